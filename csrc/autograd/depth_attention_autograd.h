// Autograd of attnres::depth_attn_fwd, registered for the Autograd dispatch
// key: it serves every native kernel of the op (CPU, and CUDA when built), and,
// registered for attnres_triton::depth_attn_fwd too (an op the Python side
// defines with the same schema when Triton is first used), the Triton kernels.
//
// Forward: redispatches to the backend kernel and saves references to the
// sources, the site parameters, the prefix (when given) and the per-row
// scalars logits and rinv (DESIGN.md §2.1; never a copy of the sources).
// Backward: attnres::depth_attn_bwd through the dispatcher. The fused backward
// kernels are not themselves differentiable, so a backward that runs with
// create_graph=True (grad mode on) calls attnres::depth_attn_bwd_differentiable
// instead, which `import attnres_kernels` implements by autograd through the
// reference: double backward is exact, at the reference's cost.
//
// Written in C++ rather than with torch.library.register_autograd because the
// Python wrapper (pytree flattening, the ctx object, saved-tensor handling in
// Python) cost more than the kernels of a small read.
//
// Compiled once, as part of autograd.cpp.
#pragma once

#include <tuple>
#include <vector>

#include "../depth_attention.h"
#include "autograd_common.h"

namespace attnres {
namespace autograd {
namespace depth_read {
namespace {

using FwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(at::TensorList, const at::Tensor&,
                                                                                const OptTensor&, const OptTensor&,
                                                                                const OptTensor&, const OptTensor&,
                                                                                ATTNRES_READ_OPTIONS_TYPES);
using BwdSignature = std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const OptTensor&, at::TensorList, const at::Tensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
    ATTNRES_READ_OPTIONS_TYPES);
using DifferentiableBwdSignature = std::vector<at::Tensor>(const OptTensor&, const OptTensor&, const OptTensor&,
                                                           at::TensorList, const at::Tensor&, const OptTensor&,
                                                           const OptTensor&, const OptTensor&, const OptTensor&,
                                                           ATTNRES_READ_OPTIONS_TYPES);

// Positions of the tensors after the sources in the saved list.
enum Saved { kQuery, kNormWeight, kPrefixOut, kPrefixLse, kOutNormWeight, kLogits, kRinv, kNumSaved };

// The forward and backward ops of one backend family: the native kernels, or the Triton ones.
struct NativeOps {
  static constexpr const char* kFwd = "attnres::depth_attn_fwd";
  static constexpr const char* kBwd = "attnres::depth_attn_bwd";
};
struct TritonOps {
  static constexpr const char* kFwd = "attnres_triton::depth_attn_fwd";
  static constexpr const char* kBwd = "attnres_triton::depth_attn_bwd";
};

template <typename Ops>
struct DepthAttnFunction : public torch::autograd::Function<DepthAttnFunction<Ops>> {
  static variable_list forward(AutogradContext* ctx, at::TensorList sources, const at::Tensor& query,
                               const OptTensor& norm_weight, const OptTensor& prefix_out, const OptTensor& prefix_lse,
                               const OptTensor& out_norm_weight, const ReadOptions& options) {
    static const auto fwd = find_op<FwdSignature>(Ops::kFwd);
    at::Tensor out, lse, logits, rinv;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse, logits, rinv) = std::apply(
          [&](auto... option) {
            return fwd.call(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, option...);
          },
          options.as_tuple());
    }
    ctx->mark_non_differentiable({rinv});
    ctx->set_materialize_grads(false);  // unused outputs (lse, logits) cost nothing in backward
    variable_list saved(sources.begin(), sources.end());
    for (const at::Tensor& t :
         {query, norm_weight.value_or(at::Tensor()), prefix_out.value_or(at::Tensor()),
          prefix_lse.value_or(at::Tensor()), out_norm_weight.value_or(at::Tensor()), logits, rinv})
      saved.push_back(t);
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["eps"] = options.eps;
    ctx->saved_data["out_norm_eps"] = options.out_norm_eps;
    ctx->saved_data["scale"] = options.scale;
    ctx->saved_data["normalize_values"] = options.normalize_values;
    ctx->saved_data["out_dtype"] = static_cast<int64_t>(out.scalar_type());
    ctx->saved_data["out_dtype_given"] = options.out_dtype.has_value();
    ctx->saved_data["key_rank"] = options.key_rank.value_or(0);  // 0: unset (full-width keys)
    return {out, lse, logits, rinv};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = saved.size() - kNumSaved;
    const std::vector<at::Tensor> sources(saved.begin(), saved.begin() + n);
    const at::Tensor* rest = saved.data() + n;
    const at::Tensor& query = rest[kQuery];
    const OptTensor norm_weight = present(rest[kNormWeight]), prefix_out = present(rest[kPrefixOut]),
                    prefix_lse = present(rest[kPrefixLse]), out_norm_weight = present(rest[kOutNormWeight]);
    const auto out_dtype = static_cast<at::ScalarType>(ctx->saved_data["out_dtype"].toInt());
    ReadOptions options{ctx->saved_data["eps"].toDouble(), ctx->saved_data["out_norm_eps"].toDouble(),
                        ctx->saved_data["scale"].toDouble(), ctx->saved_data["normalize_values"].toBool()};
    if (ctx->saved_data["out_dtype_given"].toBool()) options.out_dtype = out_dtype;
    if (const int64_t key_rank = ctx->saved_data["key_rank"].toInt()) options.key_rank = key_rank;
    const at::Tensor &grad_out = grads[0], &grad_lse = grads[1], &grad_logits = grads[2];

    std::vector<at::Tensor> result;  // one gradient per input of forward (options included)
    result.reserve(n + 6);
    if (at::GradMode::is_enabled()) {
      result = differentiable_backward(grad_out, grad_lse, grad_logits, sources, query, norm_weight, prefix_out,
                                       prefix_lse, out_norm_weight, options);
      // Inputs that do not require grad get no gradient (the Python side returns empty tensors for them).
      const at::Tensor* inputs[] = {&query, &rest[kNormWeight], &rest[kPrefixOut], &rest[kPrefixLse],
                                    &rest[kOutNormWeight]};
      for (size_t k = 0; k < n + 5; ++k) {
        const at::Tensor& input = k < n ? sources[k] : *inputs[k - n];
        if (!input.defined() || !input.requires_grad()) result[k] = at::Tensor();
      }
    } else {
      static const auto bwd = find_op<BwdSignature>(Ops::kBwd);
      at::Tensor dy = grad_out;
      if (!dy.defined()) {  // only lse or logits were used
        c10::SymDimVector shape;
        if (query.dim() == 2) shape.push_back(query.sym_size(0));
        shape.append(sources[0].sym_sizes().begin(), sources[0].sym_sizes().end());
        dy = at::zeros_symint(shape, sources[0].options().dtype(out_dtype));
      }
      // Below the Autograd key: the fused backward is not differentiable (grad mode is off
      // here), and its boxed autograd fallback would cost more than a small read's kernel.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      auto [d_sources, d_query, d_norm, d_prefix_out, d_prefix_lse, d_out_norm] = std::apply(
          [&](auto... option) {
            return bwd.call(dy, present(grad_lse), present(grad_logits), sources, query, norm_weight, prefix_out,
                            prefix_lse, out_norm_weight, rest[kLogits], rest[kRinv], option...);
          },
          options.as_tuple());
      result = std::move(d_sources);
      result.push_back(d_query);
      result.push_back(norm_weight ? d_norm : at::Tensor());
      result.push_back(prefix_out ? d_prefix_out : at::Tensor());
      result.push_back(prefix_lse ? d_prefix_lse : at::Tensor());
      result.push_back(out_norm_weight ? d_out_norm : at::Tensor());
    }
    result.emplace_back();  // the options
    return result;
  }

  static std::vector<at::Tensor> differentiable_backward(const at::Tensor& grad_out, const at::Tensor& grad_lse,
                                                         const at::Tensor& grad_logits,
                                                         const std::vector<at::Tensor>& sources,
                                                         const at::Tensor& query, const OptTensor& norm_weight,
                                                         const OptTensor& prefix_out, const OptTensor& prefix_lse,
                                                         const OptTensor& out_norm_weight, const ReadOptions& options) {
    static const auto op = find_op<DifferentiableBwdSignature>("attnres::depth_attn_bwd_differentiable");
    TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd),
                "attnres::depth_attn_fwd: a backward with create_graph=True (double backward) needs "
                "attnres::depth_attn_bwd_differentiable, which `import attnres_kernels` registers in Python; "
                "it is not registered in this process");
    return std::apply(
        [&](auto... option) {
          return op.call(present(grad_out), present(grad_lse), present(grad_logits), sources, query, norm_weight,
                         prefix_out, prefix_lse, out_norm_weight, option...);
        },
        options.as_tuple());
  }
};

template <typename Ops>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd_autograd(
    at::TensorList sources, const at::Tensor& query, const OptTensor& norm_weight, const OptTensor& prefix_out,
    const OptTensor& prefix_lse, const OptTensor& out_norm_weight, ATTNRES_READ_OPTIONS_PARAMS) {
  variable_list outputs = DepthAttnFunction<Ops>::apply(sources, query, norm_weight, prefix_out, prefix_lse,
                                                        out_norm_weight, ATTNRES_READ_OPTIONS);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) { m.impl("depth_attn_fwd", &depth_attn_fwd_autograd<NativeOps>); }

// Registered before Python defines the op (the dispatcher keeps the kernel until the schema arrives).
// On an H100 the Triton calls were host-bound (the forward's kernel 69 µs, its Python call path
// 360-510 µs); with torch.library.register_autograd's Python wrapper a Triton read's forward +
// backward cost 660-750 µs of host time on this project's CPU (9 sources, kernel launches stubbed
// out), with this autograd 410-440 µs.
TORCH_LIBRARY_IMPL(attnres_triton, Autograd, m) { m.impl("depth_attn_fwd", &depth_attn_fwd_autograd<TritonOps>); }

}  // namespace depth_read
}  // namespace autograd
}  // namespace attnres
