"""Triton backend of the depth read (the GPU path; runs on CPU under TRITON_INTERPRET=1).

Importing this package never fails: when Triton is missing, ``IMPORT_ERROR``
holds the reason and the dispatcher reports it if the backend is asked for.
"""

from __future__ import annotations

import os

import torch

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
