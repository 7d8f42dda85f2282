"""The fused residual step of two-phase Block AttnRes (DESIGN.md §2.3): :func:`block_step`.

Backends register ``block_step_fwd``/``block_step_bwd`` ops (``attnres::`` for
C++ CPU/CUDA, ``attnres_triton::`` for Triton) with one schema.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backends, _native, reference
from .._validation import (
    accumulation_dtype,
    check_block_step,
    check_depth_read,
    check_prefix,
    check_read_options,
    promoted_dtype,
)
from . import _dispatch
from ._registration import register_native_block_step_ops

if _native.defines("block_step_fwd"):
    # The C++ op brings its own autograd (csrc/autograd); Python adds the fake kernels
    # and the differentiable backward of its double backward.
    register_native_block_step_ops()


def _limit(dim: int, acc: torch.dtype, key_rank: int | None = None):
    def limit(backend: str) -> str | None:
        if key_rank is not None and backend != "cuda":
            return f"backend {backend!r} has no Block-step kernel for sliced low-rank keys (key_rank) yet"
        fused = _backends.get(backend)
        if fused.max_dim is not None and dim > fused.max_dim(acc):
            return f"the {fused.title} Block step supports D <= {fused.max_dim(acc)} for {acc} math, got D = {dim}"
        return None

    return limit


def resolve_backend(
    backend: str, device: torch.device, dim: int, acc: torch.dtype = torch.float32, key_rank: int | None = None
) -> str:
    """The backend that will run a Block step of width ``dim`` with ``acc`` accumulation on ``device``
    (``key_rank``: sliced low-rank keys of R < D coordinates)."""
    limit = _limit(dim, acc, key_rank)
    return _dispatch.resolve(backend, device, "block_step_fwd", limit, what=f" (D = {dim}, {acc} math)")


def step_unchecked(
    backend: str,
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
    """A Block step without argument checks, for modules that already guarantee what
    :func:`block_step` checks (addends of one shape and device, supported dtypes, one
    site's ``[D]`` parameters, ``prefix_lse`` in the accumulation dtype) and that resolved
    ``backend`` once (:func:`resolve_backend`; ``"auto"`` is not accepted here). Same
    results as :func:`block_step`."""
    if backend == "reference":
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
            return_lse=return_lse,
        )
    new_partial, out, lse, _, _ = _dispatch.fused_op(backend, "block_step_fwd", update.device)(
        partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, float(eps), key_rank
    )
    return (new_partial, out, lse) if return_lse else (new_partial, out)


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
    backend: str = "auto",
):
    """``partial + update`` and the next site's merge read in one pass over each row;
    same arguments and results as :func:`attnres_kernels.reference.block_step`, plus
    ``backend``. ``query``, ``norm_weight`` and ``out_norm_weight`` are one site's ``[D]``
    (``query`` and ``norm_weight`` ``[R]`` with ``key_rank = R``: sliced low-rank keys).
    Gradients flow to both addends (each in its own dtype), the site parameters and the
    prefix; autograd keeps ``new_partial`` for the backward, never the addends."""
    check_block_step(partial, update)
    options = check_read_options(eps, key_rank=key_rank)
    args = check_depth_read(query, [update], norm_weight, out_norm_weight, options)
    if args.multi_query:
        raise ValueError(f"`query` of a Block step is one site's [D], got shape {tuple(query.shape)}")
    check_prefix(args, prefix_out, prefix_lse)
    acc = accumulation_dtype(promoted_dtype([partial, update, prefix_out]))
    key_rank = args.options.key_rank  # None for R = D
    chosen = resolve_backend(backend, update.device, update.shape[-1], acc, key_rank)
    return step_unchecked(
        chosen,
        partial,
        update,
        query,
        prefix_out,
        prefix_lse if chosen == "reference" else prefix_lse.to(acc),
        norm_weight,
        eps=eps,
        out_norm_weight=out_norm_weight,
        key_rank=key_rank,
        return_lse=return_lse,
    )
