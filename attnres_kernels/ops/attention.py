"""Fused attention (DESIGN.md §2.4): :func:`attention`.

Backends register ``attn_fwd``/``attn_bwd`` ops (``attnres::`` for C++ CPU/CUDA,
``attnres_triton::`` for Triton) with one schema::

    attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float scale)
        -> (Tensor out, Tensor lse)
    attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask,
             Tensor out, Tensor lse, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from .._validation import check_attention
from . import _dispatch


def resolve_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """The backend that will run an attention call with head size ``head_dim`` on ``device``."""
    return _dispatch.resolve(backend, device, "attn_fwd", what=f" (Dh = {head_dim})")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """``softmax(q kᵀ · scale + mask) v``, fused; see :func:`attnres_kernels.reference.attention`."""
    check_attention(q, k, v, key_padding_mask, scale)
    chosen = resolve_backend(backend, q.device, q.shape[-1])
    if chosen != "reference":
        raise _dispatch.BackendUnavailableError(f"no fused attention kernels yet ({chosen!r})")
    return reference.attention(
        q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, return_lse=return_lse
    )
