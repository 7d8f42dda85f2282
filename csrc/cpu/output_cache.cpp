// A cache of large CPU buffers for the outputs of the native ops (empty_output
// in depth_attention.h).
//
// Why: glibc serves a large allocation (above its mmap threshold, at most
// 32 MiB) with a fresh mmap, and every page of it faults on first touch while
// the kernel zeroes it. For a depth read whose output is 32 MiB that costs as
// much as reading the sources, and it varies from call to call. The outputs of
// one training step are freed within that step's backward or the next step, so
// handing a freed buffer to the next output of (about) the same size removes
// those faults after the first step. Transparent huge pages would make each
// fault cheaper, but with THP "enabled=madvise, defrag=madvise" a
// madvise(MADV_HUGEPAGE) region compacts memory synchronously on its first
// fault, which stalled single calls by up to 0.7 s.
//
// Each buffer starts on a page boundary (it is allocated a page longer). The
// backward writes its N source gradients row by row with non-temporal stores,
// one line of each in turn; with gradients at one page offset it ran 5-12 %
// faster than with offsets 128 bytes apart, which is what glibc's heap hands
// out for a run of allocations of one size after its dynamic mmap threshold
// has grown (N=9, 8192 rows, D=1024, bf16, 2 threads; the offsets of the
// sources mattered less). Page-aligned outputs keep that rate whatever the
// process allocated before.
//
// Buffers smaller than kMinBytes come from the default CPU allocator (glibc
// reuses those from its heap). Free buffers are kept up to a limit: the
// environment variable ATTNRES_CPU_CACHE_MB when set (0 keeps none: every
// buffer is freed when its tensor is, still page-aligned while it lived), else
// 1/8 of the physical memory. A freed buffer that does not fit under the limit
// displaces the buffers freed longest ago: the cache follows the shapes the
// program uses now. (Kept out instead, it left a cache filled by earlier shapes
// holding them for good while every output of the new ones faulted its pages
// again: in benchmarks/sweep.py, after the large cases, the fp32 N=33 backward
// ran at 34-43 % of a copy against 107-133 % in a fresh process.)
// attnres::empty_cpu_cache() frees them; attnres::cpu_cache_stats() counts them.
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "../depth_attention.h"

namespace attnres {
namespace {

constexpr size_t kMinBytes = size_t(1) << 20;
constexpr size_t kPageBytes = 4096;

size_t limit_from_env() {
  if (const char* mb = std::getenv("ATTNRES_CPU_CACHE_MB"))
    return static_cast<size_t>(std::strtoull(mb, nullptr, 10)) << 20;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) / 8 : size_t(1) << 30;
}

struct Block {
  void* allocation;  // from c10::alloc_cpu: size + kPageBytes bytes
  void* ptr;         // the buffer: the first page boundary in the allocation
  size_t size;
  uint64_t freed_at = 0;  // when it was last freed (OutputCache::releases_), while it is free
};

class OutputCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinBytes) return c10::GetDefaultCPUAllocator()->allocate(nbytes);
    const size_t size = (nbytes + kPageBytes - 1) / kPageBytes * kPageBytes;
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // The smallest free buffer that fits, if it wastes at most 1/8 of itself.
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first - size <= it->first / 8) {
        block = it->second;
        free_.erase(it);
        by_age_.erase(block->freed_at);
        cached_ -= block->size;
      }
      in_use_ += block != nullptr ? block->size : size;
    }
    if (block == nullptr) {
      void* allocation = c10::alloc_cpu(size + kPageBytes);
      const uintptr_t page_start = (reinterpret_cast<uintptr_t>(allocation) + kPageBytes - 1) / kPageBytes * kPageBytes;
      block = new Block{allocation, reinterpret_cast<void*>(page_start), size};
    }
    report(block, static_cast<int64_t>(block->size));
    return {block->ptr, block, &OutputCache::release, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  void empty() {
    std::multimap<size_t, Block*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
      by_age_.clear();
      cached_ = 0;
    }
    for (auto& entry : blocks) destroy(entry.second);
  }

  // Bytes and count of the free buffers kept, bytes of the cache's buffers in use.
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(cached_), static_cast<int64_t>(free_.size()), static_cast<int64_t>(in_use_)};
  }

  static OutputCache& instance() {
    // Never destroyed: tensors may release their buffers after static destructors ran.
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

 private:
  static void release(void* ctx) { instance().put(static_cast<Block*>(ctx)); }

  void put(Block* block) {
    report(block, -static_cast<int64_t>(block->size));
    std::vector<Block*> displaced;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_ -= block->size;
      if (block->size <= limit_) {
        while (cached_ + block->size > limit_) {  // the buffers freed longest ago make room
          Block* oldest = by_age_.begin()->second;
          by_age_.erase(by_age_.begin());
          auto it = free_.lower_bound(oldest->size);  // the first of its size; it is among them
          while (it->second != oldest) ++it;
          free_.erase(it);
          cached_ -= oldest->size;
          displaced.push_back(oldest);
        }
        block->freed_at = ++releases_;
        free_.emplace(block->size, block);
        by_age_.emplace(block->freed_at, block);
        cached_ += block->size;
        block = nullptr;
      }
    }
    for (Block* old : displaced) destroy(old);
    if (block != nullptr) destroy(block);
  }

  static void destroy(Block* block) {
    c10::free_cpu(block->allocation);
    delete block;
  }

  // Tells the memory profiler (torch.profiler with profile_memory=True), as the default allocator does.
  void report(const Block* block, int64_t delta) {
    if (!c10::memoryProfilingEnabled()) return;
    size_t in_use, reserved;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use = in_use_;
      reserved = in_use_ + cached_;
    }
    c10::reportMemoryUsageToProfiler(block->ptr, delta, in_use, reserved, c10::Device(c10::kCPU));
  }

  const size_t limit_ = limit_from_env();
  std::mutex mutex_;
  std::multimap<size_t, Block*> free_;  // free buffers by size
  std::map<uint64_t, Block*> by_age_;   // the same by freed_at, the longest free first
  uint64_t releases_ = 0;               // buffers put into free_ so far
  size_t cached_ = 0;                   // bytes in free_
  size_t in_use_ = 0;                   // bytes of cached-size buffers held by tensors
};

}  // namespace

at::Tensor cached_cpu_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, &OutputCache::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

void empty_cpu_cache() { OutputCache::instance().empty(); }

std::vector<int64_t> cpu_cache_stats() { return OutputCache::instance().stats(); }

}  // namespace attnres
