// What both families of CUDA attention kernels share (docs/design.md §2.4): the
// launch parameters, the shared-memory carver, the warp reductions and the
// backward's row terms kernel. Torch-free (see attention_kernels.cuh).
#pragma once

#include <cstdint>
#include <type_traits>

#include "device_primitives.cuh"

namespace attnres::cuda {

constexpr int kAttnMaxHeadDim = 256;
constexpr double kLog2e = 1.4426950408889634;

// A [B, heads, T, Dh] tensor with any strides (in elements). `vector`: every run of
// 8 elements of a row that starts at a multiple of 8 is contiguous and 16-byte
// aligned (stride_d = 1, the other strides and the address multiples of 8 elements,
// Dh a multiple of 8), so the tensor-core kernels copy it in 16-byte chunks.
struct HeadView {
  const void* data;
  int64_t stride_b, stride_h, stride_t, stride_d;
  bool vector;
};

struct AttnParams {
  HeadView q, k, v;
  const uint8_t* mask;  // key_padding_mask [B, Tk] (nonzero: a real key), or null
  int64_t mask_stride_b, mask_stride_t;
  int64_t heads, group, tq, tk, dh;
  int64_t offset;  // Tk - Tq: query i sees keys j <= i + offset under the causal mask
  bool causal;
  double scale;
  // The launch plan: SIMT kernels Bq, Bk, Dp; tensor-core kernels the K/V (or q/dO) buffers in flight.
  int block_q, block_k, head_pad;
  int stages;
  // forward outputs: out [B, H, Tq, Dh] contiguous in S, lse [B, H, Tq] in acc_t
  void* out;
  void* lse;
  // backward
  HeadView grad_out, saved_out;
  const void* saved_lse;  // [B, H, Tq] acc_t
  const void* grad_lse;   // [B, H, Tq] acc_t, or null
  void* delta;            // [B, H, Tq] acc_t: rowsum(dO ⊙ O) - dlse
  void* lse_log2;         // [B, H, Tq] acc_t: lse · log2(e), +inf where lse = -inf (so that P = 0)
  void* grad_q;           // like out
  void* grad_k;           // [B, Hkv, Tk, Dh] contiguous in S
  void* grad_v;
};

template <typename S>
using attn_acc_t = std::conditional_t<std::is_same_v<S, double>, double, float>;

// The last key (exclusive) any of the queries [i0, i_end) may see.
__host__ __device__ inline int64_t attn_key_end(const AttnParams& p, int64_t i_end) {
  if (!p.causal) return p.tk;
  const int64_t end = i_end + p.offset;
  return end < 0 ? 0 : end > p.tk ? p.tk : end;
}

// The first query that may see key j.
__host__ __device__ inline int64_t attn_query_begin(const AttnParams& p, int64_t j) {
  if (!p.causal) return 0;
  const int64_t begin = j - p.offset;
  return begin < 0 ? 0 : begin > p.tq ? p.tq : begin;
}

// Hands out consecutive 32-byte aligned pieces of the dynamic shared memory (enough
// for 16-byte cp.async and ldmatrix rows), as pointers derived from it (so that the
// compiler knows them to be shared-memory addresses). On the host (no base) it only counts.
struct SmemCarver {
  unsigned char* base = nullptr;
  size_t used = 0;
  template <typename T>
  __host__ __device__ T* take(int64_t n) {
    T* p = base != nullptr ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (static_cast<size_t>(n) * sizeof(T) + 31) / 32 * 32;
    return p;
  }
};

// Clamps a 64-bit index difference into [lo, hi] (tile-relative bounds fit an int).
__host__ __device__ inline int clamp_to_int(int64_t x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : int(x); }

#if defined(__CUDACC__)
__device__ __forceinline__ float dev_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double dev_exp2(double x) { return exp2(x); }
// The maximum that ignores a NaN operand (IEEE maxNum), like fmaxf.
__device__ __forceinline__ float dev_fmax(float a, float b) { return fmaxf(a, b); }
#else
inline float dev_exp2(float x) { return std::exp2(x); }
inline double dev_exp2(double x) { return std::exp2(x); }
inline float dev_fmax(float a, float b) { return std::fmax(a, b); }
#endif

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The maximum over the warp; NaN wins, as in the reference's logsumexp.
template <typename acc_t>
__device__ __forceinline__ acc_t warp_max(acc_t x) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) {
    const acc_t o = __shfl_xor_sync(0xffffffffu, x, m);
    if (o > x || dev_isnan(o)) x = o;
  }
  return x;
}

// One warp per row of [B, H, Tq]: delta = rowsum(dO ⊙ O) - dlse and lse_log2.
// grid ceil(rows / warps per block), kAttnRowThreads threads.
constexpr int kAttnRowThreads = 128;

template <typename S>
__global__ void __launch_bounds__(kAttnRowThreads) attn_bwd_rows_kernel(AttnParams p, int64_t num_rows) {
  using acc_t = attn_acc_t<S>;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= num_rows) return;  // no block barrier in this kernel
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = row % p.tq, bh = row / p.tq, h = bh % p.heads, b = bh / p.heads;
  const S* d_o = static_cast<const S*>(p.grad_out.data) + b * p.grad_out.stride_b + h * p.grad_out.stride_h +
                 t * p.grad_out.stride_t;
  const S* o = static_cast<const S*>(p.saved_out.data) + b * p.saved_out.stride_b + h * p.saved_out.stride_h +
               t * p.saved_out.stride_t;
  acc_t dot = acc_t(0);
  for (int64_t d = lane; d < p.dh; d += kWarpSize) {
    dot += to_acc<acc_t>(load_global(d_o + d * p.grad_out.stride_d)) *
           to_acc<acc_t>(load_global(o + d * p.saved_out.stride_d));
  }
  dot = warp_sum(dot);
  if (lane == 0) {
    const acc_t dlse = p.grad_lse != nullptr ? load_global(static_cast<const acc_t*>(p.grad_lse) + row) : acc_t(0);
    const acc_t lse = load_global(static_cast<const acc_t*>(p.saved_lse) + row);
    store_global(static_cast<acc_t*>(p.delta) + row, dot - dlse);
    store_global(static_cast<acc_t*>(p.lse_log2) + row,
                 lse == neg_infinity<acc_t>() ? -lse : lse * static_cast<acc_t>(kLog2e));
  }
}

}  // namespace attnres::cuda
