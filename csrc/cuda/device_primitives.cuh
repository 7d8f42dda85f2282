// The primitives the CUDA kernels are written against, for both compilers
// (DESIGN.md §4): nvcc maps them to CUDA, the host compiler to the SIMT harness
// (csrc/simt/simt.h), which also counts every global-memory access.
//
//   load_global(p)      a read-only global load (`__ldg`); 1, 2, 4, 8, 16 or 32 bytes
//   load_uniform(p)     a load every lane of a warp makes from the same address
//                       (one request per warp: the harness counts it once per warp)
//   store_global(p, v)  a global store
//   dynamic_shared<T>() the launch's dynamic shared memory (32-byte aligned: WMMA operands)
//   Half / BFloat16     16-bit storage types; to_acc / from_acc convert with
//                       round-to-nearest-even, directly from double for fp64 math
//   dev_sqrt, dev_exp, dev_log, dev_isnan   float and double overloads
//   __grid_constant__   a `const` kernel parameter read in place (indexed tables in the parameters)
//
// No torch here: these headers also compile into the harness build and the
// ahead-of-time check (python -m attnres_kernels.check).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#include <cmath>

#include "../simt/simt.h"
// A kernel parameter read in place from the parameter space (nvcc: no copy to local
// memory when the kernel indexes into it); the harness passes every parameter by value.
#define __grid_constant__
#endif

namespace attnres::cuda {

constexpr int kWarpSize = 32;

// Dtype codes of the source tables (the branch on them is uniform across a block).
enum DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

__host__ __device__ constexpr int dtype_size(int32_t dtype) {
  return dtype == kFloat64 ? 8 : dtype == kFloat32 ? 4 : 2;
}

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// Unsigned integer of N bytes, the unit of a vector load.
template <int N>
struct Bits;
template <>
struct Bits<1> {
  using type = unsigned char;
};
template <>
struct Bits<2> {
  using type = unsigned short;
};
template <>
struct Bits<4> {
  using type = unsigned int;
};
template <>
struct Bits<8> {
  using type = uint2;
};
template <>
struct Bits<16> {
  using type = uint4;
};

// ------------------------------------------------------------------ global memory

template <int N>
__device__ __forceinline__ typename Bits<N>::type load_bits(const void* p) {
  using B = typename Bits<N>::type;
#if defined(__CUDACC__)
  return __ldg(static_cast<const B*>(p));
#else
  B b;
  std::memcpy(&b, p, N);
  return b;
#endif
}

template <typename T>
__device__ __forceinline__ T load_global(const T* p) {
  static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) <= 16 || sizeof(T) % 16 == 0));
  T value;
  if constexpr (sizeof(T) <= 16) {
    auto b = load_bits<sizeof(T)>(p);
    std::memcpy(&value, &b, sizeof(T));
  } else {
    for (size_t off = 0; off < sizeof(T); off += 16) {
      auto b = load_bits<16>(reinterpret_cast<const char*>(p) + off);
      std::memcpy(reinterpret_cast<char*>(&value) + off, &b, 16);
    }
  }
#if !defined(__CUDACC__)
  simt::note_read(p, sizeof(T));
#endif
  return value;
}

template <typename T>
__device__ __forceinline__ T load_uniform(const T* p) {
#if defined(__CUDACC__)
  return load_global(p);
#else
  T value;
  std::memcpy(&value, p, sizeof(T));
  simt::note_read_uniform(p, sizeof(T));
  return value;
#endif
}

template <typename T>
__device__ __forceinline__ void store_global(T* p, const T& value) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16);
#if defined(__CUDACC__)
  *p = value;
#else
  std::memcpy(static_cast<void*>(p), &value, sizeof(T));
  simt::note_write(p, sizeof(T));
#endif
}

// ------------------------------------------------------------------ shared memory

template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#if defined(__CUDACC__)
  extern __shared__ __align__(32) unsigned char attnres_dynamic_shared[];
  return reinterpret_cast<T*>(attnres_dynamic_shared);
#else
  return simt::dynamic_shared<T>();
#endif
}

// ------------------------------------------------------------------ math

template <typename T>
__host__ __device__ constexpr T imin(T a, T b) {
  return a < b ? a : b;
}

__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }
#if defined(__CUDACC__)
__device__ __forceinline__ bool dev_isnan(float x) { return isnan(x); }
__device__ __forceinline__ bool dev_isnan(double x) { return isnan(x); }
#else
inline bool dev_isnan(float x) { return std::isnan(x); }
inline bool dev_isnan(double x) { return std::isnan(x); }
#endif

template <typename T>
__host__ __device__ constexpr T neg_infinity() {
  if constexpr (std::is_same_v<T, float>) {
    return -__builtin_huge_valf();
  } else {
    return -__builtin_huge_val();
  }
}

// ------------------------------------------------------------------ 16-bit conversions

#if !defined(__CUDACC__)
// Round-to-nearest-even of a finite or infinite double to a binary floating
// format with MAN mantissa bits and exponent bias BIAS (fp16: 10, 15; bf16: 7, 127).
// Every step is exact in double, so converting a float first widens it exactly.
template <int MAN, int BIAS, int EXP_BITS>
inline uint16_t round_to_bits(double x) {
  const uint16_t sign = std::signbit(x) ? uint16_t(1u << (MAN + EXP_BITS)) : uint16_t(0);
  const uint16_t inf = uint16_t(((1u << EXP_BITS) - 1) << MAN);
  if (std::isnan(x)) return uint16_t(sign | inf | (1u << (MAN - 1)));
  const double a = std::fabs(x);
  constexpr int emin = 1 - BIAS;
  if (a < std::ldexp(1.0, emin)) {  // subnormal (or rounds up to the smallest normal)
    return uint16_t(sign | uint16_t(std::nearbyint(std::ldexp(a, MAN - emin))));
  }
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  --e;                // a = m * 2^e, m in [1, 2)
  double m = std::nearbyint(std::ldexp(a, MAN - e));
  if (m == std::ldexp(1.0, MAN + 1)) {
    m = std::ldexp(1.0, MAN);
    ++e;
  }
  if (e + BIAS >= (1 << EXP_BITS) - 1 || std::isinf(a)) return uint16_t(sign | inf);
  return uint16_t(sign | uint16_t((e + BIAS) << MAN) | (uint16_t(m) - uint16_t(1u << MAN)));
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#endif

__device__ __forceinline__ float to_float(Half h) {
#if defined(__CUDACC__)
  return __half2float(__ushort_as_half(h.bits));
#else
  return half_bits_to_float(h.bits);
#endif
}

__device__ __forceinline__ float to_float(BFloat16 b) {
  const uint32_t bits = uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Storage value -> accumulation type (exact).
template <typename acc_t, typename S>
__device__ __forceinline__ acc_t to_acc(S x) {
  if constexpr (std::is_same_v<S, Half> || std::is_same_v<S, BFloat16>) {
    return static_cast<acc_t>(to_float(x));
  } else {
    return static_cast<acc_t>(x);
  }
}

// Accumulation type -> storage value, rounded to nearest even.
template <typename S, typename acc_t>
__device__ __forceinline__ S from_acc(acc_t x) {
  if constexpr (std::is_same_v<S, Half>) {
#if defined(__CUDACC__)
    if constexpr (std::is_same_v<acc_t, double>) {
      return Half{__half_as_ushort(__double2half(x))};
    } else {
      return Half{__half_as_ushort(__float2half_rn(x))};
    }
#else
    return Half{round_to_bits<10, 15, 5>(static_cast<double>(x))};
#endif
  } else if constexpr (std::is_same_v<S, BFloat16>) {
#if defined(__CUDACC__)
    if constexpr (std::is_same_v<acc_t, double>) {
      return BFloat16{__bfloat16_as_ushort(__double2bfloat16(x))};
    } else {
      return BFloat16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
    }
#else
    return BFloat16{round_to_bits<7, 127, 8>(static_cast<double>(x))};
#endif
  } else {
    return static_cast<S>(x);
  }
}

}  // namespace attnres::cuda
