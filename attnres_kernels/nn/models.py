"""Kernel-backed decoder LMs: the models of :mod:`attnres_kernels.reference.models`
with the same module tree (state dicts load both ways with ``strict=True``).

Each layer runs its own depth reads (:mod:`attnres_kernels.nn.layers`) through
the fused depth-read op with the sublayer's PreNorm fused into the read, and
attention through :func:`attnres_kernels.attention` on ``attention_backend`` (``"auto"``:
our kernels on CPU, PyTorch's SDPA on CUDA where it is faster; ``"sdpa"`` always). The
forward is split so that a pipeline stage can run any slice of it::

    state = model.initial_state(model.embed(idx))     # FullAttnResState / BlockAttnResState / a tensor
    for layer in model.layers:
        state = layer(state)
    logits = model.logits(state)

Schedules of the depth reads (same results up to rounding, same parameters):

- Full AttnRes, ``chunk_size=C``: sites (the 2L sublayers, then the output
  site) in chunks of C; the first site of a chunk reads the sources committed
  before the chunk for every site of the chunk in one multi-query read
  (phase 1, ``(h, lse)`` per site) and each later site merges the chunk's own
  sources into its row (paper, Appendix B). ``chunk_size=1`` reads site by site.
- Block AttnRes, ``schedule="two_phase"`` (DESIGN.md §2.3) or ``"per_site"``.

FSDP2: ``for unit in model.shard_units(): fully_shard(unit)`` then
``fully_shard(model)``. The per-site schedules shard each layer on its own;
the multi-query schedules need the layers of a block (chunk) in one unit: the
unit's first layer reads the queries of all its sites (and, in the last unit,
those of the root's output site). The boundaries between units are also where
a pipeline can cut the stack, with the last unit on the stage of the head.

Inference: ``cache = model.new_cache(batch_size, max_len)``, then
``model(idx_chunk, cache=cache)`` appends a chunk (a prompt, or one token) and
returns its logits; ``model.generate(idx, max_new_tokens)`` prefills and decodes
with a cache. The cache holds each layer's attention keys and values only: depth
reads are per token (see :mod:`attnres_kernels.nn.cache`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from .. import ops
from . import layers as L
from .cache import DecodeCache
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState

# Defaults chosen by measuring train steps (benchmarks/model_steps.py, CPU, the demo
# config and d=256, L=12, T=128, B=4) with the kernels of the time: chunks of 4 sites
# were 7-11 % faster than site by site (8 similar, 2 half as much); the two-phase
# Block schedule was 3-7 % slower than per-site while its Block step ran unfused.
# Re-measure when the kernels change.
DEFAULT_CHUNK_SIZE = 4
DEFAULT_BLOCK_SCHEDULE = "per_site"

BLOCK_SCHEDULES = ("two_phase", "per_site")


class _DecoderLM(nn.Module):
    """Embedding → layers → (output site) → final norm → head, as the reference models."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        eps: float,
        backend: str,
        attention_backend: str,
        checkpoint: bool,
        make_layer,
        has_sites: bool,
    ):
        super().__init__()
        if backend not in ops.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {ops.BACKENDS}")
        if attention_backend not in L.ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; expected one of {L.ATTENTION_BACKENDS}")
        self.d_model, self.n_layers, self.eps = d_model, n_layers, eps
        self.backend, self.checkpoint = backend, checkpoint
        self.attention_backend = attention_backend
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(make_layer(attention_backend) for _ in range(n_layers))
        if has_sites:
            self.out_site = DepthAttentionSite(d_model, eps, backend)
        self.final_norm = L.RMSNorm(d_model, eps)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def run_layers(self, state, cache: DecodeCache | None = None, *, layers=None, **kwargs):
        """Runs every layer (or those of ``layers``, a pipeline stage's) on ``state``, recomputing
        each in backward with ``checkpoint=True``; with a decode ``cache``, appends the chunk to
        it (inference: no checkpointing)."""
        if cache is not None:
            for i, layer in enumerate(self.layers):
                state = layer(state, kv_cache=cache.layer(i), **kwargs)
            return state
        for layer in self.layers if layers is None else layers:
            if self.checkpoint and torch.is_grad_enabled():
                state = activation_checkpoint(layer, state, use_reentrant=False, **kwargs)
            else:
                state = layer(state, **kwargs)
        return state

    def new_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None) -> DecodeCache:
        """An empty decode cache for ``batch_size`` sequences of up to ``max_len`` tokens
        (keys and values of every layer). ``device`` defaults to the model's; ``dtype`` to
        the attention's compute dtype: the autocast dtype when called under autocast, else
        the model's."""
        attn = self.layers[0].attn
        device = torch.device(self.head.weight.device if device is None else device)
        if dtype is None:
            autocast = torch.is_autocast_enabled(device.type)
            dtype = torch.get_autocast_dtype(device.type) if autocast else self.head.weight.dtype
        return DecodeCache(
            self.n_layers, batch_size, max_len, attn.n_heads, self.d_model // attn.n_heads, dtype=dtype, device=device
        )

    def _check_cache(self, cache: DecodeCache, idx: Tensor) -> None:
        attn = self.layers[0].attn
        layout = (self.n_layers, attn.n_heads, self.d_model // attn.n_heads)
        n_layers, _, n_heads, _, head_dim = cache.keys.shape
        if (n_layers, n_heads, head_dim) != layout:
            raise ValueError(
                f"the cache holds {n_layers} layers x {n_heads} heads x head size {head_dim} but this model has "
                f"{layout[0]} x {layout[1]} x {layout[2]}; make it with this model's new_cache"
            )
        cache.check_chunk(idx)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continues the prompts ``idx [B, T]`` by ``max_new_tokens`` tokens: one prefill
        of the prompt into a fresh decode cache, then one token per forward. Greedy
        (argmax) at ``temperature=0``; otherwise samples from ``softmax(logits / temperature)``
        with ``generator``. Returns ``[B, T + max_new_tokens]`` (the prompt first)."""
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError(f"the prompt must be token ids [batch, T] with T >= 1, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        b, t = idx.shape
        tokens = idx.new_empty(b, t + max_new_tokens)
        tokens[:, :t] = idx
        if max_new_tokens == 0:
            return tokens
        # The last new token is never fed back, so the cache needs t + max_new_tokens - 1 positions.
        cache = self.new_cache(b, t + max_new_tokens - 1, device=idx.device)
        chunk = idx
        for i in range(t, t + max_new_tokens):
            logits = self(chunk, cache=cache)[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1)
            else:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            tokens[:, i] = next_token
            chunk = tokens[:, i : i + 1]
        return tokens

    def shard_units(self) -> list:
        """The groups of layers to shard together with FSDP2: ``fully_shard(unit)`` for
        each, then ``fully_shard(model)`` for the embedding, output site, final norm and head."""
        return [[layer] for layer in self.layers]

    def pipeline_stage(self, stage_index: int, num_stages: int, device, group=None, cuts=None, *, cache=True):
        """Stage ``stage_index`` of ``num_stages`` as a ``torch.distributed.pipelining.PipelineStage``
        (one stage per rank: ``ScheduleGPipe``, ``Schedule1F1B``); see
        :func:`attnres_kernels.nn.pipeline.pipeline_stages`."""
        from .pipeline import pipeline_stages

        return pipeline_stages(self, [stage_index], num_stages, device, group, cuts, cache=cache)[0]

    def pipeline_stages(self, stage_indices, num_stages: int, device, group=None, cuts=None, *, cache=True) -> list:
        """This rank's stages ``stage_indices`` of ``num_stages`` (several per rank for the
        interleaved schedules, stage ``s`` on rank ``s % group size``); see
        :func:`attnres_kernels.nn.pipeline.pipeline_stages`."""
        from .pipeline import pipeline_stages

        return pipeline_stages(self, stage_indices, num_stages, device, group, cuts, cache=cache)


class StandardTransformer(_DecoderLM):
    """``h = h + attn(norm(h)); h = h + mlp(norm(h))``. The standard model has no depth reads:
    ``backend`` is taken for the signature the AttnRes models share; attention runs on
    ``attention_backend``."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        eps: float = 1e-6,
        backend: str = "auto",
        attention_backend: str = "auto",
        checkpoint: bool = False,
    ):
        super().__init__(
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            eps=eps,
            backend=backend,
            attention_backend=attention_backend,
            checkpoint=checkpoint,
            make_layer=lambda attention: L.StandardLayer(d_model, n_heads, eps, attention),
            has_sites=False,
        )

    def initial_state(self, embedding: Tensor) -> Tensor:
        return embedding

    def logits(self, h: Tensor) -> Tensor:
        return self.head(self.final_norm(h))

    def forward(self, idx: Tensor, return_depth_weights: bool = False, *, cache: DecodeCache | None = None) -> Tensor:
        """Logits ``[B, T, vocab]``; with a decode ``cache`` (:meth:`new_cache`), ``idx``
        is the next chunk of the cached sequences and is appended to the cache."""
        if return_depth_weights:
            raise ValueError("StandardTransformer has no depth attention, so no depth weights")
        if cache is not None:
            self._check_cache(cache, idx)
        logits = self.logits(self.run_layers(self.initial_state(self.embed(idx)), cache))
        if cache is not None:
            cache.advance(idx.shape[1])
        return logits


class _AttnResLM(_DecoderLM):
    def backends(self, like: Tensor) -> L.Backends:
        """The backends a forward on sources like ``like`` runs (resolved once per forward)."""
        return L.resolve_backends(self.backend, like)

    def _site_names(self) -> list:
        """``(name, site)`` of every site in read order: attention, MLP per layer, then the output site."""
        names = [
            (f"layers.{i}.{s}", getattr(layer, s))
            for i, layer in enumerate(self.layers)
            for s in ("attn_site", "mlp_site")
        ]
        return names + [("out_site", self.out_site)]

    def forward(self, idx: Tensor, return_depth_weights: bool = False, *, cache: DecodeCache | None = None):
        """Logits ``[B, T, vocab]``; with ``return_depth_weights`` also the list (site
        order: attn, mlp per layer, then the output site) of ``[n_sources, B, T]``
        weights (that forward reads site by site). With a decode ``cache``
        (:meth:`new_cache`), ``idx`` is the next chunk of the cached sequences and is
        appended to the cache; the depth reads run on the chunk alone (they are per token)."""
        if cache is not None:
            self._check_cache(cache, idx)
        embedding = self.embed(idx)
        backends = self.backends(embedding)
        state = self.initial_state(embedding, record_weights=return_depth_weights)
        state = self.run_layers(state, cache, backends=backends)
        logits, weights = self._logits(state, backends)
        if cache is not None:
            cache.advance(idx.shape[1])
        return (logits, list(weights)) if return_depth_weights else logits

    def logits(self, state) -> Tensor:
        """The output site's read of the final state, then the final norm (fused) and the head."""
        return self._logits(state, self.backends(self._like(state)))[0]


class FullAttnResTransformer(_AttnResLM):
    """Full AttnRes: every sublayer output is a source of every later read.

    ``chunk_size``: sites per chunk of the chunked schedule (1: site by site;
    default :data:`DEFAULT_CHUNK_SIZE`); see :mod:`attnres_kernels.nn.models`."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        eps: float = 1e-6,
        backend: str = "auto",
        attention_backend: str = "auto",
        checkpoint: bool = False,
    ):
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        super().__init__(
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            eps=eps,
            backend=backend,
            attention_backend=attention_backend,
            checkpoint=checkpoint,
            make_layer=lambda attention: L.FullAttnResLayer(d_model, n_heads, eps, attention, backend),
            has_sites=True,
        )
        self.chunk_size = chunk_size
        plans = L.full_site_plans(self._site_names(), chunk_size)
        for i, layer in enumerate(self.layers):
            layer.configure(plans[2 * i], plans[2 * i + 1])
        self._out_plan = plans[-1]

    def initial_state(self, embedding: Tensor, *, record_weights: bool = False) -> FullAttnResState:
        return FullAttnResState.start(embedding, record_weights=record_weights)

    @staticmethod
    def _like(state: FullAttnResState) -> Tensor:
        return state.sources[0]

    def _logits(self, state: FullAttnResState, backends: L.Backends):
        h, state = L.full_site_input(backends, state, self._out_plan, self.out_site, self.final_norm.weight, self.eps)
        return self.head(h), state.weights

    def shard_units(self) -> list:
        """Layers whose sites share a chunk form one unit (each layer alone for ``chunk_size <= 2``)."""
        units = []
        for i, layer in enumerate(self.layers):
            # Layer i joins layer i - 1's unit when its attention site (2i) is not the first of a chunk.
            if i > 0 and (2 * i) % self.chunk_size != 0:
                units[-1].append(layer)
            else:
                units.append([layer])
        return units

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, backend={self.backend!r}, checkpoint={self.checkpoint}"


class BlockAttnResTransformer(_AttnResLM):
    """Block AttnRes: reads over committed blocks of ``layers_per_block`` layers plus the partial sum.

    ``schedule``: ``"two_phase"`` (one multi-query read of the committed blocks per
    block, then the fused Block step per site) or ``"per_site"`` (default:
    :data:`DEFAULT_BLOCK_SCHEDULE`)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        *,
        layers_per_block: int,
        schedule: str = DEFAULT_BLOCK_SCHEDULE,
        eps: float = 1e-6,
        backend: str = "auto",
        attention_backend: str = "auto",
        checkpoint: bool = False,
    ):
        if layers_per_block < 1:
            raise ValueError(f"layers_per_block must be >= 1, got {layers_per_block}")
        if schedule not in BLOCK_SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {BLOCK_SCHEDULES}")
        super().__init__(
            vocab_size,
            d_model,
            n_layers,
            n_heads,
            eps=eps,
            backend=backend,
            attention_backend=attention_backend,
            checkpoint=checkpoint,
            make_layer=lambda attention: L.BlockAttnResLayer(d_model, n_heads, eps, attention, backend),
            has_sites=True,
        )
        self.layers_per_block, self.schedule = layers_per_block, schedule
        sites = self._site_names()
        for i, layer in enumerate(self.layers):
            start = i - i % layers_per_block
            end = min(start + layers_per_block, n_layers)
            group = None
            if i == start:  # the block's sites, and the output site when the block is the last
                group = tuple(sites[2 * start : 2 * end + (1 if end == n_layers else 0)])
            layer.configure(i == start, 2 * (i - start), group, schedule == "two_phase")
        self._out_row = 2 * (n_layers - (n_layers - 1) // layers_per_block * layers_per_block)

    def initial_state(self, embedding: Tensor, *, record_weights: bool = False) -> BlockAttnResState:
        return BlockAttnResState.start(embedding, record_weights=record_weights)

    @staticmethod
    def _like(state: BlockAttnResState) -> Tensor:
        return state.blocks[0]

    def _logits(self, state: BlockAttnResState, backends: L.Backends):
        norm_weight = self.final_norm.weight
        if state.prefix_out is None:  # per-site schedule
            h, weights = L.site_read(backends, state.sources, self.out_site, norm_weight, self.eps, state.weights)
            return self.head(h), weights
        prefix = (state.prefix_out[self._out_row], state.prefix_lse[self._out_row])
        _, h = L.phase2_step(backends, state.partial, state.pending, self.out_site, prefix, norm_weight, self.eps)
        return self.head(h), None

    def shard_units(self) -> list:
        """Two-phase: the layers of each block form one unit; per-site: each layer alone."""
        if self.schedule == "per_site":
            return super().shard_units()
        s = self.layers_per_block
        return [list(self.layers[i : i + s]) for i in range(0, self.n_layers, s)]

    def extra_repr(self) -> str:
        return (
            f"layers_per_block={self.layers_per_block}, schedule={self.schedule!r}, backend={self.backend!r}, "
            f"checkpoint={self.checkpoint}"
        )
