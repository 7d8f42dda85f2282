// Autograd of attnres::attn_fwd, registered for the Autograd dispatch key: it
// serves every native kernel of the op (CPU, and CUDA when built), and, registered
// for attnres_triton::attn_fwd too, the Triton kernels (see depth_attention_autograd.h).
//
// Forward: redispatches to the backend kernel and saves q, k, v, the key
// padding mask, out and the fp32 (fp64) lse: the backward recomputes the
// probabilities tile by tile from them, nothing of size T×T is kept.
// Backward: attnres::attn_bwd through the dispatcher (an absent grad_out counts
// as zero). The fused backward kernels are not themselves differentiable, so a
// backward that runs with create_graph=True (grad mode on) calls
// attnres::attn_bwd_differentiable instead, which `import attnres_kernels`
// implements by autograd through the reference (as for the depth read, see
// depth_attention_autograd.h): double backward is exact, at the reference's cost.
//
// Written in C++ rather than with torch.library.register_autograd because the
// Python wrapper's fixed cost per call (~60 µs forward, ~0.5 ms backward on the
// demo's machine) exceeds the kernels' own time at a decode step or a small
// model's sequence lengths.
//
// Compiled once, as part of autograd.cpp.
#pragma once

#include <tuple>
#include <vector>

#include "autograd_common.h"

namespace attnres {
namespace autograd {
namespace causal_attention {
namespace {

using FwdSignature = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, bool,
                                                double);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                                        const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                                                        bool, double);
using DifferentiableBwdSignature = std::vector<Tensor>(const OptTensor&, const OptTensor&, const Tensor&, const Tensor&,
                                                       const Tensor&, const OptTensor&, bool, double);

// Positions in the saved list.
enum Saved { kQ, kK, kV, kMask, kOut, kLse };

// The forward and backward ops of one backend family: the native kernels, or the Triton ones.
struct NativeOps {
  static constexpr const char* kFwd = "attnres::attn_fwd";
  static constexpr const char* kBwd = "attnres::attn_bwd";
};
struct TritonOps {
  static constexpr const char* kFwd = "attnres_triton::attn_fwd";
  static constexpr const char* kBwd = "attnres_triton::attn_bwd";
};

template <typename Ops>
struct AttentionFunction : public torch::autograd::Function<AttentionFunction<Ops>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale) {
    static const auto fwd = find_op<FwdSignature>(Ops::kFwd);
    Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse) = fwd.call(q, k, v, key_padding_mask, causal, scale);
    }
    ctx->set_materialize_grads(false);  // an unused lse costs nothing in backward
    ctx->save_for_backward({q, k, v, key_padding_mask.value_or(Tensor()), out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &q = saved[kQ], &k = saved[kK], &v = saved[kV], &out = saved[kOut];
    const OptTensor mask = present(saved[kMask]);
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const OptTensor grad_out = present(grads[0]), grad_lse = present(grads[1]);
    if (!grad_out && !grad_lse) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};

    std::vector<Tensor> result;  // grad_q, grad_k, grad_v
    if (at::GradMode::is_enabled()) {
      static const auto op = find_op<DifferentiableBwdSignature>("attnres::attn_bwd_differentiable");
      TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                  "attnres::attn_fwd: a backward with create_graph=True (double backward) needs "
                  "attnres::attn_bwd_differentiable, which `import attnres_kernels` registers in Python; "
                  "it is not registered in this process");
      result = op.call(grad_out, grad_lse, q, k, v, mask, causal, scale);
      // Inputs that do not require grad get no gradient (the Python side returns empty tensors for them).
      for (size_t i = 0; i < result.size(); ++i) {
        if (!saved[i].requires_grad()) result[i] = Tensor();
      }
    } else {
      static const auto bwd = find_op<BwdSignature>(Ops::kBwd);
      // Below the Autograd key: the fused backward is not differentiable (grad mode is off here).
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      const Tensor d_out = grad_out ? *grad_out : at::zeros_like(out);
      auto [dq, dk, dv] = bwd.call(d_out, grad_lse, q, k, v, mask, out, saved[kLse], causal, scale);
      result = {dq, dk, dv};
    }
    return {result[0], result[1], result[2], Tensor(), Tensor(), Tensor()};  // mask, causal, scale
  }
};

template <typename Ops>
std::tuple<Tensor, Tensor> attn_fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const OptTensor& key_padding_mask, bool causal, double scale) {
  if (!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    // Nothing to differentiate (inference, a decode step): the kernel alone, no graph node.
    static const auto fwd = find_op<FwdSignature>(Ops::kFwd);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return fwd.call(q, k, v, key_padding_mask, causal, scale);
  }
  const variable_list out = AttentionFunction<Ops>::apply(q, k, v, key_padding_mask, causal, scale);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) { m.impl("attn_fwd", &attn_fwd_autograd<NativeOps>); }
TORCH_LIBRARY_IMPL(attnres_triton, Autograd, m) { m.impl("attn_fwd", &attn_fwd_autograd<TritonOps>); }

}  // namespace causal_attention
}  // namespace autograd
}  // namespace attnres
