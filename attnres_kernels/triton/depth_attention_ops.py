"""Launchers of the Triton depth-read kernels: block sizes, source tables, buffers.

Sites are processed in groups of at most ``MULTI_SITE_TILE // BLOCK_D`` (≤ 8) so that
a program's ``[BLOCK_Q, BLOCK_D]`` tile stays in registers; groups after the
first add their source gradients to the first group's. The dispatcher's
choices (:func:`kernel_config`) are exactly what
``python -m attnres_kernels.triton.check`` compiles ahead of time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton.language as tl
from triton.runtime.jit import MockTensor

from .._validation import ReadOptions, accumulation_dtype, promoted_dtype
from . import cdiv, max_dim, next_power_of_2
from .depth_attention_kernels import column_sum_kernel, depth_attn_bwd_kernel, depth_attn_fwd_kernel

MAX_BLOCK_Q = 8
MULTI_SITE_TILE = 4096  # max [BLOCK_Q, BLOCK_D] elements when BLOCK_Q > 1 (one site may use BLOCK_D = MAX_DIM)
MIN_BLOCK_D = 128  # narrower rows are masked: keeps the set of compiled configurations small
# Rows per backward program: fixes the partition of the row reductions. Fewer rows, more programs in
# flight: on an H100 (bf16, N = 9, M = 8192, forward + backward device time) 4 / 8 / 16 / 32 rows took
# 341 / 322 / 399 / 584 µs at D = 1024, 1375 / 1378 / 1413 / 1405 at D = 4096 and, at Q = 4 and
# D = 2048, 1649 / 1581 / 1570 / 1557.
BWD_ROWS = 8
COLUMN_SUM_PARTS, COLUMN_SUM_COLS = 128, 32  # column_sum_kernel's tile: 32 fp32 columns = one 128-byte line
# Source dtypes in the kernels' slot order (see kernels.py). Under autocast the fp32 embedding comes
# first and bf16/fp16 sublayer outputs after it, so the usual lists are already in slot order.
SLOT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_SLOT_OF = {dtype: k for k, dtype in enumerate(SLOT_DTYPES)}


@dataclass(frozen=True)
class KernelConfig:
    block_d: int
    block_q: int
    fwd_warps: int
    bwd_warps: int

    def launch_options(self, backward: bool) -> dict:
        """Warps of the forward or backward kernel, and a per-thread register cap for ptxas
        (``maxnreg``): all the registers an SM can give one program. Without the cap ptxas
        picks a lower target on its own and spills a few bytes in the backward."""
        warps = self.bwd_warps if backward else self.fwd_warps
        return dict(num_warps=warps, maxnreg=min(255, 65536 // (32 * warps)))


def kernel_config(dim: int, num_queries: int, dtype: torch.dtype) -> KernelConfig:
    """Tile and warp counts for a read of width ``dim`` over ``num_queries`` sites.

    ``BLOCK_D`` covers the whole row; ``BLOCK_Q`` is the site group (a power of
    two; a group of several sites keeps its tile ≤ ``MULTI_SITE_TILE``
    registers). Warps, up to 16: the forward has one per 1024 tile registers
    (32 per thread), the backward, which keeps more rows live, one per 512 (16
    per thread); fp64 accumulators take two registers per element. Fewer warps
    per row leave more rows in flight per SM: on an H100 (bf16, N = 9, M = 8192)
    the forward took 71 / 82 / 161 µs with 1 / 2 / 8 warps at D = 1024, and
    298 / 399 µs with 4 / 8 warps at D = 4096. These limits keep every
    configuration free of register spills on sm_80/sm_90 (see ``python -m
    attnres_kernels.triton.check``; at 64 registers per thread both kernels spill
    with fp32 rows)."""
    if not 1 <= dim <= max_dim(dtype):
        raise ValueError(f"the Triton depth read supports 1 <= D <= {max_dim(dtype)} for {dtype}, got D = {dim}")
    words = 2 if dtype == torch.float64 else 1
    block_d = max(MIN_BLOCK_D, next_power_of_2(dim))
    block_q = max(1, min(next_power_of_2(num_queries), MAX_BLOCK_Q // words, MULTI_SITE_TILE // (block_d * words)))
    tile = block_q * block_d * words
    return KernelConfig(block_d, block_q, max(1, min(16, tile // 1024)), max(1, min(16, tile // 512)))


def all_kernel_configs(dtype: torch.dtype) -> list:
    """Every configuration :func:`kernel_config` can return for ``dtype`` sources."""
    configs = set()
    for exp_d in range(max_dim(dtype).bit_length()):
        for exp_q in range(MAX_BLOCK_Q.bit_length()):
            configs.add(kernel_config(1 << exp_d, 1 << exp_q, dtype))
    return sorted(configs, key=lambda c: (c.block_d, c.block_q))


class AotLaunch(NamedTuple):
    """One kernel launch for the ahead-of-time check: the JIT function, its
    arguments (``MockTensor`` for pointers), constexprs and launch options."""

    name: str
    config: str
    kernel: object
    args: list
    constexprs: dict
    options: dict


def _config_launches(cfg: KernelConfig, dtype: torch.dtype):
    """The launches of one configuration for reads whose promoted dtype is ``dtype``:
    realistic pointer/int arguments, every source slot present (one compiled kernel
    serves every mix of source dtypes), every optional feature switched on."""
    acc_torch, acc_tl = _acc_dtypes(dtype)
    out, acc, table = MockTensor(dtype), MockTensor(acc_torch), MockTensor(torch.int64)
    slots = tuple(None if _absent_slot(k, acc_torch) else MockTensor(dt) for k, dt in enumerate(SLOT_DTYPES))
    tile = dict(BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, ACC=acc_tl, ALIGNED=True)
    m, d, n, nq = 4096, 1024, 9, 2
    bounds = (0, 2, 5, 7, n)
    label = f"BLOCK_D={cfg.block_d} BLOCK_Q={cfg.block_q} warps={cfg.fwd_warps}/{cfg.bwd_warps}"
    yield AotLaunch(
        "depth_attn_fwd",
        label,
        depth_attn_fwd_kernel,
        [slots, table, table, *bounds[1:], acc, out, acc, acc, out, acc, acc, acc, m, d, nq, n * m],
        dict(EPS=1e-6, OUT_EPS=1e-6, HAS_PREFIX=True, HAS_OUT_NORM=True, NORMALIZE_VALUES=True, **tile),
        cfg.launch_options(backward=False),
    )
    for out_norm in (True, False):
        args = [slots, table, table, slots, table, *bounds[1:], out, acc, acc, acc, acc, acc, acc, out, acc, out, acc]
        yield AotLaunch(
            f"depth_attn_bwd[out_norm={int(out_norm)}]",
            label,
            depth_attn_bwd_kernel,
            [*args, acc, acc, m, d, nq, n * m],
            dict(
                OUT_EPS=1e-6,
                HAS_OUT_NORM=out_norm,
                HAS_PREFIX=True,
                HAS_DLSE=True,
                HAS_DLOGITS=True,
                NORMALIZE_VALUES=True,
                ACCUMULATE_DV=True,
                ROWS=BWD_ROWS,
                **tile,
            ),
            cfg.launch_options(backward=True),
        )


def aot_launches(dtype: torch.dtype) -> list:
    """Every launch the dispatcher can make for ``dtype`` sources, for the ahead-of-time
    check (:mod:`attnres_kernels.triton.check`)."""
    launches = [launch for cfg in all_kernel_configs(dtype) for launch in _config_launches(cfg, dtype)]
    if dtype == torch.float32:  # the partials of the row reductions are fp32/fp64 whatever the sources
        part = MockTensor(torch.float32)
        launches.append(
            AotLaunch(
                "column_sum",
                f"BLOCK_PARTS={COLUMN_SUM_PARTS} BLOCK_COLS={COLUMN_SUM_COLS} warps=4",
                column_sum_kernel,
                [part, part, 512, 4096],
                dict(BLOCK_PARTS=COLUMN_SUM_PARTS, BLOCK_COLS=COLUMN_SUM_COLS),
                dict(num_warps=4),
            )
        )
    return launches


def _acc_dtypes(dtype: torch.dtype):
    """The accumulation dtype of reads whose promoted dtype is ``dtype``, in torch and Triton."""
    acc = accumulation_dtype(dtype)
    return acc, (tl.float64 if acc == torch.float64 else tl.float32)


def _absent_slot(slot: int, acc: torch.dtype) -> bool:
    """The fp64 slot is compiled only into fp64-accumulating kernels (an fp64 source makes
    the promoted dtype fp64)."""
    return SLOT_DTYPES[slot] == torch.float64 and acc != torch.float64


class SlotLayout(NamedTuple):
    """Where each source goes in the kernels' slot order (see kernels.py)."""

    order: list | None  # source indices in slot order; None when the sources already are in slot order
    bounds: tuple  # slot k holds the sources bounds[k] <= i < bounds[k + 1] (in slot order)

    def arrange(self, items: list) -> list:
        """``items`` (one per source) in slot order."""
        return items if self.order is None else [items[i] for i in self.order]


def _slot_layout(sources) -> SlotLayout:
    dtype = sources[0].dtype
    if all(s.dtype is dtype for s in sources):  # one dtype, the usual case: one slot holds every source
        slot = _SLOT_OF[dtype]
        return SlotLayout(None, (0,) * (slot + 1) + (len(sources),) * (len(SLOT_DTYPES) - slot))
    slots = [_SLOT_OF[s.dtype] for s in sources]
    bounds = [0] * (len(SLOT_DTYPES) + 1)
    for k in slots:
        bounds[k + 1] += 1
    for k in range(len(SLOT_DTYPES)):
        bounds[k + 1] += bounds[k]
    in_order = all(a <= b for a, b in zip(slots, slots[1:]))
    return SlotLayout(None if in_order else sorted(range(len(slots)), key=slots.__getitem__), tuple(bounds))


@functools.cache
def _empty(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Base pointer of a slot that no source uses (its loop runs zero times)."""
    return torch.empty(0, dtype=dtype, device=device)


def _slot_bases(tensors: list, bounds: tuple, acc: torch.dtype) -> tuple:
    """The base tensor of each slot: its first source, an empty tensor of the slot's dtype
    when no source has it, or None for a slot the kernel is compiled without."""
    bases = []
    for k, dtype in enumerate(SLOT_DTYPES):
        if _absent_slot(k, acc):
            bases.append(None)
        elif bounds[k] < bounds[k + 1]:
            bases.append(tensors[bounds[k]])
        else:
            bases.append(_empty(tensors[0].device, dtype))
    return tuple(bases)


def _slot_offsets(tensors: list, pointers: list, bounds: tuple) -> list:
    """Element offset of each tensor's data (``pointers``) from the first tensor of its slot (slot order)."""
    offsets = []
    for k in range(len(SLOT_DTYPES)):
        first, end = bounds[k], bounds[k + 1]
        if first < end:
            base, size = pointers[first], tensors[first].element_size()
            offsets += [(p - base) // size for p in pointers[first:end]]
    return offsets


# The int64 tables of recent launches, by content (and stream): a read whose sources lie as before relative to
# each other (the next training step, where the caching allocator hands out the same addresses) reuses the device
# copy instead of paying a pinned host-to-device copy per launch. A table is never written once made, and is read
# only on the stream its copy was queued on; none is kept while a CUDA graph is captured (the graph could outlive
# the cache entry). A table made during a capture is copied from pinned host memory each time the graph replays:
# that host memory is kept for the life of the process (a few hundred bytes per captured launch), so that no
# later allocation can reuse it under a graph.
_TABLES: dict = {}
_MAX_TABLES = 4096
_CAPTURED_HOST_TABLES: list = []


def _int64_tables(parts: tuple, device: torch.device) -> tuple:
    """The int64 lists ``parts`` as tensors on ``device``: views of one table, made with one copy."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return _make_tables(parts, device, keep_host_copy=True)
        key = (device, torch.cuda.current_stream(device).cuda_stream, *map(tuple, parts))
    else:
        key = (device, *map(tuple, parts))
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        tables = _TABLES[key] = _make_tables(parts, device)
    return tables


def _make_tables(parts: tuple, device: torch.device, keep_host_copy: bool = False) -> tuple:
    table = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
    if device.type == "cuda":  # pinned + non_blocking: no stream synchronization
        pinned = table.pin_memory()
        if keep_host_copy:
            _CAPTURED_HOST_TABLES.append(pinned)
        table = pinned.to(device, non_blocking=True)
    return tuple(table.split([len(part) for part in parts]))


def _aligned(tensors: list, pointers: list, row_strides: list) -> bool:
    """Whether every row of every tensor starts 16-byte aligned. (A plain loop: it runs per source on
    every launch, and ``all`` over a generator cost twice as much.)"""
    for t, p, stride in zip(tensors, pointers, row_strides):
        if p % 16 or (stride * t.itemsize) % 16:
            return False
    return True


def _row_layouts(tensors: list, dim: int) -> tuple:
    """``(rows, row_strides)``: each tensor as ``M`` rows of ``dim`` unit-stride elements, given by a
    tensor whose data starts at row 0 and the stride between its rows (in elements). A contiguous
    tensor is its own rows (no view is built: this runs per source on every launch); otherwise an
    ``[M, D]`` view, a copy only when the layout needs one."""
    rows, row_strides = [], []
    for t in tensors:
        if t.is_contiguous():
            rows.append(t)
            row_strides.append(dim)
        else:
            r = t.reshape(-1, dim)
            r = r if r.stride(1) == 1 else r.contiguous()
            rows.append(r)
            row_strides.append(r.stride(0))
    return rows, row_strides


def _site_rows(t: torch.Tensor | None, q0: int, q1: int) -> torch.Tensor | None:
    """Sites ``q0 <= q < q1`` of a ``[Q, ...]`` tensor: the tensor itself when that is all of them (one site
    group, the usual launch: no view op per argument), None for an absent one."""
    return t if t is None or (q0 == 0 and q1 == t.shape[0]) else t[q0:q1]


def _site_groups(num_queries: int, block_q: int):
    return [(q, min(num_queries, q + block_q)) for q in range(0, num_queries, block_q)]


def _site_params(query, norm_weight, out_norm_weight, acc: torch.dtype, scale: float):
    """``u = scale · query ⊙ norm_weight`` and the output-norm weight as contiguous ``[Q, D]``
    accumulation-dtype tensors (``[D]`` parameters are shared by the Q sites)."""
    shape = (query.shape[0] if query.dim() == 2 else 1, query.shape[-1])
    u = _as_dtype(query, acc).expand(shape)
    if norm_weight is not None:
        u = u * _as_dtype(norm_weight, acc)
    if scale != 1.0:
        u = u * scale
    g = _as_dtype(out_norm_weight, acc).expand(shape).contiguous() if out_norm_weight is not None else None
    return u.contiguous(), g


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call when ``t`` has that dtype already (the usual fp32 parameters)."""
    return t if t.dtype is dtype else t.to(dtype)


def _param_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A ``[Q, D]`` gradient summed to the parameter's shape and cast to its dtype (one site: its row,
    no reduction kernel)."""
    if param.dim() == 1:
        grad = grad[0] if grad.shape[0] == 1 else grad.sum(0)
    return _as_dtype(grad, param.dtype)


def _order_index(layout: SlotLayout, device: torch.device) -> torch.Tensor:
    """The slot order as an int64 device tensor (through the launch tables: no synchronizing copy, none in a
    CUDA graph capture)."""
    return _int64_tables((layout.order,), device)[0]


def _dtypes(sources, prefix_out, options: ReadOptions) -> tuple:
    """``(out_dtype, compute_dtype)``: the output's dtype (``options.out_dtype`` or the
    promotion of the inputs) and the promotion of both, whose accumulation dtype the
    kernels use."""
    input_dtype = promoted_dtype([*sources, prefix_out])
    out_dtype = options.out_dtype or input_dtype
    return out_dtype, torch.promote_types(input_dtype, out_dtype)


def _check_full_width_keys(options: ReadOptions, dim: int) -> None:
    if options.key_rank not in (None, dim):
        raise RuntimeError("depth attention (triton): sliced low-rank keys (key_rank < D) have no Triton kernel yet")


def depth_attn_fwd(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, *options):
    """Forward of the op schema in :mod:`attnres_kernels.ops._registration`."""
    options = ReadOptions(*options)
    first = sources[0]
    _check_full_width_keys(options, first.shape[-1])
    dim, lead = first.shape[-1], first.shape[:-1]
    out_dtype, compute_dtype = _dtypes(sources, prefix_out, options)
    acc_torch, acc_tl = _acc_dtypes(compute_dtype)
    u, g = _site_params(query, norm_weight, out_norm_weight, acc_torch, options.scale)
    m, n, q = first.numel() // dim, len(sources), u.shape[0]
    q_dims = tuple(query.shape[:-1])
    cfg = kernel_config(dim, q, compute_dtype)
    outputs = (
        first.new_empty((*q_dims, *lead, dim), dtype=out_dtype),
        first.new_empty((*q_dims, *lead), dtype=acc_torch),
        first.new_empty((*q_dims, n, *lead), dtype=acc_torch),
        first.new_empty((n, *lead), dtype=acc_torch),
    )
    if m == 0:
        return outputs
    layout = _slot_layout(sources)
    rows, row_strides = _row_layouts(layout.arrange(sources), dim)
    # [Q, ...] views of the per-site tensors, sliced per site group below; logits and rinv
    # are written in slot order, into the outputs when that is the sources' own order.
    out, lse = outputs[0].view(q, m, dim), outputs[1].view(q, m)
    logits, rinv = outputs[2].view(q, n, m), outputs[3].view(n, m)
    if layout.order is not None:
        logits, rinv = torch.empty_like(logits), torch.empty_like(rinv)
    pointers = [r.data_ptr() for r in rows]
    offsets, strides = _int64_tables((_slot_offsets(rows, pointers, layout.bounds), row_strides), first.device)
    bases = _slot_bases(rows, layout.bounds, acc_torch)
    has_prefix = prefix_out is not None
    if has_prefix:
        prefix_out, prefix_lse = prefix_out.reshape(q, m, dim).contiguous(), prefix_lse.reshape(q, m).contiguous()
    for q0, q1 in _site_groups(q, cfg.block_q):
        depth_attn_fwd_kernel[(m,)](
            bases,
            offsets,
            strides,
            *layout.bounds[1:],
            _site_rows(u, q0, q1),
            _site_rows(prefix_out, q0, q1),
            _site_rows(prefix_lse, q0, q1),
            _site_rows(g, q0, q1),
            _site_rows(out, q0, q1),
            _site_rows(lse, q0, q1),
            _site_rows(logits, q0, q1),
            rinv,
            m,
            dim,
            q1 - q0,
            n * m,
            EPS=options.eps,
            OUT_EPS=options.out_norm_eps,
            HAS_PREFIX=has_prefix,
            HAS_OUT_NORM=g is not None,
            NORMALIZE_VALUES=options.normalize_values,
            BLOCK_Q=cfg.block_q,
            BLOCK_D=cfg.block_d,
            ACC=acc_tl,
            ALIGNED=_aligned(rows, pointers, row_strides),
            **cfg.launch_options(backward=False),
        )
    if layout.order is not None:  # back to the sources' order
        order = _order_index(layout, first.device)
        outputs[2].view(q, n, m).index_copy_(1, order, logits)
        outputs[3].view(n, m).index_copy_(0, order, rinv)
    return outputs


def column_sum(part: torch.Tensor, out: torch.Tensor) -> None:
    """``out = part.sum(0)`` in a fixed order (see :func:`column_sum_kernel`); ``part`` is contiguous."""
    n_parts = part.shape[0]
    n_cols = part.numel() // n_parts
    column_sum_kernel[(cdiv(n_cols, COLUMN_SUM_COLS),)](
        part, out, n_parts, n_cols, BLOCK_PARTS=COLUMN_SUM_PARTS, BLOCK_COLS=COLUMN_SUM_COLS, num_warps=4
    )


def depth_attn_bwd(
    grad_out,
    grad_lse,
    grad_logits,
    sources,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    logits,
    rinv,
    *options,
):
    """Backward of the op schema in :mod:`attnres_kernels.ops._registration`."""
    options = ReadOptions(*options)
    first = sources[0]
    _check_full_width_keys(options, first.shape[-1])
    _, compute_dtype = _dtypes(sources, prefix_out, options)
    acc_torch, _ = _acc_dtypes(compute_dtype)
    u, g = _site_params(query, norm_weight, out_norm_weight, acc_torch, options.scale)
    # Every gradient is allocated contiguous (the kernels write row-major), whatever the input strides,
    # each in its source's dtype.
    grad_sources = [s.new_empty(s.shape) for s in sources]
    has_prefix, has_norm = prefix_out is not None, out_norm_weight is not None
    grad_prefix_out = prefix_out.new_zeros(prefix_out.shape) if has_prefix else first.new_empty((0,))
    grad_prefix_lse = prefix_lse.new_zeros(prefix_lse.shape) if has_prefix else u.new_empty((0,))
    # With rows, the column sums write every entry of grad_u and grad_g; without, they are zero.
    new_param_grad = u.new_empty if first.numel() > 0 else u.new_zeros
    grad_u = new_param_grad(u.shape)
    grad_g = new_param_grad(u.shape) if has_norm else None
    if first.numel() > 0:
        _depth_attn_bwd_launch(
            grad_out, grad_lse, grad_logits, sources, grad_sources, u, g, prefix_out, prefix_lse, logits, rinv, options,
            grad_u, grad_prefix_out, grad_prefix_lse, grad_g, compute_dtype,
        )  # fmt: skip
    else:
        for gs in grad_sources:
            gs.zero_()
    if options.scale != 1.0:  # grad_u is the gradient of u = scale · query ⊙ norm_weight
        grad_u = grad_u * options.scale
    if norm_weight is not None:
        grad_query = _param_grad(grad_u * _as_dtype(norm_weight, acc_torch), query)
        grad_norm = _param_grad(grad_u * _as_dtype(query, acc_torch), norm_weight)
    else:
        grad_query, grad_norm = _param_grad(grad_u, query), u.new_empty((0,))
    grad_out_norm = _param_grad(grad_g, out_norm_weight) if has_norm else u.new_empty((0,))
    return grad_sources, grad_query, grad_norm, grad_prefix_out, grad_prefix_lse, grad_out_norm


def _depth_attn_bwd_launch(
    grad_out, grad_lse, grad_logits, sources, grad_sources, u, g, prefix_out, prefix_lse, logits, rinv, options,
    grad_u, grad_prefix_out, grad_prefix_lse, grad_g, compute_dtype,
):  # fmt: skip
    """The backward kernel launches over site groups; ``grad_*`` are written in place."""
    first, dim = sources[0], sources[0].shape[-1]
    acc_torch, acc_tl = _acc_dtypes(compute_dtype)
    layout = _slot_layout(sources)
    rows, row_strides = _row_layouts(layout.arrange(sources), dim)
    grad_rows = layout.arrange(grad_sources)  # contiguous: their rows are dim apart
    m, n, q = first.numel() // dim, len(rows), u.shape[0]
    cfg = kernel_config(dim, q, compute_dtype)
    has_prefix, has_norm = prefix_out is not None, g is not None
    pointers, grad_pointers = [r.data_ptr() for r in rows], [r.data_ptr() for r in grad_rows]
    offsets, strides, grad_offsets = _int64_tables(
        (
            _slot_offsets(rows, pointers, layout.bounds),
            row_strides,
            _slot_offsets(grad_rows, grad_pointers, layout.bounds),
        ),
        first.device,
    )
    bases, grad_bases = _slot_bases(rows, layout.bounds, acc_torch), _slot_bases(grad_rows, layout.bounds, acc_torch)
    dy = grad_out.reshape(q, m, dim).contiguous()
    logits, rinv = logits.reshape(q, n, m), rinv.reshape(n, m)
    dlogits = grad_logits.reshape(q, n, m) if grad_logits is not None else None
    if layout.order is not None:  # the per-source scalars in slot order, like the sources
        order = _order_index(layout, first.device)
        logits, rinv = logits.index_select(1, order), rinv.index_select(0, order)
        dlogits = dlogits.index_select(1, order) if dlogits is not None else None
    logits, rinv = logits.contiguous(), rinv.contiguous()
    dlogits = dlogits.contiguous() if dlogits is not None else None
    dlse = grad_lse.reshape(q, m).contiguous() if grad_lse is not None else None
    if has_prefix:
        prefix_out, prefix_lse = prefix_out.reshape(q, m, dim).contiguous(), prefix_lse.reshape(q, m).contiguous()
        grad_prefix_out, grad_prefix_lse = grad_prefix_out.view(q, m, dim), grad_prefix_lse.view(q, m)
    n_programs = cdiv(m, BWD_ROWS)
    for group, (q0, q1) in enumerate(_site_groups(q, cfg.block_q)):
        nq = q1 - q0
        du_part = first.new_empty((n_programs, nq, dim), dtype=acc_torch)
        dg_part = first.new_empty((n_programs, nq, dim), dtype=acc_torch) if has_norm else None
        depth_attn_bwd_kernel[(n_programs,)](
            bases,
            offsets,
            strides,
            grad_bases,
            grad_offsets,
            *layout.bounds[1:],
            _site_rows(dy, q0, q1),
            _site_rows(u, q0, q1),
            _site_rows(g, q0, q1),
            _site_rows(dlse, q0, q1),
            _site_rows(logits, q0, q1),
            _site_rows(dlogits, q0, q1),
            rinv,
            _site_rows(prefix_out, q0, q1),
            _site_rows(prefix_lse, q0, q1),
            _site_rows(grad_prefix_out, q0, q1) if has_prefix else None,
            _site_rows(grad_prefix_lse, q0, q1) if has_prefix else None,
            du_part,
            dg_part,
            m,
            dim,
            nq,
            n * m,
            OUT_EPS=options.out_norm_eps,
            HAS_OUT_NORM=has_norm,
            HAS_PREFIX=has_prefix,
            HAS_DLSE=dlse is not None,
            HAS_DLOGITS=dlogits is not None,
            NORMALIZE_VALUES=options.normalize_values,
            ACCUMULATE_DV=group > 0,
            ROWS=BWD_ROWS,
            BLOCK_Q=cfg.block_q,
            BLOCK_D=cfg.block_d,
            ACC=acc_tl,
            ALIGNED=_aligned(rows, pointers, row_strides) and _aligned(grad_rows, grad_pointers, [dim] * n),
            **cfg.launch_options(backward=True),
        )
        column_sum(du_part, _site_rows(grad_u, q0, q1))
        if has_norm:
            column_sum(dg_part, _site_rows(grad_g, q0, q1))
