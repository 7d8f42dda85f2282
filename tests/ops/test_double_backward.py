"""Higher-order gradients of the C++ depth read are exact, never silently wrong.

The fused backward kernels are not differentiable; a backward that runs with
``create_graph=True`` goes through ``attnres::depth_attn_bwd_differentiable``
(autograd through the reference). ``gradgradcheck`` in float64 checks the
result against finite differences of the first-order gradients.
"""

import pytest
import torch

import attnres_kernels as ak
from tests.support import attnres_ops_called

pytestmark = pytest.mark.skipif("cpu" not in ak.available_backends("cpu"), reason=ak.build_info())

VARIANTS = ["single", "multi_query", "out_norm", "merge", "merge_out_norm", "weights"]


def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def read_and_inputs(variant, d=4, n=3, rows=(2,)):
    """A function of fp64 tensors running one CPU read of ``variant``, and its inputs."""
    q = 2 if variant in ("multi_query", "merge", "merge_out_norm") else None
    qs = (d,) if q is None else (q, d)
    sources = [_f64(*rows, d) for _ in range(n)]
    w, g, g_out = _f64(*qs), _f64(*qs), _f64(*qs)
    out_norm = variant.endswith("out_norm")
    if variant.startswith("merge"):
        h_a, lse_a = _f64(q, *rows, d), _f64(q, *rows)

        def fn(*args):
            *srcs, w, g, g_out, h_a, lse_a = args
            return ak.depth_attention_merge(
                w, h_a, lse_a, srcs, g, out_norm_weight=g_out if out_norm else None, return_lse=True, backend="cpu"
            )

        return fn, (*sources, w, g, g_out, h_a, lse_a)

    def fn(*args):
        *srcs, w, g, g_out = args
        return ak.depth_attention(
            w,
            srcs,
            g,
            out_norm_weight=g_out if out_norm else None,
            return_lse=True,
            return_weights=variant == "weights",
            backend="cpu",
        )

    return fn, (*sources, w, g, g_out)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradgradcheck_fp64(variant):
    fn, inputs = read_and_inputs(variant)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_gradgradcheck_when_only_the_query_requires_grad():
    """Inputs that do not require grad get no gradient from the differentiable backward."""
    sources = [torch.randn(3, 5, dtype=torch.float64) for _ in range(3)]
    g = torch.rand(5, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(
        lambda w: ak.depth_attention(w, sources, g, out_norm_weight=g, backend="cpu"), (_f64(5),)
    )


def test_gradgradcheck_mixed_dtypes():
    """fp32 sources in an fp64 read: second-order gradients w.r.t. the fp64 inputs."""
    fp32 = [torch.randn(2, 4) for _ in range(2)]
    fp64 = [_f64(2, 4), _f64(2, 4)]

    def fn(a, b, w, g):
        return ak.depth_attention(w, [fp32[0], a, fp32[1], b], g, return_lse=True, backend="cpu")

    assert torch.autograd.gradgradcheck(fn, (*fp64, _f64(4), _f64(4)))


def test_double_backward_goes_through_the_differentiable_op():
    fn, inputs = read_and_inputs("out_norm")

    def gradient_penalty():
        out, lse = fn(*inputs)
        # A loss linear in the outputs: the second backward never reaches the read's first-order node.
        loss = (out * torch.randn_like(out)).sum() + (lse * torch.randn_like(lse)).sum()
        grads = torch.autograd.grad(loss, inputs, create_graph=True)
        sum(g.square().sum() for g in grads).backward()

    called = attnres_ops_called(gradient_penalty)
    assert {"attnres::depth_attn_fwd", "attnres::depth_attn_bwd_differentiable"} <= called, called
    assert "attnres::depth_attn_bwd" not in called  # the fused backward is not differentiable


def test_first_order_backward_runs_the_fused_kernel():
    fn, inputs = read_and_inputs("merge_out_norm")

    def backward():
        out, lse = fn(*inputs)
        torch.autograd.grad(out.sum() + lse.sum(), inputs)

    called = attnres_ops_called(backward)
    assert "attnres::depth_attn_bwd" in called and "attnres::depth_attn_bwd_differentiable" not in called


def test_create_graph_gradients_when_inputs_depend_on_each_other():
    """norm_weight computed from the query, sources from one tensor: the gradients made with
    create_graph=True are partial derivatives per input (as the fused kernel's), not total
    derivatives through the other inputs."""
    x, w = _f64(3, 4), _f64(4)

    def fn(x, w):
        return ak.depth_attention(w, [x.sin(), 2 * x], w.exp(), return_lse=True, backend="cpu")

    outs = fn(x, w)
    weights = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, (x, w), weights, retain_graph=True)
    with_graph = torch.autograd.grad(outs, (x, w), weights, create_graph=True)
    for a, b in zip(plain, with_graph):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(fn, (x, w))
