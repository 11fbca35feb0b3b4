// Unit: how its collectives run and fail. Each runs under a profiler scope naming the unit;
// with the collective check the ranks first compare (unit, phase, size); a failure is
// rethrown naming the unit(s), the phase and the likely causes.
#include "unit.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace mfsdp {
namespace {

// Every label this process gave a unit, by hash: the collective check names the unit
// another rank is at (all ranks built the same units, so the same labels).
std::mutex& labels_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, std::string>& labels_by_hash() {
  static std::unordered_map<int64_t, std::string> labels;
  return labels;
}

constexpr const char* kDesyncHint =
    "\nEvery rank must run the same fully_shard units in the same order (same model and sharding strategy, "
    "forward and backward on every rank). A rank that stalls, skips backward or runs an extra unit leaves the "
    "others waiting until the collective timeout (fully_shard(timeout=...), else the process group's).";

// Rethrows a failed collective as DistBackendError naming what it was for (`subject`:
// "unit 'x'" or the units of a coalesced gather), the rank and the likely causes.
[[noreturn]] void throw_collective_failure(CollectivePhase phase, const std::string& subject, int rank, int world,
                                           const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string cause = c10_error ? c10_error->what_without_backtrace() : e.what();
  C10_THROW_ERROR(DistBackendError, msg("megatron_fsdp_ext: ", phase_name(phase), " of fully_shard ", subject,
                                        " failed on rank ", rank, " of ", world, ": ", cause, kDesyncHint));
}

// How a coalesced collective's failure names its units: 'a', 'b', 'c'.
std::string quoted_labels(const std::vector<Unit*>& units) {
  std::string labels;
  for (const Unit* u : units) labels += (labels.empty() ? "'" : ", '") + u->label() + "'";
  return labels;
}

}  // namespace

void Unit::set_label(std::string label) {
  label_ = std::move(label);
  label_hash_ = static_cast<int64_t>(fnv1a(label_.data(), label_.size()));
  // Built here, not at every reshard: free_unsharded() is on the hot path.
  freed_message_ = msg("megatron_fsdp_ext: this tensor is an unsharded parameter (or a view of one) of fully_shard "
                       "unit '", label_, "', whose memory was freed by reshard(); it holds no data until the unit "
                       "is unsharded again. Keep a copy (tensor.detach().clone()) while it is unsharded, or read the "
                       "sharded parameter / model.state_dict() instead.");
  static constexpr const char* kScopes[] = {"all_gather", "reduce_scatter", "all_reduce", "all_gather_full",
                                             "all_reduce_replicas", "exchange_rows", "all_reduce_fp8_amax",
                                             "all_reduce_grad_mask", "all_gather_post_forward"};
  static_assert(std::size(kScopes) == std::tuple_size_v<decltype(profile_scopes_)>);
  for (size_t i = 0; i < profile_scopes_.size(); ++i) profile_scopes_[i] = msg("mfsdp::", kScopes[i], "[", label_, "]");
  unshard_scope_ = msg("mfsdp::unshard[", label_, "]");
  reshard_scope_ = msg("mfsdp::reshard[", label_, "]");
  std::lock_guard<std::mutex> lock(labels_mutex());
  labels_by_hash()[label_hash_] = label_;
}

void Unit::check_in_step(CollectivePhase phase, const Communicator& comm, int64_t numel, int64_t together) const {
  // Under a backend that moves nothing (fake) every rank would only see itself.
  if (!comm.moves_data(device_.type())) return;
  const int n = comm.size();
  const std::vector<int64_t> mine{label_hash_, static_cast<int64_t>(phase), numel, together};
  const auto all = comm.all_gather_host(mine, device_);
  const auto how = [](int64_t units) {
    return units > 1 ? msg(", in one collective of ", units, " units") : std::string();
  };
  for (int r = 0; r < n; ++r) {
    const int64_t* theirs = all.data() + 4 * r;
    if (std::equal(mine.begin(), mine.end(), theirs)) continue;
    std::string their_label = "(a unit this rank does not have)";
    {
      std::lock_guard<std::mutex> lock(labels_mutex());
      auto it = labels_by_hash().find(theirs[0]);
      if (it != labels_by_hash().end()) their_label = it->second;
    }
    const auto their_phase = static_cast<CollectivePhase>(theirs[1]);
    C10_THROW_ERROR(DistBackendError,
                    msg("megatron_fsdp_ext: collectives out of step: rank ", comm.rank(), " is at the ",
                        phase_name(phase), " of fully_shard unit '", label_, "' (", numel, " elements", how(together),
                        ") but rank ", r, " is at the ", phase_name(their_phase), " of unit '", their_label, "' (",
                        theirs[2], " elements", how(theirs[3]), ").", kDesyncHint,
                        together != theirs[3] ? " Ranks that bucket differently (gather_bucket_bytes, "
                                                "reduce_bucket_bytes) are out of step too." : ""));
  }
}

void Unit::run_collective(CollectivePhase phase, const Communicator& comm, int64_t numel,
                          c10::function_ref<void()> issue) {
  RECORD_USER_SCOPE(profile_scopes_[static_cast<size_t>(phase)].c_str());
  if (check_collectives_) check_in_step(phase, comm, numel);
  try {
    issue();
  } catch (const std::exception& e) {
    throw_collective_failure(phase, msg("unit '", label_, "'"), rank(), world_size(), e);
  }
}

void Unit::run_coalesced(CollectivePhase phase, const std::vector<Unit*>& units, const std::vector<int64_t>& numels,
                         const Communicator& comm, c10::function_ref<void()> issue) {
  const Unit& lead = *units.front();
  // "mfsdp::all_gather[x]" -> "mfsdp::all_gather[x +2 units]"
  std::string scope = lead.profile_scopes_[static_cast<size_t>(phase)];
  if (units.size() > 1) scope.insert(scope.size() - 1, msg(" +", units.size() - 1, " units"));
  RECORD_USER_SCOPE(scope.c_str());
  int64_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    if (lead.check_collectives_) {
      units[i]->check_in_step(phase, comm, numels[i], static_cast<int64_t>(units.size()));
    }
    total += numels[i];
  }
  try {
    issue();
  } catch (const std::exception& e) {
    throw_collective_failure(phase, msg("units ", quoted_labels(units), " (one coalesced collective of ", total,
                                        " elements)"),
                             lead.rank(), lead.world_size(), e);
  }
}

}  // namespace mfsdp
