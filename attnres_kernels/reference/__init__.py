"""Plain-PyTorch oracles: the depth read, its merge, causal attention, and the three models."""

from .models import BlockAttnResTransformer, FullAttnResTransformer, StandardTransformer
from .ops import causal_attention, depth_attention, depth_attention_merge

__all__ = [
    "depth_attention",
    "depth_attention_merge",
    "causal_attention",
    "StandardTransformer",
    "FullAttnResTransformer",
    "BlockAttnResTransformer",
]
