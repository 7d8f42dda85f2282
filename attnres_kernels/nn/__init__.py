"""Drop-in modules backed by the fused kernels: sites, layers that own their depth
reads, the Full/Block depth states, the Standard, Full and Block AttnRes models, their
decode cache, their pipeline stages (:mod:`attnres_kernels.nn.pipeline`) and their
tensor-parallel plan (:mod:`attnres_kernels.nn.tensor_parallel`)."""

from .cache import DecodeCache, LayerKVCache
from .layers import (
    BlockAttnResLayer,
    CausalSelfAttention,
    FullAttnResLayer,
    RMSNorm,
    ShardedSiteError,
    StandardLayer,
)
from .models import (
    DEFAULT_BLOCK_SCHEDULE,
    DEFAULT_CHUNK_SIZE,
    BlockAttnResTransformer,
    FullAttnResTransformer,
    StandardTransformer,
)
from .pipeline import (
    balanced_cuts,
    boundary_layout,
    pack_boundary,
    pipeline_cuts,
    pipeline_stages,
    reusable_tensors,
    unpack_boundary,
)
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState

__all__ = [
    "DEFAULT_BLOCK_SCHEDULE",
    "DEFAULT_CHUNK_SIZE",
    "BlockAttnResLayer",
    "BlockAttnResState",
    "BlockAttnResTransformer",
    "CausalSelfAttention",
    "DecodeCache",
    "DepthAttentionSite",
    "FullAttnResLayer",
    "FullAttnResState",
    "FullAttnResTransformer",
    "LayerKVCache",
    "RMSNorm",
    "ShardedSiteError",
    "StandardLayer",
    "StandardTransformer",
    "balanced_cuts",
    "boundary_layout",
    "pack_boundary",
    "pipeline_cuts",
    "pipeline_stages",
    "reusable_tensors",
    "tensor_parallel_plan",
    "unpack_boundary",
]


def __getattr__(name: str):
    # tensor_parallel_plan on first use: its module imports torch.distributed.tensor (~1 s).
    if name == "tensor_parallel_plan":
        from .tensor_parallel import tensor_parallel_plan

        return tensor_parallel_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
