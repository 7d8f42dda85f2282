// CUDA kernels of fused attention (DESIGN.md §2.4), FlashAttention-2 style:
//
//   o = softmax(q kᵀ · scale + mask) v,   q [B, H, Tq, Dh],  k, v [B, Hkv, Tk, Dh],  H = G · Hkv
//
// Torch-free: nvcc builds them into the extension (ops_cuda.cu) and the host
// compiler into the SIMT harness (csrc/simt/emulated_ops.cpp, with the WMMA
// calls emulated by csrc/simt/wmma.h); both launch them through the launchers at
// the end, with the tiles of plan_attention.
//
// Kernels (one instantiation per storage dtype S: fp16, bf16, fp32, fp64; 16 in all):
//   attn_fwd_kernel       a block owns Bq query rows of one head and walks the key
//                         tiles of Bk keys (online softmax); saves lse (fp32, fp64 for
//                         fp64). Causal: the walk stops at the last key the tile's last
//                         query sees, so tiles above the diagonal are skipped, not masked.
//   attn_bwd_rows_kernel  δ = rowsum(dO ⊙ O) - dlse and the lse the gradients use (+inf
//                         for a row that sees no key, so that its P = exp(s - lse) = 0).
//   attn_bwd_dkdv_kernel  a block owns Bk keys of one kv head: for every head of its
//                         group and every query tile that sees them (causal: from the
//                         first such tile on), Sᵀ = K qᵀ, dPᵀ = V dOᵀ, Pᵀ = exp(Sᵀ·scale
//                         - lse), dSᵀ = Pᵀ ⊙ (dPᵀ - δ), dV += Pᵀ dO, dK += dSᵀ q.
//   attn_bwd_dq_kernel    a block owns Bq queries of one head: S = q Kᵀ, dP = dO Vᵀ,
//                         dS = P ⊙ (dP - δ), dQ += dS K over the key tiles it sees.
// Every output element is summed by one block in a fixed order: no atomics, the
// results are bitwise reproducible. No T x T matrix exists anywhere.
//
// Tile products. fp16 / bf16 inputs use the tensor cores through WMMA
// (m16n16k16, fp32 accumulators); fp32 and fp64 a SIMT FMA product (exact IEEE
// arithmetic, like Triton's input_precision="ieee", and fp64 so that gradcheck
// runs through these kernels). The fragment layout is opaque, so the row-wise
// softmax cannot work on accumulator fragments: every product is stored to a
// shared-memory tile (fp32 for WMMA, the accumulation type for SIMT), and the
// running accumulators (O, dK and dV, dQ) live in shared memory too, each
// [tile rows, Dp] with Dp = Dh rounded up to 16. This keeps Dh a run-time value
// (no Dh buckets: four kernels per dtype), at the price of a shared-memory round
// trip of the accumulator per key tile. P and dS enter the next product rounded
// to the input dtype for WMMA (as FlashAttention does), exact for SIMT.
//
// Loads. Every tile is read element by element with the tensor's own strides
// (consecutive threads read consecutive head-dim elements), zero-filled past Tq /
// Tk and Dh, so padding rows and columns contribute nothing and the poisoned
// shared memory of the harness never reaches a result.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "device_primitives.cuh"

#if defined(__CUDACC__)
#include <mma.h>
#else
#include "../simt/wmma.h"
#endif

namespace attnres::cuda {

// A [B, heads, T, Dh] tensor with any strides (in elements).
struct HeadView {
  const void* data;
  int64_t stride_b, stride_h, stride_t, stride_d;
};

struct AttnParams {
  HeadView q, k, v;
  const uint8_t* mask;  // key_padding_mask [B, Tk] (nonzero: a real key), or null
  int64_t mask_stride_b, mask_stride_t;
  int64_t heads, group, tq, tk, dh;
  int64_t offset;  // Tk - Tq: query i sees keys j <= i + offset under the causal mask
  bool causal;
  double scale;
  int block_q, block_k, head_pad;  // Bq, Bk, Dp of the plan
  // forward outputs: out [B, H, Tq, Dh] contiguous in S, lse [B, H, Tq] in acc_t
  void* out;
  void* lse;
  // backward
  HeadView grad_out, saved_out;
  const void* saved_lse;  // [B, H, Tq] acc_t
  const void* grad_lse;   // [B, H, Tq] acc_t, or null
  void* delta;            // [B, H, Tq] acc_t: rowsum(dO ⊙ O) - dlse
  void* lse_used;         // [B, H, Tq] acc_t: lse, +inf where it is -inf
  void* grad_q;           // like out
  void* grad_k;           // [B, Hkv, Tk, Dh] contiguous in S
  void* grad_v;
};

template <typename S>
struct AttnTypes {
  static constexpr bool kWmma = std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>;
  using acc_t = std::conditional_t<std::is_same_v<S, double>, double, float>;
  using op_t = std::conditional_t<kWmma, uint16_t, acc_t>;  // an element of an operand tile in shared memory
  using wmma_t = std::conditional_t<std::is_same_v<S, Half>, __half, __nv_bfloat16>;
};

constexpr int kAttnThreads = 128;  // four warps per block, every kernel
constexpr int kAttnMaxHeadDim = 256;

// ------------------------------------------------------------------ shared memory layout

// Hands out consecutive 32-byte aligned pieces of the dynamic shared memory (the
// alignment WMMA loads and stores need). On the host (base 0) it only counts.
struct SmemCarver {
  uintptr_t base;
  size_t used = 0;
  template <typename T>
  __host__ __device__ T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(base + used);
    used += (static_cast<size_t>(n) * sizeof(T) + 31) / 32 * 32;
    return p;
  }
};

// What each kernel keeps in shared memory; `p_op`/`ds_op` are the probability and
// dS tiles in the operand type (WMMA only; the SIMT kernels overwrite the scores in
// place).
template <typename S>
struct FwdSmem {
  using T = AttnTypes<S>;
  typename T::op_t *q, *k, *v, *p_op;
  typename T::acc_t *s, *o, *row_max, *row_sum;
  int32_t* key_ok;
  __host__ __device__ FwdSmem(SmemCarver& c, int bq, int bk, int dp) {
    q = c.take<typename T::op_t>(int64_t(bq) * dp);
    k = c.take<typename T::op_t>(int64_t(bk) * dp);
    v = c.take<typename T::op_t>(int64_t(bk) * dp);
    s = c.take<typename T::acc_t>(int64_t(bq) * bk);
    p_op = T::kWmma ? c.take<typename T::op_t>(int64_t(bq) * bk) : nullptr;
    o = c.take<typename T::acc_t>(int64_t(bq) * dp);
    row_max = c.take<typename T::acc_t>(bq);
    row_sum = c.take<typename T::acc_t>(bq);
    key_ok = c.take<int32_t>(bk);
  }
};

// The backward kernels: `a`, `b` hold the block's own rows (dK/dV: K and V; dQ: q
// and dO), `c`, `d` the walked tiles (dK/dV: q and dO; dQ: K and V); `s` and `dp`
// the two score products, `acc0`/`acc1` the gradient accumulators (dK, dV / dQ).
template <typename S>
struct BwdSmem {
  using T = AttnTypes<S>;
  typename T::op_t *a, *b, *c, *d, *p_op, *ds_op;
  typename T::acc_t *s, *dp, *acc0, *acc1, *row_lse, *row_delta;
  int32_t* key_ok;
  __host__ __device__ BwdSmem(SmemCarver& carve, bool key_grads, int bq, int bk, int dp_) {
    const int own = key_grads ? bk : bq, walked = key_grads ? bq : bk;
    a = carve.take<typename T::op_t>(int64_t(own) * dp_);
    b = carve.take<typename T::op_t>(int64_t(own) * dp_);
    c = carve.take<typename T::op_t>(int64_t(walked) * dp_);
    d = carve.take<typename T::op_t>(int64_t(walked) * dp_);
    s = carve.take<typename T::acc_t>(int64_t(bq) * bk);
    dp = carve.take<typename T::acc_t>(int64_t(bq) * bk);
    p_op = T::kWmma && key_grads ? carve.take<typename T::op_t>(int64_t(bq) * bk) : nullptr;
    ds_op = T::kWmma ? carve.take<typename T::op_t>(int64_t(bq) * bk) : nullptr;
    acc0 = carve.take<typename T::acc_t>(int64_t(own) * dp_);
    acc1 = key_grads ? carve.take<typename T::acc_t>(int64_t(own) * dp_) : nullptr;
    row_lse = carve.take<typename T::acc_t>(bq);
    row_delta = carve.take<typename T::acc_t>(bq);
    key_ok = carve.take<int32_t>(bk);
  }
};

// ------------------------------------------------------------------ the launch plan

enum class AttnKernel : int { kForward = 0, kKeyGrads = 1, kQueryGrads = 2 };

struct AttnPlan {
  int block_q = 0, block_k = 0;  // Bq, Bk: tile rows of queries and keys
  int head_pad = 0;              // Dp: Dh rounded up to 16
  size_t shared_bytes = 0;
};

// The tiles are the largest whose shared memory stays within 96 KiB: two blocks per
// SM on sm_80 (164 KiB) and sm_90 (228 KiB); below 16 x 16 WMMA tiles a block's
// four warps would idle. No plan exceeds 99 KiB, the per-block limit of sm_86/89.
constexpr size_t kAttnPreferredShared = 96 * 1024;
constexpr size_t kAttnMaxShared = 99 * 1024;

template <typename S>
size_t attn_shared_bytes(AttnKernel kind, int bq, int bk, int dp) {
  SmemCarver c{0};
  if (kind == AttnKernel::kForward) {
    FwdSmem<S>(c, bq, bk, dp);
  } else {
    BwdSmem<S>(c, kind == AttnKernel::kKeyGrads, bq, bk, dp);
  }
  return c.used;
}

inline size_t attn_shared_bytes_of(int32_t dtype, AttnKernel kind, int bq, int bk, int dp) {
  switch (dtype) {
    case kFloat16:
      return attn_shared_bytes<Half>(kind, bq, bk, dp);
    case kBFloat16:
      return attn_shared_bytes<BFloat16>(kind, bq, bk, dp);
    case kFloat32:
      return attn_shared_bytes<float>(kind, bq, bk, dp);
    default:
      return attn_shared_bytes<double>(kind, bq, bk, dp);
  }
}

// The tiles of one kernel for a dtype and head size (and the sequence lengths,
// which only shrink the tiles of short sequences). Candidates in order of
// preference (the owned rows first, as large as possible); the first within
// kAttnPreferredShared wins, else the smallest. Launches beyond 48 KiB opt in to
// more shared memory (the Runtime sets the attribute).
// WMMA tiles are multiples of 16, SIMT tiles of 4 (its 4 x 4 micro-tiles).
inline AttnPlan plan_attention(AttnKernel kind, int32_t dtype, int64_t dh, int64_t tq, int64_t tk) {
  if (dh < 1 || dh > kAttnMaxHeadDim) {
    throw std::invalid_argument("the CUDA attention kernels support head sizes 1 <= Dh <= " +
                                std::to_string(kAttnMaxHeadDim) + ", got Dh = " + std::to_string(dh));
  }
  const bool wmma = dtype == kFloat16 || dtype == kBFloat16;
  const int granule = wmma ? 16 : 8;
  constexpr int kCandidates[][2] = {{64, 64}, {64, 32}, {32, 32}, {32, 16}, {16, 32}, {16, 16}, {16, 8}, {8, 8}};
  auto shrink = [&](int tile, int64_t length) {
    const int64_t needed = (std::max<int64_t>(length, 1) + granule - 1) / granule * granule;
    return static_cast<int>(needed < tile ? needed : tile);
  };
  AttnPlan plan;
  plan.head_pad = static_cast<int>((dh + 15) / 16 * 16);
  for (const auto& cand : kCandidates) {
    if (cand[0] < granule || cand[1] < granule) continue;
    // cand[0] is the owned tile: queries for the forward and dQ, keys for dK/dV.
    const int own = cand[0], walked = cand[1];
    const bool keys_owned = kind == AttnKernel::kKeyGrads;
    AttnPlan p = plan;
    p.block_q = shrink(keys_owned ? walked : own, tq);
    p.block_k = shrink(keys_owned ? own : walked, tk);
    p.shared_bytes = attn_shared_bytes_of(dtype, kind, p.block_q, p.block_k, p.head_pad);
    plan = p;
    if (p.shared_bytes <= kAttnPreferredShared) break;
  }
  if (plan.shared_bytes > kAttnMaxShared) {
    throw std::logic_error("attention: the smallest tile needs " + std::to_string(plan.shared_bytes) +
                           " bytes of shared memory (Dh = " + std::to_string(dh) + ")");
  }
  return plan;
}

// ------------------------------------------------------------------ device helpers

template <typename S>
__device__ __forceinline__ typename AttnTypes<S>::op_t load_operand(const S* p) {
  if constexpr (AttnTypes<S>::kWmma) {
    return load_global(p).bits;
  } else {
    return to_acc<typename AttnTypes<S>::acc_t>(load_global(p));
  }
}

template <typename S>
__device__ __forceinline__ typename AttnTypes<S>::op_t to_operand(typename AttnTypes<S>::acc_t x) {
  if constexpr (AttnTypes<S>::kWmma) {
    return from_acc<S>(x).bits;
  } else {
    return x;
  }
}

// Rows [t0, t0 + rows) of head (b, h) of x into tile [tile_rows, Dp]; zero past `rows` and Dh.
template <typename S>
__device__ __forceinline__ void load_rows(const HeadView& x, int64_t b, int64_t h, int64_t t0, int rows, int tile_rows,
                                          int64_t dh, int dp, typename AttnTypes<S>::op_t* tile) {
  using op_t = typename AttnTypes<S>::op_t;
  const S* base = static_cast<const S*>(x.data) + b * x.stride_b + h * x.stride_h;
  for (int e = threadIdx.x; e < tile_rows * dp; e += blockDim.x) {
    const int r = e / dp, d = e % dp;
    tile[e] = r < rows && d < dh ? load_operand(base + (t0 + r) * x.stride_t + d * x.stride_d) : op_t(0);
  }
}

// key_ok[c] = whether key j0 + c exists and is not padding.
__device__ __forceinline__ void load_key_flags(const AttnParams& p, int64_t b, int64_t j0, int n, int bk,
                                               int32_t* key_ok) {
  for (int c = threadIdx.x; c < bk; c += blockDim.x) {
    bool ok = c < n;
    if (ok && p.mask != nullptr) ok = load_global(p.mask + b * p.mask_stride_b + (j0 + c) * p.mask_stride_t) != 0;
    key_ok[c] = ok;
  }
}

template <typename T>
__device__ __forceinline__ void fill_shared(T* x, int64_t n, T value) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) x[e] = value;
}

// C[M, N] (+)= A[M, K] · B, all in shared memory, row-major: A with leading
// dimension lda; B either [K, N] (ldb) or, with kBTransposed, stored as its
// transpose [N, K] (ldb); C in the accumulation type (ldc). Called by the whole
// block; no barrier inside (the caller synchronizes before reading C).
// WMMA: each warp takes 16 x 16 output tiles in turn; M, N, K multiples of 16.
// SIMT: each thread takes 4 x 4 output micro-tiles in turn, summing over k in
// order; M, N multiples of 4.
template <typename S, bool kBTransposed>
__device__ __forceinline__ void tile_product(int M, int N, int K, const typename AttnTypes<S>::op_t* A, int lda,
                                             const typename AttnTypes<S>::op_t* B, int ldb,
                                             typename AttnTypes<S>::acc_t* C, int ldc, bool accumulate) {
  using Types = AttnTypes<S>;
  if constexpr (Types::kWmma) {
    namespace wmma = nvcuda::wmma;
    using W = typename Types::wmma_t;
    using LayoutB = std::conditional_t<kBTransposed, wmma::col_major, wmma::row_major>;
    const int warp = threadIdx.x / kWarpSize, warps = blockDim.x / kWarpSize;
    const int tiles_n = N / 16, tiles = (M / 16) * tiles_n;
    for (int t = warp; t < tiles; t += warps) {
      const int m0 = t / tiles_n * 16, n0 = t % tiles_n * 16;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
      float* c_ptr = C + m0 * ldc + n0;
      if (accumulate) {
        wmma::load_matrix_sync(c, c_ptr, ldc, wmma::mem_row_major);
      } else {
        wmma::fill_fragment(c, 0.0f);
      }
      for (int k0 = 0; k0 < K; k0 += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, W, LayoutB> b;
        wmma::load_matrix_sync(a, reinterpret_cast<const W*>(A + m0 * lda + k0), lda);
        wmma::load_matrix_sync(b, reinterpret_cast<const W*>(kBTransposed ? B + n0 * ldb + k0 : B + k0 * ldb + n0),
                               ldb);
        wmma::mma_sync(c, a, b, c);
      }
      wmma::store_matrix_sync(c_ptr, c, ldc, wmma::mem_row_major);
    }
  } else {
    using acc_t = typename Types::acc_t;
    const int tiles_n = N / 4, tiles = (M / 4) * tiles_n;
    for (int t = threadIdx.x; t < tiles; t += blockDim.x) {
      const int m0 = t / tiles_n * 4, n0 = t % tiles_n * 4;
      acc_t c[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) c[i][j] = accumulate ? C[(m0 + i) * ldc + n0 + j] : acc_t(0);
      for (int k = 0; k < K; ++k) {
        acc_t a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = A[(m0 + i) * lda + k];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = kBTransposed ? B[(n0 + j) * ldb + k] : B[k * ldb + n0 + j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) c[i][j] += a[i] * b[j];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) C[(m0 + i) * ldc + n0 + j] = c[i][j];
    }
  }
}

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

// Whether query i0 + r may see key j0 + c (key_ok: the key exists and is not padding).
__device__ __forceinline__ bool visible(const AttnParams& p, const int32_t* key_ok, int64_t i0, int r, int64_t j0,
                                        int c) {
  return key_ok[c] != 0 && (!p.causal || j0 + c <= i0 + r + p.offset);
}

// ------------------------------------------------------------------ forward

// grid (ceil(Tq / Bq), H, B), kAttnThreads threads.
template <typename S>
__global__ void __launch_bounds__(kAttnThreads) attn_fwd_kernel(AttnParams p) {
  using Types = AttnTypes<S>;
  using acc_t = typename Types::acc_t;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t i0 = int64_t(blockIdx.x) * bq, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
  SmemCarver carve{reinterpret_cast<uintptr_t>(dynamic_shared<unsigned char>())};
  const FwdSmem<S> sm(carve, bq, bk, dp);
  auto* p_tile = Types::kWmma ? sm.p_op : reinterpret_cast<typename Types::op_t*>(sm.s);
  const acc_t scale = static_cast<acc_t>(p.scale);
  constexpr acc_t kNegInf = neg_infinity<acc_t>();

  load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.q);
  fill_shared(sm.o, int64_t(bq) * dp, acc_t(0));
  fill_shared(sm.row_max, bq, kNegInf);
  fill_shared(sm.row_sum, bq, acc_t(0));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
  // Causal: the last key any query of the tile sees; later tiles are never visited.
  const int64_t kv_end = p.causal ? imin<int64_t>(p.tk, i0 + rows + p.offset) : p.tk;
  for (int64_t j0 = 0; j0 < kv_end; j0 += bk) {
    const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
    __syncthreads();  // the previous tile's products are done with K, V and P
    load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.k);
    load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.v);
    load_key_flags(p, b, j0, n, bk, sm.key_ok);
    __syncthreads();
    tile_product<S, true>(bq, bk, dp, sm.q, dp, sm.k, dp, sm.s, bk, false);
    __syncthreads();
    // Online softmax, one warp per row: new running max, P = exp(s - max), the row
    // sum, and the rescale of the row's accumulator by exp(old max - new max).
    for (int r = warp; r < bq; r += warps) {
      acc_t* s_row = sm.s + r * bk;
      acc_t tile_max = kNegInf;
      for (int c = lane; c < bk; c += kWarpSize) {
        const acc_t s = visible(p, sm.key_ok, i0, r, j0, c) ? s_row[c] * scale : kNegInf;
        s_row[c] = s;
        if (s > tile_max || dev_isnan(s)) tile_max = s;
      }
      tile_max = warp_max(tile_max);
      const acc_t old_max = sm.row_max[r];
      const acc_t new_max = tile_max > old_max || dev_isnan(tile_max) ? tile_max : old_max;
      const acc_t shift = new_max == kNegInf ? acc_t(0) : new_max;  // no visible key yet: every P is 0
      acc_t sum = acc_t(0);
      for (int c = lane; c < bk; c += kWarpSize) {
        const acc_t prob = dev_exp(s_row[c] - shift);
        sum += prob;
        p_tile[r * bk + c] = to_operand<S>(prob);
      }
      sum = warp_sum(sum);
      const acc_t rescale = dev_exp(old_max - shift);
      if (lane == 0) {
        sm.row_max[r] = new_max;
        sm.row_sum[r] = sm.row_sum[r] * rescale + sum;
      }
      for (int d = lane; d < dp; d += kWarpSize) sm.o[r * dp + d] *= rescale;
    }
    __syncthreads();
    tile_product<S, false>(bq, dp, bk, p_tile, bk, sm.v, dp, sm.o, dp, true);
  }
  __syncthreads();
  const int64_t row0 = (b * p.heads + h) * p.tq + i0;
  S* out = static_cast<S*>(p.out) + row0 * p.dh;
  for (int64_t e = threadIdx.x; e < int64_t(rows) * p.dh; e += blockDim.x) {
    const int r = static_cast<int>(e / p.dh), d = static_cast<int>(e % p.dh);
    const acc_t l = sm.row_sum[r];
    const acc_t inv = l == acc_t(0) ? acc_t(0) : acc_t(1) / l;  // a row that sees no key: output 0
    store_global(out + e, from_acc<S>(sm.o[r * dp + d] * inv));
  }
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const acc_t l = sm.row_sum[r];
    store_global(static_cast<acc_t*>(p.lse) + row0 + r, l == acc_t(0) ? kNegInf : sm.row_max[r] + dev_log(l));
  }
}

// ------------------------------------------------------------------ backward

// One warp per row of [B, H, Tq]: delta and lse_used. grid ceil(rows / warps per block).
template <typename S>
__global__ void __launch_bounds__(kAttnThreads) attn_bwd_rows_kernel(AttnParams p, int64_t num_rows) {
  using acc_t = typename AttnTypes<S>::acc_t;
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
    store_global(static_cast<acc_t*>(p.lse_used) + row, lse == neg_infinity<acc_t>() ? -lse : lse);
  }
}

// P = exp(s · scale - lse) where query i0 + r sees key j0 + c, else 0, and
// dS = P ⊙ (dP - δ), for a [rows_a, cols_a] pair tile; `keys_on_rows`: the tile is
// transposed (rows are keys, as in the dK/dV kernel).
template <typename S>
__device__ __forceinline__ void pair_scores(const AttnParams& p, const BwdSmem<S>& sm, bool keys_on_rows, int64_t i0,
                                            int rows_q, int64_t j0) {
  using Types = AttnTypes<S>;
  using acc_t = typename Types::acc_t;
  const int bq = p.block_q, bk = p.block_k;
  const acc_t scale = static_cast<acc_t>(p.scale);
  for (int e = threadIdx.x; e < bq * bk; e += blockDim.x) {
    const int r = keys_on_rows ? e % bq : e / bk, c = keys_on_rows ? e / bq : e % bk;
    const bool seen = r < rows_q && visible(p, sm.key_ok, i0, r, j0, c);
    const acc_t prob = seen ? dev_exp(sm.s[e] * scale - sm.row_lse[r]) : acc_t(0);
    const acc_t ds = prob * (sm.dp[e] - sm.row_delta[r]);
    if constexpr (Types::kWmma) {
      if (keys_on_rows) sm.p_op[e] = to_operand<S>(prob);
      sm.ds_op[e] = to_operand<S>(ds);
    } else {
      sm.s[e] = prob;
      sm.dp[e] = ds;
    }
  }
}

// The lse and δ of query rows [i0, i0 + rows) of head (b, h); padding rows get
// lse = +inf (P = 0) and δ = 0.
template <typename acc_t>
__device__ __forceinline__ void load_row_terms(const AttnParams& p, int64_t b, int64_t h, int64_t i0, int rows, int bq,
                                               acc_t* row_lse, acc_t* row_delta) {
  const int64_t row0 = (b * p.heads + h) * p.tq + i0;
  for (int r = threadIdx.x; r < bq; r += blockDim.x) {
    row_lse[r] = r < rows ? load_global(static_cast<const acc_t*>(p.lse_used) + row0 + r) : -neg_infinity<acc_t>();
    row_delta[r] = r < rows ? load_global(static_cast<const acc_t*>(p.delta) + row0 + r) : acc_t(0);
  }
}

// Stores rows [0, rows) of a [*, Dp] accumulator times `mul` to row `row0` on of a contiguous [*, Dh] tensor.
template <typename S, typename acc_t>
__device__ __forceinline__ void store_rows(const acc_t* acc, int rows, int dp, int64_t dh, acc_t mul, void* dst,
                                           int64_t row0) {
  S* out = static_cast<S*>(dst) + row0 * dh;
  for (int64_t e = threadIdx.x; e < int64_t(rows) * dh; e += blockDim.x) {
    const int r = static_cast<int>(e / dh), d = static_cast<int>(e % dh);
    store_global(out + e, from_acc<S>(acc[r * dp + d] * mul));
  }
}

// grid (ceil(Tk / Bk), Hkv, B).
template <typename S>
__global__ void __launch_bounds__(kAttnThreads) attn_bwd_dkdv_kernel(AttnParams p) {
  using Types = AttnTypes<S>;
  using acc_t = typename Types::acc_t;
  using op_t = typename Types::op_t;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t j0 = int64_t(blockIdx.x) * bk, hk = blockIdx.y, b = blockIdx.z;
  const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
  SmemCarver carve{reinterpret_cast<uintptr_t>(dynamic_shared<unsigned char>())};
  const BwdSmem<S> sm(carve, true, bq, bk, dp);
  // Operands of dV += Pᵀ dO and dK += dSᵀ q: [Bk, Bq] tiles.
  const op_t* pt = Types::kWmma ? sm.p_op : reinterpret_cast<const op_t*>(sm.s);
  const op_t* dst = Types::kWmma ? sm.ds_op : reinterpret_cast<const op_t*>(sm.dp);

  load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.a);
  load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.b);
  load_key_flags(p, b, j0, n, bk, sm.key_ok);
  fill_shared(sm.acc0, int64_t(bk) * dp, acc_t(0));
  fill_shared(sm.acc1, int64_t(bk) * dp, acc_t(0));
  // Causal: query tiles before the first query that sees key j0 are skipped.
  const int64_t first = p.causal ? (j0 - p.offset < 0 ? 0 : imin<int64_t>(j0 - p.offset, p.tq)) : 0;
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t h = hk * p.group + g;
    for (int64_t i0 = first / bq * bq; i0 < p.tq; i0 += bq) {
      const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
      __syncthreads();  // the previous pair's products are done with q, dO, P and dS
      load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.c);
      load_rows<S>(p.grad_out, b, h, i0, rows, bq, p.dh, dp, sm.d);
      load_row_terms(p, b, h, i0, rows, bq, sm.row_lse, sm.row_delta);
      __syncthreads();
      tile_product<S, true>(bk, bq, dp, sm.a, dp, sm.c, dp, sm.s, bq, false);   // Sᵀ = K qᵀ
      tile_product<S, true>(bk, bq, dp, sm.b, dp, sm.d, dp, sm.dp, bq, false);  // dPᵀ = V dOᵀ
      __syncthreads();
      pair_scores<S>(p, sm, true, i0, rows, j0);
      __syncthreads();
      tile_product<S, false>(bk, dp, bq, pt, bq, sm.d, dp, sm.acc1, dp, true);   // dV += Pᵀ dO
      tile_product<S, false>(bk, dp, bq, dst, bq, sm.c, dp, sm.acc0, dp, true);  // dK += dSᵀ q
    }
  }
  __syncthreads();
  const int64_t row0 = (b * (p.heads / p.group) + hk) * p.tk + j0;
  store_rows<S>(sm.acc0, n, dp, p.dh, static_cast<acc_t>(p.scale), p.grad_k, row0);
  store_rows<S>(sm.acc1, n, dp, p.dh, acc_t(1), p.grad_v, row0);
}

// grid (ceil(Tq / Bq), H, B).
template <typename S>
__global__ void __launch_bounds__(kAttnThreads) attn_bwd_dq_kernel(AttnParams p) {
  using Types = AttnTypes<S>;
  using acc_t = typename Types::acc_t;
  using op_t = typename Types::op_t;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t i0 = int64_t(blockIdx.x) * bq, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
  SmemCarver carve{reinterpret_cast<uintptr_t>(dynamic_shared<unsigned char>())};
  const BwdSmem<S> sm(carve, false, bq, bk, dp);
  const op_t* ds = Types::kWmma ? sm.ds_op : reinterpret_cast<const op_t*>(sm.dp);

  load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.a);
  load_rows<S>(p.grad_out, b, h, i0, rows, bq, p.dh, dp, sm.b);
  load_row_terms(p, b, h, i0, rows, bq, sm.row_lse, sm.row_delta);
  fill_shared(sm.acc0, int64_t(bq) * dp, acc_t(0));
  const int64_t kv_end = p.causal ? imin<int64_t>(p.tk, i0 + rows + p.offset) : p.tk;
  for (int64_t j0 = 0; j0 < kv_end; j0 += bk) {
    const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
    __syncthreads();  // the previous tile's dQ product is done with K and dS
    load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.c);
    load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.d);
    load_key_flags(p, b, j0, n, bk, sm.key_ok);
    __syncthreads();
    tile_product<S, true>(bq, bk, dp, sm.a, dp, sm.c, dp, sm.s, bk, false);   // S = q Kᵀ
    tile_product<S, true>(bq, bk, dp, sm.b, dp, sm.d, dp, sm.dp, bk, false);  // dP = dO Vᵀ
    __syncthreads();
    pair_scores<S>(p, sm, false, i0, rows, j0);
    __syncthreads();
    tile_product<S, false>(bq, dp, bk, ds, bk, sm.c, dp, sm.acc0, dp, true);  // dQ += dS K
  }
  __syncthreads();
  store_rows<S>(sm.acc0, rows, dp, p.dh, static_cast<acc_t>(p.scale), p.grad_q, (b * p.heads + h) * p.tq + i0);
}

// ------------------------------------------------------------------ host launchers
//
// `Runtime` (csrc/cuda/ops_cuda.cu, csrc/simt/emulated_ops.cpp) provides
//   void launch(const std::string& name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, args...);

inline const char* attn_dtype_name(int32_t dtype) {
  switch (dtype) {
    case kFloat16:
      return "fp16";
    case kBFloat16:
      return "bf16";
    case kFloat32:
      return "fp32";
    default:
      return "fp64";
  }
}

// Calls f(S{}) with the storage type of `dtype`.
template <typename F>
void dispatch_attn_dtype(int32_t dtype, F&& f) {
  switch (dtype) {
    case kFloat16:
      return f(Half{});
    case kBFloat16:
      return f(BFloat16{});
    case kFloat32:
      return f(float{});
    default:
      return f(double{});
  }
}

inline int64_t attn_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// out and lse for q [B, H, Tq, Dh]; `params` without the plan fields.
template <typename Runtime>
void launch_attn_fwd(Runtime& rt, int32_t dtype, int64_t batch, AttnParams params) {
  const AttnPlan plan = plan_attention(AttnKernel::kForward, dtype, params.dh, params.tq, params.tk);
  params.block_q = plan.block_q;
  params.block_k = plan.block_k;
  params.head_pad = plan.head_pad;
  const dim3 grid(static_cast<unsigned>(attn_ceil_div(params.tq, plan.block_q)), static_cast<unsigned>(params.heads),
                  static_cast<unsigned>(batch));
  dispatch_attn_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    rt.launch(std::string("attn_fwd<") + attn_dtype_name(dtype) + ">", &attn_fwd_kernel<S>, grid, dim3(kAttnThreads),
              plan.shared_bytes, params);
  });
}

// The row terms, then dK/dV and dQ (two kernels, each output summed by one block).
template <typename Runtime>
void launch_attn_bwd(Runtime& rt, int32_t dtype, int64_t batch, AttnParams params) {
  const int64_t num_rows = batch * params.heads * params.tq;
  const int warps = kAttnThreads / kWarpSize;
  const AttnPlan kv = plan_attention(AttnKernel::kKeyGrads, dtype, params.dh, params.tq, params.tk);
  const AttnPlan qg = plan_attention(AttnKernel::kQueryGrads, dtype, params.dh, params.tq, params.tk);
  const std::string suffix = std::string("<") + attn_dtype_name(dtype) + ">";
  dispatch_attn_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    rt.launch("attn_bwd_rows" + suffix, &attn_bwd_rows_kernel<S>,
              dim3(static_cast<unsigned>(attn_ceil_div(num_rows, warps))), dim3(kAttnThreads), 0, params, num_rows);
    AttnParams p = params;
    p.block_q = kv.block_q;
    p.block_k = kv.block_k;
    p.head_pad = kv.head_pad;
    if (p.tk > 0) {
      const dim3 grid(static_cast<unsigned>(attn_ceil_div(p.tk, kv.block_k)), static_cast<unsigned>(p.heads / p.group),
                      static_cast<unsigned>(batch));
      rt.launch("attn_bwd_dkdv" + suffix, &attn_bwd_dkdv_kernel<S>, grid, dim3(kAttnThreads), kv.shared_bytes, p);
    }
    p.block_q = qg.block_q;
    p.block_k = qg.block_k;
    p.head_pad = qg.head_pad;
    const dim3 grid(static_cast<unsigned>(attn_ceil_div(p.tq, qg.block_q)), static_cast<unsigned>(p.heads),
                    static_cast<unsigned>(batch));
    rt.launch("attn_bwd_dq" + suffix, &attn_bwd_dq_kernel<S>, grid, dim3(kAttnThreads), qg.shared_bytes, p);
  });
}

}  // namespace attnres::cuda
