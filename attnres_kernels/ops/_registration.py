"""Fake kernels and autograd shared by the fused backends of each op family.

Depth read. Each backend provides a pair of ops with one schema::

    depth_attn_fwd(sources, query, norm_weight?, prefix_out?, prefix_lse?, out_norm_weight?, eps)
        -> (out [Q?, ..., D], lse [Q?, ...], logits [Q?, N, ...], rinv [N, ...])
    depth_attn_bwd(grad_out, grad_lse?, grad_logits?, sources, query, norm_weight?, prefix_out?,
                   prefix_lse?, out_norm_weight?, logits, rinv, eps)
        -> (grad_sources, grad_query, grad_norm_weight, grad_prefix_out, grad_prefix_lse,
            grad_out_norm_weight)

``query`` is ``[D]`` (one site; the outputs then have no site dim ``Q?``) or
``[Q, D]``; ``norm_weight`` and ``out_norm_weight`` are ``[D]`` (shared by every
site) or ``[Q, D]``, in any floating dtype (their gradients come back in it).
The kernels fold ``u = query ⊙ norm_weight`` once per call. ``out`` is ``h`` or,
with ``out_norm_weight``, ``rmsnorm(h) * out_norm_weight``. ``lse``, ``logits``
and ``rinv`` (the key-norm scale ``r_i``) are in the accumulation dtype (fp32;
fp64 when the output dtype is fp64). Sources may differ in dtype: ``out`` has
their promoted dtype (with ``prefix_out``'s), ``grad_out`` has the dtype of
``out``, and each source gradient the dtype of its source. Absent optional
inputs get empty gradients.

Saved for backward (never a copy of the sources): references to the sources,
the site parameters, the prefix when given, and the fp32/fp64 per-row scalars
``logits`` and ``rinv``. The backward recomputes ``α = softmax(logits)`` (as
``exp(s - max) / Σ``: more accurate than ``exp(s - lse)`` with a rounded
``lse``) and, when the output norm is fused, ``h`` from the sources.
"""

from __future__ import annotations

import torch

from .._validation import accumulation_dtype, promoted_dtype


def fake_depth_fwd(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps):
    first = sources[0]
    lead, d = first.shape[:-1], first.shape[-1]
    q_dims = tuple(query.shape[:-1])
    out_dtype = promoted_dtype([*sources, prefix_out])
    acc = accumulation_dtype(out_dtype)
    return (
        first.new_empty((*q_dims, *lead, d), dtype=out_dtype),
        first.new_empty((*q_dims, *lead), dtype=acc),
        first.new_empty((*q_dims, len(sources), *lead), dtype=acc),
        first.new_empty((len(sources), *lead), dtype=acc),
    )


def _empty_like_or_none(t, like):
    return torch.empty_like(t, memory_format=torch.contiguous_format) if t is not None else like.new_empty((0,))


def fake_depth_bwd(
    grad_out,
    grad_lse,
    grad_logits,
    sources,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    logits,
    rinv,
    eps,
):
    return (
        [torch.empty_like(s, memory_format=torch.contiguous_format) for s in sources],
        torch.empty_like(query, memory_format=torch.contiguous_format),
        _empty_like_or_none(norm_weight, logits),
        _empty_like_or_none(prefix_out, sources[0]),
        _empty_like_or_none(prefix_lse, logits),
        _empty_like_or_none(out_norm_weight, logits),
    )


def register_depth_attn_fakes(fwd_name: str, bwd_name: str) -> None:
    torch.library.register_fake(fwd_name)(fake_depth_fwd)
    torch.library.register_fake(bwd_name)(fake_depth_bwd)


def register_depth_attn_autograd(fwd_name: str, bwd_op) -> None:
    """Python autograd of a depth-read forward op (``bwd_op`` computes its gradients)."""

    def setup_context(ctx, inputs, output):
        sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps = inputs
        out, _, logits, rinv = output
        ctx.mark_non_differentiable(rinv)
        ctx.num_sources, ctx.eps, ctx.out_dtype = len(sources), eps, out.dtype
        ctx.save_for_backward(*sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logits, rinv)

    def backward(ctx, grad_out, grad_lse, grad_logits, _grad_rinv):
        saved = ctx.saved_tensors
        sources = list(saved[: ctx.num_sources])
        query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logits, rinv = saved[ctx.num_sources :]
        if grad_out is None:
            lead = sources[0].shape
            grad_out = sources[0].new_zeros((*query.shape[:-1], *lead), dtype=ctx.out_dtype)
        grads = bwd_op(
            grad_out,
            grad_lse,
            grad_logits,
            sources,
            query,
            norm_weight,
            prefix_out,
            prefix_lse,
            out_norm_weight,
            logits,
            rinv,
            ctx.eps,
        )
        grad_sources, grad_query, grad_norm, grad_prefix_out, grad_prefix_lse, grad_g = grads
        present = lambda grad, t: grad if t is not None else None
        return (
            grad_sources,
            grad_query,
            present(grad_norm, norm_weight),
            present(grad_prefix_out, prefix_out),
            present(grad_prefix_lse, prefix_lse),
            present(grad_g, out_norm_weight),
            None,
        )

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)


def register_depth_attn_ops(fwd_name: str, bwd_name: str, bwd_op) -> None:
    """Registers the fake kernels of both ops and the Python autograd of the forward."""
    register_depth_attn_fakes(fwd_name, bwd_name)
    register_depth_attn_autograd(fwd_name, bwd_op)
