// A CPU SIMT harness: runs CUDA device code, written against the small set of
// primitives below, with the host C++ compiler (DESIGN.md §4).
//
// Mapping. A launch runs its blocks one after another on the calling thread.
// Every CUDA thread of a block is a fiber (its own stack, switched in user
// space: no OS threads, no locks, a deterministic schedule). A fiber runs until
// it reaches a barrier, then yields; the scheduler resumes the fibers round-robin
// until every fiber of the block has finished. Primitives:
//
//   threadIdx, blockIdx, blockDim, gridDim     per-fiber / per-block values
//   __syncthreads()                            block barrier (every thread must arrive:
//                                              a thread that exits first is a deadlock, reported)
//   __syncwarp(), __shfl_xor_sync, __shfl_sync warp barrier + a per-warp exchange buffer
//                                              (full-warp masks only, as the kernels use)
//   simt::dynamic_shared<T>()                  the launch's dynamic shared memory, filled with
//                                              0xFF bytes (NaN) at every block start so that a
//                                              read before a write shows up in the results
//   simt::note_read / note_write               global-memory traffic, counted per launch and per
//                                              tracked buffer (see simt::track)
//   simt::launch(name, kernel, grid, block, smem, args...)   kernel<<<grid, block, smem>>>(args...)
//
// `__shared__` is deliberately not provided: kernels use dynamic shared memory
// only, which the harness can poison.
//
// Tensor-core fragments and asynchronous copies: csrc/simt/warp_matrix.h emulates
// the PTX instructions of csrc/cuda/mma_primitives.cuh (mma.sync m16n8k16,
// ldmatrix, cp.async with its commit / wait groups) per lane, with the fragment
// layouts of the PTX ISA, on top of warp_collective() and the per-thread copy
// queue below.
//
// Counting. simt::track(group, ptr, bytes) names a buffer before a launch; every
// global access a kernel makes through the device memory layer
// (csrc/cuda/device_memory.cuh) is added to the group whose buffer contains it,
// or to "untracked". Loads that every thread of a warp makes from one address
// (simt::note_read_uniform) count once per warp, as the GPU serves them with one
// request. Each launch appends a LaunchRecord to a process-wide log.
//
// Adding a kernel family: write its device code against these primitives in a
// torch-free header under csrc/cuda/, launch it through a Runtime (see
// csrc/cuda/runtime.h), and register its ops in csrc/simt/emulated_ops.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};

struct uint2 {
  unsigned x, y;
};

struct uint4 {
  unsigned x, y, z, w;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace simt {

constexpr unsigned kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Traffic of one group of buffers in one launch, in bytes.
struct Traffic {
  uint64_t read = 0;
  uint64_t written = 0;
};

struct LaunchRecord {
  std::string kernel;
  dim3 grid, block;
  size_t dynamic_smem = 0;
  std::map<std::string, Traffic> traffic;  // by group name; "untracked" for any other address
};

// Names [ptr, ptr + bytes) as part of `group` for the launches that follow on
// this thread, until clear_tracking(). Overlapping buffers count toward the
// group registered first.
void track(const std::string& group, const void* ptr, size_t bytes);
void clear_tracking();

// Returns the records of every launch since the last call and clears the log.
std::vector<LaunchRecord> take_launch_log();

// ------------------------------------------------------------------ runtime state

// One cp.async of a thread: `bytes` to shared memory at `dst`, the first `src_bytes`
// of them from global memory at `src`, the rest zero.
struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes, src_bytes;
};

struct Fiber {
  uint3 thread_idx;
  unsigned lane = 0, warp = 0;
  unsigned shuffle_parity = 0;
  bool done = false;
  void* stack = nullptr;
  void* context = nullptr;  // the saved stack pointer (x86-64) or a ucontext_t*
  // cp.async: the copies issued since the last commit, and the committed groups, oldest
  // first, until a wait retires them (warp_matrix.h: when the copies land).
  std::vector<AsyncCopy> async_open;
  std::vector<std::vector<AsyncCopy>> async_groups;
};

struct Barrier {
  unsigned expected = 0, arrived = 0;
  uint64_t generation = 0;
};

// The operands of a warp-collective instruction (warp_collective): what each lane
// passed, and what each lane gets back. Double-buffered like the shuffle exchange.
constexpr size_t kCollectiveInBytes = 48, kCollectiveOutBytes = 16;
struct CollectiveSlot {
  alignas(16) unsigned char in[kWarpSize][kCollectiveInBytes];
  alignas(16) unsigned char out[kWarpSize][kCollectiveOutBytes];
  const char* op[kWarpSize];
  unsigned arrived = 0;
};

struct Warp {
  Barrier barrier;
  uint64_t exchange[2][kWarpSize];  // double-buffered: one barrier per shuffle
  CollectiveSlot collective[2];
};

struct Block {
  uint3 block_idx;
  dim3 block_dim, grid_dim;
  Barrier barrier;
  std::vector<Warp> warps;
  unsigned char* shared = nullptr;
  size_t shared_bytes = 0;
  uint64_t progress = 0;  // barrier arrivals and thread exits: the scheduler's deadlock detector
};

// The buffers named by track() and the traffic of the launch in progress.
struct Tracking {
  struct Range {
    uintptr_t begin, end;
    size_t group;
  };
  std::vector<Range> ranges;
  std::vector<std::string> groups;
  std::vector<Traffic> traffic;  // per group, then one entry for untracked addresses
};

inline thread_local Fiber* current_fiber = nullptr;
inline thread_local Block* current_block = nullptr;
inline thread_local Tracking tracking;

inline Fiber& this_fiber() { return *current_fiber; }
inline Block& this_block() { return *current_block; }

void yield();

inline void arrive_and_wait(Barrier& b) {
  const uint64_t generation = b.generation;
  ++current_block->progress;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == generation) yield();
}

inline Traffic& traffic_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto& r : tracking.ranges)
    if (a >= r.begin && a < r.end) return tracking.traffic[r.group];
  return tracking.traffic.back();
}

inline void note_read(const void* p, size_t bytes) { traffic_of(p).read += bytes; }
inline void note_write(const void* p, size_t bytes) { traffic_of(p).written += bytes; }

// A load every lane of the warp makes from the same address: one request per warp.
inline void note_read_uniform(const void* p, size_t bytes) {
  if (current_fiber->lane == 0) note_read(p, bytes);
}

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(this_block().shared);
}

// Aborts with `what` (misuse of a primitive the GPU would not report either).
[[noreturn]] void fail(const char* what);

// Whether [p, p + bytes) lies in the launch's dynamic shared memory.
inline bool in_shared(const void* p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(this_block().shared);
  return a >= base && a + bytes <= base + this_block().shared_bytes;
}

// Runs `body` once per thread of every block of `grid`; records the launch.
void run_grid(const char* name, dim3 grid, dim3 block, size_t dynamic_smem, void (*body)(void*), void* arg);

template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t dynamic_smem, Args&&... args) {
  // Every thread gets its own copy of the arguments, as kernel parameters are per thread.
  struct Call {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> args;
  } call{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  run_grid(
      name, grid, block, dynamic_smem,
      [](void* p) {
        auto* c = static_cast<Call*>(p);
        auto args = c->args;
        std::apply(c->kernel, args);
      },
      &call);
}

// ------------------------------------------------------------------ warp primitives

void check_full_mask(unsigned mask, int width);

inline void syncwarp() { arrive_and_wait(this_block().warps[this_fiber().warp].barrier); }

template <typename T>
T shuffle(T value, unsigned source_lane_xor, bool use_xor) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>, "shuffle of a wider type");
  Fiber& f = this_fiber();
  Warp& w = this_block().warps[f.warp];
  const unsigned slot = f.shuffle_parity;
  f.shuffle_parity ^= 1u;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  w.exchange[slot][f.lane] = bits;
  arrive_and_wait(w.barrier);
  const unsigned src = (use_xor ? (f.lane ^ source_lane_xor) : source_lane_xor) % kWarpSize;
  T out;
  std::memcpy(&out, &w.exchange[slot][src], sizeof(T));
  return out;
}

// A warp-collective instruction `op`: every lane of the warp passes `in`; once the
// whole warp has arrived, the last lane to arrive runs `compute(in_of_lane, out_of_lane)`
// over all 32 lanes (before any lane resumes), and every lane returns its own `out`.
// Lanes at different instructions (another `op`) are reported; a lane that never
// arrives deadlocks the block, as on the GPU.
template <typename Out, typename In, typename F>
Out warp_collective(const char* op, const In& in, F&& compute) {
  static_assert(sizeof(In) <= kCollectiveInBytes && sizeof(Out) <= kCollectiveOutBytes);
  static_assert(std::is_trivially_copyable_v<In> && std::is_trivially_copyable_v<Out>);
  Fiber& f = this_fiber();
  Warp& w = this_block().warps[f.warp];
  CollectiveSlot& slot = w.collective[f.shuffle_parity];
  f.shuffle_parity ^= 1u;
  std::memcpy(slot.in[f.lane], &in, sizeof(In));
  slot.op[f.lane] = op;
  if (++slot.arrived == w.barrier.expected) {
    slot.arrived = 0;
    if (w.barrier.expected != kWarpSize) fail("a warp-collective instruction in a partial warp");
    for (unsigned lane = 0; lane < kWarpSize; ++lane) {
      if (std::strcmp(slot.op[lane], op) != 0)
        fail("the lanes of a warp are at different warp-collective instructions");
    }
    In all_in[kWarpSize];
    Out all_out[kWarpSize];
    for (unsigned lane = 0; lane < kWarpSize; ++lane) std::memcpy(&all_in[lane], slot.in[lane], sizeof(In));
    compute(all_in, all_out);
    for (unsigned lane = 0; lane < kWarpSize; ++lane) std::memcpy(slot.out[lane], &all_out[lane], sizeof(Out));
  }
  arrive_and_wait(w.barrier);
  Out out;
  std::memcpy(&out, slot.out[f.lane], sizeof(Out));
  return out;
}

}  // namespace simt

// ------------------------------------------------------------------ CUDA names

#define threadIdx (::simt::this_fiber().thread_idx)
#define blockIdx (::simt::this_block().block_idx)
#define blockDim (::simt::this_block().block_dim)
#define gridDim (::simt::this_block().grid_dim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

inline void __syncthreads() { ::simt::arrive_and_wait(::simt::this_block().barrier); }
inline void __syncwarp(unsigned mask = ::simt::kFullMask) {
  ::simt::check_full_mask(mask, 32);
  ::simt::syncwarp();
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  ::simt::check_full_mask(mask, width);
  return ::simt::shuffle(value, static_cast<unsigned>(lane_mask), true);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32) {
  ::simt::check_full_mask(mask, width);
  return ::simt::shuffle(value, static_cast<unsigned>(source_lane), false);
}
