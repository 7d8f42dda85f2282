// Warp-level tensor-core primitives of the CUDA kernels, for both compilers
// (docs/design.md §4): nvcc maps them to PTX (sm_80+), the host compiler to the
// SIMT harness's per-lane emulation (csrc/simt/warp_matrix.h, which documents the
// fragment layouts).
//
//   ldmatrix<N, kTrans>(regs, row)   ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16
//   mma_m16n8k16<S>(d, a, b0, b1)    d += a · b on the tensor cores, fp16 / bf16 operands, fp32 d
//   cp_async<N>(dst, src, valid)     an N-byte (4, 8, 16) global -> shared copy, zero-filled when
//                                    !valid; cp_async_commit() and cp_async_wait<G>() group them
//   pack_pair<S>(lo, hi)             two fp32 values rounded to S, as one 32-bit operand register
//   SwizzledRows<kElems>             the shared-memory layout of [rows, kElems] 16-bit operand tiles
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device_primitives.cuh"

#if !defined(__CUDACC__)
#include "../simt/warp_matrix.h"
#endif

namespace attnres::cuda {

// ------------------------------------------------------------------ fragments

template <int kCount, bool kTrans>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[kCount], const void* row) {
  static_assert(kCount == 1 || kCount == 2 || kCount == 4);
#if defined(__CUDACC__)
  const auto a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kCount == 4 && kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  } else if constexpr (kCount == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  } else if constexpr (kCount == 2 && kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a)
                 : "memory");
  } else if constexpr (kCount == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a)
                 : "memory");
  } else if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a) : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a) : "memory");
  }
#else
  simt::ldmatrix(r, kCount, kTrans, row);
#endif
}

// d += a · b: A [16, 16] row-major fragment, B [16, 8] column fragment (b0: k 0-7, b1: k 8-15), fp32 d.
template <typename S>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>);
#if defined(__CUDACC__)
  if constexpr (std::is_same_v<S, Half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  const uint32_t b[2] = {b0, b1};
  simt::mma_m16n8k16(d, a, b, d, std::is_same_v<S, BFloat16>);
#endif
}

// lo in the low 16 bits, hi in the high, each rounded to nearest even.
template <typename S>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if defined(__CUDACC__)
  uint32_t bits;
  if constexpr (std::is_same_v<S, Half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    std::memcpy(&bits, &v, 4);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    std::memcpy(&bits, &v, 4);
  }
  return bits;
#else
  return uint32_t(from_acc<S>(lo).bits) | uint32_t(from_acc<S>(hi).bits) << 16;
#endif
}

// ------------------------------------------------------------------ asynchronous copies

template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16);
#if defined(__CUDACC__)
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int n = valid ? kBytes : 0;
  if constexpr (kBytes == 16) {  // .cg: through L2 only, the operand tiles are read once per block
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(src), "n"(kBytes), "r"(n) : "memory");
  }
#else
  simt::cp_async(dst, src, kBytes, valid ? kBytes : 0);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDACC__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  simt::cp_async_commit();
#endif
}

// Waits until at most kPending of this thread's committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDACC__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#else
  simt::cp_async_wait(kPending);
#endif
}

// ------------------------------------------------------------------ operand tiles in shared memory

// [rows, kElems] tiles of 16-bit elements, each row kElems / 8 chunks of 16 bytes
// with no padding; chunk c of row r sits at chunk c ^ mask(r) of its row, so that
// the eight rows of one 8 x 8 matrix an ldmatrix reads (and the chunks a warp's
// 16-byte copies write) fall into eight different 16-byte bank groups. Rows of a
// multiple of 8 chunks start in the same bank: the mask is r mod 8; rows of 4 mod 8
// chunks alternate between two: the mask is (r / 2) mod 4 on the chunk's low two bits.
// (conflict_free() checks it; the kernels assert it for every row width they use.)
template <int kElems>
struct SwizzledRows {
  static constexpr int kChunks = kElems / 8;
  static_assert(kElems % 32 == 0, "rows of a multiple of 4 chunks");

  __host__ __device__ static constexpr int mask(int r) { return kChunks % 8 == 0 ? r & 7 : (r >> 1) & 3; }
  // Element offset of chunk c of row r.
  __host__ __device__ static constexpr int offset(int r, int c) { return r * kElems + (c ^ mask(r)) * 8; }

  // The eight rows r0 .. r0 + 7 (r0 a multiple of 8) at chunk c: distinct bank groups, within the row.
  static constexpr bool conflict_free() {
    for (int c = 0; c < kChunks; ++c) {
      bool seen[8] = {};
      for (int r = 0; r < 8; ++r) {
        const int chunk = offset(r, c) / 8;
        if ((c ^ mask(r)) >= kChunks || seen[chunk % 8]) return false;
        seen[chunk % 8] = true;
      }
    }
    return true;
  }
};

}  // namespace attnres::cuda
