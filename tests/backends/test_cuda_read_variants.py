"""The read's variants in the CUDA kernels (DESIGN.md §2.7), run on CPU tensors by the SIMT harness:
normalised values with a key-norm weight (values r_i v_i ⊙ γ) and sliced low-rank keys (key_rank =
R: the keys are the last R columns, RMS-normalised over those R), in the depth read (single and
multi-query, the merge, the fused output norm) and in the Block step, forward and every gradient.
Against the reference at the same precision and an fp64 oracle (FlashAttention's rule) and by fp64
gradcheck through the kernel code; odd D and R, several leading dims, strided and transposed sources,
mixed dtypes. The global-memory traffic of the variants is in tests/backends/test_cuda_io.py."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.cuda import emulation
from tests.ops.test_block_step import make_step, step_with_grads
from tests.support import assert_close_to_oracle, attnres_ops_called, make_sources

pytestmark = pytest.mark.usefixtures("cuda_emulation")


def kernels_run():
    return [x.kernel for x in emulation.launch_log()]


# name -> (keyword options of the read for width d, whether it takes a key-norm weight, the key width R)
VARIANTS = {
    "weighted-normalised-values": (lambda d: dict(normalize_values=True, scale=d**-0.5), True, lambda d: d),
    "low-rank-keys": (lambda d: dict(key_rank=d // 4 + 1), True, lambda d: d // 4 + 1),
    "low-rank-keys-unweighted": (lambda d: dict(key_rank=d - 2, scale=0.5), False, lambda d: d - 2),
}


def _params(variant, q, d, shared_norm_weight=False):
    options, weighted, rank = VARIANTS[variant]
    r = rank(d)
    w = torch.randn((r,) if q is None else (q, r)) * 0.7
    gamma = None
    if weighted:
        gamma = 1 + 0.3 * torch.randn((r,) if q is None or shared_norm_weight else (q, r))
    g_out = 1 + 0.3 * torch.randn(d)
    return w, gamma, g_out, options(d)


def compare(variant, sources, q, out_norm, prefix_split=None, shared_norm_weight=False):
    """Outputs and every gradient of backend="cuda" vs the reference (same precision) and an fp64 oracle."""
    d = sources[0].shape[-1]
    w, gamma, g_out, kwargs = _params(variant, q, d, shared_norm_weight)
    if out_norm:
        kwargs.update(out_norm_eps=1e-3)
    head = make_sources(prefix_split, sources[0].shape[:-1], d, sources[0].dtype) if prefix_split else None

    def run(read, merge, fp64):
        srcs = [(s.double() if fp64 else s).detach().requires_grad_() for s in sources]
        params = [p.double() if fp64 and p is not None else p for p in (w, gamma, g_out if out_norm else None)]
        params = [p.detach().requires_grad_() if p is not None else None for p in params]
        w_, gamma_, g_ = params
        leaves = srcs + [p for p in params if p is not None]
        kw = dict(kwargs, out_norm_weight=g_, return_lse=True)
        if head is None:
            outs = read(w_, srcs, gamma_, **kw)
        else:
            hs = [h.double() if fp64 else h for h in head]
            h_a, lse_a = reference.depth_attention(w_.detach(), hs, gamma_, return_lse=True, **kwargs)
            h_a, lse_a = h_a.detach().requires_grad_(), lse_a.detach().requires_grad_()
            leaves += [h_a, lse_a]
            outs = merge(w_, h_a, lse_a, srcs, gamma_, **kw)
        gen = torch.Generator().manual_seed(1234)
        loss = sum((o.double() * torch.randn(o.shape, dtype=torch.float64, generator=gen)).sum() for o in outs)
        return list(outs), list(torch.autograd.grad(loss, leaves))

    fused = run(
        lambda *a, **k: ak.depth_attention(*a, backend="cuda", **k),
        lambda *a, **k: ak.depth_attention_merge(*a, backend="cuda", **k),
        False,
    )
    kernels = kernels_run()
    assert any(k.startswith("depth_attn_fwd<") for k in kernels), kernels
    assert any(k.startswith("depth_attn_bwd<") for k in kernels), kernels
    same = run(reference.depth_attention, reference.depth_attention_merge, False)
    oracle = run(reference.depth_attention, reference.depth_attention_merge, True)
    for name, a, b, c in zip(["out", "lse"], fused[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    n = len(sources)
    group = lambda g: [torch.cat([x.flatten() for x in g[:n]])] + g[n:]  # the N source gradients as one
    for k, (a, b, c) in enumerate(zip(group(fused[1]), group(same[1]), group(oracle[1]))):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert_close_to_oracle(f"grad {k}", a, b, c)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("q,out_norm", [(None, False), (3, True), (None, True), (2, False)])
def test_read_matches_reference(variant, dtype, q, out_norm):
    """Odd D (37) and R; strided sources (rows not contiguous) with two leading dims."""
    compare(variant, make_sources(4, (2, 5), 37, dtype, "strided"), q, out_norm)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", [1, 8, 100, 1000])
def test_widths_and_layouts(variant, d):
    """From one column (R = 1) to two groups per thread; transposed sources (leading dims that do
    not flatten), a key-norm weight shared by the sites."""
    if VARIANTS[variant][2](d) < 1:
        pytest.skip("no such key width")
    sources = make_sources(3, (3, 2), d, torch.float32, "transposed")
    compare(variant, sources, q=2, out_norm=d != 8, shared_norm_weight=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_dtypes_match_reference(variant):
    """Each source read in its own dtype (fp32, bf16, fp16), the output in the promoted one."""
    sources = [s.to(dt) for s, dt in zip(make_sources(3, (4,), 24), (torch.float32, torch.bfloat16, torch.float16))]
    compare(variant, sources, q=2, out_norm=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("q,out_norm", [(None, True), (3, False), (2, True)])
def test_merge_matches_reference(variant, q, out_norm):
    compare(variant, make_sources(2, (6,), 19), q, out_norm, prefix_split=3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_equals_read_over_union(variant):
    d = 24
    sources = make_sources(5, (4,), d, torch.float64)
    w, gamma, g_out, kw = _params(variant, 2, d)
    w, gamma, g_out = (p.double() if p is not None else None for p in (w, gamma, g_out))
    h_a, lse_a = ak.depth_attention(w, sources[:3], gamma, return_lse=True, backend="cuda", **kw)
    merged = ak.depth_attention_merge(
        w, h_a, lse_a, sources[3:], gamma, out_norm_weight=g_out, return_lse=True, backend="cuda", **kw
    )
    whole = ak.depth_attention(w, sources, gamma, out_norm_weight=g_out, return_lse=True, backend="cuda", **kw)
    for a, b in zip(merged, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "q,out_norm,merge", [(None, False, False), (2, True, False), (None, True, True), (2, False, True)]
)
def test_gradcheck_fp64(variant, q, out_norm, merge):
    """Every differentiable input (sources, query, key-norm weight, output-norm weight, the merge
    prefix) through out and lse, in the kernel code."""
    d = 7
    options, weighted, rank = VARIANTS[variant]
    r, kw = rank(d), options(d)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    qs = (r,) if q is None else (q, r)
    sources, w = [mk(2, 3, d) for _ in range(3)], mk(*qs)
    gamma = (1 + 0.3 * torch.randn(qs, dtype=torch.float64)).requires_grad_() if weighted else None
    g_out = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).requires_grad_() if out_norm else None
    params = [p for p in (w, gamma, g_out) if p is not None]
    prefix = []
    if merge:
        h_a, lse_a = reference.depth_attention(
            w.detach(), [torch.randn(2, 3, d, dtype=torch.float64)], gamma, return_lse=True, **kw
        )
        prefix = [h_a.detach().requires_grad_(), lse_a.detach().requires_grad_()]

    def fn(*args):
        srcs, rest = list(args[:3]), list(args[3:])
        w_ = rest.pop(0)
        gamma_ = rest.pop(0) if weighted else None
        g_ = rest.pop(0) if out_norm else None
        common = dict(kw, out_norm_weight=g_, out_norm_eps=1e-2, return_lse=True, backend="cuda")
        if merge:
            return ak.depth_attention_merge(w_, rest[0], rest[1], srcs, gamma_, **common)
        return ak.depth_attention(w_, srcs, gamma_, **common)

    assert torch.autograd.gradcheck(fn, (*sources, *params, *prefix))


def test_full_key_rank_is_the_ordinary_read_bit_for_bit():
    """key_rank = D runs the very arithmetic of the ordinary read: the same bits, forward and backward."""
    d = 40
    sources = make_sources(3, (5, 3), d, torch.bfloat16)
    w, g, g_out = torch.randn(2, d), 1 + 0.3 * torch.randn(2, d), 1 + 0.3 * torch.randn(d)

    def run(**kw):
        srcs = [s.clone().requires_grad_() for s in sources]
        params = [p.clone().requires_grad_() for p in (w, g, g_out)]
        out, lse = ak.depth_attention(
            params[0], srcs, params[1], out_norm_weight=params[2], return_lse=True, backend="cuda", **kw
        )
        gen = torch.Generator().manual_seed(0)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum() + (
            lse * torch.randn(lse.shape, generator=gen)
        ).sum()
        return [out, lse, *torch.autograd.grad(loss, srcs + params)]

    for a, b in zip(run(), run(key_rank=d)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fused_kernels_ran(variant):
    """No reference fallback: the emulated ops ran, with a kernel of each pass."""
    sources = make_sources(3, (4,), 16)
    w, gamma, _, kw = _params(variant, 3, 16)
    w.requires_grad_()

    def read():
        ak.depth_attention(w, sources, gamma, backend="cuda", **kw).sum().backward()

    called = attnres_ops_called(read)
    assert {"attnres_emu::depth_attn_fwd", "attnres_emu::depth_attn_bwd"} <= called, called
    kernels = [k.split("<")[0] for k in kernels_run()]
    assert kernels[0] == "depth_attn_fwd" and kernels[-1] == "site_grads", kernels
    assert set(kernels[1:-1]) == {"depth_attn_bwd"}, kernels  # one launch per site tile


def test_auto_resolution_takes_the_cuda_kernels_for_the_variants():
    from attnres_kernels.ops.depth_attention import resolve_backend

    options = ak._validation.check_read_options(1e-6, key_rank=4)
    assert resolve_backend("cuda", torch.device("cpu"), 16, torch.float32, options) == "cuda"
    weighted = ak._validation.check_read_options(1e-6, normalize_values=True)
    assert resolve_backend("cuda", torch.device("cpu"), 16, torch.float32, weighted, weighted_values=True) == "cuda"


def test_too_wide_fp64_weighted_values_with_the_output_norm_are_refused_by_name():
    """Normalised values with a key-norm weight and the output norm keep six rows per team in shared
    memory: with fp64 math that fits sm_80+'s 99 KiB up to about D = 2500 only."""
    d = 3000
    sources = [torch.randn(1, d, dtype=torch.float64)]
    with pytest.raises(ValueError, match="normalised values with a key-norm weight"):
        torch.ops.attnres_emu.depth_attn_fwd(
            sources, torch.randn(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64), None, None,
            torch.ones(d, dtype=torch.float64), 1e-6, 1e-6, 1.0, True, None, None,
        )  # fmt: skip


def test_more_sources_than_the_parameter_table_are_refused_by_name():
    sources = [torch.randn(1, 4) for _ in range(129)]
    with pytest.raises(ValueError, match="at most 128 sources"):
        ak.depth_attention(torch.randn(4), sources, backend="cuda")


# ---------------------------------------------------------------- the Block step


def stepper(backend, key_rank):
    def fn(partial, update, w, h_a, lse_a, gamma, g_out):
        kwargs = dict(out_norm_weight=g_out, key_rank=key_rank, return_lse=True)
        if backend == "reference":
            return reference.block_step(partial, update, w, h_a, lse_a, gamma, **kwargs)
        return ak.block_step(partial, update, w, h_a, lse_a, gamma, backend=backend, **kwargs)

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d,rank", [(37, 9), (64, 16), (1000, 250), (5, 1)])
@pytest.mark.parametrize("out_norm", [False, True])
def test_block_step_with_low_rank_keys_matches_reference(dtype, d, rank, out_norm):
    partial, update, _, _, _, _, g_out = make_step((2, 3), d, dtype, dtype, dtype, "strided", out_norm)
    w, gamma = torch.randn(rank) * 0.5, 1 + 0.3 * torch.randn(rank)
    h_a, lse_a = reference.depth_attention(
        w.double(), make_sources(2, (2, 3), d, torch.float64), gamma.double(), key_rank=rank, return_lse=True
    )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inputs = (partial, update, w, h_a.to(dtype), lse_a.to(acc), gamma, g_out)
    outs = [torch.randn(t.shape, dtype=torch.float64) for t in stepper("reference", rank)(*inputs)]
    got = step_with_grads(stepper("cuda", rank), inputs, outs)
    kernels = kernels_run()
    assert any(k.startswith("block_step_fwd<") for k in kernels) and any(
        k.startswith("block_step_bwd<") for k in kernels
    )
    same = step_with_grads(stepper("reference", rank), inputs, outs)
    oracle = step_with_grads(stepper("reference", rank), [x.double() if x is not None else None for x in inputs], outs)
    for name, a, b, c in zip(("new_partial", "out", "lse"), got[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close_to_oracle(name, a, b, c)
    for k, (a, b, c) in enumerate(zip(got[1], same[1], oracle[1])):
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert_close_to_oracle(f"grad {k}", a, b, c)


@pytest.mark.parametrize("out_norm", [False, True])
def test_block_step_with_low_rank_keys_gradcheck_fp64(out_norm):
    d, rank = 7, 3
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    partial, update, h_a, w = mk(3, d), mk(3, d), mk(3, d), mk(rank)
    lse_a, gamma = mk(3), (1 + 0.3 * torch.randn(rank, dtype=torch.float64)).requires_grad_()
    g_out = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).requires_grad_()

    def fn(partial, update, w, h_a, lse_a, gamma, g_out):
        return ak.block_step(
            partial, update, w, h_a, lse_a, gamma, out_norm_weight=g_out if out_norm else None, key_rank=rank,
            return_lse=True, backend="cuda",
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (partial, update, w, h_a, lse_a, gamma, g_out))


def test_block_step_with_low_rank_keys_equals_the_two_phase_read():
    """Phase 1 (a read over the committed blocks) and the step's merge of the new partial sum give
    the read over all of them, with sliced low-rank keys."""
    d, rank = 24, 6
    blocks = make_sources(3, (4,), d, torch.float64)
    partial, update = torch.randn(4, d, dtype=torch.float64), torch.randn(4, d, dtype=torch.float64)
    w, gamma = torch.randn(rank, dtype=torch.float64), 1 + 0.2 * torch.randn(rank, dtype=torch.float64)
    h_a, lse_a = ak.depth_attention(w, blocks, gamma, key_rank=rank, return_lse=True, backend="cuda")
    new_partial, out = ak.block_step(partial, update, w, h_a, lse_a, gamma, key_rank=rank, backend="cuda")
    whole = ak.depth_attention(w, [*blocks, partial + update], gamma, key_rank=rank, backend="cuda")
    torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
    assert torch.equal(new_partial, partial + update)
