"""Triton kernels of the fused causal attention (DESIGN.md §2.4), FlashAttention-2 style.

Layout shared by all kernels:

- ``q``/``out``/``grad_out`` are ``[B, H, Tq, Dh]``, ``k``/``v`` ``[B, Hkv, Tk, Dh]``, each
  addressed through its own four strides (any layout, no copies). Query head ``h``
  reads key/value head ``h // GROUP`` (grouped-query attention, ``GROUP = H / Hkv``).
  ``lse`` and ``delta`` are ``[B, H, Tq]`` in the accumulation dtype, contiguous.
  Offsets of the batch and head are int64; offsets inside one head (``t * stride_t +
  d * stride_d``) are int32 (the launcher checks they fit). The key padding mask is
  ``[B, Tk]`` int32 (nonzero = a real key): Triton derives the register layout of a
  ``tl.dot`` operand from the narrowest load feeding it, and a byte-wide mask would
  select one that fp64 MMA does not support.
- Visibility of key ``j`` to query ``i``: ``j < Tk``, and with ``CAUSAL``
  ``j <= i + DIAG`` (``DIAG = Tk - Tq``: the causal mask is aligned to the bottom
  right), and with ``HAS_KPM`` the key is real. A program visits only the key
  (or query) tiles that hold a visible pair; tiles entirely visible skip the
  causal and bounds tests (``MASKED=False``), the rest (the diagonal band and the
  ragged last tile) apply them.
- Softmax in base 2: logits are scaled by ``SCALE * log2(e)`` once, so every
  exponential is one ``exp2``; the stored ``lse`` is in natural-log units.
- ``DOT`` is the dtype of the ``tl.dot`` operands: the input dtype on a GPU
  (fp16/bf16 tensor cores, fp32 with IEEE precision, fp64), fp32 for bf16
  under the interpreter (which cannot do bf16 arithmetic). Probabilities and
  ``dS`` are rounded to ``DOT`` before their products, as FlashAttention does.
  ``ACC`` is the accumulation dtype: fp32, or fp64 for fp64 inputs so that fp64
  gradcheck runs through this code. ``SCALE`` is a constexpr so that fp64 runs
  use the exact fp64 scale (a runtime float argument is fp32).
- A query row that sees no key (all keys padded, or before the first key under
  the bottom-right causal mask) gets output 0 and ``lse = -inf``; the backward
  reads that ``lse`` as ``+inf``, so its probabilities, and gradients, are 0.
- The backward is deterministic, without atomics: one kernel owns a key tile
  and sums ``dK``/``dV`` over every query tile of every query head of its GQA
  group; another owns a query tile and sums ``dQ`` over the key tiles.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2)


@triton.jit
def _causal_key_range(m0, Tk, DIAG, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys a query tile starting at row ``m0`` visits: ``[0, full_end)`` in whole tiles
    that need no causal or bounds test, then ``[full_end, end)`` tested tile by tile."""
    if CAUSAL:
        end = tl.minimum(Tk, m0 + BLOCK_M + DIAG)  # past the last key its last row sees
        full_end = tl.maximum(0, tl.minimum(Tk, m0 + DIAG + 1)) // BLOCK_N * BLOCK_N  # keys its first row sees
    else:
        end = Tk
        full_end = Tk // BLOCK_N * BLOCK_N
    return full_end, end


@triton.jit
def _key_visible(kpm_ptr, stride_kpm_t, offs_n, Tk):
    """``[BLOCK_N]`` bool: the keys of the tile that are real (in range and not padding)."""
    return tl.load(kpm_ptr + offs_n * stride_kpm_t, mask=offs_n < Tk, other=0) != 0


@triton.jit
def _attn_fwd_tile(
    acc,
    row_sum,
    row_max,
    q,
    k_ptr,
    v_ptr,
    kpm_ptr,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    stride_kpm_t,
    n0,
    offs_m,
    offs_d,
    mask_d,
    Tk,
    DIAG,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """One step of the online softmax over the key tile starting at ``n0``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = mask_d[None, :]
    if MASKED:
        kv_mask = kv_mask & (offs_n < Tk)[:, None]
    k = tl.load(k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0).to(DOT)
    s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * qk_scale
    if MASKED or HAS_KPM:
        visible = tl.full([1, BLOCK_N], 1, tl.int1)
        if MASKED:
            visible = visible & (offs_n < Tk)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + DIAG)
        if HAS_KPM:
            visible = visible & _key_visible(kpm_ptr, stride_kpm_t, offs_n, Tk)[None, :]
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf: shift by 0 instead (its p are 0).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        new_max = tl.maximum(row_max, tl.max(s, 1))
        shift = new_max
    p = tl.exp2(s - shift[:, None])
    rescale = tl.exp2(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(p, 1)
    v = tl.load(v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0).to(DOT)
    acc = tl.dot(p.to(DOT), v, acc * rescale[:, None], input_precision="ieee", out_dtype=ACC)
    return acc, row_sum, new_max


@triton.jit
def attn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kpm_ptr,
    out_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_kpm_b,
    stride_kpm_t,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    H,
    GROUP,
    Tq,
    Tk,
    Dh,
    SCALE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(Tq, BLOCK_M), H, B)``: ``out`` and ``lse`` of one query tile of one head.

    Keeps the ``[BLOCK_M, BLOCK_D]`` output accumulator, the running row max and
    row sum (online softmax) and streams the visible key/value tiles."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    q_ptr += b * stride_qb + h * stride_qh
    k_ptr += b * stride_kb + hk * stride_kh
    v_ptr += b * stride_vb + hk * stride_vh
    if HAS_KPM:
        kpm_ptr += b * stride_kpm_b
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < Tq
    mask_d = offs_d < Dh
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=mask_md, other=0.0).to(DOT)
    qk_scale = tl.full([], SCALE * LOG2E, ACC)
    DIAG = Tk - Tq
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    row_sum = tl.zeros([BLOCK_M], ACC)
    row_max = tl.full([BLOCK_M], float("-inf"), ACC)
    full_end, end = _causal_key_range(m0, Tk, DIAG, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_end, BLOCK_N):
        acc, row_sum, row_max = _attn_fwd_tile(
            acc, row_sum, row_max, q, k_ptr, v_ptr, kpm_ptr, stride_kt, stride_kd, stride_vt, stride_vd,
            stride_kpm_t, n0, offs_m, offs_d, mask_d, Tk, DIAG, qk_scale,
            False, CAUSAL, HAS_KPM, BLOCK_N, DOT, ACC,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        acc, row_sum, row_max = _attn_fwd_tile(
            acc, row_sum, row_max, q, k_ptr, v_ptr, kpm_ptr, stride_kt, stride_kd, stride_vt, stride_vd,
            stride_kpm_t, n0, offs_m, offs_d, mask_d, Tk, DIAG, qk_scale,
            True, CAUSAL, HAS_KPM, BLOCK_N, DOT, ACC,
        )  # fmt: skip
    seen = row_sum != 0  # 0 only without a visible key (the row max contributes 1); NaN propagates
    row_sum = tl.where(seen, row_sum, 1.0)
    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_md)
    lse = tl.where(seen, (row_max + tl.log2(row_sum)) * tl.full([], LN2, ACC), float("-inf"))
    tl.store(lse_ptr + (b * H + h) * Tq + offs_m, lse, mask=mask_m)


@triton.jit
def attn_bwd_preprocess_kernel(
    out_ptr,
    do_ptr,
    lse_ptr,
    dlse_ptr,
    delta_ptr,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    stride_dlse_b,
    stride_dlse_h,
    stride_dlse_t,
    H,
    Tq,
    Dh,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(Tq, BLOCK_M), H, B)``: ``delta = rowsum(dO ⊙ O) - dlse`` per query row,
    over the head dim in chunks of ``BLOCK_D`` (one compiled kernel for every head size).

    ``dS = P ⊙ (dP - delta)`` then holds the gradient of both outputs (``∂lse/∂s = P``).
    Rows that see no key get ``delta = 0``: their ``dlse`` is ignored."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < Tq
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    do_ptrs = do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod
    delta = tl.zeros([BLOCK_M], ACC)
    for d0 in range(0, Dh, BLOCK_D):
        mask_md = mask_m[:, None] & (d0 + offs_d < Dh)[None, :]
        o = tl.load(o_ptrs + d0 * stride_od, mask=mask_md, other=0.0).to(ACC)
        do = tl.load(do_ptrs + d0 * stride_dod, mask=mask_md, other=0.0).to(ACC)
        delta += tl.sum(o * do, 1)
    if HAS_DLSE:
        dlse_ptrs = dlse_ptr + b * stride_dlse_b + h * stride_dlse_h + offs_m * stride_dlse_t
        delta -= tl.load(dlse_ptrs, mask=mask_m, other=0.0).to(ACC)
    row = (b * H + h) * Tq + offs_m
    seen = tl.load(lse_ptr + row, mask=mask_m, other=0.0) != float("-inf")
    tl.store(delta_ptr + row, tl.where(seen, delta, 0.0), mask=mask_m)


@triton.jit
def _backward_lse(lse_ptr, offs_m, Tq):
    """``lse`` of the tile's rows in base 2 with rows that see no key (and rows past
    ``Tq``) at ``+inf``: their probabilities ``exp2(s - lse)`` are then exactly 0."""
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < Tq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * tl.full([], LOG2E, lse.dtype))


@triton.jit
def _attn_bwd_dkdv_tile(
    dk,
    dv,
    k,
    v,
    key_real,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    stride_qt,
    stride_qd,
    stride_dot,
    stride_dod,
    m0,
    offs_n,
    offs_d,
    mask_d,
    Tq,
    DIAG,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Adds the query tile starting at ``m0`` to ``dK``/``dV`` of the key tile, in the
    transposed layout (``[BLOCK_N, BLOCK_M]`` probabilities): ``dV += Pᵀ dO``,
    ``dK += (Pᵀ ⊙ (dPᵀ - delta)) Q`` (times the scale, applied once at the end).
    Query rows past ``Tq`` load as zeros with ``lse = +inf``: they add nothing."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = (offs_m < Tq)[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0).to(DOT)
    do = tl.load(do_ptr + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod, mask=row_mask, other=0.0)
    do = do.to(DOT)
    lse = _backward_lse(lse_ptr, offs_m, Tq)
    s_t = tl.dot(k, tl.trans(q), input_precision="ieee", out_dtype=ACC) * qk_scale
    p_t = tl.exp2(s_t - lse[None, :])
    if MASKED and CAUSAL:
        p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + DIAG, p_t, 0.0)
    if HAS_KPM:
        p_t = tl.where(key_real[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(DOT), do, dv, input_precision="ieee", out_dtype=ACC)
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee", out_dtype=ACC)
    delta = tl.load(delta_ptr + offs_m, mask=offs_m < Tq, other=0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(DOT), q, dk, input_precision="ieee", out_dtype=ACC)
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kpm_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_kpm_b,
    stride_kpm_t,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    H,
    GROUP,
    Tq,
    Tk,
    Dh,
    SCALE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(Tk, BLOCK_N), Hkv, B)``: ``dK``, ``dV`` of one key tile of one kv head.

    Sums over the ``GROUP`` query heads that read this kv head and, for each, over
    the query tiles that see the key tile (with ``CAUSAL``, from the first row that
    sees its first key). ``dk``/``dv`` are contiguous ``[B, Hkv, Tk, Dh]``."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    Hkv = H // GROUP
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    mask_nd = (offs_n < Tk)[:, None] & mask_d[None, :]
    k_ptrs = k_ptr + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd
    k = tl.load(k_ptrs, mask=mask_nd, other=0.0).to(DOT)
    v = tl.load(v_ptrs, mask=mask_nd, other=0.0).to(DOT)
    if HAS_KPM:
        key_real = _key_visible(kpm_ptr + b * stride_kpm_b, stride_kpm_t, offs_n, Tk)
    else:
        key_real = offs_n < Tk
    qk_scale = tl.full([], SCALE * LOG2E, ACC)
    DIAG = Tk - Tq
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    if CAUSAL:
        # Query row i sees key j iff i >= j - DIAG; rows from full_start on see the whole tile.
        start = tl.maximum(0, n0 - DIAG) // BLOCK_M * BLOCK_M
        full_start = tl.minimum(tl.maximum(start, tl.cdiv(n0 + BLOCK_N - 1 - DIAG, BLOCK_M) * BLOCK_M), Tq)
    else:
        start = 0
        full_start = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        row0 = b * H + h
        q_head = q_ptr + b * stride_qb + h * stride_qh
        do_head = do_ptr + b * stride_dob + h * stride_doh
        for m0 in range(start, full_start, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_tile(
                dk, dv, k, v, key_real, q_head, do_head, lse_ptr + row0 * Tq, delta_ptr + row0 * Tq,
                stride_qt, stride_qd, stride_dot, stride_dod, m0, offs_n, offs_d, mask_d, Tq, DIAG, qk_scale,
                True, CAUSAL, HAS_KPM, BLOCK_M, DOT, ACC,
            )  # fmt: skip
        for m0 in range(full_start, Tq, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_tile(
                dk, dv, k, v, key_real, q_head, do_head, lse_ptr + row0 * Tq, delta_ptr + row0 * Tq,
                stride_qt, stride_qd, stride_dot, stride_dod, m0, offs_n, offs_d, mask_d, Tq, DIAG, qk_scale,
                False, CAUSAL, HAS_KPM, BLOCK_M, DOT, ACC,
            )  # fmt: skip
    dk *= tl.full([], SCALE, ACC)
    out_offs = ((b * Hkv + hk) * Tk + offs_n[:, None]) * Dh + offs_d[None, :]
    tl.store(dk_ptr + out_offs, dk.to(dk_ptr.dtype.element_ty), mask=mask_nd)
    tl.store(dv_ptr + out_offs, dv.to(dv_ptr.dtype.element_ty), mask=mask_nd)


@triton.jit
def _attn_bwd_dq_tile(
    dq,
    q,
    do,
    lse,
    delta,
    k_ptr,
    v_ptr,
    kpm_ptr,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    stride_kpm_t,
    n0,
    offs_m,
    offs_d,
    mask_d,
    Tk,
    DIAG,
    qk_scale,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Adds the key tile starting at ``n0`` to ``dQ``: ``dQ += (P ⊙ (dP - delta)) K``
    (times the scale, applied once at the end)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = mask_d[None, :]
    if MASKED:
        kv_mask = kv_mask & (offs_n < Tk)[:, None]
    k = tl.load(k_ptr + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0).to(DOT)
    v = tl.load(v_ptr + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0).to(DOT)
    s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED or HAS_KPM:
        visible = tl.full([1, BLOCK_N], 1, tl.int1)
        if MASKED:
            visible = visible & (offs_n < Tk)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + DIAG)
        if HAS_KPM:
            visible = visible & _key_visible(kpm_ptr, stride_kpm_t, offs_n, Tk)[None, :]
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee", out_dtype=ACC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(DOT), k, dq, input_precision="ieee", out_dtype=ACC)


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kpm_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_kpm_b,
    stride_kpm_t,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    H,
    GROUP,
    Tq,
    Tk,
    Dh,
    SCALE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(Tq, BLOCK_M), H, B)``: ``dQ`` of one query tile of one head, over the
    key tiles it sees (the forward's ranges). ``dq`` is contiguous ``[B, H, Tq, Dh]``."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    mask_md = (offs_m < Tq)[:, None] & mask_d[None, :]
    q_ptrs = q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd
    do_ptrs = do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :] * stride_dod
    q = tl.load(q_ptrs, mask=mask_md, other=0.0).to(DOT)
    do = tl.load(do_ptrs, mask=mask_md, other=0.0).to(DOT)
    row0 = (b * H + h) * Tq
    lse = _backward_lse(lse_ptr + row0, offs_m, Tq)
    delta = tl.load(delta_ptr + row0 + offs_m, mask=offs_m < Tq, other=0.0)
    k_ptr += b * stride_kb + hk * stride_kh
    v_ptr += b * stride_vb + hk * stride_vh
    if HAS_KPM:
        kpm_ptr += b * stride_kpm_b
    qk_scale = tl.full([], SCALE * LOG2E, ACC)
    DIAG = Tk - Tq
    dq = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    full_end, end = _causal_key_range(m0, Tk, DIAG, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(0, full_end, BLOCK_N):
        dq = _attn_bwd_dq_tile(
            dq, q, do, lse, delta, k_ptr, v_ptr, kpm_ptr, stride_kt, stride_kd, stride_vt, stride_vd, stride_kpm_t,
            n0, offs_m, offs_d, mask_d, Tk, DIAG, qk_scale,
            False, CAUSAL, HAS_KPM, BLOCK_N, DOT, ACC,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        dq = _attn_bwd_dq_tile(
            dq, q, do, lse, delta, k_ptr, v_ptr, kpm_ptr, stride_kt, stride_kd, stride_vt, stride_vd, stride_kpm_t,
            n0, offs_m, offs_d, mask_d, Tk, DIAG, qk_scale,
            True, CAUSAL, HAS_KPM, BLOCK_N, DOT, ACC,
        )  # fmt: skip
    dq *= tl.full([], SCALE, ACC)
    tl.store(dq_ptr + (row0 + offs_m[:, None]) * Dh + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=mask_md)
