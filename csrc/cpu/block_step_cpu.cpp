// CPU kernels of the fused residual step of two-phase Block AttnRes (DESIGN.md
// §2.3, phase 2): `new_partial = partial + update`, then the next site's read
// as the merge of its phase-1 read (h_a, lse_a) over the committed blocks with
// the one source new_partial, then optionally the sublayer's PreNorm
// `rmsnorm(h) * g`. Per row, with u = query ⊙ norm_weight:
//
//   v = new_partial;  r = rsqrt(mean(v²) + eps);  s = r <u, v>
//   m = max(lse_a, s);  e_a = exp(lse_a - m);  e_b = exp(s - m);  α_a, α_b = e_a, e_b / (e_a + e_b)
//   h = α_a h_a + α_b v;  lse = m + log(e_a + e_b);  out = h  or  h * rsqrt(mean(h²) + eps) * g
//
// Each row is read and written once per direction: the forward reads partial,
// update and h_a and writes new_partial and out (+ lse, s, r: one scalar each);
// the backward reads new_partial, h_a, grad_out and the incoming grad of
// new_partial, and writes the total grad of new_partial and grad h_a.
//
// Mixed dtypes (DESIGN.md §2.5): every [M, D] tensor is read and written in
// its own dtype, converted row by row to the accumulation type (float, or
// double when out is double), so only two instantiations exist (float and
// double accumulation) whatever the combination of input dtypes.
//
// new_partial is rounded to its dtype before the read uses it, so the read
// sees exactly the tensor it returns (and the backward recomputes from).
//
// Determinism: per-row results depend on that row only; the gradients of u and
// g (sums over rows) are written as one double partial per fixed chunk of rows
// (the chunking depends on M only, never on the thread count) and the chunk
// partials are then summed in chunk order.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../block_step.h"
#include "../depth_attention.h"
#include "row_math.h"

namespace attnres {
namespace {

using at::vec::Vectorized;

// ---------------------------------------------------------------- rows in their own dtype

// An [M, D] tensor with unit column stride, addressed row by row; its dtype is a
// runtime value (the conversion is chosen once per row, not per element).
struct RowView {
  char* base = nullptr;
  int64_t row_bytes = 0;
  at::ScalarType dtype = at::kFloat;

  bool defined() const { return base != nullptr; }
  char* row(int64_t p) const { return base + p * row_bytes; }
};

RowView row_view(const at::Tensor& t) {
  RowView v;
  if (!t.defined()) return v;
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && t.stride(1) == 1);
  v.base = static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  v.row_bytes = t.stride(0) * static_cast<int64_t>(t.element_size());
  v.dtype = t.scalar_type();
  return v;
}

// dst[0:n] = src[0:n] converted to A (vectorized for the 16-bit types into float).
template <typename T, typename A>
void widen(const T* src, A* dst, int64_t n) {
  int64_t d = 0;
  if constexpr (std::is_same_v<A, float> && at::vec::is_reduced_floating_point_v<T>) {
    using bVec = Vectorized<T>;
    for (; d + bVec::size() <= n; d += bVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(bVec::loadu(src + d));
      lo.store(dst + d);
      hi.store(dst + d + Vectorized<float>::size());
    }
  }
  for (; d < n; ++d) dst[d] = static_cast<A>(static_cast<float>(src[d]));
}

// Row p of `rows` as A: the row itself when it already is A, else converted into `buf`.
template <typename A>
const A* load_row(const RowView& rows, int64_t p, A* buf, int64_t n) {
  const void* src = rows.row(p);
  if (rows.dtype == c10::CppTypeToScalarType<A>::value) return static_cast<const A*>(src);
  switch (rows.dtype) {
    case at::kFloat:
      widen(static_cast<const float*>(src), buf, n);
      break;
    case at::kDouble:
      widen(static_cast<const double*>(src), buf, n);
      break;
    case at::kHalf:
      widen(static_cast<const at::Half*>(src), buf, n);
      break;
    case at::kBFloat16:
      widen(static_cast<const at::BFloat16*>(src), buf, n);
      break;
    default:
      TORCH_CHECK(false, "block step (cpu): unsupported dtype ", rows.dtype);
  }
  return buf;
}

// Copies floats with non-temporal stores where the ISA has them: a large output
// is written once and not read back soon, and streaming skips the
// read-for-ownership of each destination line.
inline void stream_floats(const float* src, float* dst, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t W = 16;
#else
  constexpr int64_t W = 8;
#endif
  int64_t d = 0;
  for (; d < n && reinterpret_cast<uintptr_t>(dst + d) % (W * sizeof(float)) != 0; ++d) dst[d] = src[d];
  for (; d + W <= n; d += W) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_ps(dst + d, _mm512_loadu_ps(src + d));
#else
    _mm256_stream_ps(dst + d, _mm256_loadu_ps(src + d));
#endif
  }
  for (; d < n; ++d) dst[d] = src[d];
#else
  std::copy(src, src + n, dst);
#endif
}

// Row p of `rows` = src converted to the row's dtype; `stream` selects
// non-temporal stores for float rows (the caller fences before returning).
template <typename A>
void store_row(const A* src, const RowView& rows, int64_t p, int64_t n, bool stream) {
  void* dst = rows.row(p);
  switch (rows.dtype) {
    case at::kFloat:
      if constexpr (std::is_same_v<A, float>) {
        if (stream) {
          stream_floats(src, static_cast<float*>(dst), n);
          break;
        }
      }
      at::vec::convert(src, static_cast<float*>(dst), n);
      break;
    case at::kDouble:
      at::vec::convert(src, static_cast<double*>(dst), n);
      break;
    case at::kHalf:
      at::vec::convert(src, static_cast<at::Half*>(dst), n);
      break;
    case at::kBFloat16:
      at::vec::convert(src, static_cast<at::BFloat16*>(dst), n);
      break;
    default:
      TORCH_CHECK(false, "block step (cpu): unsupported dtype ", rows.dtype);
  }
}

// ---------------------------------------------------------------- vector arithmetic on one row

// out = a * x + b * y (out may alias x or y).
template <typename T>
void lincomb(T* out, T a, const T* x, T b, const T* y, int64_t n) {
  at::vec::map2<T>([a, b](auto xv, auto yv) { return xv * decltype(xv)(a) + yv * decltype(xv)(b); }, out, x, y, n);
}

// The two softmax weights of a merge with one new source: α_a of the prefix
// (logit lse_a) and α_b of the source (logit s). NaN in either propagates to
// both, like the reference's softmax.
template <typename A>
struct MergeWeights {
  A alpha_a, alpha_b, lse;
};

template <typename A>
MergeWeights<A> merge_weights(A lse_a, A s) {
  const A top = (s > lse_a || std::isnan(s)) ? s : lse_a;
  const A e_a = std::exp(lse_a - top), e_b = std::exp(s - top);
  const A z = e_a + e_b;
  return {e_a / z, e_b / z, top + std::log(z)};
}

// Outputs bigger than this are written with non-temporal stores (they would
// not stay in cache anyway); smaller ones stay cached for the next op.
constexpr int64_t kStreamBytes = int64_t(8) << 20;

// ---------------------------------------------------------------- forward

struct StepRows {
  int64_t M = 0, D = 0;
  RowView partial, update, prefix_out, new_partial, out;
};

template <typename A>
void block_step_fwd_impl(const StepRows& io, const A* u, const A* g, const A* lse_a, double eps_d, A* lse, A* logit,
                         A* rinv, bool stream) {
  const int64_t M = io.M, D = io.D;
  const A eps = static_cast<A>(eps_d), inv_d = A(1) / static_cast<A>(D);
  const int64_t grain = std::max<int64_t>(1, 16384 / D);
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    // x: the sum (then v = the rounded new_partial); h: the read; a, b: conversion buffers.
    std::vector<A> x(D), h(D), a(D), b(D);
    for (int64_t p = begin; p < end; ++p) {
      const A* upd = load_row(io.update, p, b.data(), D);
      if (io.partial.defined()) {
        at::vec::map2<A>([](auto pv, auto uv) { return pv + uv; }, x.data(), load_row(io.partial, p, a.data(), D), upd,
                         D);
      } else {
        std::copy(upd, upd + D, x.data());
      }
      store_row(x.data(), io.new_partial, p, D, stream);
      const A* v = x.data();
      if (io.new_partial.dtype != c10::CppTypeToScalarType<A>::value) {
        v = load_row(io.new_partial, p, a.data(), D);  // the rounded sum, as the read must see it
      }
      const A r = A(1) / std::sqrt(dot(v, v, D) * inv_d + eps);
      const A s = r * dot(u, v, D);
      rinv[p] = r;
      logit[p] = s;
      const MergeWeights<A> w = merge_weights(lse_a[p], s);
      lse[p] = w.lse;
      lincomb(h.data(), w.alpha_a, load_row(io.prefix_out, p, b.data(), D), w.alpha_b, v, D);
      if (g != nullptr) {
        const A rstd = A(1) / std::sqrt(dot(h.data(), h.data(), D) * inv_d + eps);
        at::vec::map2<A>([rstd](auto hv, auto gv) { return hv * gv * decltype(hv)(rstd); }, h.data(), h.data(), g, D);
      }
      store_row(h.data(), io.out, p, D, stream);
    }
    fence_streaming_stores();
  });
}

// ---------------------------------------------------------------- backward

struct StepGradRows {
  int64_t M = 0, D = 0;
  RowView grad_new_partial, grad_out, new_partial, prefix_out;  // inputs (the grads optional)
  RowView grad_total, grad_prefix_out;                          // outputs
};

// Per row (do = ∂L/∂h, delta = <do, h>, dl = ∂L/∂lse):
//   with the out norm: h recomputed, rstd = rsqrt(mean(h²) + eps), dg += rstd dy h,
//                      do = rstd (g dy) - h rstd³ <g dy, h> / D;  else do = dy
//   ds_b = α_b (<do, v> - delta + dl);   ∂lse_a = α_a (<do, h_a> - delta + dl);   ∂h_a = α_a do
//   ∂v = α_b do + ds_b r (u - s r v / D) (+ the incoming ∂new_partial);   du += ds_b r v
template <typename A>
void block_step_bwd_impl(const StepGradRows& io, const A* dlse, const A* u, const A* g, const A* lse_a, const A* logit,
                         const A* rinv, double eps_d, A* dlse_a, double* du_parts, double* dg_parts, int64_t chunk,
                         int64_t num_chunks, bool stream) {
  const int64_t M = io.M, D = io.D;
  const A eps = static_cast<A>(eps_d), inv_d = A(1) / static_cast<A>(D);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    // do_: ∂L/∂h; h: the recomputed read (out norm only); dv: the row gradient being built.
    std::vector<A> do_(D), h(D), dv(D), bv(D), bha(D), bgrad(D);
    for (int64_t c = c_begin; c < c_end; ++c) {
      double* du_c = du_parts + c * D;
      double* dg_c = g != nullptr ? dg_parts + c * D : nullptr;
      for (int64_t p = c * chunk; p < std::min(M, (c + 1) * chunk); ++p) {
        const A s = logit[p], r = rinv[p];
        const MergeWeights<A> w = merge_weights(lse_a[p], s);
        const A* v = load_row(io.new_partial, p, bv.data(), D);
        const A* ha = load_row(io.prefix_out, p, bha.data(), D);
        if (io.grad_out.defined()) {
          const A* dy = load_row(io.grad_out, p, bgrad.data(), D);
          std::copy(dy, dy + D, do_.data());
        } else {
          std::fill(do_.begin(), do_.end(), A(0));
        }
        if (g != nullptr) {
          lincomb(h.data(), w.alpha_a, ha, w.alpha_b, v, D);
          const A rstd = A(1) / std::sqrt(dot(h.data(), h.data(), D) * inv_d + eps);
          accumulate_product(dg_c, rstd, do_.data(), h.data(), D);
          at::vec::map2<A>([](auto dyv, auto gv) { return dyv * gv; }, do_.data(), do_.data(), g, D);
          const A k = -rstd * rstd * rstd * dot(do_.data(), h.data(), D) * inv_d;
          lincomb(do_.data(), rstd, do_.data(), k, h.data(), D);
        }
        const A dp_a = dot(do_.data(), ha, D), dp_b = dot(do_.data(), v, D);
        const A delta = w.alpha_a * dp_a + w.alpha_b * dp_b;
        const A dl = dlse != nullptr ? dlse[p] : A(0);
        const A ds = w.alpha_b * (dp_b - delta + dl);
        dlse_a[p] = w.alpha_a * (dp_a - delta + dl);
        const A c1 = ds * r, c2 = -ds * s * r * r * inv_d;
        // ∂v = α_b do + c1 u + c2 v, then + the incoming gradient of new_partial.
        lincomb(dv.data(), w.alpha_b, do_.data(), c1, u, D);
        at::vec::map2<A>([c2](auto dvv, auto vv) { return dvv + vv * decltype(vv)(c2); }, dv.data(), dv.data(), v, D);
        if (io.grad_new_partial.defined()) {
          const A* gn = load_row(io.grad_new_partial, p, bgrad.data(), D);
          at::vec::map2<A>([](auto x, auto y) { return x + y; }, dv.data(), dv.data(), gn, D);
        }
        store_row(dv.data(), io.grad_total, p, D, stream);
        accumulate_scaled(du_c, c1, v, D);
        at::vec::map<A>([a = w.alpha_a](auto x) { return x * decltype(x)(a); }, dv.data(), do_.data(), D);
        store_row(dv.data(), io.grad_prefix_out, p, D, stream);
      }
    }
    fence_streaming_stores();
  });
}

// ---------------------------------------------------------------- argument handling

bool streams(const StepArgs& a) {
  return a.M * a.D * static_cast<int64_t>(c10::elementSize(a.out_dtype)) >= kStreamBytes;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_fwd_cpu(
    const c10::optional<at::Tensor>& partial, const at::Tensor& update, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, double eps, c10::optional<int64_t> key_rank) {
  check_full_width_keys(key_rank, update, "cpu");
  const StepArgs a = check_step(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight);
  const auto lead = update.sizes().slice(0, update.dim() - 1);
  at::Tensor new_partial = empty_output(update.sizes(), update.options().dtype(a.new_dtype));
  at::Tensor out = empty_output(update.sizes(), update.options().dtype(a.out_dtype));
  const auto acc_opts = update.options().dtype(a.acc_dtype);
  at::Tensor lse = at::empty(lead, acc_opts), logit = at::empty(lead, acc_opts), rinv = at::empty(lead, acc_opts);
  if (a.M == 0) return {new_partial, out, lse, logit, rinv};
  StepRows io;
  io.M = a.M;
  io.D = a.D;
  const at::Tensor partial_rows = partial.has_value() ? step_rows(*partial, a.M, a.D) : at::Tensor();
  const at::Tensor update_rows = step_rows(update, a.M, a.D), prefix_rows = step_rows(prefix_out, a.M, a.D);
  io.partial = row_view(partial_rows);
  io.update = row_view(update_rows);
  io.prefix_out = row_view(prefix_rows);
  io.new_partial = row_view(new_partial.view({a.M, a.D}));
  io.out = row_view(out.view({a.M, a.D}));
  const at::Tensor lse_a = prefix_lse.contiguous();
  AT_DISPATCH_FLOATING_TYPES(a.acc_dtype, "block_step_fwd_cpu", [&] {
    block_step_fwd_impl<scalar_t>(io, a.u.const_data_ptr<scalar_t>(),
                                  a.g.defined() ? a.g.const_data_ptr<scalar_t>() : nullptr,
                                  lse_a.const_data_ptr<scalar_t>(), eps, lse.mutable_data_ptr<scalar_t>(),
                                  logit.mutable_data_ptr<scalar_t>(), rinv.mutable_data_ptr<scalar_t>(), streams(a));
  });
  return {new_partial, out, lse, logit, rinv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_bwd_cpu(
    const c10::optional<at::Tensor>& grad_new_partial, const c10::optional<at::Tensor>& grad_out,
    const c10::optional<at::Tensor>& grad_lse, const at::Tensor& new_partial, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logit, const at::Tensor& rinv, double eps,
    c10::optional<int64_t> key_rank) {
  check_full_width_keys(key_rank, new_partial, "cpu");
  const StepArgs a = check_step(c10::nullopt, new_partial, query, norm_weight, prefix_out, prefix_lse, out_norm_weight);
  const auto lead = new_partial.sizes().slice(0, new_partial.dim() - 1);
  const StepSaved saved = check_step_saved(a, new_partial, grad_new_partial, grad_out, grad_lse, logit, rinv);
  const at::Tensor &logit_c = saved.logit, &rinv_c = saved.rinv, &dlse = saved.dlse;

  at::Tensor grad_total = empty_output(new_partial.sizes(), new_partial.options().dtype(a.new_dtype));
  at::Tensor grad_prefix_out = empty_output(prefix_out.sizes(), prefix_out.options());
  at::Tensor grad_prefix_lse = at::empty(lead, prefix_lse.options());
  at::Tensor du = at::zeros({a.D}, a.u.options());
  at::Tensor dg = a.g.defined() ? at::zeros({a.D}, a.u.options()) : at::Tensor();
  if (a.M > 0) {
    StepGradRows io;
    io.M = a.M;
    io.D = a.D;
    const at::Tensor gn_rows = grad_new_partial.has_value() ? step_rows(*grad_new_partial, a.M, a.D) : at::Tensor();
    const at::Tensor dy_rows = grad_out.has_value() ? step_rows(*grad_out, a.M, a.D) : at::Tensor();
    const at::Tensor v_rows = step_rows(new_partial, a.M, a.D), ha_rows = step_rows(prefix_out, a.M, a.D);
    io.grad_new_partial = row_view(gn_rows);
    io.grad_out = row_view(dy_rows);
    io.new_partial = row_view(v_rows);
    io.prefix_out = row_view(ha_rows);
    io.grad_total = row_view(grad_total.view({a.M, a.D}));
    io.grad_prefix_out = row_view(grad_prefix_out.view({a.M, a.D}));
    const at::Tensor lse_a = prefix_lse.contiguous();
    // Stage 1 writes one double partial of du (and of dg) per chunk of rows.
    const int64_t chunk = rows_per_chunk(a.M), num_chunks = (a.M + chunk - 1) / chunk;
    const auto part_opts = a.u.options().dtype(at::kDouble);
    at::Tensor du_part = at::zeros({num_chunks, a.D}, part_opts);
    at::Tensor dg_part = a.g.defined() ? at::zeros({num_chunks, a.D}, part_opts) : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES(a.acc_dtype, "block_step_bwd_cpu", [&] {
      block_step_bwd_impl<scalar_t>(
          io, dlse.defined() ? dlse.const_data_ptr<scalar_t>() : nullptr, a.u.const_data_ptr<scalar_t>(),
          a.g.defined() ? a.g.const_data_ptr<scalar_t>() : nullptr, lse_a.const_data_ptr<scalar_t>(),
          logit_c.const_data_ptr<scalar_t>(), rinv_c.const_data_ptr<scalar_t>(), eps,
          grad_prefix_lse.mutable_data_ptr<scalar_t>(), du_part.mutable_data_ptr<double>(),
          dg_part.defined() ? dg_part.mutable_data_ptr<double>() : nullptr, chunk, num_chunks, streams(a));
      sum_chunks(du_part.const_data_ptr<double>(), num_chunks, a.D, du.mutable_data_ptr<scalar_t>());
      if (dg.defined()) sum_chunks(dg_part.const_data_ptr<double>(), num_chunks, a.D, dg.mutable_data_ptr<scalar_t>());
    });
  }
  auto [d_query, d_norm, d_g] =
      site_param_grads(du.unsqueeze(0), dg.defined() ? dg.unsqueeze(0) : dg, query, norm_weight, out_norm_weight);
  return {grad_total, d_query, d_norm, grad_prefix_out, grad_prefix_lse, d_g};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CPU, m) {
  m.impl("block_step_fwd", &block_step_fwd_cpu);
  m.impl("block_step_bwd", &block_step_bwd_cpu);
}

}  // namespace attnres
