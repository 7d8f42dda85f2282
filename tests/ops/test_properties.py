"""Property tests (hypothesis): every fused backend against the reference on random cases.

Depth read: random widths, source counts, leading shapes, dtypes (one or a mix per read),
layouts (contiguous, strided columns, padded rows, transposed leading dims, views at a
non-zero storage offset, each source its own), single or multi-query reads with shared or
per-site weights, the fused output norm, the merge with a prefix of its own dtype, and the
read's options (DESIGN.md §2.7: the logits' scale, normalised values, an unweighted key norm,
the key and output norms' epsilons, the output dtype) in every combination the fused kernels run.
Attention: random batch, heads (grouped-query), lengths, head sizes, causal and key-padding
masks (fully padded rows included), dtypes and layouts.

Each case is checked with FlashAttention's error rule (``assert_close_to_oracle``: the error
against an fp64 oracle is at most 3x that of the reference run in the same precision, plus
a small slack), forward outputs and the gradients of a random linear function of them.
The inputs come from a torch generator seeded by a hypothesis draw, so a case is fully
described by its draws; the examples are derandomized (the same in every run, no database)
and bounded so that the file runs in about a minute on two cores. Triton runs under its
interpreter here, one program at a time in numpy, so it gets fewer and smaller cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.ops._dispatch import fused_op
from attnres_kernels.ops.attention import available_backends as attention_backends
from tests.support import assert_close_to_oracle, attnres_ops_called

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEPTH_FUSED = [b for b in ak.available_backends("cpu", 64) if b != "reference"]


def _defines_attention(backend: str) -> bool:
    """Whether the backend's attention op exists yet (the fused kernels are being written)."""
    try:
        fused_op(backend, "attn_fwd", torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return False
    return True


ATTENTION_FUSED = [b for b in attention_backends("cpu") if b != "reference" and _defines_attention(b)]
# Examples per backend and the largest case sizes it gets.
DEPTH_BUDGET = {"cpu": 200, "triton": 40}
DEPTH_LIMITS = {"cpu": dict(dim=100, sources=7, rows=24), "triton": dict(dim=40, sources=4, rows=6)}
ATTENTION_BUDGET = {"triton": 6}
ATTENTION_DEFAULT_BUDGET = 25
OP_PREFIX = {"cpu": "attnres::", "cuda": "attnres::", "triton": "attnres_triton::"}


def _settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------- layouts

LAYOUTS = ("contiguous", "strided", "padded", "transposed", "offset")


def base_shape(layout: str, shape: tuple) -> tuple:
    """Shape of the tensor that :func:`as_layout` views as ``shape``."""
    *lead, d = shape
    if layout == "strided":
        return (*lead, 2 * d)
    if layout == "padded":
        return (*lead, d + 3)
    if layout == "transposed":
        return (lead[1], lead[0], *lead[2:], d)
    if layout == "offset":
        return (math.prod(shape) + 1,)
    return shape


def as_layout(base: torch.Tensor, layout: str, shape: tuple) -> torch.Tensor:
    """A ``shape`` view of ``base`` in ``layout`` (a view, so gradients reach ``base``):
    every other column, rows padded to a longer stride, the first two leading dims
    swapped, or a contiguous tensor starting one element into its storage (unaligned)."""
    d = shape[-1]
    if layout == "strided":
        return base[..., ::2]
    if layout == "padded":
        return base[..., :d]
    if layout == "transposed":
        return base.transpose(0, 1)
    if layout == "offset":
        return base[1:].view(shape)
    return base


def layouts_for(shape: tuple):
    return st.sampled_from([x for x in LAYOUTS if x != "transposed" or len(shape) >= 3])


# ---------------------------------------------------------------- depth read


@dataclass
class DepthCase:
    seed: int
    shape: tuple  # of each source, [..., D]
    dtypes: list  # one per source
    layouts: list  # one per source
    q: int | None  # None: a single [D] site
    per_site_weights: bool
    out_norm: bool
    prefix: tuple | None  # (dtype, layout) of the merge prefix h_a, or None
    key_norm_weight: bool = True  # False: an unweighted key norm (norm_weight=None)
    options: dict = field(default_factory=dict)  # scale, normalize_values, eps, out_norm_eps, out_dtype


@st.composite
def depth_cases(draw, backend: str):
    limits = DEPTH_LIMITS[backend]
    d = draw(st.sampled_from([1, 2, 7, 16, 37, limits["dim"]]))
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    if math.prod(lead) > limits["rows"]:
        lead = lead[:1]
    shape = (*lead, d)
    n = draw(st.integers(1, limits["sources"]))
    if draw(st.booleans()):
        dtypes = [draw(st.sampled_from(DTYPES))] * n
    else:
        dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=n, max_size=n))
    layouts = draw(st.lists(layouts_for(shape), min_size=n, max_size=n))
    q = draw(st.one_of(st.none(), st.integers(1, 5)))
    merge = draw(st.booleans())
    prefix = None
    if merge:
        prefix = (draw(st.sampled_from(DTYPES)), draw(st.sampled_from(["contiguous", "offset"])))
    # The options: normalised values only without a key-norm weight (the fused kernels have no
    # weighted normalised values; the reference reads those, test_read_options).
    normalize_values = draw(st.booleans())
    options = dict(
        scale=draw(st.sampled_from([1.0, d**-0.5, 2.5])),
        normalize_values=normalize_values,
        eps=draw(st.sampled_from([1e-6, 1e-3])),
        out_norm_eps=draw(st.sampled_from([None, 1e-2])),
        out_dtype=draw(st.sampled_from([None, None, torch.float32, torch.bfloat16])),
    )
    return DepthCase(
        seed=draw(st.integers(0, 2**31 - 1)),
        shape=shape,
        dtypes=dtypes,
        layouts=layouts,
        q=q,
        per_site_weights=q is not None and draw(st.booleans()),
        out_norm=draw(st.booleans()),
        prefix=prefix,
        key_norm_weight=not normalize_values and draw(st.booleans()),
        options=options,
    )


def _depth_inputs(case: DepthCase):
    """Leaf tensors of the case: source bases (in their dtypes), site parameters (fp32) and
    the merge prefix (h_a in its dtype, lse_a in fp32)."""
    gen = torch.Generator().manual_seed(case.seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    bases = [randn(*base_shape(lay, case.shape)).to(dt) for dt, lay in zip(case.dtypes, case.layouts)]
    d = case.shape[-1]
    site = (d,) if case.q is None or not case.per_site_weights else (case.q, d)
    query = (randn(*((d,) if case.q is None else (case.q, d))) * 0.5).float()
    norm_weight = (1 + 0.3 * randn(*site)).float() if case.key_norm_weight else None
    out_norm_weight = (1 + 0.3 * randn(*site)).float() if case.out_norm else None
    params = [query, norm_weight, out_norm_weight]
    if case.prefix is not None:
        dtype, layout = case.prefix
        q_dims = () if case.q is None else (case.q,)
        h_shape = (*q_dims, *case.shape)
        # A prefix from a real read over two other sources with the case's options (so lse_a has a
        # realistic scale).
        prefix_options = {k: v for k, v in case.options.items() if k != "out_dtype"}
        h_a, lse_a = reference.depth_attention(
            query, [randn(*case.shape) for _ in range(2)], norm_weight, return_lse=True, **prefix_options
        )
        base = torch.empty(base_shape(layout, h_shape), dtype=dtype)
        as_layout(base, layout, h_shape).copy_(h_a)
        params += [base, lse_a.float()]
    return bases, params


def _depth_read(case: DepthCase, backend: str, bases: list, params: list, oracle: bool = False):
    """Runs the case's read on ``backend``; returns (sources, outputs). ``oracle``: the output in
    the promoted dtype of its (fp64) inputs, whatever the case's ``out_dtype``."""
    sources = [as_layout(b, lay, case.shape) for b, lay in zip(bases, case.layouts)]
    options = {**case.options, "out_dtype": None} if oracle else case.options
    query, norm_weight, out_norm_weight = params[:3]
    if case.prefix is None:
        outputs = ak.depth_attention(
            query,
            sources,
            norm_weight,
            out_norm_weight=out_norm_weight,
            return_lse=True,
            return_weights=True,
            backend=backend,
            **options,
        )
    else:
        q_dims = () if case.q is None else (case.q,)
        prefix_out = as_layout(params[3], case.prefix[1], (*q_dims, *case.shape))
        outputs = ak.depth_attention_merge(
            query,
            prefix_out,
            params[4],
            sources,
            norm_weight,
            out_norm_weight=out_norm_weight,
            return_lse=True,
            backend=backend,
            **options,
        )
    return sources, outputs


def _run_with_grads(case, backend, bases, params, out_weights, to_dtype=None):
    """Outputs of the read and the gradients of ``Σ <outputs, out_weights>`` w.r.t. the
    sources (as the views the op saw) and every parameter."""
    cast = (lambda t: t.detach().to(to_dtype)) if to_dtype is not None else (lambda t: t.detach().clone())
    bases = [cast(b).requires_grad_() for b in bases]
    params = [cast(p).requires_grad_() if p is not None else None for p in params]
    sources, outputs = _depth_read(case, backend, bases, params, oracle=to_dtype is not None)
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, out_weights))
    leaves = [p for p in params if p is not None]
    grads = torch.autograd.grad(loss, sources + leaves)
    return list(outputs), list(grads[: len(sources)]), list(grads[len(sources) :])


def check_depth_case(case: DepthCase, backend: str):
    bases, params = _depth_inputs(case)
    with torch.no_grad():
        _, shapes_from = _depth_read(case, "reference", bases, params)
    gen = torch.Generator().manual_seed(case.seed + 1)
    out_weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in shapes_from]
    got = _run_with_grads(case, backend, bases, params, out_weights)
    same = _run_with_grads(case, "reference", bases, params, out_weights)
    oracle = _run_with_grads(case, "reference", bases, params, out_weights, to_dtype=torch.float64)
    for name, a, b, c in zip(["out", "lse", "weights"], got[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    # Source gradients: each in its source's dtype; judged per dtype as one tensor (they come
    # from one computation, and a single small source gradient can be luckier than the rest).
    for dtype in set(case.dtypes):
        picked = [i for i, dt in enumerate(case.dtypes) if dt == dtype]
        for i in picked:
            assert got[1][i].dtype == dtype and got[1][i].shape == case.shape
        cat = lambda grads: torch.cat([grads[i].flatten() for i in picked])
        assert_close_to_oracle(f"d_sources[{dtype}]", cat(got[1]), cat(same[1]), cat(oracle[1]))
    for k, (a, b, c) in enumerate(zip(got[2], same[2], oracle[2])):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_to_oracle(f"d_param[{k}]", a, b, c)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in Triton's interpreter
@pytest.mark.parametrize("backend", DEPTH_FUSED)
def test_depth_read_matches_reference(backend):
    @_settings(DEPTH_BUDGET.get(backend, 10))
    @given(case=depth_cases(backend))
    def check(case):
        check_depth_case(case, backend)

    check()


@pytest.mark.parametrize("backend", DEPTH_FUSED)
def test_depth_property_runs_the_fused_op(backend):
    """The property test names the backend, so a fallback would raise; this also shows the
    backend's own ops run a mixed-dtype, unaligned, multi-query merge with the output norm."""
    case = DepthCase(
        seed=1,
        shape=(2, 3, 7),
        dtypes=[torch.float32, torch.bfloat16, torch.float16],
        layouts=["offset", "transposed", "strided"],
        q=2,
        per_site_weights=True,
        out_norm=True,
        prefix=(torch.bfloat16, "offset"),
    )
    bases, params = _depth_inputs(case)
    out_weights = [torch.ones(2, 2, 3, 7, dtype=torch.float64), torch.ones(2, 2, 3, dtype=torch.float64)]
    called = attnres_ops_called(lambda: _run_with_grads(case, backend, bases, params, out_weights))
    assert {OP_PREFIX[backend] + "depth_attn_fwd", OP_PREFIX[backend] + "depth_attn_bwd"} <= called, called


# ---------------------------------------------------------------- attention


@dataclass
class AttentionCase:
    seed: int
    batch: int
    kv_heads: int
    group: int  # query heads per key/value head
    tq: int
    tk: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    padding: list | None  # per batch row: number of real keys (0: fully padded)
    head_major: bool  # [B, T, H, Dh] storage viewed as [B, H, T, Dh] when False

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group


@st.composite
def attention_cases(draw, max_len: int = 9):
    batch = draw(st.integers(1, 2))
    tk = draw(st.integers(1, max_len))
    padding = None
    if draw(st.booleans()):
        padding = draw(st.lists(st.integers(0, tk), min_size=batch, max_size=batch))
    return AttentionCase(
        seed=draw(st.integers(0, 2**31 - 1)),
        batch=batch,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 3)),
        tq=draw(st.integers(1, max_len)),
        tk=tk,
        head_dim=draw(st.sampled_from([1, 4, 8, 13, 32])),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.booleans()),
        padding=padding,
        head_major=draw(st.booleans()),
    )


def _attention_inputs(case: AttentionCase):
    """q, k, v (fp64 values, laid out as the case says) and the key-padding mask."""
    gen = torch.Generator().manual_seed(case.seed)

    def make(heads, t):
        if case.head_major:
            return torch.randn(case.batch, heads, t, case.head_dim, generator=gen, dtype=torch.float64)
        return torch.randn(case.batch, t, heads, case.head_dim, generator=gen, dtype=torch.float64).transpose(1, 2)

    q, k, v = make(case.heads, case.tq), make(case.kv_heads, case.tk), make(case.kv_heads, case.tk)
    mask = None
    if case.padding is not None:
        mask = torch.arange(case.tk).unsqueeze(0) < torch.tensor(case.padding).unsqueeze(1)
    return q, k, v, mask


def _attention_with_grads(fn, q, k, v, out_weights):
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*inputs)
    loss = (out.double() * out_weights[0]).sum() + (lse.double().nan_to_num(neginf=0.0) * out_weights[1]).sum()
    if not loss.requires_grad:  # no query row sees a key: the loop oracle builds no graph
        return [out, lse], [torch.zeros_like(t) for t in inputs]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [out, lse], [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, inputs)]


def _loop_attention(q, k, v, mask, causal, scale):
    """An independent oracle: one query row at a time, visible keys listed explicitly."""
    b_, h_, tq, _ = q.shape
    tk, group = k.shape[2], q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(b_):
        for h in range(h_):
            for i in range(tq):
                keys = [j for j in range(tk) if (not causal or j <= i + tk - tq) and (mask is None or bool(mask[b, j]))]
                if not keys:
                    outs.append(torch.zeros_like(q[b, h, i]))
                    lses.append(torch.tensor(float("-inf"), dtype=q.dtype))
                    continue
                kk, vv = k[b, h // group, keys], v[b, h // group, keys]
                scores = (kk @ q[b, h, i]) * scale
                lse = torch.logsumexp(scores, 0)
                outs.append(torch.exp(scores - lse) @ vv)
                lses.append(lse)
    out = torch.stack(outs).reshape(q.shape)
    return out, torch.stack(lses).reshape(q.shape[:-1])


@_settings(10)
@given(case=attention_cases(max_len=5))
def test_reference_attention_matches_a_loop(case):
    """The reference (batched, masked_fill) against :func:`_loop_attention` (per row, explicit
    key lists) in fp64: outputs, lse and the gradients of q, k, v."""
    q, k, v, mask = _attention_inputs(case)
    scale = case.head_dim**-0.5
    gen = torch.Generator().manual_seed(case.seed + 1)
    out_weights = [
        torch.randn(q.shape, generator=gen, dtype=torch.float64),
        torch.randn(q.shape[:-1], generator=gen, dtype=torch.float64),
    ]
    ref = lambda q, k, v: reference.attention(q, k, v, causal=case.causal, key_padding_mask=mask, return_lse=True)
    loop = lambda q, k, v: _loop_attention(q, k, v, mask, case.causal, scale)
    got = _attention_with_grads(ref, q, k, v, out_weights)
    want = _attention_with_grads(loop, q, k, v, out_weights)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def check_attention_case(case: AttentionCase, backend: str):
    q, k, v, mask = _attention_inputs(case)
    gen = torch.Generator().manual_seed(case.seed + 1)
    out_weights = [
        torch.randn(q.shape, generator=gen, dtype=torch.float64),
        torch.randn(q.shape[:-1], generator=gen, dtype=torch.float64),
    ]

    def run(impl, dtype):
        fn = lambda q, k, v: impl(q, k, v, causal=case.causal, key_padding_mask=mask, return_lse=True)
        return _attention_with_grads(fn, *(t.to(dtype) for t in (q, k, v)), out_weights)

    fused = lambda *a, **kw: ak.attention(*a, backend=backend, **kw)
    got, same, oracle = (
        run(fused, case.dtype),
        run(reference.attention, case.dtype),
        run(reference.attention, torch.float64),
    )
    (out, lse), (same_out, same_lse), (oracle_out, oracle_lse) = got[0], same[0], oracle[0]
    assert out.dtype == case.dtype and out.shape == q.shape
    assert torch.equal(lse.isneginf(), oracle_lse.isneginf()), "rows that see no key must have lse = -inf"
    seen = ~oracle_lse.isneginf()
    assert_close_to_oracle("out", out, same_out, oracle_out)
    assert (out[~seen] == 0).all()
    if seen.any():
        assert_close_to_oracle("lse", lse[seen], same_lse[seen], oracle_lse[seen])
    for name, a, b, c in zip(["dq", "dk", "dv"], got[1], same[1], oracle[1]):
        assert a.dtype == case.dtype and a.shape == b.shape
        assert torch.isfinite(a).all(), name
        assert_close_to_oracle(name, a, b, c)


@pytest.mark.parametrize("backend", ATTENTION_FUSED)
def test_attention_matches_reference(backend):
    @_settings(ATTENTION_BUDGET.get(backend, ATTENTION_DEFAULT_BUDGET))
    @given(case=attention_cases(max_len=5 if backend == "triton" else 9))
    def check(case):
        check_attention_case(case, backend)

    check()
