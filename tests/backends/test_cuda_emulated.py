"""The CUDA kernels (csrc/cuda/) run on CPU tensors by the SIMT harness (ATTNRES_CUDA_EMULATE=1):
forward, backward, gradcheck and opcheck of the very kernel code nvcc compiles, with the
launch configuration of the real build. Shapes stay tiny: every CUDA thread is a fiber."""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels._validation import PAPER_READ, ReadOptions
from attnres_kernels.cuda import emulation
from tests.support import (
    assert_backward_checks_saved_tensors,
    assert_close_to_oracle,
    attnres_ops_called,
    make_sources,
    read_with_grads,
    reference_and_oracle,
    site_params,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


pytestmark = pytest.mark.usefixtures("cuda_emulation")


def compare_read(sources, q, out_norm, prefix_split=None, weights=True):
    """Outputs and every gradient of backend="cuda" (emulated) vs the reference (FlashAttention's rule)."""
    d = sources[0].shape[-1]
    w, g, g_out = site_params(q, d)
    g_out = g_out if out_norm else None
    extra = []
    if prefix_split is not None:
        head = make_sources(prefix_split, sources[0].shape[:-1], d, sources[0].dtype)
        extra = list(reference.depth_attention(w, head, g, return_lse=True))

    def run(read, merge):
        def fn(srcs, w, g, g_out, *prefix):
            if prefix:
                return merge(w, prefix[0], prefix[1], srcs, g, out_norm_weight=g_out, return_lse=True)
            return read(w, srcs, g, out_norm_weight=g_out, return_lse=True, return_weights=weights)

        return fn

    fused = run(
        lambda *a, **k: ak.depth_attention(*a, backend="cuda", **k),
        lambda *a, **k: ak.depth_attention_merge(*a, backend="cuda", **k),
    )
    ref = run(reference.depth_attention, reference.depth_attention_merge)
    params = [w, g, g_out, *extra]
    with torch.no_grad():
        shapes = [o.shape for o in ref(sources, *params)]
    out_weights = [torch.randn(s, dtype=torch.float64) for s in shapes]
    got = read_with_grads(fused, sources, params, out_weights)
    same, oracle = reference_and_oracle(ref, sources, params, out_weights)
    for name, a, b, c in zip(["out", "lse", "weights"], got[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    n = len(sources)
    for a, b in zip(got[1], same[1]):
        assert a.dtype == b.dtype and a.shape == b.shape

    def grouped(grads):  # the N source gradients come from one computation: judged as one tensor
        return [torch.cat([x.flatten() for x in grads[:n]])] + grads[n:]

    for i, (a, b, c) in enumerate(zip(grouped(got[1]), grouped(same[1]), grouped(oracle[1]))):
        assert_close_to_oracle(f"grad[{i}]", a, b, c)
    launches = [x.kernel for x in emulation.launch_log()]
    assert any(k.startswith("depth_attn_fwd<") for k in launches), launches
    assert any(k.startswith("depth_attn_bwd<") for k in launches), launches


def _grid():
    """dtype × D × N, with leading dims and layouts cycling; few rows at the widest D."""
    cases = []
    layouts = ("contiguous", "strided", "transposed")
    for k, (dtype, d, n) in enumerate(itertools.product(DTYPES, (1, 7, 100, 1000, 4096), (1, 3, 17))):
        lead = ((2,), (2, 3), (3, 1, 2))[k % 3] if d < 1000 else ((2,), (1, 2))[k % 2]
        layout = layouts[k % 3] if len(lead) > 1 else layouts[k % 2]
        cases.append(pytest.param(dtype, d, n, lead, layout, id=f"{dtype}-D{d}-N{n}-{lead}-{layout}"))
    return cases


@pytest.mark.parametrize("dtype,d,n,lead,layout", _grid())
def test_single_site_matches_reference(dtype, d, n, lead, layout):
    compare_read(make_sources(n, lead, d, dtype, layout), q=None, out_norm=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q,out_norm,d", [(1, False, 37), (3, True, 37), (8, True, 24), (8, False, 600), (3, True, 1000)]
)
def test_multi_query_and_out_norm_match_reference(dtype, q, out_norm, d):
    compare_read(make_sources(4, (2, 3), d, dtype, "strided"), q=q, out_norm=out_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q,out_norm,n_b", [(None, False, 1), (None, True, 3), (3, True, 2), (8, False, 2)])
def test_merge_matches_reference(dtype, q, out_norm, n_b):
    compare_read(make_sources(n_b, (5,), 19, dtype), q=q, out_norm=out_norm, prefix_split=2)


def test_merge_equals_read_over_union():
    sources = make_sources(6, (4, 3), 24, torch.float64)
    w, g, g_out = site_params(2, 24, torch.float64)
    h_a, lse_a = ak.depth_attention(w, sources[:4], g, return_lse=True, backend="cuda")
    merged = ak.depth_attention_merge(
        w, h_a, lse_a, sources[4:], g, out_norm_weight=g_out, return_lse=True, backend="cuda"
    )
    whole = ak.depth_attention(w, sources, g, out_norm_weight=g_out, return_lse=True, backend="cuda")
    for a, b in zip(merged, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", ["single", "multi_query", "out_norm", "merge", "merge_out_norm"])
def test_gradcheck_fp64(variant):
    """Every differentiable input, through lse and the weights, of the CUDA kernel code in fp64."""
    q = 3 if variant.startswith(("multi", "merge")) else None
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    qs = (5,) if q is None else (q, 5)
    sources, w, g, g_out = [mk(2, 5) for _ in range(3)], mk(*qs), mk(*qs), mk(*qs)
    use_norm = variant.endswith("out_norm")
    if variant.startswith("merge"):
        h_a, lse_a = mk(q, 2, 5), mk(q, 2)

        def fn(*args):
            *srcs, w, g, g_out, h_a, lse_a = args
            norm = g_out if use_norm else None
            return ak.depth_attention_merge(
                w, h_a, lse_a, srcs, g, out_norm_weight=norm, return_lse=True, backend="cuda"
            )

        inputs = (*sources, w, g, g_out, h_a, lse_a)
    else:

        def fn(*args):
            *srcs, w, g, g_out = args
            norm = g_out if use_norm else None
            return ak.depth_attention(
                w, srcs, g, out_norm_weight=norm, return_lse=True, return_weights=True, backend="cuda"
            )

        inputs = (*sources, w, g, g_out)
    assert torch.autograd.gradcheck(fn, inputs)


def _op_samples(q=3, d=6, rows=(3, 2), n=3):
    sources = [torch.randn(*rows, d, requires_grad=True) for _ in range(n)]
    w = torch.randn(q, d, requires_grad=True)
    gamma = torch.rand(q, d, requires_grad=True)
    g = torch.rand(d, requires_grad=True)
    h_a = torch.randn(q, *rows, d, requires_grad=True)
    lse_a = torch.randn(q, *rows, requires_grad=True)
    w1, h_a1, lse_a1 = w[0].detach().requires_grad_(), h_a[0].detach(), lse_a[0].detach()
    mixed = [
        s.detach().to(dt).requires_grad_() for s, dt in zip(sources, (torch.float32, torch.bfloat16, torch.float16))
    ]
    return [
        (sources, w, gamma, None, None, g, *ReadOptions(1e-5, 1e-5, 0.5)),
        (sources, w, g, h_a, lse_a, gamma, *PAPER_READ),
        (sources, w1, g, h_a1, lse_a1, g, *PAPER_READ),
        (mixed, w, gamma, None, None, g, *PAPER_READ),
    ]


def test_opcheck():
    for args in _op_samples():
        torch.library.opcheck(torch.ops.attnres_emu.depth_attn_fwd.default, args)


def test_schema_matches_the_native_op():
    """attnres_emu:: states the schemas of attnres:: (csrc/bindings.cpp) a second time: they must agree."""
    if not ak._native.available():
        pytest.skip("the C++ extension is not built")
    for name in ("depth_attn_fwd", "depth_attn_bwd"):
        emu = getattr(torch.ops.attnres_emu, name).default._schema
        native = getattr(torch.ops.attnres, name).default._schema
        assert (emu.arguments, emu.returns) == (native.arguments, native.returns) or str(emu).split("::")[1] == str(
            native
        ).split("::")[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("merge", [False, True])
def test_bitwise_deterministic_run_to_run(dtype, merge):
    # 40 rows: three row chunks in the backward's du reduction; Q = 3 sites, one partial tile.
    sources = make_sources(3, (5, 8), 40, dtype)
    w, g, g_out = site_params(3, 40)
    prefix = reference.depth_attention(w, make_sources(2, (5, 8), 40, dtype), g, return_lse=True) if merge else None

    def run():
        srcs = [s.clone().requires_grad_() for s in sources]
        params = [p.clone().requires_grad_() for p in (w, g, g_out)]
        if prefix is None:
            out, lse = ak.depth_attention(
                params[0], srcs, params[1], out_norm_weight=params[2], return_lse=True, backend="cuda"
            )
        else:
            out, lse = ak.depth_attention_merge(
                params[0], *prefix, srcs, params[1], out_norm_weight=params[2], return_lse=True, backend="cuda"
            )
        gen = torch.Generator().manual_seed(0)
        loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() + (
            lse * torch.randn(lse.shape, generator=gen)
        ).sum()
        return [out, lse, *torch.autograd.grad(loss, srcs + params)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_the_emulated_cuda_kernels_ran():
    sources = [torch.randn(3, 16, requires_grad=True) for _ in range(2)]
    w = torch.randn(16, requires_grad=True)

    def step():
        ak.depth_attention(w, sources, backend="cuda").sum().backward()

    called = attnres_ops_called(step)
    assert {"attnres_emu::depth_attn_fwd", "attnres_emu::depth_attn_bwd"} <= called, called
    kernels = [x.kernel for x in emulation.launch_log()]
    assert kernels[0].startswith("depth_attn_fwd<float") and kernels[1].startswith("depth_attn_bwd<float"), kernels
    assert kernels[2:] == ["site_grads<float>"], kernels


def test_cpu_tensors_need_the_emulation_switch(monkeypatch):
    monkeypatch.delenv(emulation.ENV)
    with pytest.raises(ak.ops.BackendUnavailableError, match="ATTNRES_CUDA_EMULATE"):
        ak.depth_attention(torch.randn(8), [torch.randn(2, 8)], backend="cuda")
    assert "cuda" not in ak.available_backends("cpu", 8)


def test_rows_wider_than_the_kernels_are_refused():
    assert "cuda" in ak.available_backends("cpu", 4096)
    assert "cuda" not in ak.available_backends("cpu", 4097)
    with pytest.raises(ak.ops.BackendUnavailableError, match="D <= 4096"):
        ak.depth_attention(torch.randn(4097), [torch.randn(1, 4097)], backend="cuda")
    # The op itself states the same limit (Python and C++ agree).
    with pytest.raises(ValueError, match="1 <= D <= 4096"):
        torch.ops.attnres_emu.depth_attn_fwd(
            [torch.randn(1, 4097)], torch.randn(4097), None, None, None, None, *PAPER_READ
        )


def test_grid_stride_and_several_teams_per_block():
    """The forward grid is bounded (a one-SM "GPU" in the harness), so rows are grid-strided;
    narrow rows put four one-warp teams in a block."""
    sources = make_sources(2, (100,), 8)
    w = torch.randn(8)
    want = reference.depth_attention(w, sources)
    got = ak.depth_attention(w, sources, backend="cuda")
    torch.testing.assert_close(got, want)
    (fwd,) = [x for x in emulation.launch_log() if x.kernel.startswith("depth_attn_fwd")]
    assert fwd.block[:2] == (32, 4)
    assert fwd.grid[0] * fwd.block[1] < 100


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_nan_and_inf_propagate_like_reference():
    sources = make_sources(3, (5,), 8)
    sources[1][2, 3] = float("nan")
    sources[2][4, 0] = float("inf")
    w, g, g_out = site_params(None, 8)
    for kwargs in ({}, {"out_norm_weight": g_out}):
        got = ak.depth_attention(w, sources, g, backend="cuda", **kwargs)
        want = reference.depth_attention(w, sources, g, **kwargs)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        torch.testing.assert_close(got[finite], want[finite])
    srcs = [s.clone().requires_grad_() for s in sources]
    ak.depth_attention(w, srcs, g, backend="cuda").sum().backward()
    assert srcs[0].grad.isnan().any()


def test_fp16_large_magnitudes_stay_finite():
    sources = make_sources(4, (6,), 64, torch.float16, scale=1e4)
    w, g, g_out = site_params(None, 64)
    for kwargs in ({}, {"out_norm_weight": g_out}):
        got = ak.depth_attention(w, sources, g, backend="cuda", **kwargs)
        assert torch.isfinite(got).all()
        want = reference.depth_attention(w, sources, g, **kwargs)
        oracle = reference.depth_attention(
            w.double(), [s.double() for s in sources], g.double(), **{k: v.double() for k, v in kwargs.items()}
        )
        assert_close_to_oracle("out", got, want, oracle)


def test_empty_leading_dims():
    sources = [torch.randn(0, 3, 8, requires_grad=True) for _ in range(2)]
    out = ak.depth_attention(torch.randn(8), sources, backend="cuda")
    assert out.shape == (0, 3, 8)
    out.sum().backward()
    assert sources[0].grad.shape == (0, 3, 8)


def test_backward_checks_the_saved_tensors():
    assert_backward_checks_saved_tensors(torch.ops.attnres_emu.depth_attn_fwd, torch.ops.attnres_emu.depth_attn_bwd)
