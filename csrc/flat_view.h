// Views of a flat buffer's element ranges, made on the hot path (per parameter per step).
#pragma once

#include <ATen/ATen.h>

#include "errors.h"

namespace mfsdp {

// `numel` elements of the 1-D contiguous `flat` from `offset`, as a 1-D view: one
// as_strided dispatch where narrow() makes two (slice, then as_strided). as_strided
// checks the range against the whole storage only; the check here keeps narrow's
// guard against reading past the buffer's own end.
inline at::Tensor flat_range(const at::Tensor& flat, int64_t offset, int64_t numel) {
  MFSDP_CHECK(offset >= 0 && numel >= 0 && offset + numel <= flat.numel(), "flat_range: elements [", offset, ", ",
              offset + numel, ") are outside a flat buffer of ", flat.numel(), " (internal error)");
  return flat.as_strided({numel}, {1}, flat.storage_offset() + offset);
}

}  // namespace mfsdp
