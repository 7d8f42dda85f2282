"""The fused residual step of two-phase Block AttnRes (DESIGN.md §2.3): :func:`block_step`.

Backends register ``block_step_fwd``/``block_step_bwd`` ops (``attnres::`` for
C++ CPU/CUDA, ``attnres_triton::`` for Triton) with one schema.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from .._validation import accumulation_dtype, check_block_step, check_depth_read, check_prefix, promoted_dtype
from . import _dispatch, _native
from ._registration import register_block_step_ops

if _native.defines("block_step_fwd"):
    register_block_step_ops(
        "attnres::block_step_fwd", "attnres::block_step_bwd", torch.ops.attnres.block_step_bwd.default
    )


def resolve_backend(backend: str, device: torch.device, dim: int) -> str:
    """The backend that will run a Block step of width ``dim`` on ``device``."""
    return _dispatch.resolve(backend, device, "block_step_fwd", what=f" (D = {dim})")


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
    return_lse: bool = False,
    backend: str = "auto",
):
    """``partial + update`` and the next site's merge read in one pass over each row;
    same arguments and results as :func:`attnres_kernels.reference.block_step`, plus
    ``backend``. ``query``, ``norm_weight`` and ``out_norm_weight`` are one site's ``[D]``."""
    check_block_step(partial, update)
    if query.dim() != 1:
        raise ValueError(f"`query` of a Block step is one site's [D], got shape {tuple(query.shape)}")
    args = check_depth_read(query, [update], norm_weight, out_norm_weight, eps)
    check_prefix(args, prefix_out, prefix_lse)
    chosen = resolve_backend(backend, update.device, update.shape[-1])
    if chosen == "reference":
        return reference.block_step(
            partial,
            update,
            query,
            prefix_out,
            prefix_lse,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=return_lse,
        )
    acc = accumulation_dtype(promoted_dtype([partial, update, prefix_out]))
    new_partial, out, lse, _, _ = _dispatch.fused_op(chosen, "block_step_fwd", update.device)(
        partial, update, query, norm_weight, prefix_out, prefix_lse.to(acc), out_norm_weight, float(eps)
    )
    return (new_partial, out, lse) if return_lse else (new_partial, out)
