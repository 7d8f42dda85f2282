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

from . import nn, reference
from .ops import (
    BACKENDS,
    BackendUnavailableError,
    attention,
    available_backends,
    block_step,
    depth_attention,
    depth_attention_merge,
)
from .ops._dispatch import register_triton_ops_where_used
from .ops._native import build_info

register_triton_ops_where_used()

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
