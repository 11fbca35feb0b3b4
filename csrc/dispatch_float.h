// The float dtypes the fused CUDA kernels are instantiated for, as a compile-time tag.
#pragma once

#include "errors.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace mfsdp {

// Calls f(T{}) with T the C++ type of `t` (float, c10::BFloat16, c10::Half); other dtypes
// raise naming `what`.
template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: MFSDP_CHECK(false, what, ": unsupported dtype ", t);
  }
}

}  // namespace mfsdp
