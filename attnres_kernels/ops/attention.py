"""Fused attention (DESIGN.md §2.4): :func:`attention`.

Backends register ``attn_fwd``/``attn_bwd`` ops (``attnres::`` for C++ CPU/CUDA,
``attnres_triton::`` for Triton) with one schema::

    attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, bool causal, float scale)
        -> (Tensor out, Tensor lse)
    attn_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask,
             Tensor out, Tensor lse, bool causal, float scale) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
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


# The attention backends: the fused ones, the reference, and PyTorch's scaled_dot_product_attention.
ATTENTION_BACKENDS = (*_dispatch.BACKENDS, "sdpa")

# Where our fused attention beats SDPA on a GPU, per compute capability: a rule (q, causal) -> bool over the
# shapes, from the attention section of `python -m benchmarks.gpu` (benchmarks/results/gpu_<device>.md). An
# architecture without an entry runs SDPA under "auto" wherever SDPA computes what the call asks for. On an H200
# (sm_90) SDPA measured faster at every shape (ours 0.27-0.72x of its speed), so there is no entry.
FASTER_THAN_SDPA: dict[tuple[int, int], Callable[[Tensor, bool], bool]] = {}


def sdpa_unavailable_reason(q: Tensor, k: Tensor, causal: bool, key_padding_mask, return_lse: bool) -> str | None:
    """Why SDPA cannot compute this call with our semantics (docs/design.md §2.4), or None if it can: it
    returns no LSE, and a row that sees no key is NaN there, 0 here."""
    if return_lse:
        return "SDPA does not return the LSE"
    if key_padding_mask is not None:
        return "a key padding mask can leave a row without keys (NaN in SDPA, 0 here)"
    if causal and q.shape[2] > k.shape[2]:
        return "causal with Tq > Tk leaves the first rows without keys (NaN in SDPA, 0 here)"
    return None


def _sdpa_wins(q: Tensor, causal: bool) -> bool:
    """Whether "auto" runs SDPA rather than our kernels for a call on CUDA tensors (see FASTER_THAN_SDPA)."""
    rule = FASTER_THAN_SDPA.get(torch.cuda.get_device_capability(q.device))
    return rule is None or not rule(q, causal)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """Our attention on ``scaled_dot_product_attention`` (a call :func:`sdpa_unavailable_reason` accepts):
    causal rows aligned to the bottom right when ``Tq < Tk``, grouped-query heads read in place."""
    # Imported here: torch.nn.attention.bias imports torch._dynamo, which `import attnres_kernels` defers.
    from torch.nn.attention.bias import causal_lower_right

    tq, tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if causal and tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = causal_lower_right(tq, tk) if causal and tq > 1 else None  # one query sees every key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _limit(head_dim: int):
    def limit(backend: str) -> str | None:
        if head_dim > MAX_HEAD_DIM:
            return f"the fused attention kernels support head sizes Dh <= {MAX_HEAD_DIM}, got Dh = {head_dim}"
        return None

    return limit


def resolve_backend(
    backend: str,
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
) -> str:
    """The backend that will run an attention call of ``q`` over ``k``: ``"sdpa"`` when asked for or, under
    ``"auto"`` on CUDA tensors, where SDPA computes the call and no measured rule says ours is faster
    (:data:`FASTER_THAN_SDPA`); else as the other op families resolve (CPU tensors: the C++ kernels)."""
    sdpa_reason = sdpa_unavailable_reason(q, k, causal, key_padding_mask, return_lse)
    if backend == "sdpa":
        if sdpa_reason is not None:
            raise _dispatch.BackendUnavailableError(f"backend 'sdpa' cannot run this call: {sdpa_reason}")
        return "sdpa"
    if backend == "auto" and q.device.type == "cuda" and sdpa_reason is None and _sdpa_wins(q, causal):
        return "sdpa"
    head_dim = q.shape[-1]
    return _dispatch.resolve(backend, q.device, "attn_fwd", _limit(head_dim), what=f" (Dh = {head_dim})")


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
    see no key give 0 / ``lse = -inf`` / zero gradients), plus ``backend``: one of
    :data:`ATTENTION_BACKENDS` (see :mod:`attnres_kernels.ops._dispatch`). ``"auto"`` runs
    the C++ kernels on CPU tensors and, on CUDA tensors, PyTorch's
    ``scaled_dot_product_attention`` (``"sdpa"``) wherever it computes the call (no
    ``return_lse``, no key padding mask, causal only with ``Tq <= Tk``) and no measured
    rule says ours is faster (:data:`FASTER_THAN_SDPA`), else our Triton kernels. A
    backend named explicitly that cannot run the call raises
    :class:`~attnres_kernels.ops.BackendUnavailableError`. The fused kernels take
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
    chosen = resolve_backend(backend, q, k, causal=causal, key_padding_mask=key_padding_mask, return_lse=return_lse)
    if chosen == "sdpa":
        return _sdpa(q, k, v, causal, scale)
    if chosen == "reference":
        return reference.attention(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, return_lse=return_lse
        )
    out, lse = _dispatch.fused_op(chosen, "attn_fwd", q.device)(q, k, v, key_padding_mask, bool(causal), float(scale))
    return (out, lse) if return_lse else out
