// C++ test of the registered CPU op, run by ctest: calls attnres::depth_attn_fwd
// and depth_attn_bwd through the dispatcher (no Python) and compares them with
// the same read written with plain ATen ops in double precision.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using Opt = std::optional<at::Tensor>;

struct Reference {
  at::Tensor out, lse, grad_u;
  std::vector<at::Tensor> grad_sources;
};

// DESIGN.md §2.1 for one site, with autograd for the gradients.
Reference reference_read(const std::vector<at::Tensor>& sources, const at::Tensor& u, const at::Tensor& dy,
                         double eps) {
  std::vector<at::Tensor> leaves;
  for (const auto& s : sources) leaves.push_back(s.to(at::kDouble).detach().requires_grad_());
  at::Tensor ud = u.to(at::kDouble).detach().requires_grad_();
  at::Tensor v = at::stack(leaves);                   // [N, M, D]
  at::Tensor r = at::rsqrt(v.pow(2).mean(-1) + eps);  // [N, M]
  at::Tensor s = at::matmul(v, ud[0]) * r;            // [N, M]
  at::Tensor alpha = at::softmax(s, 0);
  at::Tensor h = (alpha.unsqueeze(-1) * v).sum(0);  // [M, D]
  (h * dy.to(at::kDouble)[0]).sum().backward();
  Reference ref{h.detach(), at::logsumexp(s, 0).detach(), ud.grad(), {}};
  for (auto& l : leaves) ref.grad_sources.push_back(l.grad());
  return ref;
}

bool close(const char* name, const at::Tensor& got, const at::Tensor& want) {
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  const bool ok = err < 1e-4 * (1.0 + want.abs().max().item<double>());
  std::printf("%-14s max abs error %.3e %s\n", name, err, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main() {
  at::manual_seed(0);
  const int64_t n = 5, m = 37, d = 100;
  const double eps = 1e-6;
  std::vector<at::Tensor> sources;
  for (int64_t i = 0; i < n; ++i) sources.push_back(at::randn({m, d}));
  const at::Tensor u = 0.3 * at::randn({1, d});
  const at::Tensor dy = at::randn({1, m, d});

  auto fwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attn_fwd", "")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                     at::TensorList, const at::Tensor&, const Opt&, const Opt&, const Opt&, const Opt&, double)>();
  auto bwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("attnres::depth_attn_bwd", "")
                 .typed<std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                     const at::Tensor&, const Opt&, const Opt&, at::TensorList, const at::Tensor&, const Opt&,
                     const Opt&, const Opt&, const Opt&, const at::Tensor&, const at::Tensor&, double)>();

  // A [1, D] query with no key-norm weight: u is the query itself.
  auto [out, lse, logits, rinv] = fwd.call(sources, u, std::nullopt, std::nullopt, std::nullopt, std::nullopt, eps);
  auto [grad_sources, grad_u, grad_norm, grad_prefix_out, grad_prefix_lse, grad_g] =
      bwd.call(dy, std::nullopt, std::nullopt, sources, u, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
               logits, rinv, eps);
  const Reference ref = reference_read(sources, u, dy, eps);

  bool ok = close("out", out[0], ref.out) && close("lse", lse[0], ref.lse) && close("grad_u", grad_u, ref.grad_u);
  for (int64_t i = 0; i < n; ++i) ok = close("grad_source", grad_sources[i], ref.grad_sources[i]) && ok;
  return ok ? 0 : 1;
}
