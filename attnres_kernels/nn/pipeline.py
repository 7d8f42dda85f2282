"""Pipeline parallelism: the models as ``torch.distributed.pipelining`` stages.

``model.pipeline_stage(stage_index, num_stages, device)`` (one stage per rank) and
``model.pipeline_stages(stage_indices, num_stages, device)`` (several per rank, for the
interleaved schedules) return ``PipelineStage`` objects that PyTorch's schedules drive as
their documentation shows::

    stage = model.pipeline_stage(rank, world, device)
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    if rank == 0:
        schedule.step(idx)                          # token ids [B, T]
    elif rank == world - 1:
        losses = []
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()

A model runs as ``model.embed`` → ``model.initial_state`` → ``model.layers`` →
``model.logits`` (see :mod:`attnres_kernels.nn.models`), so a stage is a slice of that
chain. With cuts ``c_1 < ... < c_{S-1}`` (layer indices, each one of
:func:`pipeline_cuts`; ``cuts=None``: :func:`balanced_cuts`), stage 0 runs
``initial_state(embed(idx))`` and ``layers[:c_1]`` (only the embedding when ``c_1 = 0``),
stage k ``layers[c_k:c_{k+1}]`` and the last stage also ``logits``. A stage's submodule
(:class:`StageModule`) holds the model's own modules under the model's names
(``embed``, ``layers.<i>``, ``out_site``, ``final_norm``, ``head``): its
``named_parameters()`` spell each parameter as ``model.named_parameters()`` does, so
optimizers, FSDP2 (``fully_shard`` the shard units inside a stage, then
``stage.submod``) and DCP map one to one. Under tensor parallelism (the plan of
:mod:`attnres_kernels.nn.tensor_parallel` applied to the model before its stages are made)
the tensors crossing a boundary are DTensors on the ``tp`` mesh, sharded on the sequence; the
stages find that mesh among the model's parameters' (PyTorch's ``get_mesh`` callback).

What crosses the boundary before layer ``c`` is the depth state as a flat tuple of
tensors, each ``[*batch, D]`` (``[b, T, D]`` per microbatch), in this order
(:func:`boundary_layout`, :func:`pack_boundary`):

- **Standard**: ``[h]``, the residual stream.
- **Full AttnRes**: ``sources``: the embedding, then the outputs of the ``2 * c``
  sublayers before the cut in order (attention, MLP per layer): ``1 + 2 * c`` tensors.
- **Block AttnRes**: the committed blocks (block 0 is the embedding, block b the sum of
  the sublayer outputs of the b-th block of ``layers_per_block`` layers), then
  ``partial``, the running sum of the current block (the two-phase schedule's pending
  sublayer output already added). That is ``n + 1`` tensors with ``n = 0`` at ``c = 0``
  (``partial`` is then the embedding) and ``n = (c - 1) // layers_per_block + 1`` otherwise.

So per microbatch of ``b`` sequences of ``T`` tokens, ``b·T·D·s`` bytes per tensor
(``s`` = element size) cross the boundary forward and as many come back as gradients:
Full grows with depth as ``(1 + 2c)``, O(L·d) per token, Block as ``(n + 1)``, O(N·d)
(paper §4.1). Each tensor keeps its dtype (under autocast the embedding stays fp32 while
sublayer outputs are bf16/fp16); the stages learn shapes and dtypes from the first
microbatch (PyTorch's runtime shape inference). The multi-query schedules'
``prefix_*`` fields never cross: a stage may start only at a shard unit's first layer
(:func:`pipeline_cuts`), where the next layer runs its block's (chunk's) phase-1 read
itself, and the last unit stays on the stage of the head (it may read the output site's
query). Depth weights (``return_depth_weights``) are not carried.

**Cross-stage caching** (paper §4.1; ``cache=True``, the default). With more stages than
ranks, stage ``s`` runs on rank ``s % P`` (the interleaved schedules' placement), so the
rank of stage ``j >= P`` already holds, for the same microbatch, the state that its
earlier stage ``j - P`` sent on at cut ``c = c_{j-P+1}``. Every tensor of that state that
is final is not sent again: the sources of Full (``1 + 2c``), the blocks of Block whose
layers all ran (``c // layers_per_block + 1``: the committed blocks, and the partial sum
too when ``c`` ends a block). The boundary into stage ``j`` carries only the rest of its
layout (``stage.submod.received`` names them); stage ``j`` reads the kept tensors on its
own rank, and their gradients reach stage ``j - P``'s graph locally (stage ``j``'s
backward of a microbatch always precedes stage ``j - P``'s), so nothing is sent twice in
either direction. Standard keeps nothing (``h`` changes in every layer). The caching needs
a full backward per microbatch: the zero-bubble schedules that split the input and
weight gradients, and the V-shaped placements, need ``cache=False``.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor, nn

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


def reusable_tensors(model, cut: int) -> int:
    """How many leading tensors of the state at ``cut`` are final (no later layer changes
    them), so that a rank holding them need not receive them again: Full ``1 + 2·cut``
    (every source), Block ``cut // layers_per_block + 1`` (the blocks whose layers all ran),
    Standard 0."""
    _check_cut(model, cut)
    if isinstance(model, StandardTransformer):
        return 0
    if isinstance(model, FullAttnResTransformer):
        return 1 + 2 * cut
    return cut // model.layers_per_block + 1


def balanced_cuts(model, num_stages: int) -> list[int]:
    """``num_stages - 1`` increasing cuts from :func:`pipeline_cuts` that minimize the most
    layers any stage runs (then, among those, the sum of squares of the stage sizes)."""
    legal = pipeline_cuts(model)
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages - 1 > len(legal):
        raise ValueError(
            f"{num_stages} stages need {num_stages - 1} cuts, but this model can be cut only before the layers "
            f"{legal} (the first layers of its shard units, 0 = a stage of the embedding alone)"
        )
    n_layers = model.n_layers
    # best[k][i]: (max stage size, sum of squares, cuts) of stages 1..k starting at legal[i] (k cuts used).
    best = [{i: (c, c * c, [c]) for i, c in enumerate(legal)}]
    for _ in range(num_stages - 2):
        prev, step = best[-1], {}
        for i, c in enumerate(legal):
            options = [
                (max(m, c - legal[j]), sq + (c - legal[j]) ** 2, [*cuts, c])
                for j, (m, sq, cuts) in prev.items()
                if j < i
            ]
            if options:
                step[i] = min(options)
        best.append(step)
    if num_stages == 1:
        return []
    final = [
        (max(m, n_layers - legal[i]), sq + (n_layers - legal[i]) ** 2, cuts) for i, (m, sq, cuts) in best[-1].items()
    ]
    return min(final)[2]


def _committed_blocks(model: BlockAttnResTransformer, cut: int) -> int:
    return 0 if cut == 0 else (cut - 1) // model.layers_per_block + 1


def _check_model(model) -> None:
    if not isinstance(model, _MODELS):
        raise TypeError(f"expected one of {[m.__name__ for m in _MODELS]}, got {type(model).__name__}")


def _check_cut(model, cut: int) -> None:
    cuts = pipeline_cuts(model)
    if cut not in cuts:
        raise ValueError(f"a stage cannot start at layer {cut}: the cuts of this model are {cuts}")


def _check_stage_cuts(model, num_stages: int, cuts) -> list[int]:
    if cuts is None:
        return balanced_cuts(model, num_stages)
    cuts = [int(c) for c in cuts]
    legal = pipeline_cuts(model)
    if len(cuts) != num_stages - 1:
        raise ValueError(f"{num_stages} stages need {num_stages - 1} cuts (where stages 1.. start), got {cuts}")
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"the cuts must increase strictly, got {cuts}")
    for c in cuts:
        if c not in legal:
            raise ValueError(f"a stage cannot start at layer {c}: the cuts of this model are {legal}")
    return cuts


class StagePlan(NamedTuple):
    """Where stage ``index`` of a pipeline sits.

    ``start``/``end``: its layers are ``layers[start:end]``; ``first``/``last``: it runs the
    embedding / the head; ``kept_in``: how many leading tensors of its input state it takes
    from its rank's earlier stage instead of receiving them (cross-stage caching);
    ``kept_out``: how many leading tensors of its output state it hands to its rank's next
    stage ``index + P``; ``sent_from``: its output tuple is the state at ``end`` from this
    tensor on (the next stage's ``kept_in``)."""

    index: int
    start: int
    end: int
    first: bool
    last: bool
    kept_in: int
    kept_out: int
    sent_from: int


def stage_plans(model, num_stages: int, group_size: int, cuts=None, *, cache: bool = True) -> list[StagePlan]:
    """The plans of all ``num_stages`` stages with stage ``s`` on rank ``s % group_size``."""
    _check_model(model)
    cuts = _check_stage_cuts(model, num_stages, cuts)
    starts, ends = [0, *cuts], [*cuts, model.n_layers]
    caching = cache and 2 <= group_size < num_stages

    def kept_in(s: int) -> int:
        if not caching or s < group_size:
            return 0
        return reusable_tensors(model, starts[s - group_size + 1])

    plans = []
    for s in range(num_stages):
        plans.append(
            StagePlan(
                s,
                starts[s],
                ends[s],
                s == 0,
                s == num_stages - 1,
                kept_in(s),
                kept_in(s + group_size) if s + group_size < num_stages else 0,
                kept_in(s + 1) if s + 1 < num_stages else 0,
            )
        )
    return plans


class _Slot:
    """What stage ``j - P`` hands to stage ``j`` on the same rank for one microbatch: the kept
    tensors (in stage ``j - P``'s graph), then the leaves stage ``j`` made of them."""

    __slots__ = ("tensors", "leaves")

    def __init__(self, tensors):
        self.tensors, self.leaves = tensors, None


class _Handoff:
    """The kept tensors of one rank's stages, by (consumer stage, microbatch); shared by the
    stages :func:`pipeline_stages` builds together. ``chunk`` is the microbatch being run
    (None outside a schedule's ``forward_one_chunk``: the schedule's shape inference, or a
    direct call of the submodule)."""

    def __init__(self):
        self.slots: dict = {}
        self.chunk = None

    @contextmanager
    def running(self, chunk):
        self.chunk = chunk
        try:
            yield
        finally:
            self.chunk = None

    def give(self, consumer: int, tensors) -> _Slot:
        slot = _Slot(tuple(tensors))
        self.slots[(consumer, self.chunk)] = slot
        return slot

    def take(self, consumer: int) -> list[Tensor]:
        slot = self.slots.pop((consumer, self.chunk), None)
        if slot is None:
            raise RuntimeError(
                f"stage {consumer} keeps tensors of its rank's earlier stage for microbatch {self.chunk}, but that "
                "stage has not run it on this rank: build a rank's stages with one pipeline_stages() call, stage s "
                "on rank s % P, and run them with a schedule that runs every microbatch through the earlier stage "
                "first (or pass cache=False)"
            )
        grad = torch.is_grad_enabled()
        slot.leaves = [t.detach().requires_grad_(grad and t.requires_grad) for t in slot.tensors]
        return slot.leaves

    def clear(self):
        self.slots.clear()


class _HandOn(torch.autograd.Function):
    """Identity on the tensors a stage sends; in backward it also gives the kept tensors the
    gradients that the rank's later stage left on its leaves of them."""

    @staticmethod
    def forward(ctx, slot: _Slot, n_sent: int, *tensors):
        ctx.slot = slot
        return tuple(t.view_as(t) for t in tensors[:n_sent])

    @staticmethod
    def backward(ctx, *grads):
        slot, ctx.slot = ctx.slot, None
        kept = [None if slot.leaves is None else leaf.grad for leaf in (slot.leaves or slot.tensors)]
        return (None, None, *grads, *kept)


class StageModule(nn.Module):
    """The submodule of a pipeline stage: the model's modules of the stage under the model's
    names (``embed`` on the first stage, ``layers.<i>``, ``out_site``/``final_norm``/``head``
    on the last). ``forward(*tensors)`` takes token ids ``[b, T]`` (first stage) or the
    received boundary tensors, and returns the tuple of tensors sent on (``sent``) or the
    logits (last stage)."""

    def __init__(self, model, plan: StagePlan, handoff: _Handoff, group_size: int):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: only the stage's parts are
        self.plan, self._handoff, self._group_size = plan, handoff, group_size
        if plan.first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(plan.start, plan.end)})
        if plan.last:
            if hasattr(model, "out_site"):
                self.out_site = model.out_site
            self.final_norm = model.final_norm
            self.head = model.head
        #: names of the input tensors received (first stage: the token ids) and taken from this rank
        self.received = ["idx"] if plan.first else boundary_layout(model, plan.start)[plan.kept_in :]
        self.kept = [] if plan.first else boundary_layout(model, plan.start)[: plan.kept_in]
        #: names of the output tensors sent on (last stage: the logits)
        self.sent = ["logits"] if plan.last else boundary_layout(model, plan.end)[plan.sent_from :]

    def forward(self, *inputs: Tensor):
        model, plan = self._model, self.plan
        if plan.first:
            if len(inputs) != 1:
                raise ValueError(f"the first stage takes the token ids alone, got {len(inputs)} tensors")
            embedding = model.embed(inputs[0])
            like, state = embedding, model.initial_state(embedding)
        else:
            if len(inputs) != len(self.received):
                raise ValueError(
                    f"stage {plan.index} receives {len(self.received)} tensors ({self.received}), got {len(inputs)}"
                )
            tensors = [*(self._handoff.take(plan.index) if plan.kept_in else ()), *inputs]
            like, state = tensors[0], unpack_boundary(model, plan.start, tensors)
        kwargs = {} if isinstance(model, StandardTransformer) else {"backends": model.backends(like)}
        state = model.run_layers(state, layers=self.layers.values(), **kwargs)
        if plan.last:
            return model.logits(state)
        packed = pack_boundary(model, plan.end, state)
        sent = packed[plan.sent_from :]
        if plan.kept_out:
            kept = packed[: plan.kept_out]
            slot = self._handoff.give(plan.index + self._group_size, kept)
            if torch.is_grad_enabled():
                return _HandOn.apply(slot, len(sent), *sent, *kept)
        return tuple(sent)

    def extra_repr(self) -> str:
        p = self.plan
        return f"stage={p.index}, layers=[{p.start}:{p.end}], received={self.received}, kept={self.kept}"


def pipeline_stages(model, stage_indices, num_stages: int, device, group=None, cuts=None, *, cache: bool = True):
    """This rank's pipeline stages ``stage_indices`` of ``num_stages``, as
    ``torch.distributed.pipelining.PipelineStage`` objects (see the module docstring).

    ``group``: the pipeline's process group (default: the world); with more stages than
    ranks, stage ``s`` must be on rank ``s % P`` (``stage_indices = range(rank, num_stages,
    P)``, what ``ScheduleInterleaved1F1B`` / ``ScheduleLoopedBFS`` expect). ``cuts``: where
    stages 1.. start (``num_stages - 1`` increasing layer indices from :func:`pipeline_cuts`);
    None balances the layers (:func:`balanced_cuts`). ``cache``: cross-stage caching (see the
    module docstring); every rank must pass the same ``cuts`` and ``cache``.

    Each stage counts the bytes it sends per microbatch in ``stage.sent_bytes``
    (``{"forward": {microbatch: bytes}, "backward": {...}}``, reset by every ``step``)."""
    import torch.distributed as dist

    stage_class = _stage_class()
    stage_indices = [int(s) for s in stage_indices]
    group_size, rank = dist.get_world_size(group), dist.get_rank(group)
    plans = stage_plans(model, num_stages, group_size, cuts, cache=cache)
    if not stage_indices or any(not 0 <= s < num_stages for s in stage_indices):
        raise ValueError(f"stage indices must lie in [0, {num_stages}), got {stage_indices}")
    caching = any(p.kept_in for p in plans)
    if caching and stage_indices != list(range(rank, num_stages, group_size)):
        raise ValueError(
            f"with {num_stages} stages on {group_size} ranks, cross-stage caching needs stage s on rank s % "
            f"{group_size}: rank {rank} holds stages {list(range(rank, num_stages, group_size))}, got "
            f"{stage_indices}; or pass cache=False"
        )
    handoff = _Handoff()
    device = torch.device(device)
    get_mesh = _mesh_lookup(model)
    return [
        stage_class(
            StageModule(model, plans[s], handoff, group_size), s, num_stages, device, group=group, get_mesh=get_mesh
        )
        for s in stage_indices
    ]


def _mesh_lookup(model):
    """The ``get_mesh`` callback of the stages: the device mesh of the model's DTensor parameters
    whose dim names and layout a received DTensor's metadata names. Under tensor parallelism the
    depth state crosses a stage boundary as DTensors on the ``tp`` mesh (sharded on the
    sequence), and the receiving stage rebuilds them on its own copy of that mesh."""
    meshes = {}
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            meshes[(tuple(mesh.mesh_dim_names or ()), mesh._layout)] = mesh

    def get_mesh(mesh_dim_names, mesh_layout):
        return meshes.get((tuple(mesh_dim_names), mesh_layout))

    return get_mesh


@functools.cache
def _stage_class():
    """The ``PipelineStage`` subclass of :func:`pipeline_stages` (made on first use: importing
    ``torch.distributed.pipelining`` takes a second)."""
    from torch.distributed.pipelining import PipelineStage

    class AttnResPipelineStage(PipelineStage):
        """A ``PipelineStage`` over a :class:`StageModule`: tells the submodule which
        microbatch runs (cross-stage caching) and counts the bytes it sends."""

        def __init__(self, submodule: StageModule, *args, **kwargs):
            super().__init__(submodule, *args, **kwargs)
            self._handoff = submodule._handoff
            self.sent_bytes = {"forward": {}, "backward": {}}

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self._handoff.running(fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if not full_backward and (self.submod.plan.kept_in or self.submod.plan.kept_out):
                raise NotImplementedError(
                    "cross-stage caching needs a full backward per microbatch (the kept tensors' gradients reach the "
                    "earlier stage through its graph); build the stages with cache=False for zero-bubble schedules"
                )
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            self._handoff.clear()
            self.sent_bytes = {"forward": {}, "backward": {}}

        def get_fwd_send_ops(self, fwd_chunk_id):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            self.sent_bytes["forward"][fwd_chunk_id] = _nbytes(ops)
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            self.sent_bytes["backward"][bwd_chunk_id] = _nbytes(ops)
            return ops

    return AttnResPipelineStage


def _nbytes(ops) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
