"""The op layer's interface to the package's own modules (:mod:`attnres_kernels.nn`), beside the public
API: the ops without their argument checks, for modules that guarantee the checks themselves and
resolve the backend once per forward; which backend runs a fused Block step; and the DTensor test of
the sharding rules. Not for users: it changes with the models.
"""

from __future__ import annotations

import torch

from .._when_imported import when_imported
from . import _dispatch
from ._sharding import is_dtensor
from .block_step import step_unchecked
from .depth_attention import read_unchecked

__all__ = ["is_dtensor", "read_unchecked", "fused_step_backend", "step_unchecked"]

_FUSED_STEP: dict = {}


def fused_step_backend(depth: str) -> str | None:
    """The backend of the fused Block step (:func:`attnres_kernels.block_step`) where the depth reads
    run on ``depth``: ``depth`` itself when it has a ``block_step_fwd`` kernel (on CPU or CUDA
    tensors; the reference always has one), else None. A constant of the process (kernels are
    registered when they load); torch.compile takes it as one."""
    if depth not in _FUSED_STEP:
        defined = any(
            _dispatch.unavailable_reason(depth, torch.device(device_type), "block_step_fwd") is None
            for device_type in ("cpu", "cuda")
        )
        _FUSED_STEP[depth] = depth if defined else None
    return _FUSED_STEP[depth]


# torch.compile takes it as a constant (torch.compiler.assume_constant_result), marked once
# torch._dynamo is imported: importing it here only to mark the function cost ~1 s.
when_imported("torch._dynamo", lambda _: torch.compiler.assume_constant_result(fused_step_backend))
