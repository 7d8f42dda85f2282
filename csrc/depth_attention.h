// Shared argument handling of the depth-attention ops (DESIGN.md §2.1) for
// every native backend: checks, the [M, D] row views of the sources, and the
// output shapes. The math lives in the backend files (csrc/cpu, csrc/cuda).
#pragma once

// The native sources include the ATen headers they use (core/Tensor.h, ops/<op>.h, Dispatch.h), never
// ATen/ATen.h: parsing it takes ~18 s of every translation unit's compile, a fifth of the build.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace attnres {

// The options of one depth read (DESIGN.md §2.7), mirrored field by field by the
// Python NamedTuple attnres_kernels._validation.ReadOptions:
// - eps: the key RMSNorm's epsilon; out_norm_eps: the fused output norm's;
// - scale: multiplies the logits (folded into u = scale * query ⊙ norm_weight in the
//   accumulation dtype, never into a low-precision query);
// - normalize_values: the values are the normalised sources r_i v_i (Inkling2)
//   instead of the raw v_i (paper);
// - out_dtype: the output's dtype when given (else the promotion of the sources'
//   and the prefix's dtypes);
// - key_rank: sliced low-rank keys (LR-AttnRes): the key of source i is its last R
//   coordinates, RMS-normalised over those R; query and norm_weight have R entries,
//   values and output keep the full width D. Unset is the ordinary read (check_read
//   turns R = D into unset).
// The op schemas carry the fields as trailing scalars (ATTNRES_READ_OPTIONS_SCHEMA); a
// kernel entry point takes them as ATTNRES_READ_OPTIONS_PARAMS and builds the struct with
// ATTNRES_READ_OPTIONS: a new option is one field here, in the three macros and in the
// Python NamedTuple.
struct ReadOptions {
  double eps = 1e-6;
  double out_norm_eps = 1e-6;
  double scale = 1.0;
  bool normalize_values = false;
  c10::optional<at::ScalarType> out_dtype;
  c10::optional<int64_t> key_rank;

  // The fields in schema order, for calls through the dispatcher (std::apply).
  auto as_tuple() const { return std::make_tuple(eps, out_norm_eps, scale, normalize_values, out_dtype, key_rank); }
};

#define ATTNRES_READ_OPTIONS_SCHEMA \
  "float eps, float out_norm_eps, float scale, bool normalize_values, ScalarType? out_dtype, int? key_rank"
#define ATTNRES_READ_OPTIONS_PARAMS                                                                              \
  double eps, double out_norm_eps, double scale, bool normalize_values, c10::optional<at::ScalarType> out_dtype, \
      c10::optional<int64_t> key_rank
#define ATTNRES_READ_OPTIONS (::attnres::ReadOptions{eps, out_norm_eps, scale, normalize_values, out_dtype, key_rank})
// The field types alone, for typed dispatcher handles (OperatorHandle::typed<...>).
#define ATTNRES_READ_OPTIONS_TYPES double, double, double, bool, c10::optional<at::ScalarType>, c10::optional<int64_t>

// Name of the vector instruction set the CPU kernels were compiled for.
const char* cpu_vector_isa();

// The sources of one call as [M, D] matrices whose rows are contiguous (a view
// when the layout allows, a contiguous copy only when it does not). Sources may
// differ in dtype (DESIGN.md §2.5): each is read in its own dtype, the output
// has the promoted dtype and the arithmetic runs in the accumulation dtype.
struct SourceRows {
  std::vector<at::Tensor> rows;
  int64_t num_rows = 0;  // M: product of the leading dims
  int64_t dim = 0;       // D
  at::IntArrayRef lead_shape;
  at::ScalarType out_dtype;  // promotion of the source dtypes (and of a merge prefix: see check_prefix)
  at::ScalarType acc_dtype;  // fp64 when out_dtype is fp64, else fp32

  // Whether every source has the same dtype (the kernels' fast path).
  bool uniform_dtype() const {
    for (const auto& r : rows)
      if (r.scalar_type() != rows[0].scalar_type()) return false;
    return true;
  }
};

inline at::ScalarType accumulation_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline SourceRows check_sources(const at::TensorList sources) {
  TORCH_CHECK(!sources.empty(), "depth attention: `sources` is empty (N = 0)");
  const at::Tensor& first = sources[0];
  TORCH_CHECK(first.dim() >= 1, "depth attention: sources must have shape [..., D]");
  SourceRows out;
  out.dim = first.size(-1);
  TORCH_CHECK(out.dim > 0, "depth attention: sources have D = 0");
  out.num_rows = first.numel() / out.dim;
  out.lead_shape = first.sizes().slice(0, first.dim() - 1);
  out.out_dtype = first.scalar_type();
  out.rows.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK(is_supported_dtype(s.scalar_type()), "depth attention: sources[", i, "] has unsupported dtype ",
                s.scalar_type());
    TORCH_CHECK(s.sizes() == first.sizes(), "depth attention: sources[", i, "] has shape ", s.sizes(),
                ", sources[0] has ", first.sizes());
    TORCH_CHECK(s.device() == first.device(), "depth attention: sources on different devices");
    out.out_dtype = c10::promoteTypes(out.out_dtype, s.scalar_type());
    // A [M, D] source is its own row view (no view to make per source and call).
    at::Tensor r = s.dim() == 2 ? s : s.reshape({out.num_rows, out.dim});
    if (r.stride(1) != 1) r = r.contiguous();
    out.rows.push_back(std::move(r));
  }
  out.acc_dtype = accumulation_type(out.out_dtype);
  return out;
}

// The per-site parameters of one call, in the accumulation dtype (call after
// check_prefix, which may raise it to fp64). `query` is
// [D] (one site: outputs have no site dim) or [Q, D]; `norm_weight` and
// `out_norm_weight` are [D] (shared by every site) or [Q, D]. The kernels see
// u = query ⊙ norm_weight and g = out_norm_weight as contiguous [Q, D].
struct SiteParams {
  at::Tensor u;                 // [Q, D]
  at::Tensor g;                 // [Q, D], undefined without the fused output norm
  int64_t num_sites = 1;        // Q
  std::vector<int64_t> q_dims;  // {} for a [D] query, {Q} for a [Q, D] query: the outputs' leading dims
};

inline void check_site_param(const at::Tensor& t, const char* name, int64_t q, bool site_dim, int64_t dim,
                             const at::Device& device) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "depth attention: `", name, "` must be floating point, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, "depth attention: `", name, "` is on ", t.device(), ", the sources on ", device);
  const bool shared = t.dim() == 1 && t.size(0) == dim;
  const bool per_site = site_dim && t.dim() == 2 && t.size(0) == q && t.size(1) == dim;
  TORCH_CHECK(shared || per_site, "depth attention: `", name, "` must be [D]", site_dim ? " or [Q, D]" : "",
              " with D = ", dim, site_dim ? " and Q = " + std::to_string(q) : std::string(), ", got ", t.sizes());
}

// u and g of check_site_params for CPU tensors, as plain loops: the same products in the same
// order ((query ⊙ norm_weight) · scale, each rounded to acc; bitwise the ATen ops' results), without
// the ATen calls (expand, mul, contiguous) that a small read's forward and backward each paid.
// Raw ops at one row (N=3, D=128, out norm, one thread, alternating runs): forward 11.4-11.8 ->
// 9.8-10.0 µs, backward 15.8-16.6 -> 12.8-13.2 µs per call.
inline void site_params_cpu(const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
                            const c10::optional<at::Tensor>& out_norm_weight, double scale, int64_t sites,
                            int64_t key_dim, int64_t dim, at::ScalarType acc, SiteParams& p) {
  auto fill = [&](auto zero) {
    using acc_t = decltype(zero);
    // out[s, d] = t[s, d] (or *= it), d < width, for a [width] parameter shared by the sites (site
    // stride 0) or a [Q, width] one, of any strides, read in acc (converted first when it is not).
    auto take = [&](const at::Tensor& t, int64_t width, acc_t* out, bool multiply) {
      const at::Tensor a = t.to(acc);
      const acc_t* x = a.template const_data_ptr<acc_t>();
      const int64_t site_stride = a.dim() == 2 ? a.stride(0) : 0, col_stride = a.stride(-1);
      for (int64_t s = 0; s < sites; ++s) {
        for (int64_t d = 0; d < width; ++d) {
          const acc_t v = x[s * site_stride + d * col_stride];
          out[s * width + d] = multiply ? out[s * width + d] * v : v;
        }
      }
    };
    p.u = at::empty({sites, key_dim}, query.options().dtype(acc));
    acc_t* u = p.u.template mutable_data_ptr<acc_t>();
    take(query, key_dim, u, false);
    if (norm_weight.has_value()) take(*norm_weight, key_dim, u, true);
    if (scale != 1.0) {
      const auto k = static_cast<acc_t>(scale);
      for (int64_t i = 0; i < sites * key_dim; ++i) u[i] *= k;
    }
    if (out_norm_weight.has_value()) {
      p.g = at::empty({sites, dim}, p.u.options());
      take(*out_norm_weight, dim, p.g.template mutable_data_ptr<acc_t>(), false);
    }
  };
  if (acc == at::kDouble) {
    fill(double());
  } else {
    fill(float());
  }
}

// u = scale * query ⊙ norm_weight is [Q, key_dim] (key_dim = R for sliced low-rank keys, else D);
// g = out_norm_weight is [Q, D]. `form_site_params` false: only the checks (the CUDA kernels stage u
// and g from the parameters themselves).
inline SiteParams check_site_params(const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
                                    const c10::optional<at::Tensor>& out_norm_weight, const SourceRows& src,
                                    double scale, int64_t key_dim, bool form_site_params = true) {
  const at::ScalarType acc = src.acc_dtype;
  const auto device = src.rows[0].device();
  TORCH_CHECK(query.dim() == 1 || query.dim() == 2, "depth attention: `query` must be [D] or [Q, D], got ",
              query.sizes());
  SiteParams p;
  const bool site_dim = query.dim() == 2;
  p.num_sites = site_dim ? query.size(0) : 1;
  TORCH_CHECK(p.num_sites > 0, "depth attention: `query` has Q = 0 sites");
  if (site_dim) p.q_dims = {p.num_sites};
  check_site_param(query, "query", p.num_sites, site_dim, key_dim, device);
  if (norm_weight.has_value()) check_site_param(*norm_weight, "norm_weight", p.num_sites, site_dim, key_dim, device);
  if (out_norm_weight.has_value()) {
    check_site_param(*out_norm_weight, "out_norm_weight", p.num_sites, site_dim, src.dim, device);
  }
  if (form_site_params) {
    TORCH_INTERNAL_ASSERT(device.is_cpu(), "depth attention: u and g are formed on the host for CPU kernels only");
    site_params_cpu(query, norm_weight, out_norm_weight, scale, p.num_sites, key_dim, src.dim, acc, p);
  }
  return p;
}

// Sums a [Q, D] gradient down to the shape of the parameter it belongs to
// ([D] when the parameter is shared by the Q sites) and casts it to its dtype.
inline at::Tensor reduce_to_param(const at::Tensor& grad, const at::Tensor& param) {
  at::Tensor g = param.dim() == 1 ? grad.sum(0) : grad;
  return g.to(param.scalar_type());
}

// Gradients of query, norm_weight and out_norm_weight from those of u = scale *
// query ⊙ norm_weight ([Q, D]) and of the output-norm weight g ([Q, D]); absent
// parameters get empty tensors.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> site_param_grads(const at::Tensor& du_scaled,
                                                                       const at::Tensor& dg, const at::Tensor& query,
                                                                       const c10::optional<at::Tensor>& norm_weight,
                                                                       const c10::optional<at::Tensor>& out_norm_weight,
                                                                       double scale = 1.0) {
  const at::Tensor du = scale == 1.0 ? du_scaled : du_scaled.mul(scale);
  const auto acc = du.scalar_type();
  const auto empty = at::empty({0}, du.options());
  at::Tensor d_query, d_norm;
  if (norm_weight.has_value()) {
    d_query = reduce_to_param(du.mul(norm_weight->to(acc)), query);
    d_norm = reduce_to_param(du.mul(query.to(acc)), *norm_weight);
  } else {
    d_query = reduce_to_param(du, query);
    d_norm = empty;
  }
  at::Tensor d_g = out_norm_weight.has_value() ? reduce_to_param(dg, *out_norm_weight) : empty;
  return {d_query, d_norm, d_g};
}

// An uninitialized CPU tensor whose storage comes from the cache of output
// buffers (csrc/cpu/output_cache.cpp): a buffer an earlier output freed is
// reused, already mapped, instead of a fresh allocation that page-faults.
at::Tensor cached_cpu_empty(at::IntArrayRef sizes, at::ScalarType dtype);

// Frees the cached CPU output buffers that no tensor uses (op attnres::empty_cpu_cache).
void empty_cpu_cache();
// [bytes, count] of the cached free buffers and the bytes of the cache's buffers in use
// (op attnres::cpu_cache_stats).
std::vector<int64_t> cpu_cache_stats();

// at::empty for a large output that is about to be written in full; on the CPU
// it comes from the cache of output buffers (cached_cpu_empty).
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cpu()) return cached_cpu_empty(sizes, options.dtype().toScalarType());
  return at::empty(sizes, options);
}

// Shape [leading..., *lead_shape, tail...].
inline std::vector<int64_t> shape_with(std::vector<int64_t> leading, at::IntArrayRef lead_shape,
                                       std::initializer_list<int64_t> tail = {}) {
  std::vector<int64_t> shape(std::move(leading));
  shape.insert(shape.end(), lead_shape.begin(), lead_shape.end());
  shape.insert(shape.end(), tail.begin(), tail.end());
  return shape;
}

// The leading dims of the per-site outputs: {} for a [D] query, {Q} for a [Q, D] query.
inline std::vector<int64_t> site_dims(const at::Tensor& query) {
  return query.dim() == 2 ? std::vector<int64_t>{query.size(0)} : std::vector<int64_t>{};
}

// The prefix (h_a [Q?, ..., D], lse_a [Q?, ...]; Q present when the query is [Q, D])
// of a merge, as contiguous tensors. h_a may have any supported dtype: it joins
// the promotion of the output dtype (so call this before allocating outputs);
// lse_a must be in the resulting accumulation dtype.
inline void check_prefix(const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
                         const std::vector<int64_t>& q_dims, SourceRows& src, at::Tensor& h_a, at::Tensor& lse_a) {
  TORCH_CHECK(prefix_out.has_value() == prefix_lse.has_value(),
              "depth attention: prefix_out and prefix_lse must be given together");
  if (!prefix_out.has_value()) return;
  TORCH_CHECK(prefix_out->dim() > 0, "depth attention: prefix_out must be [Q?, ..., D], got a scalar");
  TORCH_CHECK(prefix_out->sizes() == at::IntArrayRef(shape_with(q_dims, src.lead_shape, {src.dim})),
              "depth attention: prefix_out must be [Q?, ..., D] like the output, got ", prefix_out->sizes());
  TORCH_CHECK(is_supported_dtype(prefix_out->scalar_type()), "depth attention: prefix_out has unsupported dtype ",
              prefix_out->scalar_type());
  TORCH_CHECK(prefix_out->device() == src.rows[0].device(), "depth attention: prefix_out is on another device");
  src.out_dtype = c10::promoteTypes(src.out_dtype, prefix_out->scalar_type());
  src.acc_dtype = accumulation_type(c10::promoteTypes(src.acc_dtype, src.out_dtype));
  TORCH_CHECK(prefix_lse->sizes() == at::IntArrayRef(shape_with(q_dims, src.lead_shape)),
              "depth attention: prefix_lse must be [Q?, ...] like lse, got ", prefix_lse->sizes());
  TORCH_CHECK(prefix_lse->scalar_type() == src.acc_dtype, "depth attention: prefix_lse must be ", src.acc_dtype,
              " (the accumulation dtype), got ", prefix_lse->scalar_type());
  h_a = prefix_out->contiguous();
  lse_a = prefix_lse->contiguous();
}

// One checked read: the sources' rows, the merge prefix (h_a, lse_a; undefined
// without one), the site parameters, and the options. With options.out_dtype the
// output has that dtype, and the accumulation dtype is fp64 when it (or the
// inputs' promotion) is fp64.
struct CheckedRead {
  SourceRows in;
  at::Tensor h_a, lse_a;
  SiteParams site;
  ReadOptions options;

  // R: the width of the keys (and of query, norm_weight and u); D unless options.key_rank is set.
  int64_t key_dim() const { return options.key_rank.value_or(in.dim); }
};

inline CheckedRead check_read(at::TensorList sources, const at::Tensor& query,
                              const c10::optional<at::Tensor>& norm_weight, const c10::optional<at::Tensor>& prefix_out,
                              const c10::optional<at::Tensor>& prefix_lse,
                              const c10::optional<at::Tensor>& out_norm_weight, const ReadOptions& options,
                              bool form_site_params = true) {
  CheckedRead r{check_sources(sources), {}, {}, {}, options};
  TORCH_CHECK(options.eps >= 0 && options.out_norm_eps >= 0, "depth attention: eps and out_norm_eps must be >= 0");
  TORCH_CHECK(std::isfinite(options.scale), "depth attention: `scale` must be finite, got ", options.scale);
  if (options.out_dtype.has_value()) {
    TORCH_CHECK(is_supported_dtype(*options.out_dtype), "depth attention: unsupported out_dtype ", *options.out_dtype);
    r.in.acc_dtype = accumulation_type(c10::promoteTypes(r.in.out_dtype, *options.out_dtype));
  }
  check_prefix(prefix_out, prefix_lse, site_dims(query), r.in, r.h_a, r.lse_a);
  if (options.out_dtype.has_value()) r.in.out_dtype = *options.out_dtype;
  if (options.key_rank.has_value()) {
    const int64_t rank = *options.key_rank;
    TORCH_CHECK(rank >= 1 && rank <= r.in.dim, "depth attention: `key_rank` must be in [1, D] with D = ", r.in.dim,
                ", got ", rank);
    if (rank == r.in.dim) r.options.key_rank = c10::nullopt;  // the ordinary read
    TORCH_CHECK(!(r.options.key_rank.has_value() && options.normalize_values),
                "depth attention: `normalize_values` needs full-width keys (key_rank unset or D)");
  }
  r.site = check_site_params(query, norm_weight, out_norm_weight, r.in, options.scale, r.key_dim(), form_site_params);
  return r;
}

// The tensors depth_attn_bwd takes besides the read's own, checked against the read (shape, dtype and
// the sources' device) and made contiguous: the output gradient, the forward's saved logits and
// key-norm scales, and the optional gradients of lse and logits (undefined when absent).
struct SavedForBackward {
  at::Tensor grad_out, logits, rinv, grad_lse, grad_logits;
};

inline SavedForBackward check_saved_for_backward(const CheckedRead& read, const at::Tensor& grad_out,
                                                 const c10::optional<at::Tensor>& grad_lse,
                                                 const c10::optional<at::Tensor>& grad_logits, const at::Tensor& logits,
                                                 const at::Tensor& rinv) {
  const SourceRows& in = read.in;
  const std::vector<int64_t>& q_dims = read.site.q_dims;
  const auto acc = in.acc_dtype;
  auto check = [&](const at::Tensor& t, const char* name, const std::vector<int64_t>& shape, at::ScalarType type) {
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape) && t.scalar_type() == type, "depth_attn_bwd: `", name, "` must be ",
                at::IntArrayRef(shape), " ", type, ", got ", t.sizes(), " ", t.scalar_type());
    TORCH_CHECK(t.device() == in.rows[0].device(), "depth_attn_bwd: `", name, "` is on another device");
    return t.contiguous();
  };
  std::vector<int64_t> q_n = q_dims;
  q_n.push_back(static_cast<int64_t>(in.rows.size()));
  SavedForBackward saved;
  saved.grad_out = check(grad_out, "grad_out", shape_with(q_dims, in.lead_shape, {in.dim}), in.out_dtype);
  saved.logits = check(logits, "logits", shape_with(q_n, in.lead_shape), acc);
  saved.rinv = check(rinv, "rinv", shape_with({q_n.back()}, in.lead_shape), acc);
  if (grad_lse.has_value()) saved.grad_lse = check(*grad_lse, "grad_lse", shape_with(q_dims, in.lead_shape), acc);
  if (grad_logits.has_value())
    saved.grad_logits = check(*grad_logits, "grad_logits", shape_with(q_n, in.lead_shape), acc);
  return saved;
}

}  // namespace attnres
