"""Transformer layers that own their depth reads (DESIGN.md §3).

Everything a layer's parameters take part in — its attention and MLP
sublayers with their PreNorms and its two depth-read sites — runs inside the
layer's ``forward``, which takes and returns the depth state
(:class:`~attnres_kernels.nn.sites.FullAttnResState` /
:class:`~attnres_kernels.nn.sites.BlockAttnResState`; a plain hidden state for
the standard layer). Wrapping each layer with FSDP2's ``fully_shard(layer)`` or
cutting the stack into pipeline stages therefore works as for any Transformer.
For incremental decoding a layer's ``forward`` also takes its slice of the
model's decode cache (``kv_cache``, :class:`~attnres_kernels.nn.cache.LayerKVCache`):
the attention appends the chunk's keys and values and attends over the cache;
the depth reads are per token and need nothing cached.

The multi-query schedules are the exception by design: the phase-1 read of a
Block (or of a Full chunk) stacks the pseudo-queries of *every* site of the
block and runs inside the forward of the block's first layer, so the block's
layers must be one FSDP unit (``fully_shard([layer, ...])``, see the models'
``shard_units()``); reading a site whose parameters are still sharded raises
:class:`ShardedSiteError` instead of failing inside the op.

Each layer's reads run through :func:`attnres_kernels.ops.depth_attention.read_unchecked`:
the models guarantee what the public op validates (same-shape sources on one
device, ``[D]`` site parameters) and resolve the backends once per forward
(:func:`resolve_backends`), so a read costs one op call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from .._validation import ReadOptions
from .._when_imported import when_imported
from ..ops import _dispatch, _native, _sharding
from ..ops.block_step import step_unchecked
from ..ops.depth_attention import read_unchecked
from ..reference import models as ref
from .cache import LayerKVCache
from .sites import BlockAttnResState, DepthAttentionSite, FullAttnResState

ATTENTION_BACKENDS = ops.ATTENTION_BACKENDS


class ShardedSiteError(RuntimeError):
    """A multi-query read needs the parameters of a site that FSDP keeps sharded."""


class Backends(NamedTuple):
    """The backends of one forward, resolved once (:func:`resolve_backends`).

    ``depth``: the backend of every depth read (never ``"auto"``). ``step``:
    the backend of the fused Block step :func:`attnres_kernels.block_step`, or
    None when ``depth`` has no such kernel (the step then runs as an add plus
    a one-source merge read on ``depth``)."""

    depth: str
    step: str | None


_FUSED_STEP: dict = {}


def fused_step_backend(depth: str) -> str | None:
    """The backend of the fused Block step on depth backend ``depth``: ``depth`` itself
    when it has a ``block_step_fwd`` kernel (the reference always does), else None.
    A constant of the process (kernels are registered at import); torch.compile
    takes it as one."""
    if depth not in _FUSED_STEP:
        if depth in ("cpu", "cuda"):
            defined = _native.has_kernel("block_step_fwd", depth)
            if depth == "cuda" and not defined:  # CPU tensors under the SIMT harness (ATTNRES_CUDA_EMULATE=1)
                from ..cuda import emulation

                defined = emulation.unavailable_reason("block_step_fwd") is None
        elif depth == "triton":
            defined = hasattr(_dispatch.triton_ops(), "block_step_fwd")
        else:
            defined = True
        _FUSED_STEP[depth] = depth if defined else None
    return _FUSED_STEP[depth]


# torch.compile takes it as a constant (torch.compiler.assume_constant_result), marked once
# torch._dynamo is imported: importing it here only to mark the function cost ~1 s.
when_imported("torch._dynamo", lambda _: torch.compiler.assume_constant_result(fused_step_backend))


def resolve_backends(backend: str, like: Tensor) -> Backends:
    """Resolves a model's ``backend`` for a forward whose depth sources look like ``like``."""
    depth = ops.resolve_backend(backend, like.device, like.shape[-1], like.dtype)
    return Backends(depth, fused_step_backend(depth))


# ---------------------------------------------------------------- components


class RMSNorm(ref.RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class CausalSelfAttention(ref.CausalSelfAttention):
    """Causal self-attention on :func:`attnres_kernels.attention` (``attention_backend`` one of
    :data:`attnres_kernels.ops.ATTENTION_BACKENDS`: our kernels, the reference or PyTorch's SDPA;
    ``"auto"`` picks SDPA on CUDA tensors where it is faster)."""

    def __init__(self, d_model: int, n_heads: int, attention_backend: str = "auto"):
        super().__init__(d_model, n_heads)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; expected one of {ATTENTION_BACKENDS}")
        self.attention_backend = attention_backend

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of ``q [B, H, Tq, Dh]`` over ``k, v [B, H, Tk, Dh]``, ``Tk >= Tq``
        (longer with a decode cache): query i sees keys ``j <= i + Tk - Tq`` (bottom-right)."""
        return ops.attention(q, k, v, causal=True, backend=self.attention_backend)

    def forward(self, x: Tensor, kv_cache: LayerKVCache | None = None) -> Tensor:
        """``x [B, T, D]``; with ``kv_cache`` the chunk's keys and values are appended to the
        cache and its queries attend over every cached position too."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if kv_cache is not None:
            k, v = kv_cache.extend(k, v)
        o = self.attend(q, k, v)  # [B, H, T, Dh]
        return self.proj(o.transpose(1, 2).reshape(b, t, d))

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, attention_backend={self.attention_backend!r}"


MLP = ref.MLP


# ---------------------------------------------------------------- reads


def _rms_norm(h: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(h, (h.shape[-1],), weight.to(h.dtype), eps)


def _sharded(param) -> bool:
    """Whether ``param`` is a DTensor split over ranks (FSDP keeps it sharded between
    forwards); tensor parallelism replicates the site parameters, which are then whole."""
    return _sharding.is_dtensor(param) and not all(p.is_replicate() for p in param.placements)


def _check_gathered(group: tuple) -> None:
    """Raises :class:`ShardedSiteError` if a site of a multi-query read is sharded."""
    for name, site in group:
        if _sharded(site.query) or _sharded(site.norm_weight):
            raise ShardedSiteError(
                f"the multi-query (phase-1) read of this block needs the parameters of `{name}`, but they are "
                "sharded: its layer is a separate FSDP unit. Shard the layers of each block (chunk) together: "
                "`for unit in model.shard_units(): fully_shard(unit)`, or use the per-site schedule "
                "(BlockAttnResTransformer(schedule='per_site'), FullAttnResTransformer(chunk_size=1))"
            )


def phase1_read(backends: Backends, sources, group: tuple, eps: float):
    """One multi-query read of ``sources`` for every site of ``group`` (``(name, site)``
    pairs): per site ``h [..., D]`` and ``lse [...]``, as two tuples. (Unbound once:
    indexing rows of the ``[Q, ...]`` outputs one by one would cost a full-size
    gradient buffer per row in backward.)"""
    _check_gathered(group)
    sites = [site for _, site in group]
    query = torch.stack([s.query for s in sites])
    norm_weight = torch.stack([s.norm_weight for s in sites])
    h, lse = read_unchecked(
        backends.depth, list(sources), query, norm_weight, options=ReadOptions(eps, eps), return_lse=True
    )
    if _sharding.is_dtensor(lse):
        # Tensor parallel: the first site's lse is never read, and unbind's backward would
        # stand in a plain-tensor zero for it among DTensors. Rows of lse are 1/D of h's.
        return h.unbind(0), tuple(lse[i] for i in range(lse.shape[0]))
    return h.unbind(0), lse.unbind(0)


def site_read(backends: Backends, sources, site: DepthAttentionSite, out_norm_weight: Tensor, eps: float, weights):
    """A site's read over all its sources with the sublayer's PreNorm fused;
    with ``weights`` (a tuple) also records the site's depth weights.
    Returns ``(x, weights)``."""
    result = read_unchecked(
        backends.depth,
        list(sources),
        site.query,
        site.norm_weight,
        out_norm_weight=out_norm_weight,
        options=ReadOptions(eps, eps),
        return_weights=weights is not None,
    )
    if weights is None:
        return result, None
    return result[0], weights + (result[1],)


def merge_read(backends: Backends, prefix: tuple, sources, site: DepthAttentionSite, out_norm_weight, eps: float):
    """A site's phase-2 read: its phase-1 ``prefix = (h, lse)`` merged with ``sources``, PreNorm fused."""
    return read_unchecked(
        backends.depth,
        list(sources),
        site.query,
        site.norm_weight,
        prefix=prefix,
        out_norm_weight=out_norm_weight,
        options=ReadOptions(eps, eps),
    )


def phase2_step(backends: Backends, partial, update, site: DepthAttentionSite, prefix: tuple, out_norm_weight, eps):
    """``partial + update`` and the site's phase-2 read (its phase-1 ``prefix`` merged
    with the new sum, PreNorm fused): ``(new_partial, x)``, fused when the backend has
    the Block-step kernel."""
    prefix_out, prefix_lse = prefix
    if backends.step is not None:
        return step_unchecked(
            backends.step,
            partial,
            update,
            site.query,
            prefix_out,
            prefix_lse,
            site.norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
        )
    new_partial = update if partial is None else partial + update
    return new_partial, merge_read(backends, prefix, [new_partial], site, out_norm_weight, eps)


# ---------------------------------------------------------------- schedules


class FullSitePlan(NamedTuple):
    """Where site ``k`` of Full AttnRes sits in the chunked schedule.

    ``row``: its row in its chunk's phase-1 read; ``chunk_start``: the index of the
    chunk's first site (the site merges ``sources[chunk_start + 1:]``); ``group``:
    ``(name, site)`` of every site of the chunk when this site starts a chunk of
    two or more sites (it then runs the phase-1 read), else None; ``single``:
    the chunk has this one site (a plain read)."""

    row: int
    chunk_start: int
    group: tuple | None
    single: bool


def full_site_plans(sites: list, chunk_size: int) -> list:
    """The plans of Full AttnRes sites ``sites`` (``(name, site)`` in order, the output site last)."""
    plans = []
    for k in range(len(sites)):
        start = k - k % chunk_size
        end = min(start + chunk_size, len(sites))
        group = tuple(sites[start:end]) if k == start and end - start > 1 else None
        plans.append(FullSitePlan(k - start, start, group, end - start == 1))
    return plans


def full_site_input(backends: Backends, state: FullAttnResState, plan: FullSitePlan, site, out_norm_weight, eps):
    """The input of a Full AttnRes sublayer (its site's read, PreNorm fused) and the state
    with the chunk's phase-1 read when this site starts a chunk."""
    if state.weights is not None or plan.single:
        x, weights = site_read(backends, state.sources, site, out_norm_weight, eps, state.weights)
        return x, state._replace(weights=weights)
    if plan.group is not None:
        h, lse = phase1_read(backends, state.sources, plan.group, eps)
        return _rms_norm(h[0], out_norm_weight, eps), state._replace(prefix_out=h, prefix_lse=lse)
    prefix = (state.prefix_out[plan.row], state.prefix_lse[plan.row])
    return merge_read(backends, prefix, state.sources[plan.chunk_start + 1 :], site, out_norm_weight, eps), state


# ---------------------------------------------------------------- layers


class _Layer(nn.Module):
    """The submodules of a layer, named and ordered as in the reference :class:`Layer`."""

    def __init__(self, d_model: int, n_heads: int, eps: float, attention_backend: str, sites: bool, backend: str):
        super().__init__()
        self.eps = eps
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = CausalSelfAttention(d_model, n_heads, attention_backend)
        self.mlp_norm = RMSNorm(d_model, eps)
        self.mlp = MLP(d_model)
        if sites:
            self.attn_site = DepthAttentionSite(d_model, eps, backend)
            self.mlp_site = DepthAttentionSite(d_model, eps, backend)


class StandardLayer(_Layer):
    """``h = h + attn(norm(h)); h = h + mlp(norm(h))``."""

    def __init__(self, d_model: int, n_heads: int, eps: float = 1e-6, attention_backend: str = "auto"):
        super().__init__(d_model, n_heads, eps, attention_backend, sites=False, backend="auto")

    def forward(self, h: Tensor, kv_cache: LayerKVCache | None = None) -> Tensor:
        h = h + self.attn(self.attn_norm(h), kv_cache)
        return h + self.mlp(self.mlp_norm(h))


class _AttnResLayer(_Layer):
    """A layer of an AttnRes model: ``forward(state, backends=None) -> state``.

    The model configures the schedule (``configure``); ``backends`` is the
    model's once-per-forward resolution, resolved here when the layer is called
    on its own (a pipeline stage)."""

    def __init__(self, d_model: int, n_heads: int, eps: float, attention_backend: str, backend: str):
        super().__init__(d_model, n_heads, eps, attention_backend, sites=True, backend=backend)
        self.backend = backend

    def _backends(self, backends: Backends | None, like: Tensor) -> Backends:
        return backends if backends is not None else resolve_backends(self.backend, like)


class FullAttnResLayer(_AttnResLayer):
    """A Full AttnRes layer: each sublayer reads every earlier source; its output is a new source."""

    def configure(self, attn_plan: FullSitePlan, mlp_plan: FullSitePlan) -> None:
        # Plain attributes (not submodules): a plan's group refers to sites of other layers.
        self.plans = (attn_plan, mlp_plan)

    def forward(
        self, state: FullAttnResState, backends: Backends | None = None, kv_cache: LayerKVCache | None = None
    ) -> FullAttnResState:
        backends = self._backends(backends, state.sources[0])
        attn_plan, mlp_plan = self.plans
        x, state = full_site_input(backends, state, attn_plan, self.attn_site, self.attn_norm.weight, self.eps)
        state = state.add(self.attn(x, kv_cache))
        x, state = full_site_input(backends, state, mlp_plan, self.mlp_site, self.mlp_norm.weight, self.eps)
        return state.add(self.mlp(x))


class BlockAttnResLayer(_AttnResLayer):
    """A Block AttnRes layer: commits a block when it starts one, then reads
    ``blocks + [block sum]`` before each sublayer and adds the sublayer's output
    to the block sum.

    Two-phase schedule (DESIGN.md §2.3): the layer that starts a block reads the
    committed blocks once for all sites of the block (phase 1, ``group``); each
    site then merges the block sum with the fused Block step (phase 2), which
    also adds the previous sublayer's output (``state.pending``)."""

    def configure(self, starts_block: bool, row: int, group: tuple | None, two_phase: bool) -> None:
        """``row``: the row of this layer's attention site in its block's phase-1 read
        (the MLP site's is ``row + 1``); ``group``: the block's sites when this layer
        starts a block (two-phase)."""
        self.starts_block, self.row, self.group, self.two_phase = starts_block, row, group, two_phase

    def forward(
        self, state: BlockAttnResState, backends: Backends | None = None, kv_cache: LayerKVCache | None = None
    ) -> BlockAttnResState:
        like = state.partial if state.partial is not None else state.blocks[0]
        backends = self._backends(backends, like)
        if self.starts_block:
            state = state.commit()
        if not self.two_phase or state.weights is not None:
            return self._per_site(backends, state, kv_cache)
        eps, row = self.eps, self.row
        if self.starts_block:  # phase 1; the block's first site reads only the committed blocks
            h, lse = phase1_read(backends, state.blocks, self.group, eps)
            state = state._replace(prefix_out=h, prefix_lse=lse)
            partial, x = None, _rms_norm(h[0], self.attn_norm.weight, eps)
        else:
            prefix = (state.prefix_out[row], state.prefix_lse[row])
            partial, x = phase2_step(
                backends, state.partial, state.pending, self.attn_site, prefix, self.attn_norm.weight, eps
            )
        prefix = (state.prefix_out[row + 1], state.prefix_lse[row + 1])
        attn_out = self.attn(x, kv_cache)
        partial, x = phase2_step(backends, partial, attn_out, self.mlp_site, prefix, self.mlp_norm.weight, eps)
        return state._replace(partial=partial, pending=self.mlp(x))

    def _per_site(self, backends: Backends, state: BlockAttnResState, kv_cache: LayerKVCache | None):
        x, weights = site_read(backends, state.sources, self.attn_site, self.attn_norm.weight, self.eps, state.weights)
        state = state._replace(weights=weights).add(self.attn(x, kv_cache))
        x, weights = site_read(backends, state.sources, self.mlp_site, self.mlp_norm.weight, self.eps, state.weights)
        return state._replace(weights=weights).add(self.mlp(x))
