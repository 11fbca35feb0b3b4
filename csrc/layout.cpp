#include "layout.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace mfsdp {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("FlatLayout: " + what);
}

// Bounds that keep every offset computation below far from int64 overflow (and a
// layout's per-rank tables small): no real job comes near them.
constexpr int64_t kMaxWorldSize = int64_t{1} << 24;
constexpr int64_t kMaxAlignment = int64_t{1} << 20;
constexpr int64_t kMaxTotalNumel = int64_t{1} << 56;

void check_world_size(int64_t world_size) {
  check(world_size >= 1 && world_size <= kMaxWorldSize,
        "world_size must be in [1, " + std::to_string(kMaxWorldSize) + "], got " + std::to_string(world_size));
}

void check_common(const std::vector<int64_t>& numels, int64_t world_size,
                  int64_t alignment) {
  check_world_size(world_size);
  check(alignment >= 1 && alignment <= kMaxAlignment,
        "alignment must be in [1, " + std::to_string(kMaxAlignment) + "], got " + std::to_string(alignment));
  int64_t total = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    check(numels[i] >= 0, "parameter " + std::to_string(i) + " has negative numel " +
                              std::to_string(numels[i]));
    // Each parameter may add up to alignment - 1 elements of padding before it.
    check(numels[i] <= kMaxTotalNumel - total - alignment,
          "parameters hold more than " + std::to_string(kMaxTotalNumel) + " elements in total");
    total += numels[i] + alignment;
  }
}

}  // namespace

FlatLayout FlatLayout::even(const std::vector<int64_t>& numels, int64_t world_size,
                            int64_t alignment) {
  check_common(numels, world_size, alignment);
  FlatLayout l;
  l.kind_ = SegmentKind::kEven;
  l.world_size_ = world_size;
  l.alignment_ = alignment;
  l.numels_ = numels;
  l.offsets_.resize(numels.size());
  int64_t cursor = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    cursor = round_up(cursor, alignment);
    l.offsets_[i] = cursor;
    cursor += numels[i];
  }
  // Every segment is a whole number of alignment units, so each rank's shard starts
  // aligned too (vectorised casts, 16-byte NCCL buffers).
  const int64_t seg = round_up((cursor + world_size - 1) / world_size, alignment);
  l.total_ = seg * world_size;
  for (int64_t r = 0; r < world_size; ++r) {
    l.seg_starts_.push_back(r * seg);
    l.seg_numels_.push_back(seg);
  }
  l.finish();
  return l;
}

FlatLayout FlatLayout::by_owner(const std::vector<int64_t>& numels,
                                const std::vector<int64_t>& owners, int64_t world_size,
                                int64_t alignment) {
  check_common(numels, world_size, alignment);
  check(owners.size() == numels.size(),
        "owners has " + std::to_string(owners.size()) + " entries for " +
            std::to_string(numels.size()) + " parameters");
  for (size_t i = 0; i < owners.size(); ++i) {
    check(owners[i] >= 0 && owners[i] < world_size,
          "parameter " + std::to_string(i) + " has owner " + std::to_string(owners[i]) +
              " outside [0, " + std::to_string(world_size) + ")");
  }
  FlatLayout l;
  l.kind_ = SegmentKind::kOwner;
  l.world_size_ = world_size;
  l.alignment_ = alignment;
  l.numels_ = numels;
  l.owners_ = owners;
  l.offsets_.resize(numels.size());
  int64_t cursor = 0;
  for (int64_t r = 0; r < world_size; ++r) {
    const int64_t start = cursor;
    for (size_t i = 0; i < numels.size(); ++i) {
      if (owners[i] != r) continue;
      cursor = round_up(cursor, alignment);
      l.offsets_[i] = cursor;
      cursor += numels[i];
    }
    cursor = round_up(cursor, alignment);  // next segment starts aligned
    l.seg_starts_.push_back(start);
    l.seg_numels_.push_back(cursor - start);
  }
  l.total_ = cursor;
  l.finish();
  return l;
}

void FlatLayout::finish() {
  int64_t covered = 0;
  for (int64_t n : numels_) covered += n;
  has_gaps_ = covered != total_;
}

int64_t FlatLayout::max_segment_numel() const {
  return seg_numels_.empty() ? 0 : *std::max_element(seg_numels_.begin(), seg_numels_.end());
}

ShardSlice FlatLayout::shard_slice(int64_t i, int64_t rank) const {
  check(rank >= 0 && rank < world_size_, "rank " + std::to_string(rank) + " out of range");
  const int64_t p0 = offsets_.at(i), p1 = p0 + numels_.at(i);
  const int64_t s0 = seg_starts_[rank], s1 = s0 + seg_numels_[rank];
  const int64_t lo = std::max(p0, s0), hi = std::min(p1, s1);
  ShardSlice s;
  if (hi > lo) {
    s.param_offset = lo - p0;
    s.shard_offset = lo - s0;
    s.numel = hi - lo;
  } else {
    // Empty slice: keep the offsets inside the segment so a zero-length view is valid.
    s.param_offset = 0;
    s.shard_offset = std::min(std::max(p0 - s0, int64_t{0}), seg_numels_[rank]);
    s.numel = 0;
  }
  return s;
}

std::vector<ShardSlice> FlatLayout::shard_slices(int64_t rank) const {
  std::vector<ShardSlice> out;
  out.reserve(numels_.size());
  for (int64_t i = 0; i < num_params(); ++i) out.push_back(shard_slice(i, rank));
  return out;
}

double FlatLayout::padding_fraction() const {
  if (total_ == 0) return 0.0;
  int64_t covered = 0;
  for (int64_t n : numels_) covered += n;
  return static_cast<double>(total_ - covered) / static_cast<double>(total_);
}

std::string FlatLayout::describe() const {
  // std::to_string only: see errors.h for why this extension avoids iostreams.
  std::string s = std::string("FlatLayout(") + (kind_ == SegmentKind::kEven ? "even" : "owner") +
                  ", params=" + std::to_string(numels_.size()) + ", total=" + std::to_string(total_) +
                  ", world=" + std::to_string(world_size_) + ", align=" + std::to_string(alignment_) +
                  ", segments=[";
  for (int64_t r = 0; r < world_size_; ++r) {
    s += (r ? ", " : "") + std::to_string(seg_starts_[r]) + "+" + std::to_string(seg_numels_[r]);
  }
  return s + "])";
}

std::vector<int64_t> balance_owners(const std::vector<double>& costs, int64_t world_size,
                                    std::vector<double>* loads) {
  check_world_size(world_size);
  for (size_t i = 0; i < costs.size(); ++i) {
    check(costs[i] >= 0 && costs[i] < std::numeric_limits<double>::infinity(),
          "cost of parameter " + std::to_string(i) + " must be finite and >= 0");
  }
  std::vector<size_t> order(costs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  std::vector<double> local(world_size, 0.0);
  std::vector<double>& load = loads ? *loads : local;
  if (load.empty()) load.assign(world_size, 0.0);
  check(static_cast<int64_t>(load.size()) == world_size,
        "loads has " + std::to_string(load.size()) + " entries for world_size " + std::to_string(world_size));
  std::vector<int64_t> owners(costs.size(), 0);
  for (size_t i : order) {
    const auto best = std::min_element(load.begin(), load.end()) - load.begin();
    owners[i] = best;
    load[best] += costs[i];
  }
  return owners;
}

}  // namespace mfsdp
