"""The C++ ops of ``attnres_kernels._C`` (CPU now; CUDA when built with nvcc).

Importing this module loads the extension if it was built and registers the
fake kernels and autograd of ``attnres::depth_attn_fwd``. The package works
without the extension (reference backend only); asking for a native backend
then raises :class:`BackendUnavailableError` with the reason.
"""

from __future__ import annotations

import torch

from ._registration import register_depth_attn_ops

try:
    from .. import _C  # noqa: F401  (loading the library runs TORCH_LIBRARY)

    LOAD_ERROR = None
except ImportError as exc:  # not built, or built against another torch
    LOAD_ERROR = exc

if LOAD_ERROR is None:
    register_depth_attn_ops(
        "attnres::depth_attn_fwd", "attnres::depth_attn_bwd", torch.ops.attnres.depth_attn_bwd.default
    )


def available() -> bool:
    return LOAD_ERROR is None


# Device types the extension registered depth-read kernels for (read once, so
# that dispatch stays traceable by torch.compile).
KERNEL_DEVICE_TYPES = frozenset(
    device_type
    for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))
    if LOAD_ERROR is None and torch._C._dispatch_has_kernel_for_dispatch_key("attnres::depth_attn_fwd", key)
)


def has_kernel_for(device_type: str) -> bool:
    """Whether the extension registered a kernel of the depth read for this device type."""
    return device_type in KERNEL_DEVICE_TYPES


def build_info() -> str:
    if LOAD_ERROR is not None:
        return f"C++ extension not loaded: {LOAD_ERROR}"
    return torch.ops.attnres.build_info()


def fwd_op():
    return torch.ops.attnres.depth_attn_fwd.default
