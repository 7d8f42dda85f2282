// Autograd of attnres::block_step_fwd, registered for the Autograd dispatch
// key: it serves every native kernel of the op (CPU, and CUDA when built), and,
// registered for attnres_triton::block_step_fwd too, the Triton kernels (see
// depth_attention_autograd.h).
//
// Forward: redispatches to the backend kernel and saves new_partial (never the
// addends: keeping the old partial sum alive would cost O(L·d) memory), the
// site parameters, the prefix and the per-row scalars logit and rinv.
// Backward: attnres::block_step_bwd through the dispatcher; autograd hands the
// total gradient of new_partial to both addends, each in its own dtype. The
// fused backward kernels are not themselves differentiable, so a backward that
// runs with create_graph=True (grad mode on) calls
// attnres::block_step_bwd_differentiable instead, which `import attnres_kernels`
// implements by autograd through the reference (as for the depth read, see
// depth_attention_autograd.h): double backward is exact, at the reference's cost.
//
// Written in C++ rather than with torch.library.register_autograd because the
// Python wrapper's fixed cost per call (~1 ms: the custom-op machinery, Python
// setup_context and backward) exceeds the kernels' own time at the sizes of a
// Block model, which runs the step once per sublayer.
//
// Compiled once, as part of autograd.cpp.
#pragma once

#include <tuple>
#include <vector>

#include "autograd_common.h"

namespace attnres {
namespace autograd {
namespace block_step {
namespace {

using FwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const OptTensor&, const Tensor&, const Tensor&,
                                                                        const OptTensor&, const Tensor&, const Tensor&,
                                                                        const OptTensor&, double,
                                                                        c10::optional<int64_t>);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const OptTensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
    const Tensor&, const OptTensor&, const Tensor&, const Tensor&, double, c10::optional<int64_t>);
using DifferentiableBwdSignature = std::vector<Tensor>(const OptTensor&, const OptTensor&, const OptTensor&,
                                                       const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                                       const Tensor&, const OptTensor&, double, c10::optional<int64_t>);

// Positions in the saved list.
enum Saved { kNewPartial, kQuery, kNormWeight, kPrefixOut, kPrefixLse, kOutNormWeight, kLogit, kRinv };

// The forward and backward ops of one backend family: the native kernels, or the Triton ones.
struct NativeOps {
  static constexpr const char* kFwd = "attnres::block_step_fwd";
  static constexpr const char* kBwd = "attnres::block_step_bwd";
};
struct TritonOps {
  static constexpr const char* kFwd = "attnres_triton::block_step_fwd";
  static constexpr const char* kBwd = "attnres_triton::block_step_bwd";
};

template <typename Ops>
struct BlockStepFunction : public torch::autograd::Function<BlockStepFunction<Ops>> {
  static variable_list forward(AutogradContext* ctx, const OptTensor& partial, const Tensor& update,
                               const Tensor& query, const OptTensor& norm_weight, const Tensor& prefix_out,
                               const Tensor& prefix_lse, const OptTensor& out_norm_weight, double eps,
                               c10::optional<int64_t> key_rank) {
    static const auto fwd = find_op<FwdSignature>(Ops::kFwd);
    Tensor new_partial, out, lse, logit, rinv;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(new_partial, out, lse, logit, rinv) =
          fwd.call(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps, key_rank);
    }
    ctx->mark_non_differentiable({logit, rinv});
    ctx->set_materialize_grads(false);  // unused outputs cost nothing in backward
    ctx->save_for_backward({new_partial, query, norm_weight.value_or(Tensor()), prefix_out, prefix_lse,
                            out_norm_weight.value_or(Tensor()), logit, rinv});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["key_rank"] = key_rank.value_or(0);  // 0: unset (full-width keys)
    ctx->saved_data["partial_dtype"] = partial.has_value() ? static_cast<int64_t>(partial->scalar_type()) : -1;
    ctx->saved_data["update_dtype"] = static_cast<int64_t>(update.scalar_type());
    return {new_partial, out, lse, logit, rinv};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &new_partial = saved[kNewPartial], &query = saved[kQuery];
    const OptTensor norm_weight = present(saved[kNormWeight]), out_norm_weight = present(saved[kOutNormWeight]);
    const Tensor &prefix_out = saved[kPrefixOut], &prefix_lse = saved[kPrefixLse];
    const double eps = ctx->saved_data["eps"].toDouble();
    const int64_t saved_rank = ctx->saved_data["key_rank"].toInt();
    const c10::optional<int64_t> key_rank = saved_rank ? c10::optional<int64_t>(saved_rank) : c10::nullopt;
    const OptTensor grad_new = present(grads[0]), grad_out = present(grads[1]), grad_lse = present(grads[2]);

    // (grad_new_partial (the total), grad_query, grad_norm_weight, grad_prefix_out,
    // grad_prefix_lse, grad_out_norm_weight)
    std::vector<Tensor> result;
    if (at::GradMode::is_enabled()) {
      result = differentiable_backward(grad_new, grad_out, grad_lse, new_partial, query, norm_weight, prefix_out,
                                       prefix_lse, out_norm_weight, eps, key_rank);
      // Inputs that do not require grad get no gradient (the Python side returns empty tensors for them).
      for (size_t k = 0; k < result.size(); ++k) {
        const Tensor& input = k == 0 ? new_partial : saved[k];
        if (!input.defined() || !input.requires_grad()) result[k] = Tensor();
      }
    } else {
      static const auto bwd = find_op<BwdSignature>(Ops::kBwd);
      // Below the Autograd key: the fused backward is not differentiable (grad mode is off here).
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      auto [d_new, d_query, d_norm, d_prefix_out, d_prefix_lse, d_out_norm] =
          bwd.call(grad_new, grad_out, grad_lse, new_partial, query, norm_weight, prefix_out, prefix_lse,
                   out_norm_weight, saved[kLogit], saved[kRinv], eps, key_rank);
      result = {d_new,        d_query,      norm_weight ? d_norm : Tensor(),
                d_prefix_out, d_prefix_lse, out_norm_weight ? d_out_norm : Tensor()};
    }
    const Tensor& grad_total = result[0];  // autograd hands the sum's gradient to both addends
    const int64_t partial_dtype = ctx->saved_data["partial_dtype"].toInt();
    const auto update_dtype = static_cast<at::ScalarType>(ctx->saved_data["update_dtype"].toInt());
    const bool has_total = grad_total.defined();
    return {partial_dtype >= 0 && has_total ? grad_total.to(static_cast<at::ScalarType>(partial_dtype)) : Tensor(),
            has_total ? grad_total.to(update_dtype) : Tensor(),
            result[1],
            result[2],
            result[3],
            result[4],
            result[5],
            Tensor(),   // eps
            Tensor()};  // key_rank
  }

  static std::vector<Tensor> differentiable_backward(const OptTensor& grad_new, const OptTensor& grad_out,
                                                     const OptTensor& grad_lse, const Tensor& new_partial,
                                                     const Tensor& query, const OptTensor& norm_weight,
                                                     const Tensor& prefix_out, const Tensor& prefix_lse,
                                                     const OptTensor& out_norm_weight, double eps,
                                                     c10::optional<int64_t> key_rank) {
    static const auto op = find_op<DifferentiableBwdSignature>("attnres::block_step_bwd_differentiable");
    TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                "attnres::block_step_fwd: a backward with create_graph=True (double backward) needs "
                "attnres::block_step_bwd_differentiable, which `import attnres_kernels` registers in Python; "
                "it is not registered in this process");
    return op.call(grad_new, grad_out, grad_lse, new_partial, query, norm_weight, prefix_out, prefix_lse,
                   out_norm_weight, eps, key_rank);
  }
};

template <typename Ops>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> block_step_fwd_autograd(
    const OptTensor& partial, const Tensor& update, const Tensor& query, const OptTensor& norm_weight,
    const Tensor& prefix_out, const Tensor& prefix_lse, const OptTensor& out_norm_weight, double eps,
    c10::optional<int64_t> key_rank) {
  const variable_list out = BlockStepFunction<Ops>::apply(partial, update, query, norm_weight, prefix_out, prefix_lse,
                                                          out_norm_weight, eps, key_rank);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) { m.impl("block_step_fwd", &block_step_fwd_autograd<NativeOps>); }
TORCH_LIBRARY_IMPL(attnres_triton, Autograd, m) { m.impl("block_step_fwd", &block_step_fwd_autograd<TritonOps>); }

}  // namespace block_step
}  // namespace autograd
}  // namespace attnres
