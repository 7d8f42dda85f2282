// The ahead-of-time check of the CUDA kernels (python -m attnres_kernels.check):
// compiled with `nvcc -Xptxas -v` for each architecture, which instantiates every
// kernel the launchers can choose, and run on the host (no GPU needed) to print
// one line per kernel: its name as ptxas reports it (demangled) and the largest
// dynamic shared memory any launch plan gives it. It also checks that every plan
// over D, Q, the dtype mixes, the output norm and weighted normalised values maps
// to an instantiated kernel within the shared memory of every sm_80+ GPU
// (for the depth read and the Block step), and that every attention plan (dtype x
// Dh x sequence lengths) fits the shared memory of every sm_80+ GPU and maps to a
// listed kernel (tensor cores: one per 16-bit dtype and head-size bucket; SIMT: one
// per fp32 / fp64).
#include <array>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "../attention_kernels.cuh"
#include "../block_step_kernels.cuh"
#include "../depth_attention_kernels.cuh"

using namespace attnres::cuda;

namespace {

using TileKey = std::tuple<int, bool, int, int, int, bool>;  // pass, acc_double, G, K, QT, source cache

std::map<TileKey, size_t> largest_shared_bytes() {
  std::map<TileKey, size_t> shared;
  for (int pass = 0; pass < 2; ++pass) {
    for (bool acc_double : {false, true}) {
      for (int itemsize : {2, 4, 8}) {
        if (itemsize == 8 && !acc_double) continue;  // fp64 data accumulates in fp64
        for (bool norm : {false, true}) {
          for (bool weighted_values : {false, true}) {
            for (int64_t d = 1; d <= kMaxDim; ++d) {
              for (int64_t q = 1; q <= 2 * kMaxSiteTile[0][0]; ++q) {
                DepthPlan p;
                try {
                  p = plan_depth_attn(static_cast<Pass>(pass), 1024, d, q, itemsize, acc_double, norm, weighted_values,
                                      132);
                } catch (const std::invalid_argument&) {
                  // Only fp64 math with the output norm and weighted normalised values at the widest rows
                  // exceeds the shared memory of every sm_80+ GPU: the op refuses those by name.
                  if (!(acc_double && norm && weighted_values)) throw;
                  continue;
                }
                auto& s = shared[{pass, acc_double, p.group, p.groups_per_thread, p.site_tile, false}];
                s = std::max(s, p.shared_bytes);
                // The backward's source cache, for N sources of this element size.
                for (int n : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128}) {
                  if (pass == 0 || itemsize == 8) break;
                  DepthPlan cached = p;
                  const std::vector<int> itemsizes(n, itemsize);
                  plan_source_cache(cached, acc_double, itemsizes.data(), n);
                  if (cached.cache_words == 0) continue;
                  auto& c = shared[{pass, acc_double, p.group, p.groups_per_thread, p.site_tile, true}];
                  c = std::max(c, cached.shared_bytes);
                }
              }
            }
          }
        }
      }
    }
  }
  return shared;
}

// The name ptxas reports for an attention kernel of storage dtype `dtype` (and head-size bucket), demangled.
std::string attention_kernel_name(const char* kernel, int32_t dtype, int head_bucket = 0) {
  const char* type = dtype == kFloat16    ? "attnres::cuda::Half"
                     : dtype == kBFloat16 ? "attnres::cuda::BFloat16"
                     : dtype == kFloat32  ? "float"
                                          : "double";
  return std::string(kernel) + "<" + type + (head_bucket > 0 ? ", " + std::to_string(head_bucket) : "") + ">";
}

using StepKey = std::tuple<int, bool, int, int>;  // pass, acc_double, G, K

std::map<StepKey, size_t> largest_step_shared_bytes() {
  std::map<StepKey, size_t> shared;
  for (int pass = 0; pass < 2; ++pass) {
    for (bool acc_double : {false, true}) {
      for (int itemsize : {2, 4, 8}) {
        if (itemsize == 8 && !acc_double) continue;
        for (bool norm : {false, true}) {
          for (int64_t d = 1; d <= kMaxDim; ++d) {
            const DepthPlan p = plan_block_step(static_cast<Pass>(pass), 1024, d, itemsize, acc_double, norm, 132);
            auto& s = shared[{pass, acc_double, p.group, p.groups_per_thread}];
            s = std::max(s, p.shared_bytes);
          }
        }
      }
    }
  }
  return shared;
}

std::string kernel_name(const char* kernel, bool acc_double, int G, int K, int QT) {
  return std::string(kernel) + "<" + (acc_double ? "double" : "float") + ", " + std::to_string(G) + ", " +
         std::to_string(K) + ", " + std::to_string(QT) + ">";
}

// The largest dynamic shared memory of each attention kernel over every plan (head
// sizes 1..256, sequence lengths from 1, where the SIMT tiles shrink, to long), for
// the GPUs of each architecture: [0] sm_80 code (sm_80 / sm_87, and sm_86 / sm_89 with
// less shared memory), [1] sm_90. plan_attention throws when no plan fits a GPU.
std::map<std::string, std::array<size_t, 2>> attention_shared_bytes() {
  std::map<std::string, std::array<size_t, 2>> shared;
  constexpr std::pair<size_t, int> kGpus[] = {{kSharedSm86, 0}, {kSharedSm80, 0}, {kSharedSm90, 1}};
  for (const auto& [max_shared, arch] : kGpus) {
    for (int32_t dtype : {kFloat16, kBFloat16, kFloat32, kFloat64}) {
      for (int kind = 0; kind < 3; ++kind) {
        const char* name =
            kind == 0   ? (attn_uses_tensor_cores(dtype) ? "attn_fwd_mma_kernel" : "attn_fwd_simt_kernel")
            : kind == 1 ? (attn_uses_tensor_cores(dtype) ? "attn_bwd_dkdv_mma_kernel" : "attn_bwd_dkdv_simt_kernel")
                        : (attn_uses_tensor_cores(dtype) ? "attn_bwd_dq_mma_kernel" : "attn_bwd_dq_simt_kernel");
        for (int64_t dh = 1; dh <= kAttnMaxHeadDim; ++dh) {
          for (int64_t t : {1, 8, 16, 17, 33, 64, 1 << 20}) {
            const AttnPlan p = plan_attention(static_cast<AttnKernel>(kind), dtype, dh, t, t, max_shared);
            const int bucket = attn_uses_tensor_cores(dtype) ? p.head_pad : 0;
            auto& s = shared[attention_kernel_name(name, dtype, bucket)][arch];
            s = std::max(s, p.shared_bytes);
          }
        }
      }
      shared[attention_kernel_name("attn_bwd_rows_kernel", dtype)] = {0, 0};
    }
  }
  return shared;
}

}  // namespace

int main() {
  std::map<TileKey, size_t> shared;
  std::map<StepKey, size_t> step_shared;
  try {
    shared = largest_shared_bytes();
    step_shared = largest_step_shared_bytes();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "a launch plan failed: %s\n", e.what());
    return 1;
  }
  size_t kernels = 0, unreachable = 0;
  // The backward comes with and without the fused output norm and the source cache (its last
  // two template arguments).
  auto emit = [&](Pass pass, bool acc_double, int G, int K, int QT, bool norm, bool cache, const void* /*kernel*/) {
    std::string name =
        kernel_name(pass == Pass::kForward ? "depth_attn_fwd_kernel" : "depth_attn_bwd_kernel", acc_double, G, K, QT);
    if (pass == Pass::kBackward) {
      name.insert(name.size() - 1, std::string(norm ? ", true" : ", false") + (cache ? ", true" : ", false"));
    }
    const auto it = shared.find({static_cast<int>(pass), acc_double, G, K, QT, cache});
    if (it == shared.end()) {
      std::fprintf(stderr, "%s is instantiated but no launch plan chooses it\n", name.c_str());
      ++unreachable;
      return;
    }
    std::printf("%s\t%zu\n", name.c_str(), it->second);
    kernels += pass == Pass::kForward || norm;  // one plan key for both output-norm variants
  };
  for_each_tile([&](auto G, auto K, auto QT) {
    if constexpr (tile_fits(Pass::kForward, false, G, K, QT))
      emit(Pass::kForward, false, G, K, QT, false, false,
           reinterpret_cast<const void*>(&depth_attn_fwd_kernel<float, G, K, QT>));
    if constexpr (tile_fits(Pass::kForward, true, G, K, QT))
      emit(Pass::kForward, true, G, K, QT, false, false,
           reinterpret_cast<const void*>(&depth_attn_fwd_kernel<double, G, K, QT>));
    if constexpr (tile_fits(Pass::kBackward, false, G, K, QT)) {
      emit(Pass::kBackward, false, G, K, QT, false, false,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<float, G, K, QT, false, false>));
      emit(Pass::kBackward, false, G, K, QT, true, false,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<float, G, K, QT, true, false>));
      emit(Pass::kBackward, false, G, K, QT, false, true,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<float, G, K, QT, false, true>));
      emit(Pass::kBackward, false, G, K, QT, true, true,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<float, G, K, QT, true, true>));
    }
    if constexpr (tile_fits(Pass::kBackward, true, G, K, QT)) {
      emit(Pass::kBackward, true, G, K, QT, false, false,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<double, G, K, QT, false, false>));
      emit(Pass::kBackward, true, G, K, QT, true, false,
           reinterpret_cast<const void*>(&depth_attn_bwd_kernel<double, G, K, QT, true, false>));
    }
  });
  std::map<std::string, std::array<size_t, 2>> attention;
  try {
    attention = attention_shared_bytes();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "an attention launch plan failed: %s\n", e.what());
    return 1;
  }
  // Every attention kernel: the tensor-core kernels per 16-bit dtype and head-size bucket, the
  // SIMT kernels per fp32 / fp64, the row terms per dtype; each reached by its dtype's plans.
  // Attention lines carry the largest shared memory for sm_80 code, then for sm_90.
  size_t attention_kernels = 0;
  auto emit_attention = [&](const std::string& name) {
    const auto it = attention.find(name);
    if (it == attention.end()) {
      std::fprintf(stderr, "%s is instantiated but no launch plan chooses it\n", name.c_str());
      ++unreachable;
      return;
    }
    std::printf("%s\t%zu\t%zu\n", name.c_str(), it->second[0], it->second[1]);
    ++attention_kernels;
  };
  auto emit_mma = [&](auto s, int32_t dtype) {
    using S = decltype(s);
    for (int64_t dh = kMmaHeadBucket; dh <= kAttnMaxHeadDim; dh += kMmaHeadBucket) {
      with_head_bucket(dh, [&](auto head_dim) {
        constexpr int D = decltype(head_dim)::value;
        (void)&attn_fwd_mma_kernel<S, D>;
        (void)&attn_bwd_dkdv_mma_kernel<S, D>;
        (void)&attn_bwd_dq_mma_kernel<S, D>;
        for (const char* kernel : {"attn_fwd_mma_kernel", "attn_bwd_dkdv_mma_kernel", "attn_bwd_dq_mma_kernel"}) {
          emit_attention(attention_kernel_name(kernel, dtype, D));
        }
      });
    }
    (void)&attn_bwd_rows_kernel<S>;
    emit_attention(attention_kernel_name("attn_bwd_rows_kernel", dtype));
  };
  auto emit_simt = [&](auto s, int32_t dtype) {
    using S = decltype(s);
    (void)&attn_fwd_simt_kernel<S>;
    (void)&attn_bwd_rows_kernel<S>;
    (void)&attn_bwd_dkdv_simt_kernel<S>;
    (void)&attn_bwd_dq_simt_kernel<S>;
    for (const char* kernel :
         {"attn_fwd_simt_kernel", "attn_bwd_rows_kernel", "attn_bwd_dkdv_simt_kernel", "attn_bwd_dq_simt_kernel"}) {
      emit_attention(attention_kernel_name(kernel, dtype));
    }
  };
  emit_mma(Half{}, kFloat16);
  emit_mma(BFloat16{}, kBFloat16);
  emit_simt(float{}, kFloat32);
  emit_simt(double{}, kFloat64);
  // The Block step (block_step_kernels.cuh): one kernel per pass, accumulation type and tile.
  size_t step_kernels = 0;
  auto emit_step = [&](Pass pass, bool acc_double, int G, int K, const void* /*kernel*/) {
    const std::string name = std::string(pass == Pass::kForward ? "block_step_fwd_kernel" : "block_step_bwd_kernel") +
                             "<" + (acc_double ? "double" : "float") + ", " + std::to_string(G) + ", " +
                             std::to_string(K) + ">";
    const auto it = step_shared.find({static_cast<int>(pass), acc_double, G, K});
    if (it == step_shared.end()) {
      std::fprintf(stderr, "%s is instantiated but no launch plan chooses it\n", name.c_str());
      ++unreachable;
      return;
    }
    std::printf("%s\t%zu\n", name.c_str(), it->second);
    ++step_kernels;
  };
  for_each_value<4, 8>([&](auto G) {
    for_each_value<1, 2>([&](auto K) {
      if constexpr (step_tile_fits(Pass::kForward, false, G, K))
        emit_step(Pass::kForward, false, G, K, reinterpret_cast<const void*>(&block_step_fwd_kernel<float, G, K>));
      if constexpr (step_tile_fits(Pass::kForward, true, G, K))
        emit_step(Pass::kForward, true, G, K, reinterpret_cast<const void*>(&block_step_fwd_kernel<double, G, K>));
      if constexpr (step_tile_fits(Pass::kBackward, false, G, K))
        emit_step(Pass::kBackward, false, G, K, reinterpret_cast<const void*>(&block_step_bwd_kernel<float, G, K>));
      if constexpr (step_tile_fits(Pass::kBackward, true, G, K))
        emit_step(Pass::kBackward, true, G, K, reinterpret_cast<const void*>(&block_step_bwd_kernel<double, G, K>));
    });
  });
  std::printf("site_grads_kernel<float>\t0\n");
  std::printf("site_grads_kernel<double>\t0\n");
  (void)&site_grads_kernel<float>;
  (void)&site_grads_kernel<double>;
  return unreachable == 0 && kernels == shared.size() && step_kernels == step_shared.size() &&
                 attention_kernels == attention.size()
             ? 0
             : 1;
}
