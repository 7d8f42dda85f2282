"""The read's options (DESIGN.md §2.7: ``scale``, ``normalize_values``, an unweighted key norm,
``out_norm_eps``, ``out_dtype``) on every fused backend against the reference: forward and every
gradient, single and multi-query, merges that equal the read over the union, sources read in place
from strided per-block views, fp64 gradcheck through the kernels, and clear errors."""

import itertools

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.cuda import emulation
from tests.support import assert_close_to_oracle, attnres_ops_called, make_sources

BACKENDS = [b for b in ("cpu", "triton") if b in ak.available_backends("cpu", 64)]
OP_PREFIX = {"cpu": "attnres::", "triton": "attnres_triton::", "cuda": "attnres_emu::"}


@pytest.fixture(params=[*BACKENDS, "cuda"], ids=lambda b: "cuda-emulated" if b == "cuda" else b)
def backend(request, monkeypatch):
    """Every fused backend; "cuda" runs the CUDA kernels under the SIMT harness (its test id is not the
    bare "cuda" keyword, which marks the tests that need a GPU)."""
    if request.param == "cuda":
        monkeypatch.setenv(emulation.ENV, "1")
        reason = emulation.load()
        assert reason is None, reason
    return request.param


def test_every_backend_is_here():
    """A backend missing here would silently shrink this suite."""
    assert BACKENDS == ["cpu", "triton"]


# Inkling2: unweighted key norm, 1/sqrt(D), normalised values, fp32 output; paper/FLA with a scale;
# the output norm with its own epsilon.
VARIANTS = {
    "inkling2": dict(norm=False, kwargs=lambda d: dict(scale=d**-0.5, normalize_values=True)),
    "inkling2-fp32-out": dict(
        norm=False, kwargs=lambda d: dict(scale=d**-0.5, normalize_values=True, out_dtype=torch.float32)
    ),
    "scaled-paper": dict(norm=True, kwargs=lambda d: dict(scale=0.3)),
    "unweighted-paper": dict(norm=False, kwargs=lambda d: dict()),
}


def _params(q, d, norm):
    shape = (d,) if q is None else (q, d)
    w = torch.randn(shape) * 0.7
    gamma = 1 + 0.3 * torch.randn(shape) if norm else None
    g_out = 1 + 0.3 * torch.randn(d)
    return w, gamma, g_out


def _compare(backend, sources, q, variant, out_norm, prefix_split=None):
    """Outputs and every gradient of the fused read vs the reference at the same precision and an
    fp64 oracle (FlashAttention's rule), for one variant of the options."""
    d = sources[0].shape[-1]
    spec = VARIANTS[variant]
    w, gamma, g_out = _params(q, d, spec["norm"])
    kwargs = spec["kwargs"](d)
    if out_norm:
        kwargs.update(out_norm_eps=1e-3)
    head = make_sources(prefix_split, sources[0].shape[:-1], d, sources[0].dtype) if prefix_split else None

    def run(impl, srcs, params, fp64):
        srcs = [s.detach().double() if fp64 else s.detach() for s in srcs]
        params = [p.detach().double() if fp64 and p is not None else p for p in params]
        leaves = [t.requires_grad_() for t in srcs + params if t is not None]
        w_, gamma_, g_ = params
        kw = dict(kwargs, out_norm_weight=g_ if out_norm else None)
        if fp64:
            kw.pop("out_dtype", None)
        if head is None:
            outs = impl["read"](w_, srcs, gamma_, return_lse=True, **kw)
        else:
            hs = [h.double() if fp64 else h for h in head]
            h_a, lse_a = reference.depth_attention(
                w_.detach(), hs, gamma_, return_lse=True, **dict(kw, out_norm_weight=None)
            )
            h_a, lse_a = h_a.detach().requires_grad_(), lse_a.detach().requires_grad_()
            leaves += [h_a, lse_a]
            outs = impl["merge"](w_, h_a, lse_a, srcs, gamma_, return_lse=True, **kw)
        torch.manual_seed(1234)
        loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64)).sum() for o in outs)
        return list(outs), list(torch.autograd.grad(loss, leaves))

    fused_impl = {
        "read": lambda *a, **k: ak.depth_attention(*a, backend=backend, **k),
        "merge": lambda *a, **k: ak.depth_attention_merge(*a, backend=backend, **k),
    }
    ref_impl = {"read": reference.depth_attention, "merge": reference.depth_attention_merge}
    params = [w, gamma, g_out if out_norm else None]
    fused = run(fused_impl, sources, params, False)
    same = run(ref_impl, sources, params, False)
    oracle = run(ref_impl, sources, params, True)
    want_dtype = kwargs.get("out_dtype") or sources[0].dtype
    assert fused[0][0].dtype == want_dtype == same[0][0].dtype
    for name, a, b, c in zip(["out", "lse"], fused[0], same[0], oracle[0]):
        assert a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    n = len(sources)
    group = lambda g: [torch.cat([x.flatten() for x in g[:n]])] + g[n:]
    for k, (a, b, c) in enumerate(zip(group(fused[1]), group(same[1]), group(oracle[1]))):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert_close_to_oracle(f"grad {k}", a, b, c)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q,out_norm", [(None, False), (3, False), (None, True), (3, True)])
def test_read_matches_reference(backend, variant, dtype, q, out_norm):
    sources = make_sources(4, (2, 5), 37, dtype, "strided")
    _compare(backend, sources, q, variant, out_norm)


@pytest.mark.parametrize("variant", ["inkling2", "inkling2-fp32-out", "scaled-paper"])
@pytest.mark.parametrize("q", [None, 3])
def test_merge_matches_reference(backend, variant, q):
    """Phase 2 of the two-phase schedule: the merge keeps the options' semantics."""
    _compare(backend, make_sources(2, (6,), 19), q, variant, out_norm=True, prefix_split=3)


@pytest.mark.parametrize("q", [None, 3])
def test_merge_equals_read_over_union(backend, q):
    d = 24
    sources = make_sources(5, (4,), d)
    w, _, g_out = _params(q, d, norm=False)
    kw = dict(scale=d**-0.5, normalize_values=True)
    h_a, lse_a = ak.depth_attention(w, sources[:3], return_lse=True, backend=backend, **kw)
    merged, lse = ak.depth_attention_merge(
        w, h_a, lse_a, sources[3:], out_norm_weight=g_out, out_norm_eps=1e-4, return_lse=True, backend=backend, **kw
    )
    whole, lse_whole = ak.depth_attention(
        w, sources, out_norm_weight=g_out, out_norm_eps=1e-4, return_lse=True, backend=backend, **kw
    )
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q,out_norm,merge", list(itertools.product([None, 2], [False, True], [False, True])))
def test_gradcheck_fp64(backend, q, out_norm, merge):
    """fp64 gradcheck of the Inkling2 options (and a separate output-norm eps) through the kernels."""
    d, n = 5, 3
    sources = [torch.randn(2, 3, d, dtype=torch.float64, requires_grad=True) for _ in range(n)]
    w = torch.randn(*(() if q is None else (q,)), d, dtype=torch.float64, requires_grad=True)
    g_out = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).requires_grad_() if out_norm else None
    kw = dict(scale=d**-0.5, normalize_values=True, out_norm_eps=1e-2, backend=backend)
    inputs = [w, *sources] + ([g_out] if out_norm else [])
    if merge:
        h_a, lse_a = reference.depth_attention(w.detach(), [torch.randn(2, 3, d, dtype=torch.float64)], return_lse=True)
        inputs += [h_a.requires_grad_(), lse_a.requires_grad_()]

    def fn(w, *rest):
        srcs, rest = list(rest[:n]), list(rest[n:])
        g = rest.pop(0) if out_norm else None
        if merge:
            return ak.depth_attention_merge(w, rest[0], rest[1], srcs, out_norm_weight=g, return_lse=True, **kw)
        return ak.depth_attention(w, srcs, out_norm_weight=g, return_lse=True, **kw)

    assert torch.autograd.gradcheck(fn, inputs, fast_mode=backend != "cpu")


def test_block_views_are_read_in_place(backend):
    """Inkling2 keeps its blocks in one [B, T, n, D] tensor: a read over its per-block views
    (``unbind(-2)``, rows n·D apart) plus the partial sum saves no copy of them for backward,
    only references to the inputs and per-row scalars, and gives the reference's results."""
    b, t, n, d = 2, 5, 4, 40
    blocks = torch.randn(b, t, n, d, dtype=torch.bfloat16, requires_grad=True)
    partial = torch.randn(b, t, d, requires_grad=True)  # the fp32 partial sum of a block
    query = torch.zeros(3, d).normal_(0, 0.5).requires_grad_()
    kw = dict(scale=d**-0.5, normalize_values=True, out_dtype=torch.float32)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = ak.depth_attention(query, [*blocks.unbind(-2), partial], backend=backend, **kw)
    inputs = {t.untyped_storage().data_ptr() for t in (blocks, partial, query)}
    per_row_elements = b * t * (n + 1) * (query.shape[0] + 2)  # logits, rinv, lse
    copied = [s for s in saved if s.untyped_storage().data_ptr() not in inputs]
    assert sum(s.numel() for s in copied) <= per_row_elements, [tuple(s.shape) for s in copied]
    ref = reference.depth_attention(query, [*blocks.unbind(-2), partial], **kw)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    out.sum().backward()
    assert blocks.grad.dtype == torch.bfloat16 and partial.grad.dtype == torch.float32


def test_fused_op_ran_with_the_options(backend):
    """The Inkling2 read runs the backend's op, not the reference."""
    sources = make_sources(3, (4,), 16)
    w = torch.randn(3, 16, requires_grad=True)

    def read():
        out = ak.depth_attention(w, sources, scale=0.25, normalize_values=True, out_norm_eps=1e-3, backend=backend)
        out.sum().backward()

    called = attnres_ops_called(read)
    assert {OP_PREFIX[backend] + "depth_attn_fwd", OP_PREFIX[backend] + "depth_attn_bwd"} <= called, called


def test_weighted_normalised_values_are_the_reference_only(backend):
    """``normalize_values`` with a key-norm weight (values rmsnorm(v)·γ) has no CPU or Triton kernel:
    an explicit backend refuses it, "auto" reads it with the reference (the CUDA kernels have it:
    tests/backends/test_cuda_read_variants.py)."""
    if backend == "cuda":
        pytest.skip("the CUDA kernels read normalised values with a key-norm weight")
    sources = make_sources(3, (4,), 16)
    w, gamma = torch.randn(16), 1 + 0.3 * torch.randn(16)
    with pytest.raises(ak.BackendUnavailableError, match="key-norm weight"):
        ak.depth_attention(w, sources, gamma, normalize_values=True, backend=backend)


def test_weighted_normalised_values_reference_semantics():
    """values = rmsnorm(v_i) · γ: checked against a direct formula, and 'auto' falls back to it."""
    sources = make_sources(3, (4,), 16)
    w, gamma = torch.randn(16), 1 + 0.3 * torch.randn(16)
    v = torch.stack(sources)
    n = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    alpha = torch.softmax((n * gamma * w).sum(-1) * 0.5, dim=0)
    want = (alpha.unsqueeze(-1) * n * gamma).sum(0)
    got = reference.depth_attention(w, sources, gamma, scale=0.5, normalize_values=True)
    torch.testing.assert_close(got, want)
    with pytest.warns(UserWarning, match="key-norm weight"):
        auto = ak.depth_attention(w, sources, gamma, scale=0.5, normalize_values=True)
    torch.testing.assert_close(auto, want)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(scale=float("inf")), ValueError, "scale"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(out_norm_eps=-1e-6), ValueError, "out_norm_eps"),
        (dict(normalize_values=1), TypeError, "normalize_values"),
        (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
        (dict(out_dtype="float32"), TypeError, "out_dtype"),
    ],
)
def test_bad_options_are_refused_before_any_kernel(kwargs, error, match):
    sources = make_sources(2, (3,), 8)
    for fn in (ak.depth_attention, reference.depth_attention):
        with pytest.raises(error, match=match):
            fn(torch.randn(8), sources, **kwargs)
    with pytest.raises(error, match=match):
        h, lse = reference.depth_attention(torch.randn(8), sources, return_lse=True)
        ak.depth_attention_merge(torch.randn(8), h, lse, sources, **kwargs)
