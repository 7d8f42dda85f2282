"""Drop-in modules backed by the fused depth-attention kernels."""

from .models import BlockAttnResTransformer, FullAttnResTransformer, StandardTransformer
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState

__all__ = [
    "DepthAttentionSite",
    "FullAttnResState",
    "BlockAttnResState",
    "StandardTransformer",
    "FullAttnResTransformer",
    "BlockAttnResTransformer",
]
