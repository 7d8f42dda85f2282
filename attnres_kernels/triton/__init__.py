"""Triton backend of the depth read (the GPU path; runs on CPU under TRITON_INTERPRET=1).

Importing this package never fails: when Triton is missing, ``IMPORT_ERROR``
holds the reason and the dispatcher reports it if the backend is asked for.
Importing it registers the ``"triton"`` backend (:mod:`attnres_kernels._backends`);
its ops are defined on first use (:func:`define_ops`).
"""

from __future__ import annotations

import os

import torch

from .. import _backends

try:
    import triton  # noqa: F401

    IMPORT_ERROR = None
except ImportError as exc:
    IMPORT_ERROR = exc

# Kernels are decorated at import time; the interpreter must be chosen before that.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Widest row the kernels keep in registers (one program holds a whole row).
# fp64 rows take two registers per element, and the mixed-dtype backward keeps
# one typed pointer per source slot: at D = 4096 its fp64 kernel spills, so fp64
# rows are a quarter as wide (see python -m attnres_kernels.triton.check).
MAX_DIM = 8192


def max_dim(dtype: torch.dtype) -> int:
    return MAX_DIM // 4 if dtype == torch.float64 else MAX_DIM


# Host-side integer helpers of the launchers: triton.cdiv and triton.next_power_of_2 are
# ConstexprFunctions, ~3 µs per call from Python, paid on every launch.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def _unavailable_reason(device: torch.device, op: str) -> str | None:
    if IMPORT_ERROR is not None:
        return f"Triton is not importable ({IMPORT_ERROR})"
    if device.type == "cpu" and not INTERPRETING:
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1 (set before Triton is imported)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type} tensors"
    return None


_ops = None


def define_ops():
    """``torch.ops.attnres_triton``: the Triton ops, defined on first use by importing :mod:`.library`
    (which loads Triton's kernels; the op layer then registers their fake kernels and autograd)."""
    global _ops
    if _ops is None:
        from . import library  # noqa: F401

        _ops = torch.ops.attnres_triton
    return _ops


_backends.register("triton", _backends.Backend("Triton", _unavailable_reason, lambda device: define_ops(), max_dim))
