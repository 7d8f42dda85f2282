"""The plain-PyTorch oracles against independent, straightforward computations."""

import math

import pytest
import torch

from attnres_kernels import reference

from support import make_sources, site_params


def loop_depth_read(w, g, sources, eps, out_norm_weight=None):
    """DESIGN.md §2.1 written row by row with Python scalars (fp64 math module)."""
    d = sources[0].shape[-1]
    rows = [s.reshape(-1, d).double().tolist() for s in sources]
    u = [a * b for a, b in zip(w.double().tolist(), g.double().tolist())]
    outs, lses, weights = [], [], []
    for p in range(len(rows[0])):
        logits = []
        for src in rows:
            v = src[p]
            r = 1.0 / math.sqrt(sum(x * x for x in v) / d + eps)
            logits.append(r * sum(a * x for a, x in zip(u, v)))
        top = max(logits)
        z = sum(math.exp(s - top) for s in logits)
        alpha = [math.exp(s - top) / z for s in logits]
        h = [sum(a * src[p][k] for a, src in zip(alpha, rows)) for k in range(d)]
        if out_norm_weight is not None:
            rstd = 1.0 / math.sqrt(sum(x * x for x in h) / d + eps)
            h = [x * rstd * gk for x, gk in zip(h, out_norm_weight.double().tolist())]
        outs.append(h)
        lses.append(top + math.log(z))
        weights.append(alpha)
    lead = sources[0].shape[:-1]
    return (
        torch.tensor(outs, dtype=torch.float64).reshape(*lead, d),
        torch.tensor(lses, dtype=torch.float64).reshape(lead),
        torch.tensor(weights, dtype=torch.float64).T.reshape(len(sources), *lead),
    )


@pytest.mark.parametrize("n,lead,d", [(1, (3,), 7), (4, (2, 3), 5), (6, (5,), 1), (3, (), 9)])
@pytest.mark.parametrize("out_norm", [False, True])
def test_reference_matches_row_by_row_fp64(n, lead, d, out_norm):
    sources = make_sources(n, lead, d, torch.float64)
    w, g, g_out = site_params(None, d, torch.float64)
    eps = 1e-5
    expected = loop_depth_read(w, g, sources, eps, g_out if out_norm else None)
    got = reference.depth_attention(
        w, sources, g, eps=eps, out_norm_weight=g_out if out_norm else None, return_lse=True, return_weights=True
    )
    for name, a, b in zip(("h", "lse", "weights"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_weights_sum_to_one_and_zero_query_is_mean():
    sources = make_sources(5, (4, 3), 16)
    h, weights = reference.depth_attention(torch.zeros(16), sources, return_weights=True)
    torch.testing.assert_close(weights.sum(0), torch.ones(4, 3))
    torch.testing.assert_close(h, torch.stack(sources).mean(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_query_equals_single_reads(dtype):
    q, d = 3, 11
    sources = make_sources(4, (2, 5), d, dtype)
    w, g, g_out = site_params(q, d, dtype)
    multi = reference.depth_attention(w, sources, g, out_norm_weight=g_out, return_lse=True, return_weights=True)
    for i in range(q):
        single = reference.depth_attention(
            w[i], sources, g[i], out_norm_weight=g_out[i], return_lse=True, return_weights=True
        )
        for a, b in zip(multi, single):
            torch.testing.assert_close(a[i], b)


def test_multi_query_shared_norm_weight_broadcasts():
    sources = make_sources(3, (4,), 6)
    w = torch.randn(2, 6)
    g = torch.rand(6) + 0.5
    torch.testing.assert_close(
        reference.depth_attention(w, sources, g), reference.depth_attention(w, sources, g.expand(2, 6))
    )


def test_list_input_equals_stacked_input():
    sources = make_sources(5, (3, 2), 8)
    w, g, _ = site_params(None, 8)
    a = reference.depth_attention(w, sources, g, return_lse=True, return_weights=True)
    b = reference.depth_attention(w, torch.stack(sources), g, return_lse=True, return_weights=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("multi_query", [False, True])
def test_merge_equals_single_read_over_union(split, multi_query):
    d = 10
    sources = make_sources(5, (3, 4), d, torch.float64)
    w, g, g_out = site_params(2 if multi_query else None, d, torch.float64)
    h_a, lse_a = reference.depth_attention(w, sources[:split], g, return_lse=True)
    merged = reference.depth_attention_merge(w, h_a, lse_a, sources[split:], g, out_norm_weight=g_out, return_lse=True)
    whole = reference.depth_attention(w, sources, g, out_norm_weight=g_out, return_lse=True)
    for a, b in zip(merged, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_chained_merges_equal_single_read():
    sources = make_sources(6, (7,), 5, torch.float64)
    w, g, _ = site_params(None, 5, torch.float64)
    h, lse = reference.depth_attention(w, sources[:1], g, return_lse=True)
    for s in sources[1:]:
        h, lse = reference.depth_attention_merge(w, h, lse, [s], g, return_lse=True)
    torch.testing.assert_close(h, reference.depth_attention(w, sources, g), rtol=1e-12, atol=1e-12)


def test_causal_attention_matches_loop_and_sdpa():
    b, heads, t, dh = 2, 3, 6, 4
    q, k, v = (torch.randn(b, heads, t, dh, dtype=torch.float64) for _ in range(3))
    out = reference.attention(q, k, v)
    expected = torch.empty_like(out)
    for i in range(t):
        scores = (q[:, :, i : i + 1] @ k[:, :, : i + 1].transpose(-1, -2)) / math.sqrt(dh)
        expected[:, :, i] = (scores.softmax(-1) @ v[:, :, : i + 1]).squeeze(2)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_causal_attention_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must have one shape"):
        reference.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 4, 4))
