// Error messages built without iostreams.
//
// Why: on the GPU image (torch 2.11.0+cu130, system g++), formatting a TORCH_CHECK
// message that streams an integer through std::ostringstream (c10::str) segfaulted
// inside this extension (found with cuda-gdb). Concatenating with
// std::to_string avoids iostreams; TORCH_CHECK then receives one ready std::string,
// which c10::str passes through untouched. Arguments are evaluated only on failure.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>
#include <vector>

namespace mfsdp {
namespace detail {

inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) { s += std::to_string(v); }
inline void append(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void append(std::string& s, c10::IntArrayRef a) {
  s += '[';
  for (size_t i = 0; i < a.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a[i]);
  }
  s += ']';
}
inline void append(std::string& s, const std::vector<int64_t>& a) { append(s, c10::IntArrayRef(a)); }

}  // namespace detail

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace mfsdp

#define MFSDP_CHECK(cond, ...) TORCH_CHECK((cond), ::mfsdp::msg(__VA_ARGS__))
// Bad user input (a wrong shape, dtype or value): raised in Python as ValueError.
#define MFSDP_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE((cond), ::mfsdp::msg(__VA_ARGS__))
