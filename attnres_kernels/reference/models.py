"""Plain-PyTorch decoder LMs with standard residuals, Full AttnRes and Block AttnRes.

These follow DESIGN.md §2.2 line by line and are the oracles for the
kernel-backed models in :mod:`attnres_kernels.nn` (same module names, so the
state dicts are interchangeable).

Each layer has two sublayers, attention then MLP, both PreNorm with RMSNorm:
causal multi-head self-attention with a fused QKV projection, no bias, no
positional encoding; MLP ``Linear(d, 4d) → GELU → Linear(4d, d)``, no bias.
In the AttnRes models every sublayer input is a depth read ("site") with its
own zero-initialized pseudo-query and its own key-norm weight (ones), and an
output site reads all sources before the final norm.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops import attention, depth_attention


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model = {d_model} is not divisible by n_heads = {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, causal=True)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v)  # [B, H, T, Dh]
        return self.proj(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.proj = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(nn.functional.gelu(self.fc(x)))


class DepthSite(nn.Module):
    """One depth-attention read: a pseudo-query (zeros) and a key RMSNorm weight (ones)."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm_weight = nn.Parameter(torch.ones(d_model))

    def forward(self, sources: list[Tensor]):
        """Returns ``(h, weights)`` with ``weights`` of shape ``[len(sources), ...]``."""
        return depth_attention(self.query, sources, self.norm_weight, eps=self.eps, return_weights=True)


class Layer(nn.Module):
    def __init__(self, model: _DecoderLM, d_model: int, n_heads: int, eps: float):
        super().__init__()
        self.attn_norm = model.norm_cls(d_model, eps)
        self.attn = model.attention_cls(d_model, n_heads)
        self.mlp_norm = model.norm_cls(d_model, eps)
        self.mlp = MLP(d_model)
        if model.site_cls is not None:
            self.attn_site = model.site_cls(d_model, eps)
            self.mlp_site = model.site_cls(d_model, eps)

    def sublayers(self):
        """(site, norm, function) for the attention then the MLP sublayer."""
        return (
            (getattr(self, "attn_site", None), self.attn_norm, self.attn),
            (getattr(self, "mlp_site", None), self.mlp_norm, self.mlp),
        )


class _DecoderLM(nn.Module):
    """Embedding → layers → (output site) → final norm → head.

    The component classes are attributes so that the kernel-backed models of
    :mod:`attnres_kernels.nn` build the same module tree (and state dict) from
    their own components."""

    site_cls = DepthSite
    attention_cls = CausalSelfAttention
    norm_cls = RMSNorm

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, eps: float = 1e-6):
        super().__init__()
        self.d_model, self.n_layers, self.eps = d_model, n_layers, eps
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Layer(self, d_model, n_heads, eps) for _ in range(n_layers))
        if self.site_cls is not None:
            self.out_site = self.site_cls(d_model, eps)
        self.final_norm = self.norm_cls(d_model, eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def _output(self, h: Tensor, weights: list | None, return_depth_weights: bool):
        logits = self.head(self.final_norm(h))
        return (logits, weights) if return_depth_weights else logits


class StandardTransformer(_DecoderLM):
    """``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""

    site_cls = None

    def forward(self, idx: Tensor, return_depth_weights: bool = False):
        if return_depth_weights:
            raise ValueError("StandardTransformer has no depth attention, so no depth weights")
        h = self.embed(idx)
        for layer in self.layers:
            h = h + layer.attn(layer.attn_norm(h))
            h = h + layer.mlp(layer.mlp_norm(h))
        return self._output(h, None, False)


class FullAttnResTransformer(_DecoderLM):
    """Every sublayer output is a source; site k (0-based over the 2L sublayers)
    reads k + 1 sources, the output site reads 2L + 1."""

    def forward(self, idx: Tensor, return_depth_weights: bool = False):
        sources = [self.embed(idx)]
        weights = []
        for layer in self.layers:
            for site, norm, f in layer.sublayers():
                x, w = site(sources)
                weights.append(w)
                sources.append(f(norm(x)))
        h, w = self.out_site(sources)
        weights.append(w)
        return self._output(h, weights, return_depth_weights)


class BlockAttnResTransformer(_DecoderLM):
    """Sums inside a block of ``layers_per_block`` layers, attends over block summaries.

    Before layer i with ``i % layers_per_block == 0`` the running partial sum is
    committed as a block (at i = 0 that commits the embedding as block 0). Each
    read sees the committed blocks plus the current partial sum, if any.
    """

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, *, layers_per_block: int, eps: float = 1e-6
    ):
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        super().__init__(vocab_size, d_model, n_layers, n_heads, eps=eps)
        self.layers_per_block = layers_per_block

    def forward(self, idx: Tensor, return_depth_weights: bool = False):
        blocks: list[Tensor] = []
        partial: Tensor | None = self.embed(idx)
        weights = []
        for i, layer in enumerate(self.layers):
            if i % self.layers_per_block == 0:
                blocks.append(partial)
                partial = None
            for site, norm, f in layer.sublayers():
                x, w = site(blocks + ([partial] if partial is not None else []))
                weights.append(w)
                y = f(norm(x))
                partial = y if partial is None else partial + y
        h, w = self.out_site(blocks + [partial])
        weights.append(w)
        return self._output(h, weights, return_depth_weights)
