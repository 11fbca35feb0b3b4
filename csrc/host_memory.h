// Host buffers for CPU offload. A buffer the device copies to or from on a stream must be
// page-locked (pinned) for the copy to be asynchronous.
#pragma once

#include <ATen/ATen.h>

namespace mfsdp {

// Whether this process can pin host memory (a CUDA build with a device).
bool can_pin_host_memory();

// An uninitialized 1-D host tensor of `numel` elements of `dtype`. With `pin` its pages are
// registered with the CUDA driver: exactly the bytes asked for (rounded to a page), where
// torch's pinned allocator rounds every block up to a power of two, up to twice the size of
// an offloaded shard. `pin` without can_pin_host_memory() is an error.
at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pin);

}  // namespace mfsdp
