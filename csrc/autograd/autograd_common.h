// What the autograd of every op family uses: the aliases, the typed handle of an op found by
// name, and an undefined tensor (an absent input or gradient) as an empty optional.
//
// Compiled once, as part of autograd.cpp.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace attnres {
namespace autograd {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = c10::optional<Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline OptTensor present(const Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

}  // namespace autograd
}  // namespace attnres
