"""DTensor inputs of the fused ops (DESIGN.md §2.8): tensor and sequence parallel.

Every fused op of every backend namespace (``attnres::`` C++, ``attnres_triton::``,
``attnres_emu::``) gets a ``torch.library.register_torch_dispatch`` rule for
:class:`~torch.distributed.tensor.DTensor`: called with DTensor arguments, the op runs
once on the local shards and its outputs come back as DTensors on the same mesh.
The rules work on the *names* of the schema's arguments, never on their count or
position, so scalar options appended to a schema (the depth read's ``ReadOptions``)
pass through untouched.

Per mesh dimension the rule picks one layout for the op's *row* tensors and moves
every argument to it (a no-op when the arguments already agree, which the
tensor-parallel plan of :mod:`attnres_kernels.nn.tensor_parallel` arranges):

- depth read and Block step: rows are tokens. Sources, prefixes, partial sums,
  ``lse``/``logits``/``rinv`` and their gradients are sharded on one token dim of
  ``[..., D]`` (the sequence dim of ``[B, T, D]``, or the batch dim), taken from the
  first row argument sharded on a token dim, or replicated when none is. The site
  parameters (``query``, ``norm_weight``, ``out_norm_weight``) are replicated; their
  gradients come back ``Partial`` (summed over the ranks when used: autograd, the
  optimizer step or ``full_tensor()`` reduce them) on the mesh dims where the rows
  are sharded. A read is per token, so a sharded read runs with no communication.
- attention: ``q, k, v [B, H, T, Dh]`` (and the output, ``lse`` and gradients) are
  sharded on the batch (0) or head (1) dim, never on the sequence (the keys of a
  query span the sequence); ``key_padding_mask [B, Tk]`` follows the batch dim and is
  replicated when the heads are sharded.

The rules run below autograd: the ops' own autograd (C++ for ``attnres::``, Python
for the others) saves the DTensors and calls the backward op, which takes the same
rule. Registered when both this package and ``torch.distributed.tensor`` are imported
(this package does not import it: :mod:`attnres_kernels._when_imported`).
"""

from __future__ import annotations

import torch

from .._when_imported import when_imported

# torch.distributed.tensor's classes, bound when that module is imported (_on_dtensor_import):
# until then no DTensor exists, and this module does not import it (~1 s).
DTensor = Partial = Replicate = Shard = None

NAMESPACES = ("attnres", "attnres_triton", "attnres_emu")

# The site parameters: replicated inputs whose gradients are partial sums over the row shards.
PARAMS = frozenset({"query", "norm_weight", "out_norm_weight"})
# Row arguments with a trailing feature dim D; other row arguments end at the token dims.
ROWS_WITH_D = frozenset({"sources", "prefix_out", "grad_out", "partial", "update", "new_partial", "grad_new_partial"})
# The row argument whose shape (minus D) gives the token dims, by preference.
TOKEN_REFERENCE = ("sources", "new_partial", "update")

# Outputs per op: "row_d" / "row" (token rows with / without D; a list for Tensor[]),
# "param" (a site parameter's gradient, or an empty tensor for an absent input), and for
# attention the argument whose layout the output has.
OUTPUTS = {
    "depth_attn_fwd": ("row_d", "row", "row", "row"),
    "depth_attn_bwd": ("row_d", "param", "param", "row_d", "row", "param"),
    "block_step_fwd": ("row_d", "row_d", "row", "row", "row"),
    "block_step_bwd": ("row_d", "param", "param", "row_d", "row", "param"),
    "attn_fwd": ("q", "q"),
    "attn_bwd": ("q", "k", "v"),
}
ATTENTION_OPS = frozenset({"attn_fwd", "attn_bwd"})
ATTENTION_ROWS = frozenset({"q", "k", "v", "out", "lse", "grad_out", "grad_lse"})


def _bind(func, args, kwargs) -> dict:
    """The op's arguments by schema name (absent optional arguments omitted)."""
    bound = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
    return bound


def is_dtensor(value) -> bool:
    """Whether ``value`` is a DTensor (never, before ``torch.distributed.tensor`` is imported)."""
    return DTensor is not None and isinstance(value, DTensor)


def _dtensors(value):
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, DTensor)]
    return [value] if isinstance(value, DTensor) else []


class _Layout:
    """Where one call's row tensors are sharded: per mesh dim, a token position (an index
    into the token dims ``lead``; for attention, the absolute dim 0 or 1) or None (replicated)."""

    def __init__(self, name: str, bound: dict):
        self.attention = name in ATTENTION_OPS
        self.mesh = None
        for value in bound.values():
            for t in _dtensors(value):
                if self.mesh is None:
                    self.mesh = t.device_mesh
                elif t.device_mesh != self.mesh:
                    raise ValueError(f"attnres::{name}: DTensor arguments on different device meshes")
        if self.attention:
            self.shapes = {k: tuple(bound[k].shape) for k in ("q", "k", "v")}
            self.n_lead = 0
        else:
            ref = next(bound[k] for k in TOKEN_REFERENCE if bound.get(k) is not None)
            ref = ref[0] if isinstance(ref, (list, tuple)) else ref
            self.lead = tuple(ref.shape[:-1])  # global token dims
            self.n_lead = len(self.lead)
        self.positions = [self._pick(bound, m) for m in range(self.mesh.ndim)]

    def _offset(self, name: str, ndim: int) -> int:
        """Dim of the first token dim in a row tensor of ``ndim`` dims."""
        return ndim - (1 if name in ROWS_WITH_D else 0) - self.n_lead

    def _pick(self, bound: dict, mesh_dim: int):
        rows = ATTENTION_ROWS if self.attention else None
        for name, value in bound.items():
            if name in PARAMS or (rows is not None and name not in rows):
                continue
            for t in _dtensors(value):
                placement = t.placements[mesh_dim]
                if not isinstance(placement, Shard):
                    continue
                dim = placement.dim % t.ndim
                if self.attention:
                    if dim in (0, 1):
                        return dim
                else:
                    position = dim - self._offset(name, t.ndim)
                    if 0 <= position < self.n_lead:
                        return position
        return None

    def _row(self, name: str, ndim: int):
        if self.attention:
            return [Replicate() if p is None else Shard(p) for p in self.positions]
        offset = self._offset(name, ndim)
        return [Replicate() if p is None else Shard(offset + p) for p in self.positions]

    def input_placements(self, name: str, t):
        if name in PARAMS:
            return [Replicate()] * self.mesh.ndim
        if self.attention and name == "key_padding_mask":  # [B, Tk]: follows the batch dim only
            return [Shard(0) if p == 0 else Replicate() for p in self.positions]
        return self._row(name, t.ndim)

    def wrap(self, role: str, local: torch.Tensor):
        """The DTensor of one local output of role ``role``."""
        if local.dim() == 1 and local.numel() == 0:  # the placeholder gradient of an absent input
            return DTensor.from_local(local, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if role == "param":  # each rank's gradient covers its rows only
            placements = [Replicate() if p is None else Partial() for p in self.positions]
            return DTensor.from_local(local, self.mesh, placements, run_check=False)
        shape = list(local.shape)
        if self.attention:
            placements = self._row(role, local.dim())
            shape[:2] = self.shapes[role][:2]
        else:
            name = "sources" if role == "row_d" else "lse"
            placements = self._row(name, local.dim())
            offset = self._offset(name, local.dim())
            shape[offset : offset + self.n_lead] = self.lead
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False, shape=torch.Size(shape), stride=_global_stride(local, shape)
        )


def _global_stride(local: torch.Tensor, shape) -> tuple:
    """Strides of a tensor of ``shape`` laid out in the dim order of ``local``."""
    order = sorted(range(local.dim()), key=lambda d: (local.stride(d), local.shape[d]))
    stride, step = [0] * local.dim(), 1
    for d in order:  # innermost first
        stride[d] = step
        step *= max(shape[d], 1)
    return tuple(stride)


def _to_local(layout: _Layout, name: str, value, op: str):
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(layout, name, v, op) for v in value)
    if isinstance(value, DTensor):
        placements = layout.input_placements(name, value)
        if tuple(value.placements) != tuple(placements):
            value = value.redistribute(layout.mesh, placements)
        return value.to_local()
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{op}: argument `{name}` is a plain torch.Tensor while others are DTensors; "
            "pass every tensor argument as a DTensor (e.g. DTensor.from_local or distribute_tensor)"
        )
    return value


def _dtensor_rule(cls, func, types, args, kwargs):
    """``register_torch_dispatch`` rule of a fused op for DTensor arguments."""
    name = func._schema.name.split("::")[-1]
    bound = _bind(func, args, kwargs)
    layout = _Layout(name, bound)
    op = func._schema.name
    local_args = [_to_local(layout, a.name, v, op) for a, v in zip(func._schema.arguments, args)]
    local_kwargs = {k: _to_local(layout, k, v, op) for k, v in kwargs.items()}
    outputs = func(*local_args, **local_kwargs)
    wrapped = []
    for role, out in zip(OUTPUTS[name], outputs):
        if isinstance(out, (list, tuple)):
            wrapped.append([layout.wrap(role, o) for o in out])
        else:
            wrapped.append(layout.wrap(role, out))
    return tuple(wrapped)


_libraries: dict = {}


def register_dtensor_rules(namespaces=NAMESPACES) -> None:
    """Registers the DTensor rule of every fused op in ``namespaces`` (by name: an op
    defined later, such as the Triton ops on first use, gets it too). Idempotent."""
    for namespace in namespaces:
        if namespace in _libraries:
            continue
        lib = torch.library.Library(namespace, "FRAGMENT")
        for name in OUTPUTS:
            torch.library.register_torch_dispatch(f"{namespace}::{name}", DTensor, _dtensor_rule, lib=lib)
        _libraries[namespace] = lib


def _on_dtensor_import(module) -> None:
    """Binds DTensor's classes and registers the rules: ``torch.distributed.tensor`` is imported."""
    global DTensor, Partial, Replicate, Shard
    DTensor, Partial, Replicate, Shard = module.DTensor, module.Partial, module.Replicate, module.Shard
    register_dtensor_rules()


when_imported("torch.distributed.tensor", _on_dtensor_import)
