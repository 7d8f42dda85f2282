"""Building blocks for putting AttnRes into your own model.

- :class:`DepthAttentionSite`: one depth read with its own pseudo-query
  (zeros) and key-norm weight (ones), optionally fusing the sublayer's PreNorm.
- :class:`FullAttnResState` / :class:`BlockAttnResState`: the sources a site
  reads, kept across a forward pass (every sublayer output for Full; committed
  blocks plus the running partial sum for Block).

A model's forward then reads::

    state = BlockAttnResState(embedding, layers_per_block=2)
    for i, layer in enumerate(layers):
        state.begin_layer(i)
        state.add(attn(attn_site(state.sources, out_norm_weight=attn_norm.weight)))
        state.add(mlp(mlp_site(state.sources, out_norm_weight=mlp_norm.weight)))
    h = out_site(state.sources)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import ops


class DepthAttentionSite(nn.Module):
    """A depth-attention read over a list of sources ``[..., D]``.

    Parameters ``query`` (``w``, zeros: at init the read is the mean of its
    sources) and ``norm_weight`` (``γ``, ones); names match the reference
    :class:`attnres_kernels.reference.models.DepthSite`.
    """

    def __init__(self, d_model: int, eps: float = 1e-6, backend: str = "auto"):
        super().__init__()
        if backend not in ops.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {ops.BACKENDS}")
        self.eps, self.backend = eps, backend
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm_weight = nn.Parameter(torch.ones(d_model))

    def forward(self, sources: list[Tensor], *, out_norm_weight: Tensor | None = None, return_weights: bool = False):
        """``h`` (or ``rmsnorm(h) * out_norm_weight``), plus the weights ``[N, ...]`` if asked."""
        return ops.depth_attention(
            self.query,
            sources,
            self.norm_weight,
            eps=self.eps,
            out_norm_weight=out_norm_weight,
            return_weights=return_weights,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"d_model={self.query.shape[0]}, eps={self.eps}, backend={self.backend!r}"


class FullAttnResState:
    """Full AttnRes: the embedding, then every sublayer output, is a source."""

    def __init__(self, embedding: Tensor):
        self._sources = [embedding]

    def begin_layer(self, index: int) -> None:
        """Full AttnRes has no block boundaries."""

    @property
    def sources(self) -> list[Tensor]:
        return list(self._sources)

    def add(self, output: Tensor) -> None:
        self._sources.append(output)


class BlockAttnResState:
    """Block AttnRes: committed block summaries plus the running partial sum.

    ``begin_layer(i)`` commits the partial sum as a block when
    ``i % layers_per_block == 0`` (at i = 0 that commits the embedding as block
    0); the next read then sees only the committed blocks, and the next
    sublayer output starts a fresh partial sum.
    """

    def __init__(self, embedding: Tensor, layers_per_block: int):
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        self.layers_per_block = layers_per_block
        self.blocks: list[Tensor] = []
        self.partial: Tensor | None = embedding

    def begin_layer(self, index: int) -> None:
        if index % self.layers_per_block == 0:
            self.blocks.append(self.partial)
            self.partial = None

    @property
    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add(self, output: Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output
