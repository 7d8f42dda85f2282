// Torch side of the CUDA Block step, shared by both builds of the kernels: nvcc
// (ops_cuda.cu: CUDA tensors, the CUDA dispatch key of attnres::) and the SIMT
// harness (csrc/simt/emulated_block_step.cpp: CPU tensors, attnres_emu::).
// Argument checks and output dtypes come from ../block_step.h, as on CPU; the
// Runtime, the site parameters' operands and their gradients are the depth
// read's (depth_attention_ops.h): per call only the outputs (and the backward's
// partial sums) are allocated, nothing is copied or synchronised. Autograd: the C++
// autograd of attnres::block_step_fwd is registered for the Autograd alias key
// (csrc/autograd/block_step_autograd.h), so it serves this CUDA kernel too.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "../block_step.h"
#include "block_step_kernels.cuh"
#include "depth_attention_ops.h"

namespace attnres::cuda {

// A RowRef of [M, D] rows with unit column stride, or an empty one (null data) for an absent operand.
inline RowRef step_row_ref(const at::Tensor& rows) { return rows.defined() ? row_ref(rows) : RowRef{nullptr, 0, 0}; }

// The narrowest element size among the row tensors (it sets the group G) and
// whether all of them allow the 16-byte vector path.
struct RowLayout {
  int min_itemsize = 8;
  bool aligned = true;

  void add(const at::Tensor& rows) {
    if (!rows.defined()) return;
    min_itemsize = std::min<int>(min_itemsize, static_cast<int>(rows.element_size()));
    aligned = aligned && rows_aligned(rows, rows.stride(0));
  }
};

inline DepthPlan plan_step_or_raise(Pass pass, const StepArgs& a, bool has_out_norm, int min_itemsize, int num_sms) {
  try {
    return plan_block_step(pass, a.M, a.D, min_itemsize, a.acc_dtype == at::kDouble, has_out_norm, num_sms);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "block step (cuda): ", e.what());
  }
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_fwd(
    Runtime& rt, const c10::optional<at::Tensor>& partial, const at::Tensor& update, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, double eps, c10::optional<int64_t> key_rank) {
  const int64_t R = step_key_dim(key_rank, update);
  const StepArgs a = check_step(partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, R,
                                /*form_site_params=*/false);
  const auto lead = update.sizes().slice(0, update.dim() - 1);
  at::Tensor new_partial = at::empty(update.sizes(), update.options().dtype(a.new_dtype));
  at::Tensor out = at::empty(update.sizes(), update.options().dtype(a.out_dtype));
  const auto acc_opts = update.options().dtype(a.acc_dtype);
  at::Tensor lse = at::empty(lead, acc_opts), logit = at::empty(lead, acc_opts), rinv = at::empty(lead, acc_opts);
  if (a.M == 0) return {new_partial, out, lse, logit, rinv};

  const at::Tensor partial_rows = partial.has_value() ? step_rows(*partial, a.M, a.D) : at::Tensor();
  const at::Tensor update_rows = step_rows(update, a.M, a.D), prefix_rows = step_rows(prefix_out, a.M, a.D);
  const at::Tensor new_rows = new_partial.view({a.M, a.D}), out_rows = out.view({a.M, a.D});
  const at::Tensor lse_a = prefix_lse.contiguous();
  RowLayout layout;
  for (const at::Tensor* t : {&partial_rows, &update_rows, &prefix_rows, &new_rows, &out_rows}) layout.add(*t);
  const DepthPlan plan =
      plan_step_or_raise(Pass::kForward, a, out_norm_weight.has_value(), layout.min_itemsize, rt.num_sms());
  const SiteOperand w = site_operand(query, a.acc_dtype), gamma = site_operand(norm_weight, a.acc_dtype),
                    g = site_operand(out_norm_weight, a.acc_dtype);
  track_all(rt, {{"partial", &partial_rows},
                 {"update", &update_rows},
                 {"prefix_out", &prefix_rows},
                 {"prefix_lse", &lse_a},
                 {"query", &w.tensor},
                 {"norm_weight", &gamma.tensor},
                 {"out_norm_weight", &g.tensor},
                 {"new_partial", &new_rows},
                 {"out", &out_rows},
                 {"lse", &lse},
                 {"logit", &logit},
                 {"rinv", &rinv}});
  AT_DISPATCH_FLOATING_TYPES(a.acc_dtype, "block_step_fwd_cuda", [&] {
    using acc_t = scalar_t;
    StepFwdParams<acc_t> p{};
    p.partial = step_row_ref(partial_rows);
    p.update = row_ref(update_rows);
    p.prefix_out = row_ref(prefix_rows);
    p.new_partial = row_ref(new_rows);
    p.out = row_ref(out_rows);
    p.rows = a.M;
    p.dim = a.D;
    p.key_start = static_cast<int32_t>(a.D - R);
    p.inv_key_dim = acc_t(1) / static_cast<acc_t>(R);
    p.query = w.view;
    p.norm_weight = gamma.view;
    p.out_norm_weight = g.view;
    p.prefix_lse = lse_a.const_data_ptr<acc_t>();
    p.lse = lse.mutable_data_ptr<acc_t>();
    p.logit = logit.mutable_data_ptr<acc_t>();
    p.rinv = rinv.mutable_data_ptr<acc_t>();
    p.eps = static_cast<acc_t>(eps);
    p.vec = a.D % plan.group == 0 && layout.aligned;
    launch_block_step_fwd<acc_t>(rt, plan, p);
  });
  return {new_partial, out, lse, logit, rinv};
}

template <typename Runtime>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_step_bwd(
    Runtime& rt, const c10::optional<at::Tensor>& grad_new_partial, const c10::optional<at::Tensor>& grad_out,
    const c10::optional<at::Tensor>& grad_lse, const at::Tensor& new_partial, const at::Tensor& query,
    const c10::optional<at::Tensor>& norm_weight, const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
    const c10::optional<at::Tensor>& out_norm_weight, const at::Tensor& logit, const at::Tensor& rinv, double eps,
    c10::optional<int64_t> key_rank) {
  const int64_t R = step_key_dim(key_rank, new_partial);
  const StepArgs a = check_step(c10::nullopt, new_partial, query, norm_weight, prefix_out, prefix_lse, out_norm_weight,
                                R, /*form_site_params=*/false);
  const StepSaved saved = check_step_saved(a, new_partial, grad_new_partial, grad_out, grad_lse, logit, rinv);
  const auto lead = new_partial.sizes().slice(0, new_partial.dim() - 1);
  at::Tensor grad_total = at::empty(new_partial.sizes(), new_partial.options().dtype(a.new_dtype));
  at::Tensor grad_prefix_out = at::empty(prefix_out.sizes(), prefix_out.options());
  at::Tensor grad_prefix_lse = at::empty(lead, prefix_lse.options());
  const bool has_norm = out_norm_weight.has_value();
  const SiteGrad d_query = site_grad(query, a.acc_dtype), d_norm = site_grad(norm_weight, a.acc_dtype),
                 d_g = site_grad(out_norm_weight, a.acc_dtype);
  const SiteOperand w = site_operand(query, a.acc_dtype), gamma = site_operand(norm_weight, a.acc_dtype),
                    g = site_operand(out_norm_weight, a.acc_dtype);
  const at::Tensor gn_rows = grad_new_partial.has_value() ? step_rows(*grad_new_partial, a.M, a.D) : at::Tensor();
  const at::Tensor dy_rows = grad_out.has_value() ? step_rows(*grad_out, a.M, a.D) : at::Tensor();
  const at::Tensor v_rows = step_rows(new_partial, a.M, a.D), ha_rows = step_rows(prefix_out, a.M, a.D);
  const at::Tensor total_rows = grad_total.view({a.M, a.D}), dha_rows = grad_prefix_out.view({a.M, a.D});
  const at::Tensor lse_a = prefix_lse.contiguous();
  RowLayout layout;
  for (const at::Tensor* t : {&gn_rows, &dy_rows, &v_rows, &ha_rows, &total_rows, &dha_rows}) layout.add(*t);
  const DepthPlan plan =
      a.M > 0 ? plan_step_or_raise(Pass::kBackward, a, has_norm, layout.min_itemsize, rt.num_sms()) : DepthPlan{};
  const Partials parts =
      partial_sums(plan.num_chunks, 1, R, a.D, has_norm, false, new_partial.options().dtype(a.acc_dtype));
  track_all(rt, {{"grad_new_partial", &gn_rows},
                 {"grad_out", &dy_rows},
                 {"grad_lse", &saved.dlse},
                 {"new_partial", &v_rows},
                 {"prefix_out", &ha_rows},
                 {"prefix_lse", &lse_a},
                 {"logit", &saved.logit},
                 {"rinv", &saved.rinv},
                 {"query", &w.tensor},
                 {"norm_weight", &gamma.tensor},
                 {"out_norm_weight", &g.tensor},
                 {"grad_total", &total_rows},
                 {"grad_prefix_out", &dha_rows},
                 {"grad_prefix_lse", &grad_prefix_lse},
                 {"grad_query", &d_query.tensor},
                 {"grad_norm_weight", &d_norm.tensor},
                 {"grad_out_norm_weight", &d_g.tensor}});
  parts.track(rt);
  AT_DISPATCH_FLOATING_TYPES(a.acc_dtype, "block_step_bwd_cuda", [&] {
    using acc_t = scalar_t;
    StepBwdParams<acc_t> p{};
    p.grad_new_partial = step_row_ref(gn_rows);
    p.grad_out = step_row_ref(dy_rows);
    p.new_partial = row_ref(v_rows);
    p.prefix_out = row_ref(ha_rows);
    p.grad_total = row_ref(total_rows);
    p.grad_prefix_out = row_ref(dha_rows);
    p.rows = a.M;
    p.dim = a.D;
    p.key_start = static_cast<int32_t>(a.D - R);
    p.inv_key_dim = acc_t(1) / static_cast<acc_t>(R);
    p.dlse = data_or_null<acc_t>(saved.dlse);
    p.query = w.view;
    p.norm_weight = gamma.view;
    p.out_norm_weight = g.view;
    p.prefix_lse = lse_a.const_data_ptr<acc_t>();
    p.logit = saved.logit.const_data_ptr<acc_t>();
    p.rinv = saved.rinv.const_data_ptr<acc_t>();
    p.d_prefix_lse = grad_prefix_lse.mutable_data_ptr<acc_t>();
    p.du_part = parts.part<acc_t>(0);
    p.dg_part = parts.part<acc_t>(parts.dg_offset);
    p.rows_per_chunk = plan.rows_per_chunk;
    p.num_chunks = plan.num_chunks;
    p.eps = static_cast<acc_t>(eps);
    p.vec = a.M > 0 && a.D % plan.group == 0 && layout.aligned;
    p.part_vec = p.vec && p.key_start % plan.group == 0;
    SiteGradParams<acc_t> s{};
    s.du_part = p.du_part;
    s.dg_part = p.dg_part;
    s.num_chunks = plan.num_chunks;
    s.num_sites = 1;
    s.key_dim = R;
    s.dim = a.D;
    s.query = w.view;
    s.norm_weight = gamma.view;
    s.scale = acc_t(1);
    s.d_query = d_query.view;
    s.d_norm_weight = d_norm.view;
    s.d_out_norm_weight = d_g.view;
    launch_block_step_bwd<acc_t>(rt, plan, p, s);
  });
  const auto absent = new_partial.options().dtype(a.acc_dtype);
  return {grad_total,      d_query.result(query, absent),      d_norm.result(norm_weight, absent), grad_prefix_out,
          grad_prefix_lse, d_g.result(out_norm_weight, absent)};
}

}  // namespace attnres::cuda
