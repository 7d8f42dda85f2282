// Torch side of the CUDA fused attention, shared by both builds of the kernels:
// nvcc (ops_cuda.cu: CUDA tensors, the CUDA dispatch key of attnres::) and the
// SIMT harness (csrc/simt/emulated_ops.cpp: CPU tensors, attnres_emu::). Argument
// checks come from ../attention.h, as on CPU. Inputs are read in place with any
// strides; outputs are contiguous.
//
// A Runtime provides (see depth_attention_ops.h)
//   void track(const char* group, const at::Tensor&);   harness traffic accounting (CUDA: no-op)
//   size_t max_shared_bytes();                          the device's opt-in shared memory per block
//   void launch(name, kernel, grid, block, shared_bytes, args...);
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Optional.h>

#include <limits>
#include <tuple>

#include "../attention.h"
#include "attention_kernels.cuh"
#include "depth_attention_ops.h"  // dtype_code

namespace attnres::cuda {

// A [B, heads, T, Dh] tensor as the kernels read it; `vector` when its rows come in
// aligned 16-byte runs of 8 elements (the 16-bit dtypes' chunked copies).
inline HeadView head_view(const at::Tensor& t) {
  bool vector = t.stride(3) == 1 && t.size(3) % 8 == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) vector = vector && (t.stride(d) % 8 == 0 || t.size(d) == 1);
  return HeadView{t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3), vector};
}

// The fields of AttnParams every attention kernel reads; the launchers add the plan.
inline AttnParams attn_params(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const c10::optional<at::Tensor>& key_padding_mask) {
  // The grid is (tiles, heads, batch): CUDA's y and z dimensions stop at 65535.
  TORCH_CHECK(p.batch <= 65535 && p.heads <= 65535,
              "attention (cuda): at most 65535 batches and heads, got B = ", p.batch, ", H = ", p.heads);
  AttnParams a{};
  a.q = head_view(q);
  a.k = head_view(k);
  a.v = head_view(v);
  if (key_padding_mask.has_value()) {
    a.mask = reinterpret_cast<const uint8_t*>(key_padding_mask->const_data_ptr());
    a.mask_stride_b = key_padding_mask->stride(0);
    a.mask_stride_t = key_padding_mask->stride(1);
  }
  a.heads = p.heads;
  a.group = p.group;
  a.tq = p.tq;
  a.tk = p.tk;
  a.dh = p.dh;
  a.offset = p.offset;
  a.causal = p.causal;
  a.scale = p.scale;
  return a;
}

template <typename Runtime>
void track_inputs(Runtime& rt, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& key_padding_mask) {
  rt.track("q", q);
  rt.track("k", k);
  rt.track("v", v);
  if (key_padding_mask.has_value()) rt.track("key_padding_mask", *key_padding_mask);
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor> attn_fwd(Runtime& rt, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const c10::optional<at::Tensor>& key_padding_mask, bool causal,
                                            double scale) {
  const AttentionProblem p = check_attention_problem(q, k, v, key_padding_mask, causal, scale);
  const auto acc = accumulation_type(q.scalar_type());
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({p.batch, p.heads, p.tq}, q.options().dtype(acc));
  if (out.numel() == 0) return {out, lse};
  AttnParams a = attn_params(p, q, k, v, key_padding_mask);
  a.out = out.mutable_data_ptr();
  a.lse = lse.mutable_data_ptr();
  track_inputs(rt, q, k, v, key_padding_mask);
  rt.track("out", out);
  rt.track("lse", lse);
  launch_attn_fwd(rt, dtype_code(q.scalar_type()), p.batch, a);
  return {out, lse};
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(Runtime& rt, const at::Tensor& grad_out,
                                                        const c10::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const c10::optional<at::Tensor>& key_padding_mask,
                                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                        double scale) {
  const AttentionProblem p = check_attention_problem(q, k, v, key_padding_mask, causal, scale);
  const at::Tensor dlse = check_attention_backward(p, grad_out, grad_lse, q, out, lse);
  const auto acc = accumulation_type(q.scalar_type());
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  if (grad_q.numel() == 0) {  // no query: nothing flows back to k and v
    grad_k.zero_();
    grad_v.zero_();
    return {grad_q, grad_k, grad_v};
  }
  const at::Tensor saved_lse = lse.contiguous();
  at::Tensor delta = at::empty({p.batch, p.heads, p.tq}, q.options().dtype(acc));
  at::Tensor lse_log2 = at::empty_like(delta);
  AttnParams a = attn_params(p, q, k, v, key_padding_mask);
  a.grad_out = head_view(grad_out);
  a.saved_out = head_view(out);
  a.saved_lse = saved_lse.const_data_ptr();
  a.grad_lse = dlse.defined() ? dlse.const_data_ptr() : nullptr;
  a.delta = delta.mutable_data_ptr();
  a.lse_log2 = lse_log2.mutable_data_ptr();
  a.grad_q = grad_q.mutable_data_ptr();
  a.grad_k = grad_k.mutable_data_ptr();
  a.grad_v = grad_v.mutable_data_ptr();
  track_inputs(rt, q, k, v, key_padding_mask);
  for (const auto& [name, t] : std::initializer_list<std::pair<const char*, const at::Tensor*>>{{"grad_out", &grad_out},
                                                                                                {"out", &out},
                                                                                                {"lse", &saved_lse},
                                                                                                {"grad_lse", &dlse},
                                                                                                {"delta", &delta},
                                                                                                {"lse_log2", &lse_log2},
                                                                                                {"grad_q", &grad_q},
                                                                                                {"grad_k", &grad_k},
                                                                                                {"grad_v", &grad_v}}) {
    rt.track(name, *t);
  }
  launch_attn_bwd(rt, dtype_code(q.scalar_type()), p.batch, a);
  return {grad_q, grad_k, grad_v};
}

}  // namespace attnres::cuda
