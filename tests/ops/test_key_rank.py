"""Sliced low-rank keys (``key_rank = R``, LR-AttnRes; docs/design.md §2.7) in the reference and
the argument checks every backend shares: the key of each source is its last R coordinates,
RMS-normalised over those R; query and key-norm weight have R entries; values and output keep
the full width D. ``key_rank = D`` is the ordinary read."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from tests.support import make_sources


def _independent_read(query, sources, norm_weight, rank, eps=1e-6, scale=1.0):
    """The low-rank read built from an ordinary (full-width) read over the sliced keys: its softmax
    weights, applied to the full-width sources, in fp64."""
    keys = [s[..., s.shape[-1] - rank :].double() for s in sources]
    nw = None if norm_weight is None else norm_weight.double()
    _, weights = reference.depth_attention(query.double(), keys, nw, eps=eps, scale=scale, return_weights=True)
    values = torch.stack([s.double() for s in sources])  # [N, ..., D]
    if query.dim() == 2:
        return torch.einsum("qn...,n...d->q...d", weights, values)
    return torch.einsum("n...,n...d->...d", weights, values)


@pytest.mark.parametrize("q", [None, 3])
@pytest.mark.parametrize("rank", [1, 5, 16])
def test_reference_reads_the_last_rank_coordinates(q, rank):
    torch.manual_seed(rank)
    d = 21
    sources = make_sources(4, (2, 3), d, torch.float64, layout="strided")
    shape = (rank,) if q is None else (q, rank)
    w, gamma = torch.randn(shape, dtype=torch.float64), 1 + 0.3 * torch.randn(shape, dtype=torch.float64)
    out = reference.depth_attention(w, sources, gamma, key_rank=rank, scale=0.7)
    torch.testing.assert_close(out, _independent_read(w, sources, gamma, rank, scale=0.7), rtol=1e-12, atol=1e-12)


def test_full_rank_is_the_ordinary_read_bit_for_bit():
    torch.manual_seed(0)
    d = 24
    sources = make_sources(3, (5,), d, torch.float32)
    w, gamma, g = torch.randn(d), 1 + 0.1 * torch.randn(d), torch.randn(d)
    ordinary = ak.depth_attention(w, sources, gamma, out_norm_weight=g, return_lse=True)
    full = ak.depth_attention(w, sources, gamma, out_norm_weight=g, return_lse=True, key_rank=d)
    for a, b in zip(ordinary, full):
        assert torch.equal(a, b)


def test_merge_with_low_rank_keys_equals_one_read_over_the_union():
    torch.manual_seed(1)
    d, rank = 17, 6
    sources = make_sources(5, (4,), d, torch.float64)
    w, gamma = torch.randn(rank, dtype=torch.float64), 1 + 0.2 * torch.randn(rank, dtype=torch.float64)
    whole = reference.depth_attention(w, sources, gamma, key_rank=rank, return_lse=True)
    h_a, lse_a = reference.depth_attention(w, sources[:2], gamma, key_rank=rank, return_lse=True)
    merged = reference.depth_attention_merge(w, h_a, lse_a, sources[2:], gamma, key_rank=rank, return_lse=True)
    for a, b in zip(whole, merged):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_reference_block_step_with_low_rank_keys():
    torch.manual_seed(2)
    d, rank = 12, 4
    blocks = make_sources(3, (2, 5), d, torch.float64)
    partial, update = torch.randn(2, 5, d, dtype=torch.float64), torch.randn(2, 5, d, dtype=torch.float64)
    w = torch.randn(rank, dtype=torch.float64)
    h_a, lse_a = reference.depth_attention(w, blocks, key_rank=rank, return_lse=True)
    new_partial, out = reference.block_step(partial, update, w, h_a, lse_a, key_rank=rank)
    torch.testing.assert_close(out, reference.depth_attention(w, [*blocks, partial + update], key_rank=rank))
    assert torch.equal(new_partial, partial + update)


def test_low_rank_gradients_pass_gradcheck_in_the_reference():
    torch.manual_seed(3)
    d, rank = 9, 4
    sources = [t.requires_grad_() for t in make_sources(3, (2,), d, torch.float64)]
    w = torch.randn(2, rank, dtype=torch.float64, requires_grad=True)
    gamma = (1 + 0.2 * torch.randn(rank, dtype=torch.float64)).requires_grad_()
    g = torch.randn(d, dtype=torch.float64, requires_grad=True)

    def fn(w, gamma, g, *srcs):
        return reference.depth_attention(w, list(srcs), gamma, out_norm_weight=g, key_rank=rank, return_lse=True)

    assert torch.autograd.gradcheck(fn, (w, gamma, g, *sources))


@pytest.mark.parametrize(
    "key_rank, error, match",
    [
        (0, ValueError, "`key_rank` must be a positive int"),
        (-2, ValueError, "`key_rank` must be a positive int"),
        (True, ValueError, "`key_rank` must be a positive int"),
        (2.0, ValueError, "`key_rank` must be a positive int"),
        (9, ValueError, "at most the sources' width D = 8"),
    ],
)
def test_bad_key_rank_is_rejected_before_any_kernel(key_rank, error, match):
    sources = make_sources(2, (3,), 8)
    for fn in (ak.depth_attention, reference.depth_attention):
        with pytest.raises(error, match=match):
            fn(torch.randn(8), sources, key_rank=key_rank)


def test_parameters_of_the_wrong_width_name_r():
    sources = make_sources(2, (3,), 8)
    with pytest.raises(ValueError, match=r"`query` must have shape \[R\] or \[Q, R\] with R = 4"):
        ak.depth_attention(torch.randn(8), sources, key_rank=4)
    with pytest.raises(ValueError, match=r"`norm_weight` must have shape \[R\] or \[Q, R\] with R = 4"):
        ak.depth_attention(torch.randn(4), sources, torch.ones(8), key_rank=4)
    with pytest.raises(ValueError, match=r"`out_norm_weight` must have shape \[D\] or \[Q, D\] with D = 8"):
        ak.depth_attention(torch.randn(4), sources, out_norm_weight=torch.ones(4), key_rank=4)


def test_normalised_values_need_full_width_keys():
    sources = make_sources(2, (3,), 8)
    with pytest.raises(ValueError, match="`normalize_values` needs full-width keys"):
        ak.depth_attention(torch.randn(4), sources, key_rank=4, normalize_values=True)
    # R = D is the ordinary read, where normalised values are fine.
    ak.depth_attention(torch.randn(8), sources, key_rank=8, normalize_values=True)
