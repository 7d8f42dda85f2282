// Torch side of the CUDA depth read, shared by both builds of the kernels: nvcc
// (ops_cuda.cu: CUDA tensors, the CUDA dispatch key of attnres::) and
// the SIMT harness (csrc/simt/emulated_ops.cpp: CPU tensors, attnres_emu::).
// Argument checks and output shapes come from ../depth_attention.h, as on CPU.
//
// A Runtime provides
//   int num_sms();                                               the forward grid bound
//   at::Tensor device_table(const std::vector<RowRef>&, const at::Device&);  the table in device memory
//   void track(const char* group, const at::Tensor&);            harness traffic accounting (CUDA: no-op;
//                                                                undefined tensors are skipped)
//   void launch(name, kernel, grid, block, shared_bytes, args...);
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Optional.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "../depth_attention.h"
#include "depth_attention_kernels.cuh"

namespace attnres::cuda {

inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kFloat32;
    case at::kDouble:
      return kFloat64;
    case at::kHalf:
      return kFloat16;
    case at::kBFloat16:
      return kBFloat16;
    default:
      TORCH_CHECK(false, "depth attention (cuda): unsupported dtype ", t);
  }
}

// Whether every row of `t` (rows `row_stride` elements apart) starts 16-byte aligned.
inline bool rows_aligned(const at::Tensor& t, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && (row_stride * t.element_size()) % 16 == 0;
}

// Bytes from the first to one past the last element of `t`.
inline size_t span_bytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return static_cast<size_t>((last + 1) * t.element_size());
}

inline RowRef row_ref(const at::Tensor& rows) {
  return RowRef{rows.const_data_ptr(), rows.stride(0), dtype_code(rows.scalar_type())};
}

// A plan, or the kernels' limit as a TORCH_CHECK error.
inline DepthPlan plan_or_raise(Pass pass, int64_t M, int64_t D, int64_t Q, int min_itemsize, bool acc_double,
                               bool has_out_norm, int num_sms) {
  try {
    return plan_depth_attn(pass, M, D, Q, min_itemsize, acc_double, has_out_norm, num_sms);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "depth attention (cuda): ", e.what());
  }
}

inline int narrowest_itemsize(const SourceRows& in, const at::Tensor& h_a) {
  int64_t size = h_a.defined() ? h_a.element_size() : 8;
  for (const auto& r : in.rows) size = std::min<int64_t>(size, r.element_size());
  return static_cast<int>(size);
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd(
    Runtime& rt, at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const ReadOptions& options) {
  const CheckedRead read = check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, options);
  const SourceRows& in = read.in;
  const at::Tensor &h_a = read.h_a, &lse_a = read.lse_a;
  const SiteParams& site = read.site;
  TORCH_CHECK(!options.normalize_values || !norm_weight.has_value(),
              "depth attention (cuda): normalised values are implemented without a key-norm weight only");
  TORCH_CHECK(!read.options.key_rank.has_value(),
              "depth attention (cuda): sliced low-rank keys (key_rank < D) have no CUDA kernel yet");
  const int64_t N = static_cast<int64_t>(in.rows.size()), M = in.num_rows, D = in.dim, Q = site.num_sites;
  const auto opts = in.rows[0].options();
  const auto acc = in.acc_dtype;
  std::vector<int64_t> qn = site.q_dims;
  qn.push_back(N);
  at::Tensor out = at::empty(shape_with(site.q_dims, in.lead_shape, {D}), opts.dtype(in.out_dtype));
  at::Tensor lse = at::empty(shape_with(site.q_dims, in.lead_shape), opts.dtype(acc));
  at::Tensor logits = at::empty(shape_with(qn, in.lead_shape), opts.dtype(acc));
  at::Tensor rinv = at::empty(shape_with({N}, in.lead_shape), opts.dtype(acc));
  if (M == 0) return {out, lse, logits, rinv};

  const bool acc_double = acc == at::kDouble;
  const DepthPlan plan =
      plan_or_raise(Pass::kForward, M, D, Q, narrowest_itemsize(in, h_a), acc_double, site.g.defined(), rt.num_sms());
  std::vector<RowRef> refs;
  bool vec = D % plan.group == 0 && rows_aligned(out, D) && (!h_a.defined() || rows_aligned(h_a, D));
  for (const auto& r : in.rows) {
    refs.push_back(row_ref(r));
    vec = vec && rows_aligned(r, r.stride(0));
    rt.track("sources", r);
  }
  const at::Tensor table = rt.device_table(refs, out.device());
  for (const auto& [name, t] : std::initializer_list<std::pair<const char*, const at::Tensor*>>{{"table", &table},
                                                                                                {"u", &site.u},
                                                                                                {"g", &site.g},
                                                                                                {"prefix_out", &h_a},
                                                                                                {"prefix_lse", &lse_a},
                                                                                                {"out", &out},
                                                                                                {"lse", &lse},
                                                                                                {"logits", &logits},
                                                                                                {"rinv", &rinv}}) {
    rt.track(name, *t);
  }
  AT_DISPATCH_FLOATING_TYPES(acc, "depth_attn_fwd_cuda", [&] {
    using acc_t = scalar_t;
    FwdParams<acc_t> p{};
    p.sources = reinterpret_cast<const RowRef*>(table.const_data_ptr());
    p.num_sources = static_cast<int32_t>(N);
    p.num_sites = static_cast<int32_t>(Q);
    p.rows = M;
    p.dim = D;
    p.u = site.u.const_data_ptr<acc_t>();
    p.g = site.g.defined() ? site.g.const_data_ptr<acc_t>() : nullptr;
    p.prefix_out = h_a.defined() ? h_a.const_data_ptr() : nullptr;
    p.prefix_dtype = h_a.defined() ? dtype_code(h_a.scalar_type()) : 0;
    p.prefix_lse = h_a.defined() ? lse_a.const_data_ptr<acc_t>() : nullptr;
    p.out = out.mutable_data_ptr();
    p.out_dtype = dtype_code(out.scalar_type());
    p.lse = lse.mutable_data_ptr<acc_t>();
    p.logits = logits.mutable_data_ptr<acc_t>();
    p.rinv = rinv.mutable_data_ptr<acc_t>();
    p.eps = static_cast<acc_t>(options.eps);
    p.out_eps = static_cast<acc_t>(options.out_norm_eps);
    p.normalize_values = options.normalize_values;
    p.vec = vec;
    launch_depth_attn_fwd<acc_t>(rt, plan, p);
  });
  return {out, lse, logits, rinv};
}

template <typename Runtime>
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_bwd(
    Runtime& rt, const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse,
    const c10::optional<at::Tensor>& grad_logits, at::TensorList sources, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const c10::optional<at::Tensor>& prefix_out,
    const c10::optional<at::Tensor>& prefix_lse, const c10::optional<at::Tensor>& out_norm_weight,
    const at::Tensor& logits, const at::Tensor& rinv, const ReadOptions& options) {
  const CheckedRead read = check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, options);
  const SourceRows& in = read.in;
  const at::Tensor &h_a = read.h_a, &lse_a = read.lse_a;
  const SiteParams& site = read.site;
  TORCH_CHECK(!options.normalize_values || !norm_weight.has_value(),
              "depth attention (cuda): normalised values are implemented without a key-norm weight only");
  TORCH_CHECK(!read.options.key_rank.has_value(),
              "depth attention (cuda): sliced low-rank keys (key_rank < D) have no CUDA kernel yet");
  const int64_t N = static_cast<int64_t>(in.rows.size()), M = in.num_rows, D = in.dim, Q = site.num_sites;
  const auto acc = in.acc_dtype;
  const SavedForBackward saved = check_saved_for_backward(read, grad_out, grad_lse, grad_logits, logits, rinv);
  const at::Tensor &dy = saved.grad_out, &saved_logits = saved.logits, &saved_rinv = saved.rinv;
  const at::Tensor &dlse = saved.grad_lse, &dlogits = saved.grad_logits;

  std::vector<at::Tensor> grad_sources;
  grad_sources.reserve(N);
  for (int64_t i = 0; i < N; ++i) grad_sources.push_back(at::empty(sources[i].sizes(), sources[i].options()));
  at::Tensor du = at::empty({Q, D}, site.u.options());
  at::Tensor dg = site.g.defined() ? at::empty({Q, D}, site.u.options()) : at::Tensor();
  at::Tensor dh_a = h_a.defined() ? at::empty_like(h_a) : at::empty({0}, in.rows[0].options());
  at::Tensor dlse_a = h_a.defined() ? at::empty_like(lse_a) : at::empty({0}, site.u.options());
  if (M == 0) {
    du.zero_();
    if (dg.defined()) dg.zero_();
  } else {
    const bool acc_double = acc == at::kDouble;
    const DepthPlan plan = plan_or_raise(Pass::kBackward, M, D, Q, narrowest_itemsize(in, h_a), acc_double,
                                         site.g.defined(), rt.num_sms());
    at::Tensor du_part = at::empty({plan.num_chunks, Q, D}, site.u.options());
    at::Tensor dg_part = site.g.defined() ? at::empty({plan.num_chunks, Q, D}, site.u.options()) : at::Tensor();
    std::vector<RowRef> refs, grad_refs;
    bool vec = D % plan.group == 0 && rows_aligned(dy, D) && rows_aligned(du_part, D) &&
               (!h_a.defined() || (rows_aligned(h_a, D) && rows_aligned(dh_a, D))) &&
               (!dg_part.defined() || rows_aligned(dg_part, D));
    for (int64_t i = 0; i < N; ++i) {
      const at::Tensor& r = in.rows[i];
      refs.push_back(row_ref(r));
      grad_refs.push_back(RowRef{grad_sources[i].const_data_ptr(), D, dtype_code(grad_sources[i].scalar_type())});
      vec = vec && rows_aligned(r, r.stride(0)) && rows_aligned(grad_sources[i], D);
      rt.track("sources", r);
      rt.track("grad_sources", grad_sources[i]);
    }
    const at::Tensor table = rt.device_table(refs, dy.device());
    const at::Tensor grad_table = rt.device_table(grad_refs, dy.device());
    for (const auto& [name, t] :
         std::initializer_list<std::pair<const char*, const at::Tensor*>>{{"table", &table},
                                                                          {"grad_table", &grad_table},
                                                                          {"dy", &dy},
                                                                          {"dlse", &dlse},
                                                                          {"dlogits", &dlogits},
                                                                          {"u", &site.u},
                                                                          {"g", &site.g},
                                                                          {"prefix_out", &h_a},
                                                                          {"prefix_lse", &lse_a},
                                                                          {"grad_prefix_out", &dh_a},
                                                                          {"grad_prefix_lse", &dlse_a},
                                                                          {"logits", &saved_logits},
                                                                          {"rinv", &saved_rinv},
                                                                          {"du_part", &du_part},
                                                                          {"dg_part", &dg_part},
                                                                          {"du", &du},
                                                                          {"dg", &dg}}) {
      rt.track(name, *t);
    }
    AT_DISPATCH_FLOATING_TYPES(acc, "depth_attn_bwd_cuda", [&] {
      using acc_t = scalar_t;
      BwdParams<acc_t> p{};
      p.sources = reinterpret_cast<const RowRef*>(table.const_data_ptr());
      p.grads = reinterpret_cast<const RowRef*>(grad_table.const_data_ptr());
      p.num_sources = static_cast<int32_t>(N);
      p.num_sites = static_cast<int32_t>(Q);
      p.rows = M;
      p.dim = D;
      p.dy = dy.const_data_ptr();
      p.dy_dtype = dtype_code(dy.scalar_type());
      p.dlse = dlse.defined() ? dlse.const_data_ptr<acc_t>() : nullptr;
      p.dlogits = dlogits.defined() ? dlogits.const_data_ptr<acc_t>() : nullptr;
      p.u = site.u.const_data_ptr<acc_t>();
      p.g = site.g.defined() ? site.g.const_data_ptr<acc_t>() : nullptr;
      p.prefix_out = h_a.defined() ? h_a.const_data_ptr() : nullptr;
      p.prefix_dtype = h_a.defined() ? dtype_code(h_a.scalar_type()) : 0;
      p.prefix_lse = h_a.defined() ? lse_a.const_data_ptr<acc_t>() : nullptr;
      p.d_prefix_out = h_a.defined() ? dh_a.mutable_data_ptr() : nullptr;
      p.d_prefix_lse = h_a.defined() ? dlse_a.mutable_data_ptr<acc_t>() : nullptr;
      p.logits = saved_logits.const_data_ptr<acc_t>();
      p.rinv = saved_rinv.const_data_ptr<acc_t>();
      p.du_part = du_part.mutable_data_ptr<acc_t>();
      p.dg_part = dg_part.defined() ? dg_part.mutable_data_ptr<acc_t>() : nullptr;
      p.rows_per_chunk = plan.rows_per_chunk;
      p.num_chunks = plan.num_chunks;
      p.out_eps = static_cast<acc_t>(options.out_norm_eps);
      p.normalize_values = options.normalize_values;
      p.vec = vec;
      launch_depth_attn_bwd<acc_t>(rt, plan, p, du.mutable_data_ptr<acc_t>(),
                                   dg.defined() ? dg.mutable_data_ptr<acc_t>() : nullptr);
    });
  }
  auto [d_query, d_norm, d_g] = site_param_grads(du, dg, query, norm_weight, out_norm_weight, options.scale);
  return {grad_sources, d_query, d_norm, dh_a, dlse_a, d_g};
}

}  // namespace attnres::cuda
