// The CUDA dispatch key of the attnres:: ops, one translation unit for every op
// family (torch's headers are compiled once). Each family's torch side (checks,
// outputs, launch plans) is a header templated on a Runtime and shared with the
// SIMT harness build (csrc/simt/emulated_ops.cpp); CudaRuntime below launches its
// torch-free kernels (csrc/cuda/*_kernels.cuh) on the current stream.
//   depth read: depth_attention_ops.h
//   fused attention: attention_ops.h
//   Block step: block_step_ops.h (its autograd is the C++ one on the Autograd key)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "attention_ops.h"
#include "block_step_ops.h"
#include "depth_attention_ops.h"

namespace attnres::cuda {
namespace {

// Raises a kernel's dynamic shared memory limit to `bytes` (above the default 48 KiB) once per
// kernel, device and size: a launch pays a lookup, not a driver call.
void allow_shared_bytes(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::pair<const void*, int> key{kernel, c10::cuda::current_device()};
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& current = allowed[key];
  if (current >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  current = bytes;
}

struct CudaRuntime {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  int num_sms() const { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }
  size_t max_shared_bytes() const { return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin; }

  void track(const char*, const at::Tensor&) {}
  void track(const char*, const void*, size_t) {}

  template <typename... P, typename... A>
  void launch(const std::string&, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, A&&... args) {
    if (shared_bytes > 48 * 1024) allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes);
    kernel<<<grid, block, shared_bytes, stream>>>(std::forward<A>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_fwd_cuda(
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, ATTNRES_READ_OPTIONS_PARAMS) {
  const c10::cuda::CUDAGuard guard(query.device());
  CudaRuntime rt;
  return depth_attn_fwd(rt, sources, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, ATTNRES_READ_OPTIONS);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> depth_attn_bwd_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_logits,
    at::TensorList sources, const at::Tensor& query, const c10::optional<at::Tensor>& norm_weight,
    const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logits, const at::Tensor& rinv,
    ATTNRES_READ_OPTIONS_PARAMS) {
  const c10::cuda::CUDAGuard guard(query.device());
  CudaRuntime rt;
  return depth_attn_bwd(rt, grad_out, grad_lse, grad_logits, sources, query, norm_weight, prefix_out, prefix_lse,
                        out_norm_weight, logits, rinv, ATTNRES_READ_OPTIONS);
}

std::tuple<at::Tensor, at::Tensor> attn_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const c10::optional<at::Tensor>& key_padding_mask, bool causal,
                                                 double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaRuntime rt;
  return attn_fwd(rt, q, k, v, key_padding_mask, causal, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_bwd_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const c10::optional<at::Tensor>& key_padding_mask, const at::Tensor& out,
    const at::Tensor& lse, bool causal, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  CudaRuntime rt;
  return attn_bwd(rt, grad_out, grad_lse, q, k, v, key_padding_mask, out, lse, causal, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_fwd_cuda(
    const c10::optional<at::Tensor>& partial, const at::Tensor& update, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, double eps, c10::optional<int64_t> key_rank) {
  const c10::cuda::CUDAGuard guard(update.device());
  CudaRuntime rt;
  return block_step_fwd(rt, partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps,
                        key_rank);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_bwd_cuda(
    const c10::optional<at::Tensor>& grad_new_partial, const c10::optional<at::Tensor>& grad_out,
    const c10::optional<at::Tensor>& grad_lse, const at::Tensor& new_partial, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logit, const at::Tensor& rinv, double eps,
    c10::optional<int64_t> key_rank) {
  const c10::cuda::CUDAGuard guard(new_partial.device());
  CudaRuntime rt;
  return block_step_bwd(rt, grad_new_partial, grad_out, grad_lse, new_partial, query, norm_weight, prefix_out,
                        prefix_lse, out_norm_weight, logit, rinv, eps, key_rank);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnres, CUDA, m) {
  m.impl("depth_attn_fwd", &depth_attn_fwd_cuda);
  m.impl("depth_attn_bwd", &depth_attn_bwd_cuda);
  m.impl("attn_fwd", &attn_fwd_cuda);
  m.impl("attn_bwd", &attn_bwd_cuda);
  m.impl("block_step_fwd", &block_step_fwd_cuda);
  m.impl("block_step_bwd", &block_step_bwd_cuda);
}

}  // namespace attnres::cuda
