"""Backend selection shared by every op family (depth read, attention, Block step).

``backend`` is one of:

- ``"auto"``: CPU tensors → ``"cpu"`` (C++), CUDA tensors → ``"triton"``; the
  reference is used (with a one-time warning) only when no fused backend
  can serve the call.
- ``"reference"``: plain PyTorch (:mod:`attnres_kernels.reference`), always available.
- ``"cpu"``: the C++ kernels of ``attnres_kernels._C`` on CPU tensors.
- ``"cuda"``: C++/CUDA kernels on CUDA tensors, when the extension was built with nvcc;
  on CPU tensors with ``ATTNRES_CUDA_EMULATE=1``, the same kernel code run by the
  SIMT harness (:mod:`attnres_kernels.cuda.emulation`, ops ``attnres_emu::<name>``).
- ``"triton"``: Triton kernels on CUDA tensors, or on CPU tensors when
  ``TRITON_INTERPRET=1`` was set before the first import of Triton.

A backend named explicitly that cannot serve the call raises
:class:`BackendUnavailableError`; it never falls back silently.

Each fused backend exposes an op family as ``torch.library`` ops of one
schema: ``attnres::<name>`` (C++: CPU and CUDA dispatch keys) and
``attnres_triton::<name>`` (Triton). :func:`fused_op` returns the one a
backend runs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from . import _native

BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")
# The backend names that run CPU tensors on the C++ kernels when the extension has them: the ops
# check these first, so that a small call (a decode step, a small read) skips the resolution.
CPU_KERNEL_BACKENDS = frozenset(("auto", "cpu"))

# What "auto" tries, in order, per device type.
AUTO_PREFERENCE = {"cpu": ("cpu",), "cuda": ("triton", "cuda")}


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run this call."""


def _native_reason(backend: str, device: torch.device, op: str) -> str | None:
    if backend == "cuda" and device.type == "cpu":
        from ..cuda import emulation

        reason = emulation.unavailable_reason(op)
        return None if reason is None else f"backend 'cuda' needs cuda tensors, got cpu tensors ({reason})"
    if device.type != backend:
        return f"backend {backend!r} needs {backend} tensors, got {device.type} tensors"
    if not _native.available():
        return f"the C++ extension attnres_kernels._C is not available ({_native.LOAD_ERROR})"
    if not _native.has_kernel(op, backend):
        return f"the C++ extension was built without a {backend} kernel of attnres::{op}"
    return None


def _triton_reason(device: torch.device) -> str | None:
    from .. import triton as triton_backend

    if triton_backend.IMPORT_ERROR is not None:
        return f"Triton is not importable ({triton_backend.IMPORT_ERROR})"
    if device.type == "cpu" and not triton_backend.INTERPRETING:
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before Triton is imported)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type} tensors"
    return None


Limit = Callable[[str], "str | None"]


def unavailable_reason(backend: str, device: torch.device, op: str, limit: Limit | None = None) -> str | None:
    """Why ``backend`` cannot run op ``op`` on ``device`` tensors, or None if it can.

    ``limit(backend)`` adds the op family's own limits for this call (widths,
    head sizes) and returns a reason or None."""
    if backend == "reference":
        return None
    reason = _native_reason(backend, device, op) if backend in ("cpu", "cuda") else _triton_reason(device)
    if reason is None and limit is not None:
        reason = limit(backend)
    return reason


_warned_fallbacks = set()


def resolve(backend: str, device: torch.device, op: str, limit: Limit | None = None, what: str = "") -> str:
    """The backend that runs op ``op`` on ``device`` tensors when ``backend`` is asked for.

    ``what`` describes the call in the one-time fallback warning of ``"auto"``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        reason = unavailable_reason(backend, device, op, limit)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend!r} cannot run this call: {reason}")
        return backend
    preferred = AUTO_PREFERENCE.get(device.type, ())
    for candidate in preferred:
        if unavailable_reason(candidate, device, op, limit) is None:
            return candidate
    key = (op, device.type, what)
    if preferred and key not in _warned_fallbacks:
        _warned_fallbacks.add(key)
        reasons = "; ".join(unavailable_reason(c, device, op, limit) for c in preferred)
        warnings.warn(
            f"attnres_kernels: no fused backend for {op} on {device.type} tensors{what} ({reasons}); "
            "using the plain-PyTorch reference",
            stacklevel=4,
        )
    return "reference"


def fused_op(backend: str, name: str, device: torch.device):
    """The ``torch.library`` op ``name`` (e.g. ``"depth_attn_fwd"``) of a fused backend on ``device`` tensors."""
    if backend == "cuda" and device.type == "cpu":
        return getattr(torch.ops.attnres_emu, name).default
    if backend in ("cpu", "cuda"):
        return getattr(torch.ops.attnres, name).default
    return getattr(triton_ops(), name).default


_triton_ops = None


def register_triton_ops_where_used() -> None:
    """Registers the Triton ops now where ``"auto"`` picks them (a CUDA device) or the interpreter was
    asked for (``TRITON_INTERPRET=1``), rather than on first use: a model compiled before its first
    eager call would meet that registration (imports, library definitions) inside the code
    ``torch.compile`` traces, which it cannot trace."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
        return
    from .. import triton as triton_backend

    if triton_backend.IMPORT_ERROR is None:
        triton_ops()


def _has_cpp_autograd(op: str) -> bool:
    """Whether the C++ extension registered the autograd of ``op`` (csrc/autograd serves the
    Triton ops it knows, as it serves the native ones: without Python on the autograd path)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "Autograd")


def triton_ops():
    """``torch.ops.attnres_triton``: the Triton ops, defined on first use by importing
    :mod:`attnres_kernels.triton.library` (which loads Triton), with their fake kernels and
    autograd registered here, once."""
    global _triton_ops
    if _triton_ops is None:
        from ..triton import library  # noqa: F401  (defines the attnres_triton ops)
        from . import _registration as reg

        namespace = torch.ops.attnres_triton
        # Each op family: its fake kernels, and its autograd in Python only when the C++ extension
        # (which registers it for these ops too) is not loaded.
        for family, register_fakes, register_ops in (
            ("depth_attn", reg.register_depth_attn_fakes, reg.register_depth_attn_ops),
            ("attn", reg.register_attention_fakes, reg.register_attention_ops),
            ("block_step", reg.register_block_step_fakes, reg.register_block_step_ops),
        ):
            fwd, bwd = f"attnres_triton::{family}_fwd", f"attnres_triton::{family}_bwd"
            if _has_cpp_autograd(fwd):
                register_fakes(fwd, bwd)
            else:
                register_ops(fwd, bwd, getattr(namespace, f"{family}_bwd").default)
        _triton_ops = namespace
    return _triton_ops
