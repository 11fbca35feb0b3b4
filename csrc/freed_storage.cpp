#include "freed_storage.h"

#include <optional>
#include <type_traits>
#include <utility>

namespace mfsdp {
namespace {

// torch lets a storage refuse data access with a custom message (what CUDA-graph trees
// use for freed memory). Detected rather than assumed, so the extension still builds
// against a torch without it; freed storage then simply has a null pointer.
template <typename S, typename = void>
struct CanRefuseAccess : std::false_type {};
template <typename S>
struct CanRefuseAccess<S, std::void_t<decltype(std::declval<S&>().clear_data_ptr_access_error_msg_()),
                                      decltype(std::declval<S&>().release_data_and_set_meta_custom_data_ptr_error_msg_(
                                          std::optional<std::string>()))>> : std::true_type {};

// Templates, so that a torch without the calls never instantiates them.
template <typename S>
void refuse_access_if_supported(S* impl, const std::string& why) {
  if constexpr (CanRefuseAccess<S>::value) impl->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
}

template <typename S>
void allow_access_if_supported(S* impl) {
  if constexpr (CanRefuseAccess<S>::value) impl->clear_data_ptr_access_error_msg_();
}

}  // namespace

bool freed_storage_guard() { return CanRefuseAccess<c10::StorageImpl>::value; }

void refuse_access(c10::StorageImpl* impl, const std::string& why) { refuse_access_if_supported(impl, why); }

void allow_access(c10::StorageImpl* impl) { allow_access_if_supported(impl); }

}  // namespace mfsdp
