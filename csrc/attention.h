// Shared argument handling of the fused attention ops (DESIGN.md §2.4) for
// every native backend (csrc/cpu/attention_cpu.cpp, csrc/cuda/attention_ops.h):
// the checks of attn_fwd / attn_bwd and the problem sizes they derive. The math
// lives in the backend files.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "depth_attention.h"  // is_supported_dtype, accumulation_type

namespace attnres {

// Widest head the fused kernels hold (every backend keeps [tile, Dh] blocks of q, k, v).
constexpr int64_t kAttentionMaxHeadDim = 256;

// q [B, H, Tq, Dh], k/v [B, Hkv, Tk, Dh], H = group · Hkv.
struct AttentionProblem {
  int64_t batch, heads, kv_heads, group, tq, tk, dh;
  int64_t offset;  // Tk - Tq: query i sees keys j <= i + offset under the causal mask
  bool causal;
  double scale;

  // Number of keys [0, n) that query row i may see (before key padding).
  int64_t key_end(int64_t i) const { return causal ? std::clamp<int64_t>(i + offset + 1, 0, tk) : tk; }
  // First query row that may see key j.
  int64_t query_begin(int64_t j) const { return causal ? std::clamp<int64_t>(j - offset, 0, tq) : 0; }
};

inline AttentionProblem check_attention_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const c10::optional<at::Tensor>& key_padding_mask, bool causal,
                                                double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: q, k, v must be 4-D [B, heads, T, Dh], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(is_supported_dtype(q.scalar_type()), "attention: unsupported dtype ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "attention: q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), "attention: q, k, v on different devices");
  TORCH_CHECK(k.sizes() == v.sizes(), "attention: k and v must have one shape, got ", k.sizes(), ", ", v.sizes());
  AttentionProblem p;
  p.batch = q.size(0);
  p.heads = q.size(1);
  p.tq = q.size(2);
  p.dh = q.size(3);
  p.kv_heads = k.size(1);
  p.tk = k.size(2);
  TORCH_CHECK(k.size(0) == p.batch && k.size(3) == p.dh, "attention: k/v ", k.sizes(), " do not match q ", q.sizes(),
              " in batch size or head size");
  TORCH_CHECK(p.dh > 0 && p.dh <= kAttentionMaxHeadDim, "attention: head size must be in [1, ", kAttentionMaxHeadDim,
              "], got ", p.dh);
  TORCH_CHECK(p.kv_heads > 0 && p.heads % p.kv_heads == 0, "attention: query heads H = ", p.heads,
              " must be a multiple of key/value heads Hkv = ", p.kv_heads);
  if (key_padding_mask.has_value()) {
    const at::Tensor& m = *key_padding_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool, "attention: key_padding_mask must be bool, got ", m.scalar_type());
    TORCH_CHECK(m.dim() == 2 && m.size(0) == p.batch && m.size(1) == p.tk,
                "attention: key_padding_mask must be [B, Tk] = [", p.batch, ", ", p.tk, "], got ", m.sizes());
    TORCH_CHECK(m.device() == q.device(), "attention: key_padding_mask is on another device");
  }
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "attention: scale must be positive and finite, got ", scale);
  p.group = p.heads / p.kv_heads;
  p.offset = p.tk - p.tq;
  p.causal = causal;
  p.scale = scale;
  return p;
}

// The further inputs of attn_bwd: grad_out and out like q, lse [B, H, Tq] in the
// accumulation dtype, grad_lse (optional) a floating [B, H, Tq] tensor. Returns
// grad_lse converted to the accumulation dtype and made contiguous (undefined
// when absent).
inline at::Tensor check_attention_backward(const AttentionProblem& p, const at::Tensor& grad_out,
                                           const c10::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                           const at::Tensor& out, const at::Tensor& lse) {
  const auto acc = accumulation_type(q.scalar_type());
  for (const auto* t : {&grad_out, &out}) {
    TORCH_CHECK(t->sizes() == q.sizes() && t->scalar_type() == q.scalar_type(),
                "attn_bwd: grad_out and out must be like q: ", q.sizes(), " ", q.scalar_type(), ", got ", t->sizes(),
                " ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), "attn_bwd: grad_out and out must be on q's device");
  }
  const std::vector<int64_t> row_shape = {p.batch, p.heads, p.tq};
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(row_shape) && lse.scalar_type() == acc, "attn_bwd: lse must be ",
              at::IntArrayRef(row_shape), " ", acc, ", got ", lse.sizes(), " ", lse.scalar_type());
  TORCH_CHECK(lse.device() == q.device(), "attn_bwd: lse must be on q's device");
  if (!grad_lse.has_value()) return at::Tensor();
  TORCH_CHECK(grad_lse->sizes() == at::IntArrayRef(row_shape) && at::isFloatingType(grad_lse->scalar_type()),
              "attn_bwd: grad_lse must be a floating ", at::IntArrayRef(row_shape), " tensor, got ", grad_lse->sizes(),
              " ", grad_lse->scalar_type());
  TORCH_CHECK(grad_lse->device() == q.device(), "attn_bwd: grad_lse must be on q's device");
  return grad_lse->to(acc).contiguous();
}

}  // namespace attnres
