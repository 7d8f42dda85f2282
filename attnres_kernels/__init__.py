"""attnres_kernels: fused kernels for Attention Residuals (AttnRes).

- :func:`depth_attention` / :func:`depth_attention_merge`: the depth read of
  DESIGN.md §2.1 (single or multi-query, fused output RMSNorm, lse, weights,
  merge of partial reads) on the C++ CPU kernels, Triton, or the reference.
- :mod:`attnres_kernels.nn`: sites, source-state helpers and the Standard,
  Full and Block AttnRes models.
- :mod:`attnres_kernels.reference`: the plain-PyTorch oracles.
"""

from . import nn, reference
from .ops import BACKENDS, BackendUnavailableError, available_backends, depth_attention, depth_attention_merge
from .ops._native import build_info

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "available_backends",
    "build_info",
    "depth_attention",
    "depth_attention_merge",
    "nn",
    "reference",
]
