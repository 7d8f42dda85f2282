// The fp32 / fp64 CUDA attention kernels (docs/design.md §2.4): FlashAttention-2's
// tiling with exact IEEE products on the CUDA cores (like Triton's
// input_precision="ieee"; fp64 so that gradcheck runs through these kernels).
// The fp16 / bf16 kernels are attention_mma_kernels.cuh.
//
//   attn_fwd_simt_kernel    a block owns Bq query rows of one head and walks the key tiles of
//                           Bk keys (online softmax); saves lse. Causal: the walk stops at the
//                           last key the tile's last query sees.
//   attn_bwd_dkdv_simt_kernel  a block owns Bk keys of one kv head: for every head of its group
//                           and every query tile that sees them, Sᵀ = K qᵀ, dPᵀ = V dOᵀ,
//                           Pᵀ = exp(Sᵀ·scale - lse), dSᵀ = Pᵀ ⊙ (dPᵀ - δ), dV += Pᵀ dO, dK += dSᵀ q.
//   attn_bwd_dq_simt_kernel a block owns Bq queries of one head: S = q Kᵀ, dP = dO Vᵀ,
//                           dS = P ⊙ (dP - δ), dQ += dS K over the key tiles it sees.
//
// Every product goes through shared memory: each thread computes 4 x 4 output
// micro-tiles summing over k in order, and the running accumulators (O, dK and
// dV, dQ) live in shared memory too, each [tile rows, Dp] with Dp = Dh rounded up
// to 16. Dh stays a run-time value (one kernel per dtype). Tiles are read element
// by element with the tensor's own strides, zero-filled past Tq / Tk and Dh, so
// padding rows and columns contribute nothing and the poisoned shared memory of
// the harness never reaches a result.
#pragma once

#include <cstdint>

#include "attention_common.cuh"

namespace attnres::cuda {

constexpr int kAttnSimtThreads = 128;  // four warps per block

// What each kernel keeps in shared memory (acc_t: float for fp32, double for fp64).
template <typename acc_t>
struct SimtFwdSmem {
  acc_t *q, *k, *v, *s, *o, *row_max, *row_sum;
  int32_t* key_ok;
  __host__ __device__ SimtFwdSmem(SmemCarver& c, int bq, int bk, int dp) {
    q = c.take<acc_t>(int64_t(bq) * dp);
    k = c.take<acc_t>(int64_t(bk) * dp);
    v = c.take<acc_t>(int64_t(bk) * dp);
    s = c.take<acc_t>(int64_t(bq) * bk);
    o = c.take<acc_t>(int64_t(bq) * dp);
    row_max = c.take<acc_t>(bq);
    row_sum = c.take<acc_t>(bq);
    key_ok = c.take<int32_t>(bk);
  }
};

// The backward kernels: `a`, `b` hold the block's own rows (dK/dV: K and V; dQ: q
// and dO), `c`, `d` the walked tiles (dK/dV: q and dO; dQ: K and V); `s` and `dp`
// the two score products (overwritten by P and dS), `acc0`/`acc1` the gradient
// accumulators (dK, dV / dQ).
template <typename acc_t>
struct SimtBwdSmem {
  acc_t *a, *b, *c, *d, *s, *dp, *acc0, *acc1, *row_lse, *row_delta;
  int32_t* key_ok;
  __host__ __device__ SimtBwdSmem(SmemCarver& carve, bool key_grads, int bq, int bk, int dp_) {
    const int own = key_grads ? bk : bq, walked = key_grads ? bq : bk;
    a = carve.take<acc_t>(int64_t(own) * dp_);
    b = carve.take<acc_t>(int64_t(own) * dp_);
    c = carve.take<acc_t>(int64_t(walked) * dp_);
    d = carve.take<acc_t>(int64_t(walked) * dp_);
    s = carve.take<acc_t>(int64_t(bq) * bk);
    dp = carve.take<acc_t>(int64_t(bq) * bk);
    acc0 = carve.take<acc_t>(int64_t(own) * dp_);
    acc1 = key_grads ? carve.take<acc_t>(int64_t(own) * dp_) : nullptr;
    row_lse = carve.take<acc_t>(bq);
    row_delta = carve.take<acc_t>(bq);
    key_ok = carve.take<int32_t>(bk);
  }
};

// ------------------------------------------------------------------ device helpers

// Rows [t0, t0 + rows) of head (b, h) of x into tile [tile_rows, Dp]; zero past `rows` and Dh.
template <typename S>
__device__ __forceinline__ void simt_load_rows(const HeadView& x, int64_t b, int64_t h, int64_t t0, int rows,
                                               int tile_rows, int64_t dh, int dp, attn_acc_t<S>* tile) {
  using acc_t = attn_acc_t<S>;
  const S* base = static_cast<const S*>(x.data) + b * x.stride_b + h * x.stride_h;
  for (int e = threadIdx.x; e < tile_rows * dp; e += blockDim.x) {
    const int r = e / dp, d = e % dp;
    tile[e] = r < rows && d < dh ? to_acc<acc_t>(load_global(base + (t0 + r) * x.stride_t + d * x.stride_d)) : acc_t(0);
  }
}

// key_ok[c] = whether key j0 + c exists and is not padding.
__device__ __forceinline__ void simt_load_key_flags(const AttnParams& p, int64_t b, int64_t j0, int n, int bk,
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
// transpose [N, K] (ldb). Called by the whole block; no barrier inside (the caller
// synchronizes before reading C). Each thread takes 4 x 4 output micro-tiles in
// turn, summing over k in order; M, N multiples of 4.
template <typename acc_t, bool kBTransposed>
__device__ __forceinline__ void simt_tile_product(int M, int N, int K, const acc_t* A, int lda, const acc_t* B, int ldb,
                                                  acc_t* C, int ldc, bool accumulate) {
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

// Whether query i0 + r may see key j0 + c (key_ok: the key exists and is not padding).
__device__ __forceinline__ bool simt_visible(const AttnParams& p, const int32_t* key_ok, int64_t i0, int r, int64_t j0,
                                             int c) {
  return key_ok[c] != 0 && (!p.causal || j0 + c <= i0 + r + p.offset);
}

// ------------------------------------------------------------------ forward

// grid (ceil(Tq / Bq), H, B), kAttnSimtThreads threads.
template <typename S>
__global__ void __launch_bounds__(kAttnSimtThreads) attn_fwd_simt_kernel(AttnParams p) {
  using acc_t = attn_acc_t<S>;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t i0 = int64_t(blockIdx.x) * bq, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const SimtFwdSmem<acc_t> sm(carve, bq, bk, dp);
  const acc_t scale = static_cast<acc_t>(p.scale);
  constexpr acc_t kNegInf = neg_infinity<acc_t>();

  simt_load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.q);
  fill_shared(sm.o, int64_t(bq) * dp, acc_t(0));
  fill_shared(sm.row_max, bq, kNegInf);
  fill_shared(sm.row_sum, bq, acc_t(0));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
  // Causal: the last key any query of the tile sees; later tiles are never visited.
  const int64_t kv_end = attn_key_end(p, i0 + rows);
  for (int64_t j0 = 0; j0 < kv_end; j0 += bk) {
    const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
    __syncthreads();  // the previous tile's products are done with K, V and P
    simt_load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.k);
    simt_load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.v);
    simt_load_key_flags(p, b, j0, n, bk, sm.key_ok);
    __syncthreads();
    simt_tile_product<acc_t, true>(bq, bk, dp, sm.q, dp, sm.k, dp, sm.s, bk, false);
    __syncthreads();
    // Online softmax, one warp per row: new running max, P = exp(s - max) (in place of
    // the scores), the row sum, and the rescale of the row's accumulator by exp(old max - new max).
    for (int r = warp; r < bq; r += warps) {
      acc_t* s_row = sm.s + r * bk;
      acc_t tile_max = kNegInf;
      for (int c = lane; c < bk; c += kWarpSize) {
        const acc_t s = simt_visible(p, sm.key_ok, i0, r, j0, c) ? s_row[c] * scale : kNegInf;
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
        s_row[c] = prob;
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
    simt_tile_product<acc_t, false>(bq, dp, bk, sm.s, bk, sm.v, dp, sm.o, dp, true);
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

// P = exp2(s · scale · log2 e - lse_log2) where query i0 + r sees key j0 + c, else 0,
// and dS = P ⊙ (dP - δ), in place of s and dp, for a [Bq, Bk] pair tile;
// `keys_on_rows`: the tile is transposed (rows are keys, as in the dK/dV kernel).
template <typename acc_t>
__device__ __forceinline__ void simt_pair_scores(const AttnParams& p, const SimtBwdSmem<acc_t>& sm, bool keys_on_rows,
                                                 int64_t i0, int rows_q, int64_t j0) {
  const int bq = p.block_q, bk = p.block_k;
  const acc_t scale_log2 = static_cast<acc_t>(p.scale * kLog2e);
  for (int e = threadIdx.x; e < bq * bk; e += blockDim.x) {
    const int r = keys_on_rows ? e % bq : e / bk, c = keys_on_rows ? e / bq : e % bk;
    const bool seen = r < rows_q && simt_visible(p, sm.key_ok, i0, r, j0, c);
    const acc_t prob = seen ? dev_exp2(sm.s[e] * scale_log2 - sm.row_lse[r]) : acc_t(0);
    sm.s[e] = prob;
    sm.dp[e] = prob * (sm.dp[e] - sm.row_delta[r]);
  }
}

// The lse_log2 and δ of query rows [i0, i0 + rows) of head (b, h); padding rows get
// lse_log2 = +inf (P = 0) and δ = 0.
template <typename acc_t>
__device__ __forceinline__ void simt_load_row_terms(const AttnParams& p, int64_t b, int64_t h, int64_t i0, int rows,
                                                    int bq, acc_t* row_lse, acc_t* row_delta) {
  const int64_t row0 = (b * p.heads + h) * p.tq + i0;
  for (int r = threadIdx.x; r < bq; r += blockDim.x) {
    row_lse[r] = r < rows ? load_global(static_cast<const acc_t*>(p.lse_log2) + row0 + r) : -neg_infinity<acc_t>();
    row_delta[r] = r < rows ? load_global(static_cast<const acc_t*>(p.delta) + row0 + r) : acc_t(0);
  }
}

// Stores rows [0, rows) of a [*, Dp] accumulator times `mul` to row `row0` on of a contiguous [*, Dh] tensor.
template <typename S, typename acc_t>
__device__ __forceinline__ void simt_store_rows(const acc_t* acc, int rows, int dp, int64_t dh, acc_t mul, void* dst,
                                                int64_t row0) {
  S* out = static_cast<S*>(dst) + row0 * dh;
  for (int64_t e = threadIdx.x; e < int64_t(rows) * dh; e += blockDim.x) {
    const int r = static_cast<int>(e / dh), d = static_cast<int>(e % dh);
    store_global(out + e, from_acc<S>(acc[r * dp + d] * mul));
  }
}

// grid (ceil(Tk / Bk), Hkv, B).
template <typename S>
__global__ void __launch_bounds__(kAttnSimtThreads) attn_bwd_dkdv_simt_kernel(AttnParams p) {
  using acc_t = attn_acc_t<S>;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t j0 = int64_t(blockIdx.x) * bk, hk = blockIdx.y, b = blockIdx.z;
  const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const SimtBwdSmem<acc_t> sm(carve, true, bq, bk, dp);

  simt_load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.a);
  simt_load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.b);
  simt_load_key_flags(p, b, j0, n, bk, sm.key_ok);
  fill_shared(sm.acc0, int64_t(bk) * dp, acc_t(0));
  fill_shared(sm.acc1, int64_t(bk) * dp, acc_t(0));
  // Causal: query tiles before the first query that sees key j0 are skipped.
  const int64_t first = attn_query_begin(p, j0);
  for (int64_t g = 0; g < p.group; ++g) {
    const int64_t h = hk * p.group + g;
    for (int64_t i0 = first / bq * bq; i0 < p.tq; i0 += bq) {
      const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
      __syncthreads();  // the previous pair's products are done with q, dO, P and dS
      simt_load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.c);
      simt_load_rows<S>(p.grad_out, b, h, i0, rows, bq, p.dh, dp, sm.d);
      simt_load_row_terms(p, b, h, i0, rows, bq, sm.row_lse, sm.row_delta);
      __syncthreads();
      simt_tile_product<acc_t, true>(bk, bq, dp, sm.a, dp, sm.c, dp, sm.s, bq, false);   // Sᵀ = K qᵀ
      simt_tile_product<acc_t, true>(bk, bq, dp, sm.b, dp, sm.d, dp, sm.dp, bq, false);  // dPᵀ = V dOᵀ
      __syncthreads();
      simt_pair_scores(p, sm, true, i0, rows, j0);
      __syncthreads();
      simt_tile_product<acc_t, false>(bk, dp, bq, sm.s, bq, sm.d, dp, sm.acc1, dp, true);   // dV += Pᵀ dO
      simt_tile_product<acc_t, false>(bk, dp, bq, sm.dp, bq, sm.c, dp, sm.acc0, dp, true);  // dK += dSᵀ q
    }
  }
  __syncthreads();
  const int64_t row0 = (b * (p.heads / p.group) + hk) * p.tk + j0;
  simt_store_rows<S>(sm.acc0, n, dp, p.dh, static_cast<acc_t>(p.scale), p.grad_k, row0);
  simt_store_rows<S>(sm.acc1, n, dp, p.dh, acc_t(1), p.grad_v, row0);
}

// grid (ceil(Tq / Bq), H, B).
template <typename S>
__global__ void __launch_bounds__(kAttnSimtThreads) attn_bwd_dq_simt_kernel(AttnParams p) {
  using acc_t = attn_acc_t<S>;
  const int bq = p.block_q, bk = p.block_k, dp = p.head_pad;
  const int64_t i0 = int64_t(blockIdx.x) * bq, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(bq, p.tq - i0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const SimtBwdSmem<acc_t> sm(carve, false, bq, bk, dp);

  simt_load_rows<S>(p.q, b, h, i0, rows, bq, p.dh, dp, sm.a);
  simt_load_rows<S>(p.grad_out, b, h, i0, rows, bq, p.dh, dp, sm.b);
  simt_load_row_terms(p, b, h, i0, rows, bq, sm.row_lse, sm.row_delta);
  fill_shared(sm.acc0, int64_t(bq) * dp, acc_t(0));
  const int64_t kv_end = attn_key_end(p, i0 + rows);
  for (int64_t j0 = 0; j0 < kv_end; j0 += bk) {
    const int n = static_cast<int>(imin<int64_t>(bk, p.tk - j0));
    __syncthreads();  // the previous tile's dQ product is done with K and dS
    simt_load_rows<S>(p.k, b, hk, j0, n, bk, p.dh, dp, sm.c);
    simt_load_rows<S>(p.v, b, hk, j0, n, bk, p.dh, dp, sm.d);
    simt_load_key_flags(p, b, j0, n, bk, sm.key_ok);
    __syncthreads();
    simt_tile_product<acc_t, true>(bq, bk, dp, sm.a, dp, sm.c, dp, sm.s, bk, false);   // S = q Kᵀ
    simt_tile_product<acc_t, true>(bq, bk, dp, sm.b, dp, sm.d, dp, sm.dp, bk, false);  // dP = dO Vᵀ
    __syncthreads();
    simt_pair_scores(p, sm, false, i0, rows, j0);
    __syncthreads();
    simt_tile_product<acc_t, false>(bq, dp, bk, sm.dp, bk, sm.c, dp, sm.acc0, dp, true);  // dQ += dS K
  }
  __syncthreads();
  simt_store_rows<S>(sm.acc0, rows, dp, p.dh, static_cast<acc_t>(p.scale), p.grad_q, (b * p.heads + h) * p.tq + i0);
}

}  // namespace attnres::cuda
