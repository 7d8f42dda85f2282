"""The C++/CUDA backend (``backend="cuda"``): kernels in ``csrc/cuda/``.

On CUDA tensors it runs the nvcc build inside ``attnres_kernels._C`` (the
``attnres::`` ops' CUDA kernels). On CPU tensors, with ``ATTNRES_CUDA_EMULATE=1``,
the very same kernel code runs under the SIMT harness (:mod:`.emulation`).
"""

from __future__ import annotations

import torch

from .. import _backends, _native

# Widest row the CUDA depth-read kernels hold (kMaxDim of csrc/cuda/depth_attention_kernels.cuh).
MAX_DIM = 4096


def max_dim(dtype: torch.dtype) -> int:
    """Widest row a read whose output dtype is ``dtype`` can have (the same for every dtype)."""
    return MAX_DIM


def _unavailable_reason(device: torch.device, op: str) -> str | None:
    if device.type == "cpu":
        from . import emulation  # builds the emulated kernels on first use

        reason = emulation.unavailable_reason(op)
        return None if reason is None else f"backend 'cuda' needs cuda tensors, got cpu tensors ({reason})"
    return _native.unavailable_reason("cuda", device, op)


def _ops(device: torch.device):
    return torch.ops.attnres_emu if device.type == "cpu" else torch.ops.attnres


_backends.register("cuda", _backends.Backend("CUDA", _unavailable_reason, _ops, max_dim))
