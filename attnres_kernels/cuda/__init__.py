"""The C++/CUDA backend (``backend="cuda"``): kernels in ``csrc/cuda/``.

On CUDA tensors it runs the nvcc build inside ``attnres_kernels._C`` (the
``attnres::`` ops' CUDA kernels). On CPU tensors, with ``ATTNRES_CUDA_EMULATE=1``,
the very same kernel code runs under the SIMT harness (:mod:`.emulation`).
"""

from __future__ import annotations

import torch

# Widest row the CUDA depth-read kernels hold (kMaxDim of csrc/cuda/depth_attention_kernels.cuh).
MAX_DIM = 4096


def max_dim(dtype: torch.dtype) -> int:
    """Widest row a read whose output dtype is ``dtype`` can have (the same for every dtype)."""
    return MAX_DIM
