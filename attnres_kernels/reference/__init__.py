"""Plain-PyTorch oracles: the depth read, its merge, attention, the Block step, and the three models."""

from .models import BlockAttnResTransformer, FullAttnResTransformer, StandardTransformer
from .ops import attention, block_step, depth_attention, depth_attention_merge

__all__ = [
    "depth_attention",
    "depth_attention_merge",
    "attention",
    "block_step",
    "StandardTransformer",
    "FullAttnResTransformer",
    "BlockAttnResTransformer",
]
