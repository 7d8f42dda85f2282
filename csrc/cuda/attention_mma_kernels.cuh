// The fp16 / bf16 CUDA attention kernels (docs/design.md §2.4) on the tensor cores,
// in FlashAttention-2's structure. Torch-free (see attention_kernels.cuh).
//
// Layout. A block has W warps (8, or 4 where shared memory is short); every warp
// owns 16 rows of the block's tile and keeps everything about them in registers:
// the score tile S of its rows (mma.sync m16n8k16 accumulators), the online-softmax
// statistics, and its rows of the output accumulator (O, dQ, or dK and dV). The
// products' operands come from shared memory by ldmatrix, the probabilities P and
// dS feed the next product straight from the registers that hold them (an
// accumulator fragment of S is, pair by pair, the A fragment of P · V), rounded to
// the input dtype as FlashAttention does. Shared memory holds only the operand
// tiles, filled by cp.async in 16-byte chunks: the block's own rows once, and the
// walked tiles double-buffered (`stages` = 2: tile t + 1 is in flight while tile t
// is multiplied, one block barrier per tile) or single-buffered (`stages` = 1, where
// shared memory is short). Views whose rows are not 16-byte chunks (odd strides,
// Dh not a multiple of 8) are read element by element into the same tiles.
//
// Head sizes compile in buckets of 32 (kHeadDim: Dh rounded up; the padding columns
// are zero in every operand tile, so they add nothing and are never stored).
//
//   attn_fwd_mma_kernel       grid (ceil(Tq / 16W), H, B): a block owns 16W queries and walks
//                             key tiles of kKeys keys: S = q Kᵀ, online softmax, O += P V;
//                             saves lse (fp32). Causal: key tiles past the last key the
//                             block's last query sees are never loaded.
//   attn_bwd_dkdv_mma_kernel  grid (ceil(Tk / (16W / kSplit)), Hkv, B): a block owns keys and
//                             walks the query tiles (kQueries rows) of every head of its group
//                             that see them: Sᵀ = K qᵀ, Pᵀ = exp2(Sᵀ · scale · log2 e - lse_log2),
//                             dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ - δ), dK += dSᵀ q.
//                             Past Dh = 128, kSplit = 2 warps share 16 keys, each accumulating
//                             half of dK and dV's columns (both compute the scores).
//   attn_bwd_dq_mma_kernel    grid (ceil(Tq / 16W), H, B): a block owns 16W queries and walks
//                             the key tiles they see: S = q Kᵀ, dP = dO Vᵀ, dS = P ⊙ (dP - δ),
//                             dQ += dS K.
// Tiles where some pair is hidden (key padding, the causal diagonal, the ragged last
// tile) are masked per element; the others skip the test.
#pragma once

#include <cstdint>
#include <cstring>

#include "attention_common.cuh"
#include "mma_primitives.cuh"

namespace attnres::cuda {

constexpr int kMmaMaxWarps = 8, kMmaMaxThreads = kMmaMaxWarps * kWarpSize;
constexpr int kMmaHeadBucket = 32;  // head sizes compile in buckets of 32 up to kAttnMaxHeadDim

template <int kHeadDim>
struct MmaTiles {
  static constexpr int kKeys = kHeadDim <= 128 ? 64 : 32;    // key tile of the forward and dQ kernels
  static constexpr int kQueries = kHeadDim <= 64 ? 64 : 32;  // query tile of the dK/dV kernel
  static constexpr int kSplit = kHeadDim <= 128 ? 1 : 2;     // warps sharing 16 keys in the dK/dV kernel
  static_assert(kHeadDim % kMmaHeadBucket == 0 && kHeadDim <= kAttnMaxHeadDim);
  static_assert(SwizzledRows<kHeadDim>::conflict_free());
};

// ------------------------------------------------------------------ shared memory layout

// Forward: q [16W, D]; per stage K, V [kKeys, D] and the key flags.
template <int kHeadDim>
struct MmaFwdSmem {
  static constexpr int kKeys = MmaTiles<kHeadDim>::kKeys;
  uint16_t *q, *kv;
  uint8_t* key_ok;
  __host__ __device__ MmaFwdSmem(SmemCarver& c, int warps, int stages) {
    q = c.take<uint16_t>(int64_t(warps) * 16 * kHeadDim);
    kv = c.take<uint16_t>(int64_t(stages) * 2 * kKeys * kHeadDim);
    key_ok = c.take<uint8_t>(int64_t(stages) * kKeys);
  }
  __device__ uint16_t* k(int buf) const { return kv + buf * 2 * kKeys * kHeadDim; }
  __device__ uint16_t* v(int buf) const { return k(buf) + kKeys * kHeadDim; }
};

// dQ: q and dO [16W, D]; per stage K, V [kKeys, D] and the key flags.
template <int kHeadDim>
struct MmaDqSmem {
  static constexpr int kKeys = MmaTiles<kHeadDim>::kKeys;
  uint16_t *q, *grad_out, *kv;
  uint8_t* key_ok;
  __host__ __device__ MmaDqSmem(SmemCarver& c, int warps, int stages) {
    q = c.take<uint16_t>(int64_t(warps) * 16 * kHeadDim);
    grad_out = c.take<uint16_t>(int64_t(warps) * 16 * kHeadDim);
    kv = c.take<uint16_t>(int64_t(stages) * 2 * kKeys * kHeadDim);
    key_ok = c.take<uint8_t>(int64_t(stages) * kKeys);
  }
  __device__ uint16_t* k(int buf) const { return kv + buf * 2 * kKeys * kHeadDim; }
  __device__ uint16_t* v(int buf) const { return k(buf) + kKeys * kHeadDim; }
};

// dK/dV: K and V [16W / kSplit, D]; per stage q, dO [kQueries, D], lse_log2 and δ [kQueries].
template <int kHeadDim>
struct MmaDkdvSmem {
  static constexpr int kQueries = MmaTiles<kHeadDim>::kQueries;
  uint16_t *k, *v, *qdo;
  float* rows;
  __host__ __device__ MmaDkdvSmem(SmemCarver& c, int warps, int stages) {
    const int64_t keys = int64_t(warps) / MmaTiles<kHeadDim>::kSplit * 16;
    k = c.take<uint16_t>(keys * kHeadDim);
    v = c.take<uint16_t>(keys * kHeadDim);
    qdo = c.take<uint16_t>(int64_t(stages) * 2 * kQueries * kHeadDim);
    rows = c.take<float>(int64_t(stages) * 2 * kQueries);
  }
  __device__ uint16_t* q(int buf) const { return qdo + buf * 2 * kQueries * kHeadDim; }
  __device__ uint16_t* grad_out(int buf) const { return q(buf) + kQueries * kHeadDim; }
  __device__ float* lse_log2(int buf) const { return rows + buf * 2 * kQueries; }
  __device__ float* delta(int buf) const { return lse_log2(buf) + kQueries; }
};

// ------------------------------------------------------------------ tiles

// Rows [t0, t0 + rows) of head (b, h) of x into a [tile_rows, kHeadDim] swizzled
// tile, zero past `rows` and Dh. Vector views: one 16-byte cp.async per chunk
// (the caller commits and waits); others element by element.
template <typename S, int kHeadDim>
__device__ __forceinline__ void load_tile(uint16_t* tile, const HeadView& x, int64_t b, int64_t h, int64_t t0, int rows,
                                          int tile_rows, int64_t dh) {
  using Rows = SwizzledRows<kHeadDim>;
  const S* base = static_cast<const S*>(x.data) + b * x.stride_b + h * x.stride_h;
  for (int e = threadIdx.x; e < tile_rows * Rows::kChunks; e += blockDim.x) {
    const int r = e / Rows::kChunks, c = e % Rows::kChunks;
    uint16_t* dst = tile + Rows::offset(r, c);
    const bool inside = r < rows && c * 8 < dh;
    const S* src = inside ? base + (t0 + r) * x.stride_t + int64_t(c) * 8 * x.stride_d : base;
    if (x.vector) {
      cp_async<16>(dst, src, inside);
    } else {
      uint32_t pairs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int d = c * 8 + 2 * i;
        const uint32_t lo = inside && d < dh ? load_global(src + 2 * i * x.stride_d).bits : 0;
        const uint32_t hi = inside && d + 1 < dh ? load_global(src + (2 * i + 1) * x.stride_d).bits : 0;
        pairs[i] = lo | hi << 16;
      }
      *reinterpret_cast<uint4*>(dst) = uint4{pairs[0], pairs[1], pairs[2], pairs[3]};
    }
  }
}

// key_ok[c] = whether key j0 + c exists and is not padding (the key padding mask only).
__device__ __forceinline__ void load_key_ok(const AttnParams& p, int64_t b, int64_t j0, int keys, uint8_t* key_ok) {
  for (int c = threadIdx.x; c < keys; c += blockDim.x) {
    key_ok[c] = j0 + c < p.tk && load_global(p.mask + b * p.mask_stride_b + (j0 + c) * p.mask_stride_t) != 0;
  }
}

// The shared-memory element offsets of one lane's row address in an ldmatrix.x4 of
// a swizzled [*, kElems] tile. Matrix m = lane / 8 of the x4 covers rows r0 + 8 · mr
// and chunk c0 + mc: kRowsFirst, (mr, mc) = (m % 2, m / 2) — an A operand [16, 16]
// (registers 0-3 as mma.sync takes them), or with .trans the B operands of two
// adjacent n-tiles of a tile stored [k, n] (registers 0-1 and 2-3); otherwise
// (m / 2, m % 2) — the B operands of two adjacent n-tiles of a tile stored [n, k].
// The swizzle depends on the row mod 8 and flips chunk bits below kGroup only, so
// an offset is (row, chunk-group) arithmetic plus one of kGroup / 2 per-lane values:
// the addresses of a whole tile product differ by immediates. `bias` (even,
// warp-uniform) shifts every chunk; a caller's chunk0 % kGroup + bias stays below kGroup.
template <int kElems, bool kRowsFirst>
struct LdsmOffsets {
  static constexpr int kGroup = SwizzledRows<kElems>::kChunks % 8 == 0 ? 8 : 4;
  int lane_offset[kGroup / 2];
  __device__ __forceinline__ LdsmOffsets(int lane, int bias) {
    const int m = lane / 8, mr = kRowsFirst ? m % 2 : m / 2, mc = kRowsFirst ? m / 2 : m % 2;
    const int row = mr * 8 + lane % 8, flip = mc ^ SwizzledRows<kElems>::mask(row);
#pragma unroll
    for (int j = 0; j < kGroup / 2; ++j) lane_offset[j] = row * kElems + ((2 * j + bias) ^ flip) * 8;
  }
  // Rows r0 .. r0 + 15 (r0 a multiple of 8), chunks c0 + bias and c0 + bias + 1 (c0 even).
  __device__ __forceinline__ int operator()(int r0, int c0) const {
    return r0 * kElems + c0 / kGroup * kGroup * 8 + lane_offset[c0 % kGroup / 2];
  }
};

// acc[kN][4] += A [16, kHeadDim] (rows a_row0.. of `a_tile`) · Bᵀ, B [8 kN, kHeadDim]
// (rows b_row0.. of `b_tile`): a warp's 16 x (8 kN) score tile.
template <typename S, int kHeadDim, int kN>
__device__ __forceinline__ void warp_scores(float (&acc)[kN][4], const uint16_t* a_tile, int a_row0,
                                            const uint16_t* b_tile, int b_row0,
                                            const LdsmOffsets<kHeadDim, true>& a_lane,
                                            const LdsmOffsets<kHeadDim, false>& b_lane) {
  static_assert(kN % 2 == 0);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[4];
    ldmatrix<4, false>(a, a_tile + a_lane(a_row0, 2 * kk));
#pragma unroll
    for (int n = 0; n < kN; n += 2) {
      uint32_t b[4];
      ldmatrix<4, false>(b, b_tile + b_lane(b_row0 + n * 8, 2 * kk));
      mma_m16n8k16<S>(acc[n], a, b[0], b[1]);
      mma_m16n8k16<S>(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// acc[kD][4] += P [16, 8 kN] (accumulator fragments in registers, rounded to S) · B, B
// the rows of `b_tile` [8 kN, kHeadDim] from b_row0; accumulator pair (d, d + 1) holds
// the chunks d · kStride + bias and the next (kStride > 1: warps interleave their chunk pairs).
template <typename S, int kHeadDim, int kN, int kD, int kStride>
__device__ __forceinline__ void warp_product(float (&acc)[kD][4], const float (&p)[kN][4], const uint16_t* b_tile,
                                             int b_row0, const LdsmOffsets<kHeadDim, true>& b_lane) {
  static_assert(kN % 2 == 0 && kD % 2 == 0);
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) {
    const uint32_t a[4] = {pack_pair<S>(p[2 * kk][0], p[2 * kk][1]), pack_pair<S>(p[2 * kk][2], p[2 * kk][3]),
                           pack_pair<S>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           pack_pair<S>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int d = 0; d < kD; d += 2) {
      uint32_t b[4];
      ldmatrix<4, true>(b, b_tile + b_lane(b_row0 + kk * 16, d * kStride));
      mma_m16n8k16<S>(acc[d], a, b[0], b[1]);
      mma_m16n8k16<S>(acc[d + 1], a, b[2], b[3]);
    }
  }
}

// Writes a warp's [16, 8 kD] accumulator times `mul` (per row half) into rows row0.. of a
// swizzled tile, accumulator d at chunk d / 2 · 2 kStride + bias + d % 2 (as warp_product
// lays them out), rounded to S; the caller synchronizes before the tile is read.
template <typename S, int kHeadDim, int kD, int kStride>
__device__ __forceinline__ void stage_rows(uint16_t* tile, int row0, int bias, const float (&acc)[kD][4],
                                           const float (&mul)[2], int lane) {
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int d = 0; d < kD; ++d) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int chunk = d / 2 * 2 * kStride + bias + d % 2;
      const uint32_t pair = pack_pair<S>(acc[d][2 * half] * mul[half], acc[d][2 * half + 1] * mul[half]);
      *reinterpret_cast<uint32_t*>(tile + SwizzledRows<kHeadDim>::offset(row0 + g + 8 * half, chunk) + 2 * t4) = pair;
    }
  }
}

// Rows [0, rows) of a swizzled tile (threads `first`, `first` + `stride`, ... of the
// block) to a contiguous [*, Dh] tensor at row `row0`: 16-byte stores when Dh is a
// multiple of 8, element stores otherwise.
template <typename S, int kHeadDim>
__device__ __forceinline__ void store_tile(const uint16_t* tile, int rows, int64_t dh, void* dst, int64_t row0,
                                           int first, int stride) {
  using Rows = SwizzledRows<kHeadDim>;
  S* out = static_cast<S*>(dst) + row0 * dh;
  for (int e = first; e < rows * Rows::kChunks; e += stride) {
    const int r = e / Rows::kChunks, c = e % Rows::kChunks;
    if (c * 8 >= dh) continue;
    const uint16_t* src = tile + Rows::offset(r, c);
    S* to = out + r * dh + c * 8;
    if (dh % 8 == 0) {
      store_global(reinterpret_cast<uint4*>(to), *reinterpret_cast<const uint4*>(src));
    } else {
      for (int i = 0; i < 8 && c * 8 + i < dh; ++i) store_global(to + i, S{src[i]});
    }
  }
}

// Which columns (keys j0 + c, c < kKeys) of a tile the lane's two rows (queries i
// and i + 8) see: the key exists, is not padding (key_ok: the tile's mask flags, read
// when there is a mask) and, under the causal mask, j <= i + offset. Tile-relative
// 32-bit bounds, set up once per tile.
template <int kKeys>
struct KeyColumns {
  int key_end, last[2];
  const uint8_t* key_ok;
  __device__ __forceinline__ KeyColumns(const AttnParams& p, const uint8_t* flags, int64_t i, int64_t j0)
      : key_end(clamp_to_int(p.tk - j0, 0, kKeys)), key_ok(p.mask != nullptr ? flags : nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
      last[half] = p.causal ? clamp_to_int(i + 8 * half + p.offset - j0, -1, kKeys) : kKeys;
  }
  __device__ __forceinline__ bool operator()(int c, int half) const {
    return c < key_end && c <= last[half] && (key_ok == nullptr || key_ok[c] != 0);
  }
};

// Which columns (queries i0 + c, c < kQueries) of a tile see the lane's two rows
// (keys j and j + 8, key_ok: whether each exists and is not padding): the query
// exists and, under the causal mask, j <= i + offset.
template <int kQueries>
struct QueryColumns {
  int query_end, first[2];
  __device__ __forceinline__ QueryColumns(const AttnParams& p, const bool (&key_ok)[2], int64_t j, int64_t i0)
      : query_end(clamp_to_int(p.tq - i0, 0, kQueries)) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      first[half] = !key_ok[half] ? kQueries : p.causal ? clamp_to_int(j + 8 * half - p.offset - i0, 0, kQueries) : 0;
    }
  }
  __device__ __forceinline__ bool operator()(int c, int half) const { return c >= first[half] && c < query_end; }
};

// ------------------------------------------------------------------ forward

template <typename S, int kHeadDim>
__global__ void __launch_bounds__(kMmaMaxThreads) attn_fwd_mma_kernel(AttnParams p) {
  constexpr int kKeys = MmaTiles<kHeadDim>::kKeys, kN = kKeys / 8, kD = kHeadDim / 8;
  constexpr float kNegInf = neg_infinity<float>();
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t4 = lane % 4, row0 = warp * 16;
  const int64_t i0 = int64_t(blockIdx.x) * warps * 16, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(warps * 16, p.tq - i0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const MmaFwdSmem<kHeadDim> sm(carve, warps, p.stages);
  const float scale_log2 = static_cast<float>(p.scale * kLog2e);
  const LdsmOffsets<kHeadDim, true> rows_first(lane, 0);
  const LdsmOffsets<kHeadDim, false> cols_first(lane, 0);
  const int tiles = static_cast<int>((attn_key_end(p, i0 + rows) + kKeys - 1) / kKeys);
  auto load_keys = [&](int tile, int buf) {
    const int64_t j0 = int64_t(tile) * kKeys;
    const int keys = static_cast<int>(imin<int64_t>(kKeys, p.tk - j0));
    load_tile<S, kHeadDim>(sm.k(buf), p.k, b, hk, j0, keys, kKeys, p.dh);
    load_tile<S, kHeadDim>(sm.v(buf), p.v, b, hk, j0, keys, kKeys, p.dh);
    if (p.mask != nullptr) load_key_ok(p, b, j0, kKeys, sm.key_ok + buf * kKeys);
  };

  load_tile<S, kHeadDim>(sm.q, p.q, b, h, i0, rows, warps * 16, p.dh);
  if (tiles > 0) load_keys(0, 0);
  cp_async_commit();
  float o[kD][4] = {}, row_max[2] = {kNegInf, kNegInf}, row_sum[2] = {0.0f, 0.0f};
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = p.stages == 2 ? tile & 1 : 0;
    if (p.stages == 1 && tile > 0) {
      __syncthreads();  // every warp is done with the previous tile
      load_keys(tile, 0);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();  // the tile is in; with two stages every warp is also done with the other buffer
    if (p.stages == 2 && tile + 1 < tiles) {
      load_keys(tile + 1, buf ^ 1);
      cp_async_commit();
    }
    float s[kN][4] = {};
    warp_scores<S, kHeadDim, kN>(s, sm.q, row0, sm.k(buf), 0, rows_first, cols_first);
    const int64_t j0 = int64_t(tile) * kKeys;
    if (p.mask != nullptr || j0 + kKeys > p.tk || (p.causal && j0 + kKeys - 1 > i0 + p.offset)) {
      const KeyColumns<kKeys> seen(p, sm.key_ok + buf * kKeys, i0 + row0 + g, j0);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!seen(n * 8 + 2 * t4 + e % 2, e / 2)) s[n][e] = kNegInf;
        }
      }
    }
    // Online softmax per row half (rows g and g + 8 of the warp): the quad of lanes
    // that holds a row agrees on its maximum; the row sums stay per lane until the end.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = row_max[half];
#pragma unroll
      for (int n = 0; n < kN; ++n) tile_max = dev_fmax(tile_max, dev_fmax(s[n][2 * half], s[n][2 * half + 1]));
      tile_max = dev_fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = dev_fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float shift = tile_max == kNegInf ? 0.0f : tile_max * scale_log2;  // no visible key yet: every P is 0
      const float rescale = dev_exp2(row_max[half] * scale_log2 - shift);
      row_max[half] = tile_max;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[n][e] = dev_exp2(s[n][e] * scale_log2 - shift);
          sum += s[n][e];
        }
      }
      row_sum[half] = row_sum[half] * rescale + sum;
#pragma unroll
      for (int d = 0; d < kD; ++d) {
        o[d][2 * half] *= rescale;
        o[d][2 * half + 1] *= rescale;
      }
    }
    warp_product<S, kHeadDim, kN, kD, 1>(o, s, sm.v(buf), 0, rows_first);
  }
  // No tile at all: the copies of q are still in flight, each thread's own only
  // retired by its wait, and other threads' may land on rows this warp stages below.
  cp_async_wait<0>();
  __syncthreads();
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    inv[half] = row_sum[half] == 0.0f ? 0.0f : 1.0f / row_sum[half];  // a row that sees no key: output 0
  }
  // The warp's own q rows take its output (no other warp reads them).
  stage_rows<S, kHeadDim, kD, 1>(sm.q, row0, 0, o, inv, lane);
  __syncwarp();
  const int64_t out_row0 = (b * p.heads + h) * p.tq + i0 + row0;
  const int warp_rows = static_cast<int>(imin<int64_t>(16, rows - row0));
  if (warp_rows > 0) {
    store_tile<S, kHeadDim>(sm.q + row0 * kHeadDim, warp_rows, p.dh, p.out, out_row0, lane, kWarpSize);
  }
  if (t4 == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (g + 8 * half < warp_rows) {
        const float l = row_sum[half];
        const float lse = l == 0.0f ? kNegInf : row_max[half] * static_cast<float>(p.scale) + dev_log(l);
        store_global(static_cast<float*>(p.lse) + out_row0 + g + 8 * half, lse);
      }
    }
  }
}

// ------------------------------------------------------------------ backward

template <typename S, int kHeadDim>
__global__ void __launch_bounds__(kMmaMaxThreads) attn_bwd_dkdv_mma_kernel(AttnParams p) {
  using Tiles = MmaTiles<kHeadDim>;
  constexpr int kQueries = Tiles::kQueries, kSplit = Tiles::kSplit;
  constexpr int kN = kQueries / 8, kD = kHeadDim / kSplit / 8;
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;
  const int block_keys = warps / kSplit * 16, row0 = warp / kSplit * 16, bias = warp % kSplit * 2;
  const int64_t j0 = int64_t(blockIdx.x) * block_keys, hk = blockIdx.y, b = blockIdx.z;
  const int keys = static_cast<int>(imin<int64_t>(block_keys, p.tk - j0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const MmaDkdvSmem<kHeadDim> sm(carve, warps, p.stages);
  const float scale_log2 = static_cast<float>(p.scale * kLog2e);
  const LdsmOffsets<kHeadDim, true> rows_first(lane, 0), own_columns(lane, bias);
  const LdsmOffsets<kHeadDim, false> cols_first(lane, 0);
  // Whether the keys of this lane's two accumulator rows exist and are not padding.
  bool key_ok[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t j = j0 + row0 + g + 8 * half;
    key_ok[half] = j < p.tk && (p.mask == nullptr || load_global(p.mask + b * p.mask_stride_b + j * p.mask_stride_t));
  }
  // The query tiles that see the block's keys (causal: from the first query that sees key j0
  // on), for each head of the group in turn.
  const int64_t first = attn_query_begin(p, j0), first_tile = first / kQueries;
  const int64_t tiles_per_head = first < p.tq ? (p.tq + kQueries - 1) / kQueries - first_tile : 0;
  const int64_t tiles = p.group * tiles_per_head;
  auto head_of = [&](int64_t it) { return hk * p.group + it / tiles_per_head; };
  auto first_query = [&](int64_t it) { return (first_tile + it % tiles_per_head) * kQueries; };
  auto load_queries = [&](int64_t it, int buf) {
    const int64_t h = head_of(it), i0 = first_query(it);
    const int rows = static_cast<int>(imin<int64_t>(kQueries, p.tq - i0));
    load_tile<S, kHeadDim>(sm.q(buf), p.q, b, h, i0, rows, kQueries, p.dh);
    load_tile<S, kHeadDim>(sm.grad_out(buf), p.grad_out, b, h, i0, rows, kQueries, p.dh);
    const int64_t row_base = (b * p.heads + h) * p.tq + i0;
    for (int r = threadIdx.x; r < kQueries; r += blockDim.x) {
      const bool inside = r < rows;
      cp_async<4>(sm.lse_log2(buf) + r, static_cast<const float*>(p.lse_log2) + (inside ? row_base + r : 0), inside);
      cp_async<4>(sm.delta(buf) + r, static_cast<const float*>(p.delta) + (inside ? row_base + r : 0), inside);
    }
  };

  load_tile<S, kHeadDim>(sm.k, p.k, b, hk, j0, keys, block_keys, p.dh);
  load_tile<S, kHeadDim>(sm.v, p.v, b, hk, j0, keys, block_keys, p.dh);
  if (tiles > 0) load_queries(0, 0);
  cp_async_commit();
  float dk[kD][4] = {}, dv[kD][4] = {};
  for (int64_t it = 0; it < tiles; ++it) {
    const int buf = p.stages == 2 ? static_cast<int>(it & 1) : 0;
    if (p.stages == 1 && it > 0) {
      __syncthreads();  // every warp is done with the previous tile
      load_queries(it, 0);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();  // the tile is in; with two stages every warp is also done with the other buffer
    if (p.stages == 2 && it + 1 < tiles) {
      load_queries(it + 1, buf ^ 1);
      cp_async_commit();
    }
    const int64_t i0 = first_query(it);
    const float* lse_log2 = sm.lse_log2(buf);
    const float* delta = sm.delta(buf);
    // Pᵀ = exp2(Sᵀ · scale · log2 e - lse_log2) on the pairs that are visible, 0 elsewhere.
    float pt[kN][4] = {};
    warp_scores<S, kHeadDim, kN>(pt, sm.k, row0, sm.q(buf), 0, rows_first, cols_first);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) pt[n][e] = dev_exp2(pt[n][e] * scale_log2 - lse_log2[n * 8 + 2 * t4 + e % 2]);
    }
    if (p.mask != nullptr || j0 + block_keys > p.tk || i0 + kQueries > p.tq ||
        (p.causal && j0 + block_keys - 1 > i0 + p.offset)) {
      const QueryColumns<kQueries> seen(p, key_ok, j0 + row0 + g, i0);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!seen(n * 8 + 2 * t4 + e % 2, e / 2)) pt[n][e] = 0.0f;
        }
      }
    }
    warp_product<S, kHeadDim, kN, kD, kSplit>(dv, pt, sm.grad_out(buf), 0, own_columns);  // dV += Pᵀ dO
    // dSᵀ = Pᵀ ⊙ (dPᵀ - δ), dPᵀ = V dOᵀ
    float dst[kN][4] = {};
    warp_scores<S, kHeadDim, kN>(dst, sm.v, row0, sm.grad_out(buf), 0, rows_first, cols_first);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[n][e] = pt[n][e] * (dst[n][e] - delta[n * 8 + 2 * t4 + e % 2]);
    }
    warp_product<S, kHeadDim, kN, kD, kSplit>(dk, dst, sm.q(buf), 0, own_columns);  // dK += dSᵀ q
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with K and V: their tiles take dK and dV
  const float scale[2] = {static_cast<float>(p.scale), static_cast<float>(p.scale)}, one[2] = {1.0f, 1.0f};
  stage_rows<S, kHeadDim, kD, kSplit>(sm.k, row0, bias, dk, scale, lane);
  stage_rows<S, kHeadDim, kD, kSplit>(sm.v, row0, bias, dv, one, lane);
  __syncthreads();
  const int64_t out_row0 = (b * (p.heads / p.group) + hk) * p.tk + j0;
  store_tile<S, kHeadDim>(sm.k, keys, p.dh, p.grad_k, out_row0, threadIdx.x, blockDim.x);
  store_tile<S, kHeadDim>(sm.v, keys, p.dh, p.grad_v, out_row0, threadIdx.x, blockDim.x);
}

template <typename S, int kHeadDim>
__global__ void __launch_bounds__(kMmaMaxThreads) attn_bwd_dq_mma_kernel(AttnParams p) {
  constexpr int kKeys = MmaTiles<kHeadDim>::kKeys, kN = kKeys / 8, kD = kHeadDim / 8;
  const int warps = blockDim.x / kWarpSize, warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, t4 = lane % 4, row0 = warp * 16;
  const int64_t i0 = int64_t(blockIdx.x) * warps * 16, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
  const int rows = static_cast<int>(imin<int64_t>(warps * 16, p.tq - i0));
  SmemCarver carve{dynamic_shared<unsigned char>()};
  const MmaDqSmem<kHeadDim> sm(carve, warps, p.stages);
  const float scale_log2 = static_cast<float>(p.scale * kLog2e);
  const LdsmOffsets<kHeadDim, true> rows_first(lane, 0);
  const LdsmOffsets<kHeadDim, false> cols_first(lane, 0);
  const int64_t row_base = (b * p.heads + h) * p.tq + i0 + row0;
  // lse_log2 and δ of this lane's two rows; rows past Tq: P = 0.
  float lse_log2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    lse_log2[half] = r < rows ? load_global(static_cast<const float*>(p.lse_log2) + row_base + g + 8 * half)
                              : -neg_infinity<float>();
    delta[half] = r < rows ? load_global(static_cast<const float*>(p.delta) + row_base + g + 8 * half) : 0.0f;
  }
  const int tiles = static_cast<int>((attn_key_end(p, i0 + rows) + kKeys - 1) / kKeys);
  auto load_keys = [&](int tile, int buf) {
    const int64_t j0 = int64_t(tile) * kKeys;
    const int keys = static_cast<int>(imin<int64_t>(kKeys, p.tk - j0));
    load_tile<S, kHeadDim>(sm.k(buf), p.k, b, hk, j0, keys, kKeys, p.dh);
    load_tile<S, kHeadDim>(sm.v(buf), p.v, b, hk, j0, keys, kKeys, p.dh);
    if (p.mask != nullptr) load_key_ok(p, b, j0, kKeys, sm.key_ok + buf * kKeys);
  };

  load_tile<S, kHeadDim>(sm.q, p.q, b, h, i0, rows, warps * 16, p.dh);
  load_tile<S, kHeadDim>(sm.grad_out, p.grad_out, b, h, i0, rows, warps * 16, p.dh);
  if (tiles > 0) load_keys(0, 0);
  cp_async_commit();
  float dq[kD][4] = {};
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = p.stages == 2 ? tile & 1 : 0;
    if (p.stages == 1 && tile > 0) {
      __syncthreads();  // every warp is done with the previous tile
      load_keys(tile, 0);
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();  // the tile is in; with two stages every warp is also done with the other buffer
    if (p.stages == 2 && tile + 1 < tiles) {
      load_keys(tile + 1, buf ^ 1);
      cp_async_commit();
    }
    // P = exp2(S · scale · log2 e - lse_log2) on the visible pairs, 0 elsewhere.
    float ps[kN][4] = {};
    warp_scores<S, kHeadDim, kN>(ps, sm.q, row0, sm.k(buf), 0, rows_first, cols_first);
    const int64_t j0 = int64_t(tile) * kKeys;
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ps[n][e] = dev_exp2(ps[n][e] * scale_log2 - lse_log2[e / 2]);
    }
    if (p.mask != nullptr || j0 + kKeys > p.tk || (p.causal && j0 + kKeys - 1 > i0 + p.offset)) {
      const KeyColumns<kKeys> seen(p, sm.key_ok + buf * kKeys, i0 + row0 + g, j0);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!seen(n * 8 + 2 * t4 + e % 2, e / 2)) ps[n][e] = 0.0f;
        }
      }
    }
    // dS = P ⊙ (dP - δ), dP = dO Vᵀ
    float ds[kN][4] = {};
    warp_scores<S, kHeadDim, kN>(ds, sm.grad_out, row0, sm.v(buf), 0, rows_first, cols_first);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[n][e] = ps[n][e] * (ds[n][e] - delta[e / 2]);
    }
    warp_product<S, kHeadDim, kN, kD, 1>(dq, ds, sm.k(buf), 0, rows_first);  // dQ += dS K
  }
  cp_async_wait<0>();  // as in the forward: no tile at all leaves the q and dO copies in flight
  __syncthreads();
  // The warp's own q rows take its dQ (no other warp reads them).
  const float scale[2] = {static_cast<float>(p.scale), static_cast<float>(p.scale)};
  stage_rows<S, kHeadDim, kD, 1>(sm.q, row0, 0, dq, scale, lane);
  __syncwarp();
  const int warp_rows = static_cast<int>(imin<int64_t>(16, rows - row0));
  if (warp_rows > 0) {
    store_tile<S, kHeadDim>(sm.q + row0 * kHeadDim, warp_rows, p.dh, p.grad_q, row_base, lane, kWarpSize);
  }
}

}  // namespace attnres::cuda
