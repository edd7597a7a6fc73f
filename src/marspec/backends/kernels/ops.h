// The torch side of every kernel file: the operator namespace of this build's path, and the checks every
// operator makes of its tensors before it reads them.
//
// Each instruction-set path is built as a library of its own (backends/kernels/paths.py), its operators
// in a namespace named after it (MARSPEC_OPS, defined by the build: marspec_avx2, marspec_avx512_vnni,
// ...), so that several paths' libraries can be loaded in one process and compared bit for bit.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#ifndef MARSPEC_OPS
#error "the build defines MARSPEC_OPS, the operators' namespace"
#endif

// TORCH_LIBRARY_FRAGMENT with its namespace macro-expanded first.
#define MARSPEC_LIBRARY_EXPANDED(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define MARSPEC_LIBRARY(m) MARSPEC_LIBRARY_EXPANDED(MARSPEC_OPS, m)

namespace marspec_kernels {

// A CPU tensor, else an error naming the argument and where it is.
inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU, not ", t.device());
}

}  // namespace marspec_kernels
