"""Triton kernels of the fused Block residual step (DESIGN.md §2.3, phase 2) and their launchers.

Per row, with ``u = query ⊙ norm_weight`` (folded once per call by the launcher)::

    v = new_partial = partial + update            (rounded to its dtype before the read)
    r = rsqrt(mean(v²) + eps);  s = r <u, v>
    m = max(lse_a, s);  α_a, α_b = exp(lse_a - m), exp(s - m) normalized
    h = α_a h_a + α_b v;  lse = m + log(exp(lse_a - m) + exp(s - m))
    out = h, or rmsnorm(h) * g with the fused output norm

One program holds a whole row (``BLOCK_D = next_pow2(D)``, masked), so every
row is read and written once per direction. Each ``[M, D]`` tensor is read
and written in its own dtype (Triton specializes on the pointer types) and
the arithmetic runs in ``ACC`` (fp32, or fp64 when ``out`` is fp64, so that
fp64 gradcheck runs through the kernels under the interpreter). Rows may have
any stride (unit column stride); the outputs are contiguous.

The backward is deterministic: each program sums its ``ROWS`` rows' share of
``du`` and ``dg`` into a private partial row, and ``column_sum_kernel`` adds
the partials in a fixed order. No atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import MockTensor

from . import cdiv, max_dim, next_power_of_2
from .launch import AotLaunch, _as_dtype, column_sum

MIN_BLOCK_D = 128  # narrower rows are masked: keeps the set of compiled configurations small
BWD_ROWS = 16  # rows per backward program: fixes the partition of the row reductions

FWD_SCHEMA = (
    "(Tensor? partial, Tensor update, Tensor query, Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, "
    "Tensor? out_norm_weight, float eps, int? key_rank=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor? grad_new_partial, Tensor? grad_out, Tensor? grad_lse, Tensor new_partial, Tensor query, "
    "Tensor? norm_weight, Tensor prefix_out, Tensor prefix_lse, Tensor? out_norm_weight, Tensor logit, "
    "Tensor rinv, float eps, int? key_rank=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@triton.jit
def _store_row(ptrs, x, mask):
    """Stores ``x`` in the element type of ``ptrs``; 16-bit types are reached through
    fp32 (the interpreter converts only fp32 to bf16; on a GPU it costs nothing)."""
    if ptrs.dtype.element_ty.primitive_bitwidth == 16:
        x = x.to(tl.float32)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _merge_weights(lse_a, s):
    """Softmax weights of the prefix (logit ``lse_a``) and the new source (logit ``s``),
    and the merged lse; a NaN in either logit propagates to both weights."""
    top = tl.maximum(lse_a, s, propagate_nan=tl.PropagateNan.ALL)
    e_a = tl.exp(lse_a - top)
    e_b = tl.exp(s - top)
    z = e_a + e_b
    return e_a / z, e_b / z, top + tl.log(z)


@triton.jit
def block_step_fwd_kernel(
    partial_ptr,
    stride_partial,
    update_ptr,
    stride_update,
    prefix_h_ptr,
    stride_prefix_h,
    prefix_lse_ptr,
    u_ptr,
    g_ptr,
    new_ptr,
    out_ptr,
    lse_ptr,
    logit_ptr,
    rinv_ptr,
    D,
    EPS: tl.constexpr,
    HAS_PARTIAL: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(M,)``: one row per program. Writes ``new_partial`` (contiguous, its own
    dtype), ``out``, and the per-row ``lse``, ``logit`` (s) and ``rinv`` (r)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # The sum in the compute dtype of PyTorch's add (fp64 for fp64, else fp32), rounded
    # to new_partial's dtype: the read sees exactly the tensor it returns.
    if new_ptr.dtype.element_ty == tl.float64:
        x = tl.load(update_ptr + row * stride_update + offs, mask=mask, other=0.0).to(tl.float64)
        if HAS_PARTIAL:
            x += tl.load(partial_ptr + row * stride_partial + offs, mask=mask, other=0.0).to(tl.float64)
    else:
        x = tl.load(update_ptr + row * stride_update + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_PARTIAL:
            x += tl.load(partial_ptr + row * stride_partial + offs, mask=mask, other=0.0).to(tl.float32)
    new = x.to(new_ptr.dtype.element_ty)
    tl.store(new_ptr + row * D + offs, new, mask=mask)
    v = new.to(ACC)
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + EPS)
    s = r * tl.sum(tl.load(u_ptr + offs, mask=mask, other=0.0) * v, axis=0)
    alpha_a, alpha_b, lse = _merge_weights(tl.load(prefix_lse_ptr + row), s)
    h = alpha_a * tl.load(prefix_h_ptr + row * stride_prefix_h + offs, mask=mask, other=0.0).to(ACC) + alpha_b * v
    if HAS_OUT_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + EPS)
        h = h * rstd * tl.load(g_ptr + offs, mask=mask, other=0.0)
    _store_row(out_ptr + row * D + offs, h, mask)
    tl.store(lse_ptr + row, lse)
    tl.store(logit_ptr + row, s)
    tl.store(rinv_ptr + row, r)


@triton.jit
def block_step_bwd_kernel(
    grad_new_ptr,
    stride_grad_new,
    grad_out_ptr,
    stride_grad_out,
    grad_lse_ptr,
    new_ptr,
    stride_new,
    prefix_h_ptr,
    stride_prefix_h,
    prefix_lse_ptr,
    logit_ptr,
    rinv_ptr,
    u_ptr,
    g_ptr,
    grad_total_ptr,
    grad_prefix_h_ptr,
    grad_prefix_lse_ptr,
    du_part_ptr,
    dg_part_ptr,
    M,
    D,
    EPS: tl.constexpr,
    HAS_GRAD_NEW: tl.constexpr,
    HAS_GRAD_OUT: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(M, ROWS),)``: all gradients of ``ROWS`` rows. Per row
    (``do = ∂L/∂h``, ``dl = ∂L/∂lse``):

    - with the out norm: ``h`` recomputed from ``new_partial`` and ``h_a``,
      ``dg += rstd dy h``, ``do = rstd (g dy) - h rstd³ <g dy, h> / D``; else ``do = dy``;
    - ``delta = <do, h> = α_a <do, h_a> + α_b <do, v>``;
      ``ds = α_b (<do, v> - delta + dl)``; ``∂lse_a = α_a (<do, h_a> - delta + dl)``;
    - ``∂new_partial = α_b do + ds r (u - s r v / D)`` plus the incoming gradient
      (the total, in new_partial's dtype); ``∂h_a = α_a do``; ``du += ds r v``.

    ``du``/``dg`` are summed over the program's rows in its private partial row
    (read-modify-write in memory, which stays in L1/L2, rather than registers:
    two fewer live row vectors keep the widest rows free of spills)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    du_ptrs = du_part_ptr + pid.to(tl.int64) * D + offs
    tl.store(du_ptrs, tl.zeros([BLOCK_D], ACC), mask=mask)
    if HAS_OUT_NORM:
        dg_ptrs = dg_part_ptr + pid.to(tl.int64) * D + offs
        tl.store(dg_ptrs, tl.zeros([BLOCK_D], ACC), mask=mask)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i
        if row < M:
            s = tl.load(logit_ptr + row)
            r = tl.load(rinv_ptr + row)
            alpha_a, alpha_b, _ = _merge_weights(tl.load(prefix_lse_ptr + row), s)
            v = tl.load(new_ptr + row * stride_new + offs, mask=mask, other=0.0).to(ACC)
            h_a = tl.load(prefix_h_ptr + row * stride_prefix_h + offs, mask=mask, other=0.0).to(ACC)
            if HAS_GRAD_OUT:
                do = tl.load(grad_out_ptr + row * stride_grad_out + offs, mask=mask, other=0.0).to(ACC)
            else:
                do = tl.zeros([BLOCK_D], ACC)
            if HAS_OUT_NORM:
                h = alpha_a * h_a + alpha_b * v
                rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + EPS)
                tl.store(dg_ptrs, tl.load(dg_ptrs, mask=mask, other=0.0) + rstd * do * h, mask=mask)
                gy = tl.load(g_ptr + offs, mask=mask, other=0.0) * do
                do = rstd * gy - h * (rstd * rstd * rstd * tl.sum(gy * h, axis=0) / D)
            dp_a = tl.sum(do * h_a, axis=0)
            dp_b = tl.sum(do * v, axis=0)
            delta = alpha_a * dp_a + alpha_b * dp_b
            if HAS_GRAD_LSE:
                dl = tl.load(grad_lse_ptr + row)
            else:
                dl = 0.0
            ds = alpha_b * (dp_b - delta + dl)
            tl.store(grad_prefix_lse_ptr + row, alpha_a * (dp_a - delta + dl))
            c1 = ds * r
            dv = alpha_b * do + c1 * tl.load(u_ptr + offs, mask=mask, other=0.0) - (ds * s * r * r / D) * v
            if HAS_GRAD_NEW:
                dv += tl.load(grad_new_ptr + row * stride_grad_new + offs, mask=mask, other=0.0).to(ACC)
            _store_row(grad_total_ptr + row * D + offs, dv, mask)
            _store_row(grad_prefix_h_ptr + row * D + offs, alpha_a * do, mask)
            tl.store(du_ptrs, tl.load(du_ptrs, mask=mask, other=0.0) + c1 * v, mask=mask)


# ---------------------------------------------------------------- launchers


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
    key_rank: int | None = None,
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
    key_rank: int | None = None,
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
