// Op schemas of the `attnres` namespace.
//
// The schemas live here, the kernels in csrc/cpu (and later csrc/cuda) register
// implementations with TORCH_LIBRARY_IMPL. The autograd of depth_attn_fwd and
// block_step_fwd is registered in C++ (csrc/autograd); fake (meta) kernels, the
// differentiable backwards used for double backward, and the autograd of the
// other ops are registered from Python (attnres_kernels/ops/_registration.py).
#include <torch/library.h>

#include <string>

#include "depth_attention.h"

namespace attnres {

std::string build_info() { return std::string("attnres_kernels C++ ops; CPU vector ISA: ") + cpu_vector_isa(); }

TORCH_LIBRARY(attnres, m) {
  m.def("build_info() -> str", &build_info);
  // One depth read of Q sites over N sources, optionally merged into a prefix
  // read (h_a, lse_a) and followed by a fused output RMSNorm. `query` is [D]
  // (one site) or [Q, D]; `norm_weight` / `out_norm_weight` are [D] (shared by
  // the sites) or [Q, D]. Returns (out [Q?, ..., D], lse [Q?, ...], logits
  // [Q?, N, ...], rinv [N, ...]); the site dim Q? is present for a [Q, D] query.
  m.def(
      "depth_attn_fwd(Tensor[] sources, Tensor query, Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, "
      "Tensor? out_norm_weight, float eps) -> (Tensor, Tensor, Tensor, Tensor)");
  // Returns (grad_sources, grad_query, grad_norm_weight, grad_prefix_out,
  // grad_prefix_lse, grad_out_norm_weight); absent optional inputs get empty gradients.
  m.def(
      "depth_attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor? grad_logits, Tensor[] sources, Tensor query, "
      "Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, Tensor? out_norm_weight, Tensor logits, "
      "Tensor rinv, float eps) -> (Tensor[], Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The fused residual step of two-phase Block AttnRes: new_partial = partial +
  // update (update alone without partial), then the merge of the next site's
  // prefix read (h_a, lse_a) with the one source new_partial, optionally
  // followed by the output RMSNorm. query / norm_weight / out_norm_weight are
  // one site's [D]. Returns (new_partial, out, lse, logit, rinv).
  m.def(
      "block_step_fwd(Tensor? partial, Tensor update, Tensor query, Tensor? norm_weight, Tensor prefix_out, "
      "Tensor prefix_lse, Tensor? out_norm_weight, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Returns (grad_new_partial (the total: incoming + the read's), grad_query,
  // grad_norm_weight, grad_prefix_out, grad_prefix_lse, grad_out_norm_weight).
  m.def(
      "block_step_bwd(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, Tensor new_partial, "
      "Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, Tensor? out_norm_weight, "
      "Tensor logit, Tensor rinv, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The gradients of block_step_fwd as a differentiable function of new_partial,
  // the site parameters, the prefix and the incoming gradients, for a backward
  // with create_graph=True (like depth_attn_bwd_differentiable; implemented in
  // Python). Returns the gradients of new_partial (the total), query,
  // norm_weight, prefix_out, prefix_lse and out_norm_weight; inputs that are
  // absent or do not require grad get an empty tensor.
  m.def(
      "block_step_bwd_differentiable(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, "
      "Tensor new_partial, Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, "
      "Tensor? out_norm_weight, float eps) -> Tensor[]");
  // Fused attention (DESIGN.md §2.4): q [B, H, Tq, Dh], k/v [B, Hkv, Tk, Dh] (H % Hkv == 0),
  // key_padding_mask bool [B, Tk] (True = a real key). Returns out [B, H, Tq, Dh] (q's dtype) and
  // lse [B, H, Tq] (fp32; fp64 for fp64 inputs; -inf for a row that sees no key).
  m.def(
      "attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float scale) "
      "-> (Tensor out, Tensor lse)");
  // Gradients of q, k, v (their dtypes); grad_lse may be absent.
  m.def(
      "attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, "
      "Tensor out, Tensor lse, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The gradients of attn_fwd (grad_q, grad_k, grad_v) as a differentiable function of q, k, v and
  // the incoming gradients, for a backward with create_graph=True (csrc/autograd/attention_autograd.cpp);
  // implemented in Python by autograd through the reference. An input that does not require grad gets an
  // empty tensor.
  m.def(
      "attn_bwd_differentiable(Tensor? grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, "
      "Tensor? key_padding_mask, bool causal, float scale) -> Tensor[]");
  // The gradients of depth_attn_fwd as a differentiable function of its inputs
  // and of the incoming gradients: the backward of the autograd (csrc/autograd)
  // calls it when it runs with create_graph=True. Implemented in Python
  // (CompositeImplicitAutograd, by autograd through the reference). Returns one
  // gradient per source, then those of query, norm_weight, prefix_out,
  // prefix_lse and out_norm_weight; inputs that are absent or do not require
  // grad get an empty tensor.
  m.def(
      "depth_attn_bwd_differentiable(Tensor? grad_out, Tensor? grad_lse, Tensor? grad_logits, Tensor[] sources, "
      "Tensor query, Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, Tensor? out_norm_weight, "
      "float eps) -> Tensor[]");
  // Frees the CPU output buffers the ops keep for reuse (csrc/cpu/output_cache.cpp).
  m.def("empty_cpu_cache() -> ()", &empty_cpu_cache);
}

}  // namespace attnres
