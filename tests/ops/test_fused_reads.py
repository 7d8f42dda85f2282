"""Every fused backend against the reference: forward, backward, gradcheck, opcheck.

The C++ CPU op runs the full grid of shapes; Triton runs a smaller grid because
here it executes under the interpreter (``TRITON_INTERPRET=1``, one program at
a time in numpy).
"""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels._validation import PAPER_READ, ReadOptions
from tests.support import (
    assert_close_to_oracle,
    attnres_ops_called,
    make_sources,
    read_with_grads,
    reference_and_oracle,
    site_params,
)

FUSED = [b for b in ("cpu", "triton") if b in ak.available_backends("cpu", 1000)]
OP_NAMES = {"cpu": "attnres::depth_attn", "triton": "attnres_triton::depth_attn"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def test_fused_backends_are_available():
    """The CPU op must be built here; a silently missing backend must not shrink the suite."""
    assert "cpu" in FUSED, ak.build_info()
    assert "triton" in FUSED, "Triton interpreter backend unavailable (TRITON_INTERPRET=1 and triton installed?)"


def _grid(backend):
    if backend == "cpu":
        dims, counts, leads = (1, 7, 128, 1000), (1, 2, 5, 33), ((3,), (2, 5, 11))
    else:
        dims, counts, leads = (1, 7, 100), (1, 3, 9), ((3,), (2, 3))
    cases = []
    for k, (dtype, d, n, lead) in enumerate(itertools.product(DTYPES, dims, counts, leads)):
        layout = ("contiguous", "strided", "transposed" if len(lead) > 1 else "strided")[k % 3]
        case_id = f"{backend}-{dtype}-D{d}-N{n}-{lead}-{layout}"
        cases.append(pytest.param(backend, dtype, d, n, lead, layout, id=case_id))
    return cases


def compare_read(backend, sources, q, out_norm, prefix_split=None):
    """Forward outputs and all gradients of ``backend`` vs the reference (2x rule)."""
    d = sources[0].shape[-1]
    w, g, g_out = site_params(q, d)
    g_out = g_out if out_norm else None
    extra = []
    if prefix_split is not None:
        head = make_sources(prefix_split, sources[0].shape[:-1], d, sources[0].dtype)
        h_a, lse_a = reference.depth_attention(w, head, g, return_lse=True)
        extra = [h_a, lse_a]

    def run(impl):
        def fn(srcs, w, g, g_out, *prefix):
            if prefix:
                return impl["merge"](w, prefix[0], prefix[1], srcs, g, out_norm_weight=g_out, return_lse=True)
            return impl["read"](w, srcs, g, out_norm_weight=g_out, return_lse=True, return_weights=True)

        return fn

    fused_impl = {
        "read": lambda *a, **k: ak.depth_attention(*a, backend=backend, **k),
        "merge": lambda *a, **k: ak.depth_attention_merge(*a, backend=backend, **k),
    }
    ref_impl = {"read": reference.depth_attention, "merge": reference.depth_attention_merge}
    params = [w, g, g_out, *extra]
    with torch.no_grad():
        shapes = [o.shape for o in run(ref_impl)(sources, *params)]
    out_weights = [torch.randn(s, dtype=torch.float64) for s in shapes]
    fused = read_with_grads(run(fused_impl), sources, params, out_weights)
    same, oracle = reference_and_oracle(run(ref_impl), sources, params, out_weights)
    names = ["out", "lse", "weights"][: len(shapes)]
    for name, a, b, c in zip(names, fused[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    grad_names = ["d_sources", "d_query", "d_norm_weight"]
    grad_names += ["d_out_norm_weight"] if out_norm else []
    grad_names += ["d_prefix_out", "d_prefix_lse"] if extra else []
    n = len(sources)
    for a, b in zip(fused[1], same[1]):
        assert a.dtype == b.dtype and a.shape == b.shape

    def grouped(grads):
        # The N source gradients come from one computation: judged as one tensor.
        return [torch.cat([x.flatten() for x in grads[:n]])] + grads[n:]

    for name, a, b, c in zip(grad_names, grouped(fused[1]), grouped(same[1]), grouped(oracle[1])):
        assert_close_to_oracle(name, a, b, c)


@pytest.mark.parametrize("backend,dtype,d,n,lead,layout", [c for b in FUSED for c in _grid(b)])
def test_single_site_matches_reference(backend, dtype, d, n, lead, layout):
    compare_read(backend, make_sources(n, lead, d, dtype, layout), q=None, out_norm=False)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q,out_norm", [(1, False), (3, True), (5, False), (2, True)])
def test_multi_query_and_out_norm_match_reference(backend, dtype, q, out_norm):
    compare_read(backend, make_sources(4, (2, 3), 37, dtype, "strided"), q=q, out_norm=out_norm)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q,out_norm,n_b", [(None, False, 1), (None, True, 3), (3, True, 2), (2, False, 4)])
def test_merge_matches_reference(backend, dtype, q, out_norm, n_b):
    compare_read(backend, make_sources(n_b, (5,), 19, dtype), q=q, out_norm=out_norm, prefix_split=2)


@pytest.mark.parametrize("backend", FUSED)
def test_merge_equals_fused_read_over_union(backend):
    sources = make_sources(6, (4, 3), 24, torch.float64)
    w, g, g_out = site_params(2, 24, torch.float64)
    h_a, lse_a = ak.depth_attention(w, sources[:4], g, return_lse=True, backend=backend)
    merged = ak.depth_attention_merge(
        w, h_a, lse_a, sources[4:], g, out_norm_weight=g_out, return_lse=True, backend=backend
    )
    whole = ak.depth_attention(w, sources, g, out_norm_weight=g_out, return_lse=True, backend=backend)
    for a, b in zip(merged, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _gradcheck_inputs(q, d=5, n=3, rows=(2,)):
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    qs = (d,) if q is None else (q, d)
    return [mk(*rows, d) for _ in range(n)], mk(*qs), mk(*qs), mk(*qs)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("variant", ["single", "multi_query", "out_norm", "merge", "merge_out_norm"])
def test_gradcheck_fp64(backend, variant):
    """Every differentiable input, including through lse and the weights."""
    q = 2 if variant.startswith(("multi", "merge")) else None
    sources, w, g, g_out = _gradcheck_inputs(q)
    use_norm = variant.endswith("out_norm")
    if variant.startswith("merge"):
        h_a = torch.randn(2, 2, 5, dtype=torch.float64, requires_grad=True)
        lse_a = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)

        def fn(*args):
            *srcs, w, g, g_out, h_a, lse_a = args
            return ak.depth_attention_merge(
                w, h_a, lse_a, srcs, g, out_norm_weight=g_out if use_norm else None, return_lse=True, backend=backend
            )

        inputs = (*sources, w, g, g_out, h_a, lse_a)
    else:

        def fn(*args):
            *srcs, w, g, g_out = args
            return ak.depth_attention(
                w,
                srcs,
                g,
                out_norm_weight=g_out if use_norm else None,
                return_lse=True,
                return_weights=True,
                backend=backend,
            )

        inputs = (*sources, w, g, g_out)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", FUSED)
def test_the_fused_op_ran_not_the_reference(backend):
    sources, w, g, g_out = _gradcheck_inputs(None)

    def step():
        out = ak.depth_attention(w, sources, g, out_norm_weight=g_out, backend=backend)
        out.sum().backward()

    called = attnres_ops_called(step)
    assert {OP_NAMES[backend] + "_fwd", OP_NAMES[backend] + "_bwd"} <= called, called


def test_auto_uses_the_cpu_op_for_cpu_tensors():
    sources, w, g, _ = _gradcheck_inputs(None)
    assert ak.ops.resolve_backend("auto", torch.device("cpu"), 5) == "cpu"
    assert "attnres::depth_attn_fwd" in attnres_ops_called(lambda: ak.depth_attention(w, sources, g))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in Triton's interpreter
@pytest.mark.parametrize("backend", FUSED)
def test_nan_and_inf_propagate_like_reference(backend):
    sources = make_sources(3, (5,), 8)
    sources[1][2, 3] = float("nan")
    sources[2][4, 0] = float("inf")
    w, g, g_out = site_params(None, 8)
    for kwargs in ({}, {"out_norm_weight": g_out}):
        got = ak.depth_attention(w, sources, g, backend=backend, **kwargs)
        want = reference.depth_attention(w, sources, g, **kwargs)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        torch.testing.assert_close(got[finite], want[finite])
    srcs = [s.clone().requires_grad_() for s in sources]
    ak.depth_attention(w, srcs, g, backend=backend).sum().backward()
    assert srcs[0].grad.isnan().any()  # NaN rows carry NaN gradients; no crash, no hang


@pytest.mark.parametrize("backend", FUSED)
def test_fp16_large_magnitudes_stay_finite(backend):
    sources = make_sources(4, (6,), 64, torch.float16, scale=1e4)
    assert sources[0].abs().max() > 1e4
    w, g, g_out = site_params(None, 64)
    for kwargs in ({}, {"out_norm_weight": g_out}):
        got = ak.depth_attention(w, sources, g, backend=backend, **kwargs)
        assert torch.isfinite(got).all()
        want = reference.depth_attention(w, sources, g, **kwargs)
        oracle = reference.depth_attention(
            w.double(), [s.double() for s in sources], g.double(), **{k: v.double() for k, v in kwargs.items()}
        )
        assert_close_to_oracle("out", got, want, oracle)


@pytest.mark.parametrize("backend", FUSED)
def test_empty_leading_dims(backend):
    sources = [torch.randn(0, 3, 8, requires_grad=True) for _ in range(2)]
    out = ak.depth_attention(torch.randn(8), sources, backend=backend)
    assert out.shape == (0, 3, 8)
    out.sum().backward()
    assert sources[0].grad.shape == (0, 3, 8)


def _op_samples(q=2, d=6, rows=(3, 2), n=3):
    """Argument tuples of ``depth_attn_fwd``: [Q, D] and [D] queries, shared and
    per-site weights, with and without prefix, grads required or not."""
    sources = [torch.randn(*rows, d, requires_grad=True) for _ in range(n)]
    w = torch.randn(q, d, requires_grad=True)
    gamma = torch.rand(q, d, requires_grad=True)
    g = torch.rand(d, requires_grad=True)
    h_a = torch.randn(q, *rows, d, requires_grad=True)
    lse_a = torch.randn(q, *rows, requires_grad=True)
    w1, h_a1, lse_a1 = w[0].detach().requires_grad_(), h_a[0].detach(), lse_a[0].detach()
    paper, scaled = PAPER_READ, ReadOptions(1e-5, 1e-3, 0.25)
    inkling2 = ReadOptions(1e-6, 1e-5, d**-0.5, True, torch.float64)
    return [
        (sources, w, None, None, None, None, *paper),
        (sources, w, gamma, None, None, g, *scaled),
        (sources, w, g, h_a, lse_a, gamma, *paper),
        (sources, w1, g, h_a1, lse_a1, g, *paper),
        ([s.detach() for s in sources], w.detach(), None, h_a.detach(), lse_a.detach(), None, *paper),
        (sources, w, None, None, None, g, *inkling2),
        (sources, w1, None, h_a1, lse_a1, None, *inkling2._replace(out_dtype=None)),
    ]


@pytest.mark.parametrize("backend", FUSED)
def test_opcheck(backend):
    op = (torch.ops.attnres if backend == "cpu" else ak.ops._dispatch.triton_ops()).depth_attn_fwd.default
    for args in _op_samples():
        torch.library.opcheck(op, args)
