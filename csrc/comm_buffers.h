// Communication buffers: where a unit's all-gather output and reduce-scatter input live.
//
// NCCL runs a collective on registered memory in place: with user-buffer registration
// the peers read and write the buffer itself over NVLink instead of staging through
// NCCL's own buffers, which takes fewer SMs and fewer copies. c10d exposes it as
// Backend::allocateTensor: memory from the backend's pool (ncclMemAlloc), registered
// with the group's communicator (FSDP2's set_allocate_memory_from_process_group_for_comm,
// Megatron-FSDP's nccl_ub). The pool is the group's own, so its freed blocks are reused
// by communication buffers only.
#pragma once

#include "comm.h"

#include <ATen/ATen.h>

namespace mfsdp {

enum class CommBufferSource {
  kCachingAllocator = 0,  // torch's caching allocator, like every other tensor
  kProcessGroup = 1,      // the group's backend (registered with its communicator)
};

// Whether `comm`'s backend allocates `device` tensors itself (NCCL on a device and NCCL
// version that support it). False at world 1: nothing is communicated.
bool group_allocates(const Communicator& comm, const c10::Device& device);

// Makes sure the group's communicator exists, which the backend needs before it can
// register its pool: one 1-element all-reduce the first time per group in this process.
// Collective: every rank of the group calls it at the same point.
void connect_for_allocation(const Communicator& comm, const c10::Device& device);

// `numel` elements of `options`, allocated on the current stream: from the group's
// backend when `from_group` (group_allocates was true and the group is connected), else
// from the caching allocator.
at::Tensor allocate_comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                                bool from_group);

}  // namespace mfsdp
