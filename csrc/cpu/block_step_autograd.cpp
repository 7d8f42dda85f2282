// Native autograd of attnres::block_step_fwd, for every device: it
// redispatches below autograd to the op's CPU (or CUDA) kernel, and its
// backward calls attnres::block_step_bwd. It stands in for the Python autograd
// of torch.library.register_autograd, whose fixed cost per call (~1 ms here:
// the custom-op machinery, Python setup_context and backward) exceeds the
// kernels' own time at the sizes of a Block model, which runs the step once
// per sublayer.
//
// Saved for backward: new_partial (never the addends: keeping the old partial
// sum alive would cost O(L·d) memory), the site parameters, the prefix and the
// per-row scalars logit and rinv.
//
// Double backward: a backward that runs with create_graph=True computes the
// gradients with differentiable ATen ops instead of the kernel (see
// differentiable_grads), so higher-order gradients are exact, at the cost of
// plain ATen ops.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace attnres {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const std::optional<Tensor>&, const Tensor&,
                                                                        const Tensor&, const std::optional<Tensor>&,
                                                                        const Tensor&, const Tensor&,
                                                                        const std::optional<Tensor>&, double);
using BwdSignature = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
    const std::optional<Tensor>&, const std::optional<Tensor>&, const std::optional<Tensor>&, const Tensor&,
    const Tensor&, const std::optional<Tensor>&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
    const Tensor&, const Tensor&, double);

std::optional<Tensor> present(const Tensor& t) { return t.defined() ? std::optional<Tensor>(t) : std::nullopt; }

// The gradients block_step_bwd returns (grad_new_partial the total), computed
// with differentiable ATen ops from the saved tensors (the formulas of the
// kernels, DESIGN.md §2.1, with the read recomputed): their own graph gives the
// higher-order gradients. (Autograd through a recomputed forward would not do:
// new_partial is this node's own output, so a nested backward would re-enter it.)
std::vector<Tensor> differentiable_grads(const variable_list& saved, const Tensor& grad_new, const Tensor& grad_out,
                                         const Tensor& grad_lse, double eps) {
  const Tensor &new_partial = saved[0], &query = saved[1], &norm_weight = saved[2], &prefix_out = saved[3];
  const Tensor &prefix_lse = saved[4], &out_norm_weight = saved[5];
  const auto acc =
      at::promote_types(new_partial.scalar_type(), prefix_out.scalar_type()) == at::kDouble ? at::kDouble : at::kFloat;
  const double inv_d = 1.0 / static_cast<double>(new_partial.size(-1));
  const Tensor v = new_partial.to(acc), h_a = prefix_out.to(acc), lse_a = prefix_lse.to(acc);
  const Tensor u = norm_weight.defined() ? query.to(acc) * norm_weight.to(acc) : query.to(acc);
  const Tensor r = at::rsqrt(v.square().mean(-1) + eps);
  const Tensor s = r * (v * u).sum(-1);
  const Tensor top = at::maximum(lse_a, s).detach();
  const Tensor e_a = at::exp(lse_a - top), e_b = at::exp(s - top), z = e_a + e_b;
  const Tensor alpha_a = e_a / z, alpha_b = e_b / z;
  Tensor d_h = grad_out.defined() ? grad_out.to(acc) : at::zeros_like(v);
  Tensor d_g;
  if (out_norm_weight.defined()) {
    const Tensor h = alpha_a.unsqueeze(-1) * h_a + alpha_b.unsqueeze(-1) * v;
    const Tensor rstd = at::rsqrt(h.square().mean(-1, true) + eps);
    d_g = (d_h * h * rstd).reshape({-1, h.size(-1)}).sum(0).to(out_norm_weight.scalar_type());
    const Tensor gy = d_h * out_norm_weight.to(acc);
    d_h = rstd * gy - h * (rstd.pow(3) * (gy * h).sum(-1, true) * inv_d);
  }
  const Tensor dp_a = (d_h * h_a).sum(-1), dp_b = (d_h * v).sum(-1);
  const Tensor delta = alpha_a * dp_a + alpha_b * dp_b;
  const Tensor d_lse = grad_lse.defined() ? grad_lse.to(acc) : at::zeros_like(delta);
  const Tensor ds = alpha_b * (dp_b - delta + d_lse);
  const Tensor c1 = (ds * r).unsqueeze(-1), c2 = (ds * s * r * r * inv_d).unsqueeze(-1);
  Tensor d_new = (alpha_b.unsqueeze(-1) * d_h + c1 * u - c2 * v).to(new_partial.scalar_type());
  if (grad_new.defined()) d_new = d_new + grad_new;
  const Tensor d_u = (c1 * v).reshape({-1, v.size(-1)}).sum(0);
  const Tensor d_query = (norm_weight.defined() ? d_u * norm_weight.to(acc) : d_u).to(query.scalar_type());
  const Tensor d_norm = norm_weight.defined() ? (d_u * query.to(acc)).to(norm_weight.scalar_type()) : Tensor();
  const Tensor d_prefix_out = (alpha_a.unsqueeze(-1) * d_h).to(prefix_out.scalar_type());
  const Tensor d_prefix_lse = (alpha_a * (dp_a - delta + d_lse)).to(prefix_lse.scalar_type());
  return {d_new, d_query, d_norm, d_prefix_out, d_prefix_lse, d_g};
}

class BlockStepFunction : public torch::autograd::Function<BlockStepFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const std::optional<Tensor>& partial, const Tensor& update,
                               const Tensor& query, const std::optional<Tensor>& norm_weight, const Tensor& prefix_out,
                               const Tensor& prefix_lse, const std::optional<Tensor>& out_norm_weight, double eps) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("attnres::block_step_fwd", "").typed<FwdSignature>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [new_partial, out, lse, logit, rinv] =
        op.call(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps);
    ctx->mark_non_differentiable({logit, rinv});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({new_partial, query, norm_weight.value_or(Tensor()), prefix_out, prefix_lse,
                            out_norm_weight.value_or(Tensor()), logit, rinv});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["partial_dtype"] = partial.has_value() ? static_cast<int64_t>(partial->scalar_type()) : -1;
    ctx->saved_data["update_dtype"] = static_cast<int64_t>(update.scalar_type());
    return {new_partial, out, lse, logit, rinv};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("attnres::block_step_bwd", "").typed<BwdSignature>();
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &new_partial = saved[0], &query = saved[1], &norm_weight = saved[2], &prefix_out = saved[3];
    const Tensor &prefix_lse = saved[4], &out_norm_weight = saved[5];
    const double eps = ctx->saved_data["eps"].toDouble();
    std::vector<Tensor> grads(6);
    if (at::GradMode::is_enabled()) {  // create_graph=True
      grads = differentiable_grads(saved, grad_outputs[0], grad_outputs[1], grad_outputs[2], eps);
    } else {
      auto result =
          op.call(present(grad_outputs[0]), present(grad_outputs[1]), present(grad_outputs[2]), new_partial, query,
                  present(norm_weight), prefix_out, prefix_lse, present(out_norm_weight), saved[6], saved[7], eps);
      grads = {std::get<0>(result), std::get<1>(result), std::get<2>(result),
               std::get<3>(result), std::get<4>(result), std::get<5>(result)};
    }
    const int64_t partial_dtype = ctx->saved_data["partial_dtype"].toInt();
    const auto update_dtype = static_cast<at::ScalarType>(ctx->saved_data["update_dtype"].toInt());
    const Tensor& grad_total = grads[0];  // autograd hands the sum's gradient to both addends
    return {partial_dtype >= 0 ? grad_total.to(static_cast<at::ScalarType>(partial_dtype)) : Tensor(),
            grad_total.to(update_dtype),
            grads[1],
            norm_weight.defined() ? grads[2] : Tensor(),
            grads[3],
            grads[4],
            out_norm_weight.defined() ? grads[5] : Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> block_step_fwd_autograd(
    const std::optional<Tensor>& partial, const Tensor& update, const Tensor& query,
    const std::optional<Tensor>& norm_weight, const Tensor& prefix_out, const Tensor& prefix_lse,
    const std::optional<Tensor>& out_norm_weight, double eps) {
  const variable_list out =
      BlockStepFunction::apply(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, Autograd, m) { m.impl("block_step_fwd", &block_step_fwd_autograd); }

}  // namespace attnres
