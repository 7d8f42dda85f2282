"""Plain-PyTorch oracles for the depth read (DESIGN.md §2.1) and causal attention (§2.4).

Written for reading, not for speed: every source is stacked, upcast to the
accumulation dtype (fp32, or fp64 for fp64 inputs) and pushed through the
formulas exactly as the design states them. Autograd provides the backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._validation import Sources, accumulation_dtype, check_depth_read, check_prefix


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _logits(u: Tensor, v: Tensor, eps: float) -> Tensor:
    """``s[q, i, ...] = r_i * <u_q, v_i>`` with ``r_i = rsqrt(mean(v_i^2) + eps)``.

    ``u`` is ``[Q, D]`` (query ⊙ key-norm weight), ``v`` is ``[N, ..., D]``.
    There is no ``1/sqrt(D)`` temperature."""
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)  # [N, ...]
    dots = torch.einsum("qd,n...d->qn...", u, v)  # [Q, N, ...]
    return dots * r.unsqueeze(0)


def _finish(h: Tensor, lse: Tensor, weights: Tensor | None, args, eps, out_dtype, return_lse, return_weights):
    if args.out_norm_weight is not None:
        g = args.out_norm_weight.to(h.dtype).reshape(args.num_queries, *([1] * (h.dim() - 2)), -1)
        h = _rms_normalize(h, eps) * g
    return args.pack_outputs(h.to(out_dtype), lse, weights, return_lse, return_weights)


def depth_attention(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
):
    """Softmax attention over depth for every row of the sources.

    Args:
        query: pseudo-query ``w``, ``[D]`` for one site or ``[Q, D]`` for Q sites
            reading the same sources.
        sources: N ≥ 1 tensors of one shape ``[..., D]``, or one ``[N, ..., D]`` tensor.
        norm_weight: key RMSNorm weight ``γ``, ``[D]`` or ``[Q, D]``; None means ones.
        eps: epsilon of the key RMSNorm (and of the fused output norm).
        out_norm_weight: if given, return ``rmsnorm(h) * out_norm_weight`` instead of ``h``.
        return_lse: also return ``logsumexp`` of the logits (fp32, fp64 for fp64 inputs).
        return_weights: also return the softmax weights ``α`` (``[N, ...]`` or ``[Q, N, ...]``).

    Returns:
        ``h`` (``[..., D]`` or ``[Q, ..., D]``, the source dtype), followed by
        ``lse`` and ``weights`` when asked for, in that order.
    """
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, eps)
    acc = accumulation_dtype(args.dtype)
    v = torch.stack(args.sources).to(acc)  # [N, ..., D]
    s = _logits(args.query_key(), v, eps)  # [Q, N, ...]
    weights = torch.softmax(s, dim=1)
    h = torch.einsum("qn...,n...d->q...d", weights, v)
    lse = torch.logsumexp(s, dim=1)
    return _finish(h, lse, weights, args, eps, args.dtype, return_lse, return_weights)


def depth_attention_merge(
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
):
    """Extends a finished read ``(h_a, lse_a)`` over a source set A with extra sources B.

    The result equals :func:`depth_attention` over ``A ∪ B`` (DESIGN.md §2.1 "Merge"):
    ``h = (e^{lse_a - m} h_a + Σ_b e^{s_b - m} v_b) / (e^{lse_a - m} + Σ_b e^{s_b - m})``.
    ``prefix_out`` must be the un-normalized ``h_a`` (not a fused-output-norm result).
    """
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, eps)
    h_a, lse_a = check_prefix(args, prefix_out, prefix_lse)
    acc = accumulation_dtype(args.dtype)
    v = torch.stack(args.sources).to(acc)
    s_b = _logits(args.query_key(), v, eps)  # [Q, N_b, ...]
    all_logits = torch.cat([lse_a.unsqueeze(1), s_b], dim=1)
    m = all_logits.amax(dim=1, keepdim=True)
    e = torch.exp(all_logits - m)  # [Q, 1 + N_b, ...]
    numerator = e[:, 0].unsqueeze(-1) * h_a.to(acc) + torch.einsum("qn...,n...d->q...d", e[:, 1:], v)
    denominator = e.sum(dim=1)
    h = numerator / denominator.unsqueeze(-1)
    lse = m.squeeze(1) + torch.log(denominator)
    return _finish(h, lse, None, args, eps, args.dtype, return_lse, False)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """``softmax(q kᵀ · scale + causal mask) v`` for ``[B, H, T, Dh]`` inputs, computed in fp32/fp64."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(
            f"q, k, v must share one [B, H, T, Dh] shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bhtd,bhsd->bhts", q.to(acc), k.to(acc)) * scale
    t = q.shape[-2]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("bhts,bhsd->bhtd", probs, v.to(acc)).to(q.dtype)
