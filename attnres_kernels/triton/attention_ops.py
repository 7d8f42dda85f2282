"""Launchers of the Triton attention kernels (:mod:`.attention_kernels`): tiles, grids, buffers.

The op schema is the one of :mod:`attnres_kernels.ops._registration` (attention).
Tile sizes and warp counts come from one dispatcher, :func:`kernel_config`; every
configuration it can return is what ``python -m attnres_kernels.triton.check``
compiles ahead of time (:func:`aot_launches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.jit import MockTensor

from .._validation import MAX_HEAD_DIM, accumulation_dtype
from . import INTERPRETING, cdiv, next_power_of_2
from .attention_kernels import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel, attn_fwd_kernel
from .depth_attention_ops import AotLaunch

MIN_BLOCK_D = 32  # tl.dot needs K >= 16; Dh <= 16 pads to 32 (one configuration fewer to compile)
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims y (heads) and z (batch)
PREPROCESS_BLOCK_M, PREPROCESS_BLOCK_D = 32, 64  # tile of the delta kernel, which loops over Dh

_DOT_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@dataclass(frozen=True)
class Tiles:
    """Tile of one kernel: ``block_m`` query rows × ``block_n`` keys, and its launch options."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def launch_options(self) -> dict:
        # maxnreg: every register an SM can give one program (at most 255). Without it
        # ptxas aims at a lower count on its own and spills in fp32/fp64 dots.
        maxnreg = min(255, 65536 // (32 * self.num_warps))
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=maxnreg)

    def label(self, block_d: int) -> str:
        return f"D={block_d} M={self.block_m} N={self.block_n} w={self.num_warps} s={self.num_stages}"


@dataclass(frozen=True)
class AttentionConfig:
    block_d: int
    fwd: Tiles
    dkdv: Tiles
    dq: Tiles


def max_head_dim(dtype: torch.dtype) -> int:
    """Largest head size of the Triton attention for ``dtype`` inputs: fp64 tiles of
    ``Dh = 256`` do not fit a GPU's registers and shared memory even at 16 × 16."""
    return 128 if dtype == torch.float64 else MAX_HEAD_DIM


def kernel_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Tiles and warps of every attention kernel for head size ``head_dim`` and ``dtype`` inputs.

    ``BLOCK_D = max(32, next_pow2(Dh))`` (masked). Tiles are ``query rows × keys``:

    ============  ===========  =================  ==============  ==============
    dtype         BLOCK_D      forward            dK/dV           dQ
    ============  ===========  =================  ==============  ==============
    fp16/bf16     32, 64       128×64, 8 warps    32×64, 8 w      64×32, 4 w
    fp16/bf16     128          64×64, 4 w         32×32, 8 w      64×32, 8 w
    fp16/bf16     256          64×32, 8 w         32×32, 8 w      32×32, 8 w
    fp32          32, 64       32×32, 4 w         32×32, 8 w      32×32, 4 w
    fp32          128, 256     16×16, 4 w         16×16, 4 w      16×16, 4 w
    fp64          32, 64       32×32, 4 w         16×32, 8 w      32×16, 8 w
    fp64          128          16×16, 4 w         16×16, 4 w      16×16, 4 w
    ============  ===========  =================  ==============  ==============

    fp16/bf16 dots run on tensor cores (fp32 accumulators), fp32 dots with IEEE
    precision on CUDA cores, fp64 dots on fp64 MMA. Every choice compiles with zero
    register spills on sm_80 and sm_90 and needs at most the 99 KiB of shared memory
    every sm_80+ GPU gives a block (``python -m attnres_kernels.triton.check``). The
    tiles were chosen from ptxas's register and shared-memory reports, not from GPU
    timings (no GPU was available)."""
    if not 1 <= head_dim <= max_head_dim(dtype):
        limit = max_head_dim(dtype)
        raise ValueError(
            f"the Triton attention supports head sizes 1 <= Dh <= {limit} for {dtype}, got Dh = {head_dim}"
        )
    block_d = max(MIN_BLOCK_D, next_power_of_2(head_dim))
    if dtype in (torch.float16, torch.bfloat16):
        if block_d <= 64:
            stages = 3 if block_d == 32 else 2
            return AttentionConfig(block_d, Tiles(128, 64, 8, stages), Tiles(32, 64, 8, 2), Tiles(64, 32, 4, 2))
        if block_d == 128:
            return AttentionConfig(block_d, Tiles(64, 64, 4, 2), Tiles(32, 32, 8, 2), Tiles(64, 32, 8, 2))
        return AttentionConfig(block_d, Tiles(64, 32, 8, 2), Tiles(32, 32, 8, 1), Tiles(32, 32, 8, 1))
    if dtype == torch.float32:
        if block_d <= 64:
            return AttentionConfig(block_d, Tiles(32, 32, 4, 2), Tiles(32, 32, 8, 1), Tiles(32, 32, 4, 1))
        return AttentionConfig(block_d, Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1))
    if dtype == torch.float64:
        if block_d <= 64:
            return AttentionConfig(block_d, Tiles(32, 32, 4, 1), Tiles(16, 32, 8, 1), Tiles(32, 16, 8, 1))
        return AttentionConfig(block_d, Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1))
    raise TypeError(f"the Triton attention does not support {dtype}")


def all_kernel_configs(dtype: torch.dtype) -> list:
    """Every configuration :func:`kernel_config` can return for ``dtype`` inputs."""
    configs = {kernel_config(1 << e, dtype) for e in range(max_head_dim(dtype).bit_length())}
    return sorted(configs, key=lambda c: c.block_d)


def _dtypes(dtype: torch.dtype, interpreting: bool = INTERPRETING):
    """(accumulation dtype as torch and tl, ``tl.dot`` operand dtype) for ``dtype`` inputs."""
    acc = accumulation_dtype(dtype)
    acc_tl = tl.float64 if acc == torch.float64 else tl.float32
    if dtype == torch.bfloat16 and interpreting:  # the interpreter has no bf16 arithmetic
        return acc, acc_tl, tl.float32
    return acc, acc_tl, _DOT_DTYPES[dtype]


def _launch(kernel, grid, *args, **kwargs):
    """Launches ``kernel`` unless its grid is empty."""
    if all(g > 0 for g in grid):
        kernel[grid](*args, **kwargs)


def _check_sizes(batch: int, heads: int, *tensors) -> None:
    """The grid's limits, and offsets inside one head (``[T, Dh]``) that fit int32."""
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"the Triton attention supports B, H <= {MAX_GRID_YZ}, got B = {batch}, H = {heads}")
    for t in tensors:
        if (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
            raise ValueError(
                f"the Triton attention needs T * stride(2) < 2**31, got shape {tuple(t.shape)}, strides {t.stride()}"
            )


def _mask_args(key_padding_mask):
    """The key padding mask as int32 (``B × Tk`` elements; see :mod:`.attention` for
    why not bytes) and its two strides."""
    if key_padding_mask is None:
        return None, 0, 0
    mask = key_padding_mask.to(torch.int32)
    return mask, *mask.stride()


def attn_fwd(q, k, v, key_padding_mask, causal: bool, scale: float):
    """Forward of the attention op schema: ``(out, lse)``."""
    batch, heads, tq, head_dim = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    _check_sizes(batch, heads, q, k, v)
    acc, acc_tl, dot = _dtypes(q.dtype)
    cfg = kernel_config(head_dim, q.dtype)
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, tq), dtype=acc)
    mask, *mask_strides = _mask_args(key_padding_mask)
    tiles = cfg.fwd
    _launch(
        attn_fwd_kernel,
        (cdiv(tq, tiles.block_m), heads, batch),
        q, k, v, mask, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(),
        heads, heads // kv_heads, tq, tk, head_dim,
        SCALE=scale, CAUSAL=causal, HAS_KPM=mask is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=cfg.block_d, DOT=dot, ACC=acc_tl,
        **tiles.launch_options(),
    )  # fmt: skip
    return out, lse


def attn_bwd(grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, causal: bool, scale: float):
    """Backward of the attention op schema: ``(grad_q, grad_k, grad_v)``, each contiguous
    in its input's dtype. Three launches: ``delta``, then ``dK``/``dV`` and ``dQ``."""
    batch, heads, tq, head_dim = q.shape
    kv_heads, tk = k.shape[1], k.shape[2]
    _check_sizes(batch, heads, q, k, v, out, grad_out)
    acc, acc_tl, dot = _dtypes(q.dtype)
    cfg = kernel_config(head_dim, q.dtype)
    grad_q, grad_k, grad_v = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    if q.numel() == 0:  # no query reads a key (H = 0 would also make the head group size 0)
        return grad_q, grad_k.zero_(), grad_v.zero_()
    lse = lse.contiguous()
    delta = q.new_empty((batch, heads, tq), dtype=acc)
    mask, *mask_strides = _mask_args(key_padding_mask)
    flags = dict(SCALE=scale, CAUSAL=causal, HAS_KPM=mask is not None, BLOCK_D=cfg.block_d, DOT=dot, ACC=acc_tl)
    sizes = (heads, heads // kv_heads, tq, tk, head_dim)
    _launch(
        attn_bwd_preprocess_kernel,
        (cdiv(tq, PREPROCESS_BLOCK_M), heads, batch),
        out, grad_out, lse, grad_lse, delta,
        *out.stride(), *grad_out.stride(), *(grad_lse.stride() if grad_lse is not None else (0, 0, 0)),
        heads, tq, head_dim,
        HAS_DLSE=grad_lse is not None, BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_D=PREPROCESS_BLOCK_D, ACC=acc_tl,
    )  # fmt: skip
    _launch(
        attn_bwd_dkdv_kernel,
        (cdiv(tk, cfg.dkdv.block_n), kv_heads, batch),
        q, k, v, mask, grad_out, lse, delta, grad_k, grad_v,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *grad_out.stride(), *sizes,
        BLOCK_M=cfg.dkdv.block_m, BLOCK_N=cfg.dkdv.block_n, **flags, **cfg.dkdv.launch_options(),
    )  # fmt: skip
    _launch(
        attn_bwd_dq_kernel,
        (cdiv(tq, cfg.dq.block_m), heads, batch),
        q, k, v, mask, grad_out, lse, delta, grad_q,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *grad_out.stride(), *sizes,
        BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n, **flags, **cfg.dq.launch_options(),
    )  # fmt: skip
    return grad_q, grad_k, grad_v


# ---------------------------------------------------------------- ahead-of-time check


def aot_launches(dtype: torch.dtype) -> list:
    """Every launch the dispatcher can make for ``dtype`` inputs, with every optional
    feature on (causal, key padding, grad_lse), for :mod:`attnres_kernels.triton.check`."""
    acc, acc_tl, dot = _dtypes(dtype, interpreting=False)
    x, a, m = MockTensor(dtype), MockTensor(acc), MockTensor(torch.int32)
    h, group, tq, tk = 16, 4, 4096, 4096  # a 16-head GQA layer, T = 4096, Dh = 128
    strides = (h * tq * 128, tq * 128, 128, 1)
    kv_strides = (h // group * tk * 128, tk * 128, 128, 1)
    sizes = (h, group, tq, tk, 128)
    launches = [
        AotLaunch(
            "attn_bwd_preprocess",
            f"M={PREPROCESS_BLOCK_M} D={PREPROCESS_BLOCK_D} (any Dh) w=4",
            attn_bwd_preprocess_kernel,
            [x, x, a, a, a, *strides, *strides, h * tq, tq, 1, h, tq, 128],
            dict(HAS_DLSE=True, BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_D=PREPROCESS_BLOCK_D, ACC=acc_tl),
            dict(num_warps=4),
        )
    ]
    for cfg in all_kernel_configs(dtype):
        flags = dict(SCALE=0.125, CAUSAL=True, HAS_KPM=True, BLOCK_D=cfg.block_d, DOT=dot, ACC=acc_tl)
        for name, kernel, tiles, buffers in (
            ("attn_fwd", attn_fwd_kernel, cfg.fwd, [x, a]),
            ("attn_bwd_dkdv", attn_bwd_dkdv_kernel, cfg.dkdv, [x, a, a, x, x]),
            ("attn_bwd_dq", attn_bwd_dq_kernel, cfg.dq, [x, a, a, x]),
        ):
            # q, k, v, mask, then fwd: out, lse; bwd: grad_out, lse, delta, grads; strides (out's or grad_out's last)
            launches.append(
                AotLaunch(
                    name,
                    tiles.label(cfg.block_d),
                    kernel,
                    [x, x, x, m, *buffers, *strides, *kv_strides, *kv_strides, tk, 1, *strides, *sizes],
                    dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **flags),
                    tiles.launch_options(),
                )
            )
    return launches
