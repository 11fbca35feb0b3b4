// Unit: CPU offload (the shard and its gradient in host memory) and the overlapped host
// step: the copies in before a gather, the copy out after a reduction, the host buffers.
#include "unit.h"

#include "grad_buffers.h"
#include "host_memory.h"

#include <utility>

namespace mfsdp {

void Unit::offload_to_host(bool pin_memory) {
  MFSDP_CHECK(sharded_params_.empty(), "offload_to_host: unit '", label_, "' already has its parameters (call it "
              "before bind_params)");
  if (offloaded_) return;
  MFSDP_CHECK_VALUE(!replicated() && !full_grads(), "CPU offload of unit '", label_, "' needs a sharding strategy that "
                    "reduce-scatters gradients ('optim_grads_params' or 'optim_grads'), not '", traits(strategy_).name,
                    "'");
  MFSDP_CHECK_VALUE(!gathers_bytes(), "CPU offload of unit '", label_, "': the FP8 gather does not combine with "
                    "offloading yet");
  pinned_ = pin_memory && device_.is_cuda();
  at::Tensor host = empty_host(sharded_flat_.numel(), orig_dtype_, pinned_);
  host.copy_(sharded_flat_);
  sharded_flat_ = host;
  for (auto& spec : specs_) spec.storage_device = host.device();
  if (param_dtype_ == at::kBFloat16 && orig_dtype_ == at::kFloat) {
    host_gather_copy_ = empty_host(sharded_flat_.numel(), param_dtype_, pinned_);
  }
  offloaded_ = true;
}

void Unit::set_host_update(std::shared_ptr<HostTask> task) {
  wait_host_update();  // one in flight at a time
  host_update_ = std::move(task);
}

void Unit::wait_host_update() {
  if (!host_update_) return;
  auto task = std::move(host_update_);
  task->wait();
}

void Unit::mark_host_copy_fresh() {
  MFSDP_CHECK(host_gather_copy_.defined(), "mark_host_copy_fresh: unit '", label_, "' has no host gather copy");
  host_copy_generation_ = shard_generation_;
  host_copy_version_ = sharded_flat_._version();
}

int64_t Unit::host_nbytes() const {
  if (!offloaded_) return 0;
  int64_t bytes = sharded_flat_.nbytes();
  if (host_gather_copy_.defined()) bytes += host_gather_copy_.nbytes();
  if (host_grad_.defined()) bytes += host_grad_.nbytes();
  return bytes;
}

void Unit::copy_shard_in(at::Tensor& dst) const {
  if (host_copy_fresh() && dst.scalar_type() == host_gather_copy_.scalar_type()) {
    dst.copy_(host_gather_copy_, /*non_blocking=*/pinned_);
  } else if (dst.scalar_type() == orig_dtype_ || !dst.is_cuda()) {
    dst.copy_(sharded_flat_, /*non_blocking=*/pinned_);
  } else {
    // Copied as stored, then cast on the device: a cross-device copy that casts would cast
    // on the host first, synchronously.
    at::Tensor staging = at::empty({sharded_flat_.numel()}, device_options(orig_dtype_));
    staging.copy_(sharded_flat_, /*non_blocking=*/pinned_);
    dst.copy_(staging);
  }
}

at::Tensor Unit::host_grad_buffer() {
  if (!host_grad_.defined()) {
    host_grad_ = empty_host(sharded_flat_.numel(), orig_dtype_, pinned_);
  } else if (host_grad_.storage().use_count() > 1) {
    // A .grad view (or anything else) still holds the kept buffer: leave it to them. The
    // successor comes from torch's caching pinned allocator: registering pages anew each
    // step (the caller keeps every step's gradients) would cost far more than its rounding.
    host_grad_ = at::Tensor();
    host_grad_ = at::empty({sharded_flat_.numel()}, at::TensorOptions().dtype(orig_dtype_).pinned_memory(pinned_));
  }
  return host_grad_;
}

void Unit::copy_out(const GradBuffers& b) const {
  if (b.host.defined()) b.host.copy_(b.target, /*non_blocking=*/pinned_);
}

}  // namespace mfsdp
