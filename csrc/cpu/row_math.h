// Row arithmetic shared by the CPU kernels (depth read, Block step). Every
// kernel file is compiled with the same vector-ISA flags, so these inline
// templates match the file that includes them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace attnres {

#if defined(CPU_CAPABILITY_AVX512)
// Bit `bit` of register `reg` (0 = EAX, 1 = EBX, 2 = ECX, 3 = EDX) of CPUID leaf 7, sub-leaf
// `subleaf`, where the extensions below have their flags. (Read directly: __builtin_cpu_supports
// names AMX only from GCC 11 and Clang 16 on, and the AVX-512 state these need is the build's
// premise anyway.)
inline bool cpuid_leaf7_bit(unsigned subleaf, int reg, int bit) {
  unsigned regs[4] = {0, 0, 0, 0};
  if (__get_cpuid_count(7, subleaf, &regs[0], &regs[1], &regs[2], &regs[3]) == 0) return false;
  return ((regs[reg] >> bit) & 1u) != 0;
}

// Whether this CPU has AVX512-BF16 (vdpbf16ps; CPUID.(7,1):EAX[5]), asked once per process: the
// kernels that use it (the bf16 decode scores) are compiled for that target alone and called only
// when this is true. ATTNRES_CPU_AVX512_BF16=0 turns their use off (the tests run both paths on a
// machine that has it).
inline bool use_avx512_bf16() {
  static const bool use = [] {
    const char* env = std::getenv("ATTNRES_CPU_AVX512_BF16");
    return cpuid_leaf7_bit(1, 0, 5) && !(env != nullptr && std::string(env) == "0");
  }();
  return use;
}
#endif

// Makes this thread's non-temporal stores visible before the parallel region ends.
inline void fence_streaming_stores() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Each run of 2W values of u reordered as its even-indexed values, then its odd-indexed
// ones (kSplit), or back (!kSplit); the tail past the last full run as is. Split is the
// order in which the kernels load bf16 rows as two float vectors with two integer ops.
template <bool kSplit>
inline void reorder_even_odd(const float* u, int64_t n, float* out) {
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t W = fVec::size();
  int64_t d = 0;
  for (; d + 2 * W <= n; d += 2 * W) {
    const fVec a = fVec::loadu(u + d), b = fVec::loadu(u + d + W);
    auto [first, second] = kSplit ? at::vec::deinterleave2(a, b) : at::vec::interleave2(a, b);
    first.store(out + d);
    second.store(out + d + W);
  }
  std::copy(u + d, u + n, out + d);
}

inline void split_even_odd(const float* u, int64_t n, float* out) { reorder_even_odd<true>(u, n, out); }
inline void merge_even_odd(const float* split, int64_t n, float* out) { reorder_even_odd<false>(split, n, out); }

// <a, b> with four vector accumulators: each takes one multiply-add per step of 4 vectors, so the
// loop issues FMAs at the ports' rate instead of waiting on one accumulator's latency.
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec acc[4] = {Vec(T(0)), Vec(T(0)), Vec(T(0)), Vec(T(0))};
  int64_t d = 0;
  for (; d + 4 * W <= n; d += 4 * W) {
    for (int k = 0; k < 4; ++k) acc[k] = at::vec::fmadd(Vec::loadu(a + d + k * W), Vec::loadu(b + d + k * W), acc[k]);
  }
  for (; d + W <= n; d += W) acc[0] = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc[0]);
  T sum = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, (acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// dst += a * x * y and dst += a * x, accumulated in double: the row reductions
// sum thousands of terms, and double keeps their rounding far below a row's.
template <typename T>
inline void accumulate_product(double* dst, T a, const T* x, const T* y, int64_t n) {
  const double ad = static_cast<double>(a);
  for (int64_t d = 0; d < n; ++d) dst[d] += ad * static_cast<double>(x[d]) * static_cast<double>(y[d]);
}

template <typename T>
inline void accumulate_scaled(double* dst, T a, const T* x, int64_t n) {
  const double ad = static_cast<double>(a);
  for (int64_t d = 0; d < n; ++d) dst[d] += ad * static_cast<double>(x[d]);
}

// The row reductions (gradients of per-site parameters summed over rows) are deterministic in two
// stages: stage 1 writes one double partial per chunk of rows, a fixed partition that depends on the
// row count M only (never on the thread count); stage 2 (sum_chunks) sums the partials in chunk order.
inline int64_t rows_per_chunk(int64_t m) { return std::max<int64_t>(16, (m + 63) / 64); }

// out[j] = Σ_c parts[c * width + j] over the chunks c in order, for j < width (stage 2). Threads
// take blocks of columns; a block's sums are kept as a row of doubles and each chunk's partial is
// added to it as a row, so every add is a vector add over contiguous memory. (Walking down each
// column in turn made every sum a chain of dependent scalar adds over strided loads: 9 % of the
// 3-site bf16 backward with the output norm, N=9, 2048 rows, D=1024, one thread.) Each column's
// sum is the same chain of adds either way.
template <typename T>
void sum_chunks(const double* parts, int64_t num_chunks, int64_t width, T* out) {
  using dVec = at::vec::Vectorized<double>;
  constexpr int64_t kBlockColumns = 256;
  const int64_t num_blocks = (width + kBlockColumns - 1) / kBlockColumns;
  // A second thread only for at least 2^18 adds. (No chunks, no rows: the sums are 0.)
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, num_chunks * kBlockColumns));
  at::parallel_for(0, num_blocks, grain, [&](int64_t block_begin, int64_t block_end) {
    double sums[kBlockColumns];
    for (int64_t block = block_begin; block < block_end; ++block) {
      const int64_t first = block * kBlockColumns, n = std::min(kBlockColumns, width - first);
      std::fill(sums, sums + n, 0.0);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const double* partial = parts + c * width + first;
        int64_t j = 0;
        for (; j + dVec::size() <= n; j += dVec::size()) {
          (dVec::loadu(sums + j) + dVec::loadu(partial + j)).store(sums + j);
        }
        for (; j < n; ++j) sums[j] += partial[j];
      }
      for (int64_t j = 0; j < n; ++j) out[first + j] = static_cast<T>(sums[j]);
    }
  });
}

}  // namespace attnres
