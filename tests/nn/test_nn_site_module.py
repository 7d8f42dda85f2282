"""``ak.nn.DepthAttentionSite`` as a module for people writing their own layers: the paper's read
(state dict of the reference site) and Inkling2's (transformers' own module), from a list of
sources or a stacked ``[..., n, D]`` block tensor plus the partial sum."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from tests.support import attnres_ops_called


def inkling2_site(d, num_queries):
    return ak.nn.DepthAttentionSite(
        d,
        num_queries=num_queries,
        key_norm_weight=False,
        scale=d**-0.5,
        normalize_values=True,
        out_dtype=torch.float32,
    )


@pytest.mark.parametrize("num_queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inkling2_style_site_equals_transformers_module(num_queries, dtype):
    from transformers.models.inkling2 import modeling_inkling2 as m
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    d = 48
    theirs = m.Inkling2BlockAttentionResidual(Inkling2TextConfig(hidden_size=d), num_queries=num_queries)
    ours = inkling2_site(d, num_queries)
    with torch.no_grad():
        theirs.query.normal_(0, 1.0)
    assert ours.query.shape == theirs.query.shape  # [D] for one query, [Q, D] for several
    ours.load_state_dict(theirs.state_dict())  # the same parameter name and shape
    blocks = torch.randn(2, 7, 3, d).to(dtype)
    partial = torch.randn(2, 7, d)  # Inkling2's MLP-input reads get the fp32 partial sum
    b1, p1 = blocks.clone().requires_grad_(), partial.clone().requires_grad_()
    b2, p2 = blocks.clone().requires_grad_(), partial.clone().requires_grad_()
    want = theirs(b1, p1)
    got = ours(b2, p2)
    got = (got,) if num_queries == 1 else got
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    torch.manual_seed(7)
    weights = [torch.randn_like(o) for o in want]
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    sum((o * w).sum() for o, w in zip(got, weights)).backward()
    torch.testing.assert_close(ours.query.grad, theirs.query.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b2.grad, b1.grad, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-4)
    torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-4)


def test_inkling2_style_site_runs_the_fused_op():
    site = inkling2_site(16, 3)
    blocks, partial = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 16)
    assert "attnres::depth_attn_fwd" in attnres_ops_called(lambda: site(blocks, partial))


def test_paper_style_site_is_the_reference_site():
    d = 24
    ours, ref = ak.nn.DepthAttentionSite(d), reference.models.DepthSite(d)
    with torch.no_grad():
        ref.query.normal_()
        ref.norm_weight.uniform_(0.5, 1.5)
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    sources = [torch.randn(3, 5, d) for _ in range(4)]
    g = 1 + 0.2 * torch.randn(d)
    want, weights = ref(sources)
    torch.testing.assert_close(ours(sources), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(sources[:3], sources[3]), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(torch.stack(sources[:3], dim=-2), sources[3]), want, rtol=1e-5, atol=1e-5)
    _, got_weights = ours(sources, return_weights=True)
    torch.testing.assert_close(got_weights, weights, rtol=1e-5, atol=1e-6)
    normed = ours(sources, out_norm_weight=g, out_norm_eps=1e-3)
    torch.testing.assert_close(
        normed,
        reference.depth_attention(ref.query, sources, ref.norm_weight, out_norm_weight=g, out_norm_eps=1e-3),
        rtol=1e-5,
        atol=1e-5,
    )


def test_several_queries_return_one_output_each_and_weights():
    site = ak.nn.DepthAttentionSite(8, num_queries=2, scale=0.5)
    sources = [torch.randn(4, 8) for _ in range(3)]
    outs, weights = site(sources, return_weights=True)
    assert len(outs) == 2 and outs[0].shape == (4, 8) and weights.shape == (2, 3, 4)
    assert site.query.shape == (2, 8) and site.norm_weight.shape == (2, 8)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_queries=0), "num_queries"),
        (dict(num_queries=None), "num_queries"),
        (dict(scale=float("nan")), "scale"),
        (dict(backend="gpu"), "backend"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ak.nn.DepthAttentionSite(8, **kwargs)
