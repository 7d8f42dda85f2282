"""The plain-PyTorch oracles against independent, straightforward computations."""

import math

import pytest
import torch

from attnres_kernels import reference
from tests.support import make_sources, site_params


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


def loop_attention(q, k, v, causal, key_padding_mask, scale):
    """DESIGN.md §2.4 query row by query row with Python scalars (fp64 math module):
    ``(out, lse)``, with 0 / -inf for a row that sees no key."""
    b_, h_, tq, dh = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    out = torch.zeros(b_, h_, tq, dh, dtype=torch.float64)
    lse = torch.full((b_, h_, tq), -math.inf, dtype=torch.float64)
    for b in range(b_):
        for h in range(h_):
            kv = h // (h_ // hkv)
            for i in range(tq):
                keys = [j for j in range(tk) if (not causal or j <= i + tk - tq)]
                if key_padding_mask is not None:
                    keys = [j for j in keys if bool(key_padding_mask[b, j])]
                if not keys:
                    continue
                qi = q[b, h, i].tolist()
                s = [scale * sum(x * y for x, y in zip(qi, k[b, kv, j].tolist())) for j in keys]
                top = max(s)
                z = sum(math.exp(x - top) for x in s)
                for j, x in zip(keys, s):
                    out[b, h, i] += math.exp(x - top) / z * v[b, kv, j].double()
                lse[b, h, i] = top + math.log(z)
    return out, lse


@pytest.mark.parametrize(
    "heads,kv_heads,tq,tk,causal,masked",
    [
        (2, 2, 6, 6, True, False),
        (4, 2, 5, 9, True, True),  # GQA, Tq < Tk: bottom-right causal alignment
        (3, 1, 8, 4, True, False),  # Tq > Tk: the first 4 rows see no key
        (2, 1, 7, 5, False, True),
    ],
)
def test_attention_matches_row_by_row_fp64(heads, kv_heads, tq, tk, causal, masked):
    q = torch.randn(2, heads, tq, 3, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, tk, 3, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:
        mask = torch.rand(2, tk) > 0.4
        mask[1] = False  # the second batch sees no key at all
        mask[0, 0] = True
    expected = loop_attention(q, k, v, causal, mask, 0.7)
    got = reference.attention(q, k, v, causal=causal, key_padding_mask=mask, scale=0.7, return_lse=True)
    for name, a, b in zip(("out", "lse"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_attention_default_scale_and_masked_sdpa():
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 5) > 0.3
    mask[:, 0] = True  # every row sees a key: SDPA would give NaN otherwise
    got = reference.attention(q, k, v, causal=False, key_padding_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(got, expected)


def test_attention_backward_formulas():
    """The backward written in the docstring of reference.attention (dP, δ, dS, dq, dk, dv,
    GQA sums, dlse) equals autograd through the reference, rows without keys included."""
    b, h, hkv, tq, tk, dh, scale = 2, 4, 2, 6, 9, 5, 0.6
    q = torch.randn(b, h, tq, dh, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, tk, dh, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(b, tk) > 0.3
    mask[1, :] = False
    d_out = torch.randn(b, h, tq, dh, dtype=torch.float64)
    d_lse = torch.randn(b, h, tq, dtype=torch.float64)
    out, lse = reference.attention(q, k, v, key_padding_mask=mask, scale=scale, return_lse=True)
    expected = torch.autograd.grad([out, lse], [q, k, v], [d_out, d_lse])

    group = h // hkv
    kf, vf = k.detach().repeat_interleave(group, 1), v.detach().repeat_interleave(group, 1)
    causal = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    visible = causal & mask[:, None, None, :]
    s = (q.detach() @ kf.transpose(-1, -2) * scale).masked_fill(~visible, -math.inf)
    lse_used = torch.where(torch.isinf(lse), math.inf, lse).detach()  # P = 0 in rows that see no key
    p = torch.exp(s - lse_used.unsqueeze(-1))
    d_p = d_out @ vf.transpose(-1, -2)
    delta = (d_out * out.detach()).sum(-1) - d_lse
    d_s = p * (d_p - delta.unsqueeze(-1))
    dq = d_s @ kf * scale
    dk = (d_s.transpose(-1, -2) @ q.detach() * scale).unflatten(1, (hkv, group)).sum(2)
    dv = (p.transpose(-1, -2) @ d_out).unflatten(1, (hkv, group)).sum(2)
    for name, a, e in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=name)


def test_attention_rows_without_keys_are_zero_not_nan():
    q = torch.randn(2, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[True, True, True], [False, False, False]])
    out, lse = reference.attention(q, k, v, key_padding_mask=mask, return_lse=True)
    grads = torch.autograd.grad((out.sum() + torch.where(torch.isinf(lse), 0, lse).sum()), [q, k, v])
    # Tq = 6 > Tk = 3: rows 0-2 of batch 0 see no key (causal); batch 1 sees none at all.
    no_key = torch.zeros(2, 2, 6, dtype=torch.bool)
    no_key[0, :, :3] = True
    no_key[1] = True
    assert torch.equal(torch.isinf(lse), no_key) and bool((lse[no_key] < 0).all())
    assert bool((out[no_key] == 0).all()) and bool((grads[0][no_key] == 0).all())
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert bool((grads[1][1] == 0).all()) and bool((grads[2][1] == 0).all())


def test_attention_gradcheck_fp64():
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 6, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.tensor([[True, False, True, True, False, True]])

    def fn(q, k, v):
        return reference.attention(q, k, v, key_padding_mask=mask, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


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
