// The linear kernels as C++ functions (q4k.cpp, q6k.cpp), for the operators that call them without the
// dispatcher (layer.cpp): y = x @ W.T (+ bias) for float32 x [M, K] and packed weights.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace marspec_kernels {

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                      const std::optional<at::Tensor>& bias);
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                      const std::optional<at::Tensor>& bias);

}  // namespace marspec_kernels
