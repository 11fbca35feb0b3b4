#include "gather_bytes.h"

#include <algorithm>

#include "errors.h"

namespace mfsdp {

int64_t GatherBytes::byte_of(int64_t pos) const {
  // The last span starting at or before `pos`.
  auto it = std::upper_bound(span_starts.begin(), span_starts.end(), pos);
  if (it == span_starts.begin()) return pos * (span_widths.empty() ? 1 : span_widths.front());
  const size_t k = static_cast<size_t>(it - span_starts.begin()) - 1;
  int64_t bytes = 0;
  for (size_t j = 0; j < k; ++j) bytes += (span_starts[j + 1] - span_starts[j]) * span_widths[j];
  return bytes + (pos - span_starts[k]) * span_widths[k];
}

GatherBytes gather_bytes_of(const FlatLayout& layout, const std::vector<int64_t>& widths) {
  MFSDP_CHECK(static_cast<int64_t>(widths.size()) == layout.num_params(), "gather_bytes_of: ", widths.size(),
              " widths for ", layout.num_params(), " parameters");
  for (auto w : widths) MFSDP_CHECK(w > 0, "gather_bytes_of: element widths must be positive, got ", w);
  GatherBytes g;
  // Parameters in layout order (an owner layout places them rank by rank, not by index).
  std::vector<int64_t> order(widths.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return layout.param_offset(a) < layout.param_offset(b); });
  // Elements before the first parameter (none in the layouts built here) take its width.
  for (int64_t i : order) {
    const int64_t start = g.span_starts.empty() ? 0 : layout.param_offset(i);
    if (!g.span_starts.empty() && g.span_starts.back() == start) {
      g.span_widths.back() = widths[i];  // a zero-size parameter's span is empty
      continue;
    }
    g.span_starts.push_back(start);
    g.span_widths.push_back(widths[i]);
  }
  g.param_starts.resize(widths.size());
  for (size_t i = 0; i < widths.size(); ++i) g.param_starts[i] = g.byte_of(layout.param_offset(i));
  for (int64_t r = 0; r < layout.world_size(); ++r) {
    const int64_t begin = g.byte_of(layout.segment_start(r));
    g.segment_starts.push_back(begin);
    g.segment_bytes.push_back(g.byte_of(layout.segment_start(r) + layout.segment_numel(r)) - begin);
  }
  g.total = g.byte_of(layout.total_numel());
  return g;
}

}  // namespace mfsdp
