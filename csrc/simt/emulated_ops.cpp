// The CUDA kernels of attnres_kernels run on CPU tensors by the SIMT harness
// (DESIGN.md §4): the op namespace attnres_emu, CPU dispatch key, same schemas as
// attnres::. Built on first use by attnres_kernels/cuda/emulation.py
// (ATTNRES_CUDA_EMULATE=1 makes backend="cuda" accept CPU tensors). Python
// registers the fake kernels and autograd (ops/_registration.py).
//
// Adding a kernel family: include its torch-side header (the one the .cu binding
// uses, templated on a Runtime), define its schemas in TORCH_LIBRARY(attnres_emu)
// and register the Runtime-instantiated entry points below; list any new .cpp in
// attnres_kernels/cuda/emulation.py (SOURCES).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../cuda/attention_ops.h"
#include "../cuda/block_step_ops.h"
#include "../cuda/depth_attention_ops.h"
#include "../schemas.h"
#include "simt.h"
#include "warp_matrix.h"

namespace attnres::emulated {

// The Runtime of csrc/cuda/depth_attention_ops.h (and block_step_ops.h) for the harness: a one-SM
// "GPU" (forward grids stay small, so the grid-stride loops run), every tensor a kernel touches
// named for the traffic count.
struct Runtime {
  Runtime() { simt::clear_tracking(); }
  ~Runtime() { simt::clear_tracking(); }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int num_sms() const { return 1; }
  size_t max_shared_bytes() const { return shared_memory_limit; }

  // The opt-in shared memory per block the launch plans assume (set_shared_memory_limit): sm_80's by default.
  static inline size_t shared_memory_limit = cuda::kSharedSm80;

  void track(const char* group, const at::Tensor& t) {
    if (t.defined()) simt::track(group, t.const_data_ptr(), cuda::span_bytes(t));
  }
  void track(const char* group, const void* data, size_t bytes) { simt::track(group, data, bytes); }

  template <typename... P, typename... A>
  void launch(const std::string& name, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, A&&... args) {
    simt::launch(name.c_str(), kernel, grid, block, shared_bytes, std::forward<A>(args)...);
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd(
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, ATTNRES_READ_OPTIONS_PARAMS) {
  Runtime rt;
  return cuda::depth_attn_fwd(rt, sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight,
                              ATTNRES_READ_OPTIONS);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_bwd(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_logits,
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logits, const at::Tensor& rinv,
    ATTNRES_READ_OPTIONS_PARAMS) {
  Runtime rt;
  return cuda::depth_attn_bwd(rt, grad_out, grad_lse, grad_logits, sources, query, norm_weight, prefix_out, prefix_lse,
                              out_norm_weight, logits, rinv, ATTNRES_READ_OPTIONS);
}

std::tuple<at::Tensor, at::Tensor> attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const c10::optional<at::Tensor>& key_padding_mask, bool causal,
                                            double scale) {
  Runtime rt;
  return cuda::attn_fwd(rt, q, k, v, key_padding_mask, causal, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd(const at::Tensor& grad_out,
                                                        const c10::optional<at::Tensor>& grad_lse, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const c10::optional<at::Tensor>& key_padding_mask,
                                                        const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                        double scale) {
  Runtime rt;
  return cuda::attn_bwd(rt, grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, causal, scale);
}

// ------------------------------------------------------------------ the fragment instructions alone
// Each op below runs one emulated instruction of csrc/simt/warp_matrix.h in a harness launch
// (through csrc/cuda/mma_primitives.cuh, as the kernels call it), with the operands laid out
// by the PTX ISA's fragment tables written out again here, so that tests can check them
// against a plain matrix product or copy.

// d = a · b + c for one m16n8k16 tile: each lane gathers its A, B and C elements from global
// memory by the fragment table (g = lane / 4, t = lane % 4) and scatters D the same way.
template <typename S>
__global__ void mma_tile_kernel(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  auto pair = [](const uint16_t* m, int i0, int j0, int ld, int di, int dj) {  // m[i0, j0], m[i0 + di, j0 + dj]
    return uint32_t(m[i0 * ld + j0]) | uint32_t(m[(i0 + di) * ld + j0 + dj]) << 16;
  };
  const uint32_t fa[4] = {pair(a, g, 2 * t, 16, 0, 1), pair(a, g + 8, 2 * t, 16, 0, 1), pair(a, g, 2 * t + 8, 16, 0, 1),
                          pair(a, g + 8, 2 * t + 8, 16, 0, 1)};
  const uint32_t b0 = pair(b, 2 * t, g, 8, 1, 0), b1 = pair(b, 2 * t + 8, g, 8, 1, 0);
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  cuda::mma_m16n8k16<S>(acc, fa, b0, b1);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

at::Tensor mma_tile(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "mma_tile: a and b must both be fp16 or bf16");
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 16}) && b.sizes() == at::IntArrayRef({16, 8}) &&
                  c.sizes() == at::IntArrayRef({16, 8}) && c.scalar_type() == at::kFloat,
              "mma_tile: a [16, 16], b [16, 8], c [16, 8] fp32");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous(), cc = c.contiguous();
  at::Tensor d = at::empty({16, 8}, c.options());
  auto* pa = reinterpret_cast<const uint16_t*>(ac.const_data_ptr());
  auto* pb = reinterpret_cast<const uint16_t*>(bc.const_data_ptr());
  if (a.scalar_type() == at::kHalf) {
    simt::launch("mma_tile", &mma_tile_kernel<cuda::Half>, dim3(1), dim3(32), 0, pa, pb, cc.const_data_ptr<float>(),
                 d.mutable_data_ptr<float>());
  } else {
    simt::launch("mma_tile", &mma_tile_kernel<cuda::BFloat16>, dim3(1), dim3(32), 0, pa, pb, cc.const_data_ptr<float>(),
                 d.mutable_data_ptr<float>());
  }
  return d;
}

// ldmatrix of `count` 8 x 8 matrices m [8 count, 8] (16-bit elements): the rows sit in shared
// memory in reverse order, and lane l passes the address of row l (the lanes past 8 count the
// address of row l mod 8 count, which the instruction ignores). out [32, count]: each lane's registers.
template <int kCount, bool kTrans>
__global__ void ldmatrix_kernel(const uint16_t* m, uint32_t* out) {
  const int lane = threadIdx.x, rows = 8 * kCount;
  auto* shared = cuda::dynamic_shared<uint16_t>();
  for (int r = 0; r < rows; ++r) {
    if (lane < 8) shared[(rows - 1 - r) * 8 + lane] = m[r * 8 + lane];
  }
  __syncwarp();
  uint32_t regs[kCount];
  cuda::ldmatrix<kCount, kTrans>(regs, shared + (rows - 1 - lane % rows) * 8);
  for (int i = 0; i < kCount; ++i) out[lane * kCount + i] = regs[i];
}

at::Tensor ldmatrix_copy(const at::Tensor& m, int64_t count, bool trans) {
  TORCH_CHECK(count == 1 || count == 2 || count == 4, "ldmatrix_copy: count must be 1, 2 or 4");
  TORCH_CHECK(m.element_size() == 2 && m.sizes() == at::IntArrayRef({8 * count, 8}),
              "ldmatrix_copy: m must be [8 count, 8] of a 16-bit dtype");
  const at::Tensor mc = m.contiguous();
  at::Tensor out = at::empty({32, count}, m.options().dtype(at::kInt));
  auto* src = reinterpret_cast<const uint16_t*>(mc.const_data_ptr());
  auto* dst = reinterpret_cast<uint32_t*>(out.mutable_data_ptr());
  const size_t shared = 8 * count * 16;
  auto run = [&](auto kernel) { simt::launch("ldmatrix", kernel, dim3(1), dim3(32), shared, src, dst); };
  if (count == 1) trans ? run(&ldmatrix_kernel<1, true>) : run(&ldmatrix_kernel<1, false>);
  if (count == 2) trans ? run(&ldmatrix_kernel<2, true>) : run(&ldmatrix_kernel<2, false>);
  if (count == 4) trans ? run(&ldmatrix_kernel<4, true>) : run(&ldmatrix_kernel<4, false>);
  return out;
}

// Each thread copies chunk `threadIdx.x` (kBytes bytes; zero-filled instead for every
// `zero_every`-th chunk when zero_every > 0) into shared memory by cp.async; then the block
// writes shared memory to `out`. mode 0: after waiting for every group; 1: before any wait
// (the copies have not landed); 2: two groups (the even chunks, then the odd ones), read after
// cp.async.wait_group 1.
template <int kBytes>
__global__ void cp_async_kernel(const unsigned char* src, int zero_every, int mode, unsigned char* out) {
  const int t = threadIdx.x, n = blockDim.x;
  auto* shared = cuda::dynamic_shared<unsigned char>();
  auto issue = [&](int chunk) {
    const bool valid = zero_every == 0 || chunk % zero_every != zero_every - 1;
    cuda::cp_async<kBytes>(shared + chunk * kBytes, src + chunk * kBytes, valid);
  };
  if (mode == 2) {
    if (t % 2 == 0) issue(t);
    cuda::cp_async_commit();
    if (t % 2 == 1) issue(t);
    cuda::cp_async_commit();
    cuda::cp_async_wait<1>();
  } else {
    issue(t);
    cuda::cp_async_commit();
    if (mode == 0) cuda::cp_async_wait<0>();
  }
  __syncthreads();
  for (int i = t; i < n * kBytes; i += n) out[i] = shared[i];
  __syncthreads();
  cuda::cp_async_wait<0>();  // every copy retired before the thread exits
}

at::Tensor cp_async_copy(const at::Tensor& src, int64_t chunk_bytes, int64_t zero_every, int64_t mode) {
  TORCH_CHECK(src.scalar_type() == at::kByte && src.dim() == 1 && src.is_contiguous(), "cp_async_copy: 1-d uint8 src");
  TORCH_CHECK(chunk_bytes == 4 || chunk_bytes == 8 || chunk_bytes == 16, "cp_async_copy: chunks of 4, 8 or 16 bytes");
  TORCH_CHECK(zero_every >= 0 && 0 <= mode && mode <= 2, "cp_async_copy: bad zero_every or mode");
  TORCH_CHECK(src.numel() % chunk_bytes == 0 && src.numel() > 0 && src.numel() / chunk_bytes <= 1024,
              "cp_async_copy: src must be 1 to 1024 chunks");
  at::Tensor out = at::empty_like(src);
  const auto threads = static_cast<unsigned>(src.numel() / chunk_bytes);
  auto run = [&](auto kernel) {
    simt::launch("cp_async", kernel, dim3(1), dim3(threads), static_cast<size_t>(src.numel()),
                 src.const_data_ptr<uint8_t>(), static_cast<int>(zero_every), static_cast<int>(mode),
                 out.mutable_data_ptr<uint8_t>());
  };
  if (chunk_bytes == 4) run(&cp_async_kernel<4>);
  if (chunk_bytes == 8) run(&cp_async_kernel<8>);
  if (chunk_bytes == 16) run(&cp_async_kernel<16>);
  return out;
}

// c + a · b through ldmatrix and mma.sync, one warp per 16 x 8 tile of c, the operands
// staged in shared memory row-major: A [M, K] by ldmatrix.x4, B by ldmatrix.x2 from its
// transpose [N, K] (b_transposed) or .x2.trans from [K, N]. `misuse` breaks the
// warp-collective contract on purpose: 1, lane 5 passes a row address outside shared
// memory (reported, aborts); 2, lane 3 skips the instructions (a deadlock).
template <typename S>
__global__ void mma_matmul_kernel(const uint16_t* a, const uint16_t* b, float* c, int M, int N, int K,
                                  bool b_transposed, int misuse) {
  auto* sa = cuda::dynamic_shared<uint16_t>();
  uint16_t* sb = sa + M * K;
  for (int i = threadIdx.x; i < M * K; i += blockDim.x) sa[i] = a[i];
  for (int i = threadIdx.x; i < K * N; i += blockDim.x) sb[i] = b[i];
  __syncthreads();
  const int lane = threadIdx.x % 32, tiles_n = N / 8;
  for (int tile = threadIdx.x / 32; tile < (M / 16) * tiles_n; tile += blockDim.x / 32) {
    if (misuse == 2 && lane == 3) return;
    const int m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 8, g = lane / 4, t = lane % 4;
    float acc[4] = {c[(m0 + g) * N + n0 + 2 * t], c[(m0 + g) * N + n0 + 2 * t + 1], c[(m0 + g + 8) * N + n0 + 2 * t],
                    c[(m0 + g + 8) * N + n0 + 2 * t + 1]};
    for (int k0 = 0; k0 < K; k0 += 16) {
      uint32_t fa[4], fb[2];
      const uint16_t* row_a = sa + (m0 + lane % 8 + (lane / 8 % 2) * 8) * K + k0 + lane / 16 * 8;
      cuda::ldmatrix<4, false>(fa, misuse == 1 && lane == 5 ? a : row_a);
      if (b_transposed) {
        cuda::ldmatrix<2, false>(fb, sb + (n0 + lane % 8) * K + k0 + lane / 8 % 2 * 8);
      } else {
        cuda::ldmatrix<2, true>(fb, sb + (k0 + lane % 8 + lane / 8 % 2 * 8) * N + n0);
      }
      cuda::mma_m16n8k16<S>(acc, fa, fb[0], fb[1]);
    }
    c[(m0 + g) * N + n0 + 2 * t] = acc[0];
    c[(m0 + g) * N + n0 + 2 * t + 1] = acc[1];
    c[(m0 + g + 8) * N + n0 + 2 * t] = acc[2];
    c[(m0 + g + 8) * N + n0 + 2 * t + 1] = acc[3];
  }
}

at::Tensor mma_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool b_transposed,
                      int64_t misuse) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "mma_matmul: 2-d operands");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "mma_matmul: a and b must both be fp16 or bf16");
  TORCH_CHECK(c.scalar_type() == at::kFloat, "mma_matmul: c must be fp32");
  const int64_t M = a.size(0), K = a.size(1), N = b_transposed ? b.size(0) : b.size(1);
  TORCH_CHECK((b_transposed ? b.size(1) : b.size(0)) == K && c.size(0) == M && c.size(1) == N,
              "mma_matmul: shapes do not match");
  TORCH_CHECK(M % 16 == 0 && N % 8 == 0 && K % 16 == 0 && M > 0 && N > 0 && K > 0,
              "mma_matmul: M and K must be positive multiples of 16, N of 8");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = c.contiguous().clone();
  const size_t shared = static_cast<size_t>((M * K + K * N) * 2);
  auto* pa = reinterpret_cast<const uint16_t*>(ac.const_data_ptr());
  auto* pb = reinterpret_cast<const uint16_t*>(bc.const_data_ptr());
  auto run = [&](auto kernel) {
    simt::launch("mma_matmul", kernel, dim3(1), dim3(128), shared, pa, pb, out.mutable_data_ptr<float>(),
                 static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), b_transposed, static_cast<int>(misuse));
  };
  if (a.scalar_type() == at::kHalf) {
    run(&mma_matmul_kernel<cuda::Half>);
  } else {
    run(&mma_matmul_kernel<cuda::BFloat16>);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_fwd(
    const c10::optional<at::Tensor>& partial, const at::Tensor& update, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, double eps, c10::optional<int64_t> key_rank) {
  Runtime rt;
  return cuda::block_step_fwd(rt, partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps,
                              key_rank);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_bwd(
    const c10::optional<at::Tensor>& grad_new_partial, const c10::optional<at::Tensor>& grad_out,
    const c10::optional<at::Tensor>& grad_lse, const at::Tensor& new_partial, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logit, const at::Tensor& rinv, double eps,
    c10::optional<int64_t> key_rank) {
  Runtime rt;
  return cuda::block_step_bwd(rt, grad_new_partial, grad_out, grad_lse, new_partial, query, norm_weight, prefix_out,
                              prefix_lse, out_norm_weight, logit, rinv, eps, key_rank);
}

// x (fp32 or fp64) rounded to fp16 / bf16 by the device conversion (from_acc) in a
// harness launch: checks the harness's conversions against PyTorch's.
template <typename acc_t>
__global__ void round_kernel(const acc_t* x, uint16_t* out, int64_t n, bool half) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = half ? cuda::from_acc<cuda::Half>(x[i]).bits : cuda::from_acc<cuda::BFloat16>(x[i]).bits;
}

at::Tensor round_to(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "round_to: x must be 1-d fp32/fp64");
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "round_to: dtype must be fp16 or bf16");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.numel()}, x.options().dtype(at::kShort));
  const int64_t n = x.numel();
  if (n == 0) return out.view(dtype);
  const dim3 grid(static_cast<unsigned>((n + 255) / 256)), block(256);
  auto* bits = reinterpret_cast<uint16_t*>(out.mutable_data_ptr());
  if (x.scalar_type() == at::kFloat) {
    simt::launch("round<float>", &round_kernel<float>, grid, block, 0, xc.const_data_ptr<float>(), bits, n,
                 dtype == at::kHalf);
  } else {
    simt::launch("round<double>", &round_kernel<double>, grid, block, 0, xc.const_data_ptr<double>(), bits, n,
                 dtype == at::kHalf);
  }
  return out.view(dtype);
}

// Sets the opt-in shared memory per block the attention launch plans assume (a GPU's
// limit: 99 KiB on sm_86/89, 163 KiB on sm_80, 227 KiB on sm_90); returns the previous one.
int64_t set_shared_memory_limit(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "set_shared_memory_limit: bytes must be positive");
  const auto previous = static_cast<int64_t>(Runtime::shared_memory_limit);
  Runtime::shared_memory_limit = static_cast<size_t>(bytes);
  return previous;
}

// Whether cp.async copies land when issued (true) or when waited for (false, the default).
bool set_cp_async_eager(bool eager) { return simt::set_cp_async_eager(eager); }

// Every launch since the last call, one per line:
// kernel \t grid x,y,z \t block x,y,z \t shared bytes \t group:read:written ...
std::string launch_log() {
  std::ostringstream out;
  for (const auto& r : simt::take_launch_log()) {
    out << r.kernel << '\t' << r.grid.x << ',' << r.grid.y << ',' << r.grid.z << '\t' << r.block.x << ',' << r.block.y
        << ',' << r.block.z << '\t' << r.dynamic_smem << '\t';
    bool first = true;
    for (const auto& [group, t] : r.traffic) {
      out << (first ? "" : " ") << group << ':' << t.read << ':' << t.written;
      first = false;
    }
    out << '\n';
  }
  return out.str();
}

TORCH_LIBRARY(attnres_emu, m) {
  // The schemas of the attnres ops (csrc/schemas.h).
  m.def(schema::kDepthAttnFwd);
  m.def(schema::kDepthAttnBwd);
  m.def(schema::kAttnFwd);
  m.def(schema::kAttnBwd);
  m.def(schema::kBlockStepFwd);
  m.def(schema::kBlockStepBwd);
  m.def("mma_tile(Tensor a, Tensor b, Tensor c) -> Tensor");
  m.def("ldmatrix_copy(Tensor m, int count, bool trans) -> Tensor");
  m.def("cp_async_copy(Tensor src, int chunk_bytes, int zero_every, int mode) -> Tensor");
  m.def("mma_matmul(Tensor a, Tensor b, Tensor c, bool b_transposed, int misuse) -> Tensor");
  m.def("set_shared_memory_limit(int bytes) -> int", &set_shared_memory_limit);
  m.def("set_cp_async_eager(bool eager) -> bool", &set_cp_async_eager);
  m.def("launch_log() -> str", &launch_log);
  m.def("round_to(Tensor x, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnres_emu, CPU, m) {
  m.impl("depth_attn_fwd", &depth_attn_fwd);
  m.impl("depth_attn_bwd", &depth_attn_bwd);
  m.impl("block_step_fwd", &block_step_fwd);
  m.impl("block_step_bwd", &block_step_bwd);
  m.impl("round_to", &round_to);
  m.impl("attn_fwd", &attn_fwd);
  m.impl("attn_bwd", &attn_bwd);
  m.impl("mma_tile", &mma_tile);
  m.impl("ldmatrix_copy", &ldmatrix_copy);
  m.impl("cp_async_copy", &cp_async_copy);
  m.impl("mma_matmul", &mma_matmul);
}

}  // namespace attnres::emulated
