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

from .. import _native, reference
from .._validation import MAX_HEAD_DIM, check_attention
from . import _dispatch
from ._registration import register_native_attention_ops

if _native.defines("attn_fwd"):
    register_native_attention_ops()

# What "auto" and "cpu" resolve to on CPU tensors with Dh <= MAX_HEAD_DIM when the extension has the CPU
# kernel: known at import, so that a call (a decode step is a few µs of kernel) skips the resolution.
_CPU_OP = torch.ops.attnres.attn_fwd.default if _native.has_kernel("attn_fwd", "cpu") else None


def _plain_cpu_call(q, k, v, key_padding_mask) -> bool:
    """Whether q, k, v (and the mask) are plain CPU tensors and q's head size is one the C++ kernel takes:
    a call the C++ op validates itself (a tensor on another device would dispatch elsewhere)."""
    return (
        type(q) is Tensor
        and type(k) is Tensor
        and type(v) is Tensor
        and q.is_cpu
        and k.is_cpu
        and v.is_cpu
        and (key_padding_mask is None or (type(key_padding_mask) is Tensor and key_padding_mask.is_cpu))
        and q.dim() == 4
        and 0 < q.shape[3] <= MAX_HEAD_DIM
    )


def _limit(head_dim: int):
    def limit(backend: str) -> str | None:
        if head_dim > MAX_HEAD_DIM:
            return f"the fused attention kernels support head sizes Dh <= {MAX_HEAD_DIM}, got Dh = {head_dim}"
        return None

    return limit


def resolve_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """The backend that will run an attention call with head size ``head_dim`` on ``device``."""
    return _dispatch.resolve(backend, device, "attn_fwd", _limit(head_dim), what=f" (Dh = {head_dim})")


def available_backends(device: torch.device | str = "cpu", head_dim: int = 64) -> list:
    """Backends that can run attention with head size ``head_dim`` on ``device`` right now."""
    device = torch.device(device)
    limit = _limit(head_dim)
    return [b for b in _dispatch.BACKENDS[1:] if _dispatch.unavailable_reason(b, device, "attn_fwd", limit) is None]


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
    """``softmax(q kᵀ · scale + mask) v``, fused (FlashAttention-2 style: no T×T matrix
    in memory, fp32 LSE saved for a backward that recomputes the probabilities).

    Same arguments and results as :func:`attnres_kernels.reference.attention` (masks,
    grouped-query attention, ``Tq != Tk`` with bottom-right causal alignment, rows that
    see no key give 0 / ``lse = -inf`` / zero gradients), plus ``backend`` (see
    :mod:`attnres_kernels.ops._dispatch`: ``"auto"`` runs the C++ kernels on CPU
    tensors; a backend named explicitly that cannot run the call raises
    :class:`~attnres_kernels.ops.BackendUnavailableError`). The fused kernels take
    fp16, bf16, fp32 (all accumulated in fp32) and fp64, any sequence lengths and
    strides, and head sizes up to :data:`MAX_HEAD_DIM`; ``"auto"`` falls back to the
    reference (with a one-time warning) beyond that. Double backward is exact: it
    runs through the reference."""
    if _CPU_OP is not None and backend in _dispatch.CPU_KERNEL_BACKENDS and _plain_cpu_call(q, k, v, key_padding_mask):
        # The C++ op checks every argument before its kernel runs; the Python checks (~1 µs, a sixth of
        # a one-key decode step) run only to word the error of a call it rejected.
        try:
            out, lse = _CPU_OP(q, k, v, key_padding_mask, bool(causal), q.shape[3] ** -0.5 if scale is None else scale)
        except (RuntimeError, TypeError):
            check_attention(q, k, v, key_padding_mask, scale)
            raise
        return (out, lse) if return_lse else out
    scale = check_attention(q, k, v, key_padding_mask, scale)
    if _CPU_OP is not None and backend in _dispatch.CPU_KERNEL_BACKENDS and q.is_cpu and q.shape[3] <= MAX_HEAD_DIM:
        out, lse = _CPU_OP(q, k, v, key_padding_mask, bool(causal), scale)  # tensor subclasses on CPU
        return (out, lse) if return_lse else out
    chosen = resolve_backend(backend, q.device, q.shape[-1])
    if chosen == "reference":
        return reference.attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, return_lse=return_lse
        )
    out, lse = _dispatch.fused_op(chosen, "attn_fwd", q.device)(q, k, v, key_padding_mask, bool(causal), float(scale))
    return (out, lse) if return_lse else out
