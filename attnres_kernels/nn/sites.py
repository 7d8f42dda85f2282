"""Building blocks for putting AttnRes into your own model.

- :class:`DepthAttentionSite`: one depth read with its own pseudo-query
  (zeros) and key-norm weight (ones), optionally fusing the sublayer's PreNorm.
- :class:`FullAttnResState` / :class:`BlockAttnResState`: the depth state that
  crosses a layer boundary (every sublayer output for Full; committed blocks
  plus the running partial sum for Block). They are named tuples of tensors
  (a pytree), immutable: each step returns a new state.

A model's forward then reads::

    state = BlockAttnResState.start(embedding)
    for i, layer in enumerate(layers):
        if i % layers_per_block == 0:
            state = state.commit()
        state = state.add(attn(attn_site(state.sources, out_norm_weight=attn_norm.weight)))
        state = state.add(mlp(mlp_site(state.sources, out_norm_weight=mlp_norm.weight)))
    h = out_site(state.sources)

The models of :mod:`attnres_kernels.nn.models` keep the same states but run
each layer's reads inside the layer (see :mod:`attnres_kernels.nn.layers`),
with the multi-query schedules filling the ``prefix_*`` fields.
"""

from __future__ import annotations

from typing import NamedTuple

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


class FullAttnResState(NamedTuple):
    """The depth state of Full AttnRes between two layers.

    - ``sources``: the embedding, then every sublayer output so far, each
      ``[..., D]``; site k (0-based over the sublayers) reads ``sources[:k + 1]``.
    - ``prefix_out`` / ``prefix_lse``: chunked schedule only, the phase-1 read of
      the current chunk's C sites over the sources committed before the chunk:
      tuples of C tensors ``[..., D]`` / ``[...]`` (accumulation dtype), entry r
      for the chunk's r-th site; None outside the chunked schedule. A chunk that spans a layer
      boundary carries them across it.
    - ``weights``: ``None``, or (when depth weights were asked for) the weights
      ``[n_sources, ...]`` of every site read so far.
    """

    sources: tuple
    prefix_out: tuple | None = None
    prefix_lse: tuple | None = None
    weights: tuple | None = None

    @classmethod
    def start(cls, embedding: Tensor, *, record_weights: bool = False) -> FullAttnResState:
        return cls((embedding,), weights=() if record_weights else None)

    def add(self, output: Tensor) -> FullAttnResState:
        """The state after a sublayer output ``output`` (a new source)."""
        return self._replace(sources=self.sources + (output,))


class BlockAttnResState(NamedTuple):
    """The depth state of Block AttnRes between two layers.

    - ``blocks``: the committed blocks, each ``[..., D]``: block 0 is the
      embedding, block b the sum of the sublayer outputs of the b-th block of layers.
    - ``partial``: the running sum of the current block's sublayer outputs, or
      None right after a commit (no sublayer of the block has run yet).
    - ``pending``: two-phase schedule only, the last sublayer output, not yet
      added to ``partial`` (the next site's fused Block step adds it); None otherwise.
      The block's sum is ``partial + pending``.
    - ``prefix_out`` / ``prefix_lse``: two-phase schedule only, the phase-1 read
      of the current block's Q sites (attention, MLP per layer, then the output
      site if the block is the last) over ``blocks``: tuples of Q tensors
      ``[..., D]`` / ``[...]`` (accumulation dtype), one entry per site.
    - ``weights``: as in :class:`FullAttnResState`.

    Every site reads ``blocks`` plus the block's sum so far, when there is one.
    """

    blocks: tuple
    partial: Tensor | None
    pending: Tensor | None = None
    prefix_out: tuple | None = None
    prefix_lse: tuple | None = None
    weights: tuple | None = None

    @classmethod
    def start(cls, embedding: Tensor, *, record_weights: bool = False) -> BlockAttnResState:
        """Before layer 0: the embedding is the running sum, committed as block 0 by layer 0."""
        return cls((), embedding, weights=() if record_weights else None)

    def block_sum(self) -> Tensor | None:
        """The sum of the current block's outputs so far (``partial + pending``), or None."""
        if self.pending is None:
            return self.partial
        return self.pending if self.partial is None else self.partial + self.pending

    @property
    def sources(self) -> tuple:
        """What a site reads: the committed blocks plus the block's sum so far, if any."""
        total = self.block_sum()
        return self.blocks if total is None else self.blocks + (total,)

    def commit(self) -> BlockAttnResState:
        """Ends the current block: its sum becomes a committed block and the next starts empty."""
        return self._replace(blocks=self.sources, partial=None, pending=None, prefix_out=None, prefix_lse=None)

    def add(self, output: Tensor) -> BlockAttnResState:
        """The state after a sublayer output ``output`` (added to the running sum)."""
        total = self.block_sum()
        return self._replace(partial=output if total is None else total + output, pending=None)
