"""attnres_kernels: fused kernels for Attention Residuals (AttnRes).

- :func:`depth_attention` / :func:`depth_attention_merge`: the depth read of
  DESIGN.md §2.1 (single or multi-query, fused output RMSNorm, lse, weights,
  merge of partial reads) on the C++ CPU kernels, Triton, CUDA, or the reference.
- :func:`attention`: fused attention with causal / key-padding masks and GQA (§2.4).
- :func:`block_step`: the fused residual step of two-phase Block AttnRes (§2.3).
- :mod:`attnres_kernels.nn`: sites, layers, Full/Block depth state and the
  Standard, Full and Block AttnRes models.
- :mod:`attnres_kernels.reference`: the plain-PyTorch oracles.
"""

import os

import torch

from . import _backends, nn, reference
from ._native import build_info
from .ops import (
    BACKENDS,
    BackendUnavailableError,
    attention,
    available_backends,
    block_step,
    depth_attention,
    depth_attention_merge,
)

# The fused backends: each registers itself with the op layer when its package is imported
# (attnres_kernels._backends), on first use.
_backends.locate("cpu", f"{__name__}._native")
_backends.locate("cuda", f"{__name__}.cuda")
_backends.locate("triton", f"{__name__}.triton.backend")


def _define_triton_ops_where_used() -> None:
    """Defines the Triton ops now where ``"auto"`` picks them (a CUDA device) or the interpreter was
    asked for (``TRITON_INTERPRET=1``), rather than on first use: a model compiled before its first
    eager call would meet their definition (imports, library definitions) inside the code
    ``torch.compile`` traces, which it cannot trace. Elsewhere Triton is not imported (about a second)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
        return
    from . import triton

    if triton.IMPORT_ERROR is None:
        from .triton.backend import define_ops

        define_ops()


_define_triton_ops_where_used()

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "available_backends",
    "block_step",
    "build_info",
    "depth_attention",
    "depth_attention_merge",
    "nn",
    "reference",
]
