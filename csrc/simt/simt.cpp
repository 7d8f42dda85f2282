// The SIMT harness runtime (see simt.h): fibers, the block scheduler, the launch log.
#include "simt.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace simt {

namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;

std::mutex log_mutex;
std::vector<LaunchRecord> launch_log;

// Per OS thread: the scheduler's context, the body every fiber runs and the fiber stacks (reused).
thread_local void* scheduler_context = nullptr;
thread_local void (*fiber_body)(void*) = nullptr;
thread_local void* fiber_arg = nullptr;
thread_local std::vector<void*> stack_pool;

void* allocate_stack() {
  if (!stack_pool.empty()) {
    void* s = stack_pool.back();
    stack_pool.pop_back();
    return s;
  }
  void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("simt: cannot allocate a fiber stack");
  mprotect(p, kGuardBytes, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  return p;
}

void fiber_main(Fiber* f);

}  // namespace

void fail(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

// ------------------------------------------------------------------ context switch

#if defined(__x86_64__)
// simt_switch(save, load): saves the callee-saved registers and the floating-point
// control words on the current stack, stores the stack pointer in *save, and
// resumes the context whose stack pointer is `load`.
extern "C" void simt_switch(void** save, void* load);
extern "C" void simt_fiber_entry();
asm(R"(
  .text
  .p2align 4
  .type simt_switch, @function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch, .-simt_switch

  .p2align 4
  .type simt_fiber_entry, @function
simt_fiber_entry:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size simt_fiber_entry, .-simt_fiber_entry
)");

namespace {

void init_context(Fiber& f) {
  // The first switch to the fiber pops this frame and "returns" into
  // simt_fiber_entry, which calls fiber_main(f) (r12 = f, r13 = fiber_main).
  auto top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = reinterpret_cast<uint64_t>(&simt_fiber_entry);  // popped by `ret`: rsp is then 16-byte aligned
  *--sp = 0;                                              // rbp
  *--sp = 0;                                              // rbx
  *--sp = reinterpret_cast<uint64_t>(&f);                 // r12
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);        // r13
  *--sp = 0;                                              // r14
  *--sp = 0;                                              // r15
  *--sp = 0x1F80;                                         // mxcsr (default)
  *--sp = 0x037F;                                         // x87 control word (default)
  f.context = sp;
}

void switch_to_fiber(Fiber& f) { simt_switch(&scheduler_context, f.context); }
void switch_to_scheduler(Fiber& f) { simt_switch(&f.context, scheduler_context); }

}  // namespace

#else  // portable fallback: ucontext (slower: a signal-mask system call per switch)

namespace {

thread_local ucontext_t scheduler_ucontext;

void trampoline(unsigned lo, unsigned hi) { fiber_main(reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | lo)); }

void init_context(Fiber& f) {
  auto* uc = static_cast<ucontext_t*>(f.context);
  if (uc == nullptr) f.context = uc = new ucontext_t;
  getcontext(uc);
  uc->uc_stack.ss_sp = static_cast<char*>(f.stack) + kGuardBytes;
  uc->uc_stack.ss_size = kStackBytes - kGuardBytes;
  uc->uc_link = nullptr;
  const auto p = reinterpret_cast<uintptr_t>(&f);
  makecontext(uc, reinterpret_cast<void (*)()>(&trampoline), 2, unsigned(p & 0xffffffffu), unsigned(p >> 32));
}

void switch_to_fiber(Fiber& f) { swapcontext(&scheduler_ucontext, static_cast<ucontext_t*>(f.context)); }
void switch_to_scheduler(Fiber& f) { swapcontext(static_cast<ucontext_t*>(f.context), &scheduler_ucontext); }

}  // namespace

#endif

namespace {

void fiber_main(Fiber* f) {
  fiber_body(fiber_arg);
  if (!f->async_open.empty() || !f->async_groups.empty()) fail("a thread exited with cp.async copies never waited for");
  f->done = true;
  ++current_block->progress;
  switch_to_scheduler(*f);
  fail("a finished thread was resumed");
}

}  // namespace

void yield() { switch_to_scheduler(*current_fiber); }

void check_full_mask(unsigned mask, int width) {
  if (mask != kFullMask || width != static_cast<int>(kWarpSize)) {
    fail("only full-warp masks and width 32 are emulated");
  }
}

// ------------------------------------------------------------------ tracking and the log

void track(const std::string& group, const void* ptr, size_t bytes) {
  if (bytes == 0) return;
  size_t index = 0;
  while (index < tracking.groups.size() && tracking.groups[index] != group) ++index;
  if (index == tracking.groups.size()) tracking.groups.push_back(group);
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  tracking.ranges.push_back({begin, begin + bytes, index});
}

void clear_tracking() {
  tracking.ranges.clear();
  tracking.groups.clear();
}

std::vector<LaunchRecord> take_launch_log() {
  std::lock_guard<std::mutex> lock(log_mutex);
  std::vector<LaunchRecord> out;
  out.swap(launch_log);
  return out;
}

// ------------------------------------------------------------------ the grid

void run_grid(const char* name, dim3 grid, dim3 block_dim, size_t dynamic_smem, void (*body)(void*), void* arg) {
  const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024) throw std::invalid_argument(std::string("simt: bad block size for ") + name);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) throw std::invalid_argument(std::string("simt: empty grid: ") + name);
  if (current_fiber != nullptr) fail("a kernel launched from device code");

  tracking.traffic.assign(tracking.groups.size() + 1, Traffic{});
  std::vector<unsigned char> shared_storage(dynamic_smem + 16);
  auto* shared = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(shared_storage.data()) + 15) & ~15ull);

  std::vector<Fiber> fibers(threads);
  for (auto& f : fibers) f.stack = allocate_stack();
  Block block;
  block.block_dim = block_dim;
  block.grid_dim = grid;
  block.shared = shared;
  block.shared_bytes = dynamic_smem;
  block.warps.resize((threads + kWarpSize - 1) / kWarpSize);
  block.barrier.expected = threads;
  for (unsigned w = 0; w < block.warps.size(); ++w) {
    block.warps[w].barrier.expected = std::min(kWarpSize, threads - w * kWarpSize);
  }
  fiber_body = body;
  fiber_arg = arg;

  std::string deadlock;
  for (unsigned bz = 0; bz < grid.z && deadlock.empty(); ++bz) {
    for (unsigned by = 0; by < grid.y && deadlock.empty(); ++by) {
      for (unsigned bx = 0; bx < grid.x && deadlock.empty(); ++bx) {
        block.block_idx = {bx, by, bz};
        block.barrier.arrived = 0;
        for (auto& w : block.warps) {
          w.barrier.arrived = 0;
          w.collective[0].arrived = w.collective[1].arrived = 0;
        }
        std::memset(shared, 0xFF, dynamic_smem);
        for (unsigned t = 0; t < threads; ++t) {
          Fiber& f = fibers[t];
          f.thread_idx = {t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
          f.lane = t % kWarpSize;
          f.warp = t / kWarpSize;
          f.shuffle_parity = 0;
          f.done = false;
          f.async_open.clear();
          f.async_groups.clear();
          init_context(f);
        }
        current_block = &block;
        unsigned live = threads;
        while (live > 0) {
          const uint64_t before = block.progress;
          for (auto& f : fibers) {
            if (f.done) continue;
            current_fiber = &f;
            switch_to_fiber(f);
            current_fiber = nullptr;
            live -= f.done;
          }
          if (live > 0 && block.progress == before) {
            deadlock = std::string("simt: deadlock in ") + name + " block (" + std::to_string(bx) + ", " +
                       std::to_string(by) + ", " + std::to_string(bz) +
                       "): threads wait at a barrier that the others never reach (or exited before)";
            break;
          }
        }
        current_block = nullptr;
      }
    }
  }
  for (auto& f : fibers) stack_pool.push_back(f.stack);
  if (!deadlock.empty()) throw std::runtime_error(deadlock);

  LaunchRecord record{name, grid, block_dim, dynamic_smem, {}};
  for (size_t g = 0; g < tracking.groups.size(); ++g) record.traffic[tracking.groups[g]] = tracking.traffic[g];
  record.traffic["untracked"] = tracking.traffic.back();
  std::lock_guard<std::mutex> lock(log_mutex);
  launch_log.push_back(std::move(record));
}

}  // namespace simt
