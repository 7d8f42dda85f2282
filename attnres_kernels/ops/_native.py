"""The C++ ops of ``attnres_kernels._C`` (CPU now; CUDA when built with nvcc).

Importing this module loads the extension if it was built. The package works
without the extension (reference backend only); asking for a native backend
then raises :class:`~attnres_kernels.ops.BackendUnavailableError` with the reason.
The fake kernels and autograd of the ops are registered by the op-family
modules (:mod:`attnres_kernels.ops.depth_attention`, ...).
"""

from __future__ import annotations

import torch

try:
    from .. import _C  # noqa: F401  (loading the library runs TORCH_LIBRARY)

    LOAD_ERROR = None
except ImportError as exc:  # not built, or built against another torch
    LOAD_ERROR = exc


def available() -> bool:
    return LOAD_ERROR is None


# Names of the attnres:: ops the extension defines, and (op name, device type)
# of every kernel it registered: read once so that dispatch decisions stay
# traceable by torch.compile.
OPS = (
    frozenset(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("attnres::"))
    if LOAD_ERROR is None
    else frozenset()
)
KERNELS = frozenset(
    (name, device_type)
    for name in OPS
    for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))
    if torch._C._dispatch_has_kernel_for_dispatch_key(f"attnres::{name}", key)
)


def defines(op: str) -> bool:
    """Whether the extension defines the op ``attnres::<op>`` (with kernels or not)."""
    return op in OPS


def has_kernel(op: str, device_type: str) -> bool:
    """Whether the extension registered a ``device_type`` kernel of ``attnres::<op>``."""
    return (op, device_type) in KERNELS


def build_info() -> str:
    """What the extension was built with: its CPU vector ISA, and whether it has CUDA kernels."""
    if LOAD_ERROR is not None:
        return f"C++ extension not loaded: {LOAD_ERROR}"
    cuda = "registered" if any(device == "cuda" for _, device in KERNELS) else "not built"
    return f"{torch.ops.attnres.build_info()}; CUDA kernels: {cuda}"
