// Communication buffers: where a unit's all-gather output and reduce-scatter input live.
//
// NCCL runs a collective on registered memory in place: with user-buffer registration
// the peers read and write the buffer itself over NVLink instead of staging through
// NCCL's own buffers (for the all-gather: fewer channels, so fewer SMs, and from a few
// MiB up less time). c10d exposes it as Backend::allocateTensor: memory from the
// backend's pool (ncclMemAlloc), registered with the group's communicator (FSDP2's
// set_allocate_memory_from_process_group_for_comm, Megatron-FSDP's nccl_ub). The pool is
// the group's own, so its freed blocks are reused by communication buffers only.
#pragma once

#include "comm.h"

#include <ATen/ATen.h>

namespace mfsdp {

enum class CommBufferSource {
  kCachingAllocator = 0,  // torch's caching allocator, like every other tensor
  kProcessGroup = 1,      // the group's backend (registered with its communicator)
};

// Whether `comm`'s backend allocates `device` tensors itself (torch's
// Backend::supportsTensorAlloc: ProcessGroupNCCL on a GPU with NVLink multicast support).
// False at world 1: nothing is communicated.
bool group_allocates(const Communicator& comm, const c10::Device& device);

// The backend registers its pool with the group's communicator, which must exist, so a
// group's buffers come from it only once a collective of the group has run on the
// device (Communicator records it). Until then they come from the caching allocator:
// no collective of its own is needed, and ranks need not agree on anything.
void note_device_collective(const ProcessGroupPtr& pg);
bool ran_device_collective(const ProcessGroupPtr& pg);

// `numel` elements of `options`, allocated on the current stream: from the group's
// backend when `from_group` (the caller checked that the backend allocates and that the
// group has run a device collective), else from the caching allocator.
at::Tensor allocate_comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                                bool from_group);

}  // namespace mfsdp
