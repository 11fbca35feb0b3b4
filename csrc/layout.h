// FlatLayout: where every parameter of a unit lives in one flat buffer, and how that
// buffer is split into one contiguous segment per rank.
//
// Pure C++ (no torch): everything per-parameter is computed once here and is testable
// without a process group.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mfsdp {

// The part of one parameter that lies in one rank's segment.
struct ShardSlice {
  int64_t param_offset = 0;  // first element of the slice, counted inside the parameter
  int64_t shard_offset = 0;  // the same element, counted inside the rank's segment
  int64_t numel = 0;         // 0 when the parameter does not touch the segment
};

enum class SegmentKind {
  kEven,   // equal segments cut anywhere (ZeRO): all-gather / reduce-scatter
  kOwner,  // each parameter wholly inside its owner's segment; segments uneven
};

// Every parameter starts at a multiple of this many elements (32 bytes in bf16, 64 in
// fp32): vectorized pack/cast kernels and NCCL get aligned addresses. The one default
// the bindings and the Python API share (DEFAULT_ALIGNMENT).
inline constexpr int64_t kDefaultAlignment = 16;

class FlatLayout {
 public:
  // Even (ZeRO) layout: parameters packed in order, each start aligned to `alignment`
  // elements, total padded so that it splits into `world_size` equal segments whose
  // length is itself a multiple of `alignment`.
  static FlatLayout even(const std::vector<int64_t>& numels, int64_t world_size,
                         int64_t alignment);

  // Owner layout: parameter i belongs wholly to rank owners[i]. Parameters are placed
  // rank by rank (keeping their relative order inside a rank), so segment r is a
  // contiguous, possibly empty, range [segment_start(r), segment_end(r)).
  static FlatLayout by_owner(const std::vector<int64_t>& numels,
                             const std::vector<int64_t>& owners, int64_t world_size,
                             int64_t alignment);

  SegmentKind kind() const { return kind_; }
  int64_t world_size() const { return world_size_; }
  int64_t alignment() const { return alignment_; }
  int64_t num_params() const { return static_cast<int64_t>(numels_.size()); }
  int64_t total_numel() const { return total_; }  // padded unsharded length
  int64_t param_numel(int64_t i) const { return numels_.at(i); }
  int64_t param_offset(int64_t i) const { return offsets_.at(i); }
  int64_t segment_start(int64_t rank) const { return seg_starts_.at(rank); }
  int64_t segment_numel(int64_t rank) const { return seg_numels_.at(rank); }
  int64_t max_segment_numel() const;
  // Owner of parameter i (kOwner), or -1 for even layouts where params may span ranks.
  int64_t owner(int64_t i) const { return owners_.empty() ? -1 : owners_.at(i); }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<int64_t>& numels() const { return numels_; }
  const std::vector<int64_t>& segment_starts() const { return seg_starts_; }
  const std::vector<int64_t>& segment_numels() const { return seg_numels_; }

  // Intersection of parameter i with the segment of `rank`.
  ShardSlice shard_slice(int64_t i, int64_t rank) const;
  std::vector<ShardSlice> shard_slices(int64_t rank) const;

  // True when [0, total) is not fully covered by parameters (alignment gaps or tail
  // padding): a gradient buffer then needs zero-filling before packing.
  bool has_gaps() const { return has_gaps_; }
  // Elements of padding (alignment gaps + tail) as a fraction of total_numel().
  double padding_fraction() const;

  std::string describe() const;

 private:
  FlatLayout() = default;
  void finish();

  SegmentKind kind_ = SegmentKind::kEven;
  int64_t world_size_ = 1;
  int64_t alignment_ = 1;
  int64_t total_ = 0;
  bool has_gaps_ = false;
  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> owners_;
  std::vector<int64_t> seg_starts_;
  std::vector<int64_t> seg_numels_;
};

// Owner per parameter balancing total cost across ranks: largest cost first, each to
// the rank with the least cost so far (ties: lowest rank, then original order), so
// every rank computes the same answer. Costs must be finite and >= 0. `loads` (one
// per rank, or empty for zeros) is the cost already assigned, e.g. by earlier buckets,
// and is updated in place.
std::vector<int64_t> balance_owners(const std::vector<double>& costs, int64_t world_size,
                                    std::vector<double>* loads = nullptr);

}  // namespace mfsdp
