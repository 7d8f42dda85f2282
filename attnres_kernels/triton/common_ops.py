"""Launcher helpers shared by the op families' launchers (``*_ops.py``): the record of one launch for the
ahead-of-time check, a cast that skips the call when the dtype already matches, and the fixed-order column
sum of the backward kernels' partial rows."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import cdiv
from .depth_attention_kernels import column_sum_kernel

COLUMN_SUM_PARTS, COLUMN_SUM_COLS = 128, 32  # column_sum_kernel's tile: 32 fp32 columns = one 128-byte line


class AotLaunch(NamedTuple):
    """One kernel launch for the ahead-of-time check: the JIT function, its
    arguments (``MockTensor`` for pointers), constexprs and launch options."""

    name: str
    config: str
    kernel: object
    args: list
    constexprs: dict
    options: dict


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` has that dtype already (the usual fp32 parameters)."""
    return t if t.dtype is dtype else t.to(dtype)


def column_sum(part: torch.Tensor, out: torch.Tensor) -> None:
    """``out = part.sum(0)`` in a fixed order (see :func:`column_sum_kernel`); ``part`` is contiguous."""
    n_parts = part.shape[0]
    n_cols = part.numel() // n_parts
    column_sum_kernel[(cdiv(n_cols, COLUMN_SUM_COLS),)](
        part, out, n_parts, n_cols, BLOCK_PARTS=COLUMN_SUM_PARTS, BLOCK_COLS=COLUMN_SUM_COLS, num_warps=4
    )
