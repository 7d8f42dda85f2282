"""Public functional API: one module per op family over one shared dispatch module.

- :mod:`.depth_attention`: the depth read, :func:`depth_attention` and :func:`depth_attention_merge`;
- :mod:`.attention`: fused causal attention, :func:`attention`;
- :mod:`.block_step`: the fused Block residual step, :func:`block_step`;
- :mod:`._dispatch`: backend names and selection (see its docstring for the rules);
- :mod:`._registration`: fake kernels and autograd shared by the fused backends;
- :mod:`._sharding`: the fused ops on DTensor arguments (tensor and sequence parallel).
"""

from . import _sharding  # noqa: F401  (DTensor rules of the fused ops: tensor / sequence parallel)
from ._dispatch import BACKENDS, BackendUnavailableError
from .attention import ATTENTION_BACKENDS, attention
from .block_step import block_step
from .depth_attention import available_backends, depth_attention, depth_attention_merge, resolve_backend

__all__ = [
    "ATTENTION_BACKENDS",
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "available_backends",
    "block_step",
    "depth_attention",
    "depth_attention_merge",
    "resolve_backend",
]
