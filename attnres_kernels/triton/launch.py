"""Launchers of the Triton depth-read kernels: block sizes, source tables, buffers.

Sites are processed in groups of at most ``MULTI_SITE_TILE // BLOCK_D`` (≤ 8) so that
a program's ``[BLOCK_Q, BLOCK_D]`` tile stays in registers; groups after the
first add their source gradients to the first group's. The dispatcher's
choices (:func:`kernel_config`) are exactly what
``python -m attnres_kernels.triton.check`` compiles ahead of time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import MockTensor

from . import max_dim
from .kernels import column_sum_kernel, depth_attn_bwd_kernel, depth_attn_fwd_kernel

MAX_BLOCK_Q = 8
MULTI_SITE_TILE = 4096  # max [BLOCK_Q, BLOCK_D] elements when BLOCK_Q > 1 (one site may use BLOCK_D = MAX_DIM)
MIN_BLOCK_D = 128  # narrower rows are masked: keeps the set of compiled configurations small
BWD_ROWS = 16  # rows per backward program: fixes the partition of the row reductions
COLUMN_SUM_BLOCK = 1024


@dataclass(frozen=True)
class KernelConfig:
    block_d: int
    block_q: int
    num_warps: int

    @property
    def max_registers(self) -> int:
        """Per-thread register cap passed to ptxas (``maxnreg``): all the
        registers an SM can give one program. Without it ptxas picks a lower
        target on its own and spills a few bytes in the backward."""
        return min(255, 65536 // (32 * self.num_warps))

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, maxnreg=self.max_registers)


def kernel_config(dim: int, num_queries: int, dtype: torch.dtype) -> KernelConfig:
    """Tile and warp count for a read of width ``dim`` over ``num_queries`` sites.

    ``BLOCK_D`` covers the whole row; ``BLOCK_Q`` is the site group (a power of
    two; a group of several sites keeps its tile ≤ ``MULTI_SITE_TILE``
    registers); one warp per 512 tile registers (16 per thread) up to 16
    warps. fp64 accumulators take two registers per element. These limits keep
    every configuration free of register spills on sm_80/sm_90 (see
    ``python -m attnres_kernels.triton.check``)."""
    if not 1 <= dim <= max_dim(dtype):
        raise ValueError(f"the Triton depth read supports 1 <= D <= {max_dim(dtype)} for {dtype}, got D = {dim}")
    words = 2 if dtype == torch.float64 else 1
    block_d = max(MIN_BLOCK_D, triton.next_power_of_2(dim))
    block_q = max(
        1, min(triton.next_power_of_2(num_queries), MAX_BLOCK_Q // words, MULTI_SITE_TILE // (block_d * words))
    )
    num_warps = max(1, min(16, block_q * block_d * words // 512))
    return KernelConfig(block_d, block_q, num_warps)


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
    """The launches of one configuration: realistic pointer/int arguments,
    every optional feature switched on."""
    acc_torch = torch.float64 if dtype == torch.float64 else torch.float32
    acc_tl = tl.float64 if dtype == torch.float64 else tl.float32
    src, acc, table = MockTensor(dtype), MockTensor(acc_torch), MockTensor(torch.int64)
    tile = dict(BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, ACC=acc_tl, ALIGN=16 // src.dtype.itemsize)
    m, d, n, nq = 4096, 1024, 9, 2
    label = f"BLOCK_D={cfg.block_d} BLOCK_Q={cfg.block_q} warps={cfg.num_warps}"
    yield AotLaunch(
        "depth_attn_fwd",
        label,
        depth_attn_fwd_kernel,
        [src, table, table, n, acc, src, acc, acc, src, acc, acc, acc, m, d, nq, n * m],
        dict(EPS=1e-6, HAS_PREFIX=True, HAS_OUT_NORM=True, **tile),
        cfg.launch_options(),
    )
    for out_norm in (True, False):
        yield AotLaunch(
            f"depth_attn_bwd[out_norm={int(out_norm)}]",
            label,
            depth_attn_bwd_kernel,
            [
                src,
                table,
                table,
                src,
                table,
                n,
                src,
                acc,
                acc,
                acc,
                acc,
                acc,
                acc,
                src,
                acc,
                src,
                acc,
                acc,
                acc,
                m,
                d,
                nq,
                n * m,
            ],
            dict(
                EPS=1e-6,
                HAS_OUT_NORM=out_norm,
                HAS_PREFIX=True,
                HAS_DLSE=True,
                HAS_DLOGITS=True,
                ACCUMULATE_DV=True,
                ROWS=BWD_ROWS,
                **tile,
            ),
            cfg.launch_options(),
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
                f"BLOCK={COLUMN_SUM_BLOCK} warps=4",
                column_sum_kernel,
                [part, part, 64, 4096],
                dict(BLOCK=COLUMN_SUM_BLOCK),
                dict(num_warps=4),
            )
        )
    return launches


def _acc_dtypes(dtype: torch.dtype):
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[M, D]`` view with unit column stride (a copy only when the layout needs one)."""
    r = t.reshape(-1, dim)
    return r if r.stride(1) == 1 else r.contiguous()


def _int64_table(values: list, device: torch.device) -> torch.Tensor:
    table = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":  # pinned + non_blocking: no stream synchronization
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def _offsets(tensors: list) -> list:
    """Element offsets of each tensor's data from the first one's."""
    base, itemsize = tensors[0].data_ptr(), tensors[0].element_size()
    return [(t.data_ptr() - base) // itemsize for t in tensors]


def _alignment(tensors: list) -> int:
    """``ALIGN``: elements per 16 bytes if every row of every tensor starts 16-byte aligned, else 1."""
    itemsize = tensors[0].element_size()
    aligned = all(t.data_ptr() % 16 == 0 and (t.stride(0) * itemsize) % 16 == 0 for t in tensors)
    return 16 // itemsize if aligned else 1


def _site_groups(num_queries: int, block_q: int):
    return [(q, min(num_queries, q + block_q)) for q in range(0, num_queries, block_q)]


def _site_params(query, norm_weight, out_norm_weight, acc: torch.dtype):
    """``u = query ⊙ norm_weight`` and the output-norm weight as contiguous ``[Q, D]``
    accumulation-dtype tensors (``[D]`` parameters are shared by the Q sites)."""
    shape = (query.shape[0] if query.dim() == 2 else 1, query.shape[-1])
    u = query.to(acc).expand(shape)
    if norm_weight is not None:
        u = u * norm_weight.to(acc)
    g = out_norm_weight.to(acc).expand(shape).contiguous() if out_norm_weight is not None else None
    return u.contiguous(), g


def _param_grad(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A ``[Q, D]`` gradient summed to the parameter's shape and cast to its dtype."""
    return (grad.sum(0) if param.dim() == 1 else grad).to(param.dtype)


def depth_attn_fwd(sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps: float):
    """Forward of the op schema in :mod:`attnres_kernels.ops._registration`."""
    first = sources[0]
    dim, lead = first.shape[-1], first.shape[:-1]
    rows = [_rows(s, dim) for s in sources]
    acc_torch, acc_tl = _acc_dtypes(first.dtype)
    u, g = _site_params(query, norm_weight, out_norm_weight, acc_torch)
    m, n, q = rows[0].shape[0], len(rows), u.shape[0]
    q_dims = tuple(query.shape[:-1])
    cfg = kernel_config(dim, q, first.dtype)
    outputs = (
        first.new_empty((*q_dims, *lead, dim)),
        first.new_empty((*q_dims, *lead), dtype=acc_torch),
        first.new_empty((*q_dims, n, *lead), dtype=acc_torch),
        first.new_empty((n, *lead), dtype=acc_torch),
    )
    if m == 0:
        return outputs
    # [Q, ...] views of the per-site tensors, sliced per site group below.
    out, lse, logits = outputs[0].view(q, m, dim), outputs[1].view(q, m), outputs[2].view(q, n, m)
    rinv = outputs[3]
    offsets = _int64_table(_offsets(rows), first.device)
    strides = _int64_table([r.stride(0) for r in rows], first.device)
    has_prefix = prefix_out is not None
    if has_prefix:
        prefix_out, prefix_lse = prefix_out.reshape(q, m, dim).contiguous(), prefix_lse.reshape(q, m).contiguous()
    for q0, q1 in _site_groups(q, cfg.block_q):
        depth_attn_fwd_kernel[(m,)](
            rows[0],
            offsets,
            strides,
            n,
            u[q0:q1],
            prefix_out[q0:q1] if has_prefix else None,
            prefix_lse[q0:q1] if has_prefix else None,
            g[q0:q1] if g is not None else None,
            out[q0:q1],
            lse[q0:q1],
            logits[q0:q1],
            rinv,
            m,
            dim,
            q1 - q0,
            n * m,
            EPS=eps,
            HAS_PREFIX=has_prefix,
            HAS_OUT_NORM=g is not None,
            BLOCK_Q=cfg.block_q,
            BLOCK_D=cfg.block_d,
            ACC=acc_tl,
            ALIGN=_alignment(rows),
            **cfg.launch_options(),
        )
    return outputs


def _column_sum(part: torch.Tensor, out: torch.Tensor) -> None:
    n_parts, n_cols = part.shape[0], part[0].numel()
    column_sum_kernel[(triton.cdiv(n_cols, COLUMN_SUM_BLOCK),)](part, out, n_parts, n_cols, BLOCK=COLUMN_SUM_BLOCK)


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
    eps: float,
):
    """Backward of the op schema in :mod:`attnres_kernels.ops._registration`."""
    first = sources[0]
    dim = first.shape[-1]
    rows = [_rows(s, dim) for s in sources]
    acc_torch, acc_tl = _acc_dtypes(first.dtype)
    u, g = _site_params(query, norm_weight, out_norm_weight, acc_torch)
    m, q = rows[0].shape[0], u.shape[0]
    cfg = kernel_config(dim, q, first.dtype)
    # Every gradient is allocated contiguous (the kernels write row-major), whatever the input strides.
    grad_sources = [first.new_empty(s.shape) for s in sources]
    grad_u = u.new_zeros(u.shape)
    has_prefix, has_norm = prefix_out is not None, out_norm_weight is not None
    grad_prefix_out = prefix_out.new_zeros(prefix_out.shape) if has_prefix else first.new_empty((0,))
    grad_prefix_lse = prefix_lse.new_zeros(prefix_lse.shape) if has_prefix else u.new_empty((0,))
    grad_g = u.new_zeros(u.shape) if has_norm else None
    if m > 0:
        _depth_attn_bwd_launch(
            grad_out, grad_lse, grad_logits, rows, grad_sources, u, g, prefix_out, prefix_lse, logits, rinv, eps,
            grad_u, grad_prefix_out, grad_prefix_lse, grad_g, cfg, acc_torch, acc_tl,
        )  # fmt: skip
    else:
        for gs in grad_sources:
            gs.zero_()
    if norm_weight is not None:
        grad_query = _param_grad(grad_u * norm_weight.to(acc_torch), query)
        grad_norm = _param_grad(grad_u * query.to(acc_torch), norm_weight)
    else:
        grad_query, grad_norm = _param_grad(grad_u, query), u.new_empty((0,))
    grad_out_norm = _param_grad(grad_g, out_norm_weight) if has_norm else u.new_empty((0,))
    return grad_sources, grad_query, grad_norm, grad_prefix_out, grad_prefix_lse, grad_out_norm


def _depth_attn_bwd_launch(
    grad_out, grad_lse, grad_logits, rows, grad_sources, u, g, prefix_out, prefix_lse, logits, rinv, eps,
    grad_u, grad_prefix_out, grad_prefix_lse, grad_g, cfg, acc_torch, acc_tl,
):  # fmt: skip
    """The backward kernel launches over site groups; ``grad_*`` are written in place."""
    first, dim = rows[0], rows[0].shape[1]
    m, n, q = first.shape[0], len(rows), u.shape[0]
    has_prefix, has_norm = prefix_out is not None, g is not None
    grad_rows = [gs.view(m, dim) for gs in grad_sources]
    offsets = _int64_table(_offsets(rows), first.device)
    strides = _int64_table([r.stride(0) for r in rows], first.device)
    grad_offsets = _int64_table(_offsets(grad_rows), first.device)
    align = min(_alignment(rows), _alignment(grad_rows))
    dy = grad_out.reshape(q, m, dim).contiguous()
    logits, rinv = logits.reshape(q, n, m).contiguous(), rinv.contiguous()
    dlse = grad_lse.reshape(q, m).contiguous() if grad_lse is not None else None
    dlogits = grad_logits.reshape(q, n, m).contiguous() if grad_logits is not None else None
    if has_prefix:
        prefix_out, prefix_lse = prefix_out.reshape(q, m, dim).contiguous(), prefix_lse.reshape(q, m).contiguous()
        grad_prefix_out, grad_prefix_lse = grad_prefix_out.view(q, m, dim), grad_prefix_lse.view(q, m)
    n_programs = triton.cdiv(m, BWD_ROWS)
    for group, (q0, q1) in enumerate(_site_groups(q, cfg.block_q)):
        nq = q1 - q0
        du_part = first.new_empty((n_programs, nq, dim), dtype=acc_torch)
        dg_part = first.new_empty((n_programs, nq, dim), dtype=acc_torch) if has_norm else None
        depth_attn_bwd_kernel[(n_programs,)](
            rows[0],
            offsets,
            strides,
            grad_rows[0],
            grad_offsets,
            n,
            dy[q0:q1],
            u[q0:q1],
            g[q0:q1] if has_norm else None,
            dlse[q0:q1] if dlse is not None else None,
            logits[q0:q1],
            dlogits[q0:q1] if dlogits is not None else None,
            rinv,
            prefix_out[q0:q1] if has_prefix else None,
            prefix_lse[q0:q1] if has_prefix else None,
            grad_prefix_out[q0:q1] if has_prefix else None,
            grad_prefix_lse[q0:q1] if has_prefix else None,
            du_part,
            dg_part,
            m,
            dim,
            nq,
            n * m,
            EPS=eps,
            HAS_OUT_NORM=has_norm,
            HAS_PREFIX=has_prefix,
            HAS_DLSE=dlse is not None,
            HAS_DLOGITS=dlogits is not None,
            ACCUMULATE_DV=group > 0,
            ROWS=BWD_ROWS,
            BLOCK_Q=cfg.block_q,
            BLOCK_D=cfg.block_d,
            ACC=acc_tl,
            ALIGN=align,
            **cfg.launch_options(),
        )
        _column_sum(du_part, grad_u[q0:q1])
        if has_norm:
            _column_sum(dg_part, grad_g[q0:q1])
