// The buffers of one gradient reduction of a unit (Unit::reduce_grads, reduce_together):
// made by Unit::plan_reduction, reduced, then landed as the sharded .grad.
#pragma once

#include <ATen/ATen.h>

namespace mfsdp {

// How the reduced shard meets the sharded .grad: the first gradient since zero_grad
// (views of a new buffer), added into our own flat gradient, or the rare mixed case
// (some .grad set by hand) merged per parameter.
enum class GradLanding { kFresh, kAccumulate, kMixed };

struct GradBuffers {
  GradLanding landing = GradLanding::kFresh;
  at::Tensor flat;     // packed unsharded grads, reduce dtype
  at::Tensor reduced;  // this rank's reduced segment, reduce dtype (may alias flat or target)
  at::Tensor target;   // fp32 (orig dtype) segment behind the sharded .grad views
                       // (offloaded: on the device, copied into `host` after the reduction)
  at::Tensor host;     // offloaded: where the reduced fp32 segment lands in host memory
  double scale = 1.0;  // the factor flat's (and so reduced's) values already carry
};

}  // namespace mfsdp
