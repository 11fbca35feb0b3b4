// GatherBytes: where a unit's gathered copy lives when its parameters gather in dtypes of
// different widths (an FP8 weight beside bf16 norms). The gathered buffer is bytes; every
// element of the flat layout takes its parameter's gathered width (padding takes the
// width of the parameter before it), so
//  - each parameter's gathered copy is one contiguous byte range (a view, no copy-out);
//  - each rank's contribution is one contiguous byte range, in rank order;
//  - a parameter that starts on an aligned element of the layout starts on an address
//    aligned to alignment x its width (16 bytes for fp8 with the default alignment).
// Ranks then contribute unequal byte counts: the gather is an uneven all-gather.
//
// Pure C++ (no torch): computed once per unit, testable without a process group.
#pragma once

#include <cstdint>
#include <vector>

#include "layout.h"

namespace mfsdp {

struct GatherBytes {
  std::vector<int64_t> param_starts;    // byte offset of each parameter's gathered copy
  std::vector<int64_t> segment_starts;  // byte offset of each rank's contribution
  std::vector<int64_t> segment_bytes;   // its length in bytes
  int64_t total = 0;                    // bytes of the whole gathered buffer

  // Byte offset of element `pos` of the layout (0 <= pos <= total_numel).
  int64_t byte_of(int64_t pos) const;

  // Kept to answer byte_of: the layout's parameter offsets and each span's width.
  std::vector<int64_t> span_starts;  // element offsets where a width begins
  std::vector<int64_t> span_widths;  // bytes per element from that offset on
};

// `widths`: bytes per element of each parameter's gathered copy (layout.num_params()).
GatherBytes gather_bytes_of(const FlatLayout& layout, const std::vector<int64_t>& widths);

}  // namespace mfsdp
