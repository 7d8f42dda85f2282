// The nvcuda::wmma API (warp matrix multiply-accumulate, m16n16k16) for the
// SIMT harness (simt.h): what the CUDA kernels use of <mma.h>, run on CPU.
//
//   fragment<matrix_a | matrix_b, 16, 16, 16, __half | __nv_bfloat16, row_major | col_major>
//   fragment<accumulator, 16, 16, 16, float>
//   load_matrix_sync(frag, ptr, ldm[, mem_row_major | mem_col_major])
//   store_matrix_sync(ptr, frag, ldm, mem_row_major | mem_col_major)
//   fill_fragment(frag, value)
//   mma_sync(d, a, b, c)        d = a · b + c, products exact, sums in fp32 in k order
//
// Warp-collective like the real API: load, store and mma are a warp barrier, so
// a lane that does not call them deadlocks the block (the scheduler reports it),
// and every lane must pass the same pointer, ldm and layout (anything else is
// reported and aborts, like the harness's other misuse checks). Pointers must be
// 32-byte aligned (relative to the dynamic shared memory for addresses in it)
// and ldm a multiple of 16 bytes, as CUDA requires.
//
// The element layout of a fragment is unspecified in CUDA; here every lane holds
// the whole 16 x 16 tile, and element access (x[], num_elements) is deliberately
// not provided: kernels must move data through load/store only. The product of
// an mma is computed once per warp (by lane 0, into a per-warp slot) and copied
// by every lane.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "simt.h"

// 16-bit storage types of the CUDA headers (cuda_fp16.h, cuda_bf16.h) as far as WMMA operands need them.
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

constexpr int kTile = 16;

inline float to_float(__half h) {
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16, exponent = (h.bits >> 10) & 0x1fu, mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float to_float(__nv_bfloat16 b) {
  const uint32_t bits = uint32_t(b.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float to_float(float x) { return x; }

[[noreturn]] inline void misuse(const char* what) {
  std::fprintf(stderr, "simt: wmma misuse: %s\n", what);
  std::abort();
}

// One call of a warp-collective function by one lane: what it passed.
struct Call {
  const void* ptr;
  unsigned ldm;
  int layout;
  bool operator!=(const Call& o) const { return ptr != o.ptr || ldm != o.ldm || layout != o.layout; }
};

// Per warp, double-buffered like the shuffle exchange: every collective is one
// warp barrier (a shuffle), so consecutive collectives alternate between the two
// slots and a slot is rewritten only after every lane has read it.
struct WarpSlots {
  Call calls[2][simt::kWarpSize];
  float product[2][kTile * kTile];
};
inline thread_local WarpSlots warp_slots[1024 / simt::kWarpSize];

// Records this lane's arguments, waits for the whole warp and checks that every
// lane passed the same ones. Returns the slot of this collective.
inline unsigned collective(const Call& call, const char* what) {
  const simt::Fiber& f = simt::this_fiber();
  const unsigned slot = f.shuffle_parity;
  WarpSlots& w = warp_slots[f.warp];
  w.calls[slot][f.lane] = call;
  (void)simt::shuffle(0, 0, false);  // the warp barrier
  if (call != w.calls[slot][0]) misuse(what);
  return slot;
}

inline void check_operand(const void* ptr, unsigned ldm, size_t element_size, const char* what) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  const auto shared = reinterpret_cast<uintptr_t>(simt::this_block().shared);
  if (address % 32 != 0 && (address - shared) % 32 != 0) misuse(what);
  if ((ldm * element_size) % 16 != 0) misuse(what);
}

}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 is emulated");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                "emulated fragments: fp16/bf16 operands, fp32 accumulators");

 public:
  // The whole tile, row-major, as float (fp16/bf16 widen exactly). Not part of the API.
  float tile_[detail::kTile * detail::kTile];
};

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float value) {
  for (float& x : f.tile_) x = value;
}

// Operand tiles: matrix_a / matrix_b in the fragment's own layout.
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load needs a layout_t");
  constexpr bool kColMajor = std::is_same_v<Layout, col_major>;
  detail::check_operand(ptr, ldm, sizeof(T), "load_matrix_sync: pointer not 32-byte aligned or ldm not 16 bytes");
  detail::collective({ptr, ldm, kColMajor}, "load_matrix_sync: the lanes passed different pointers or ldm");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.tile_[r * 16 + c] = detail::to_float(kColMajor ? ptr[c * ldm + r] : ptr[r * ldm + c]);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* ptr, unsigned ldm,
                             layout_t layout) {
  detail::check_operand(ptr, ldm, sizeof(float), "load_matrix_sync: pointer not 32-byte aligned or ldm not 16 bytes");
  detail::collective({ptr, ldm, layout}, "load_matrix_sync: the lanes passed different pointers, ldm or layouts");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.tile_[r * 16 + c] = layout == mem_col_major ? ptr[c * ldm + r] : ptr[r * ldm + c];
}

inline void store_matrix_sync(float* ptr, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  detail::check_operand(ptr, ldm, sizeof(float), "store_matrix_sync: pointer not 32-byte aligned or ldm not 16 bytes");
  detail::collective({ptr, ldm, layout}, "store_matrix_sync: the lanes passed different pointers, ldm or layouts");
  if (simt::this_fiber().lane != 0) return;  // the tile is the same in every lane
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) (layout == mem_col_major ? ptr[c * ldm + r] : ptr[r * ldm + c]) = f.tile_[r * 16 + c];
}

template <typename T, typename LayoutA, typename LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  const simt::Fiber& f = simt::this_fiber();
  detail::WarpSlots& w = detail::warp_slots[f.warp];
  const unsigned slot = f.shuffle_parity;
  if (f.lane == 0) {
    float* out = w.product[slot];
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float sum = c.tile_[m * 16 + n];
        for (int k = 0; k < 16; ++k) sum += a.tile_[m * 16 + k] * b.tile_[k * 16 + n];
        out[m * 16 + n] = sum;
      }
  }
  detail::collective({nullptr, 0, 0}, "mma_sync");  // every lane waits for lane 0's product
  std::memcpy(d.tile_, w.product[slot], sizeof(d.tile_));
}

}  // namespace nvcuda::wmma
