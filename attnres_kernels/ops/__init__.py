"""Public functional API of the depth read, dispatching to one of several backends.

``backend`` is one of:

- ``"auto"``: CPU tensors → ``"cpu"`` (C++), CUDA tensors → ``"triton"``; the
  reference is used (with a one-time warning) only when no fused backend
  can serve the call.
- ``"reference"``: plain PyTorch (:mod:`attnres_kernels.reference`), always available.
- ``"cpu"``: the C++ kernels of ``attnres_kernels._C`` on CPU tensors.
- ``"cuda"``: C++/CUDA kernels on CUDA tensors, when the extension was built with nvcc.
- ``"triton"``: Triton kernels on CUDA tensors, or on CPU tensors when
  ``TRITON_INTERPRET=1`` was set before the first import of Triton.

A backend named explicitly that cannot serve the call raises
:class:`BackendUnavailableError`; it never falls back silently.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .. import reference
from .._validation import DepthReadArgs, Sources, check_depth_read, check_prefix
from . import _native

BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run this call."""


def _triton_unavailable_reason(device: torch.device, dim: int, dtype: torch.dtype) -> str | None:
    from .. import triton as triton_backend

    if triton_backend.IMPORT_ERROR is not None:
        return f"Triton is not importable ({triton_backend.IMPORT_ERROR})"
    if device.type == "cpu" and not triton_backend.INTERPRETING:
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before Triton is imported)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type} tensors"
    if dim > triton_backend.max_dim(dtype):
        return f"the Triton kernels support D <= {triton_backend.max_dim(dtype)} for {dtype}, got D = {dim}"
    return None


def _unavailable_reason(backend: str, device: torch.device, dim: int, dtype: torch.dtype) -> str | None:
    if backend == "reference":
        return None
    if backend in ("cpu", "cuda"):
        if device.type != backend:
            return f"backend {backend!r} needs {backend} tensors, got {device.type} tensors"
        if not _native.available():
            return f"the C++ extension attnres_kernels._C is not available ({_native.LOAD_ERROR})"
        if not _native.has_kernel_for(backend):
            return f"the C++ extension was built without {backend} kernels"
        return None
    return _triton_unavailable_reason(device, dim, dtype)


_warned_fallbacks = set()


def resolve_backend(backend: str, device: torch.device, dim: int, dtype: torch.dtype = torch.float32) -> str:
    """The backend that will run a depth read of ``dtype`` sources of width ``dim`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        reason = _unavailable_reason(backend, device, dim, dtype)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend!r} cannot run this call: {reason}")
        return backend
    preferred = {"cpu": ("cpu",), "cuda": ("triton", "cuda")}.get(device.type, ())
    for candidate in preferred:
        if _unavailable_reason(candidate, device, dim, dtype) is None:
            return candidate
    if preferred and (device.type, dim, dtype) not in _warned_fallbacks:
        _warned_fallbacks.add((device.type, dim, dtype))
        reasons = "; ".join(_unavailable_reason(c, device, dim, dtype) for c in preferred)
        warnings.warn(
            f"attnres_kernels: no fused backend for {device.type} tensors ({reasons}); "
            "using the plain-PyTorch reference",
            stacklevel=3,
        )
    return "reference"


def _fwd_op(backend: str):
    if backend in ("cpu", "cuda"):
        return _native.fwd_op()
    from ..triton import ops as triton_ops

    return triton_ops.fwd_op()


def _run_fused(backend: str, args: DepthReadArgs, eps: float, prefix, return_lse: bool, return_weights: bool):
    prefix_out, prefix_lse = prefix
    out, lse, logits, _ = _fwd_op(backend)(
        list(args.sources), args.query_key(), prefix_out, prefix_lse, args.out_norm_weight_acc(), float(eps)
    )
    # The weights are the softmax of the saved logits (not exp(logits - lse)): exact
    # to an ulp, and their backward is the plain softmax backward.
    weights = torch.softmax(logits, dim=1) if return_weights else None
    return args.pack_outputs(out, lse, weights, return_lse, return_weights)


def depth_attention(
    query: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
    return_weights: bool = False,
    backend: str = "auto",
):
    """Softmax attention over depth (DESIGN.md §2.1), fused.

    Same arguments and results as :func:`attnres_kernels.reference.depth_attention`,
    plus ``backend`` (see the module docstring). Gradients flow to the sources,
    ``query``, ``norm_weight`` and ``out_norm_weight``, and through ``lse``
    and the weights when those are used.
    """
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, eps)
    chosen = resolve_backend(backend, args.device, args.sources[0].shape[-1], args.dtype)
    if chosen == "reference":
        return reference.depth_attention(
            query,
            sources,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=return_lse,
            return_weights=return_weights,
        )
    return _run_fused(chosen, args, eps, (None, None), return_lse, return_weights)


def depth_attention_merge(
    query: Tensor,
    prefix_out: Tensor,
    prefix_lse: Tensor,
    sources: Sources,
    norm_weight: Tensor | None = None,
    *,
    eps: float = 1e-6,
    out_norm_weight: Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Extends a read ``(prefix_out, prefix_lse)`` over sources A with sources B, fused.

    Equals :func:`depth_attention` over ``A ∪ B``; see
    :func:`attnres_kernels.reference.depth_attention_merge`.
    """
    args = check_depth_read(query, sources, norm_weight, out_norm_weight, eps)
    prefix = check_prefix(args, prefix_out, prefix_lse)
    chosen = resolve_backend(backend, args.device, args.sources[0].shape[-1], args.dtype)
    if chosen == "reference":
        return reference.depth_attention_merge(
            query,
            prefix_out,
            prefix_lse,
            sources,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=return_lse,
        )
    return _run_fused(chosen, args, eps, prefix, return_lse, False)


def available_backends(device: torch.device | str = "cpu", dim: int = 1, dtype: torch.dtype = torch.float32) -> list:
    """Backends that can run a depth read of ``dtype`` sources of width ``dim`` on ``device`` right now."""
    device = torch.device(device)
    return [b for b in BACKENDS[1:] if _unavailable_reason(b, device, dim, dtype) is None]


__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "depth_attention",
    "depth_attention_merge",
    "resolve_backend",
]
