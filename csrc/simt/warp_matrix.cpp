// The emulated fragment and asynchronous-copy instructions (warp_matrix.h).
#include "warp_matrix.h"

#include <cstring>
#include <utility>

namespace simt {

namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float bfloat16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element `half` (0: low 16 bits, 1: high) of a packed pair.
uint16_t element(uint32_t pair, int half) { return static_cast<uint16_t>(pair >> (16 * half)); }

struct LdmatrixIn {
  const void* row;
  unsigned count, trans;
};
struct Registers {
  uint32_t r[4];
};

struct MmaIn {
  uint32_t a[4], b[2];
  float c[4];
};
struct Accumulators {
  float d[4];
};

bool cp_async_eager = false;

void perform(const AsyncCopy& c) {
  if (c.src_bytes > 0) {
    std::memcpy(c.dst, c.src, c.src_bytes);
    note_read(c.src, c.src_bytes);
  }
  std::memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
}

}  // namespace

void ldmatrix(uint32_t* regs, unsigned count, bool trans, const void* row) {
  if (count != 1 && count != 2 && count != 4) fail("ldmatrix: .x1, .x2 or .x4");
  const auto out = warp_collective<Registers>("ldmatrix", LdmatrixIn{row, count, trans}, [](const auto* in, auto* out) {
    const unsigned n = in[0].count;
    const bool t = in[0].trans != 0;
    for (unsigned lane = 0; lane < kWarpSize; ++lane) {
      if (in[lane].count != n || (in[lane].trans != 0) != t) fail("ldmatrix: the lanes disagree on the shape");
    }
    for (unsigned lane = 0; lane < 8 * n; ++lane) {
      if (!in_shared(in[lane].row, 16) || reinterpret_cast<uintptr_t>(in[lane].row) % 16 != 0) {
        fail("ldmatrix: a row address outside the dynamic shared memory or not 16-byte aligned");
      }
    }
    for (unsigned lane = 0; lane < kWarpSize; ++lane) {
      for (unsigned i = 0; i < n; ++i) {
        uint16_t pair[2];
        for (int e = 0; e < 2; ++e) {
          // Non-transposed: row lane / 4, column 2 (lane % 4) + e; transposed: the reverse.
          const unsigned r = t ? 2 * (lane % 4) + e : lane / 4, c = t ? lane / 4 : 2 * (lane % 4) + e;
          std::memcpy(&pair[e], static_cast<const unsigned char*>(in[8 * i + r].row) + 2 * c, 2);
        }
        out[lane].r[i] = uint32_t(pair[0]) | uint32_t(pair[1]) << 16;
      }
    }
  });
  for (unsigned i = 0; i < count; ++i) regs[i] = out.r[i];
}

void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, const float* c, bool bf16) {
  MmaIn in;
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  std::memcpy(in.c, c, sizeof(in.c));
  const auto out = warp_collective<Accumulators>(
      bf16 ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", in, [bf16](const auto* in, auto* out) {
        auto widen = [bf16](uint16_t x) { return bf16 ? bfloat16_to_float(x) : half_to_float(x); };
        float A[16][16], B[16][8];
        for (unsigned lane = 0; lane < kWarpSize; ++lane) {
          const unsigned g = lane / 4, t = lane % 4;
          for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = widen(element(in[lane].a[0], e));
            A[g + 8][2 * t + e] = widen(element(in[lane].a[1], e));
            A[g][2 * t + 8 + e] = widen(element(in[lane].a[2], e));
            A[g + 8][2 * t + 8 + e] = widen(element(in[lane].a[3], e));
            B[2 * t + e][g] = widen(element(in[lane].b[0], e));
            B[2 * t + 8 + e][g] = widen(element(in[lane].b[1], e));
          }
        }
        for (unsigned lane = 0; lane < kWarpSize; ++lane) {
          const unsigned g = lane / 4, t = lane % 4;
          for (int i = 0; i < 4; ++i) {
            const unsigned row = g + 8 * (i / 2), col = 2 * t + i % 2;
            float sum = in[lane].c[i];
            for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
            out[lane].d[i] = sum;
          }
        }
      });
  std::memcpy(d, out.d, sizeof(out.d));
}

void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
  if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes > bytes) fail("cp.async: 4, 8 or 16 bytes");
  if (!in_shared(dst, bytes) || reinterpret_cast<uintptr_t>(dst) % bytes != 0) {
    fail("cp.async: a destination outside the dynamic shared memory or not aligned to the copy size");
  }
  if (reinterpret_cast<uintptr_t>(src) % bytes != 0) fail("cp.async: a source not aligned to the copy size");
  const AsyncCopy copy{dst, src, bytes, src_bytes};
  if (cp_async_eager) {
    perform(copy);
  } else {
    this_fiber().async_open.push_back(copy);
  }
}

bool set_cp_async_eager(bool eager) {
  const bool previous = cp_async_eager;
  cp_async_eager = eager;
  return previous;
}

void cp_async_commit() {
  Fiber& f = this_fiber();
  f.async_groups.push_back(std::move(f.async_open));
  f.async_open.clear();
}

void cp_async_wait(unsigned pending_groups) {
  Fiber& f = this_fiber();
  while (f.async_groups.size() > pending_groups) {
    for (const AsyncCopy& c : f.async_groups.front()) perform(c);
    f.async_groups.erase(f.async_groups.begin());
  }
}

}  // namespace simt
