// Torch side of the CUDA depth read, shared by both builds of the kernels: nvcc
// (ops_cuda.cu: CUDA tensors, the CUDA dispatch key of attnres::) and
// the SIMT harness (csrc/simt/emulated_ops.cpp: CPU tensors, attnres_emu::).
// Argument checks and output shapes come from ../depth_attention.h, as on CPU.
//
// Per call the host allocates the outputs (and, in the backward, one workspace
// of per-chunk partial sums) and launches: no host-side arithmetic on the site
// parameters (the kernels stage u = scale · query ⊙ norm_weight themselves and
// write the parameters' gradients), no table to copy (the sources travel in the
// kernel parameters), no synchronisation, and every allocation's size follows
// from the shapes alone, so a call can be captured in a CUDA graph.
//
// A Runtime provides
//   int num_sms();                                               the forward grid bound
//   void track(const char* group, const at::Tensor&);            harness traffic accounting (CUDA: no-op;
//                                                                undefined tensors are skipped)
//   void track(const char* group, const void*, size_t bytes);    the same for a piece of a buffer
//   void launch(name, kernel, grid, block, shared_bytes, args...);
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <initializer_list>
#include <limits>
#include <tuple>
#include <utility>
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

// A per-site parameter ([W] shared by the sites, or [Q, W]) as the kernels read it, in
// place; a converted copy only for a dtype the kernels do not read (fp8) or a strided last dim.
struct SiteOperand {
  at::Tensor tensor;  // undefined when absent
  SiteVector view{nullptr, 0, 0};
};

inline SiteOperand site_operand(const c10::optional<at::Tensor>& param, at::ScalarType acc) {
  if (!param.has_value()) return {};
  at::Tensor t = *param;
  if (!is_supported_dtype(t.scalar_type())) t = t.to(acc);
  if (t.size(-1) > 1 && t.stride(-1) != 1) t = t.contiguous();
  return {t, SiteVector{t.const_data_ptr(), t.dim() == 2 ? t.stride(0) : 0, dtype_code(t.scalar_type())}};
}

// The gradient of a site parameter, written by site_grads_kernel in the parameter's shape
// and dtype (in the accumulation dtype, converted after the launch, for a dtype the
// kernels do not write).
struct SiteGrad {
  at::Tensor tensor;  // undefined when the parameter is absent
  SiteVector view{nullptr, 0, 0};

  // The gradient as the op returns it: an empty tensor of `absent` options for an absent parameter.
  at::Tensor result(const c10::optional<at::Tensor>& param, const at::TensorOptions& absent) const {
    if (!param.has_value()) return at::empty({0}, absent);
    return tensor.scalar_type() == param->scalar_type() ? tensor : tensor.to(param->scalar_type());
  }
};

inline SiteGrad site_grad(const c10::optional<at::Tensor>& param, at::ScalarType acc) {
  if (!param.has_value()) return {};
  const at::ScalarType dtype = is_supported_dtype(param->scalar_type()) ? param->scalar_type() : acc;
  at::Tensor t = at::empty(param->sizes(), param->options().dtype(dtype));
  return {t, SiteVector{t.const_data_ptr(), t.dim() == 2 ? t.size(1) : 0, dtype_code(dtype)}};
}

// A plan, or the kernels' limit as a TORCH_CHECK error.
inline DepthPlan plan_or_raise(Pass pass, int64_t M, int64_t D, int64_t Q, int min_itemsize, bool acc_double,
                               bool has_out_norm, bool weighted_values, int num_sms) {
  try {
    return plan_depth_attn(pass, M, D, Q, min_itemsize, acc_double, has_out_norm, weighted_values, num_sms);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "depth attention (cuda): ", e.what());
  }
}

inline int narrowest_itemsize(const SourceRows& in, const at::Tensor& h_a) {
  int64_t size = h_a.defined() ? h_a.element_size() : 8;
  for (const auto& r : in.rows) size = std::min<int64_t>(size, r.element_size());
  return static_cast<int>(size);
}

// The sources as the kernels read them: the rows of each (a contiguous copy only for rows more than
// 2^31 elements apart) and their table, which travels in the kernel parameters.
struct Sources {
  std::vector<at::Tensor> rows;
  SourceTable table{};
};

inline Sources source_table(const SourceRows& in) {
  const int64_t n = static_cast<int64_t>(in.rows.size());
  TORCH_CHECK_VALUE(n <= kMaxSources, "depth attention (cuda): the CUDA kernels read at most ", kMaxSources,
                    " sources per call, got N = ", n);
  Sources s;
  s.rows.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& r = in.rows[i];
    s.rows.push_back(r.stride(0) > std::numeric_limits<int32_t>::max() ? r.contiguous() : r);
    s.table.ref[i] =
        SourceRef{s.rows[i].const_data_ptr(), static_cast<int32_t>(s.rows[i].stride(0)), dtype_code(r.scalar_type())};
  }
  return s;
}

// The per-chunk partial sums of the backward in one allocation: du [chunks, Q, R], then
// dg [chunks, Q, D] (output norm) and dγ_values [chunks, Q, D] (normalised values with a
// key-norm weight), each starting 16-byte aligned. Pointers into it, no view per part.
struct Partials {
  at::Tensor space;
  int64_t du_elems = 0, row_elems = 0;      // elements of du, and of dg or dγ_values
  int64_t dg_offset = -1, dvw_offset = -1;  // in elements; -1: absent

  template <typename acc_t>
  acc_t* part(int64_t offset) const {
    return offset < 0 ? nullptr : const_cast<acc_t*>(space.const_data_ptr<acc_t>()) + offset;
  }
  template <typename Runtime>
  void track(Runtime& rt) const {
    if (space.numel() == 0) return;
    const char* base = static_cast<const char*>(space.const_data_ptr());
    const size_t size = space.element_size();
    rt.track("du_part", base, du_elems * size);
    if (dg_offset >= 0) rt.track("dg_part", base + dg_offset * size, row_elems * size);
    if (dvw_offset >= 0) rt.track("dvw_part", base + dvw_offset * size, row_elems * size);
  }
};

inline Partials partial_sums(int64_t chunks, int64_t Q, int64_t R, int64_t D, bool has_out_norm, bool weighted_values,
                             const at::TensorOptions& acc_options) {
  const int64_t align = 16 / static_cast<int64_t>(c10::elementSize(acc_options.dtype().toScalarType()));
  auto padded = [&](int64_t n) { return ceil_div(n, align) * align; };
  Partials p;
  p.du_elems = chunks * Q * R;
  p.row_elems = chunks * Q * D;
  int64_t total = padded(p.du_elems);
  if (has_out_norm) {
    p.dg_offset = total;
    total += padded(p.row_elems);
  }
  if (weighted_values) {
    p.dvw_offset = total;
    total += p.row_elems;
  }
  p.space = at::empty({total}, acc_options);
  return p;
}

template <typename acc_t>
const acc_t* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<acc_t>() : nullptr;
}

template <typename Runtime>
void track_all(Runtime& rt, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) rt.track(name, *t);
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd(
    Runtime& rt, at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const ReadOptions& options) {
  const CheckedRead read = check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, options,
                                      /*form_site_params=*/false);
  const SourceRows& in = read.in;
  const at::Tensor &h_a = read.h_a, &lse_a = read.lse_a;
  const int64_t N = static_cast<int64_t>(in.rows.size()), M = in.num_rows, D = in.dim, Q = read.site.num_sites;
  const Sources src = source_table(in);
  const auto opts = in.rows[0].options();
  const auto acc = in.acc_dtype;
  std::vector<int64_t> qn = read.site.q_dims;
  qn.push_back(N);
  at::Tensor out = at::empty(shape_with(read.site.q_dims, in.lead_shape, {D}), opts.dtype(in.out_dtype));
  at::Tensor lse = at::empty(shape_with(read.site.q_dims, in.lead_shape), opts.dtype(acc));
  at::Tensor logits = at::empty(shape_with(qn, in.lead_shape), opts.dtype(acc));
  at::Tensor rinv = at::empty(shape_with({N}, in.lead_shape), opts.dtype(acc));
  if (M == 0) return {out, lse, logits, rinv};

  const bool weighted_values = options.normalize_values && norm_weight.has_value();
  const DepthPlan plan = plan_or_raise(Pass::kForward, M, D, Q, narrowest_itemsize(in, h_a), acc == at::kDouble,
                                       out_norm_weight.has_value(), weighted_values, rt.num_sms());
  // A read whose backward the kernels cannot run is refused here, not after its forward.
  plan_or_raise(Pass::kBackward, M, D, Q, narrowest_itemsize(in, h_a), acc == at::kDouble, out_norm_weight.has_value(),
                weighted_values, rt.num_sms());
  const SiteOperand w = site_operand(query, acc), gamma = site_operand(norm_weight, acc),
                    g = site_operand(out_norm_weight, acc);
  bool vec = D % plan.group == 0 && rows_aligned(out, D) && (!h_a.defined() || rows_aligned(h_a, D));
  for (const at::Tensor& r : src.rows) {
    vec = vec && rows_aligned(r, r.stride(0));
    rt.track("sources", r);
  }
  track_all(rt, {{"query", &w.tensor},
                 {"norm_weight", &gamma.tensor},
                 {"out_norm_weight", &g.tensor},
                 {"prefix_out", &h_a},
                 {"prefix_lse", &lse_a},
                 {"out", &out},
                 {"lse", &lse},
                 {"logits", &logits},
                 {"rinv", &rinv}});
  AT_DISPATCH_FLOATING_TYPES(acc, "depth_attn_fwd_cuda", [&] {
    using acc_t = scalar_t;
    FwdParams<acc_t> p{};
    p.sources = src.table;
    p.num_sources = static_cast<int32_t>(N);
    p.num_sites = static_cast<int32_t>(Q);
    p.rows = M;
    p.dim = D;
    p.key_start = static_cast<int32_t>(D - read.key_dim());
    p.query = w.view;
    p.norm_weight = gamma.view;
    p.out_norm_weight = g.view;
    p.prefix_out = h_a.defined() ? h_a.const_data_ptr() : nullptr;
    p.prefix_dtype = h_a.defined() ? dtype_code(h_a.scalar_type()) : 0;
    p.prefix_lse = data_or_null<acc_t>(lse_a);
    p.out = out.mutable_data_ptr();
    p.out_dtype = dtype_code(out.scalar_type());
    p.lse = lse.mutable_data_ptr<acc_t>();
    p.logits = logits.mutable_data_ptr<acc_t>();
    p.rinv = rinv.mutable_data_ptr<acc_t>();
    p.scale = static_cast<acc_t>(options.scale);
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
  const CheckedRead read = check_read(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, options,
                                      /*form_site_params=*/false);
  const SourceRows& in = read.in;
  const at::Tensor &h_a = read.h_a, &lse_a = read.lse_a;
  const int64_t N = static_cast<int64_t>(in.rows.size()), M = in.num_rows, D = in.dim, Q = read.site.num_sites;
  const int64_t R = read.key_dim();
  const Sources src = source_table(in);
  const auto acc = in.acc_dtype;
  const SavedForBackward saved = check_saved_for_backward(read, grad_out, grad_lse, grad_logits, logits, rinv);
  const at::Tensor &dy = saved.grad_out, &saved_logits = saved.logits, &saved_rinv = saved.rinv;
  const at::Tensor &dlse = saved.grad_lse, &dlogits = saved.grad_logits;
  const bool has_norm = out_norm_weight.has_value();
  const bool weighted_values = options.normalize_values && norm_weight.has_value();

  std::vector<at::Tensor> grad_sources;
  grad_sources.reserve(N);
  for (int64_t i = 0; i < N; ++i) grad_sources.push_back(at::empty(sources[i].sizes(), sources[i].options()));
  const SiteGrad d_query = site_grad(query, acc), d_norm = site_grad(norm_weight, acc),
                 d_g = site_grad(out_norm_weight, acc);
  // The prefix's gradients (h_a and lse_a are contiguous); empty without a prefix.
  at::Tensor dh_a = h_a.defined() ? at::empty(h_a.sizes(), h_a.options()) : at::empty({0}, in.rows[0].options());
  at::Tensor dlse_a =
      h_a.defined() ? at::empty(lse_a.sizes(), lse_a.options()) : at::empty({0}, dh_a.options().dtype(acc));
  DepthPlan plan = M > 0 ? plan_or_raise(Pass::kBackward, M, D, Q, narrowest_itemsize(in, h_a), acc == at::kDouble,
                                         has_norm, weighted_values, rt.num_sms())
                         : DepthPlan{};
  if (M > 0) {
    std::vector<int> itemsizes;
    for (const at::Tensor& r : in.rows) itemsizes.push_back(static_cast<int>(r.element_size()));
    plan_source_cache(plan, acc == at::kDouble, itemsizes.data(), static_cast<int>(N));
  }
  const Partials parts =
      partial_sums(plan.num_chunks, Q, R, D, has_norm, weighted_values, in.rows[0].options().dtype(acc));
  const SiteOperand w = site_operand(query, acc), gamma = site_operand(norm_weight, acc),
                    g = site_operand(out_norm_weight, acc);
  bool vec = M > 0 && D % plan.group == 0 && rows_aligned(dy, D) &&
             (!h_a.defined() || (rows_aligned(h_a, D) && rows_aligned(dh_a, D)));
  for (int64_t i = 0; i < N; ++i) {
    const at::Tensor& r = src.rows[i];
    vec = vec && rows_aligned(r, r.stride(0)) && rows_aligned(grad_sources[i], D);
    rt.track("sources", r);
    rt.track("grad_sources", grad_sources[i]);
  }
  track_all(rt, {{"dy", &dy},
                 {"dlse", &dlse},
                 {"dlogits", &dlogits},
                 {"query", &w.tensor},
                 {"norm_weight", &gamma.tensor},
                 {"out_norm_weight", &g.tensor},
                 {"prefix_out", &h_a},
                 {"prefix_lse", &lse_a},
                 {"grad_prefix_out", &dh_a},
                 {"grad_prefix_lse", &dlse_a},
                 {"logits", &saved_logits},
                 {"rinv", &saved_rinv},
                 {"grad_query", &d_query.tensor},
                 {"grad_norm_weight", &d_norm.tensor},
                 {"grad_out_norm_weight", &d_g.tensor}});
  parts.track(rt);
  AT_DISPATCH_FLOATING_TYPES(acc, "depth_attn_bwd_cuda", [&] {
    using acc_t = scalar_t;
    BwdParams<acc_t> p{};
    p.sources = src.table;
    for (int64_t i = 0; i < N; ++i) p.grads[i] = grad_sources[i].mutable_data_ptr();
    p.num_sources = static_cast<int32_t>(N);
    p.num_sites = static_cast<int32_t>(Q);
    p.rows = M;
    p.dim = D;
    p.key_start = static_cast<int32_t>(D - R);
    p.inv_key_dim = acc_t(1) / static_cast<acc_t>(R);
    p.dy = dy.const_data_ptr();
    p.dy_dtype = dtype_code(dy.scalar_type());
    p.dlse = data_or_null<acc_t>(dlse);
    p.dlogits = data_or_null<acc_t>(dlogits);
    p.query = w.view;
    p.norm_weight = gamma.view;
    p.out_norm_weight = g.view;
    p.prefix_out = h_a.defined() ? h_a.const_data_ptr() : nullptr;
    p.prefix_dtype = h_a.defined() ? dtype_code(h_a.scalar_type()) : 0;
    p.prefix_lse = data_or_null<acc_t>(lse_a);
    p.d_prefix_out = h_a.defined() ? dh_a.mutable_data_ptr() : nullptr;
    p.d_prefix_lse = h_a.defined() ? dlse_a.mutable_data_ptr<acc_t>() : nullptr;
    p.logits = saved_logits.const_data_ptr<acc_t>();
    p.rinv = saved_rinv.const_data_ptr<acc_t>();
    p.du_part = parts.part<acc_t>(0);
    p.dg_part = parts.part<acc_t>(parts.dg_offset);
    p.dvw_part = parts.part<acc_t>(parts.dvw_offset);
    p.rows_per_chunk = plan.rows_per_chunk;
    p.num_chunks = plan.num_chunks;
    p.scale = static_cast<acc_t>(options.scale);
    p.out_eps = static_cast<acc_t>(options.out_norm_eps);
    p.normalize_values = options.normalize_values;
    p.vec = vec;
    p.part_vec = vec && p.key_start % plan.group == 0;
    p.cache_words = static_cast<int32_t>(plan.cache_words);
    SiteGradParams<acc_t> s{};
    s.du_part = p.du_part;
    s.dg_part = p.dg_part;
    s.dvw_part = p.dvw_part;
    s.num_chunks = plan.num_chunks;
    s.num_sites = static_cast<int32_t>(Q);
    s.key_dim = R;
    s.dim = D;
    s.query = w.view;
    s.norm_weight = gamma.view;
    s.scale = p.scale;
    s.d_query = d_query.view;
    s.d_norm_weight = d_norm.view;
    s.d_out_norm_weight = d_g.view;
    launch_depth_attn_bwd<acc_t>(rt, plan, p, s);
  });
  const auto absent = in.rows[0].options().dtype(acc);
  return {grad_sources, d_query.result(query, absent),      d_norm.result(norm_weight, absent), dh_a,
          dlse_a,       d_g.result(out_norm_weight, absent)};
}

}  // namespace attnres::cuda
