"""Mixed-dtype sources (DESIGN.md §2.5): each source is read in its own dtype, the
output has the promoted dtype, and each source gets its gradient in its own dtype."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels._validation import ReadOptions
from tests.support import assert_close_to_oracle, read_with_grads, site_params

FUSED = [b for b in ak.available_backends("cpu", 64) if b != "reference"]
BACKENDS = ["reference", *FUSED]

MIXES = {
    "fp32+bf16": [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16],
    "fp32+fp16": [torch.float32, torch.float16, torch.float16],
    "bf16+fp32+fp16": [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32],
    "bf16+fp16": [torch.bfloat16, torch.float16],
    "fp64+fp32": [torch.float64, torch.float32, torch.float64],
}


def mixed_sources(dtypes, lead, d):
    return [torch.randn(*lead, d, dtype=torch.float64).to(dt) for dt in dtypes]


def promoted(dtypes):
    out = dtypes[0]
    for dt in dtypes[1:]:
        out = torch.promote_types(out, dt)
    return out


def _read(backend, merge):
    def fn(srcs, w, g, g_out, *prefix):
        if merge:
            return ak.depth_attention_merge(
                w, prefix[0], prefix[1], srcs, g, out_norm_weight=g_out, return_lse=True, backend=backend
            )
        return ak.depth_attention(w, srcs, g, out_norm_weight=g_out, return_lse=True, backend=backend)

    return fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("q,out_norm,merge", [(None, False, False), (3, True, False), (None, True, True)])
def test_mixed_sources_match_the_fp64_oracle(backend, mix, q, out_norm, merge):
    dtypes = MIXES[mix]
    d = 37
    sources = mixed_sources(dtypes, (2, 5), d)
    w, g, g_out = site_params(q, d)
    g_out = g_out if out_norm else None
    params = [w, g, g_out]
    if merge:  # a bf16 prefix joins the promotion
        h_a, lse_a = reference.depth_attention(w, mixed_sources([torch.float32] * 2, (2, 5), d), g, return_lse=True)
        params += [h_a.to(torch.bfloat16), lse_a]
    want_dtype = promoted(dtypes + ([torch.bfloat16] if merge else []))
    out_shapes = [((q,) if q else ()) + (2, 5, d), ((q,) if q else ()) + (2, 5)]
    out_weights = [torch.randn(s, dtype=torch.float64) for s in out_shapes]
    got = read_with_grads(_read(backend, merge), sources, params, out_weights)
    same = read_with_grads(_read("reference", merge), sources, params, out_weights)
    oracle = read_with_grads(
        _read("reference", merge),
        [s.double() for s in sources],
        [p.double() if p is not None else None for p in params],
        out_weights,
    )
    out, lse = got[0]
    assert out.dtype == want_dtype
    assert lse.dtype == (torch.float64 if want_dtype == torch.float64 else torch.float32)
    for name, a, b, c in zip(["out", "lse"], got[0], same[0], oracle[0]):
        assert_close_to_oracle(name, a, b.to(a.dtype), c)
    n = len(sources)
    for i, (a, b, c) in enumerate(zip(got[1][:n], same[1][:n], oracle[1][:n])):
        assert a.dtype == sources[i].dtype, f"d_sources[{i}] is {a.dtype}, source is {sources[i].dtype}"
        assert_close_to_oracle(f"d_sources[{i}]", a, b, c)
    for a, b, c in zip(got[1][n:], same[1][n:], oracle[1][n:]):
        assert a.dtype == b.dtype
        assert_close_to_oracle("d_param", a, b, c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_norm", [False, True])
def test_gradcheck_fp64_with_fp32_sources(backend, out_norm):
    """fp64 accumulation with fp32 sources in the read: gradcheck w.r.t. the fp64
    inputs (fp32 inputs are too coarse for finite differences) through the mixed path."""
    fp64 = [torch.randn(3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    fp32 = [torch.randn(3, 5, dtype=torch.float32) for _ in range(2)]
    w, g, g_out = (torch.randn(5, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(a, b, w, g, g_out):
        return ak.depth_attention(
            w,
            [fp32[0], a, fp32[1], b],
            g,
            out_norm_weight=g_out if out_norm else None,
            return_lse=True,
            backend=backend,
        )

    assert torch.autograd.gradcheck(fn, (*fp64, w, g, g_out), fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "source_dtypes,prefix_dtype",
    [
        ([torch.float32, torch.float32], torch.float64),  # the prefix raises the read to fp64
        ([torch.bfloat16, torch.bfloat16], torch.float16),  # bf16 + fp16 -> fp32
        ([torch.bfloat16, torch.float16], torch.bfloat16),
        ([torch.float64, torch.bfloat16], torch.float32),
    ],
    ids=["fp32+fp64prefix", "bf16+fp16prefix", "bf16+fp16+bf16prefix", "fp64+bf16+fp32prefix"],
)
def test_merge_prefix_dtype_joins_the_promotion(backend, source_dtypes, prefix_dtype):
    d = 13
    sources = mixed_sources(source_dtypes, (3, 4), d)
    w, g, g_out = site_params(2, d)
    want_dtype = promoted(source_dtypes + [prefix_dtype])
    acc = torch.float64 if want_dtype == torch.float64 else torch.float32
    h_a, lse_a = reference.depth_attention(w, mixed_sources([torch.float64] * 3, (3, 4), d), g, return_lse=True)
    params = [w, g, g_out, h_a.to(prefix_dtype), lse_a.to(acc)]
    out_weights = [torch.randn(2, 3, 4, d, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)]
    got = read_with_grads(_read(backend, True), sources, params, out_weights)
    same = read_with_grads(_read("reference", True), sources, params, out_weights)
    oracle = read_with_grads(
        _read("reference", True), [s.double() for s in sources], [p.double() for p in params], out_weights
    )
    out, lse = got[0]
    assert out.dtype == want_dtype and lse.dtype == acc
    for name, a, b, c in zip(["out", "lse"], got[0], same[0], oracle[0]):
        assert_close_to_oracle(name, a, b.to(a.dtype), c)
    names = [f"d_sources[{i}]" for i in range(len(sources))] + ["d_query", "d_norm", "d_out_norm", "d_h_a", "d_lse_a"]
    for name, a, b, c, x in zip(names, got[1], same[1], oracle[1], sources + params):
        assert a.dtype == x.dtype, f"{name} is {a.dtype}, its input is {x.dtype}"
        assert_close_to_oracle(name, a, b, c)


@pytest.mark.parametrize("backend", FUSED)
def test_mixed_strided_sources_and_a_gradient_through_lse_only(backend):
    """Non-contiguous sources of mixed dtypes, and a backward with no gradient of the
    output (only of lse): the kernel gets a zero output gradient in the promoted dtype."""
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    sources = [torch.randn(4, 6, 2 * 24, dtype=torch.float64).to(dt)[..., ::2] for dt in dtypes]
    assert not sources[0].is_contiguous()
    w, g, _ = site_params(None, 24)
    lse_weights = torch.randn(4, 6, dtype=torch.float64)

    def run(impl, srcs):
        leaves = [s.detach().clone().requires_grad_() for s in srcs]
        _, lse = impl(w, leaves, g, return_lse=True)
        return lse, torch.autograd.grad((lse.double() * lse_weights).sum(), leaves)

    lse, grads = run(lambda *a, **k: ak.depth_attention(*a, backend=backend, **k), sources)
    lse_ref, grads_ref = run(reference.depth_attention, sources)
    lse_oracle, grads_oracle = run(reference.depth_attention, [s.double() for s in sources])
    assert_close_to_oracle("lse", lse, lse_ref, lse_oracle)
    for i, (a, b, c) in enumerate(zip(grads, grads_ref, grads_oracle)):
        assert a.dtype == dtypes[i]
        assert_close_to_oracle(f"d_sources[{i}]", a, b, c)


@pytest.mark.parametrize("backend", FUSED)
def test_opcheck_mixed_dtypes(backend):
    """The fake kernel's promoted dtypes agree with the kernel's (opcheck compares them)."""
    ns = torch.ops.attnres if backend == "cpu" else ak.ops._dispatch.triton_ops()
    sources = [t.requires_grad_() for t in mixed_sources([torch.float32, torch.bfloat16, torch.float16], (3, 2), 8)]
    w = torch.randn(2, 8, requires_grad=True)
    g = torch.rand(8, requires_grad=True)
    h_a = torch.randn(2, 3, 2, 8, dtype=torch.float16, requires_grad=True)
    lse_a = torch.randn(2, 3, 2, requires_grad=True)
    paper = ReadOptions()
    for args in [(sources, w, g, None, None, g, *paper), (sources, w, None, h_a, lse_a, None, *paper)]:
        torch.library.opcheck(ns.depth_attn_fwd.default, args)
