"""The fused residual step of two-phase Block AttnRes (DESIGN.md §2.3): :func:`block_step`.

Backends register ``block_step_fwd``/``block_step_bwd`` ops (``attnres::`` for
C++ CPU/CUDA, ``attnres_triton::`` for Triton) with one schema.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from .._validation import check_block_step
from . import _dispatch


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
    """``partial + update`` and the next site's merge read, fused; see
    :func:`attnres_kernels.reference.block_step`."""
    check_block_step(partial, update)
    chosen = resolve_backend(backend, update.device, update.shape[-1])
    if chosen != "reference":
        raise _dispatch.BackendUnavailableError(f"no fused Block step kernels yet ({chosen!r})")
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
