// CUDA kernels of fused attention (docs/design.md §2.4), FlashAttention-2 style:
//
//   o = softmax(q kᵀ · scale + mask) v,   q [B, H, Tq, Dh],  k, v [B, Hkv, Tk, Dh],  H = G · Hkv
//
// Torch-free: nvcc builds them into the extension (ops_cuda.cu) and the host
// compiler into the SIMT harness (csrc/simt/emulated_ops.cpp, with the tensor-core
// fragments and asynchronous copies emulated per lane by csrc/simt/warp_matrix.h);
// both launch them through the launchers at the end, with the plans below.
//
// Two families, one launch sequence (forward; backward: row terms, dK/dV, dQ):
//   fp16 / bf16  attention_mma_kernels.cuh: mma.sync tensor-core products with
//                register-resident accumulators, ldmatrix operands, cp.async double
//                buffering, 16 query (or key) rows per warp; one instantiation per
//                head-size bucket of 32.
//   fp32 / fp64  attention_simt_kernels.cuh: exact IEEE products through shared
//                memory (fp64: gradcheck runs through the kernels); Dh at run time.
//   attn_bwd_rows_kernel (attention_common.cuh), every dtype: δ = rowsum(dO ⊙ O) - dlse
//                and lse · log2 e (+inf for a row that sees no key, so that its P = 0).
// Every output element is summed by one block in a fixed order: no atomics, the
// results are bitwise reproducible. No T x T matrix exists anywhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_mma_kernels.cuh"
#include "attention_simt_kernels.cuh"

namespace attnres::cuda {

// ------------------------------------------------------------------ launch plans

enum class AttnKernel : int { kForward = 0, kKeyGrads = 1, kQueryGrads = 2 };

// The dynamic shared memory one block may opt in to: sm_86 / sm_89, sm_80 / sm_87, sm_90.
constexpr size_t kSharedSm86 = 99 * 1024, kSharedSm80 = 163 * 1024, kSharedSm90 = 227 * 1024;

struct AttnPlan {
  int threads = 0;
  int block_q = 0, block_k = 0;  // rows per block (forward, dQ: queries; dK/dV: keys) and per walked tile
  int head_pad = 0;              // SIMT: Dh rounded up to 16; tensor cores: the head-size bucket
  int stages = 1;                // tensor cores: walked tiles in flight
  size_t shared_bytes = 0;
};

inline bool attn_uses_tensor_cores(int32_t dtype) { return dtype == kFloat16 || dtype == kBFloat16; }

// Calls f(std::integral_constant<int, D>{}) with the head-size bucket D of the tensor-core kernels.
template <typename F>
void with_head_bucket(int64_t dh, F&& f) {
  switch ((dh + kMmaHeadBucket - 1) / kMmaHeadBucket) {
    case 1:
      return f(std::integral_constant<int, 32>{});
    case 2:
      return f(std::integral_constant<int, 64>{});
    case 3:
      return f(std::integral_constant<int, 96>{});
    case 4:
      return f(std::integral_constant<int, 128>{});
    case 5:
      return f(std::integral_constant<int, 160>{});
    case 6:
      return f(std::integral_constant<int, 192>{});
    case 7:
      return f(std::integral_constant<int, 224>{});
    default:
      return f(std::integral_constant<int, 256>{});
  }
}

inline size_t mma_shared_bytes(AttnKernel kind, int64_t dh, int warps, int stages) {
  size_t bytes = 0;
  with_head_bucket(dh, [&](auto head_dim) {
    constexpr int D = decltype(head_dim)::value;
    SmemCarver c;
    if (kind == AttnKernel::kForward) {
      MmaFwdSmem<D>(c, warps, stages);
    } else if (kind == AttnKernel::kKeyGrads) {
      MmaDkdvSmem<D>(c, warps, stages);
    } else {
      MmaDqSmem<D>(c, warps, stages);
    }
    bytes = c.used;
  });
  return bytes;
}

// Tensor cores: 8 warps with the walked tiles double-buffered when that fits the
// device's shared memory, else one buffer, else 4 warps (only Dh > 128 on sm_86/89).
inline AttnPlan plan_attention_mma(AttnKernel kind, int64_t dh, size_t max_shared) {
  constexpr int kCandidates[][2] = {{8, 2}, {8, 1}, {4, 2}, {4, 1}};  // warps, stages
  AttnPlan plan;
  with_head_bucket(dh, [&](auto head_dim) {
    using Tiles = MmaTiles<decltype(head_dim)::value>;
    plan.head_pad = decltype(head_dim)::value;
    for (const auto& [warps, stages] : kCandidates) {
      plan.threads = warps * kWarpSize;
      plan.stages = stages;
      if (kind == AttnKernel::kKeyGrads) {
        plan.block_k = warps / Tiles::kSplit * 16;
        plan.block_q = Tiles::kQueries;
      } else {
        plan.block_q = warps * 16;
        plan.block_k = Tiles::kKeys;
      }
      plan.shared_bytes = mma_shared_bytes(kind, dh, warps, stages);
      if (plan.shared_bytes <= max_shared) return;
    }
    throw std::logic_error("attention: no tensor-core plan fits " + std::to_string(max_shared) +
                           " bytes of shared memory (Dh = " + std::to_string(dh) + ")");
  });
  return plan;
}

template <typename acc_t>
size_t simt_shared_bytes(AttnKernel kind, int bq, int bk, int dp) {
  SmemCarver c;
  if (kind == AttnKernel::kForward) {
    SimtFwdSmem<acc_t>(c, bq, bk, dp);
  } else {
    SimtBwdSmem<acc_t>(c, kind == AttnKernel::kKeyGrads, bq, bk, dp);
  }
  return c.used;
}

// SIMT (fp32 / fp64): the largest tiles whose shared memory stays within 96 KiB
// (two blocks per SM on sm_80 and sm_90), the owned rows first; the sequence lengths
// only shrink the tiles of short sequences. Tiles are multiples of 8 (4 x 4
// micro-tiles over four warps). No plan exceeds sm_86's limit.
inline AttnPlan plan_attention_simt(AttnKernel kind, int32_t dtype, int64_t dh, int64_t tq, int64_t tk) {
  constexpr size_t kPreferred = 96 * 1024;
  constexpr int kCandidates[][2] = {{64, 64}, {64, 32}, {32, 32}, {32, 16}, {16, 32}, {16, 16}, {16, 8}, {8, 8}};
  constexpr int kGranule = 8;
  auto shrink = [&](int tile, int64_t length) {
    const int64_t needed = (std::max<int64_t>(length, 1) + kGranule - 1) / kGranule * kGranule;
    return static_cast<int>(needed < tile ? needed : tile);
  };
  AttnPlan plan;
  plan.threads = kAttnSimtThreads;
  plan.head_pad = static_cast<int>((dh + 15) / 16 * 16);
  for (const auto& [own, walked] : kCandidates) {
    const bool keys_owned = kind == AttnKernel::kKeyGrads;
    plan.block_q = shrink(keys_owned ? walked : own, tq);
    plan.block_k = shrink(keys_owned ? own : walked, tk);
    plan.shared_bytes = dtype == kFloat64 ? simt_shared_bytes<double>(kind, plan.block_q, plan.block_k, plan.head_pad)
                                          : simt_shared_bytes<float>(kind, plan.block_q, plan.block_k, plan.head_pad);
    if (plan.shared_bytes <= kPreferred) break;
  }
  if (plan.shared_bytes > kSharedSm86) {
    throw std::logic_error("attention: the smallest tile needs " + std::to_string(plan.shared_bytes) +
                           " bytes of shared memory (Dh = " + std::to_string(dh) + ")");
  }
  return plan;
}

// The plan of one kernel for a dtype, head size and sequence lengths on a device
// whose blocks may have `max_shared` bytes of dynamic shared memory. Launches
// beyond 48 KiB opt in to more (the Runtime sets the attribute).
inline AttnPlan plan_attention(AttnKernel kind, int32_t dtype, int64_t dh, int64_t tq, int64_t tk, size_t max_shared) {
  if (dh < 1 || dh > kAttnMaxHeadDim) {
    throw std::invalid_argument("the CUDA attention kernels support head sizes 1 <= Dh <= " +
                                std::to_string(kAttnMaxHeadDim) + ", got Dh = " + std::to_string(dh));
  }
  return attn_uses_tensor_cores(dtype) ? plan_attention_mma(kind, dh, max_shared)
                                       : plan_attention_simt(kind, dtype, dh, tq, tk);
}

// ------------------------------------------------------------------ host launchers
//
// `Runtime` (csrc/cuda/ops_cuda.cu, csrc/simt/emulated_ops.cpp) provides
//   size_t max_shared_bytes();   the device's opt-in shared memory per block
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

// The launch name of a kernel: "attn_fwd_mma<bf16, 128>", "attn_fwd_simt<fp32>".
inline std::string attn_kernel_name(const char* kernel, int32_t dtype, const AttnPlan& plan) {
  return attn_uses_tensor_cores(dtype)
             ? std::string(kernel) + "_mma<" + attn_dtype_name(dtype) + ", " + std::to_string(plan.head_pad) + ">"
             : std::string(kernel) + "_simt<" + attn_dtype_name(dtype) + ">";
}

// Launches the kernel of `kind` for storage type S with `plan` on `grid`.
template <typename S, typename Runtime>
void launch_attn_kernel(Runtime& rt, AttnKernel kind, int32_t dtype, const AttnPlan& plan, dim3 grid,
                        AttnParams params) {
  params.block_q = plan.block_q;
  params.block_k = plan.block_k;
  params.head_pad = plan.head_pad;
  params.stages = plan.stages;
  const char* names[] = {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"};
  const std::string name = attn_kernel_name(names[static_cast<int>(kind)], dtype, plan);
  const dim3 block(static_cast<unsigned>(plan.threads));
  if constexpr (std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>) {
    with_head_bucket(params.dh, [&](auto head_dim) {
      constexpr int D = decltype(head_dim)::value;
      auto* kernel = kind == AttnKernel::kForward    ? &attn_fwd_mma_kernel<S, D>
                     : kind == AttnKernel::kKeyGrads ? &attn_bwd_dkdv_mma_kernel<S, D>
                                                     : &attn_bwd_dq_mma_kernel<S, D>;
      rt.launch(name, kernel, grid, block, plan.shared_bytes, params);
    });
  } else {
    auto* kernel = kind == AttnKernel::kForward    ? &attn_fwd_simt_kernel<S>
                   : kind == AttnKernel::kKeyGrads ? &attn_bwd_dkdv_simt_kernel<S>
                                                   : &attn_bwd_dq_simt_kernel<S>;
    rt.launch(name, kernel, grid, block, plan.shared_bytes, params);
  }
}

// out and lse for q [B, H, Tq, Dh]; `params` without the plan fields.
template <typename Runtime>
void launch_attn_fwd(Runtime& rt, int32_t dtype, int64_t batch, const AttnParams& params) {
  const AttnPlan plan =
      plan_attention(AttnKernel::kForward, dtype, params.dh, params.tq, params.tk, rt.max_shared_bytes());
  const dim3 grid(static_cast<unsigned>(attn_ceil_div(params.tq, plan.block_q)), static_cast<unsigned>(params.heads),
                  static_cast<unsigned>(batch));
  dispatch_attn_dtype(
      dtype, [&](auto s) { launch_attn_kernel<decltype(s)>(rt, AttnKernel::kForward, dtype, plan, grid, params); });
}

// The row terms, then dK/dV and dQ (two kernels, each output summed by one block).
template <typename Runtime>
void launch_attn_bwd(Runtime& rt, int32_t dtype, int64_t batch, const AttnParams& params) {
  const int64_t num_rows = batch * params.heads * params.tq;
  const size_t max_shared = rt.max_shared_bytes();
  const AttnPlan kv = plan_attention(AttnKernel::kKeyGrads, dtype, params.dh, params.tq, params.tk, max_shared);
  const AttnPlan qg = plan_attention(AttnKernel::kQueryGrads, dtype, params.dh, params.tq, params.tk, max_shared);
  dispatch_attn_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    const int row_warps = kAttnRowThreads / kWarpSize;
    rt.launch(std::string("attn_bwd_rows<") + attn_dtype_name(dtype) + ">", &attn_bwd_rows_kernel<S>,
              dim3(static_cast<unsigned>(attn_ceil_div(num_rows, row_warps))), dim3(kAttnRowThreads), 0, params,
              num_rows);
    if (params.tk > 0) {
      const dim3 grid(static_cast<unsigned>(attn_ceil_div(params.tk, kv.block_k)),
                      static_cast<unsigned>(params.heads / params.group), static_cast<unsigned>(batch));
      launch_attn_kernel<S>(rt, AttnKernel::kKeyGrads, dtype, kv, grid, params);
    }
    const dim3 grid(static_cast<unsigned>(attn_ceil_div(params.tq, qg.block_q)), static_cast<unsigned>(params.heads),
                    static_cast<unsigned>(batch));
    launch_attn_kernel<S>(rt, AttnKernel::kQueryGrads, dtype, qg, grid, params);
  });
}

}  // namespace attnres::cuda
