"""Kernel-backed decoder LMs: the models of :mod:`attnres_kernels.reference.models`
with the same module tree (state dicts load both ways with ``strict=True``),
running every depth read through :func:`attnres_kernels.depth_attention` with
the sublayer's PreNorm fused into the read, and attention through
``scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..reference import models as ref
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState


class RMSNorm(ref.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class CausalSelfAttention(ref.CausalSelfAttention):
    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _FusedLM(ref._DecoderLM):
    site_cls = DepthAttentionSite
    attention_cls = CausalSelfAttention
    norm_cls = RMSNorm

    def _set_backend(self, backend: str) -> None:
        if backend not in ops.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {ops.BACKENDS}")
        self.backend = backend
        for module in self.modules():
            if isinstance(module, DepthAttentionSite):
                module.backend = backend


class StandardTransformer(_FusedLM):
    """``h = h + attn(norm(h)); h = h + mlp(norm(h))``; ``backend`` is accepted
    for a uniform constructor (the standard model has no depth reads)."""

    site_cls = None

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, eps: float = 1e-6, backend: str = "auto"
    ):
        super().__init__(vocab_size, d_model, n_layers, n_heads, eps=eps)
        self._set_backend(backend)

    forward = ref.StandardTransformer.forward


class _AttnResLM(_FusedLM):
    def _initial_state(self, embedding: Tensor):
        raise NotImplementedError

    def forward(self, idx: Tensor, return_depth_weights: bool = False):
        """Logits ``[B, T, vocab]``; with ``return_depth_weights`` also the list
        (site order: attn, mlp per layer, then the output site) of ``[n_sources, B, T]`` weights."""
        state = self._initial_state(self.embed(idx))
        weights = []

        def read(site, norm):
            result = site(state.sources, out_norm_weight=norm.weight, return_weights=return_depth_weights)
            if return_depth_weights:
                weights.append(result[1])
                return result[0]
            return result

        for i, layer in enumerate(self.layers):
            state.begin_layer(i)
            for site, norm, f in layer.sublayers():
                state.add(f(read(site, norm)))
        logits = self.head(read(self.out_site, self.final_norm))
        return (logits, weights) if return_depth_weights else logits


class FullAttnResTransformer(_AttnResLM):
    """Full AttnRes: every sublayer output is a source of every later read."""

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, eps: float = 1e-6, backend: str = "auto"
    ):
        super().__init__(vocab_size, d_model, n_layers, n_heads, eps=eps)
        self._set_backend(backend)

    def _initial_state(self, embedding: Tensor) -> FullAttnResState:
        return FullAttnResState(embedding)


class BlockAttnResTransformer(_AttnResLM):
    """Block AttnRes: reads over committed blocks of ``layers_per_block`` layers plus the partial sum."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        layers_per_block: int,
        eps: float = 1e-6,
        backend: str = "auto",
    ):
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        super().__init__(vocab_size, d_model, n_layers, n_heads, eps=eps)
        self.layers_per_block = layers_per_block
        self._set_backend(backend)

    def _initial_state(self, embedding: Tensor) -> BlockAttnResState:
        return BlockAttnResState(embedding, self.layers_per_block)
