"""Fused attention (DESIGN.md §2.4) on every backend that runs CPU tensors here, against the reference.

The C++ op runs the full grid of shapes; a Triton backend (under ``TRITON_INTERPRET=1``,
once it defines ``attnres_triton::attn_fwd``) joins with a tiny grid, because the
interpreter runs one program at a time in numpy.
"""

import importlib
import itertools
import os
import warnings

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import ops, reference
from attnres_kernels.reference.ops import attention_mask
from tests.support import (
    assert_close_to_oracle,
    attnres_ops_called,
    read_with_grads,
    run_check_in_subprocess,
)

# `ak.ops.attention` is the function; the module holds the backend helpers.
attention_ops = importlib.import_module("attnres_kernels.ops.attention")

FUSED = [b for b in attention_ops.available_backends("cpu") if b != "reference"]
OP_PREFIX = {"cpu": "attnres::attn_", "cuda": "attnres::attn_", "triton": "attnres_triton::attn_"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def test_cpu_backend_is_available():
    """The C++ op must be built here: a silently missing backend must not shrink the suite."""
    assert "cpu" in FUSED, ak.build_info()
    q, k, _ = make_qkv(1, 2, 2, 4, 4, 64, torch.float32)
    assert attention_ops.resolve_backend("auto", q, k) == "cpu"


def make_qkv(batch, heads, kv_heads, tq, tk, dh, dtype, layout="contiguous"):
    """q ``[B, H, Tq, Dh]`` and k, v ``[B, Hkv, Tk, Dh]``. ``layout``: "contiguous";
    "bthd" (head views of ``[B, T, heads, Dh]`` tensors, the layout a fused QKV
    projection produces); "strided" (every other element of the last dim)."""

    def make(h, t):
        if layout == "contiguous":
            return torch.randn(batch, h, t, dh, dtype=torch.float64).to(dtype)
        if layout == "bthd":
            return torch.randn(batch, t, h, dh, dtype=torch.float64).to(dtype).transpose(1, 2)
        assert layout == "strided"
        return torch.randn(batch, h, t, 2 * dh, dtype=torch.float64).to(dtype)[..., ::2]

    return make(heads, tq), make(kv_heads, tk), make(kv_heads, tk)


def make_mask(batch, tk):
    """Random key padding; the last batch (when there are several) has no real key."""
    mask = torch.rand(batch, tk) > 0.3
    mask[0, 0] = True
    if batch > 1:
        mask[-1] = False
    return mask


def finite(t, like):
    """``t`` with the positions where ``like`` is infinite set to 0."""
    return torch.where(torch.isinf(like), torch.zeros_like(t), t)


def flash_backward_at_same_precision(q, k, v, causal, mask, scale, weights):
    """Gradients of ``sum(out * weights[0]) + sum(lse * weights[1])`` by the backward DESIGN.md
    §2.4 specifies (FlashAttention-2's), in the reference's precision (fp32 for reduced-precision
    inputs) from its dense probabilities: ``dS = P ⊙ (dP - rowsum(dO ⊙ O))`` with the output O as
    the forward returned it, rounded to the inputs' dtype. That rounding moves rowsum(dO ⊙ O) and
    with it every dS of the row alike, so dq and dk carry more error than autograd through the
    fp32 reference has (bf16 decode, one query over 513 keys: dq off by 6 ulps vs 0.4); this is
    the same-precision baseline for the gradients."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    qf = q.to(acc)
    kf, vf = (x.to(acc).repeat_interleave(group, dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    allowed = attention_mask(q.shape[2], k.shape[2], causal, mask, q.device)  # the reference's visibility
    s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows that see no key: P = 0
    out = (p @ vf).to(q.dtype).to(acc)
    grad_out, grad_lse = weights[0].to(q.dtype).to(acc), weights[1].to(acc)
    delta = (grad_out * out).sum(-1) - grad_lse
    ds = p * (grad_out @ vf.transpose(-1, -2) - delta[..., None])
    dq = ds @ kf * scale
    dk = (ds.transpose(-1, -2) @ qf * scale).unflatten(1, (k.shape[1], group)).sum(2)
    dv = (p.transpose(-1, -2) @ grad_out).unflatten(1, (k.shape[1], group)).sum(2)
    return [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]


def compare(backend, q, k, v, causal, mask, scale=None):
    """Outputs and gradients of ``backend`` against the reference: FlashAttention's rule
    (error vs an fp64 oracle at most a few times that of a same-precision run: the reference
    for the outputs, its probabilities through the specified backward for the gradients)."""

    def run(impl):
        def fn(qkv):
            return impl(*qkv, causal=causal, key_padding_mask=mask, scale=scale, return_lse=True)

        return fn

    def fused(q, k, v, **kwargs):
        return ak.attention(q, k, v, backend=backend, **kwargs)

    weights = [torch.randn(q.shape, dtype=torch.float64), torch.randn(q.shape[:-1], dtype=torch.float64)]
    got_out, got_grads = read_with_grads(run(fused), [q, k, v], [], weights)
    with torch.no_grad():  # the same-precision gradients come from flash_backward_at_same_precision
        same_out = run(reference.attention)([q, k, v])
    oracle_out, oracle_grads = read_with_grads(run(reference.attention), [x.double() for x in (q, k, v)], [], weights)
    same_grads = flash_backward_at_same_precision(q, k, v, causal, mask, scale, weights)
    (out, lse), (same, same_lse), (oracle, oracle_lse) = got_out, same_out, oracle_out
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:-1]
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert_close_to_oracle("out", out, same, oracle)
    assert torch.equal(torch.isinf(lse), torch.isinf(oracle_lse)), "rows that see no key differ"
    assert_close_to_oracle("lse", finite(lse, oracle_lse), finite(same_lse, oracle_lse), finite(oracle_lse, oracle_lse))
    for name, a, b, c, x in zip(("dq", "dk", "dv"), got_grads, same_grads, oracle_grads, (q, k, v)):
        assert a.dtype == x.dtype and a.shape == x.shape, name
        assert_close_to_oracle(name, a, b, c)
    no_key = torch.isinf(oracle_lse)
    assert bool((out[no_key] == 0).all()) and bool((got_grads[0][no_key] == 0).all())


def _grid(backend):
    if backend == "cpu":
        lengths, dims, dtypes, batch, heads, kv_heads = (1, 17, 64, 200), (16, 64, 80, 128), DTYPES, 2, 4, 2
    else:  # the Triton interpreter: tiny cases
        lengths, dims, dtypes, batch, heads, kv_heads = (1, 17), (16,), DTYPES, 2, 2, 1
    cases = []
    combos = itertools.product(dtypes, (True, False), (False, True), lengths)
    for n, (dtype, causal, masked, t) in enumerate(combos):
        if backend != "cpu" and n % 2:
            continue
        dh = dims[(n // len(lengths)) % len(dims)]
        layout = ("contiguous", "bthd", "strided")[n % 3]
        case_id = (
            f"{backend}-{dtype}-{'causal' if causal else 'full'}-{'mask' if masked else 'nomask'}-T{t}-D{dh}-{layout}"
        )
        cases.append(pytest.param(backend, dtype, causal, masked, t, dh, layout, batch, heads, kv_heads, id=case_id))
    return cases


@pytest.mark.parametrize(
    "backend,dtype,causal,masked,t,dh,layout,batch,heads,kv_heads", [c for b in FUSED for c in _grid(b)]
)
def test_matches_reference(backend, dtype, causal, masked, t, dh, layout, batch, heads, kv_heads):
    q, k, v = make_qkv(batch, heads, kv_heads, t, t, dh, dtype, layout)
    compare(backend, q, k, v, causal, make_mask(batch, t) if masked else None)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "tq,tk,heads,kv_heads",
    [(17, 64, 4, 1), (64, 17, 4, 4), (1, 200, 2, 1), (200, 1, 2, 2), (70, 130, 6, 3)],
    ids=["Tq<Tk-gqa4", "Tq>Tk", "one-query", "one-key", "gqa2"],
)
@pytest.mark.parametrize("causal,masked", [(True, False), (True, True), (False, True)])
def test_cross_lengths_and_gqa(backend, dtype, tq, tk, heads, kv_heads, causal, masked):
    if backend != "cpu" and (tq > 17 or tk > 17):
        pytest.skip("the interpreter runs the small cases only")
    q, k, v = make_qkv(2, heads, kv_heads, tq, tk, 24, dtype, "bthd")
    compare(backend, q, k, v, causal, make_mask(2, tk) if masked else None, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tq,tk,causal", [(530, 600, True), (600, 530, True), (300, 600, False)])
def test_many_tiles_both_backward_schedules(dtype, threads, tq, tk, causal):
    """Lengths beyond the C++ kernels' 256-row blocks. With B·Hkv = 1 the backward runs
    its fused schedule on one thread and its split schedule on two."""
    q, k, v = make_qkv(1, 2, 1, tq, tk, 40, dtype, "bthd")
    mask = torch.rand(1, tk) > 0.1
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        compare("cpu", q, k, v, causal, mask)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("backend", FUSED)
def test_rows_without_keys_are_zero_not_nan(backend):
    # Tq > Tk under causal: rows 0-2 see no key; batch 1 has every key padded.
    q, k, v = make_qkv(2, 2, 1, 7, 4, 16, torch.float32)
    mask = torch.tensor([[True, False, True, True], [False] * 4])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend=backend)
    grads = torch.autograd.grad(out.sum() + finite(lse, lse).sum(), [q, k, v])
    no_key = torch.zeros(2, 2, 7, dtype=torch.bool)
    no_key[0, :, :3] = True
    no_key[1] = True
    assert torch.equal(lse == -float("inf"), no_key)
    assert bool((out[no_key] == 0).all()) and bool((grads[0][no_key] == 0).all())
    assert bool((grads[1][1] == 0).all()) and bool((grads[2][1] == 0).all())
    assert all(bool(torch.isfinite(t).all()) for t in (out, *grads))


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("batch,heads,tq,tk", [(2, 2, 0, 5), (2, 2, 5, 0), (2, 2, 0, 0), (0, 2, 3, 3), (2, 0, 3, 3)])
def test_empty_inputs(backend, batch, heads, tq, tk):
    """Empty batches, heads or sequences are valid: empty outputs; with no keys, 0 and lse = -inf."""
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, heads, 1, tq, tk, 8, torch.float32))
    out, lse = ak.attention(q, k, v, return_lse=True, backend=backend)
    expected_out, expected_lse = reference.attention(q, k, v, return_lse=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(g.shape == t.shape and bool((g == 0).all()) for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("backend", FUSED)
def test_nan_propagates_like_the_reference(backend):
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, torch.float32)
    q[0, 0, 4, 3] = float("nan")  # one query row
    k[0, 1, 6, 0] = float("nan")  # one key: every later row of head 1 reads it
    out = ak.attention(q, k, v, backend=backend)
    expected = reference.attention(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and bool(torch.isnan(out).any())
    torch.testing.assert_close(out, expected, equal_nan=True)


@pytest.mark.parametrize("backend", FUSED)
def test_gradcheck_fp64(backend):
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 7, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[True, True, False, True, True, False, True]])

    def fn(q, k, v):
        return ak.attention(q, k, v, key_padding_mask=mask, scale=0.8, return_lse=True, backend=backend)

    def no_key_rows(q, k, v):  # Tq = 5 > Tk = 3: rows 0-1 see no key (lse = -inf, set to 0 here)
        out, lse = ak.attention(q, k[:, :, :3], v[:, :, :3], return_lse=True, backend=backend)
        return out, finite(lse, lse)

    fast = backend == "triton"  # the interpreter runs one program at a time: a random projection of the Jacobian
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=fast)
    assert torch.autograd.gradcheck(no_key_rows, (q, k, v), fast_mode=fast)


@pytest.mark.parametrize("backend", FUSED)
def test_double_backward_is_exact(backend):
    """The fused backward is not differentiable itself; with create_graph=True the
    gradients come from the reference, so second derivatives are exact."""
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[True, False, True, True, True, True]])

    def fn(q, k, v):
        return ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend=backend)

    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=backend == "triton")  # interpreter: see above


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("causal,masked", [(True, True), (False, False)])
def test_opcheck(backend, causal, masked):
    q, k, v = make_qkv(2, 4, 2, 5, 7, 8, torch.float32)
    mask = make_mask(2, 7) if masked else None
    fwd, bwd = (ops._dispatch.fused_op(backend, name, q.device) for name in ("attn_fwd", "attn_bwd"))
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask, causal, 0.4)
    torch.library.opcheck(fwd, args)
    with torch.no_grad():
        out, lse = fwd(*args)
    for grad_lse in (None, torch.randn_like(lse)):
        bwd_args = (torch.randn_like(out), grad_lse, q.detach(), k.detach(), v.detach(), mask, out, lse, causal, 0.4)
        torch.library.opcheck(bwd, bwd_args)


@pytest.mark.parametrize("backend", FUSED)
def test_the_fused_op_ran_not_the_reference(backend):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 9, 9, 16, torch.float32))

    def step():
        torch.autograd.grad(ak.attention(q, k, v, backend=backend).sum(), [q, k, v])

    prefix = OP_PREFIX[backend]
    assert {prefix + "fwd", prefix + "bwd"} <= attnres_ops_called(step)


def _forward_backward(backend, q, k, v, mask, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ak.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True, backend=backend)
    torch.manual_seed(0)
    loss = (out.double() * torch.randn(out.shape, dtype=torch.float64)).sum() + finite(lse, lse).sum()
    return [out, lse, *torch.autograd.grad(loss, [q, k, v])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,causal", [(1, 2, 1, True), (2, 4, 2, False), (3, 3, 1, True)])
def test_cpu_bitwise_deterministic_across_runs_and_thread_counts(dtype, batch, heads, kv_heads, causal):
    """No atomics: one thread and two give the same bits. With B·Hkv = 1 the backward
    also switches schedule (fused on one thread, split on two)."""
    q, k, v = make_qkv(batch, heads, kv_heads, 300, 290, 48, dtype, "bthd")
    mask = torch.rand(batch, 290) > 0.2
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = _forward_backward("cpu", q, k, v, mask, causal)
        second = _forward_backward("cpu", q, k, v, mask, causal)
        torch.set_num_threads(1)
        single = _forward_backward("cpu", q, k, v, mask, causal)
    finally:
        torch.set_num_threads(previous)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------- the CPU decode path
#
# A few query rows per kv head (G · Tq <= 16, attention_cpu.cpp's decode_forward) against
# many keys: each kv head's rows read its keys once, key spans of 512 merged by their lse.

DECODE_EVENT = "attnres::attn_fwd_decode"  # recorded by the C++ decode path (seen by the profiler)


def decode_qkv(batch, heads, kv_heads, tq, tk, dh, dtype):
    """Shaped as the decode cache passes them: q a head view of ``[B, Tq, H, Dh]``, k and v
    the first Tk positions of preallocated ``[B, Hkv, Tk + 5, Dh]`` buffers."""
    q = torch.randn(batch, tq, heads, dh, dtype=torch.float64).to(dtype).transpose(1, 2)
    k, v = (torch.randn(batch, kv_heads, tk + 5, dh, dtype=torch.float64).to(dtype)[:, :, :tk] for _ in range(2))
    return q, k, v


DECODE_CASES = {  # tq, tk, heads, kv_heads, dh
    "one-query-3-spans": (1, 1100, 2, 2, 64),
    "gqa4-2-spans": (1, 513, 8, 2, 80),
    "odd-dh": (3, 300, 2, 1, 7),
    "16-rows-5-spans": (4, 2100, 4, 1, 48),
    "chunk-dh96": (2, 64, 2, 2, 96),
    "one-key": (1, 1, 2, 1, 16),
    "rows-without-keys": (4, 2, 2, 2, 32),  # causal: queries 0-1 see no key
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=list(DECODE_CASES))
@pytest.mark.parametrize("causal,masked", [(True, False), (True, True), (False, True)])
def test_cpu_decode_path_matches_reference(dtype, case, causal, masked):
    tq, tk, heads, kv_heads, dh = DECODE_CASES[case]
    q, k, v = decode_qkv(2, heads, kv_heads, tq, tk, dh, dtype)
    mask = make_mask(2, tk) if masked else None  # batch 1: every key padded
    assert DECODE_EVENT in attnres_ops_called(lambda: ak.attention(q, k, v, causal=causal, key_padding_mask=mask))
    compare("cpu", q, k, v, causal, mask, scale=0.3 if dh == 7 else None)  # forward and the backward


def test_cpu_decode_path_is_taken_for_few_rows_only():
    for tq, heads, kv_heads, expected in [(1, 4, 4, True), (1, 16, 1, True), (4, 8, 2, True), (17, 2, 2, False)]:
        q, k, v = decode_qkv(1, heads, kv_heads, tq, 40, 16, torch.float32)
        assert (DECODE_EVENT in attnres_ops_called(lambda: ak.attention(q, k, v))) == expected, (tq, heads, kv_heads)
    q, k, v = decode_qkv(1, 17, 1, 1, 40, 16, torch.float32)  # 17 query heads per kv head
    assert DECODE_EVENT not in attnres_ops_called(lambda: ak.attention(q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "tq,heads,kv_heads,dh", [(1, 8, 8, 64), (1, 8, 2, 64), (1, 8, 1, 64), (3, 4, 1, 40), (2, 2, 2, 7)]
)
def test_cpu_decode_bitwise_across_runs_and_thread_counts(dtype, tq, heads, kv_heads, dh):
    """Key spans are fixed by Tk and merged in one order: 1 and 2 threads give the same bits."""
    q, k, v = decode_qkv(3, heads, kv_heads, tq, 1300, dh, dtype)
    mask = torch.rand(3, 1300) > 0.2
    mask[1, 512:] = False  # batch 1 sees the first span only
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (2, 2, 1):
            torch.set_num_threads(threads)
            results.append(_forward_backward("cpu", q, k, v, mask, True))
    finally:
        torch.set_num_threads(previous)
    assert DECODE_EVENT in attnres_ops_called(lambda: ak.attention(q, k, v, key_padding_mask=mask))
    for a, b, c in zip(*results):
        assert torch.equal(a, b) and torch.equal(a, c)


@torch.no_grad()
def test_cpu_decode_long_cache_matches_reference():
    """K/V beyond 32 MiB (the decode path then prefetches the next chunk's rows)."""
    q = torch.randn(2, 1, 4, 64).transpose(1, 2)
    k, v = (torch.randn(2, 2, 20100, 64)[:, :, :20000] for _ in range(2))
    mask = torch.rand(2, 20000) > 0.1
    out, lse = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    expected, expected_lse = reference.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, expected_lse)


def test_cpu_decode_nan_propagates_like_the_reference():
    q, k, v = decode_qkv(1, 4, 2, 2, 600, 16, torch.float32)
    q[0, 0, 1, 3] = float("nan")  # one query row
    k[0, 1, 550, 0] = float("nan")  # one key in the second kv head's last span: heads 2-3 read it
    out, lse = ak.attention(q, k, v, return_lse=True)
    expected, expected_lse = reference.attention(q, k, v, return_lse=True)
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and bool(torch.isnan(out[0, 2:]).all())
    torch.testing.assert_close(out, expected, equal_nan=True)
    torch.testing.assert_close(lse, expected_lse, equal_nan=True)


BF16_DOT_EVENT = "attnres::attn_fwd_decode_bf16_dot"  # bf16 decode scores by vdpbf16ps
AMX_SCORES_EVENT = "attnres::attn_fwd_decode_amx_scores"  # bf16 decode scores on AMX tiles


def machine_takes(flags_needed: set[str], env_off: str) -> bool:
    """Whether this machine's build takes a path that needs these CPU flags: the CPU has them and
    the extension was built for AVX-512 (its build info says so, whatever ATTNRES_CPU_CAPABILITY
    the tests run with), unless the environment variable ``env_off`` is 0."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return flags_needed <= flags and "CPU vector ISA: avx512;" in ak.build_info() and os.environ.get(env_off) != "0"


def machine_takes_bf16_dot() -> bool:
    return machine_takes({"avx512_bf16"}, "ATTNRES_CPU_AVX512_BF16")


def machine_takes_amx() -> bool:
    return machine_takes({"amx_bf16", "amx_tile"}, "ATTNRES_CPU_AMX")


def check_bf16_decode_scores():
    """bf16 decode steps read in place (1-4 query rows per kv head; whole 32-column blocks,
    a last 16-column one, or both; groups of 16 keys and the keys after them; a scale that
    is not a power of 2; 5-16 rows, read in place with AMX scores and packed otherwise)
    against the reference, forward and backward, and NaN propagation; 2-16 rows with Dh a
    multiple of 32 take AMX tiles exactly when the machine has them, the others with up to
    4 rows AVX512-BF16 exactly when it has that."""
    for tq, tk, heads, kv_heads, dh, scale in [
        (1, 700, 8, 8, 64, None),
        (1, 300, 8, 2, 80, 0.3),
        (2, 37, 4, 2, 16, None),
        (1, 513, 2, 1, 48, 0.7),
        (1, 530, 8, 2, 64, None),
        (3, 77, 3, 3, 128, 0.3),
        (2, 20, 2, 2, 32, None),
        (1, 16, 4, 2, 256, 0.7),
        (1, 300, 8, 1, 64, None),
        (1, 77, 16, 1, 128, 0.3),
        (2, 40, 6, 2, 32, None),
    ]:
        q, k, v = decode_qkv(2, heads, kv_heads, tq, tk, dh, torch.bfloat16)
        mask = make_mask(2, tk)
        events = attnres_ops_called(lambda: ak.attention(q, k, v, key_padding_mask=mask, scale=scale))
        rows = heads // kv_heads * tq
        amx = machine_takes_amx() and rows >= 2 and dh % 32 == 0
        assert DECODE_EVENT in events and (AMX_SCORES_EVENT in events) == amx, events
        assert (BF16_DOT_EVENT in events) == (machine_takes_bf16_dot() and not amx and rows <= 4), events
        compare("cpu", q, k, v, True, mask, scale=scale)
    q, k, v = decode_qkv(1, 2, 1, 1, 300, 64, torch.bfloat16)
    k[0, 0, 20, 5] = float("nan")
    assert bool(torch.isnan(ak.attention(q, k, v)).all())


def test_cpu_decode_bf16_scores():
    check_bf16_decode_scores()


def test_cpu_decode_bf16_scores_without_avx512_bf16():
    """The same with ATTNRES_CPU_AVX512_BF16=0 (read once per process: a subprocess), the
    path of CPUs without AVX512-BF16."""
    run_check_in_subprocess(__name__, "check_bf16_decode_scores()", {"ATTNRES_CPU_AVX512_BF16": "0"})


def test_cpu_decode_bf16_scores_without_amx():
    """The same with ATTNRES_CPU_AMX=0: the path of CPUs without AMX (vdpbf16ps for every
    case on a CPU with AVX512-BF16)."""
    run_check_in_subprocess(__name__, "check_bf16_decode_scores()", {"ATTNRES_CPU_AMX": "0"})


@pytest.mark.parametrize("group", range(2, 17))
def test_cpu_decode_bf16_every_group_size(group):
    """Every count of query rows per kv head the decode path takes (2-16: AMX scores where the
    machine has them, 4 or 16 rows at a time; vdpbf16ps or fp32 copies elsewhere), over two groups
    of 16 keys and five keys after them, forward and backward against the reference."""
    q, k, v = decode_qkv(2, group, 1, 1, 37, 64, torch.bfloat16)
    mask = make_mask(2, 37)
    events = attnres_ops_called(lambda: ak.attention(q, k, v, key_padding_mask=mask))
    assert DECODE_EVENT in events and (AMX_SCORES_EVENT in events) == machine_takes_amx(), events
    compare("cpu", q, k, v, True, mask, scale=0.3)


def test_cpu_decode_gradcheck_fp64():
    """Decode shapes (one or two queries, GQA, keys over two spans, padding) through the
    decode forward and the tile backward."""
    q = torch.randn(1, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 520, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(1, 520) > 0.3

    def fn(q, k, v):
        return ak.attention(q, k, v, key_padding_mask=mask, return_lse=True)

    def one_query(q, k, v):
        return ak.attention(q[:, :, :1], k, v, scale=0.7, return_lse=True)

    assert DECODE_EVENT in attnres_ops_called(lambda: fn(q, k, v))
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradcheck(one_query, (q, k, v))


def test_cpu_compile_fullgraph_matches_eager():
    q, k, v = make_qkv(2, 4, 2, 9, 11, 16, torch.float32)
    mask = torch.rand(2, 11) > 0.2
    mask[:, -1] = True

    def fn(q, k, v):
        out, lse = ak.attention(q, k, v, key_padding_mask=mask, return_lse=True, backend="cpu")
        causal_only = ak.attention(q, k, v, scale=0.5, backend="cpu")
        return (out * 1.5).sum() + lse.sum() + causal_only.square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_loss = fn(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    compiled_loss = compiled(*inputs)
    compiled_grads = torch.autograd.grad(compiled_loss, inputs)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- backend selection and bad input


@pytest.fixture
def no_kernel(monkeypatch):
    """Makes any fused-kernel launch fail the test: errors must come from validation."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the bad input was rejected")

    monkeypatch.setattr(ops._dispatch, "fused_op", lambda backend, name: launched)


@pytest.mark.parametrize("backend", FUSED)
def test_head_size_beyond_the_fused_limit_raises_before_any_kernel(no_kernel, backend):
    q, k, v = make_qkv(1, 2, 1, 4, 4, attention_ops.MAX_HEAD_DIM + 1, torch.float32)
    with pytest.raises(ak.BackendUnavailableError, match="Dh <= 256"):
        ak.attention(q, k, v, backend=backend)


def test_explicit_backend_that_cannot_run_raises(no_kernel):
    q, k, v = make_qkv(1, 2, 1, 4, 4, 8, torch.float32)
    with pytest.raises(ak.BackendUnavailableError, match="cuda"):
        ak.attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="unknown backend"):
        ak.attention(q, k, v, backend="fastest")


def test_auto_falls_back_to_the_reference_beyond_the_head_size_limit():
    q, k, v = make_qkv(1, 2, 1, 4, 4, 300, torch.float32)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert attnres_ops_called(lambda: ak.attention(q, k, v)) == set()
        torch.testing.assert_close(ak.attention(q, k, v), reference.attention(q, k, v))


def _qkv(q=(2, 4, 5, 8), kv=(2, 2, 6, 8), dtype=torch.float32):
    return torch.randn(q).to(dtype), torch.randn(kv).to(dtype), torch.randn(kv).to(dtype)


BAD_CALLS = [
    ("q not 4-D", lambda: (torch.randn(4, 5, 8), *_qkv()[1:]), {}, ValueError, "`q` must be 4-D"),
    ("k not a tensor", lambda: (_qkv()[0], [[1.0]], _qkv()[2]), {}, TypeError, "`k` must be a tensor"),
    ("integer dtype", lambda: tuple(t.long() for t in _qkv()), {}, TypeError, "supported: float16"),
    ("mixed dtypes", lambda: (_qkv()[0], _qkv()[1].double(), _qkv()[2]), {}, TypeError, "`k` has dtype"),
    ("k and v shapes", lambda: (*_qkv()[:2], torch.randn(2, 2, 7, 8)), {}, ValueError, "one shape"),
    ("batch mismatch", lambda: _qkv(kv=(3, 2, 6, 8)), {}, ValueError, "batch size or head size"),
    ("head size mismatch", lambda: _qkv(kv=(2, 2, 6, 4)), {}, ValueError, "batch size or head size"),
    ("heads not a multiple", lambda: _qkv(kv=(2, 3, 6, 8)), {}, ValueError, "multiple of key/value heads"),
    ("zero head size", lambda: _qkv(q=(2, 4, 5, 0), kv=(2, 2, 6, 0)), {}, ValueError, "Dh = 0"),
    (
        "device mismatch",
        lambda: (_qkv()[0], torch.randn(2, 2, 6, 8, device="meta"), _qkv()[2]),
        {},
        ValueError,
        "on meta",
    ),
    ("mask dtype", _qkv, {"key_padding_mask": torch.ones(2, 6)}, TypeError, "must be a bool tensor"),
    ("mask shape", _qkv, {"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, r"\[B, Tk\]"),
    ("mask rank", _qkv, {"key_padding_mask": torch.ones(2, 1, 6, dtype=torch.bool)}, ValueError, r"\[B, Tk\]"),
    (
        "mask device",
        _qkv,
        {"key_padding_mask": torch.ones(2, 6, dtype=torch.bool, device="meta")},
        ValueError,
        "`key_padding_mask` is on meta",
    ),
    ("negative scale", _qkv, {"scale": -1.0}, ValueError, "positive finite"),
    ("nan scale", _qkv, {"scale": float("nan")}, ValueError, "positive finite"),
]


@pytest.mark.parametrize("backend", ["reference", *FUSED])
@pytest.mark.parametrize("make,kwargs,error,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_before_any_kernel(no_kernel, backend, make, kwargs, error, match):
    q, k, v = make()
    with pytest.raises(error, match=match):
        if backend == "reference":
            reference.attention(q, k, v, **kwargs)
        else:
            ak.attention(q, k, v, backend=backend, **kwargs)


# The bad calls ak.attention hands to the C++ op unchecked: plain CPU tensors, q 4-D with a head size it takes.
OP_CHECKED_BAD_CALLS = [
    c for c in BAD_CALLS if attention_ops._plain_cpu_call(*c[1]()[:3], c[2].get("key_padding_mask"))
]


@pytest.mark.parametrize(
    "make,kwargs", [c[1:3] for c in OP_CHECKED_BAD_CALLS], ids=[c[0] for c in OP_CHECKED_BAD_CALLS]
)
def test_bad_calls_the_public_function_hands_to_the_cpu_op_are_rejected_by_it(make, kwargs):
    """``ak.attention`` sends plain CPU tensors to the C++ op without the Python checks (they only word
    the error afterwards): every such bad call must make the op itself raise, before its kernel."""
    q, k, v = make()
    scale = kwargs.get("scale", q.shape[3] ** -0.5)
    with pytest.raises((RuntimeError, TypeError)):
        torch.ops.attnres.attn_fwd.default(q, k, v, kwargs.get("key_padding_mask"), True, scale)


def test_cpu_op_checks_its_arguments():
    """The C++ op called directly (no Python validation) still rejects bad input."""
    q, k, v = _qkv()
    fwd = torch.ops.attnres.attn_fwd
    with pytest.raises(RuntimeError, match="head size must be in"):
        fwd(*_qkv(q=(1, 2, 3, 300), kv=(1, 2, 3, 300)), None, True, 0.1)
    with pytest.raises(RuntimeError, match="one dtype"):
        fwd(q, k.double(), v, None, True, 0.1)
    with pytest.raises(RuntimeError, match="key_padding_mask must be"):
        fwd(q, k, v, torch.ones(2, 5, dtype=torch.bool), True, 0.1)
    out, lse = fwd(q, k, v, None, True, 0.1)
    with pytest.raises(RuntimeError, match="lse must be"):
        torch.ops.attnres.attn_bwd(out, None, q, k, v, None, out, lse.double(), True, 0.1)


# ---------------------------------------------------------------- SDPA as a backend, and "auto" on CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "heads, kv_heads, tq, tk, causal, scale",
    [
        (4, 4, 7, 7, True, None),  # square causal
        (4, 2, 3, 9, True, None),  # a chunk of the last queries over a longer cache: bottom-right
        (6, 2, 1, 11, True, 0.3),  # one decode query sees every key
        (4, 1, 5, 8, False, None),  # not causal, one key/value head
    ],
)
def test_sdpa_backend_has_our_semantics(dtype, heads, kv_heads, tq, tk, causal, scale):
    """``backend="sdpa"`` (what "auto" runs on CUDA where it is faster) computes what the reference does:
    bottom-right causal alignment when Tq < Tk, grouped-query heads, the scale; gradients too."""
    torch.manual_seed(tq * tk)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, heads, kv_heads, tq, tk, 16, dtype, layout="bthd"))
    out = ak.attention(q, k, v, causal=causal, scale=scale, backend="sdpa")
    want = reference.attention(q, k, v, causal=causal, scale=scale)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, want, **tol)
    dout = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize(
    "kwargs, tq, tk, match",
    [
        (dict(return_lse=True), 4, 4, "does not return the LSE"),
        (dict(key_padding_mask=torch.ones(1, 4, dtype=torch.bool)), 4, 4, "key padding mask"),
        (dict(causal=True), 6, 4, "Tq > Tk"),
    ],
)
def test_sdpa_backend_refuses_what_sdpa_cannot_compute(kwargs, tq, tk, match):
    q, k, v = make_qkv(1, 2, 2, tq, tk, 8, torch.float32)
    with pytest.raises(ak.BackendUnavailableError, match=match):
        ak.attention(q, k, v, backend="sdpa", **kwargs)


@pytest.fixture
def fake_cuda_capability(monkeypatch):
    """Fake CUDA tensors (no GPU needed) on a device of compute capability 9.0."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with FakeTensorMode():
        yield


def test_auto_on_cuda_runs_sdpa_where_it_computes_the_call(fake_cuda_capability, monkeypatch):
    """Without a measured rule that ours is faster, "auto" on CUDA tensors picks SDPA for every call SDPA
    can compute, and our kernels (Triton first) for the rest."""
    q = torch.empty(2, 8, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 80, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(2, 80, dtype=torch.bool, device="cuda")
    assert attention_ops.resolve_backend("auto", q, k) == "sdpa"
    assert attention_ops.resolve_backend("auto", q, k, causal=False) == "sdpa"
    fused = attention_ops.resolve_backend("auto", q, k, key_padding_mask=mask)
    assert fused in ("triton", "cuda", "reference") and fused != "sdpa"
    assert attention_ops.resolve_backend("auto", q, k, return_lse=True) == fused
    # A measured rule that ours is faster on this architecture hands such calls back to our kernels.
    monkeypatch.setitem(attention_ops.FASTER_THAN_SDPA, (9, 0), lambda q, causal: q.shape[-1] == 64)
    assert attention_ops.resolve_backend("auto", q, k) == fused
    q128, k128 = (torch.empty(*t.shape[:-1], 128, device="cuda", dtype=torch.bfloat16) for t in (q, k))
    assert attention_ops.resolve_backend("auto", q128, k128) == "sdpa"


def test_models_attention_auto_follows_the_op_not_the_depth_backend(monkeypatch):
    """A model's ``attention_backend="auto"`` is the attention op's own choice (SDPA on CUDA where faster),
    whatever backend its depth reads run on."""
    seen = []
    original = attention_ops.attention

    def spy(q, k, v, **kwargs):
        seen.append(kwargs["backend"])
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(ak.ops, "attention", spy)
    model = ak.nn.FullAttnResTransformer(32, 16, 2, 2, backend="reference")
    model(torch.randint(0, 32, (1, 5)))
    assert seen == ["auto", "auto"]


@pytest.mark.cuda
def test_auto_on_a_gpu_runs_sdpa_with_our_semantics():
    """On a GPU whose architecture has no rule for our kernels, "auto" runs SDPA, and SDPA computes the
    reference's result (bottom-right causal alignment, grouped-query heads)."""
    q, k, v = (t.cuda() for t in make_qkv(2, 8, 2, 64, 96, 64, torch.bfloat16))
    capability = torch.cuda.get_device_capability(q.device)
    expected = "sdpa" if capability not in attention_ops.FASTER_THAN_SDPA else None
    if expected is not None:
        assert attention_ops.resolve_backend("auto", q, k) == expected
    out = ak.attention(q, k, v)
    want = reference.attention(q, k, v)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
