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

namespace attnres::emulated {

// The Runtime of csrc/cuda/depth_attention_ops.h (and block_step_ops.h) for the harness: tables in host
// memory, a one-SM "GPU" (forward grids stay small, so the grid-stride loops run),
// every tensor a kernel touches named for the traffic count.
struct Runtime {
  Runtime() { simt::clear_tracking(); }
  ~Runtime() { simt::clear_tracking(); }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int num_sms() const { return 1; }

  at::Tensor device_table(const std::vector<cuda::RowRef>& refs, const at::Device&) {
    const auto bytes = static_cast<int64_t>(refs.size() * sizeof(cuda::RowRef));
    at::Tensor table = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(table.mutable_data_ptr(), refs.data(), bytes);
    return table;
  }

  void track(const char* group, const at::Tensor& t) {
    if (t.defined()) simt::track(group, t.const_data_ptr(), cuda::span_bytes(t));
  }

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

// c + a · b through the emulated WMMA calls (csrc/simt/wmma.h), one warp per 16 x 16
// tile of c, straight from global memory: checks the emulation against a matmul.
// `misuse` breaks the warp-collective contract on purpose: 1, lane 5 passes
// another pointer (reported, aborts); 2, lane 3 skips the calls (a deadlock).
template <typename W, typename Layout>
__global__ void wmma_matmul_kernel(const W* a, const W* b, float* c, int M, int N, int K, int misuse) {
  namespace wmma = nvcuda::wmma;
  constexpr bool kColMajor = std::is_same_v<Layout, wmma::col_major>;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x * warps + threadIdx.x / 32, tiles_n = N / 16;
  if (tile >= (M / 16) * tiles_n || (misuse == 2 && lane == 3)) return;
  const int m0 = tile / tiles_n * 16, n0 = tile % tiles_n * 16;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(acc, c + m0 * N + n0, N, wmma::mem_row_major);
  for (int k0 = 0; k0 < K; k0 += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, W, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, W, Layout> fb;
    const W* pa = a + m0 * K + k0;
    wmma::load_matrix_sync(fa, misuse == 1 && lane == 5 ? pa + 16 * K : pa, K);
    wmma::load_matrix_sync(fb, kColMajor ? b + n0 * K + k0 : b + k0 * N + n0, kColMajor ? K : N);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(c + m0 * N + n0, acc, N, wmma::mem_row_major);
}

at::Tensor wmma_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, bool b_transposed,
                       int64_t misuse) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "wmma_matmul: 2-d operands");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "wmma_matmul: a and b must both be fp16 or bf16");
  TORCH_CHECK(c.scalar_type() == at::kFloat, "wmma_matmul: c must be fp32");
  const int64_t M = a.size(0), K = a.size(1), N = b_transposed ? b.size(0) : b.size(1);
  TORCH_CHECK((b_transposed ? b.size(1) : b.size(0)) == K && c.size(0) == M && c.size(1) == N,
              "wmma_matmul: shapes do not match");
  TORCH_CHECK(M % 16 == 0 && N % 16 == 0 && K % 16 == 0 && M > 0 && N > 0 && K > 0,
              "wmma_matmul: sizes must be positive multiples of 16");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = c.contiguous().clone();
  const int tiles = static_cast<int>((M / 16) * (N / 16));
  const dim3 grid(static_cast<unsigned>((tiles + 3) / 4)), block(128);
  auto run = [&](auto w, auto layout) {
    using W = decltype(w);
    using Layout = decltype(layout);
    simt::launch("wmma_matmul", &wmma_matmul_kernel<W, Layout>, grid, block, 0,
                 reinterpret_cast<const W*>(ac.const_data_ptr()), reinterpret_cast<const W*>(bc.const_data_ptr()),
                 out.mutable_data_ptr<float>(), static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                 static_cast<int>(misuse));
  };
  auto with_layout = [&](auto w) {
    if (b_transposed) {
      run(w, nvcuda::wmma::col_major{});
    } else {
      run(w, nvcuda::wmma::row_major{});
    }
  };
  if (a.scalar_type() == at::kHalf) {
    with_layout(__half{});
  } else {
    with_layout(__nv_bfloat16{});
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
  m.def("wmma_matmul(Tensor a, Tensor b, Tensor c, bool b_transposed, int misuse) -> Tensor");
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
  m.impl("wmma_matmul", &wmma_matmul);
}

}  // namespace attnres::emulated
