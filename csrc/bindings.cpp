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
#include "schemas.h"

namespace attnres {

std::string build_info() { return std::string("attnres_kernels C++ ops; CPU vector ISA: ") + cpu_vector_isa(); }

TORCH_LIBRARY(attnres, m) {
  m.def("build_info() -> str", &build_info);
  m.def(schema::kDepthAttnFwd);
  m.def(schema::kDepthAttnBwd);
  m.def(schema::kBlockStepFwd);
  m.def(schema::kBlockStepBwd);
  // The gradients of block_step_fwd as a differentiable function of new_partial,
  // the site parameters, the prefix and the incoming gradients, for a backward
  // with create_graph=True (like depth_attn_bwd_differentiable; implemented in
  // Python). Returns the gradients of new_partial (the total), query,
  // norm_weight, prefix_out, prefix_lse and out_norm_weight; inputs that are
  // absent or do not require grad get an empty tensor.
  m.def(
      "block_step_bwd_differentiable(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, "
      "Tensor new_partial, Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, "
      "Tensor? out_norm_weight, float eps, int? key_rank) -> Tensor[]");
  m.def(schema::kAttnFwd);
  m.def(schema::kAttnBwd);
  // The gradients of attn_fwd (grad_q, grad_k, grad_v) as a differentiable function of q, k, v and
  // the incoming gradients, for a backward with create_graph=True (csrc/autograd/attention_autograd.h);
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
      "Tensor query, Tensor? norm_weight, Tensor? prefix_out, Tensor? prefix_lse, Tensor? "
      "out_norm_weight, " ATTNRES_READ_OPTIONS_SCHEMA ") -> Tensor[]");
  // Frees the CPU output buffers the ops keep for reuse (csrc/cpu/output_cache.cpp).
  m.def("empty_cpu_cache() -> ()", &empty_cpu_cache);
  // [bytes, count] of the free buffers it keeps and the bytes of its buffers in use.
  m.def("cpu_cache_stats() -> int[]", &cpu_cache_stats);
}

}  // namespace attnres
