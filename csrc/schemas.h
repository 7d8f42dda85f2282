// Op schemas shared by the `attnres` library (csrc/bindings.cpp) and the SIMT
// harness's `attnres_emu` library (csrc/simt/emulated_ops.cpp): one text per op.
#pragma once

#include "depth_attention.h"

namespace attnres::schema {

// One depth read of Q sites over N sources, optionally merged into a prefix
// read (h_a, lse_a) and followed by a fused output RMSNorm. `query` is [D]
// (one site) or [Q, D]; `norm_weight` / `out_norm_weight` are [D] (shared by
// the sites) or [Q, D]; the trailing scalars are the ReadOptions fields. Returns
// (out [Q?, ..., D], lse [Q?, ...], logits [Q?, N, ...], rinv [N, ...]); the site
// dim Q? is present for a [Q, D] query.
inline constexpr const char* kDepthAttnFwd =
    "depth_attn_fwd(Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, "
    "Tensor? out_norm_weight, " ATTNRES_READ_OPTIONS_SCHEMA ") -> (Tensor, Tensor, Tensor, Tensor)";
// Returns (grad_sources, grad_query, grad_norm_weight, grad_prefix_out,
// grad_prefix_lse, grad_out_norm_weight); absent optional inputs get empty gradients.
inline constexpr const char* kDepthAttnBwd =
    "depth_attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor? grad_logits, Tensor[] sources, Tensor query, "
    "Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, Tensor? out_norm_weight, Tensor logits, "
    "Tensor rinv, " ATTNRES_READ_OPTIONS_SCHEMA ") -> (Tensor[], Tensor, Tensor, Tensor, Tensor, Tensor)";

// The fused residual step of two-phase Block AttnRes: new_partial = partial +
// update (update alone without partial), then the merge of the next site's
// prefix read (h_a, lse_a) with the one source new_partial, optionally
// followed by the output RMSNorm. query / norm_weight / out_norm_weight are
// one site's [D] ([R] with key_rank = R < D: sliced low-rank keys). Returns (new_partial, out, lse, logit, rinv).
inline constexpr const char* kBlockStepFwd =
    "block_step_fwd(Tensor? partial, Tensor update, Tensor query, Tensor? norm_weight, Tensor prefix_out, "
    "Tensor prefix_lse, Tensor? out_norm_weight, float eps, int? key_rank) -> (Tensor, Tensor, Tensor, Tensor, "
    "Tensor)";
// Returns (grad_new_partial (the total: incoming + the read's), grad_query,
// grad_norm_weight, grad_prefix_out, grad_prefix_lse, grad_out_norm_weight).
inline constexpr const char* kBlockStepBwd =
    "block_step_bwd(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, Tensor new_partial, "
    "Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, Tensor? out_norm_weight, "
    "Tensor logit, Tensor rinv, float eps, int? key_rank) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";

// Fused attention (DESIGN.md §2.4): q [B, H, Tq, Dh], k/v [B, Hkv, Tk, Dh] (H % Hkv == 0),
// key_padding_mask bool [B, Tk] (True = a real key). Returns out [B, H, Tq, Dh] (q's dtype) and
// lse [B, H, Tq] (fp32; fp64 for fp64 inputs; -inf for a row that sees no key).
inline constexpr const char* kAttnFwd =
    "attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float scale) "
    "-> (Tensor out, Tensor lse)";
// Gradients of q, k, v (their dtypes); grad_lse may be absent.
inline constexpr const char* kAttnBwd =
    "attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
    "Tensor out, Tensor lse, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)";

}  // namespace attnres::schema
