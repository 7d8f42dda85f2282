// Shared argument handling of the Block step ops (block_step_fwd / _bwd,
// DESIGN.md §2.3) for every native backend: the checks, the dtypes of the
// outputs and of the arithmetic, and the [M, D] row views. The math lives in
// the backend files (csrc/cpu/block_step_cpu.cpp, csrc/cuda/block_step_ops.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "depth_attention.h"

namespace attnres {

// `t` as [M, D] rows with unit column stride (a view when the layout allows).
inline at::Tensor step_rows(const at::Tensor& t, int64_t m, int64_t d) {
  at::Tensor r = t.reshape({m, d});
  return r.stride(1) == 1 ? r : r.contiguous();
}

inline void check_step_rows(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), "block step: `", name, "` has unsupported dtype ", t.scalar_type());
  TORCH_CHECK(t.sizes() == like.sizes(), "block step: `", name, "` must have the shape of `update` ", like.sizes(),
              ", got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "block step: `", name, "` is on ", t.device(), ", `update` on ",
              like.device());
}

// `width`: D, or R for query and norm_weight with sliced low-rank keys.
inline void check_step_site_vector(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t width) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "block step: `", name, "` must be floating point, got ",
              t.scalar_type());
  const char* symbol = width == like.size(-1) ? "D" : "R";
  TORCH_CHECK(t.dim() == 1 && t.size(0) == width, "block step: `", name, "` must be one site's [", symbol, "] with ",
              symbol, " = ", width, ", got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "block step: `", name, "` is on ", t.device(), ", `update` on ",
              like.device());
}

// A Block step's key width R (sliced low-rank keys, docs/design.md §2.7): key_rank, checked to
// be in [1, D]; D when unset (the ordinary step).
inline int64_t step_key_dim(c10::optional<int64_t> key_rank, const at::Tensor& rows) {
  const int64_t dim = rows.dim() > 0 ? rows.size(-1) : 0;
  if (!key_rank.has_value()) return dim;
  TORCH_CHECK(*key_rank >= 1 && *key_rank <= dim, "block step: `key_rank` must be in [1, D] with D = ", dim, ", got ",
              *key_rank);
  return *key_rank;
}

// R = D (or unset) is the ordinary step; R < D has no kernel on this backend yet.
inline void check_full_width_keys(c10::optional<int64_t> key_rank, const at::Tensor& rows, const char* backend) {
  TORCH_CHECK(step_key_dim(key_rank, rows) == (rows.dim() > 0 ? rows.size(-1) : 0), "block step (", backend,
              "): sliced low-rank keys (key_rank < D) have no kernel yet");
}

// The checked arguments of one call: dtypes, row count, u = query ⊙ norm_weight ([R]) and g ([D])
// contiguous in the accumulation dtype (undefined with form_site_params false: the CUDA kernels
// stage them from the parameters themselves).
struct StepArgs {
  int64_t M = 0, D = 0;
  at::ScalarType new_dtype, out_dtype, acc_dtype;
  at::Tensor u, g;
};

inline StepArgs check_step(const c10::optional<at::Tensor>& partial, const at::Tensor& update, const at::Tensor& query,
                           const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out,
                           const at::Tensor& prefix_lse, const c10::optional<at::Tensor>& out_norm_weight,
                           int64_t key_dim = -1, bool form_site_params = true) {
  TORCH_CHECK(is_supported_dtype(update.scalar_type()), "block step: `update` has unsupported dtype ",
              update.scalar_type());
  TORCH_CHECK(update.dim() >= 1 && update.size(-1) > 0, "block step: `update` must be [..., D] with D > 0, got ",
              update.sizes());
  StepArgs a;
  a.D = update.size(-1);
  a.M = update.numel() / a.D;
  a.new_dtype = update.scalar_type();
  if (partial.has_value()) {
    check_step_rows(*partial, "partial", update);
    a.new_dtype = c10::promoteTypes(a.new_dtype, partial->scalar_type());
  }
  check_step_rows(prefix_out, "prefix_out", update);
  a.out_dtype = c10::promoteTypes(a.new_dtype, prefix_out.scalar_type());
  a.acc_dtype = accumulation_type(a.out_dtype);
  TORCH_CHECK(prefix_lse.sizes() == update.sizes().slice(0, update.dim() - 1),
              "block step: `prefix_lse` must have the leading shape of `update` ",
              update.sizes().slice(0, update.dim() - 1), ", got ", prefix_lse.sizes());
  TORCH_CHECK(prefix_lse.scalar_type() == a.acc_dtype, "block step: `prefix_lse` must be ", a.acc_dtype,
              " (the accumulation dtype), got ", prefix_lse.scalar_type());
  TORCH_CHECK(prefix_lse.device() == update.device(), "block step: `prefix_lse` is on another device");
  if (key_dim < 0) key_dim = a.D;
  check_step_site_vector(query, "query", update, key_dim);
  if (norm_weight.has_value()) check_step_site_vector(*norm_weight, "norm_weight", update, key_dim);
  if (out_norm_weight.has_value()) check_step_site_vector(*out_norm_weight, "out_norm_weight", update, a.D);
  if (!form_site_params) return a;
  a.u = query.to(a.acc_dtype);
  if (norm_weight.has_value()) a.u = a.u.mul(norm_weight->to(a.acc_dtype));
  a.u = a.u.contiguous();
  if (out_norm_weight.has_value()) a.g = out_norm_weight->to(a.acc_dtype).contiguous();
  return a;
}

// The backward's per-row inputs besides the rows, checked and contiguous:
// the saved logit and rinv, and grad_lse (undefined when absent); the row
// gradients grad_new_partial / grad_out are checked like the addends.
struct StepSaved {
  at::Tensor logit, rinv, dlse;
};

inline StepSaved check_step_saved(const StepArgs& a, const at::Tensor& new_partial,
                                  const c10::optional<at::Tensor>& grad_new_partial,
                                  const c10::optional<at::Tensor>& grad_out, const c10::optional<at::Tensor>& grad_lse,
                                  const at::Tensor& logit, const at::Tensor& rinv) {
  const auto lead = new_partial.sizes().slice(0, new_partial.dim() - 1);
  auto check_scalars = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.sizes() == lead && t.scalar_type() == a.acc_dtype, "block_step_bwd: `", name, "` must be ", lead, " ",
                a.acc_dtype, ", got ", t.sizes(), " ", t.scalar_type());
    TORCH_CHECK(t.device() == new_partial.device(), "block_step_bwd: `", name, "` is on another device");
    return t.contiguous();
  };
  StepSaved s;
  s.logit = check_scalars(logit, "logit");
  s.rinv = check_scalars(rinv, "rinv");
  if (grad_lse.has_value()) s.dlse = check_scalars(*grad_lse, "grad_lse");
  if (grad_new_partial.has_value()) check_step_rows(*grad_new_partial, "grad_new_partial", new_partial);
  if (grad_out.has_value()) check_step_rows(*grad_out, "grad_out", new_partial);
  return s;
}

}  // namespace attnres
