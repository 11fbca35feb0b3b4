// BackendCaps: what a process group's backend can do for tensors of one device type.
//
// Collectives choose how to run from these (never from the backend's name elsewhere),
// so a backend this table does not know still works through the plain collectives every
// c10d backend has, and one that lacks something gets a fallback instead of a crash.
// What each known backend can do is written in backend.cpp, with the reason.
#pragma once

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <optional>
#include <string>

namespace mfsdp {

struct BackendCaps {
  std::string name;  // the backend's own name for this device type ("nccl", "gloo", "fake", ...)
  // false: every collective returns at once and moves nothing (torch's "fake" backend,
  // for sizing jobs on one device). Results are not real; cross-rank checks are skipped.
  bool moves_data = true;
  // The collective is enqueued on the caller's current device stream and the host never
  // waits for it (NCCL). Otherwise the host waits for it in Work::wait (Gloo stages
  // device tensors through pinned host memory).
  bool enqueues_on_stream = false;
  // _allgather_base / _reduce_scatter_base on flat buffers. Without them: an all-gather
  // into views of the output, and an all-reduce of the whole buffer (this rank's segment kept).
  bool flat_all_gather = true;
  bool flat_reduce_scatter = true;
  // allgather_into_tensor_coalesced / reduce_scatter_tensor_coalesced for the device
  // type. Without them: one collective per (out, in) pair.
  bool coalesced_all_gather = false;
  bool coalesced_reduce_scatter = false;
  // Uneven allgather / reduce_scatter with one view per rank (an NCCL group of
  // broadcasts / reduces). Without it the uneven collectives pad every segment.
  bool uneven_lists = false;
  // alltoall_base with per-rank split sizes. Without it, state dicts gather whole units
  // to cut FSDP2's rows instead of exchanging only the rows (csrc/row_exchange.h).
  bool all_to_all = false;
};

// The capabilities of `pg`'s backend for `device_type` tensors; nullopt when the group
// has no backend for that device type. A name the table does not know gets the plain
// collectives only (the struct's defaults).
std::optional<BackendCaps> backend_caps(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                        c10::DeviceType device_type);

// What `caps.name` can do for `device_type` from now on in this process (a backend of
// one's own, or one the table judges wrongly). Units made before keep what they read.
void register_backend_caps(c10::DeviceType device_type, const BackendCaps& caps);

// The table's entry for a backend name (the defaults for an unknown one).
BackendCaps known_backend_caps(const std::string& name, c10::DeviceType device_type);

}  // namespace mfsdp
