"""Plain-PyTorch oracles: the depth read and its merge (DESIGN.md §2.1), attention (§2.4)
and the Block residual step (§2.3).

Written for reading, not for speed: every source is upcast to the
accumulation dtype (fp32, or fp64 when the promoted input dtype is fp64),
stacked, and pushed through the
formulas exactly as the design states them. Autograd provides the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validation import (
    DepthReadArgs,
    Sources,
    accumulation_dtype,
    check_attention,
    check_block_step,
    check_depth_read,
    check_prefix_args,
    check_read_options,
)


def _rms_normalize(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _logits(u: Tensor, v: Tensor, eps: float) -> Tensor:
    """``s[q, i, ...] = r_i * <u_q, t_i>`` with ``r_i = rsqrt(mean(t_i^2) + eps)``, where the key
    ``t_i`` is the last R coordinates of ``v_i`` (all D of them unless ``key_rank`` is set).

    ``u`` is ``[Q, R]`` (``scale`` · query ⊙ key-norm weight), ``v`` is ``[N, ..., D]``."""
    t = v[..., v.shape[-1] - u.shape[-1] :]  # [N, ..., R]
    r = torch.rsqrt(t.pow(2).mean(-1) + eps)  # [N, ...]
    dots = torch.einsum("qd,n...d->qn...", u, t)  # [Q, N, ...]
    return dots * r.unsqueeze(0)


def _value_sum(weights: Tensor, v: Tensor, args) -> Tensor:
    """``Σ_i weights[q, i] · value_i`` ``[Q, ..., D]``: the values are the sources ``v_i``,
    or with ``normalize_values`` the normalised ``rmsnorm(v_i)`` times the key-norm
    weight when there is one."""
    if not args.options.normalize_values:
        return torch.einsum("qn...,n...d->q...d", weights, v)
    h = torch.einsum("qn...,n...d->q...d", weights, _rms_normalize(v, args.options.eps))
    if args.norm_weight is not None:
        h = h * args.norm_weight.to(h.dtype).reshape(args.num_queries, *([1] * (h.dim() - 2)), -1)
    return h


def _finish(h: Tensor, lse: Tensor, weights: Tensor | None, args, return_lse, return_weights):
    if args.out_norm_weight is not None:
        g = args.out_norm_weight.to(h.dtype).reshape(args.num_queries, *([1] * (h.dim() - 2)), -1)
        h = _rms_normalize(h, args.options.out_norm_eps) * g
    return args.pack_outputs(h.to(args.dtype), lse, weights, return_lse, return_weights)


def depth_attention(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    scale: float = 1.0,
    normalize_values: bool = False,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    key_rank: int | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
):
    """Softmax attention over depth for every row of the sources.

    Args:
        query: pseudo-query ``w``, ``[D]`` for one site or ``[Q, D]`` for Q sites
            reading the same sources (``[R]`` / ``[Q, R]`` with ``key_rank = R``).
        sources: N ≥ 1 tensors of one shape ``[..., D]``, or one ``[N, ..., D]`` tensor.
        norm_weight: key RMSNorm weight ``γ``, ``[D]`` or ``[Q, D]`` (``[R]`` / ``[Q, R]``
            with ``key_rank``); None: an unweighted key norm.
        scale: multiplies the logits (1 in the paper, ``1/√D`` in Inkling2).
        normalize_values: the values are the normalised sources ``rmsnorm(v_i)``
            (times ``norm_weight`` when given), as in Inkling2, instead of the raw
            sources (the paper).
        eps: epsilon of the key RMSNorm.
        out_norm_weight: if given, return ``rmsnorm(h) * out_norm_weight`` instead of ``h``.
        out_norm_eps: epsilon of that output norm (default: ``eps``).
        out_dtype: dtype of the output (default: the promotion of the source dtypes).
        key_rank: sliced low-rank keys: the key of each source is its last ``key_rank``
            coordinates, RMS-normalised over those (LR-AttnRes); values and output keep
            the full width D. None (or D) is the ordinary read. Not combinable with
            ``normalize_values``.
        return_lse: also return ``logsumexp`` of the logits (fp32, fp64 for fp64 inputs).
        return_weights: also return the softmax weights ``α`` (``[N, ...]`` or ``[Q, N, ...]``).

    Returns:
        ``h`` (``[..., D]`` or ``[Q, ..., D]``), followed by ``lse`` and ``weights``
        when asked for, in that order.
    """
    options = check_read_options(
        eps,
        scale=scale,
        normalize_values=normalize_values,
        out_norm_eps=out_norm_eps,
        out_dtype=out_dtype,
        key_rank=key_rank,
    )
    return read(check_depth_read(query, sources, norm_weight, out_norm_weight, options), return_lse, return_weights)


def read(args: DepthReadArgs, return_lse: bool = False, return_weights: bool = False):
    """:func:`depth_attention` of checked arguments."""
    v = torch.stack([s.to(args.acc_dtype) for s in args.sources])  # [N, ..., D]
    s = _logits(args.query_key(), v, args.options.eps)  # [Q, N, ...]
    weights = torch.softmax(s, dim=1)
    h = _value_sum(weights, v, args)
    lse = torch.logsumexp(s, dim=1)
    return _finish(h, lse, weights, args, return_lse, return_weights)


def depth_attention_merge(
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    scale: float = 1.0,
    normalize_values: bool = False,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    out_norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    key_rank: int | None = None,
    return_lse: bool = False,
):
    """Extends a finished read ``(h_a, lse_a)`` over a source set A with extra sources B.

    The result equals :func:`depth_attention` over ``A ∪ B`` with the same options
    (DESIGN.md §2.1 "Merge"):
    ``h = (e^{lse_a - m} h_a + Σ_b e^{s_b - m} value_b) / (e^{lse_a - m} + Σ_b e^{s_b - m})``.
    ``prefix_out`` must be the un-normalized ``h_a`` (not a fused-output-norm result).
    """
    options = check_read_options(
        eps,
        scale=scale,
        normalize_values=normalize_values,
        out_norm_eps=out_norm_eps,
        out_dtype=out_dtype,
        key_rank=key_rank,
    )
    args = check_prefix_args(
        check_depth_read(query, sources, norm_weight, out_norm_weight, options), prefix_out, prefix_lse
    )
    return merge(args, prefix_out, prefix_lse, return_lse)


def merge(args: DepthReadArgs, prefix_out: Tensor, prefix_lse: Tensor, return_lse: bool = False):
    """:func:`depth_attention_merge` of checked arguments (``args`` from :func:`check_prefix_args`)."""
    if not args.multi_query:
        prefix_out, prefix_lse = prefix_out.unsqueeze(0), prefix_lse.unsqueeze(0)
    acc = args.acc_dtype
    v = torch.stack([s.to(acc) for s in args.sources])
    s_b = _logits(args.query_key(), v, args.options.eps)  # [Q, N_b, ...]
    all_logits = torch.cat([prefix_lse.to(acc).unsqueeze(1), s_b], dim=1)
    m = all_logits.amax(dim=1, keepdim=True)
    e = torch.exp(all_logits - m)  # [Q, 1 + N_b, ...]
    numerator = e[:, 0].unsqueeze(-1) * prefix_out.to(acc) + _value_sum(e[:, 1:], v, args)
    denominator = e.sum(dim=1)
    h = numerator / denominator.unsqueeze(-1)
    lse = m.squeeze(1) + torch.log(denominator)
    return _finish(h, lse, None, args, return_lse, False)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """``softmax(q kᵀ · scale + mask) v`` (DESIGN.md §2.4), computed in fp32 (fp64 for fp64 inputs).

    Args:
        q: ``[B, H, Tq, Dh]``; k, v: ``[B, Hkv, Tk, Dh]`` with ``H % Hkv == 0``
            (grouped-query attention: query head h reads key/value head ``h // (H // Hkv)``).
        causal: query i sees keys ``j <= i + Tk - Tq`` (aligned to the bottom right,
            as FlashAttention does, so a chunk of the last Tq queries can attend
            to a longer cache).
        key_padding_mask: bool ``[B, Tk]``, True for a real key, False for padding;
            combines with ``causal``.
        scale: logit scale, default ``1 / sqrt(Dh)``.
        return_lse: also return ``lse = logsumexp_j(s_j)`` over the visible keys,
            ``[B, H, Tq]`` in the accumulation dtype.

    Returns:
        ``out`` (``[B, H, Tq, Dh]``, q's dtype), followed by ``lse`` when asked for.

    A query row that sees no key (every key padded, or ``Tq > Tk`` under ``causal``
    for its first ``Tq - Tk`` rows) gets output 0, ``lse = -inf`` and zero gradients,
    never NaN.

    Backward (what the fused kernels compute; here autograd derives it). Per head,
    with ``S = q kᵀ · scale`` (hidden keys at -inf), ``P = exp(S - lse)`` (0 in rows
    that see no key), ``O = P v`` and incoming gradients ``dO`` and ``dlse``::

        dP = dO vᵀ
        δ  = rowsum(dO ⊙ O) - dlse          # = rowsum(P ⊙ dP) - dlse
        dS = P ⊙ (dP - δ)                   # = P ⊙ (dP - rowsum(dO ⊙ O)) + P ⊙ dlse
        dq = dS k · scale
        dk = dSᵀ q · scale
        dv = Pᵀ dO

    With grouped-query attention, dk and dv of a key/value head sum these terms over
    the ``H / Hkv`` query heads that read it. ``dlse`` enters through
    ``∂lse/∂S = P``. No ``T x T`` matrix is needed: a kernel recomputes ``P`` tile by
    tile from the saved ``lse``, and ``δ`` is one number per query row.
    """
    scale = check_attention(q, k, v, key_padding_mask, scale)
    acc = accumulation_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", q.to(acc), kf) * scale
    visible = attention_mask(q.shape[2], k.shape[2], causal, key_padding_mask, q.device)  # [B or 1, 1, Tq, Tk]
    scores = scores.masked_fill(~visible, float("-inf"))
    # Rows that see no key are normalized against 0 instead of -inf: their
    # probabilities are then exp(-inf) = 0 with finite gradients everywhere.
    has_key = visible.any(-1)
    lse = torch.logsumexp(torch.where(has_key.unsqueeze(-1), scores, 0.0), dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhts,bhsd->bhtd", probs, vf).to(q.dtype)
    if not return_lse:
        return out
    return out, lse.masked_fill(~has_key, float("-inf"))


def attention_mask(tq: int, tk: int, causal: bool, key_padding_mask: Tensor | None, device) -> Tensor:
    """Bool ``[B or 1, 1, Tq, Tk]``: True where query i may attend to key j."""
    visible = torch.ones(1, 1, tq, tk, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(tq, device=device).unsqueeze(1)
        j = torch.arange(tk, device=device).unsqueeze(0)
        visible = visible & (j <= i + (tk - tq))
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, :]
    return visible


def block_step(
    partial: Tensor | None,
    update: Tensor,
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    key_rank: int | None = None,
    return_lse: bool = False,
):
    """One residual step of two-phase Block AttnRes (DESIGN.md §2.3, phase 2).

    ``new_partial = partial + update`` (``update`` alone when ``partial`` is None:
    the first sublayer output of a block), then the next site's read: the
    merge of its phase-1 read over the committed blocks ``(prefix_out, prefix_lse)``
    with the one source ``new_partial``, optionally followed by the sublayer's
    PreNorm ``rmsnorm(h) * out_norm_weight``. ``query``/``norm_weight`` are the
    next site's ``w``/``γ`` (``[D]``, or ``[R]`` with ``key_rank = R``: sliced low-rank keys).

    Returns ``(new_partial, out)`` or, with ``return_lse``, ``(new_partial, out, lse)``.
    """
    check_block_step(partial, update)
    new_partial = update if partial is None else partial + update
    result = depth_attention_merge(
        query,
        prefix_out,
        prefix_lse,
        [new_partial],
        norm_weight,
        eps=eps,
        out_norm_weight=out_norm_weight,
        key_rank=key_rank,
        return_lse=return_lse,
    )
    return (new_partial, *result) if return_lse else (new_partial, result)
