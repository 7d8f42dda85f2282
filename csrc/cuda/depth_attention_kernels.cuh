// CUDA kernels of the depth read (DESIGN.md §2.1, §2.5, §2.7): forward and backward
// of Q sites over N sources, optional prefix merge and fused output RMSNorm, with
// every variant of the read's options (scale, normalised values with or without a
// key-norm weight, sliced low-rank keys). Torch-free: nvcc builds them into the
// extension (ops_cuda.cu) and the host compiler into the SIMT harness
// (csrc/simt/emulated_ops.cpp); both launch them through launch_depth_attn_fwd /
// _bwd below, with the launch configuration of plan_depth_attn.
//
// Layout. A row p (one token: the flattened leading dims) is read by a team of
// T threads (blockDim.x, a multiple of 32). Thread t owns the K groups of G
// consecutive elements starting at (k * T + t) * G, so a warp's load of group k
// is one contiguous span; G is 16 bytes of the narrowest dtype (at least 4
// elements), so a group is one or more 16-byte vector loads when every row is
// 16-byte aligned and G divides D (else element loads). Teams of
// one warp come four to a block (blockDim.y = 4); wider teams are a block.
// The sources travel in the kernel parameters (SourceTable: pointer, row stride,
// dtype of each): no stacking copy, no table to allocate or copy per call, and
// each source is loaded in its own dtype (the dtype branch is uniform across the
// block). Arithmetic is in acc_t (float; double for fp64). A site tile of QT
// sites is processed per pass; more sites take several tiles.
//
// Site parameters. Each row team stages u = scale · query ⊙ norm_weight (the
// query side of the logits), and the output-norm weight g, into shared memory
// straight from the parameters in their own dtypes and layouts ([R] shared by the
// sites or [Q, R]): no host-side product per call. With sliced low-rank keys the
// keys are the last R = D - key_start columns: u is staged at those columns and
// zero elsewhere, and the key norm sums v² over them only (R = D: key_start = 0,
// every column, the ordinary read's arithmetic).
//
// Forward (one pass over the sources, online softmax): per row, for each source
// i, the team reduces (Σ_key v², <u_q, v> for q < QT) in one warp-shuffle + shared
// memory reduction, and every thread folds the value (v; with normalize_values
// r_i v, times the key-norm weight γ_q when one is given) into its QT accumulators.
//
// Backward (fixed-order, no atomics): a team owns a fixed chunk of rows (the
// chunking depends on M only). Per row, the sources are read in pass A and again
// in pass B, from global memory or, where they fit (plan_source_cache), from a
// copy of the row's sources in shared memory made once. Pass A: with the output norm it
// recomputes h_q = Σ α_qi x_qi (+ α_a h_a) in registers (x_qi the values), goes
// back through the norm to do_q and forms δ_q = <do_q, h_q>; without it, δ_q =
// Σ_i α_qi <do_q, x_qi> (as the reference's softmax backward does). Pass B: per
// source it reduces dp_qi = <do_q, x_qi> and writes, with t_i the key columns of v_i,
//     dv_i = Σ_q α_qi do_q + ds_qi r_i u_q - (Σ_q ds_qi s_qi) r_i² t_i / R,
//     ds_qi = α_qi (dp_qi - δ_q + dlse_q) + dlogits_qi.
// With normalize_values (R = D) the values are x_qi = r_i v_i (⊙ γ_q): dp_qi =
// r_i <do_q (⊙ γ_q), v_i>, and
//     dv_i = Σ_q α_qi r_i do_q (⊙ γ_q) + ds_qi r_i u_q - (Σ_q ds_qi s_qi + α_qi dp_qi) r_i² v_i / D.
// du = Σ ds r t (in registers), dg (output norm) and dγ_values = Σ α r v ⊙ do
// (normalised values with a key-norm weight; both in shared memory) are summed
// over the chunk's rows and written as one partial per chunk; site_grads_kernel
// adds the partials in chunk order and writes the parameters' gradients in their
// own dtypes and shapes: dquery = scale du ⊙ γ, dγ = scale du ⊙ query (+ dγ_values),
// summed over the sites for a parameter the sites share.
//
// Global-memory traffic (the harness counts it; tests/backends/test_cuda_io.py checks it
// exactly). Per row, with Q <= QT (one site tile), s_i / s_a / s_o the element
// sizes of source i, the merge prefix and the output, a = sizeof(acc_t), and W =
// T / 32 warps per row team (a per-row scalar every lane loads is one request
// per warp):
//   forward   reads   Σ_i D s_i                        each source element once
//                     + [merge] Q D s_a + Q a W
//             writes  Q D s_o                          each output element once
//                     + Q a (lse) + Q N a (logits) + N a (rinv)
//   backward  reads   Σ_i D s_i                        with the source cache (fp32 math, when the
//                                                      row's sources fit in shared memory): each
//                                                      source element once, the floor; else
//                     2 Σ_i D s_i                      δ_q = <do_q, h_q> needs every source before
//                                                      any dv_i can be written, and dv_i needs v_i again
//                     + Q D s_o (dy) + [merge] Q D s_a
//                     + (4 Q N + N + Q N + Q [+ Q merge]) a W   logits (softmax max and sum,
//                                                      passes A and B), rinv, dlogits, dlse, lse_a
//                     + [normalize_values] N a W      rinv again, in pass A
//             writes  Σ_i D s_i                        each source gradient element once
//                     + [merge] Q D s_a + Q a
//   per row team: the site rows of query and norm_weight (Q R elements each) and of
//   g (Q D) read once [and of γ again, Q D, for normalised values with a key-norm weight];
//   per row chunk (backward): Q R a (du) [+ Q D a (dg)] [+ Q D a (dγ values)] partial
//   sums, read back once by site_grads_kernel, which also reads query and norm_weight
//   once and writes each parameter gradient once.
// With more sites than QT the forward reads the sources once per site tile (the
// tiles run side by side as blockIdx.y, so on a GPU largely from L2), and the
// backward runs one launch per tile, each after the first also reading the
// source gradients it adds to.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "device_primitives.cuh"

namespace attnres::cuda {

// One [M, D] operand with unit column stride (the Block step's rows). 32 bytes, 16-byte
// aligned: a kernel reads a parameter of this layout with two vector loads (ptxas gives
// the Block step's backward 8-20 registers fewer than with a packed 24-byte one).
struct alignas(16) RowRef {
  const void* data;
  int64_t row_stride;  // in elements
  int32_t dtype;       // DType
  int32_t reserved0 = 0;
  int64_t reserved1 = 0;
};

// The most sources one read takes: the source table travels in the kernel
// parameters (the backward's, with the gradients' pointers, stays under 4 KiB).
constexpr int kMaxSources = 128;

// One source of a read: an [M, D] matrix with unit column stride. 16 bytes, read
// with one vector load from the parameters (separate arrays of pointers, strides
// and dtypes cost the backward's fp64 tiles the registers they have no room for).
struct alignas(16) SourceRef {
  const void* data;
  int32_t row_stride;  // in elements (a wider stride is made contiguous by the host)
  int32_t dtype;       // DType
};

struct SourceTable {
  SourceRef ref[kMaxSources];
};

// A per-site parameter: one row of width W shared by every site (site_stride 0)
// or Q rows site_stride elements apart, unit column stride, in its own dtype.
// Null data: the parameter is absent.
struct SiteVector {
  const void* data;
  int64_t site_stride;
  int32_t dtype;
};

template <typename acc_t>
struct FwdParams {
  SourceTable sources;  // [N]
  int32_t num_sources;
  int32_t num_sites;           // Q
  int64_t rows, dim;           // M, D
  int32_t key_start;           // D - R: the keys are the columns [key_start, D)
  SiteVector query;            // [Q?, R]
  SiteVector norm_weight;      // [Q?, R] or absent
  SiteVector out_norm_weight;  // [Q?, D] or absent: the fused output norm's weight g
  const void* prefix_out;
  int32_t prefix_dtype;     // [Q, M, D] or null
  const acc_t* prefix_lse;  // [Q, M]
  void* out;
  int32_t out_dtype;      // [Q, M, D]
  acc_t* lse;             // [Q, M]
  acc_t* logits;          // [Q, N, M]
  acc_t* rinv;            // [N, M]
  acc_t scale;            // of the logits, folded into u
  acc_t eps;              // the key norm's
  acc_t out_eps;          // the output norm's
  bool normalize_values;  // the values are the normalised sources r_i v_i (⊙ norm_weight when given)
  bool vec;               // every row 16-byte aligned and D % G == 0: vector loads and stores
};

template <typename acc_t>
struct BwdParams {
  SourceTable sources;       // [N]
  void* grads[kMaxSources];  // the gradient of each source: [M, D] contiguous in the source's dtype
  int32_t num_sources;
  int32_t num_sites;   // Q
  int32_t first_site;  // q0: this launch handles sites [q0, q0 + QT)
  int64_t rows, dim;
  int32_t key_start;
  acc_t inv_key_dim;  // 1 / R
  const void* dy;
  int32_t dy_dtype;      // [Q, M, D]
  const acc_t* dlse;     // [Q, M] or null
  const acc_t* dlogits;  // [Q, N, M] or null
  SiteVector query, norm_weight, out_norm_weight;
  const void* prefix_out;
  int32_t prefix_dtype;     // [Q, M, D] or null
  const acc_t* prefix_lse;  // [Q, M]
  void* d_prefix_out;       // [Q, M, D] in the prefix dtype
  acc_t* d_prefix_lse;      // [Q, M]
  const acc_t* logits;      // [Q, N, M]
  const acc_t* rinv;        // [N, M]
  acc_t* du_part;           // [chunks, Q, R]
  acc_t* dg_part;           // [chunks, Q, D] or null
  acc_t* dvw_part;          // [chunks, Q, D] or null: dγ of normalised values with a key-norm weight
  int64_t rows_per_chunk, num_chunks;
  acc_t scale;
  acc_t out_eps;  // the output norm's (the key norm's is in the saved rinv)
  bool normalize_values;
  bool vec;
  bool part_vec;        // vec, and the key columns start at a group boundary: vector stores of du
  bool accumulate;      // add to the source gradients (site tiles after the first)
  int32_t cache_words;  // per team, the source cache's 32-bit words (DepthPlan::cache_words)
};

// The kernel parameters stay within the 4 KiB every CUDA version takes.
static_assert(sizeof(FwdParams<double>) <= 4096 && sizeof(BwdParams<double>) <= 4096, "kernel parameters over 4 KiB");

// The gradients of the site parameters from the backward's per-chunk partial sums.
template <typename acc_t>
struct SiteGradParams {
  const acc_t* du_part;   // [chunks, Q, R]
  const acc_t* dg_part;   // [chunks, Q, D] or null
  const acc_t* dvw_part;  // [chunks, Q, D] or null
  int64_t num_chunks;
  int32_t num_sites;
  int64_t key_dim, dim;  // R, D
  SiteVector query, norm_weight;
  acc_t scale;
  // Written in the dtype and shape of their parameter (site_stride 0: the sites share
  // the parameter, its gradient is the sum over the sites); data null when absent.
  SiteVector d_query, d_norm_weight, d_out_norm_weight;
};

// ------------------------------------------------------------------ tiles and configurations

enum class Pass { kForward, kBackward };

// Register budget of the row tiles (a thread holds the QT sites x K x G elements
// of each row array): the forward keeps the accumulators (u, g in shared memory),
// the backward do, h and du (u, g, dg in shared memory) plus about ten scalars per
// site. Measured with ptxas -v on sm_80/sm_90 (python -m attnres_kernels.check):
// beyond these limits the kernels spill.
constexpr int kMaxTileElems[2] = {32, 8};             // QT * K * G per thread (forward, backward)
constexpr int kMaxTileWords[2] = {32, 16};            // the same in 32-bit words (fp64 takes two)
constexpr int kMaxGroupElems[2] = {16, 8};            // K * G: one site's row elements per thread
constexpr int kMaxSiteTile[2][2] = {{8, 2}, {2, 1}};  // QT [pass][acc_double]: the per-site scalars
constexpr int kMaxThreads = 512;                      // per team: leaves 128 registers per thread
constexpr int kMaxSharedTileBytes = 16384;            // per staged parameter array when QT > 1
constexpr int64_t kMaxSharedBytes = 99 * 1024;        // per block: the limit of sm_86/89, the smallest sm_80+

// Widest row the kernels hold: 512 threads x 8 elements (the backward's limit).
constexpr int64_t kMaxDim = 4096;

// Whether the plan below can choose tile (G, K, QT): the kernels are instantiated
// for exactly these. The plan takes K = 2 groups per thread only for D > 512 G,
// so with at least 288 threads, and a site tile of QT > 1 must stage at most
// kMaxSharedTileBytes per array.
constexpr bool tile_fits(Pass pass, bool acc_double, int G, int K, int QT) {
  const int p = pass == Pass::kBackward ? 1 : 0;
  const int acc_words = acc_double ? 2 : 1;
  const int64_t min_row_tile = K == 1 ? int64_t(kWarpSize) * G : int64_t(kMaxThreads / 2 + kWarpSize) * K * G;
  return (G == 4 || G == 8) && (K == 1 || int64_t(kMaxThreads) * G * (K / 2) < kMaxDim) && K * G <= kMaxGroupElems[p] &&
         QT * K * G <= kMaxTileElems[p] && QT * K * G * acc_words <= kMaxTileWords[p] &&
         QT <= kMaxSiteTile[p][acc_double] && (QT == 1 || QT * min_row_tile * 4 * acc_words <= kMaxSharedTileBytes);
}

template <int... Vs, typename F>
void for_each_value(F&& f) {
  (f(std::integral_constant<int, Vs>{}), ...);
}

// Calls f(G, K, QT) (integral constants) for every tile shape; instantiate those that tile_fits.
template <typename F>
void for_each_tile(F&& f) {
  for_each_value<4, 8>([&](auto g) {
    for_each_value<1, 2>([&](auto k) { for_each_value<1, 2, 4, 8>([&](auto qt) { f(g, k, qt); }); });
  });
}

struct DepthPlan {
  int group = 0;              // G
  int groups_per_thread = 0;  // K
  int site_tile = 0;          // QT
  int threads = 0;            // T = blockDim.x
  int teams = 0;              // blockDim.y: rows (forward) or row chunks (backward) per block
  int site_tiles = 0;         // ceil(Q / QT)
  int64_t grid_x = 0;
  int64_t rows_per_chunk = 0, num_chunks = 0;  // backward
  size_t shared_bytes = 0;
  int64_t cache_words = 0;  // backward: 32-bit words per team of the source cache; 0 without one
};

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The row arrays a team keeps in shared memory: u, and per option its row (forward)
// or its row and its gradient's (backward): the output norm's g (dg), the value
// weight γ of normalised values with a key-norm weight (dγ_values); the backward
// with both also keeps a row's h' = Σ α r v.
inline int staged_arrays(Pass pass, bool has_out_norm, bool weighted_values) {
  if (pass == Pass::kForward) return 1 + int(has_out_norm) + int(weighted_values);
  return 1 + 2 * (int(has_out_norm) + int(weighted_values)) + int(has_out_norm && weighted_values);
}

// The launch configuration of a depth read of M rows of width D over Q sites.
// `min_itemsize`: the narrowest element size among the sources, prefix and
// output (it sets G: 16 bytes of it). `weighted_values`: normalised values with a
// key-norm weight. `num_sms` bounds the forward grid (rows are grid-strided); the
// backward's row chunks depend on M only.
inline DepthPlan plan_depth_attn(Pass pass, int64_t M, int64_t D, int64_t Q, int min_itemsize, bool acc_double,
                                 bool has_out_norm, bool weighted_values, int num_sms) {
  if (D < 1 || D > kMaxDim) {
    throw std::invalid_argument("the CUDA depth-read kernels support 1 <= D <= " + std::to_string(kMaxDim) +
                                ", got D = " + std::to_string(D));
  }
  DepthPlan plan;
  plan.group = std::max(4, 16 / min_itemsize);  // 16 bytes of the narrowest dtype; fp64 takes 32
  const int64_t groups = ceil_div(D, plan.group);
  plan.groups_per_thread = groups <= kMaxThreads ? 1 : 2;
  plan.threads = static_cast<int>(ceil_div(ceil_div(groups, plan.groups_per_thread), kWarpSize) * kWarpSize);
  const int acc_bytes = acc_double ? 8 : 4;
  const int64_t row_tile = int64_t(plan.threads) * plan.groups_per_thread * plan.group;
  const int p = pass == Pass::kBackward ? 1 : 0;
  plan.site_tile = 1;
  for (int qt = 2; qt <= kMaxSiteTile[p][acc_double] && qt < 2 * Q; qt *= 2) {
    if (!tile_fits(pass, acc_double, plan.group, plan.groups_per_thread, qt)) break;
    if (qt * row_tile * acc_bytes > kMaxSharedTileBytes) break;
    plan.site_tile = qt;
  }
  if (!tile_fits(pass, acc_double, plan.group, plan.groups_per_thread, plan.site_tile)) {
    throw std::logic_error("depth read: the planned tile has no kernel (D = " + std::to_string(D) + ")");
  }
  plan.teams = plan.threads == kWarpSize ? 4 : 1;
  plan.site_tiles = static_cast<int>(ceil_div(Q, plan.site_tile));
  const int64_t tile_bytes = int64_t(plan.site_tile) * row_tile * acc_bytes;
  const int warps = plan.threads / kWarpSize;
  const int reduce_values = pass == Pass::kForward ? plan.site_tile + 1 : 5 * plan.site_tile;
  const int64_t scratch = warps > 1 ? int64_t(2) * warps * reduce_values * acc_bytes : 0;
  const int64_t shared = plan.teams * tile_bytes * staged_arrays(pass, has_out_norm, weighted_values) + scratch;
  if (shared > kMaxSharedBytes) {
    throw std::invalid_argument("D = " + std::to_string(D) + " with " + (acc_double ? "fp64" : "fp32") + " math" +
                                (has_out_norm ? ", the fused output norm" : "") +
                                (weighted_values ? " and normalised values with a key-norm weight" : "") + " needs " +
                                std::to_string(shared) + " bytes of shared memory per block, over the " +
                                std::to_string(kMaxSharedBytes) + " every sm_80+ GPU has");
  }
  plan.shared_bytes = static_cast<size_t>(shared);
  if (pass == Pass::kForward) {
    const int64_t resident = std::max<int64_t>(1, 2048 / (int64_t(plan.threads) * plan.teams));
    plan.grid_x = std::max<int64_t>(1, std::min(ceil_div(M, plan.teams), int64_t(num_sms) * resident));
  } else {
    plan.rows_per_chunk = std::max<int64_t>(16, ceil_div(M, 1024));
    plan.num_chunks = ceil_div(M, plan.rows_per_chunk);
    plan.grid_x = ceil_div(plan.num_chunks, plan.teams);
  }
  return plan;
}

// Shared memory of one SM of the smallest sm_80+ GPU that has the most (A100: 164 KiB).
constexpr int64_t kSharedBytesPerSM = 164 * 1024;

// The backward's source cache: the raw bits of a row's sources kept in shared memory
// (the team's threads' groups, thread-minor) so that both passes decode them from
// there and the sources cross HBM once, the floor. `itemsizes`: each source's element
// size. fp32 math only (the fp64 kernels have no registers to spare); taken when the
// cache and du (then in shared memory) fit beside the staged arrays within
// kMaxSharedBytes and do not lower the blocks per SM the registers allow (128 per
// thread: 65536 / (128 T teams)).
inline void plan_source_cache(DepthPlan& plan, bool acc_double, const int* itemsizes, int num_sources) {
  if (acc_double) return;
  int64_t words = 0;
  for (int i = 0; i < num_sources; ++i) {
    words += int64_t(plan.groups_per_thread) * (plan.group * itemsizes[i] / 4) * plan.threads;
  }
  const int64_t du_bytes =
      int64_t(plan.teams) * plan.site_tile * plan.groups_per_thread * plan.group * plan.threads * 4;
  const int64_t shared = int64_t(plan.shared_bytes) + du_bytes + int64_t(plan.teams) * words * 4;
  const int64_t blocks_by_registers = std::max<int64_t>(1, 65536 / (128 * int64_t(plan.threads) * plan.teams));
  if (shared > kMaxSharedBytes || shared * blocks_by_registers > kSharedBytesPerSM) return;
  plan.cache_words = words;
  plan.shared_bytes = static_cast<size_t>(shared);
}

// ------------------------------------------------------------------ row tiles

// Offset of the k-th group of this thread in a row.
template <int G>
__device__ __forceinline__ int64_t group_start(int k) {
  return (int64_t(k) * blockDim.x + threadIdx.x) * G;
}

// Stores this thread's elements of columns [first, D) of a row of the accumulation
// type at row[d - first] (the partial sums: du over the key columns, dg over all).
// `vec`: 16-byte stores, for rows 16-byte aligned with `first` a multiple of G
// (a group lies wholly inside or outside the columns).
template <int G, int K, typename acc_t>
__device__ __forceinline__ void store_acc_row(acc_t* row, int64_t first, int64_t D, bool vec, const acc_t (&x)[K][G]) {
  constexpr int kChunk = 16 / int(sizeof(acc_t));  // G (4 or 8) is a multiple
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t d0 = group_start<G>(k);
    if (vec) {
      if (d0 < D && d0 >= first) {
#pragma unroll
        for (int c = 0; c < G / kChunk; ++c) {
          uint4 bits;
          std::memcpy(&bits, &x[k][c * kChunk], 16);
          store_global(reinterpret_cast<uint4*>(row + (d0 - first) + c * kChunk), bits);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < G; ++e)
        if (d0 + e >= first && d0 + e < D) store_global(row + (d0 + e - first), x[k][e]);
    }
  }
}

// One group of G elements of any dtype as raw bits, with room for the widest
// element the kernel can see (fp64 only in the double kernels). Loads and stores
// move bytes; only the conversion branches on the dtype, so the address
// arithmetic is shared by every dtype.
template <int G, typename acc_t>
struct RawGroup {
  static constexpr int kWords = G * int(sizeof(acc_t)) / 4;
  uint32_t w[kWords];
};

// Loads the `valid` (<= G) leading elements of the group at `p` (the rest read as
// zero); `vec`: a full 16-byte aligned group, loaded as 16-byte vectors.
template <int G, typename acc_t>
__device__ __forceinline__ void load_group(const char* p, int size, bool vec, int64_t valid, RawGroup<G, acc_t>& raw) {
  constexpr int kWords = RawGroup<G, acc_t>::kWords;
#pragma unroll
  for (int j = 0; j < kWords; ++j) raw.w[j] = 0;
  if (valid <= 0) return;
  if (vec) {
    const int chunks = G * size / 16;
#pragma unroll
    for (int c = 0; c < kWords / 4; ++c) {
      if (c < chunks) {
        const uint4 b = load_global(reinterpret_cast<const uint4*>(p) + c);
        raw.w[4 * c] = b.x;
        raw.w[4 * c + 1] = b.y;
        raw.w[4 * c + 2] = b.z;
        raw.w[4 * c + 3] = b.w;
      }
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < G; ++e) {
    if (e >= valid) break;
    if (size == 2) {
      raw.w[e / 2] |= uint32_t(load_global(reinterpret_cast<const unsigned short*>(p) + e)) << (16 * (e % 2));
    } else if (size == 4) {
      raw.w[e] = load_global(reinterpret_cast<const unsigned int*>(p) + e);
    } else if constexpr (sizeof(acc_t) == 8) {
      const uint2 b = load_global(reinterpret_cast<const uint2*>(p) + e);
      raw.w[2 * e] = b.x;
      raw.w[2 * e + 1] = b.y;
    }
  }
}

template <int G, typename acc_t>
__device__ __forceinline__ void store_group(char* p, int size, bool vec, int64_t valid, const RawGroup<G, acc_t>& raw) {
  constexpr int kWords = RawGroup<G, acc_t>::kWords;
  if (valid <= 0) return;
  if (vec) {
    const int chunks = G * size / 16;
#pragma unroll
    for (int c = 0; c < kWords / 4; ++c) {
      if (c < chunks) {
        const uint4 b{raw.w[4 * c], raw.w[4 * c + 1], raw.w[4 * c + 2], raw.w[4 * c + 3]};
        store_global(reinterpret_cast<uint4*>(p) + c, b);
      }
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < G; ++e) {
    if (e >= valid) break;
    if (size == 2) {
      store_global(reinterpret_cast<unsigned short*>(p) + e,
                   static_cast<unsigned short>(raw.w[e / 2] >> (16 * (e % 2))));
    } else if (size == 4) {
      store_global(reinterpret_cast<unsigned int*>(p) + e, raw.w[e]);
    } else if constexpr (sizeof(acc_t) == 8) {
      store_global(reinterpret_cast<uint2*>(p) + e, uint2{raw.w[2 * e], raw.w[2 * e + 1]});
    }
  }
}

template <typename T>
__device__ __forceinline__ T bits_as(uint32_t lo, uint32_t hi = 0) {
  T value;
  const uint64_t bits = uint64_t(hi) << 32 | lo;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

template <int G, typename acc_t>
__device__ __forceinline__ void decode(const RawGroup<G, acc_t>& raw, int32_t dtype, acc_t (&x)[G]) {
  switch (dtype) {
    case kBFloat16:
#pragma unroll
      for (int e = 0; e < G; ++e) x[e] = to_float(BFloat16{uint16_t(raw.w[e / 2] >> (16 * (e % 2)))});
      break;
    case kFloat16:
#pragma unroll
      for (int e = 0; e < G; ++e) x[e] = to_float(Half{uint16_t(raw.w[e / 2] >> (16 * (e % 2)))});
      break;
    case kFloat32:
#pragma unroll
      for (int e = 0; e < G; ++e) x[e] = bits_as<float>(raw.w[e]);
      break;
    default:
      if constexpr (sizeof(acc_t) == 8) {
#pragma unroll
        for (int e = 0; e < G; ++e) x[e] = bits_as<double>(raw.w[2 * e], raw.w[2 * e + 1]);
      }
      break;
  }
}

template <int G, typename acc_t>
__device__ __forceinline__ void encode(const acc_t (&x)[G], int32_t dtype, RawGroup<G, acc_t>& raw) {
  switch (dtype) {
    case kBFloat16:
#pragma unroll
      for (int e = 0; e < G; e += 2) {
        raw.w[e / 2] = uint32_t(from_acc<BFloat16>(x[e]).bits) | uint32_t(from_acc<BFloat16>(x[e + 1]).bits) << 16;
      }
      break;
    case kFloat16:
#pragma unroll
      for (int e = 0; e < G; e += 2) {
        raw.w[e / 2] = uint32_t(from_acc<Half>(x[e]).bits) | uint32_t(from_acc<Half>(x[e + 1]).bits) << 16;
      }
      break;
    case kFloat32:
#pragma unroll
      for (int e = 0; e < G; ++e) {
        const float f = static_cast<float>(x[e]);
        std::memcpy(&raw.w[e], &f, 4);
      }
      break;
    default:
      if constexpr (sizeof(acc_t) == 8) {
#pragma unroll
        for (int e = 0; e < G; ++e) std::memcpy(&raw.w[2 * e], &x[e], 8);
      }
      break;
  }
}

// Row p of a matrix of `dtype` elements whose rows are `row_stride` apart.
__device__ __forceinline__ const void* row_ptr(const void* base, int32_t dtype, int64_t row_stride, int64_t p) {
  return static_cast<const char*>(base) + p * row_stride * dtype_size(dtype);
}

// This thread's elements of a row of `dtype` (zero past D).
template <int G, int K, typename acc_t>
__device__ __forceinline__ void load_row(const void* row, int32_t dtype, int64_t D, bool vec, acc_t (&x)[K][G]) {
  const int size = dtype_size(dtype);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t d0 = group_start<G>(k);
    RawGroup<G, acc_t> raw;
    load_group(static_cast<const char*>(row) + d0 * size, size, vec, D - d0, raw);
    decode(raw, dtype, x[k]);
  }
}

// Stores this thread's elements of a row of `dtype`; with `accumulate`, adds
// them to the row's values first (group by group: one group of old values live).
template <int G, int K, typename acc_t>
__device__ __forceinline__ void store_row(void* row, int32_t dtype, int64_t D, bool vec, const acc_t (&x)[K][G],
                                          bool accumulate = false) {
  const int size = dtype_size(dtype);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t d0 = group_start<G>(k);
    char* p = static_cast<char*>(row) + d0 * size;
    RawGroup<G, acc_t> raw;
    if (accumulate) {
      acc_t sum[G];
      load_group(p, size, vec, D - d0, raw);
      decode(raw, dtype, sum);
#pragma unroll
      for (int e = 0; e < G; ++e) sum[e] += x[k][e];
      encode(sum, dtype, raw);
    } else {
      encode(x[k], dtype, raw);
    }
    store_group(p, size, vec, D - d0, raw);
  }
}

// The backward's source cache: cache_row copies the raw bits of this thread's groups of
// a row into `cache` ([K][words][T] words, words = G * size / 4: thread-minor,
// conflict-free, each thread touching only its own slots), load_cached_row decodes
// them like load_row. Both return the words the row takes.
template <int G, int K, typename acc_t>
__device__ __forceinline__ int cache_row(const void* row, int32_t dtype, int64_t D, bool vec, uint32_t* cache) {
  const int size = dtype_size(dtype), words = G * size / 4;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t d0 = group_start<G>(k);
    RawGroup<G, acc_t> raw;
    load_group(static_cast<const char*>(row) + d0 * size, size, vec, D - d0, raw);
#pragma unroll
    for (int w = 0; w < RawGroup<G, acc_t>::kWords; ++w) {
      if (w < words) cache[(k * words + w) * blockDim.x + threadIdx.x] = raw.w[w];
    }
  }
  return K * words * blockDim.x;
}

template <int G, int K, typename acc_t>
__device__ __forceinline__ int load_cached_row(int32_t dtype, const uint32_t* cache, acc_t (&x)[K][G]) {
  const int words = G * dtype_size(dtype) / 4;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    RawGroup<G, acc_t> raw;
#pragma unroll
    for (int w = 0; w < RawGroup<G, acc_t>::kWords; ++w) {
      raw.w[w] = w < words ? cache[(k * words + w) * blockDim.x + threadIdx.x] : 0u;
    }
    decode(raw, dtype, x[k]);
  }
  return K * words * blockDim.x;
}

// Element i of an array of `dtype` (any of the four: a site parameter may differ
// from the sources), converted to acc_t; and its store, rounded to nearest even.
template <typename acc_t>
__device__ __forceinline__ acc_t load_scalar(const void* base, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kBFloat16:
      return static_cast<acc_t>(to_float(BFloat16{load_global(static_cast<const uint16_t*>(base) + i)}));
    case kFloat16:
      return static_cast<acc_t>(to_float(Half{load_global(static_cast<const uint16_t*>(base) + i)}));
    case kFloat32:
      return static_cast<acc_t>(load_global(static_cast<const float*>(base) + i));
    default:
      return static_cast<acc_t>(load_global(static_cast<const double*>(base) + i));
  }
}

template <typename acc_t>
__device__ __forceinline__ void store_scalar(const void* base, int32_t dtype, int64_t i, acc_t x) {
  void* p = const_cast<void*>(base);
  switch (dtype) {
    case kBFloat16:
      store_global(static_cast<uint16_t*>(p) + i, from_acc<BFloat16>(x).bits);
      break;
    case kFloat16:
      store_global(static_cast<uint16_t*>(p) + i, from_acc<Half>(x).bits);
      break;
    case kFloat32:
      store_global(static_cast<float*>(p) + i, static_cast<float>(x));
      break;
    default:
      store_global(static_cast<double*>(p) + i, static_cast<double>(x));
      break;
  }
}

// Element j of site q's row of a site parameter.
template <typename acc_t>
__device__ __forceinline__ acc_t site_element(SiteVector x, int64_t q, int64_t j) {
  return load_scalar<acc_t>(x.data, x.dtype, q * x.site_stride + j);
}

// The per-site parameter rows (u, g, ...) a thread uses, staged once per block in
// shared memory, thread-minor ([QT][K][G][T]: conflict-free, and each thread
// touches only its own slots, so staging needs no barrier).
template <typename acc_t, int G, int K, int QT>
struct SiteTile {
  acc_t* base;
  __device__ __forceinline__ acc_t& at(int q, int k, int e) const {
    return base[((q * K + k) * G + e) * blockDim.x + threadIdx.x];
  }
  // Column d of site q0 + q holds scale · x[d - first] (⊙ y[d - first] when y is
  // given), converted to acc_t and rounded after each product as the CPU kernels
  // round u; columns before `first` (the non-key columns of low-rank keys), past
  // D and sites past nq hold zero.
  __device__ __forceinline__ void stage(SiteVector x, SiteVector y, acc_t scale, int q0, int nq, int64_t first,
                                        int64_t D) const {
#pragma unroll
    for (int q = 0; q < QT; ++q)
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          const int64_t d = group_start<G>(k) + e;
          acc_t value = acc_t(0);
          if (q < nq && d >= first && d < D) {
            value = site_element<acc_t>(x, q0 + q, d - first);
            if (y.data != nullptr) value *= site_element<acc_t>(y, q0 + q, d - first);
            value *= scale;
          }
          at(q, k, e) = value;
        }
  }
  __device__ __forceinline__ void stage(SiteVector x, int q0, int nq, int64_t D) const {
    stage(x, SiteVector{nullptr, 0, 0}, acc_t(1), q0, nq, 0, D);
  }
  __device__ __forceinline__ void zero() const {
#pragma unroll
    for (int q = 0; q < QT; ++q)
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) at(q, k, e) = acc_t(0);
  }
};

// Sums of NV values over a team; every thread of the team gets the same bits
// (xor butterflies give each lane the same operands; the cross-warp step sums
// in warp order everywhere). Teams of several warps go through a double-buffered
// shared scratch: one barrier per reduction.
template <typename acc_t>
struct TeamReducer {
  acc_t* scratch;
  int max_values;
  int parity = 0;

  template <int NV>
  __device__ __forceinline__ void sum(acc_t (&v)[NV]) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int m = kWarpSize / 2; m > 0; m /= 2) v[j] += __shfl_xor_sync(0xffffffffu, v[j], m);
    const int warps = blockDim.x / kWarpSize;
    if (warps == 1) return;
    acc_t* s = scratch + parity * warps * max_values;
    parity ^= 1;
    const int warp = threadIdx.x / kWarpSize;
    if (threadIdx.x % kWarpSize == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) s[warp * max_values + j] = v[j];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      acc_t total = acc_t(0);
      for (int w = 0; w < warps; ++w) total += s[w * max_values + j];
      v[j] = total;
    }
  }
};

template <int G, int K, typename acc_t>
__device__ __forceinline__ void fill(acc_t (&x)[K][G], acc_t value) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < G; ++e) x[k][e] = value;
}

// Whether this thread's element e of group k is a key column (column >= key_start).
// In 32-bit arithmetic (D <= kMaxDim): recomputed where used, it holds no register
// across the row loop (the fp64 backward's tiles have none to spare).
template <int G>
__device__ __forceinline__ bool is_key_column(int k, int e, int key_start) {
  return int((k * blockDim.x + threadIdx.x) * G + e) >= key_start;
}

// This thread's part of dp_q = <x_q, v> for each site q; with `weighted`, of
// <x_q ⊙ w_q, v> (the values of normalised values with a key-norm weight w).
template <int G, int K, int QT, typename acc_t>
__device__ __forceinline__ void row_dots(const acc_t (&x)[QT][K][G], const acc_t (&v)[K][G],
                                         const SiteTile<acc_t, G, K, QT>& w, bool weighted, acc_t (&dp)[QT]) {
#pragma unroll
  for (int q = 0; q < QT; ++q) {
    dp[q] = acc_t(0);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e) dp[q] += (weighted ? x[q][k][e] * w.at(q, k, e) : x[q][k][e]) * v[k][e];
  }
}

// ------------------------------------------------------------------ forward

template <typename acc_t, int G, int K, int QT>
__global__ void __launch_bounds__(kMaxThreads, 1) depth_attn_fwd_kernel(const __grid_constant__ FwdParams<acc_t> a) {
  const int64_t M = a.rows, D = a.dim;
  const int N = a.num_sources;
  const int q0 = blockIdx.y * QT;
  const int nq = imin(QT, a.num_sites - q0);
  const bool has_norm = a.out_norm_weight.data != nullptr;
  const bool weighted_values = a.normalize_values && a.norm_weight.data != nullptr;
  const acc_t key_dim = static_cast<acc_t>(D - a.key_start);  // R
  const int64_t tile = int64_t(QT) * K * G * blockDim.x;
  acc_t* smem = dynamic_shared<acc_t>();
  int arrays = 0;
  auto next_array = [&] { return smem + (arrays++ * blockDim.y + threadIdx.y) * tile; };
  const SiteTile<acc_t, G, K, QT> u{next_array()};
  const SiteTile<acc_t, G, K, QT> g{has_norm ? next_array() : nullptr};
  const SiteTile<acc_t, G, K, QT> vw{weighted_values ? next_array() : nullptr};  // the values' weight γ
  u.stage(a.query, a.norm_weight, a.scale, q0, nq, a.key_start, D);
  if (has_norm) g.stage(a.out_norm_weight, q0, nq, D);
  if (weighted_values) vw.stage(a.norm_weight, q0, nq, D);
  TeamReducer<acc_t> reducer{smem + arrays * blockDim.y * tile, QT + 1};

  for (int64_t first = int64_t(blockIdx.x) * blockDim.y; first < M; first += int64_t(gridDim.x) * blockDim.y) {
    const int64_t p = first + threadIdx.y;
    if (p >= M) continue;  // only one-warp teams come several to a block; they use no block barrier
    // Online softmax per site: running max `mx`, sum `den`, and acc = Σ e^{s - mx} x.
    // A merge prefix enters as one source with logit lse_a and value h_a.
    acc_t acc[QT][K][G], mx[QT], den[QT];
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      if (a.prefix_out != nullptr && q < nq) {
        const int64_t prow = int64_t(q0 + q) * M + p;
        load_row(row_ptr(a.prefix_out, a.prefix_dtype, D, prow), a.prefix_dtype, D, a.vec, acc[q]);
        mx[q] = load_uniform(a.prefix_lse + prow);
        den[q] = acc_t(1);
      } else {
        fill(acc[q], acc_t(0));
        mx[q] = neg_infinity<acc_t>();
        den[q] = acc_t(0);
      }
    }
    for (int i = 0; i < N; ++i) {
      const SourceRef src = a.sources.ref[i];
      acc_t v[K][G];
      load_row(row_ptr(src.data, src.dtype, src.row_stride, p), src.dtype, D, a.vec, v);
      acc_t part[QT + 1];  // Σ_key v², <u_q, v>
#pragma unroll
      for (int j = 0; j <= QT; ++j) part[j] = acc_t(0);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          if (is_key_column<G>(k, e, a.key_start)) part[0] += v[k][e] * v[k][e];
#pragma unroll
          for (int q = 0; q < QT; ++q) part[1 + q] += u.at(q, k, e) * v[k][e];
        }
      reducer.sum(part);
      const acc_t r = acc_t(1) / dev_sqrt(part[0] / key_dim + a.eps);
      if (threadIdx.x == 0) {
        if (blockIdx.y == 0) store_global(a.rinv + int64_t(i) * M + p, r);
        for (int q = 0; q < nq; ++q) store_global(a.logits + (int64_t(q0 + q) * N + i) * M + p, r * part[1 + q]);
      }
      if (a.normalize_values) {
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) v[k][e] *= r;
      }
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        if (q >= nq) continue;
        const acc_t s = r * part[1 + q];
        // The value of site q: v, or v ⊙ γ_q for normalised values with a key-norm weight.
        auto value = [&](int k, int e) { return weighted_values ? v[k][e] * vw.at(q, k, e) : v[k][e]; };
        if (s > mx[q] || dev_isnan(s)) {  // a new maximum (NaN propagates like the reference softmax)
          const acc_t rescale = dev_exp(mx[q] - s);
          mx[q] = s;
          den[q] = den[q] * rescale + acc_t(1);
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) acc[q][k][e] = acc[q][k][e] * rescale + value(k, e);
        } else {
          const acc_t w = dev_exp(s - mx[q]);
          den[q] += w;
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) acc[q][k][e] += w * value(k, e);
        }
      }
    }
    acc_t scale[QT];
#pragma unroll
    for (int q = 0; q < QT; ++q) scale[q] = acc_t(1) / den[q];
    if (has_norm) {  // fused output RMSNorm: y = h * rsqrt(mean(h²) + eps) * g
      acc_t sumsq[QT];
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        sumsq[q] = acc_t(0);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) sumsq[q] += acc[q][k][e] * acc[q][k][e];
      }
      reducer.sum(sumsq);
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        const acc_t mean_sq = sumsq[q] * scale[q] * scale[q] / static_cast<acc_t>(D);
        scale[q] *= acc_t(1) / dev_sqrt(mean_sq + a.out_eps);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) acc[q][k][e] = acc[q][k][e] * g.at(q, k, e) * scale[q];
      }
    } else {
#pragma unroll
      for (int q = 0; q < QT; ++q)
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) acc[q][k][e] *= scale[q];
    }
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      if (q >= nq) continue;
      const int64_t orow = int64_t(q0 + q) * M + p;
      store_row(const_cast<void*>(row_ptr(a.out, a.out_dtype, D, orow)), a.out_dtype, D, a.vec, acc[q]);
      if (threadIdx.x == 0) store_global(a.lse + orow, mx[q] + dev_log(den[q]));
    }
  }
}

// ------------------------------------------------------------------ backward

// kNorm (the fused output norm) is a template parameter: the two variants of
// pass A together would not fit the register budget. So is kCache, the source
// cache (DepthPlan::cache_words): with it du lives in shared memory, its registers
// going to the cache's addressing.
template <typename acc_t, int G, int K, int QT, bool kNorm, bool kCache>
__global__ void __launch_bounds__(kMaxThreads, 1) depth_attn_bwd_kernel(const __grid_constant__ BwdParams<acc_t> a) {
  const int64_t M = a.rows, D = a.dim;
  const int N = a.num_sources, Q = a.num_sites;
  const int q0 = a.first_site;
  const int nq = imin(QT, Q - q0);
  const int64_t chunk = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (chunk >= a.num_chunks) return;  // only one-warp teams come several to a block; they use no block barrier
  const bool has_prefix = a.prefix_out != nullptr;
  constexpr bool has_norm = kNorm;
  const bool weighted_values = a.normalize_values && a.norm_weight.data != nullptr;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const int64_t tile = int64_t(QT) * K * G * blockDim.x;
  acc_t* smem = dynamic_shared<acc_t>();
  int arrays = 0;
  auto next_array = [&] { return smem + (arrays++ * blockDim.y + threadIdx.y) * tile; };
  const SiteTile<acc_t, G, K, QT> u{next_array()};
  const SiteTile<acc_t, G, K, QT> g{has_norm ? next_array() : nullptr};
  const SiteTile<acc_t, G, K, QT> dg{has_norm ? next_array() : nullptr};          // Σ over the chunk's rows
  const SiteTile<acc_t, G, K, QT> vw{weighted_values ? next_array() : nullptr};   // the values' weight γ
  const SiteTile<acc_t, G, K, QT> dvw{weighted_values ? next_array() : nullptr};  // its gradient, Σ over rows
  // h'_q = Σ_i α_qi r_i v_i of the row, between pass A's sums and its dγ_values (output norm only).
  const SiteTile<acc_t, G, K, QT> hs{has_norm && weighted_values ? next_array() : nullptr};
  const SiteTile<acc_t, G, K, QT> du_shared{kCache ? next_array() : nullptr};
  if constexpr (kCache) du_shared.zero();
  u.stage(a.query, a.norm_weight, a.scale, q0, nq, a.key_start, D);
  if constexpr (has_norm) {
    g.stage(a.out_norm_weight, q0, nq, D);
    dg.zero();
  }
  if (weighted_values) {
    vw.stage(a.norm_weight, q0, nq, D);
    dvw.zero();
  }
  TeamReducer<acc_t> reducer{smem + arrays * blockDim.y * tile, 5 * QT};
  const int warps = blockDim.x / kWarpSize;
  uint32_t* const cache =
      reinterpret_cast<uint32_t*>(reducer.scratch + (warps > 1 ? 2 * warps * 5 * QT : 0)) + threadIdx.y * a.cache_words;

  // du = Σ ds r t over the chunk's rows: in registers, or in shared memory beside the cache.
  acc_t du_registers[kCache ? 1 : QT][K][G];
  if constexpr (!kCache) {
#pragma unroll
    for (int q = 0; q < QT; ++q) fill(du_registers[q], acc_t(0));
  }
  auto du = [&](int q, int k, int e) -> acc_t& {
    if constexpr (kCache) {
      return du_shared.at(q, k, e);
    } else {
      return du_registers[q][k][e];
    }
  };
  const int64_t row_end = imin(M, (chunk + 1) * a.rows_per_chunk);
  for (int64_t p = chunk * a.rows_per_chunk; p < row_end; ++p) {
    // Softmax of the saved logits: α_qi = e^{s_qi - top_q} · inv_q (and α_a for the prefix).
    acc_t top[QT], inv[QT], alpha_a[QT], dlse[QT];
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      top[q] = neg_infinity<acc_t>();
      inv[q] = alpha_a[q] = dlse[q] = acc_t(0);
      if (q >= nq) continue;
      const acc_t* s_row = a.logits + int64_t(q0 + q) * N * M + p;
      const acc_t lse_a = has_prefix ? load_uniform(a.prefix_lse + int64_t(q0 + q) * M + p) : acc_t(0);
      acc_t t = has_prefix ? lse_a : neg_infinity<acc_t>();
      for (int i = 0; i < N; ++i) {
        const acc_t x = load_uniform(s_row + int64_t(i) * M);
        if (x > t || dev_isnan(x)) t = x;
      }
      acc_t sum = has_prefix ? dev_exp(lse_a - t) : acc_t(0);
      for (int i = 0; i < N; ++i) sum += dev_exp(load_uniform(s_row + int64_t(i) * M) - t);
      top[q] = t;
      inv[q] = acc_t(1) / sum;
      alpha_a[q] = has_prefix ? dev_exp(lse_a - t) * inv[q] : acc_t(0);
      dlse[q] = a.dlse != nullptr ? load_uniform(a.dlse + int64_t(q0 + q) * M + p) : acc_t(0);
    }
    auto alpha = [&](int q, int i) {
      return dev_exp(load_uniform(a.logits + (int64_t(q0 + q) * N + i) * M + p) - top[q]) * inv[q];
    };
    // With the cache, the row's sources are copied into it first (their only read from
    // global memory) and both passes decode them from there; `offset` walks it in source order.
    int offset = 0;
    if constexpr (kCache) {
      for (int i = 0; i < N; ++i) {
        const SourceRef src = a.sources.ref[i];
        offset += cache_row<G, K, acc_t>(row_ptr(src.data, src.dtype, src.row_stride, p), src.dtype, D, a.vec,
                                         cache + offset);
      }
      offset = 0;
    }
    auto load_source = [&](int i, acc_t(&v)[K][G]) {
      const SourceRef src = a.sources.ref[i];
      if constexpr (kCache) {
        offset += load_cached_row(src.dtype, cache + offset, v);
      } else {
        load_row(row_ptr(src.data, src.dtype, src.row_stride, p), src.dtype, D, a.vec, v);
      }
    };

    // do_q starts as dy_q.
    acc_t dO[QT][K][G];
#pragma unroll
    for (int q = 0; q < QT; ++q) {
      if (q < nq) {
        load_row(row_ptr(a.dy, a.dy_dtype, D, int64_t(q0 + q) * M + p), a.dy_dtype, D, a.vec, dO[q]);
      } else {
        fill(dO[q], acc_t(0));
      }
    }

    acc_t delta[QT], dp_a[QT];
    if constexpr (has_norm) {
      // Pass A: h_q = Σ_i α_qi x_qi (+ α_a h_a) in registers, then do through the output norm.
      acc_t h[QT][K][G];
#pragma unroll
      for (int q = 0; q < QT; ++q) fill(h[q], acc_t(0));
      for (int i = 0; i < N; ++i) {
        acc_t v[K][G];
        load_source(i, v);
        const acc_t r = a.normalize_values ? load_uniform(a.rinv + int64_t(i) * M + p) : acc_t(1);
#pragma unroll
        for (int q = 0; q < QT; ++q) {
          if (q >= nq) continue;
          const acc_t w = alpha(q, i) * r;
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) h[q][k][e] += w * v[k][e];
        }
      }
      // With weighted values that is h'_q: kept in shared memory for dγ_values = do ⊙ h',
      // and h_q = γ_q ⊙ h'_q in registers.
      if (weighted_values) {
#pragma unroll
        for (int q = 0; q < QT; ++q)
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) {
              hs.at(q, k, e) = h[q][k][e];
              h[q][k][e] *= vw.at(q, k, e);
            }
      }
      // Row sums per site: ||h||², <g dy, h>, <g dy, h_a>, <h - α_a h_a, h_a>, ||h_a||².
      acc_t sums[5 * QT];
#pragma unroll
      for (int j = 0; j < 5 * QT; ++j) sums[j] = acc_t(0);
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        if (q >= nq) continue;
        if (has_prefix) {
          acc_t ha[K][G];
          const int64_t prow = int64_t(q0 + q) * M + p;
          load_row(row_ptr(a.prefix_out, a.prefix_dtype, D, prow), a.prefix_dtype, D, a.vec, ha);
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) {
              sums[5 * q + 2] += g.at(q, k, e) * dO[q][k][e] * ha[k][e];
              sums[5 * q + 3] += h[q][k][e] * ha[k][e];
              sums[5 * q + 4] += ha[k][e] * ha[k][e];
              h[q][k][e] += alpha_a[q] * ha[k][e];
            }
        }
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) {
            sums[5 * q] += h[q][k][e] * h[q][k][e];
            sums[5 * q + 1] += g.at(q, k, e) * dO[q][k][e] * h[q][k][e];
          }
      }
      reducer.sum(sums);
      // do = g dy rstd + k h with k = -rstd³ <g dy, h> / D;  dg += rstd dy h;  δ = <do, h>;
      // <do, h_a> = rstd <g dy, h_a> + k <h, h_a>.
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        const acc_t rstd = acc_t(1) / dev_sqrt(sums[5 * q] * inv_d + a.out_eps);
        const acc_t k_coef = -rstd * rstd * rstd * sums[5 * q + 1] * inv_d;
        dp_a[q] = rstd * sums[5 * q + 2] + k_coef * (sums[5 * q + 3] + alpha_a[q] * sums[5 * q + 4]);
        delta[q] = acc_t(0);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) {
            dg.at(q, k, e) += rstd * dO[q][k][e] * h[q][k][e];
            dO[q][k][e] = g.at(q, k, e) * dO[q][k][e] * rstd + h[q][k][e] * k_coef;
            delta[q] += dO[q][k][e] * h[q][k][e];
            if (weighted_values) dvw.at(q, k, e) += dO[q][k][e] * hs.at(q, k, e);
          }
      }
      reducer.sum(delta);
    } else {
      // Pass A: δ_q = Σ_i α_qi dp_qi (+ α_a <dy_q, h_a>), the sum the reference's softmax
      // backward forms, from the very dp_qi that pass B recomputes (bitwise the same).
#pragma unroll
      for (int q = 0; q < QT; ++q) delta[q] = dp_a[q] = acc_t(0);
      for (int i = 0; i < N; ++i) {
        acc_t v[K][G], dp[QT];
        load_source(i, v);
        row_dots(dO, v, vw, weighted_values, dp);
        reducer.sum(dp);
        const acc_t r = a.normalize_values ? load_uniform(a.rinv + int64_t(i) * M + p) : acc_t(1);
#pragma unroll
        for (int q = 0; q < QT; ++q) {
          if (q >= nq) continue;
          const acc_t alpha_qi = alpha(q, i);
          delta[q] += alpha_qi * (dp[q] * r);
          if (weighted_values) {  // dγ_values += α r v ⊙ do
            const acc_t w = alpha_qi * r;
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
              for (int e = 0; e < G; ++e) dvw.at(q, k, e) += w * v[k][e] * dO[q][k][e];
          }
        }
      }
      if (has_prefix) {
#pragma unroll
        for (int q = 0; q < QT; ++q) {
          if (q >= nq) continue;
          acc_t ha[K][G];
          load_row(row_ptr(a.prefix_out, a.prefix_dtype, D, int64_t(q0 + q) * M + p), a.prefix_dtype, D, a.vec, ha);
#pragma unroll
          for (int k = 0; k < K; ++k)
#pragma unroll
            for (int e = 0; e < G; ++e) dp_a[q] += dO[q][k][e] * ha[k][e];
        }
        reducer.sum(dp_a);
#pragma unroll
        for (int q = 0; q < QT; ++q) delta[q] += alpha_a[q] * dp_a[q];
      }
    }
    if (has_prefix) {  // d h_a = α_a do;  d lse_a = α_a (<do, h_a> - δ + dlse)
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        if (q >= nq) continue;
        const int64_t prow = int64_t(q0 + q) * M + p;
        acc_t dha[K][G];
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) dha[k][e] = dO[q][k][e] * alpha_a[q];
        store_row(const_cast<void*>(row_ptr(a.d_prefix_out, a.prefix_dtype, D, prow)), a.prefix_dtype, D, a.vec, dha);
        if (threadIdx.x == 0) store_global(a.d_prefix_lse + prow, alpha_a[q] * (dp_a[q] - delta[q] + dlse[q]));
      }
    }

    // Weighted values: from here on do_q ⊙ γ_q stands for do_q, so that pass B is the unweighted
    // one (dp_qi = r_i <do_q ⊙ γ_q, v_i>, the bits pass A summed; dv_i's do term α r do ⊙ γ).
    if (weighted_values) {
#pragma unroll
      for (int q = 0; q < QT; ++q)
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) dO[q][k][e] *= vw.at(q, k, e);
    }

    // Pass B: per source, dp_qi = <do_q, x_qi>, then dv_i and du.
    offset = 0;
    for (int i = 0; i < N; ++i) {
      acc_t v[K][G];
      load_source(i, v);
      acc_t dp[QT];
      row_dots(dO, v, vw, false, dp);
      reducer.sum(dp);
      // From here on v is the key t_i (zero outside the key columns): the key norm's term of
      // dv and du = Σ ds r t (its other columns are not stored) see the key only.
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e)
          if (!is_key_column<G>(k, e, a.key_start)) v[k][e] = acc_t(0);
      const acc_t r = load_uniform(a.rinv + int64_t(i) * M + p);
      // w: the weight of do in dv (α, or α r for normalised values, whose norm also adds
      // α dp to the coefficient of v).
      acc_t w[QT], c1[QT], c2 = acc_t(0);
#pragma unroll
      for (int q = 0; q < QT; ++q) {
        w[q] = c1[q] = acc_t(0);
        if (q >= nq) continue;
        const int64_t qi = (int64_t(q0 + q) * N + i) * M + p;
        const acc_t s = load_uniform(a.logits + qi);
        const acc_t alpha_qi = dev_exp(s - top[q]) * inv[q];
        if (a.normalize_values) dp[q] *= r;
        acc_t ds = alpha_qi * (dp[q] - delta[q] + dlse[q]);
        if (a.dlogits != nullptr) ds += load_uniform(a.dlogits + qi);
        c1[q] = ds * r;
        c2 += ds * s;
        if (a.normalize_values) {
          c2 += alpha_qi * dp[q];
          w[q] = alpha_qi * r;
        } else {
          w[q] = alpha_qi;
        }
      }
      c2 *= r * r * a.inv_key_dim;
#pragma unroll
      for (int q = 0; q < QT; ++q)
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
          for (int e = 0; e < G; ++e) du(q, k, e) += c1[q] * v[k][e];
      // v becomes dv_i in place.
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          acc_t dv = v[k][e] * -c2;
#pragma unroll
          for (int q = 0; q < QT; ++q) {
            dv += w[q] * dO[q][k][e];
            dv += c1[q] * u.at(q, k, e);
          }
          v[k][e] = dv;
        }
      const int32_t dtype = a.sources.ref[i].dtype;
      store_row(static_cast<char*>(a.grads[i]) + p * D * dtype_size(dtype), dtype, D, a.vec, v, a.accumulate);
    }
  }
  // This chunk's partial sums of du (over the key columns), dg and dγ_values over its rows.
#pragma unroll
  for (int q = 0; q < QT; ++q) {
    if (q >= nq) continue;
    const int64_t prow = chunk * Q + q0 + q;
    acc_t row[K][G];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e) row[k][e] = du(q, k, e);
    store_acc_row(a.du_part + prow * (D - a.key_start), a.key_start, D, a.part_vec, row);
    if constexpr (has_norm) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) row[k][e] = dg.at(q, k, e);
      store_acc_row(a.dg_part + prow * D, 0, D, a.vec, row);
    }
    if (weighted_values) {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) row[k][e] = dvw.at(q, k, e);
      store_acc_row(a.dvw_part + prow * D, 0, D, a.vec, row);
    }
  }
}

// The gradients of the site parameters (stage 2 of the row reductions): thread j
// sums column j of the partials in chunk order, site by site, and writes
//   dquery = scale du ⊙ norm_weight (scale du without one),  dnorm_weight = scale du ⊙ query
//   (+ dγ_values),  dout_norm_weight = dg,
// each summed over the sites (in site order) when the sites share the parameter.
template <typename acc_t>
__global__ void __launch_bounds__(256) site_grads_kernel(const __grid_constant__ SiteGradParams<acc_t> a) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t R = a.key_dim, D = a.dim;
  const int Q = a.num_sites;
  if (j >= D) return;
  const bool has_norm_weight = a.norm_weight.data != nullptr;
  // The sums over the sites of the gradients of parameters the sites share.
  acc_t dquery_sum = acc_t(0), dnorm_sum = acc_t(0), dg_sum = acc_t(0);
  for (int q = 0; q < Q; ++q) {
    if (j < R) {
      acc_t du = acc_t(0);
      for (int64_t c = 0; c < a.num_chunks; ++c) du += load_global(a.du_part + (c * Q + q) * R + j);
      du *= a.scale;
      const acc_t dquery = has_norm_weight ? du * site_element<acc_t>(a.norm_weight, q, j) : du;
      if (a.d_query.site_stride == 0) {
        dquery_sum += dquery;
      } else {
        store_scalar(a.d_query.data, a.d_query.dtype, q * a.d_query.site_stride + j, dquery);
      }
      if (has_norm_weight) {
        acc_t dnorm = du * site_element<acc_t>(a.query, q, j);
        if (a.dvw_part != nullptr) {
          for (int64_t c = 0; c < a.num_chunks; ++c) dnorm += load_global(a.dvw_part + (c * Q + q) * D + j);
        }
        if (a.d_norm_weight.site_stride == 0) {
          dnorm_sum += dnorm;
        } else {
          store_scalar(a.d_norm_weight.data, a.d_norm_weight.dtype, q * a.d_norm_weight.site_stride + j, dnorm);
        }
      }
    }
    if (a.dg_part != nullptr) {
      acc_t dg = acc_t(0);
      for (int64_t c = 0; c < a.num_chunks; ++c) dg += load_global(a.dg_part + (c * Q + q) * D + j);
      if (a.d_out_norm_weight.site_stride == 0) {
        dg_sum += dg;
      } else {
        store_scalar(a.d_out_norm_weight.data, a.d_out_norm_weight.dtype, q * a.d_out_norm_weight.site_stride + j, dg);
      }
    }
  }
  if (j < R && a.d_query.site_stride == 0) store_scalar(a.d_query.data, a.d_query.dtype, j, dquery_sum);
  if (j < R && has_norm_weight && a.d_norm_weight.site_stride == 0) {
    store_scalar(a.d_norm_weight.data, a.d_norm_weight.dtype, j, dnorm_sum);
  }
  if (a.dg_part != nullptr && a.d_out_norm_weight.site_stride == 0) {
    store_scalar(a.d_out_norm_weight.data, a.d_out_norm_weight.dtype, j, dg_sum);
  }
}

// ------------------------------------------------------------------ host launchers
//
// `Runtime` (csrc/cuda/ops_cuda.cu, csrc/simt/emulated_ops.cpp) provides
//   template <typename... P> void launch(const std::string& name, void (*kernel)(P...),
//                                        dim3 grid, dim3 block, size_t shared_bytes, P... args);

inline std::string tile_name(const char* kernel, bool acc_double, int G, int K, int QT) {
  return std::string(kernel) + "<" + (acc_double ? "double" : "float") + ", G=" + std::to_string(G) +
         ", K=" + std::to_string(K) + ", QT=" + std::to_string(QT) + ">";
}

template <typename acc_t, typename Runtime>
void launch_depth_attn_fwd(Runtime& rt, const DepthPlan& plan, const FwdParams<acc_t>& params) {
  constexpr bool kDouble = std::is_same_v<acc_t, double>;
  bool launched = false;
  for_each_tile([&](auto G, auto K, auto QT) {
    if constexpr (tile_fits(Pass::kForward, kDouble, G, K, QT)) {
      if (plan.group == G && plan.groups_per_thread == K && plan.site_tile == QT) {
        rt.launch(tile_name("depth_attn_fwd", kDouble, G, K, QT), &depth_attn_fwd_kernel<acc_t, G, K, QT>,
                  dim3(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.site_tiles)),
                  dim3(plan.threads, plan.teams), plan.shared_bytes, params);
        launched = true;
      }
    }
  });
  if (!launched) throw std::logic_error("depth_attn_fwd: no kernel instantiated for the planned tile");
}

// The site parameters' gradients from the per-chunk partials: one launch over the D columns.
template <typename acc_t, typename Runtime>
void launch_site_grads(Runtime& rt, const SiteGradParams<acc_t>& params) {
  const std::string name = std::string("site_grads<") + (std::is_same_v<acc_t, double> ? "double" : "float") + ">";
  rt.launch(name, &site_grads_kernel<acc_t>, dim3(static_cast<unsigned>(ceil_div(params.dim, 256))), dim3(256), 0,
            params);
}

// One launch per site tile (each after the first adds to the source gradients; none
// without rows), then site_grads_kernel.
template <typename acc_t, typename Runtime>
void launch_depth_attn_bwd(Runtime& rt, const DepthPlan& plan, BwdParams<acc_t> params,
                           const SiteGradParams<acc_t>& site_grads) {
  constexpr bool kDouble = std::is_same_v<acc_t, double>;
  const bool norm = params.out_norm_weight.data != nullptr;
  for (int t = 0; t < plan.site_tiles && params.rows > 0; ++t) {
    params.first_site = t * plan.site_tile;
    params.accumulate = t > 0;
    bool launched = false;
    for_each_tile([&](auto G, auto K, auto QT) {
      if constexpr (tile_fits(Pass::kBackward, kDouble, G, K, QT)) {
        if (plan.group == G && plan.groups_per_thread == K && plan.site_tile == QT) {
          const bool cache = plan.cache_words > 0;
          const std::string name =
              tile_name("depth_attn_bwd", kDouble, G, K, QT) + (norm ? "[norm]" : "") + (cache ? "[cache]" : "");
          const dim3 grid(static_cast<unsigned>(plan.grid_x)), block(plan.threads, plan.teams);
          auto launch = [&](auto kernel) { rt.launch(name, kernel, grid, block, plan.shared_bytes, params); };
          if (norm && cache) {
            launch(&depth_attn_bwd_kernel<acc_t, G, K, QT, true, !kDouble>);
          } else if (norm) {
            launch(&depth_attn_bwd_kernel<acc_t, G, K, QT, true, false>);
          } else if (cache) {
            launch(&depth_attn_bwd_kernel<acc_t, G, K, QT, false, !kDouble>);
          } else {
            launch(&depth_attn_bwd_kernel<acc_t, G, K, QT, false, false>);
          }
          launched = true;
        }
      }
    });
    if (!launched) throw std::logic_error("depth_attn_bwd: no kernel instantiated for the planned tile");
  }
  launch_site_grads<acc_t>(rt, site_grads);
}

}  // namespace attnres::cuda
