"""Conformance with the released semantics of the depth read (DESIGN.md §2.7).

Each released model family gets a tiny oracle written from its own description, independent of
the package's reference, and our op with the matching options must reproduce it, in fp32 and bf16:

- the paper / FLA read: keys ``rmsnorm(v_i) * γ`` (a weighted key norm), logits ``<w, k_i>``
  times an optional ``scale`` (FLA's), values the raw sources;
- Inkling2 (transformers ≥ 5.23): the sources concatenated and upcast to fp32, keys and values the
  *unweighted* ``n_i = v_i · rsqrt(mean(v_i²) + 1e-6)``, logits ``<w_q, n_i> / √D`` through
  ``scaled_dot_product_attention``, fp32 output; also checked against transformers' own module;
- Kimi-K3 as trained in torchtitan: paper semantics with bf16 parameters, ``γ ⊙ w`` folded in fp32
  (folding in bf16 is a known accuracy trap, and the test shows the difference is visible).
"""

import pytest
import torch
import torch.nn.functional as F

import attnres_kernels as ak
from tests.support import make_sources

BACKENDS = ["reference", "cpu"]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-5, atol=2e-5)}


def paper_fla_oracle(w, gamma, sources, scale=1.0, eps=1e-6):
    """Paper / FLA: weighted RMSNorm keys, raw values, softmax over depth, in fp32."""
    v = torch.stack([s.float() for s in sources], dim=-2)  # [..., N, D]
    keys = F.rms_norm(v, (v.shape[-1],), weight=gamma.float(), eps=eps)
    alpha = torch.softmax((keys @ w.float()) * scale, dim=-1)  # [..., N]
    return (alpha.unsqueeze(-1) * v).sum(-2)


def inkling2_oracle(queries, blocks, partial, eps=1e-6):
    """Inkling2: cat → fp32 → unweighted RMSNorm → SDPA with scale 1/√D; one output per query."""
    stacked = torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).float()
    normed = stacked * torch.rsqrt(stacked.square().mean(-1, keepdim=True) + eps)
    d = normed.shape[-1]
    q = queries.float().view(-1, d).expand(*normed.shape[:-2], -1, -1)
    return F.scaled_dot_product_attention(q, normed, normed, scale=d**-0.5).unbind(-2)


def kimi_oracle(w, gamma, sources, fold_dtype, eps=1e-6):
    """Kimi-K3 (torchtitan): paper semantics, the query-key product u = γ ⊙ w formed in ``fold_dtype``."""
    u = (w.to(fold_dtype) * gamma.to(fold_dtype)).float()
    v = torch.stack([s.float() for s in sources], dim=-2)
    r = torch.rsqrt(v.square().mean(-1) + eps)
    alpha = torch.softmax(r * (v @ u), dim=-1)
    return (alpha.unsqueeze(-1) * v).sum(-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.125])
def test_paper_fla(backend, dtype, scale):
    d = 96
    sources = make_sources(5, (3, 7), d, dtype)
    w, gamma = torch.randn(d) * 0.3, 1 + 0.3 * torch.randn(d)
    want = paper_fla_oracle(w, gamma, sources, scale)
    got = ak.depth_attention(w, sources, gamma, scale=scale, out_dtype=torch.float32, backend=backend)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_inkling2(backend, dtype, num_queries):
    d, n = 64, 4
    blocks = torch.randn(2, 9, n, d).to(dtype)
    partial = torch.randn(2, 9, d).to(dtype)
    queries = torch.randn(d) * 2 if num_queries == 1 else torch.randn(num_queries, d) * 2
    want = inkling2_oracle(queries, blocks, partial)
    got = ak.depth_attention(
        queries,
        [*blocks.unbind(-2), partial],
        scale=d**-0.5,
        normalize_values=True,
        out_dtype=torch.float32,
        backend=backend,
    )
    got = (got,) if num_queries == 1 else got.unbind(0)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("num_queries", [1, 3])
def test_inkling2_against_transformers(num_queries):
    """The oracle above is transformers' own Inkling2BlockAttentionResidual (5.23)."""
    from transformers.models.inkling2 import modeling_inkling2 as m
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    d = 32
    module = m.Inkling2BlockAttentionResidual(Inkling2TextConfig(hidden_size=d), num_queries=num_queries)
    with torch.no_grad():
        module.query.normal_(0, 1.0)
    blocks, partial = torch.randn(2, 5, 3, d), torch.randn(2, 5, d)
    want = module(blocks, partial)
    for a, b in zip(inkling2_oracle(module.query.detach(), blocks, partial), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kimi_fold_in_fp32(backend, dtype):
    """bf16 parameters: our op folds γ ⊙ w in fp32 (matches the fp32-fold oracle tightly); a bf16
    fold would be off by far more than that tolerance (so this test can tell them apart)."""
    d = 1024
    sources = make_sources(6, (4, 8), d, dtype)
    w, gamma = (torch.randn(d) * 0.2).bfloat16(), (1 + 0.3 * torch.randn(d)).bfloat16()
    got = ak.depth_attention(w, sources, gamma, out_dtype=torch.float32, backend=backend)
    fp32_fold = kimi_oracle(w, gamma, sources, torch.float32)
    bf16_fold = kimi_oracle(w, gamma, sources, torch.bfloat16)
    torch.testing.assert_close(got, fp32_fold, **TOL[dtype])
    assert (bf16_fold - fp32_fold).abs().max() > 20 * TOL[dtype]["atol"]
