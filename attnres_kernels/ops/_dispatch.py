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
schema: ``attnres::<name>`` (C++: CPU and CUDA dispatch keys),
``attnres_triton::<name>`` (Triton) and ``attnres_emu::<name>`` (the emulated CUDA
kernels). :func:`fused_op` returns the one a backend runs. The backends register
themselves (:mod:`attnres_kernels._backends`): this module names them, asks them
why they cannot run a call, and imports none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .. import _backends

BACKENDS = ("auto", "reference", "cpu", "cuda", "triton")
# The backend names that run CPU tensors on the C++ kernels when the extension has them: the ops
# check these first, so that a small call (a decode step, a small read) skips the resolution.
CPU_KERNEL_BACKENDS = frozenset(("auto", "cpu"))

# What "auto" tries, in order, per device type.
AUTO_PREFERENCE = {"cpu": ("cpu",), "cuda": ("triton", "cuda")}


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run this call."""


Limit = Callable[[str], "str | None"]


def unavailable_reason(backend: str, device: torch.device, op: str, limit: Limit | None = None) -> str | None:
    """Why ``backend`` cannot run op ``op`` on ``device`` tensors, or None if it can.

    ``limit(backend)`` adds the op family's own limits for this call (widths,
    head sizes) and returns a reason or None."""
    if backend == "reference":
        return None
    reason = _backends.get(backend).unavailable_reason(device, op)
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
    return getattr(_backends.get(backend).ops(device), name).default
