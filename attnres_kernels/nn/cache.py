"""The decode cache of the nn models: preallocated attention keys and values.

What crosses positions, and so what a cache must hold: every depth read is
per token (DESIGN.md §2.1: each row is independent), so a position's depth
state — Full AttnRes's bank of sources, Block AttnRes's committed blocks and
running partial, the phase-1 prefixes of the multi-query schedules — is built
from that position's own embedding inside the forward that processes it, and
no later position ever reads it. The only state that crosses positions is
causal self-attention's: the keys and values of every earlier position, per
layer. :class:`DecodeCache` holds exactly these, for all three models.

The buffers are allocated once for ``max_len`` positions; a forward writes its
chunk's keys and values in place at ``[length, length + T)`` and attends over
the views ``[0, length + T)`` (nothing is concatenated or re-stacked per step).
A chunk of T queries against the longer cache uses causal masking aligned
bottom-right (query i of the chunk sees keys ``j <= length + i``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LayerKVCache(NamedTuple):
    """One layer's slice of a :class:`DecodeCache` for one forward.

    ``keys`` / ``values``: the layer's buffers ``[B, H, max_len, Dh]``;
    ``start``: the number of positions cached before this forward."""

    keys: Tensor
    values: Tensor
    start: int

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Writes the chunk's ``k, v [B, H, T, Dh]`` at ``[start, start + T)``; returns
        the views of keys and values ``[B, H, start + T, Dh]`` (the cached positions, then the chunk)."""
        if k.dtype != self.keys.dtype:
            raise TypeError(
                f"the decode cache holds {self.keys.dtype} but the attention computes in {k.dtype}; "
                f"make the cache with model.new_cache(..., dtype={k.dtype})"
            )
        end = self.start + k.shape[2]
        self.keys[:, :, self.start : end].copy_(k)
        self.values[:, :, self.start : end].copy_(v)
        return self.keys[:, :, :end], self.values[:, :, :end]


class DecodeCache:
    """Keys and values of every attention layer for ``batch_size`` sequences of up to
    ``max_len`` positions (made by ``model.new_cache``; see the module docstring).

    ``model(idx_chunk, cache=cache)`` appends ``idx_chunk [batch_size, T]`` (a prompt
    or one token) and advances :attr:`length`; :meth:`reset` empties the cache for
    reuse. The cache is for inference: run it under ``torch.no_grad()``
    (``model.generate`` does); gradients through it are not supported."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.batch_size, self.max_len = batch_size, max_len
        shape = (n_layers, batch_size, n_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def reset(self) -> None:
        """Forgets every cached position (the buffers are kept)."""
        self.length = 0

    def check_chunk(self, idx: Tensor) -> None:
        """Raises a clear error if token ids ``idx`` cannot be appended."""
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError(f"a decode chunk must be token ids [batch, T] with T >= 1, got shape {tuple(idx.shape)}")
        if idx.shape[0] != self.batch_size:
            raise ValueError(f"the chunk has batch size {idx.shape[0]} but the cache was made for {self.batch_size}")
        if idx.device != self.keys.device:
            raise ValueError(f"the chunk is on {idx.device} but the cache is on {self.keys.device}")
        if self.length + idx.shape[1] > self.max_len:
            raise ValueError(
                f"the cache holds {self.length} of max_len = {self.max_len} positions; a chunk of "
                f"{idx.shape[1]} more does not fit (make the cache with a larger max_len)"
            )

    def advance(self, n: int) -> None:
        """Counts the ``n`` positions a forward has just written into every layer's buffers."""
        self.length += n

    def layer(self, i: int) -> LayerKVCache:
        """Layer ``i``'s view for the current forward."""
        return LayerKVCache(self.keys[i], self.values[i], self.length)

    def __repr__(self) -> str:
        n_layers, b, h, t, dh = self.keys.shape
        return (
            f"DecodeCache(length={self.length}, max_len={t}, batch_size={b}, n_layers={n_layers}, n_heads={h}, "
            f"head_dim={dh}, dtype={self.keys.dtype}, device={self.keys.device})"
        )
