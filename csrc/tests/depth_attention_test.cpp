// C++ test of the registered CPU op, run by ctest: calls attnres::depth_attn_fwd
// and depth_attn_bwd through the dispatcher (no Python) and compares them with
// the same read written with plain ATen ops in double precision; checks mixed
// source dtypes, the C++ autograd of the forward, and that a double backward
// without the Python package fails with a clear error instead of a wrong result.
#include "../depth_attention.h"  // ReadOptions

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <optional>
#include <string>
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

bool check(bool ok, const std::string& what) {
  std::printf("%-56s %s\n", what.c_str(), ok ? "ok" : "FAILED");
  return ok;
}

// Error relative to the magnitude of `want`, within `tol` (about the precision of got's dtype).
bool close(const std::string& name, const at::Tensor& got, const at::Tensor& want, double tol = 1e-4) {
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  char what[128];
  std::snprintf(what, sizeof(what), "%s: max abs error %.3e", name.c_str(), err);
  return check(err < tol * (1.0 + want.abs().max().item<double>()), what);
}

double tolerance(at::ScalarType t) { return t == at::kBFloat16 ? 1e-2 : t == at::kHalf ? 2e-3 : 1e-4; }

auto fwd_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("attnres::depth_attn_fwd", "")
      .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(at::TensorList, const at::Tensor&, const Opt&,
                                                                        const Opt&, const Opt&, const Opt&,
                                                                        ATTNRES_READ_OPTIONS_TYPES)>();
}

auto bwd_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("attnres::depth_attn_bwd", "")
      .typed<std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const Opt&, const Opt&, at::TensorList, const at::Tensor&, const Opt&, const Opt&,
          const Opt&, const Opt&, const at::Tensor&, const at::Tensor&, ATTNRES_READ_OPTIONS_TYPES)>();
}

// The read of `query` over `sources` with no optional tensor inputs, options spread as the ops' trailing arguments.
auto fwd(const std::vector<at::Tensor>& sources, const at::Tensor& query, const attnres::ReadOptions& options) {
  return std::apply([&](auto... option) { return fwd_op().call(sources, query, {}, {}, {}, {}, option...); },
                    options.as_tuple());
}

auto bwd(const at::Tensor& dy, const std::vector<at::Tensor>& sources, const at::Tensor& query,
         const at::Tensor& logits, const at::Tensor& rinv, const attnres::ReadOptions& options) {
  return std::apply(
      [&](auto... option) {
        return bwd_op().call(dy, {}, {}, sources, query, {}, {}, {}, {}, logits, rinv, option...);
      },
      options.as_tuple());
}

// One read over sources of the given dtypes against the fp64 reference of the same values.
bool test_read(const std::vector<at::ScalarType>& dtypes, const char* label) {
  const int64_t m = 37, d = 100;
  const double eps = 1e-6;
  std::vector<at::Tensor> sources;
  at::ScalarType out_dtype = dtypes[0];
  for (auto t : dtypes) {
    sources.push_back(at::randn({m, d}).to(t));
    out_dtype = at::promote_types(out_dtype, t);
  }
  // A [1, D] query with no key-norm weight: u is the query itself.
  const at::Tensor u = 0.3 * at::randn({1, d});
  const at::Tensor dy = at::randn({1, m, d}).to(out_dtype);
  const attnres::ReadOptions options{eps};
  auto [out, lse, logits, rinv] = fwd(sources, u, options);
  auto [grad_sources, grad_u, grad_norm, grad_prefix_out, grad_prefix_lse, grad_g] =
      bwd(dy, sources, u, logits, rinv, options);
  const Reference ref = reference_read(sources, u, dy, eps);

  const std::string p = std::string(label) + " ";
  bool ok = check(out.scalar_type() == out_dtype, p + "output has the promoted dtype");
  ok = close(p + "out", out[0], ref.out, tolerance(out_dtype)) && ok;
  ok = close(p + "lse", lse[0], ref.lse) && ok;
  ok = close(p + "grad_u", grad_u, ref.grad_u, 1e-3) && ok;
  for (size_t i = 0; i < sources.size(); ++i) {
    ok = check(grad_sources[i].scalar_type() == dtypes[i], p + "grad_source in its source's dtype") && ok;
    ok = close(p + "grad_source", grad_sources[i], ref.grad_sources[i], tolerance(dtypes[i])) && ok;
  }
  return ok;
}

// The Autograd kernel (csrc/autograd) gives the fused backward's gradients, and a
// backward with create_graph=True fails loudly here (its differentiable backward
// is registered by the Python package, which this program does not load).
bool test_autograd() {
  const int64_t m = 9, d = 16;
  std::vector<at::Tensor> sources;
  for (int i = 0; i < 3; ++i) sources.push_back(at::randn({m, d}, at::kDouble).requires_grad_());
  const at::Tensor w = at::randn({d}, at::kDouble).requires_grad_();
  const at::Tensor dy = at::randn({m, d}, at::kDouble);
  auto [out, lse, logits, rinv] = fwd(sources, w, attnres::ReadOptions{});
  bool ok = check(out.requires_grad() && !rinv.requires_grad(), "autograd: out differentiable, rinv not");
  std::vector<at::Tensor> inputs = sources;
  inputs.push_back(w);
  const auto grads = torch::autograd::grad({out}, inputs, {dy}, /*retain_graph=*/true);
  at::Tensor no_grad_logits, no_grad_rinv;
  {
    at::NoGradGuard no_grad;
    auto [d_sources, d_query, d_norm, d_prefix_out, d_prefix_lse, d_g] =
        bwd(dy, sources, w, logits, rinv, attnres::ReadOptions{});
    for (size_t i = 0; i < sources.size(); ++i) ok = close("autograd grad_source", grads[i], d_sources[i], 1e-12) && ok;
    ok = close("autograd grad_query", grads.back(), d_query, 1e-12) && ok;
  }
  bool raised = false;
  try {
    torch::autograd::grad({out}, inputs, {dy}, /*retain_graph=*/true, /*create_graph=*/true);
  } catch (const c10::Error& e) {
    raised = std::string(e.what()).find("import attnres_kernels") != std::string::npos;
  }
  return check(raised, "double backward without Python raises a clear error") && ok;
}

}  // namespace

int main() {
  at::manual_seed(0);
  bool ok = test_read({at::kFloat, at::kFloat, at::kFloat, at::kFloat, at::kFloat}, "fp32");
  ok = test_read({at::kFloat, at::kBFloat16, at::kHalf, at::kBFloat16}, "fp32+bf16+fp16") && ok;
  ok = test_read({at::kBFloat16, at::kHalf}, "bf16+fp16") && ok;
  ok = test_read({at::kDouble, at::kFloat, at::kBFloat16}, "fp64+fp32+bf16") && ok;
  ok = test_autograd() && ok;
  return ok ? 0 : 1;
}
