"""The Triton backend as the op layer sees it (``backend="triton"``): importing this module registers it
(:mod:`attnres_kernels._backends`); its ops are defined on first use (:func:`define_ops`)."""

from __future__ import annotations

import torch

from .. import _backends
from .. import triton as package  # read at call time: IMPORT_ERROR, INTERPRETING


def _unavailable_reason(device: torch.device, op: str) -> str | None:
    if package.IMPORT_ERROR is not None:
        return f"Triton is not importable ({package.IMPORT_ERROR})"
    if device.type == "cpu" and not package.INTERPRETING:
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


_backends.register(
    "triton", _backends.Backend("Triton", _unavailable_reason, lambda device: define_ops(), package.max_dim)
)
