// Communicator: the collectives FSDP needs, over one c10d::ProcessGroup.
//
// Contract: every collective is issued with asyncOp=false and its Work (if any) is waited
// before the call returns. What that means depends on the backend (BackendCaps):
//  - enqueues_on_stream (NCCL): the collective runs on the caller's *current* stream
//    (set a stream guard first) and completes in stream order; the host never waits.
//  - otherwise (Gloo; CPU tensors on any backend): the host waits in Work::wait until
//    the collective is done; for CUDA tensors the caller's current stream is then made
//    to wait for the copy back to the device, so results are again in stream order.
//  - moves_data == false (fake): nothing moves; outputs hold whatever was there.
// What a backend lacks is replaced by a fallback (per-pair collectives instead of a
// coalesced one, padding instead of uneven lists, an all-reduce instead of a flat
// reduce-scatter); a collective the backend refuses raises naming backend and collective.
#pragma once

#include "backend.h"
#include "errors.h"
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <vector>

namespace mfsdp {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// How an uneven (v) collective is carried out.
//  kGrouped: one NCCL group of per-rank broadcasts / reduces through the process
//            group's uneven allgather / reduce_scatter, straight into views (NCCL only).
//  kPadded:  pad every segment to the longest, run the even collective, compact.
//            Works on every backend; costs a copy and (max - mean) extra bytes.
//  kAllReduce: (reduce_scatter_v only) all-reduce the whole buffer, keep our segment.
//  kAuto:    auto_var_algo() below: chosen by what the backend can do, collective, size
//            and imbalance.
enum class VarAlgo { kAuto = 0, kGrouped = 1, kPadded = 2, kAllReduce = 3 };

// FNV-1a over raw bytes (chainable through `h`): the cheap fingerprint ranks exchange
// in cross-rank checks.
inline uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 1469598103934665603ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

// What kAuto means. Measured on 2xH200 (NCCL 2.28, fp32, segments 1:2, benchmarks/RESULTS.md):
// all_gather_v GROUPED vs PADDED 0.07 vs 0.13 ms at 1 MiB, equal at 64 MiB, 1.40 vs 1.37 ms
// at 256 MiB; reduce_scatter_v GROUPED beat PADDED and ALL_REDUCE from 16 MiB up (0.56 vs
// 1.17 ms at 256 MiB). So: GROUPED, except PADDED for an all-gather of at least
// kPaddedAllGatherMinBytes whose padding adds at most a third (ties go to GROUPED, which
// allocates nothing); PADDED where the backend has no uneven lists (`grouped` false:
// Gloo, fake, unknown backends, any backend on CPU tensors).
constexpr int64_t kPaddedAllGatherMinBytes = int64_t{256} << 20;
VarAlgo auto_var_algo(bool all_gather, bool grouped, int64_t total_numel, int64_t longest_numel,
                      int world, int64_t element_size);

// Collectives this process issued through any Communicator, by kind: c10d calls (a
// coalesced collective is one) and bytes of the collective's whole buffer (all-gather
// output, reduce-scatter input, all-reduce / broadcast tensor). For measurements.
enum class CollectiveKind { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2, kBroadcast = 3, kAllToAll = 4 };
constexpr int kNumCollectiveKinds = 5;
const char* collective_kind_name(CollectiveKind kind);
struct CollectiveCount {
  int64_t calls = 0;
  int64_t bytes = 0;
};
CollectiveCount collective_count(CollectiveKind kind);
void reset_collective_counts();

// Sum and maximum of an uneven collective's segment sizes.
struct SegmentExtent {
  int64_t total = 0;
  int64_t longest = 0;
};

class Communicator {
 public:
  Communicator() = default;
  explicit Communicator(ProcessGroupPtr pg);

  bool defined() const { return static_cast<bool>(pg_); }
  // What the group's backend can do for `type` tensors; null when it has no backend for them.
  const BackendCaps* caps(c10::DeviceType type) const;
  // False under a backend that moves nothing (fake): cross-rank checks are skipped.
  bool moves_data(c10::DeviceType type) const {
    const BackendCaps* c = caps(type);
    return c == nullptr || c->moves_data;
  }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const ProcessGroupPtr& group() const { return pg_; }

  // out (size * in.numel()) <- concatenation of every rank's `in`. `in` may alias
  // out's own segment (in-place all-gather).
  void all_gather_flat(at::Tensor& out, at::Tensor& in) const;
  // all_gather_flat for several (out, in) pairs as one collective: one c10d call, one
  // NCCL group (pairs with no elements are skipped). Every rank passes the same sizes.
  void all_gather_flat_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) const;
  // out (in.numel() / size) <- SUM over ranks of this rank's segment of `in`.
  void reduce_scatter_flat(at::Tensor& out, at::Tensor& in) const;
  // reduce_scatter_flat for several (out, in) pairs as one collective: one c10d call,
  // one NCCL group (pairs with no elements are skipped). Every rank passes the same sizes.
  void reduce_scatter_flat_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) const;
  void all_reduce(at::Tensor& t, c10d::ReduceOp::RedOpType op) const;

  // Uneven all-gather: rank r contributes numels[r] elements (`in`), which land at
  // out[starts[r], starts[r] + numels[r]). Segments may be empty. Every rank must pass
  // the same starts/numels; `verify` checks that first with one small all-gather
  // (callers whose tables come from a layout already checked across ranks skip it).
  void all_gather_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& numels, VarAlgo algo = VarAlgo::kAuto,
                    bool verify = false) const;
  // Uneven reduce-scatter (SUM): out (numels[rank]) <- sum over ranks of
  // in[starts[rank], starts[rank] + numels[rank]).
  void reduce_scatter_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& starts,
                        const std::vector<int64_t>& numels, VarAlgo algo = VarAlgo::kAuto,
                        bool verify = false) const;
  void broadcast(at::Tensor& t, int root) const;
  // Every rank sends in_splits[q] elements of `in` (in rank order) to rank q and receives
  // out_splits[p] elements from rank p into `out` (in rank order). The splits must pair
  // up across ranks (what p sends q is what q expects from p); callers derive them from
  // one plan every rank computes alike. Needs caps().all_to_all.
  void all_to_all_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& out_splits,
                    const std::vector<int64_t>& in_splits) const;
  // Every rank's `values` (the same length on every rank), in rank order, on the host:
  // the small synchronous exchange behind the cross-rank checks. Staged on `device`.
  std::vector<int64_t> all_gather_host(const std::vector<int64_t>& values, const c10::Device& device) const;

 private:
  // The capabilities for `t`'s device; raises naming the collective when the group has
  // no backend for it.
  const BackendCaps& caps_for(const char* what, const at::Tensor& t) const;
  // Calls the backend (`call` returns its Work), counts it and waits for it; a failure
  // is rethrown naming the collective and the backend.
  template <typename F>
  void issue(const char* what, const BackendCaps& caps, CollectiveKind kind, int64_t bytes, F&& call) const;
  void check_buffer(const char* what, const char* which, const at::Tensor& t) const;
  void check_pair(const char* what, const at::Tensor& out, const at::Tensor& in) const;
  // The (out, in) pairs of a coalesced collective that need communication, each checked
  // (`gather`: out holds size x in, else in holds size x out), into out_list/in_list.
  // At world 1 each pair is copied here instead; empty pairs are dropped.
  void coalesced_pairs(const char* what, bool gather, std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                       std::vector<at::Tensor>& out_list, std::vector<at::Tensor>& in_list) const;
  void check_segments_agree(const char* what, const c10::Device& device, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& numels) const;
  void check_segments(const char* what, const at::Tensor& flat, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& numels) const;
  // Refuses an explicit GROUPED where the backend has no uneven lists (at any world size).
  void check_grouped_available(VarAlgo algo, const at::Tensor& t) const;
  VarAlgo resolve(VarAlgo algo, bool all_gather, const at::Tensor& t,
                  const SegmentExtent& extent) const;

  ProcessGroupPtr pg_;
  std::optional<BackendCaps> cpu_caps_, cuda_caps_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace mfsdp
