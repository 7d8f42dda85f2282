"""The nvcc build of the CUDA kernels on a GPU (marked `cuda`: skipped without one).

On machines without a GPU the same kernel code runs under the SIMT harness
(tests/backends/test_cuda_emulated.py, tests/backends/test_cuda_io.py)."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from tests.support import assert_close_to_oracle, attnres_ops_called, make_sources, read_with_grads, site_params

pytestmark = pytest.mark.cuda


def _read(backend, merge):
    def fn(srcs, w, g, g_out, *prefix):
        kwargs = dict(out_norm_weight=g_out, return_lse=True)
        if merge:
            return ak.depth_attention_merge(w, prefix[0], prefix[1], srcs, g, backend=backend, **kwargs)
        return ak.depth_attention(w, srcs, g, backend=backend, **kwargs)

    return fn


def test_the_cuda_kernels_are_built():
    assert "cuda" in ak.available_backends("cuda", 1024, torch.bfloat16), ak.build_info()


@pytest.mark.parametrize("d", [7, 1000, 4096])
@pytest.mark.parametrize("q,merge", [(None, False), (3, False), (2, True)])
def test_bf16_end_to_end_matches_reference(d, q, merge):
    sources = [s.cuda() for s in make_sources(5, (4, 33), d, torch.bfloat16)]
    w, g, g_out = (p.cuda() for p in site_params(q, d))
    params = [w, g, g_out]
    if merge:
        params += list(reference.depth_attention(w, [s.float() for s in sources[:2]], g, return_lse=True))
        params[3] = params[3].to(torch.bfloat16)
        sources = sources[2:]
    lead = (q,) if q else ()
    out_weights = [torch.randn(lead + (4, 33, d), device="cuda"), torch.randn(lead + (4, 33), device="cuda")]
    out_weights = [x.double() for x in out_weights]
    got = read_with_grads(_read("cuda", merge), sources, params, out_weights)
    same = read_with_grads(_read("reference", merge), sources, params, out_weights)
    oracle = read_with_grads(
        _read("reference", merge), [s.double() for s in sources], [p.double() for p in params], out_weights
    )
    for name, a, b, c in zip(["out", "lse"], got[0], same[0], oracle[0]):
        assert a.dtype == b.dtype
        assert_close_to_oracle(name, a, b, c)
    for i, (a, b, c) in enumerate(zip(got[1], same[1], oracle[1])):
        assert a.dtype == b.dtype
        assert_close_to_oracle(f"grad[{i}]", a, b, c)


def test_the_cuda_op_ran():
    sources = [torch.randn(8, 64, device="cuda", requires_grad=True) for _ in range(3)]
    w = torch.randn(64, device="cuda", requires_grad=True)

    def step():
        ak.depth_attention(w, sources, backend="cuda").sum().backward()

    assert {"attnres::depth_attn_fwd", "attnres::depth_attn_bwd"} <= attnres_ops_called(step)


@pytest.mark.parametrize("merge", [False, True])
def test_bitwise_deterministic_on_device(merge):
    sources = [s.cuda() for s in make_sources(4, (64, 33), 1024, torch.bfloat16)]
    w, g, g_out = (p.cuda() for p in site_params(3, 1024))
    prefix = reference.depth_attention(w, [s.float() for s in sources[:2]], g, return_lse=True) if merge else None

    def run():
        srcs = [s.clone().requires_grad_() for s in sources]
        params = [p.clone().requires_grad_() for p in (w, g, g_out)]
        kwargs = dict(out_norm_weight=params[2], return_lse=True, backend="cuda")
        if prefix is None:
            out, lse = ak.depth_attention(params[0], srcs, params[1], **kwargs)
        else:
            out, lse = ak.depth_attention_merge(params[0], *prefix, srcs, params[1], **kwargs)
        gen = torch.Generator(device="cuda").manual_seed(0)
        loss = (out.float() * torch.randn(out.shape, generator=gen, device="cuda")).sum()
        loss = loss + (lse * torch.randn(lse.shape, generator=gen, device="cuda")).sum()
        return [out, lse, *torch.autograd.grad(loss, srcs + params)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def _attention_qkv(batch, heads, kv_heads, tq, tk, dh, dtype):
    def make(h, t):  # head views of [B, T, heads, Dh] tensors: strided input
        return torch.randn(batch, t, h, dh, device="cuda", dtype=torch.float64).to(dtype).transpose(1, 2)

    return make(heads, tq), make(kv_heads, tk), make(kv_heads, tk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tq,tk,dh,causal,masked",
    [(300, 300, 64, True, True), (77, 500, 128, True, False), (64, 33, 256, False, True)]
    + [(129, 257, 80, True, True), (300, 140, 200, True, False), (65, 65, 20, False, False)],
)
def test_attention_matches_reference_on_device(dtype, tq, tk, dh, causal, masked):
    """The nvcc build of the fused attention (fp16/bf16: mma.sync tensor-core kernels per
    head-size bucket, among them a padded bucket, one whose dK/dV warps split the columns and
    one read element by element; fp32: SIMT): outputs and gradients against the reference by
    FlashAttention's rule, and the CUDA ops ran."""
    q, k, v = _attention_qkv(2, 4, 2, tq, tk, dh, dtype)
    mask = (torch.rand(2, tk, device="cuda") > 0.3) if masked else None

    def run(backend):
        def fn(qkv):
            return ak.attention(*qkv, causal=causal, key_padding_mask=mask, return_lse=True, backend=backend)

        return fn

    weights = [torch.randn(q.shape, device="cuda", dtype=torch.float64), torch.randn(q.shape[:-1], device="cuda")]
    weights[1] = weights[1].double()
    ops_ran = attnres_ops_called(lambda: read_with_grads(run("cuda"), [q, k, v], [], weights))
    assert {"attnres::attn_fwd", "attnres::attn_bwd"} <= ops_ran
    got = read_with_grads(run("cuda"), [q, k, v], [], weights)
    same = read_with_grads(run("reference"), [q, k, v], [], weights)
    oracle = read_with_grads(run("reference"), [t.double() for t in (q, k, v)], [], weights)
    finite = torch.isfinite(oracle[0][1])
    for name, a, b, c in zip(["out", "lse"], got[0], same[0], oracle[0]):
        a, b, c = (x.where(finite, 0) if name == "lse" else x for x in (a, b, c))
        assert_close_to_oracle(name, a, b, c)
    for name, a, b, c in zip(["dq", "dk", "dv"], got[1], same[1], oracle[1]):
        assert a.dtype == dtype
        assert_close_to_oracle(name, a, b, c)


def test_attention_bitwise_deterministic_on_device():
    q, k, v = _attention_qkv(2, 8, 2, 513, 513, 128, torch.bfloat16)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ak.attention(*leaves, return_lse=True, backend="cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        loss = (out.float() * torch.randn(out.shape, generator=gen, device="cuda")).sum() + lse.sum()
        return [out, lse, *torch.autograd.grad(loss, leaves)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [7, 1000, 4096])
@pytest.mark.parametrize("out_norm", [False, True])
def test_block_step_bf16_end_to_end_matches_reference(d, out_norm):
    """The fused Block step on the GPU: bf16 addends, fp32 prefix (as under autocast),
    outputs and every gradient by FlashAttention's rule; the CUDA ops ran."""
    lead = (4, 33)
    partial, update = (torch.randn(*lead, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    w, g, g_out = (p.cuda() for p in site_params(None, d))
    blocks = [torch.randn(*lead, d, device="cuda") for _ in range(2)]
    h_a, lse_a = reference.depth_attention(w, blocks, g, return_lse=True)
    g_out = g_out if out_norm else None
    inputs = [partial, update, w, h_a, lse_a, g, g_out]
    out_weights = [torch.randn(*lead, d, device="cuda", dtype=torch.float64) for _ in range(2)]
    out_weights.append(torch.randn(*lead, device="cuda", dtype=torch.float64))

    def run(backend, xs):
        leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in xs]
        p, u, w_, h, lse, g_, go = leaves
        kwargs = dict(out_norm_weight=go, return_lse=True)
        if backend == "reference":
            outs = reference.block_step(p, u, w_, h, lse, g_, **kwargs)
        else:
            outs = ak.block_step(p, u, w_, h, lse, g_, backend=backend, **kwargs)
        loss = sum((o.double() * wt).sum() for o, wt in zip(outs, out_weights))
        present = [x for x in leaves if x is not None]
        return list(outs), list(torch.autograd.grad(loss, present))

    called = attnres_ops_called(lambda: run("cuda", inputs))
    assert {"attnres::block_step_fwd", "attnres::block_step_bwd"} <= called, called
    got, same = run("cuda", inputs), run("reference", inputs)
    oracle = run("reference", [x.double() if x is not None else None for x in inputs])
    assert torch.equal(got[0][0], same[0][0])  # new_partial: the sum rounded once
    for i, (a, b, c) in enumerate(zip(got[0] + got[1], same[0] + same[1], oracle[0] + oracle[1])):
        assert a.dtype == b.dtype
        assert_close_to_oracle(f"[{i}]", a, b, c)


@pytest.mark.parametrize("d", [37, 1024, 4096])
@pytest.mark.parametrize("variant", ["low-rank-keys", "weighted-normalised-values"])
@pytest.mark.parametrize("q,out_norm", [(None, True), (3, False)])
def test_read_variants_bf16_end_to_end_match_reference(d, variant, q, out_norm):
    """Sliced low-rank keys (R = D / 4 + 1) and normalised values with a key-norm weight on the GPU:
    every output and gradient by FlashAttention's rule."""
    rank = d // 4 + 1 if variant == "low-rank-keys" else d
    kwargs = dict(key_rank=rank) if variant == "low-rank-keys" else dict(normalize_values=True, scale=d**-0.5)
    sources = [s.cuda() for s in make_sources(4, (4, 33), d, torch.bfloat16)]
    w, g, _ = (p.cuda() for p in site_params(q, rank))
    g_out = (1 + 0.3 * torch.randn(d, device="cuda")) if out_norm else None
    lead = (q,) if q else ()
    out_weights = [torch.randn(lead + (4, 33, d), device="cuda"), torch.randn(lead + (4, 33), device="cuda")]
    out_weights = [x.double() for x in out_weights]

    def read(backend):
        def fn(srcs, w, g, g_out):
            return ak.depth_attention(w, srcs, g, out_norm_weight=g_out, return_lse=True, backend=backend, **kwargs)

        return fn

    params = [w, g, g_out]
    called = attnres_ops_called(lambda: read_with_grads(read("cuda"), sources, params, out_weights))
    assert {"attnres::depth_attn_fwd", "attnres::depth_attn_bwd"} <= called, called
    got = read_with_grads(read("cuda"), sources, params, out_weights)
    same = read_with_grads(read("reference"), sources, params, out_weights)
    oracle = read_with_grads(
        read("reference"), [s.double() for s in sources], [p.double() if p is not None else None for p in params],
        out_weights,
    )  # fmt: skip
    for i, (a, b, c) in enumerate(zip(got[0] + got[1], same[0] + same[1], oracle[0] + oracle[1])):
        assert a.dtype == b.dtype
        assert_close_to_oracle(f"[{i}]", a, b, c)


@pytest.mark.parametrize("d,rank", [(37, 9), (4096, 1024)])
def test_block_step_low_rank_keys_on_device(d, rank):
    """The Block step with sliced low-rank keys on the GPU: outputs and gradients against the reference."""
    lead = (4, 33)
    partial, update = (torch.randn(*lead, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    w, g = torch.randn(rank, device="cuda") * 0.5, 1 + 0.3 * torch.randn(rank, device="cuda")
    h_a, lse_a = reference.depth_attention(w, [torch.randn(*lead, d, device="cuda") for _ in range(2)], g,
                                           key_rank=rank, return_lse=True)  # fmt: skip
    inputs = [partial, update, w, h_a, lse_a, g]
    out_weights = [torch.randn(*lead, d, device="cuda", dtype=torch.float64) for _ in range(2)]

    def run(backend, xs):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        step = reference.block_step if backend == "reference" else ak.block_step
        extra = {} if backend == "reference" else dict(backend=backend)
        outs = step(*leaves, key_rank=rank, **extra)
        loss = sum((o.double() * wt).sum() for o, wt in zip(outs, out_weights))
        return list(outs), list(torch.autograd.grad(loss, leaves))

    got, same = run("cuda", inputs), run("reference", inputs)
    oracle = run("reference", [x.double() for x in inputs])
    for i, (a, b, c) in enumerate(zip(got[0] + got[1], same[0] + same[1], oracle[0] + oracle[1])):
        assert a.dtype == b.dtype
        assert_close_to_oracle(f"[{i}]", a, b, c)
