// CUDA kernels of the fused Block step (DESIGN.md §2.3, phase 2; the CPU op is
// csrc/cpu/block_step_cpu.cpp): `new_partial = partial + update`, then the next
// site's read as the merge of its phase-1 read (h_a, lse_a) with the one source
// new_partial, then optionally the output RMSNorm. Per row, with u = query ⊙ norm_weight
// and t the key columns of v (its last R = key_rank columns; every column when R = D):
//
//   v = new_partial (rounded to its dtype);  r = rsqrt(mean(t²) + eps);  s = r <u, t>
//   m = max(lse_a, s);  α_a, α_b = e^{lse_a - m}, e^{s - m} / (e^{lse_a - m} + e^{s - m})
//   h = α_a h_a + α_b v;  lse = m + log(...);  out = h  or  h * rsqrt(mean(h²) + eps) * g
//
// Torch-free, built by nvcc (ops_cuda.cu) and by the host compiler into the SIMT
// harness (csrc/simt/emulated_ops.cpp), like the depth read, whose device
// layer this reuses (depth_attention_kernels.cuh): the row layout (a team of T
// threads per row, thread t owning K groups of G elements, one-warp teams four
// to a block), the launch plan (plan_depth_attn with one site), row loads and
// stores in each tensor's own dtype, the staged site parameters (SiteTile), the
// team reductions (TeamReducer) and the fixed-order column sums of the backward.
//
// Forward: one pass over each row, one team reduction (Σ v², <u, v>), a second
// (Σ h²) with the output norm. Backward: a team owns a fixed chunk of rows (the
// chunking depends on M only); per row, with do = ∂L/∂h, one team reduction:
//   with the out norm: h = α_a h_a + α_b v recomputed, rstd = rsqrt(mean(h²) + eps),
//                      do = rstd g dy + k h with k = -rstd³ <g dy, h> / D, dg += rstd dy h,
//                      and <do, x> = rstd <g dy, x> + k <h, x> for x = h_a, v (six sums);
//   without:           do = dy, and the sums <do, h_a>, <do, v>
//   δ = α_a <do, h_a> + α_b <do, v>;  ds = α_b (<do, v> - δ + dlse)
//   ∂lse_a = α_a (<do, h_a> - δ + dlse);   ∂h_a = α_a do
//   ∂v = α_b do + ds r u - ds s r² t / R (+ the incoming ∂new_partial);   du += ds r t
// The row outputs are built group by group. du and dg (in shared memory: the
// registers hold the three rows v, h_a, do) are summed over the chunk's rows and
// written as one partial per chunk ([R] and [D]); site_grads_kernel (the depth
// read's) adds the partials in chunk order and writes the gradients of query,
// norm_weight and out_norm_weight in their dtypes: no atomics, the same bits on
// every run. As in the depth read, u and g are staged from the parameters
// themselves (no host-side product per call).
//
// Global-memory traffic per row (the harness counts it; tests/backends/test_cuda_block_step.py
// checks it exactly), s_x the element size of tensor x, a = sizeof(acc_t), W = T / 32
// warps per row team (a per-row scalar every lane loads is one request per warp):
//   forward   reads   D (s_partial + s_update + s_prefix) + a W (lse_a)
//             writes  D (s_new + s_out) + 3 a (lse, logit, rinv)
//   backward  reads   D (s_new + s_prefix [+ s_dy] [+ s_dnew]) + (3 [+ 1 dlse]) a W (lse_a, logit, rinv)
//             writes  D (s_new + s_prefix) + a (d lse_a)
//   per row team: the rows of query and norm_weight (R elements each) [and of g, D]
//   read once; per row chunk (backward): R a (du) [+ D a (dg)] partial sums, read
//   back once by site_grads_kernel, which writes each parameter gradient once.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "depth_attention_kernels.cuh"

namespace attnres::cuda {

// RowRef (depth_attention_kernels.cuh) names each [M, D] operand: pointer (null
// when the optional operand is absent), row stride in elements, dtype code.

template <typename acc_t>
struct StepFwdParams {
  RowRef partial, update, prefix_out;  // inputs (partial.data null: new_partial = update)
  RowRef new_partial, out;             // outputs (contiguous)
  int64_t rows, dim;                   // M, D
  int32_t key_start;                   // D - R: the keys are the columns [key_start, D)
  acc_t inv_key_dim;                   // 1 / R (rounded to acc_t, as the kernel would)
  SiteVector query, norm_weight;       // [R] (norm_weight: or absent)
  SiteVector out_norm_weight;          // [D] output-norm weight g, or absent
  const acc_t* prefix_lse;             // [M]
  acc_t* lse;                          // [M]
  acc_t* logit;                        // [M]: s of the new source
  acc_t* rinv;                         // [M]: r of the new source
  acc_t eps;
  bool vec;  // every row 16-byte aligned and D % G == 0: vector loads and stores
};

template <typename acc_t>
struct StepBwdParams {
  RowRef grad_new_partial, grad_out;   // incoming gradients (data null when absent)
  RowRef new_partial, prefix_out;      // saved inputs
  RowRef grad_total, grad_prefix_out;  // outputs (contiguous): ∂new_partial (total), ∂h_a
  int64_t rows, dim;
  int32_t key_start;
  acc_t inv_key_dim;
  const acc_t* dlse;  // [M] or null
  SiteVector query, norm_weight, out_norm_weight;
  const acc_t* prefix_lse;  // [M]
  const acc_t* logit;       // [M]
  const acc_t* rinv;        // [M]
  acc_t* d_prefix_lse;      // [M]
  acc_t* du_part;           // [chunks, R]
  acc_t* dg_part;           // [chunks, D] or null
  int64_t rows_per_chunk, num_chunks;
  acc_t eps;
  bool vec;
  bool part_vec;  // vec, and the key columns start at a group boundary: vector stores of du
};

// Values one team reduction carries at most, per pass: forward Σ v², <u, v>
// (then Σ h²); backward with the out norm the six sums below, else <do, h_a>, <do, v>.
constexpr int kStepReduceValues[2] = {2, 6};

// The launch configuration of a step over M rows of width D: the depth read's
// plan for one site (same row layout, tiles and staged arrays), with the team
// scratch sized for kStepReduceValues and the backward's du kept in shared memory.
inline DepthPlan plan_block_step(Pass pass, int64_t M, int64_t D, int min_itemsize, bool acc_double, bool has_out_norm,
                                 int num_sms) {
  DepthPlan plan = plan_depth_attn(pass, M, D, 1, min_itemsize, acc_double, has_out_norm, false, num_sms);
  const int warps = plan.threads / kWarpSize;
  const int acc_bytes = acc_double ? 8 : 4;
  // Staged arrays: forward u [+ g]; backward u, du [+ g, dg].
  const int arrays = pass == Pass::kForward ? 1 + has_out_norm : 2 + 2 * has_out_norm;
  const int64_t tile_bytes = int64_t(plan.groups_per_thread) * plan.group * plan.threads * acc_bytes;
  const int64_t scratch = warps > 1 ? int64_t(2) * warps * kStepReduceValues[pass == Pass::kBackward] * acc_bytes : 0;
  plan.shared_bytes = static_cast<size_t>(plan.teams * tile_bytes * arrays + scratch);
  return plan;
}

// The step's tiles: those of the depth read with one site.
constexpr bool step_tile_fits(Pass pass, bool acc_double, int G, int K) { return tile_fits(pass, acc_double, G, K, 1); }

// The softmax weights of a merge with one new source: α_a of the prefix (logit
// lse_a), α_b of the source (logit s), and the merged lse. NaN in either logit
// propagates to both weights, like the reference's softmax.
template <typename acc_t>
struct MergeWeights {
  acc_t alpha_a, alpha_b, lse;
};

template <typename acc_t>
__device__ __forceinline__ MergeWeights<acc_t> merge_weights(acc_t lse_a, acc_t s) {
  const acc_t top = (s > lse_a || dev_isnan(s)) ? s : lse_a;
  const acc_t e_a = dev_exp(lse_a - top), e_b = dev_exp(s - top);
  const acc_t z = e_a + e_b;
  return {e_a / z, e_b / z, top + dev_log(z)};
}

__device__ __forceinline__ const void* row_of(RowRef t, int64_t p) { return row_ptr(t.data, t.dtype, t.row_stride, p); }

// This thread's k-th group of row p of `t` (zero past D), and its store: the
// backward builds its row outputs group by group (one group live, not a row).
template <int G, typename acc_t>
__device__ __forceinline__ void load_row_group(RowRef t, int64_t p, int k, int64_t D, bool vec, acc_t (&x)[G]) {
  const int size = dtype_size(t.dtype);
  const int64_t d0 = group_start<G>(k);
  RawGroup<G, acc_t> raw;
  load_group(static_cast<const char*>(row_of(t, p)) + d0 * size, size, vec, D - d0, raw);
  decode(raw, t.dtype, x);
}

template <int G, typename acc_t>
__device__ __forceinline__ void store_row_group(RowRef t, int64_t p, int k, int64_t D, bool vec,
                                                const RawGroup<G, acc_t>& raw) {
  const int size = dtype_size(t.dtype);
  const int64_t d0 = group_start<G>(k);
  store_group(const_cast<char*>(static_cast<const char*>(row_of(t, p))) + d0 * size, size, vec, D - d0, raw);
}

// Stores this thread's elements of row p of `t` and replaces them by the values
// stored (rounded to t's dtype): the read must see exactly the new_partial it returns.
template <int G, int K, typename acc_t>
__device__ __forceinline__ void store_row_rounded(RowRef t, int64_t p, int64_t D, bool vec, acc_t (&x)[K][G]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    RawGroup<G, acc_t> raw;
    encode(x[k], t.dtype, raw);
    decode(raw, t.dtype, x[k]);
    store_row_group(t, p, k, D, vec, raw);
  }
}

// ------------------------------------------------------------------ forward

template <typename acc_t, int G, int K>
__global__ void __launch_bounds__(kMaxThreads, 1)
    block_step_fwd_kernel(const __grid_constant__ StepFwdParams<acc_t> a) {
  const int64_t M = a.rows, D = a.dim;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const bool has_norm = a.out_norm_weight.data != nullptr;
  const int64_t tile = int64_t(K) * G * blockDim.x;
  acc_t* smem = dynamic_shared<acc_t>();
  const SiteTile<acc_t, G, K, 1> u{smem + threadIdx.y * tile};
  const SiteTile<acc_t, G, K, 1> g{smem + (blockDim.y + threadIdx.y) * tile};
  u.stage(a.query, a.norm_weight, acc_t(1), 0, 1, a.key_start, D);
  if (has_norm) g.stage(a.out_norm_weight, 0, 1, D);
  TeamReducer<acc_t> reducer{smem + (has_norm ? 2 : 1) * blockDim.y * tile, kStepReduceValues[0]};

  for (int64_t first = int64_t(blockIdx.x) * blockDim.y; first < M; first += int64_t(gridDim.x) * blockDim.y) {
    const int64_t p = first + threadIdx.y;
    if (p >= M) continue;  // only one-warp teams come several to a block; they use no block barrier
    acc_t v[K][G], h[K][G];
    load_row(row_of(a.update, p), a.update.dtype, D, a.vec, v);
    if (a.partial.data != nullptr) {
      load_row(row_of(a.partial, p), a.partial.dtype, D, a.vec, h);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) v[k][e] = h[k][e] + v[k][e];
    }
    store_row_rounded(a.new_partial, p, D, a.vec, v);
    acc_t sums[2] = {acc_t(0), acc_t(0)};  // Σ t², <u, t>
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e) {
        if (is_key_column<G>(k, e, a.key_start)) sums[0] += v[k][e] * v[k][e];
        sums[1] += u.at(0, k, e) * v[k][e];
      }
    reducer.sum(sums);
    const acc_t r = acc_t(1) / dev_sqrt(sums[0] * a.inv_key_dim + a.eps);
    const acc_t s = r * sums[1];
    const MergeWeights<acc_t> w = merge_weights(load_uniform(a.prefix_lse + p), s);
    load_row(row_of(a.prefix_out, p), a.prefix_out.dtype, D, a.vec, h);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e) h[k][e] = h[k][e] * w.alpha_a + v[k][e] * w.alpha_b;
    if (has_norm) {  // fused output RMSNorm: y = h * g * rsqrt(mean(h²) + eps)
      acc_t sumsq[1] = {acc_t(0)};
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) sumsq[0] += h[k][e] * h[k][e];
      reducer.sum(sumsq);
      const acc_t rstd = acc_t(1) / dev_sqrt(sumsq[0] * inv_d + a.eps);
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) h[k][e] = h[k][e] * g.at(0, k, e) * rstd;
    }
    store_row(const_cast<void*>(row_of(a.out, p)), a.out.dtype, D, a.vec, h);
    if (threadIdx.x == 0) {
      store_global(a.lse + p, w.lse);
      store_global(a.logit + p, s);
      store_global(a.rinv + p, r);
    }
  }
}

// ------------------------------------------------------------------ backward

template <typename acc_t, int G, int K>
__global__ void __launch_bounds__(kMaxThreads, 1)
    block_step_bwd_kernel(const __grid_constant__ StepBwdParams<acc_t> a) {
  const int64_t M = a.rows, D = a.dim;
  const acc_t inv_d = acc_t(1) / static_cast<acc_t>(D);
  const bool has_norm = a.out_norm_weight.data != nullptr;
  const int64_t chunk = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (chunk >= a.num_chunks) return;  // only one-warp teams come several to a block; they use no block barrier
  const int64_t tile = int64_t(K) * G * blockDim.x;
  acc_t* smem = dynamic_shared<acc_t>();
  // du and dg (sums over the chunk's rows) live in shared memory beside u and g:
  // registers hold the three rows of the step (v, h_a, do).
  const SiteTile<acc_t, G, K, 1> u{smem + threadIdx.y * tile};
  const SiteTile<acc_t, G, K, 1> du{smem + (blockDim.y + threadIdx.y) * tile};
  const SiteTile<acc_t, G, K, 1> g{smem + (2 * blockDim.y + threadIdx.y) * tile};
  const SiteTile<acc_t, G, K, 1> dg{smem + (3 * blockDim.y + threadIdx.y) * tile};
  u.stage(a.query, a.norm_weight, acc_t(1), 0, 1, a.key_start, D);
  du.zero();
  if (has_norm) {
    g.stage(a.out_norm_weight, 0, 1, D);
    dg.zero();
  }
  TeamReducer<acc_t> reducer{smem + (has_norm ? 4 : 2) * blockDim.y * tile, kStepReduceValues[1]};

  const int64_t row_end = imin(M, (chunk + 1) * a.rows_per_chunk);
  for (int64_t p = chunk * a.rows_per_chunk; p < row_end; ++p) {
    const acc_t s = load_uniform(a.logit + p), r = load_uniform(a.rinv + p);
    const MergeWeights<acc_t> w = merge_weights(load_uniform(a.prefix_lse + p), s);
    // Three rows live (v, h_a, do) besides du; h = α_a h_a + α_b v is recomputed where used.
    acc_t v[K][G], ha[K][G], dO[K][G];
    load_row(row_of(a.new_partial, p), a.new_partial.dtype, D, a.vec, v);
    load_row(row_of(a.prefix_out, p), a.prefix_out.dtype, D, a.vec, ha);
    if (a.grad_out.data != nullptr) {
      load_row(row_of(a.grad_out, p), a.grad_out.dtype, D, a.vec, dO);
    } else {
      fill(dO, acc_t(0));
    }
    acc_t dp[2] = {acc_t(0), acc_t(0)};  // <do, h_a>, <do, v>
    if (has_norm) {
      // h = α_a h_a + α_b v replaces h_a in registers; one team reduction gives
      // rstd, k = -rstd³ <g dy, h> / D and, as do = rstd g dy + k h, both <do, ·>.
      acc_t sums[6] = {};  // Σ h², <g dy, h>, <g dy, h_a>, <h, h_a>, <g dy, v>, <h, v>
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          const acc_t h = ha[k][e] * w.alpha_a + v[k][e] * w.alpha_b;
          const acc_t gdy = g.at(0, k, e) * dO[k][e];
          sums[0] += h * h;
          sums[1] += gdy * h;
          sums[2] += gdy * ha[k][e];
          sums[3] += h * ha[k][e];
          sums[4] += gdy * v[k][e];
          sums[5] += h * v[k][e];
          ha[k][e] = h;
        }
      reducer.sum(sums);
      const acc_t rstd = acc_t(1) / dev_sqrt(sums[0] * inv_d + a.eps);
      const acc_t k_coef = -rstd * rstd * rstd * sums[1] * inv_d;
      dp[0] = rstd * sums[2] + k_coef * sums[3];
      dp[1] = rstd * sums[4] + k_coef * sums[5];
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          dg.at(0, k, e) += rstd * dO[k][e] * ha[k][e];
          dO[k][e] = g.at(0, k, e) * dO[k][e] * rstd + ha[k][e] * k_coef;
        }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int e = 0; e < G; ++e) {
          dp[0] += dO[k][e] * ha[k][e];
          dp[1] += dO[k][e] * v[k][e];
        }
      reducer.sum(dp);
    }
    const acc_t delta = w.alpha_a * dp[0] + w.alpha_b * dp[1];
    const acc_t dl = a.dlse != nullptr ? load_uniform(a.dlse + p) : acc_t(0);
    const acc_t ds = w.alpha_b * (dp[1] - delta + dl);
    const acc_t c1 = ds * r, c2 = -ds * s * r * r * a.inv_key_dim;
    // From here on v is the key t (zero outside the key columns).
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e)
        if (!is_key_column<G>(k, e, a.key_start)) v[k][e] = acc_t(0);
    // Group by group: ∂v = α_b do + c1 u + c2 t (+ the incoming gradient of new_partial),
    // ∂h_a = α_a do, du += c1 t.
#pragma unroll
    for (int k = 0; k < K; ++k) {
      acc_t x[G];
      if (a.grad_new_partial.data != nullptr) {
        load_row_group(a.grad_new_partial, p, k, D, a.vec, x);
      } else {
#pragma unroll
        for (int e = 0; e < G; ++e) x[e] = acc_t(0);
      }
#pragma unroll
      for (int e = 0; e < G; ++e) {
        x[e] += dO[k][e] * w.alpha_b + u.at(0, k, e) * c1 + v[k][e] * c2;
        du.at(0, k, e) += c1 * v[k][e];
      }
      RawGroup<G, acc_t> raw;
      encode(x, a.grad_total.dtype, raw);
      store_row_group(a.grad_total, p, k, D, a.vec, raw);
#pragma unroll
      for (int e = 0; e < G; ++e) x[e] = dO[k][e] * w.alpha_a;
      encode(x, a.grad_prefix_out.dtype, raw);
      store_row_group(a.grad_prefix_out, p, k, D, a.vec, raw);
    }
    if (threadIdx.x == 0) store_global(a.d_prefix_lse + p, w.alpha_a * (dp[0] - delta + dl));
  }
  // This chunk's partial sums of du (and dg) over its rows.
  acc_t row[K][G];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int e = 0; e < G; ++e) row[k][e] = du.at(0, k, e);
  store_acc_row(a.du_part + chunk * (D - a.key_start), a.key_start, D, a.part_vec, row);
  if (has_norm) {
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int e = 0; e < G; ++e) row[k][e] = dg.at(0, k, e);
    store_acc_row(a.dg_part + chunk * D, 0, D, a.vec, row);
  }
}

// ------------------------------------------------------------------ host launchers
//
// `Runtime`: as for the depth read (launch(name, kernel, grid, block, shared_bytes, args...)).

inline std::string step_tile_name(const char* kernel, bool acc_double, int G, int K) {
  return std::string(kernel) + "<" + (acc_double ? "double" : "float") + ", G=" + std::to_string(G) +
         ", K=" + std::to_string(K) + ">";
}

template <typename acc_t, typename Runtime>
void launch_block_step_fwd(Runtime& rt, const DepthPlan& plan, const StepFwdParams<acc_t>& params) {
  constexpr bool kDouble = std::is_same_v<acc_t, double>;
  bool launched = false;
  for_each_value<4, 8>([&](auto G) {
    for_each_value<1, 2>([&](auto K) {
      if constexpr (step_tile_fits(Pass::kForward, kDouble, G, K)) {
        if (plan.group == G && plan.groups_per_thread == K) {
          rt.launch(step_tile_name("block_step_fwd", kDouble, G, K), &block_step_fwd_kernel<acc_t, G, K>,
                    dim3(static_cast<unsigned>(plan.grid_x)), dim3(plan.threads, plan.teams), plan.shared_bytes,
                    params);
          launched = true;
        }
      }
    });
  });
  if (!launched) throw std::logic_error("block_step_fwd: no kernel instantiated for the planned tile");
}

// The backward kernel (none without rows), then site_grads_kernel.
template <typename acc_t, typename Runtime>
void launch_block_step_bwd(Runtime& rt, const DepthPlan& plan, const StepBwdParams<acc_t>& params,
                           const SiteGradParams<acc_t>& site_grads) {
  constexpr bool kDouble = std::is_same_v<acc_t, double>;
  const bool norm = params.out_norm_weight.data != nullptr;
  bool launched = params.rows == 0;
  for_each_value<4, 8>([&](auto G) {
    for_each_value<1, 2>([&](auto K) {
      if constexpr (step_tile_fits(Pass::kBackward, kDouble, G, K)) {
        if (params.rows > 0 && plan.group == G && plan.groups_per_thread == K) {
          const std::string name = step_tile_name("block_step_bwd", kDouble, G, K) + (norm ? "[norm]" : "");
          rt.launch(name, &block_step_bwd_kernel<acc_t, G, K>, dim3(static_cast<unsigned>(plan.grid_x)),
                    dim3(plan.threads, plan.teams), plan.shared_bytes, params);
          launched = true;
        }
      }
    });
  });
  if (!launched) throw std::logic_error("block_step_bwd: no kernel instantiated for the planned tile");
  launch_site_grads<acc_t>(rt, site_grads);
}

}  // namespace attnres::cuda
