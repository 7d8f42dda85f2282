"""Launchers of the Triton Block-step kernels (:mod:`.block_step_kernels`): block sizes, buffers,
the deterministic reduction of the backward's partial rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.jit import MockTensor

from . import cdiv, max_dim, next_power_of_2
from .block_step_kernels import block_step_bwd_kernel, block_step_fwd_kernel
from .depth_attention_ops import AotLaunch, _as_dtype, column_sum

MIN_BLOCK_D = 128  # narrower rows are masked: keeps the set of compiled configurations small
BWD_ROWS = 16  # rows per backward program: fixes the partition of the row reductions

FWD_SCHEMA = (
    "(Tensor? partial, Tensor update, Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, "
    "Tensor? out_norm_weight, float eps, int? key_rank) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, Tensor new_partial, Tensor query, "
    "Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, Tensor? out_norm_weight, Tensor logit, "
    "Tensor rinv, float eps, int? key_rank) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@dataclass(frozen=True)
class StepConfig:
    block_d: int
    num_warps: int

    @property
    def max_registers(self) -> int:
        """Per-thread register cap for ptxas: all an SM can give one program."""
        return min(255, 65536 // (32 * self.num_warps))

    def launch_options(self) -> dict:
        return dict(num_warps=self.num_warps, maxnreg=self.max_registers)


def step_config(dim: int, acc: torch.dtype) -> StepConfig:
    """``BLOCK_D`` covers the row; one warp per 512 row words (16 per thread), at most 16
    warps (fp64 takes two words per element). Keeps every configuration free of spills
    (``python -m attnres_kernels.triton.check``)."""
    if not 1 <= dim <= max_dim(acc):
        raise ValueError(f"the Triton Block step supports 1 <= D <= {max_dim(acc)} for {acc} math, got D = {dim}")
    words = 2 if acc == torch.float64 else 1
    block_d = max(MIN_BLOCK_D, next_power_of_2(dim))
    return StepConfig(block_d, max(1, min(16, block_d * words // 512)))


def all_step_configs(acc: torch.dtype) -> list:
    """Every configuration :func:`step_config` can return for ``acc`` math."""
    return sorted({step_config(1 << e, acc) for e in range(max_dim(acc).bit_length())}, key=lambda c: c.block_d)


def _acc_dtypes(out_dtype: torch.dtype):
    return (torch.float64, tl.float64) if out_dtype == torch.float64 else (torch.float32, tl.float32)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[M, D]`` view with unit column stride (a copy only when the layout needs one)."""
    r = t.reshape(-1, dim)
    return r if r.stride(1) == 1 else r.contiguous()


def _folded_query(query, norm_weight, acc: torch.dtype) -> torch.Tensor:
    u = _as_dtype(query, acc)
    return (u * _as_dtype(norm_weight, acc) if norm_weight is not None else u).contiguous()


def _check_full_width_keys(key_rank: int | None, dim: int) -> None:
    if key_rank not in (None, dim):
        raise RuntimeError("block step (triton): sliced low-rank keys (key_rank < D) have no Triton kernel yet")


def block_step_fwd(
    partial,
    update,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    eps: float,
    key_rank: int | None,
):
    """Forward of the op schema in :mod:`attnres_kernels.ops._registration` (Block step)."""
    dim, lead = update.shape[-1], update.shape[:-1]
    _check_full_width_keys(key_rank, dim)
    new_dtype = update.dtype if partial is None else torch.promote_types(partial.dtype, update.dtype)
    out_dtype = torch.promote_types(new_dtype, prefix_out.dtype)
    acc_torch, acc_tl = _acc_dtypes(out_dtype)
    cfg = step_config(dim, acc_torch)
    new_partial = update.new_empty(update.shape, dtype=new_dtype)
    out = update.new_empty(update.shape, dtype=out_dtype)
    lse, logit, rinv = (update.new_empty(lead, dtype=acc_torch) for _ in range(3))
    m = new_partial.numel() // dim
    if m == 0:
        return new_partial, out, lse, logit, rinv
    upd, h_a = _rows(update, dim), _rows(prefix_out, dim)
    part = _rows(partial, dim) if partial is not None else None
    g = _as_dtype(out_norm_weight, acc_torch).contiguous() if out_norm_weight is not None else None
    block_step_fwd_kernel[(m,)](
        part,
        part.stride(0) if part is not None else 0,
        upd,
        upd.stride(0),
        h_a,
        h_a.stride(0),
        prefix_lse.reshape(m).contiguous(),
        _folded_query(query, norm_weight, acc_torch),
        g,
        new_partial,
        out,
        lse,
        logit,
        rinv,
        dim,
        EPS=eps,
        HAS_PARTIAL=part is not None,
        HAS_OUT_NORM=g is not None,
        BLOCK_D=cfg.block_d,
        ACC=acc_tl,
        **cfg.launch_options(),
    )
    return new_partial, out, lse, logit, rinv


def block_step_bwd(
    grad_new_partial,
    grad_out,
    grad_lse,
    new_partial,
    query,
    norm_weight,
    prefix_out,
    prefix_lse,
    out_norm_weight,
    logit,
    rinv,
    eps: float,
    key_rank: int | None,
):
    """Backward of the op schema in :mod:`attnres_kernels.ops._registration` (Block step)."""
    dim = new_partial.shape[-1]
    _check_full_width_keys(key_rank, dim)
    acc_torch, acc_tl = _acc_dtypes(torch.promote_types(new_partial.dtype, prefix_out.dtype))
    cfg = step_config(dim, acc_torch)
    m = new_partial.numel() // dim
    grad_total = new_partial.new_empty(new_partial.shape)
    grad_prefix_out = prefix_out.new_empty(prefix_out.shape)
    grad_prefix_lse = prefix_lse.new_empty(prefix_lse.shape)
    # With rows, the column sums write every entry of grad_u and grad_g; without, they are zero.
    new_param_grad = new_partial.new_empty if m > 0 else new_partial.new_zeros
    grad_u = new_param_grad((dim,), dtype=acc_torch)
    grad_g = new_param_grad((dim,), dtype=acc_torch) if out_norm_weight is not None else None
    if m > 0:
        n_programs = cdiv(m, BWD_ROWS)
        du_part = new_partial.new_empty((n_programs, dim), dtype=acc_torch)
        dg_part = new_partial.new_empty((n_programs, dim), dtype=acc_torch) if grad_g is not None else None
        v, h_a = _rows(new_partial, dim), _rows(prefix_out, dim)
        dnew = _rows(grad_new_partial, dim) if grad_new_partial is not None else None
        dy = _rows(grad_out, dim) if grad_out is not None else None
        block_step_bwd_kernel[(n_programs,)](
            dnew,
            dnew.stride(0) if dnew is not None else 0,
            dy,
            dy.stride(0) if dy is not None else 0,
            grad_lse.reshape(m).contiguous() if grad_lse is not None else None,
            v,
            v.stride(0),
            h_a,
            h_a.stride(0),
            prefix_lse.reshape(m).contiguous(),
            logit.reshape(m).contiguous(),
            rinv.reshape(m).contiguous(),
            _folded_query(query, norm_weight, acc_torch),
            _as_dtype(out_norm_weight, acc_torch).contiguous() if grad_g is not None else None,
            grad_total,
            grad_prefix_out,
            grad_prefix_lse,
            du_part,
            dg_part,
            m,
            dim,
            EPS=eps,
            HAS_GRAD_NEW=dnew is not None,
            HAS_GRAD_OUT=dy is not None,
            HAS_GRAD_LSE=grad_lse is not None,
            HAS_OUT_NORM=grad_g is not None,
            ROWS=BWD_ROWS,
            BLOCK_D=cfg.block_d,
            ACC=acc_tl,
            **cfg.launch_options(),
        )
        column_sum(du_part, grad_u)
        if grad_g is not None:
            column_sum(dg_part, grad_g)
    if norm_weight is not None:
        grad_query = _as_dtype(grad_u * _as_dtype(norm_weight, acc_torch), query.dtype)
        grad_norm = _as_dtype(grad_u * _as_dtype(query, acc_torch), norm_weight.dtype)
    else:
        grad_query, grad_norm = _as_dtype(grad_u, query.dtype), grad_u.new_empty((0,))
    grad_out_norm = _as_dtype(grad_g, out_norm_weight.dtype) if grad_g is not None else grad_u.new_empty((0,))
    return grad_total, grad_query, grad_norm, grad_prefix_out, grad_prefix_lse, grad_out_norm


# ---------------------------------------------------------------- ahead-of-time check


def aot_launches(dtype: torch.dtype) -> list:
    """Every launch the launchers can make with ``dtype`` row tensors (and ``dtype``'s
    accumulation), every optional input switched on, for :mod:`attnres_kernels.triton.check`.
    For 16-bit ``dtype`` it adds the mixed case of the models under autocast: a bf16/fp16
    partial sum and update over an fp32 prefix."""
    acc_torch, acc_tl = _acc_dtypes(dtype)
    rows, acc = MockTensor(dtype), MockTensor(acc_torch)
    mixes = [(rows, rows)]
    if dtype in (torch.bfloat16, torch.float16):
        mixes.append((rows, MockTensor(torch.float32)))
    m, d = 4096, 1024
    launches = []
    for cfg in all_step_configs(acc_torch):
        for new, prefix in mixes:
            mix = "" if new is prefix else " prefix=fp32"
            label = f"BLOCK_D={cfg.block_d} warps={cfg.num_warps}{mix}"
            out = prefix  # the promotion of new_partial's dtype and the prefix's
            launches.append(
                AotLaunch(
                    "block_step_fwd",
                    label,
                    block_step_fwd_kernel,
                    [rows, d, rows, d, prefix, d, acc, acc, acc, new, out, acc, acc, acc, d],
                    dict(EPS=1e-6, HAS_PARTIAL=True, HAS_OUT_NORM=True, BLOCK_D=cfg.block_d, ACC=acc_tl),
                    cfg.launch_options(),
                )
            )
            for out_norm in (True, False):
                launches.append(
                    AotLaunch(
                        f"block_step_bwd[out_norm={int(out_norm)}]",
                        label,
                        block_step_bwd_kernel,
                        [new, d, out, d, acc, new, d, prefix, d, acc, acc, acc, acc, acc, new, prefix, acc, acc, acc]
                        + [m, d],
                        dict(
                            EPS=1e-6,
                            HAS_GRAD_NEW=True,
                            HAS_GRAD_OUT=True,
                            HAS_GRAD_LSE=True,
                            HAS_OUT_NORM=out_norm,
                            ROWS=BWD_ROWS,
                            BLOCK_D=cfg.block_d,
                            ACC=acc_tl,
                        ),
                        cfg.launch_options(),
                    )
                )
    return launches
