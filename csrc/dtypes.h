// The floating dtypes a unit may store, gather and reduce its parameters in: the one
// definition the C++ checks and the Python API (supported_float_dtypes) share. float8
// and complex are not among them: the reductions and casts here do not support them.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>

namespace mfsdp {

inline constexpr std::array<c10::ScalarType, 4> kSupportedFloats = {c10::kFloat, c10::kBFloat16, c10::kHalf,
                                                                    c10::kDouble};
inline constexpr const char* kSupportedFloatNames = "float32, bfloat16, float16 or float64";

inline bool is_supported_float(c10::ScalarType t) {
  for (auto s : kSupportedFloats)
    if (s == t) return true;
  return false;
}

}  // namespace mfsdp
