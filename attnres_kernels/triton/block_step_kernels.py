"""Triton kernels of the fused Block residual step (DESIGN.md §2.3, phase 2); launched by :mod:`.block_step_ops`.

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

import triton
import triton.language as tl


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
