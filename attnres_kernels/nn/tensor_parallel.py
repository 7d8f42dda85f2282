"""Tensor and sequence parallel plans of the nn models (DESIGN.md §2.8).

``parallelize_module(model, tp_mesh, tensor_parallel_plan(model))`` splits every layer
over the ranks of a 1-D mesh, Megatron style with sequence parallelism, on DTensors:

- the depth state (Standard: ``h``; Full: every source; Block: the committed blocks and
  the partial sum) is ``[B, T, D]`` sharded on the sequence, ``Shard(1)``. Every depth
  read, Block step and PreNorm runs on the local tokens with no communication (the
  fused ops take DTensors, :mod:`attnres_kernels.ops._sharding`); the site parameters
  (``query``, ``norm_weight``) and the norm weights are replicated and their gradients
  summed over the ranks;
- attention: its input is all-gathered over the sequence and split by head: rank r
  computes q, k and v of its heads only (the fused QKV projection's rows ``[q; k; v]``
  hold a rank's heads in three separate blocks, so the weight is replicated and each
  rank multiplies its rows, :class:`HeadParallelQKV`), attention runs on the local
  heads and the row-parallel output projection reduce-scatters back onto the sequence;
- MLP: column-parallel ``fc``, row-parallel ``proj`` (reduce-scatter onto the sequence);
- embedding: row-parallel over the vocabulary, output sharded on the sequence;
  head: column-parallel over the vocabulary, logits replicated (a plain tensor).

Every rank is called with the same whole batch ``idx [B, T]`` and gets the whole logits,
as in torchtitan. ``n_heads`` must divide by the mesh size; the vocabulary, the MLP
width and the sequence need not (uneven shards). A decode cache is not supported
under tensor parallelism.

FSDP2 on top (2-D mesh ``("dp", "tp")``): apply the plan on ``mesh["tp"]`` first, then
``fully_shard(unit, mesh=mesh["dp"])`` for each of ``model.shard_units()`` and the root
(:class:`DepthStateGradients` keeps FSDP2's backward hooks on DTensor gradients).
Pipeline stages on top: apply the plan first, then ``model.pipeline_stages(...)`` (then
FSDP2 per stage); the depth state crosses a cut as DTensors on the ``tp`` mesh.

Every parameter is a DTensor with a plain ``Shard`` or ``Replicate`` placement, so
``full_tensor()``, FSDP2 and DCP (``get_state_dict``) see each in its own layout and a
checkpoint loads into any other layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layers import CausalSelfAttention
from .sites import DepthAttentionSite


class ReplicateParameters(ParallelStyle):
    """Replicates a module's parameters over the mesh (DTensor ``Replicate``) and leaves
    its calls alone: for depth-attention sites, whose parameters the layers pass to the
    fused reads directly. Their gradients come back as partial sums over the token shards
    and are reduced wherever they are used (autograd, the optimizer, ``full_tensor()``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class HeadParallelQKV(nn.Linear):
    """The fused QKV projection ``nn.Linear(d, 3d)`` of an attention whose heads are split
    over the ranks of a tensor-parallel mesh (class set by :class:`FusedQKVParallel`).

    Its rows are ``[q; k; v]`` (``d`` rows each, head-major inside), so the rows of rank
    r's heads, ``[q_r; k_r; v_r]``, are three separate blocks: no ``Shard`` placement
    describes them, and the one that does (``_StridedShard(0, split_factor=3)``) is
    handled by neither FSDP2 (a 2-D layout of the wrong rows) nor DCP (overlapping
    chunks). So the weight is replicated and each rank multiplies only its rows, on
    local tensors: ``x [B, T, d]`` (replicated) to ``[B, T, 3d/n]``, returned as a
    DTensor that the attention's ``view(B, T, 3, H, Dh)`` turns into heads sharded on
    the head dim. The weight's (and the input's) gradients come back as partial sums
    over the ranks (zero outside a rank's rows), reduced wherever they are used."""

    def forward(self, x):
        mesh = self.weight.device_mesh
        n, r = mesh.size(), mesh.get_local_rank()
        d = self.in_features
        rows = slice(r * d // n, (r + 1) * d // n)  # of each of q, k, v

        def local_rows(param):  # this rank's rows of q, k and v; the gradient a partial sum
            return param.to_local(grad_placements=[Partial()]).unflatten(0, (3, d))[:, rows].flatten(0, 1)

        bias = None if self.bias is None else local_rows(self.bias)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        y = F.linear(x, local_rows(self.weight), bias)  # [..., 3d/n]: q, k, v of this rank's heads
        shape = (*y.shape[:-1], 3 * d)
        layout = [_StridedShard(y.dim() - 1, split_factor=3)]
        return DTensor.from_local(y, mesh, layout, run_check=False, shape=shape, stride=_contiguous(shape))


def _contiguous(shape) -> tuple:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


class FusedQKVParallel(ParallelStyle):
    """Column parallel by head for a fused QKV ``nn.Linear(d, 3d)`` (see :class:`HeadParallelQKV`):
    the weight is replicated, rank r computes the q, k and v of heads ``r·H/n … (r+1)·H/n - 1``."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n = device_mesh.size()
        if type(module) is not nn.Linear or module.out_features != 3 * module.in_features:
            raise TypeError(f"FusedQKVParallel takes an nn.Linear(d, 3 * d), got {module}")
        if device_mesh.ndim != 1 or self.n_heads % n:
            raise ValueError(
                f"tensor parallel splits the attention by head over a 1-D mesh: n_heads = {self.n_heads} must be a "
                f"multiple of its size, got a mesh of shape {tuple(device_mesh.shape)}"
            )
        distribute_module(module, device_mesh)  # replicates the weight
        module.__class__ = HeadParallelQKV
        return module


class _DepthStateGrads(torch.autograd.Function):
    """Identity on the DTensors of a layer's input depth state whose backward hands each of
    them a DTensor gradient: the zeros of its layout for those nothing downstream reads."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.set_materialize_grads(False)
        ctx.layouts = [(t.shape, t.dtype, t.device_mesh, t.placements) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(
            g if g is not None else dtensor_zeros(shape, dtype=dtype, device_mesh=mesh, placements=placements)
            for g, (shape, dtype, mesh, placements) in zip(grads, ctx.layouts)
        )


class DepthStateGradients(ParallelStyle):
    """Gives every DTensor of a layer's input depth state a DTensor gradient under FSDP2.

    FSDP2 passes a unit's inputs through an autograd function (its post-backward hook)
    that stands in zeros for the gradients of inputs nothing downstream reads, and
    autograd makes those zeros plain tensors, which cannot meet the DTensor gradients
    of the same tensors. The multi-query schedules carry such inputs (the phase-1 rows
    of sites already read, the committed blocks after the last block's phase-1 read).
    A forward pre-hook, run after FSDP2's, wraps the layer's inputs in
    :class:`_DepthStateGrads`, which supplies DTensor zeros instead. Layers that FSDP2
    does not wrap are left alone."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_wrap_state, with_kwargs=True)
        return module


def _wrap_state(module, args, kwargs):
    if not torch.is_grad_enabled() or not isinstance(module, FSDPModule):
        return None
    leaves, spec = tree_flatten((args, kwargs))
    index = [i for i, t in enumerate(leaves) if isinstance(t, DTensor) and t.requires_grad]
    if not index:
        return None
    for i, t in zip(index, _DepthStateGrads.apply(*(leaves[i] for i in index))):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def tensor_parallel_plan(model: nn.Module) -> dict:
    """The plan of an nn model (Standard, Full or Block AttnRes) for
    ``torch.distributed.tensor.parallel.parallelize_module(model, tp_mesh, plan)``:
    ``{submodule name: ParallelStyle}`` (see this module's docstring for the layouts)."""
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "embed") or not hasattr(model, "head"):
        raise TypeError(f"tensor_parallel_plan takes an attnres_kernels.nn model, got {type(model).__name__}")
    seq = Shard(1)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "final_norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if isinstance(getattr(model, "out_site", None), DepthAttentionSite):
        plan["out_site"] = ReplicateParameters()
    for i, layer in enumerate(layers):
        if not isinstance(layer.attn, CausalSelfAttention):
            raise TypeError(f"layers.{i}.attn is a {type(layer.attn).__name__}, not an nn.CausalSelfAttention")
        prefix = f"layers.{i}."
        plan.update(
            {
                f"layers.{i}": DepthStateGradients(),
                # Standard calls the norms on the sequence shards; AttnRes fuses them into the reads.
                prefix + "attn_norm": SequenceParallel(),
                prefix + "mlp_norm": SequenceParallel(),
                # attn(x, kv_cache): x all-gathered over the sequence, then split by head.
                prefix + "attn": PrepareModuleInput(
                    input_layouts=(seq, None), desired_input_layouts=(Replicate(), None), use_local_output=False
                ),
                prefix + "attn.qkv": FusedQKVParallel(layer.attn.n_heads),
                prefix + "attn.proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
                prefix + "mlp.fc": ColwiseParallel(input_layouts=seq, use_local_output=False),
                prefix + "mlp.proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
            }
        )
        for site in ("attn_site", "mlp_site"):
            if isinstance(getattr(layer, site, None), DepthAttentionSite):
                plan[prefix + site] = ReplicateParameters()
    return plan
