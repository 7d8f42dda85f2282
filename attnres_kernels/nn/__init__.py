"""Drop-in modules backed by the fused kernels: sites, layers that own their depth
reads, the Full/Block depth states and the Standard, Full and Block AttnRes models."""

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
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState

__all__ = [
    "DEFAULT_BLOCK_SCHEDULE",
    "DEFAULT_CHUNK_SIZE",
    "BlockAttnResLayer",
    "BlockAttnResState",
    "BlockAttnResTransformer",
    "CausalSelfAttention",
    "DepthAttentionSite",
    "FullAttnResLayer",
    "FullAttnResState",
    "FullAttnResTransformer",
    "RMSNorm",
    "ShardedSiteError",
    "StandardLayer",
    "StandardTransformer",
]
