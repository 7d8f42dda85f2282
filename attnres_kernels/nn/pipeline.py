"""Cutting an nn model into pipeline stages: what crosses a stage boundary.

A model runs as ``model.embed`` → ``model.initial_state`` → ``model.layers`` →
``model.logits`` (see :mod:`attnres_kernels.nn.models`), so a stage is a slice
of that chain: stage 0 runs ``initial_state(embed(idx))`` and
``layers[:cut]``, the next stage ``layers[cut:...]`` and the last also
``logits``. Between two stages travels the depth state as a flat list of
tensors, each ``[*batch, D]`` (``[B, T, D]`` for the models), in this order:

- **Standard**: ``[h]``, the residual stream.
- **Full AttnRes**: ``sources``: the embedding, then the outputs of the
  ``2 * cut`` sublayers before the cut in order (attention, MLP per layer):
  ``1 + 2 * cut`` tensors.
- **Block AttnRes**: the committed blocks (block 0 is the embedding, block b
  the sum of the sublayer outputs of the b-th block of ``layers_per_block``
  layers), then ``partial``, the running sum of the current block (the
  two-phase schedule's pending sublayer output already added). That is
  ``n + 1`` tensors with ``n = 0`` at ``cut = 0`` (``partial`` is then the
  embedding) and ``n = (cut - 1) // layers_per_block + 1`` otherwise.

Each tensor keeps its dtype (under autocast the embedding stays fp32 while
sublayer outputs are bf16/fp16), so a receiver allocates its buffers from
:func:`boundary_layout` and the dtypes its layers produce. The multi-query
schedules' ``prefix_*`` fields never cross: a stage may start only at a shard
unit's first layer (:func:`pipeline_cuts`), where the next layer runs its
block's (chunk's) phase-1 read itself, and the last unit stays on the stage
of the head (it may read the output site's query). Depth weights
(``return_depth_weights``) are not carried.

Backward: the receiving stage sets ``requires_grad`` on what it received and,
after its backward, returns their ``.grad`` in the same order; the sending
stage calls ``torch.autograd.backward(packed, grads)``. A two-rank example
with ``torch.distributed`` send/recv is in the README ("Distributed training").
"""

from __future__ import annotations

from torch import Tensor

from .models import BlockAttnResTransformer, FullAttnResTransformer, StandardTransformer
from .sites import BlockAttnResState, FullAttnResState

_MODELS = (StandardTransformer, FullAttnResTransformer, BlockAttnResTransformer)


def pipeline_cuts(model) -> list[int]:
    """The layer indices where a pipeline stage may start: 0 (the first stage then runs only
    the embedding) and the first layer of every other shard unit (``model.shard_units()``).
    Not ``n_layers``: the last unit stays on the stage of the head."""
    _check_model(model)
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    return [0] + [index[id(unit[0])] for unit in model.shard_units()[1:]]


def boundary_layout(model, cut: int) -> list[str]:
    """Names of the tensors that cross the boundary before layer ``cut``, in packing order."""
    _check_cut(model, cut)
    if isinstance(model, StandardTransformer):
        return ["h"]
    if isinstance(model, FullAttnResTransformer):
        return [f"sources[{k}]" for k in range(1 + 2 * cut)]
    return [f"blocks[{b}]" for b in range(_committed_blocks(model, cut))] + ["partial"]


def pack_boundary(model, cut: int, state) -> list[Tensor]:
    """The state after ``layers[:cut]`` as the flat list :func:`boundary_layout` names."""
    layout = boundary_layout(model, cut)
    if isinstance(model, StandardTransformer):
        tensors = [state]
    elif state.weights is not None:
        raise ValueError("depth weights are not carried across a pipeline stage; run without return_depth_weights")
    elif isinstance(model, FullAttnResTransformer):
        tensors = list(state.sources)
    else:
        tensors = [*state.blocks, state.block_sum()]
    if len(tensors) != len(layout):
        raise ValueError(f"the state has {len(tensors)} tensors where a cut before layer {cut} has {len(layout)}")
    return tensors


def unpack_boundary(model, cut: int, tensors: list[Tensor]):
    """The state that ``layers[cut:]`` continue from, built from :func:`pack_boundary`'s list."""
    layout = boundary_layout(model, cut)
    if len(tensors) != len(layout):
        raise ValueError(f"a cut before layer {cut} carries {len(layout)} tensors ({layout}), got {len(tensors)}")
    if isinstance(model, StandardTransformer):
        return tensors[0]
    if isinstance(model, FullAttnResTransformer):
        return FullAttnResState(tuple(tensors))
    return BlockAttnResState(tuple(tensors[:-1]), tensors[-1])


def _committed_blocks(model: BlockAttnResTransformer, cut: int) -> int:
    return 0 if cut == 0 else (cut - 1) // model.layers_per_block + 1


def _check_model(model) -> None:
    if not isinstance(model, _MODELS):
        raise TypeError(f"expected one of {[m.__name__ for m in _MODELS]}, got {type(model).__name__}")


def _check_cut(model, cut: int) -> None:
    cuts = pipeline_cuts(model)
    if cut not in cuts:
        raise ValueError(f"a stage cannot start at layer {cut}: the cuts of this model are {cuts}")
