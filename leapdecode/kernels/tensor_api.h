// The part of torch's C++ API the kernel sources use: at::Tensor with its methods, the few factories they call,
// parallel_for, under the torch:: names <torch/extension.h> gives them. That header also brings pybind11, Python's
// C API and torch's whole C++ frontend into every source that includes it: ~45 s of a ~55 s compile a source, so a
// first-use build of eleven sources took ~4 minutes on 2 cores. The Python module's source (bindings.cpp) includes only
// the part of it with the tensor conversions.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>

namespace torch {
using namespace at;  // as torch/types.h does: torch::Tensor, torch::empty, torch::kFloat are ATen's
}
