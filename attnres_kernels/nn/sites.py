"""Building blocks for putting AttnRes into your own model.

- :class:`DepthAttentionSite`: one depth read with its own pseudo-query
  (zeros) and key-norm weight (ones), optionally fusing the sublayer's PreNorm;
  options for the released variants (several queries, unweighted key norm,
  ``scale``, normalised values, ``out_dtype``: DESIGN.md §2.7).
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
from .._validation import check_read_options


class DepthAttentionSite(nn.Module):
    """A depth-attention read (DESIGN.md §2.1, §2.7) as a module, for models and for people
    writing their own layers.

    Parameters: ``query`` (``w``, zeros: at init the read is the mean of its sources),
    ``[D]`` for one query (``num_queries=1``), ``[num_queries, D]`` for several over the same
    sources (Inkling2's full-attention layers read 3: q, k and v inputs), the shapes Inkling2's
    ``Inkling2BlockAttentionResidual(config, num_queries)`` gives its ``query``;
    ``norm_weight`` (``γ``, ones, the query's shape), or None with ``key_norm_weight=False`` (an
    unweighted key norm). Names match the reference
    :class:`attnres_kernels.reference.models.DepthSite` for the defaults, and Inkling2's module
    for the unweighted form, so each one's state dict loads into the other.

    The read's options (see :func:`attnres_kernels.depth_attention`): ``scale`` multiplies the
    logits, ``normalize_values`` makes the values the normalised sources, ``eps`` is the key
    norm's epsilon, ``out_dtype`` the output dtype. The paper's read is the default; Inkling2's
    is ``DepthAttentionSite(d, num_queries=q, key_norm_weight=False, scale=d**-0.5,
    normalize_values=True, out_dtype=torch.float32)`` with Inkling2's ``q``.
    """

    def __init__(
        self,
        d_model: int,
        eps: float = 1e-6,
        backend: str = "auto",
        *,
        num_queries: int = 1,
        key_norm_weight: bool = True,
        scale: float = 1.0,
        normalize_values: bool = False,
        out_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if backend not in ops.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {ops.BACKENDS}")
        if isinstance(num_queries, bool) or not (isinstance(num_queries, int) and num_queries >= 1):
            raise ValueError(f"`num_queries` must be a positive int, got {num_queries!r}")
        check_read_options(eps, scale=scale, normalize_values=normalize_values, out_dtype=out_dtype)
        self.eps, self.backend = eps, backend
        self.scale, self.normalize_values, self.out_dtype = scale, normalize_values, out_dtype
        shape = (d_model,) if num_queries == 1 else (num_queries, d_model)
        self.query = nn.Parameter(torch.zeros(shape))
        self.norm_weight = nn.Parameter(torch.ones(shape)) if key_norm_weight else None

    def forward(
        self,
        sources,
        partial: Tensor | None = None,
        *,
        out_norm_weight: Tensor | None = None,
        out_norm_eps: float | None = None,
        return_weights: bool = False,
    ):
        """The read over ``sources`` (a list of ``[..., D]`` tensors, or the blocks stacked as one
        ``[..., n, D]`` tensor, Inkling2's ``block_states``, read in place through its per-block
        views), followed by ``partial`` when given.

        Returns ``h`` (or ``rmsnorm(h, out_norm_eps) * out_norm_weight``) for one query, a tuple of
        one output per query for several; with ``return_weights`` also the weights ``[N, ...]``
        (``[Q, N, ...]``)."""
        sources = list(sources.unbind(-2) if isinstance(sources, Tensor) else sources)
        if partial is not None:
            sources.append(partial)
        result = ops.depth_attention(
            self.query,
            sources,
            self.norm_weight,
            scale=self.scale,
            normalize_values=self.normalize_values,
            eps=self.eps,
            out_norm_weight=out_norm_weight,
            out_norm_eps=out_norm_eps,
            out_dtype=self.out_dtype,
            return_weights=return_weights,
            backend=self.backend,
        )
        if self.query.dim() == 1:
            return result
        if return_weights:
            out, weights = result
            return out.unbind(0), weights
        return result.unbind(0)

    def extra_repr(self) -> str:
        num_queries = 1 if self.query.dim() == 1 else self.query.shape[0]
        return (
            f"d_model={self.query.shape[-1]}, num_queries={num_queries}, "
            f"key_norm_weight={self.norm_weight is not None}, scale={self.scale}, "
            f"normalize_values={self.normalize_values}, eps={self.eps}, backend={self.backend!r}"
        )


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
