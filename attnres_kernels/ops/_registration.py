"""Fake kernels and autograd shared by the fused backends of each op family.

Depth read. Each backend provides a pair of ops with one schema::

    depth_attn_fwd(sources, query, norm_weight?, prefix_out?, prefix_lse?, out_norm_weight?, *options)
        -> (out [Q?, ..., D], lse [Q?, ...], logits [Q?, N, ...], rinv [N, ...])
    depth_attn_bwd(grad_out, grad_lse?, grad_logits?, sources, query, norm_weight?, prefix_out?,
                   prefix_lse?, out_norm_weight?, logits, rinv, *options)
        -> (grad_sources, grad_query, grad_norm_weight, grad_prefix_out, grad_prefix_lse,
            grad_out_norm_weight)

where ``*options`` are the fields of :class:`attnres_kernels._validation.ReadOptions`
(``eps, out_norm_eps, scale, normalize_values, out_dtype``), passed as trailing scalars.

``query`` is ``[D]`` (one site; the outputs then have no site dim ``Q?``) or
``[Q, D]``; ``norm_weight`` and ``out_norm_weight`` are ``[D]`` (shared by every
site) or ``[Q, D]``, in any floating dtype (their gradients come back in it).
The kernels fold ``u = scale · query ⊙ norm_weight`` once per call. ``out`` is ``h`` or,
with ``out_norm_weight``, ``rmsnorm(h) * out_norm_weight``; ``logits`` are the scaled
logits ``r_i <u, v_i>``. ``lse``, ``logits``
and ``rinv`` (the key-norm scale ``r_i``) are in the accumulation dtype (fp32;
fp64 when the inputs or the output are fp64). Sources may differ in dtype: ``out`` has
``out_dtype`` or else their promoted dtype (with ``prefix_out``'s), ``grad_out`` has the
dtype of ``out``, and each source gradient the dtype of its source. Absent optional
inputs get empty gradients.

Saved for backward (never a copy of the sources): references to the sources,
the site parameters, the prefix when given, and the fp32/fp64 per-row scalars
``logits`` and ``rinv``. The backward recomputes ``α = softmax(logits)`` (as
``exp(s - max) / Σ``: more accurate than ``exp(s - lse)`` with a rounded
``lse``) and, when the output norm is fused, ``h`` from the sources.

Attention and the Block step follow below, each with its schema.

Autograd. The C++ ops ``attnres::depth_attn_fwd``, ``attnres::block_step_fwd`` and
``attnres::attn_fwd`` have their autograd in C++ (``csrc/autograd``, registered for the Autograd
dispatch key, serving the CPU and CUDA kernels alike): a Python autograd wrapper
costs more than the kernels of a small read. The extension registers the same autograd
for the Triton ops (``attnres_triton::*_fwd``, defined in Python with the same schemas), whose
GPU calls are host-bound. The emulated CUDA ops, and the Triton ops when the extension is not
loaded, get the Python autograd below.

Higher-order gradients. The fused backward kernels are not themselves
differentiable. When a backward runs with ``create_graph=True`` (grad mode on
inside the backward), the gradients are computed instead by autograd through
the plain-PyTorch reference, as a differentiable function of the saved inputs
(:func:`differentiable_grads`; the C++ autograd reaches it through the ops
``attnres::depth_attn_bwd_differentiable``, ``attnres::block_step_bwd_differentiable`` and
``attnres::attn_bwd_differentiable``, implemented here): double backward is then exact, on every backend, at the
reference's cost.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import reference
from .._validation import DepthReadArgs, ReadOptions, accumulation_dtype, promoted_dtype
from ..reference import ops as reference_ops


def differentiable_grads(fn, inputs: list, grad_outputs: list) -> list:
    """``d(Σ <fn(inputs)_k, grad_outputs_k>) / d inputs`` as a differentiable function
    (``create_graph=True``), ``None`` for inputs that do not require grad.

    ``inputs`` is a flat list of tensors (or None); ``fn`` maps it to a tuple of
    outputs matching ``grad_outputs`` (None entries are skipped).

    It differentiates w.r.t. aliases (``view_as``) of the inputs, not the inputs
    themselves, so that the nested backward stops at the aliases. Differentiating
    w.r.t. an input itself would run every node between the outputs and it:
    through an input computed from another input (a total instead of a partial
    derivative), and, for the Block step, whose saved ``new_partial`` is the op's
    own output, through the very node whose backward is running, which would
    call this again without end."""
    wrt = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    with torch.enable_grad():
        inputs = [x.view_as(x) if i in wrt else x for i, x in enumerate(inputs)]
        outputs = fn(inputs)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    result = [None] * len(inputs)
    if not wrt or not pairs:
        return result
    grads = torch.autograd.grad(
        [o for o, _ in pairs], [inputs[i] for i in wrt], [g for _, g in pairs], create_graph=True, allow_unused=True
    )
    for i, grad in zip(wrt, grads):
        result[i] = grad if grad is not None else torch.zeros_like(inputs[i])
    return result


# ---------------------------------------------------------------- depth read


def reference_depth_fwd(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, options):
    """``(out, lse, logits)`` of ``depth_attn_fwd`` computed by the reference (differentiable)."""
    args = DepthReadArgs(tuple(sources), query, norm_weight, out_norm_weight, ReadOptions(*options))
    if prefix_out is None:
        out, lse = reference_ops.read(args, return_lse=True)
    else:
        args = dataclasses.replace(args, prefix_dtype=prefix_out.dtype)
        out, lse = reference_ops.merge(args, prefix_out, prefix_lse, return_lse=True)
    logits = reference_ops._logits(
        args.query_key(), torch.stack([s.to(args.acc_dtype) for s in sources]), args.options.eps
    )
    return out, lse, logits if query.dim() == 2 else logits.squeeze(0)


def fake_depth_fwd(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, *options):
    options = ReadOptions(*options)
    first = sources[0]
    lead, d = first.shape[:-1], first.shape[-1]
    q_dims = tuple(query.shape[:-1])
    input_dtype = promoted_dtype([*sources, prefix_out])
    out_dtype = options.out_dtype or input_dtype
    acc = accumulation_dtype(torch.promote_types(input_dtype, out_dtype))
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
    *options,
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
        sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, *options = inputs
        out, _, logits, rinv = output
        ctx.mark_non_differentiable(rinv)
        ctx.num_sources, ctx.options, ctx.out_dtype = len(sources), ReadOptions(*options), out.dtype
        ctx.save_for_backward(*sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logits, rinv)

    def backward(ctx, grad_out, grad_lse, grad_logits, _grad_rinv):
        saved = ctx.saved_tensors
        sources = list(saved[: ctx.num_sources])
        query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logits, rinv = saved[ctx.num_sources :]
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward through the reference
            n = ctx.num_sources
            grads = differentiable_grads(
                lambda x: reference_depth_fwd(x[:n], *x[n:], ctx.options),
                [*sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight],
                [grad_out, grad_lse, grad_logits],
            )
            return (grads[:n], *grads[n:], *[None] * len(ctx.options))
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
            *ctx.options,
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
            *[None] * len(ctx.options),
        )

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)


def differentiable_depth_bwd(
    grad_out, grad_lse, grad_logits, sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, *options
):
    """``attnres::depth_attn_bwd_differentiable``: the gradients of ``depth_attn_fwd``
    w.r.t. its inputs, differentiable (by autograd through the reference). One
    per source, then query, norm_weight, prefix_out, prefix_lse, out_norm_weight;
    an empty tensor for an input that is absent or does not require grad."""
    n = len(sources)
    grads = differentiable_grads(
        lambda x: reference_depth_fwd(x[:n], *x[n:], options),
        [*sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight],
        [grad_out, grad_lse, grad_logits],
    )
    return [g if g is not None else query.new_empty((0,)) for g in grads]


def register_native_depth_attn_ops(namespace: str = "attnres") -> None:
    """Python parts of a C++ depth read whose autograd is registered in C++: the
    fake kernels and the differentiable backward its double backward calls."""
    register_depth_attn_fakes(f"{namespace}::depth_attn_fwd", f"{namespace}::depth_attn_bwd")
    torch.library.impl(f"{namespace}::depth_attn_bwd_differentiable", "CompositeImplicitAutograd")(
        differentiable_depth_bwd
    )


def register_depth_attn_ops(fwd_name: str, bwd_name: str, bwd_op) -> None:
    """Registers the fake kernels of both ops and the Python autograd of the forward."""
    register_depth_attn_fakes(fwd_name, bwd_name)
    register_depth_attn_autograd(fwd_name, bwd_op)


# ---------------------------------------------------------------- attention
#
#   attn_fwd(q [B, H, Tq, Dh], k [B, Hkv, Tk, Dh], v [B, Hkv, Tk, Dh], key_padding_mask? [B, Tk] bool,
#            bool causal, float scale) -> (out [B, H, Tq, Dh] (q's dtype), lse [B, H, Tq] (acc dtype))
#   attn_bwd(grad_out, grad_lse?, q, k, v, key_padding_mask?, out, lse, causal, scale)
#       -> (grad_q, grad_k, grad_v)
#
# Saved for backward: q, k, v, the mask, out and the fp32/fp64 lse (no T x T
# matrix: the backward recomputes the probabilities tile by tile).


def fake_attn_fwd(q, k, v, key_padding_mask, causal, scale):
    acc = accumulation_dtype(q.dtype)
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=acc)


def fake_attn_bwd(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, causal, scale):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def reference_attn_fwd(q, k, v, key_padding_mask, causal, scale):
    """``(out, lse)`` of ``attn_fwd`` computed by the reference (differentiable)."""
    return reference.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, return_lse=True)


def register_attention_fakes(fwd_name: str, bwd_name: str) -> None:
    torch.library.register_fake(fwd_name)(fake_attn_fwd)
    torch.library.register_fake(bwd_name)(fake_attn_bwd)


def differentiable_attn_bwd(grad_out, grad_lse, q, k, v, key_padding_mask, causal, scale):
    """``attnres::attn_bwd_differentiable``: the gradients of ``attn_fwd`` w.r.t. q, k, v,
    differentiable (by autograd through the reference); an empty tensor for an input
    that does not require grad."""
    grads = differentiable_grads(
        lambda x: reference_attn_fwd(*x, causal, scale), [q, k, v, key_padding_mask], [grad_out, grad_lse]
    )
    return [g if g is not None else q.new_empty((0,)) for g in grads[:3]]


def register_native_attention_ops(namespace: str = "attnres") -> None:
    """Python parts of a C++ attention whose autograd is registered in C++: the fake
    kernels and the differentiable backward its double backward calls."""
    register_attention_fakes(f"{namespace}::attn_fwd", f"{namespace}::attn_bwd")
    torch.library.impl(f"{namespace}::attn_bwd_differentiable", "CompositeImplicitAutograd")(differentiable_attn_bwd)


def register_attention_ops(fwd_name: str, bwd_name: str, bwd_op) -> None:
    """Fake kernels of both attention ops and the Python autograd of the forward."""
    register_attention_fakes(fwd_name, bwd_name)

    def setup_context(ctx, inputs, output):
        q, k, v, key_padding_mask, causal, scale = inputs
        out, lse = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, key_padding_mask, out, lse)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, key_padding_mask, out, lse = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward through the reference
            dq, dk, dv, *_ = differentiable_grads(
                lambda x: reference_attn_fwd(*x, ctx.causal, ctx.scale),
                [q, k, v, key_padding_mask],
                [grad_out, grad_lse],
            )
            return dq, dk, dv, None, None, None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = bwd_op(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)


# ---------------------------------------------------------------- Block step
#
#   block_step_fwd(partial? [..., D], update [..., D], query [D], norm_weight? [D], prefix_out [..., D],
#                  prefix_lse [...], out_norm_weight? [D], float eps, int? key_rank)
#       -> (new_partial [..., D], out [..., D], lse [...], logit [...], rinv [...])
#   block_step_bwd(grad_new_partial?, grad_out?, grad_lse?, new_partial, query, norm_weight?, prefix_out,
#                  prefix_lse, out_norm_weight?, logit, rinv, eps, key_rank)
#       -> (grad_new_partial, grad_query, grad_norm_weight, grad_prefix_out, grad_prefix_lse,
#           grad_out_norm_weight)
#
# new_partial = partial + update (update alone when partial is absent) has the
# promoted dtype of the addends; out = the merge of the prefix read with the one
# source new_partial (then the fused output norm) has the promotion of that and
# prefix_out's dtype; lse, logit (the new source's s) and rinv (its key-norm
# scale) are in the accumulation dtype. grad_new_partial is the total gradient
# of new_partial (the incoming one plus the read's): autograd hands it to both
# addends, each in its own dtype. Saved for backward: new_partial (never the
# addends), the site parameters, the prefix and the per-row scalars logit and rinv.


def fake_block_step_fwd(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps, key_rank):
    new_dtype = update.dtype if partial is None else torch.promote_types(partial.dtype, update.dtype)
    out_dtype = torch.promote_types(new_dtype, prefix_out.dtype)
    acc = accumulation_dtype(out_dtype)
    lead = update.shape[:-1]
    return (
        update.new_empty(update.shape, dtype=new_dtype),
        update.new_empty(update.shape, dtype=out_dtype),
        update.new_empty(lead, dtype=acc),
        update.new_empty(lead, dtype=acc),
        update.new_empty(lead, dtype=acc),
    )


def fake_block_step_bwd(
    grad_new_partial,
    grad_out,
    grad_lse,
    new_partial,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    logit,
    rinv,
    eps,
    key_rank,
):
    return (
        torch.empty_like(new_partial, memory_format=torch.contiguous_format),
        torch.empty_like(query),
        _empty_like_or_none(norm_weight, logit),
        torch.empty_like(prefix_out, memory_format=torch.contiguous_format),
        torch.empty_like(prefix_lse, memory_format=torch.contiguous_format),
        _empty_like_or_none(out_norm_weight, logit),
    )


def reference_block_step_fwd(
    partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps, key_rank
):
    """``(new_partial, out, lse)`` of ``block_step_fwd`` computed by the reference (differentiable)."""
    return reference.block_step(
        partial,
        update,
        query,
        prefix_out,
        prefix_lse,
        norm_weight,
        eps=eps,
        out_norm_weight=out_norm_weight,
        key_rank=key_rank,
        return_lse=True,
    )


def register_block_step_fakes(fwd_name: str, bwd_name: str) -> None:
    torch.library.register_fake(fwd_name)(fake_block_step_fwd)
    torch.library.register_fake(bwd_name)(fake_block_step_bwd)


def differentiable_block_step_bwd(
    grad_new_partial,
    grad_out,
    grad_lse,
    new_partial,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    eps,
    key_rank,
):
    """``attnres::block_step_bwd_differentiable``: the gradients of ``block_step_fwd``,
    differentiable (by autograd through the reference). The read depends on the addends
    only through their sum, so the reference reads the saved ``new_partial`` as its one
    source; its gradient plus ``grad_new_partial`` is the total. Returns the gradients of
    new_partial, query, norm_weight, prefix_out, prefix_lse and out_norm_weight; an empty
    tensor for an input that is absent or does not require grad."""
    d_new, *grads = differentiable_grads(
        lambda x: reference_block_step_fwd(None, *x, eps, key_rank),
        [new_partial, query, norm_weight, prefix_out, prefix_lse, out_norm_weight],
        [None, grad_out, grad_lse],
    )
    if grad_new_partial is not None:
        d_new = grad_new_partial if d_new is None else d_new + grad_new_partial
    return [g if g is not None else new_partial.new_empty((0,)) for g in (d_new, *grads)]


def register_block_step_autograd(fwd_name: str, bwd_op) -> None:
    """Python autograd of a Block-step forward op (``bwd_op`` computes its gradients).
    The C++ op ``attnres::block_step_fwd`` has a native autograd of the same
    semantics instead (csrc/autograd/block_step_autograd.h): this one costs ~1 ms per call."""

    def setup_context(ctx, inputs, output):
        partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps, key_rank = inputs
        new_partial, _, _, logit, rinv = output
        ctx.mark_non_differentiable(logit, rinv)
        ctx.eps, ctx.key_rank = eps, key_rank
        ctx.addend_dtypes = (partial.dtype if partial is not None else None, update.dtype)
        # Not the addends: keeping the old partial sum alive would cost O(L·d) memory.
        ctx.save_for_backward(new_partial, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logit, rinv)

    def backward(ctx, grad_new_partial, grad_out, grad_lse, _grad_logit, _grad_rinv):
        new_partial, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, logit, rinv = ctx.saved_tensors
        params = (query, norm_weight, prefix_out, prefix_lse, out_norm_weight)
        if torch.is_grad_enabled():  # create_graph=True: a differentiable backward through the reference
            grads = differentiable_block_step_bwd(
                grad_new_partial, grad_out, grad_lse, new_partial, *params, ctx.eps, ctx.key_rank
            )
            grads = [g if t is not None and t.requires_grad else None for g, t in zip(grads, (new_partial, *params))]
        else:
            grads = bwd_op(
                grad_new_partial, grad_out, grad_lse, new_partial, *params, logit, rinv, ctx.eps, ctx.key_rank
            )
            grads = [g if t is not None else None for g, t in zip(grads, (new_partial, *params))]
        grad_total, grad_query, grad_norm, grad_prefix_out, grad_prefix_lse, grad_g = grads
        partial_dtype, update_dtype = ctx.addend_dtypes
        to = lambda dtype: grad_total.to(dtype) if grad_total is not None and dtype is not None else None
        return (
            to(partial_dtype),
            to(update_dtype),
            grad_query,
            grad_norm,
            grad_prefix_out,
            grad_prefix_lse,
            grad_g,
            None,
            None,
        )

    torch.library.register_autograd(fwd_name, backward, setup_context=setup_context)


def register_native_block_step_ops(namespace: str = "attnres") -> None:
    """Python parts of a C++ Block step whose autograd is registered in C++: the fake
    kernels and the differentiable backward its double backward calls."""
    register_block_step_fakes(f"{namespace}::block_step_fwd", f"{namespace}::block_step_bwd")
    torch.library.impl(f"{namespace}::block_step_bwd_differentiable", "CompositeImplicitAutograd")(
        differentiable_block_step_bwd
    )


def register_block_step_ops(fwd_name: str, bwd_name: str, bwd_op) -> None:
    """Fake kernels of both Block-step ops and the Python autograd of the forward."""
    register_block_step_fakes(fwd_name, bwd_name)
    register_block_step_autograd(fwd_name, bwd_op)
