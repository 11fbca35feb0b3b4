// Views of a flat buffer's element ranges, made on the hot path (per parameter per step).
#pragma once

#include <ATen/ATen.h>

namespace mfsdp {

// `numel` elements of the 1-D contiguous `flat` from `offset`, as a 1-D view: one
// as_strided dispatch where narrow() makes two (slice, then as_strided).
inline at::Tensor flat_range(const at::Tensor& flat, int64_t offset, int64_t numel) {
  return flat.as_strided({numel}, {1}, flat.storage_offset() + offset);
}

}  // namespace mfsdp
