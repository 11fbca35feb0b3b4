#include "comm_context.h"

#include <utility>

#ifdef WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace mfsdp {

CommContext::CommContext(c10::Device device) : device_(device), streams_(device) {}

void CommContext::delay_after_collective() const {
#ifdef WITH_CUDA
  if (fault_delay_cycles_ > 0 && streams_.enabled()) at::cuda::sleep(fault_delay_cycles_);
#endif
}

void CommContext::check_nonfinite(const std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> checked;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0) checked.push_back(g);
  }
  if (checked.empty()) return;
  if (!nonfinite_.defined()) {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(device_);
    nonfinite_ = at::zeros({1}, opts);
    one_ = at::ones({1}, opts);
  }
  // torch's fused AMP check: sets the flag on any non-finite element; the scale of 1
  // leaves the values as they are.
  at::_amp_foreach_non_finite_check_and_unscale_(checked, nonfinite_, one_);
}

void CommContext::hold_reduction(std::vector<at::Tensor> buffers, std::shared_ptr<PendingCollective> done) {
  retire();
  inflight_ = Inflight{std::move(buffers), std::move(done)};
}

void CommContext::retire() {
  if (!inflight_) return;
  // The buffers were allocated on the current (compute) stream; once that stream has
  // waited for the collective, the allocator may hand the memory out again safely.
  inflight_->done->wait();
  inflight_.reset();
}

void CommContext::synchronize_reductions() {
  retire();
  if (!streams_.enabled()) return;
  // Every reduction (bucketed ones record only their lead's event) runs on this stream.
  c10::impl::VirtualGuardImpl impl(device_.type());
  impl.synchronizeStream(streams_.reduce_scatter());
}

std::shared_ptr<PendingCollective> CommContext::all_gather_v_async(const Communicator& comm, at::Tensor& out,
                                                                   at::Tensor& in, const std::vector<int64_t>& starts,
                                                                   const std::vector<int64_t>& numels, VarAlgo algo,
                                                                   bool verify) {
  auto pending = std::make_shared<PendingCollective>(device_);
  if (!streams_.enabled()) {
    comm.all_gather_v(out, in, starts, numels, algo, verify);
    return pending;
  }
  StreamEvent compute_ready(device_);
  compute_ready.record(current_stream(device_));
  c10::StreamGuard guard(streams_.all_gather());
  compute_ready.block(streams_.all_gather());
  comm.all_gather_v(out, in, starts, numels, algo, verify);
  delay_after_collective();
  pending->record(streams_.all_gather());
  return pending;
}

}  // namespace mfsdp
