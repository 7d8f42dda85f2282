"""Fake kernels and autograd shared by every fused backend of the depth read.

Each backend provides a pair of ops with one schema:

    depth_attn_fwd(sources, query_key, prefix_out, prefix_lse, out_norm_weight, eps)
        -> (out [Q, ..., D], lse [Q, ...], logits [Q, N, ...], rinv [N, ...])
    depth_attn_bwd(grad_out, grad_lse, grad_logits, sources, query_key, prefix_out,
                   prefix_lse, out_norm_weight, logits, rinv, eps)
        -> (grad_sources, grad_query_key, grad_prefix_out, grad_prefix_lse, grad_out_norm_weight)

``query_key`` is ``w ⊙ γ`` (``[Q, D]``, accumulation dtype); ``out`` is ``h``
or, with ``out_norm_weight``, ``rmsnorm(h) * out_norm_weight``. ``lse``,
``logits`` and ``rinv`` (the key-norm scale ``r_i``) are in the accumulation
dtype (fp32; fp64 when the output dtype is fp64). Sources may differ in dtype:
``out`` has their promoted dtype (with ``prefix_out``'s), ``grad_out`` has the
dtype of ``out``, and each source gradient the dtype of its source.

Saved for backward (never a copy of the sources): references to the sources,
``query_key``, the prefix and out-norm weight when given, and the fp32/fp64
per-row scalars ``logits [Q, N, M]`` and ``rinv [N, M]``. The backward
recomputes ``α = softmax(logits)`` (as ``exp(s - max) / Σ``: more accurate
than ``exp(s - lse)`` with a rounded ``lse``) and, when the output norm is
fused, ``h`` from the sources.
"""

from __future__ import annotations

import torch

from .._validation import accumulation_dtype, promoted_dtype


def fake_fwd(sources, query_key, prefix_out, prefix_lse, out_norm_weight, eps):
    first = sources[0]
    lead, d = first.shape[:-1], first.shape[-1]
    q, n = query_key.shape[0], len(sources)
    out_dtype = promoted_dtype([*sources, prefix_out])
    acc = accumulation_dtype(out_dtype)
    return (
        first.new_empty((q, *lead, d), dtype=out_dtype),
        first.new_empty((q, *lead), dtype=acc),
        first.new_empty((q, n, *lead), dtype=acc),
        first.new_empty((n, *lead), dtype=acc),
    )


def fake_bwd(
    grad_out, grad_lse, grad_logits, sources, query_key, prefix_out, prefix_lse, out_norm_weight, logits, rinv, eps
):
    def empty_like_or_none(t, like):
        return torch.empty_like(t, memory_format=torch.contiguous_format) if t is not None else like.new_empty((0,))

    return (
        [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources],
        torch.empty_like(query_key),
        empty_like_or_none(prefix_out, sources[0]),
        empty_like_or_none(prefix_lse, query_key),
        empty_like_or_none(out_norm_weight, query_key),
    )


def register_depth_attn_ops(fwd_name: str, bwd_name: str, bwd_op) -> None:
    """Registers the fake kernels of both ops and the autograd of the forward."""
    torch.library.register_fake(fwd_name)(fake_fwd)
    torch.library.register_fake(bwd_name)(fake_bwd)

    def setup_context(ctx, inputs, output):
        sources, query_key, prefix_out, prefix_lse, out_norm_weight, eps = inputs
        _, _, logits, rinv = output
        ctx.mark_non_differentiable(rinv)
        ctx.num_sources, ctx.eps = len(sources), eps
        ctx.save_for_backward(*sources, query_key, prefix_out, prefix_lse, out_norm_weight, logits, rinv)

    def backward(ctx, grad_out, grad_lse, grad_logits, _grad_rinv):
        saved = ctx.saved_tensors
        sources = list(saved[: ctx.num_sources])
        query_key, prefix_out, prefix_lse, out_norm_weight, logits, rinv = saved[ctx.num_sources :]
        if grad_out is None:
            first = sources[0]
            grad_out = first.new_zeros((query_key.shape[0], *first.shape), dtype=promoted_dtype([*sources, prefix_out]))
        grad_sources, grad_qk, grad_prefix_out, grad_prefix_lse, grad_g = bwd_op(
            grad_out,
            grad_lse,
            grad_logits,
            sources,
            query_key,
            prefix_out,
            prefix_lse,
            out_norm_weight,
            logits,
            rinv,
            ctx.eps,
        )
        return (
            grad_sources,
            grad_qk,
            grad_prefix_out if prefix_out is not None else None,
            grad_prefix_lse if prefix_lse is not None else None,
            grad_g if out_norm_weight is not None else None,
            None,
        )

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)
