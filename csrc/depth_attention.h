// Shared argument handling of the depth-attention ops (DESIGN.md §2.1) for
// every native backend: checks, the [M, D] row views of the sources, and the
// output shapes. The math lives in the backend files (csrc/cpu, csrc/cuda).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attnres {

// Name of the vector instruction set the CPU kernels were compiled for.
const char* cpu_vector_isa();

// The sources of one call as [M, D] matrices whose rows are contiguous (a view
// when the layout allows, a contiguous copy only when it does not).
struct SourceRows {
  std::vector<at::Tensor> rows;
  int64_t num_rows = 0;  // M: product of the leading dims
  int64_t dim = 0;       // D
  at::IntArrayRef lead_shape;
};

inline at::ScalarType accumulation_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline SourceRows check_sources(const at::TensorList sources) {
  TORCH_CHECK(!sources.empty(), "depth attention: `sources` is empty (N = 0)");
  const at::Tensor& first = sources[0];
  TORCH_CHECK(first.dim() >= 1, "depth attention: sources must have shape [..., D]");
  const auto dtype = first.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "depth attention: unsupported source dtype ", dtype);
  SourceRows out;
  out.dim = first.size(-1);
  TORCH_CHECK(out.dim > 0, "depth attention: sources have D = 0");
  out.num_rows = first.numel() / out.dim;
  out.lead_shape = first.sizes().slice(0, first.dim() - 1);
  out.rows.reserve(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& s = sources[i];
    TORCH_CHECK(s.sizes() == first.sizes(), "depth attention: sources[", i, "] has shape ", s.sizes(),
                ", sources[0] has ", first.sizes());
    TORCH_CHECK(s.scalar_type() == dtype, "depth attention: sources[", i, "] is ", s.scalar_type(), ", sources[0] is ",
                dtype);
    TORCH_CHECK(s.device() == first.device(), "depth attention: sources on different devices");
    at::Tensor r = s.reshape({out.num_rows, out.dim});
    if (r.stride(1) != 1) r = r.contiguous();
    out.rows.push_back(std::move(r));
  }
  return out;
}

// Checks a [Q, D] per-site tensor in the accumulation dtype and returns it contiguous.
inline at::Tensor check_site_param(const at::Tensor& t, const char* name, int64_t q, const SourceRows& src,
                                   at::ScalarType acc) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == q && t.size(1) == src.dim, "depth attention: `", name,
              "` must be [Q, D] = [", q, ", ", src.dim, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == acc, "depth attention: `", name, "` must be ", acc, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == src.rows[0].device(), "depth attention: `", name, "` is on another device");
  return t.contiguous();
}

// at::empty for a large output that is about to be written in full. On Linux
// the fresh pages are marked MADV_HUGEPAGE before their first touch: on hosts
// with transparent huge pages in "madvise" mode, one fault then maps 2 MiB
// instead of 4 KiB, which for a backward that writes N gradients of [M, D]
// removes most of the time spent in page faults. Memory the allocator reuses
// is already mapped and unaffected.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t end = begin + t.nbytes();
  const uintptr_t aligned_begin = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t aligned_end = end & ~(kHuge - 1);
  if (t.is_cpu() && aligned_end > aligned_begin) {
    madvise(reinterpret_cast<void*>(aligned_begin), aligned_end - aligned_begin, MADV_HUGEPAGE);
  }
#endif
  return t;
}

// Shape [leading..., *lead_shape, tail...].
inline std::vector<int64_t> shape_with(std::initializer_list<int64_t> leading, at::IntArrayRef lead_shape,
                                       std::initializer_list<int64_t> tail = {}) {
  std::vector<int64_t> shape(leading);
  shape.insert(shape.end(), lead_shape.begin(), lead_shape.end());
  shape.insert(shape.end(), tail.begin(), tail.end());
  return shape;
}

// The prefix (h_a [Q, ..., D], lse_a [Q, ...]) of a merge, as contiguous tensors.
inline void check_prefix(const c10::optional<at::Tensor>& prefix_out, const c10::optional<at::Tensor>& prefix_lse,
                         int64_t q, const SourceRows& src, at::Tensor& h_a, at::Tensor& lse_a) {
  TORCH_CHECK(prefix_out.has_value() == prefix_lse.has_value(),
              "depth attention: prefix_out and prefix_lse must be given together");
  if (!prefix_out.has_value()) return;
  const auto dtype = src.rows[0].scalar_type();
  TORCH_CHECK(prefix_out->sizes() == at::IntArrayRef(shape_with({q}, src.lead_shape, {src.dim})),
              "depth attention: prefix_out must be [Q, ..., D], got ", prefix_out->sizes());
  TORCH_CHECK(prefix_out->scalar_type() == dtype, "depth attention: prefix_out dtype differs from the sources");
  TORCH_CHECK(prefix_lse->sizes() == at::IntArrayRef(shape_with({q}, src.lead_shape)),
              "depth attention: prefix_lse must be [Q, ...], got ", prefix_lse->sizes());
  TORCH_CHECK(prefix_lse->scalar_type() == accumulation_type(dtype),
              "depth attention: prefix_lse must be in the accumulation dtype");
  h_a = prefix_out->contiguous();
  lse_a = prefix_lse->contiguous();
}

}  // namespace attnres
