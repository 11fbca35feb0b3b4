// CommContext: what all units under one root share: the side streams their
// collectives run on, and the one gradient reduction whose buffers must outlive it.
//
// Stream contract (CUDA): a collective is issued on its side stream after that stream
// waited for the compute stream; the compute stream waits for the collective's event
// before it reads the result. Buffers are allocated on the compute stream, so freeing
// them needs no record_stream once the compute stream has waited (retire below).
// On CPU there are no side streams and every collective completes when issued.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

#include "comm.h"
#include "streams.h"

namespace mfsdp {

// A collective issued on a side stream; wait() makes the current stream wait for it.
class PendingCollective {
 public:
  explicit PendingCollective(const c10::Device& device) : device_(device), done_(device) {}
  void record(const c10::Stream& stream) { done_.record(stream); }
  void wait() const { done_.block(current_stream(device_)); }
  // The host waits for it (offloaded gradients are read on the host).
  void synchronize() const { done_.synchronize(); }

 private:
  c10::Device device_;
  StreamEvent done_;
};

class CommContext {
 public:
  explicit CommContext(c10::Device device);

  const c10::Device& device() const { return device_; }
  const StreamSet& streams() const { return streams_; }

  // Fault injection for tests: with cycles > 0, every collective on a side stream is
  // followed there by a busy-wait of that many GPU cycles before its results are landed
  // and its done event recorded, so a consumer that does not wait for the event reads
  // stale values. Where the host waits for the collective itself (Gloo), this is the only
  // delay a missing wait can race with. No effect without side streams (CPU).
  void set_fault_delay_cycles(int64_t cycles) { fault_delay_cycles_ = cycles; }
  int64_t fault_delay_cycles() const { return fault_delay_cycles_; }
  // Called on the side stream right after a collective.
  void delay_after_collective() const;

  // Non-finite gradient check (check_for_nan_in_grad): one fused kernel over `grads` on
  // the current stream sets the context's flag to 1 if any element is NaN or +-Inf. No
  // host synchronization: the flag is read (and reset) at the optimizer step.
  void check_nonfinite(const std::vector<at::Tensor>& grads);
  // The flag (a 1-element float tensor on the device, 0 while every checked gradient was
  // finite); undefined before the first check.
  const at::Tensor& nonfinite_flag() const { return nonfinite_; }

  // One reduction in flight while the next unit's backward computes: a second one would
  // add a whole flat gradient buffer to the peak and buy no overlap.
  int64_t num_inflight_reductions() const { return inflight_ ? 1 : 0; }
  // Keep `buffers` alive until the current stream has waited for `done` (retiring the
  // reduction held before, if any).
  void hold_reduction(std::vector<at::Tensor> buffers, std::shared_ptr<PendingCollective> done);
  // Called before allocating the next reduction's buffers: the held reduction is
  // retired first, so its memory is reused instead of adding to the peak.
  void make_room_for_reduction() { retire(); }
  // The current stream waits for the held reduction; its buffers are released.
  void wait_reductions() { retire(); }
  // wait_reductions(), and the host waits until every reduction issued so far is done:
  // what offloaded units need before their host gradients are read.
  void synchronize_reductions();

  // An uneven all-gather (Communicator::all_gather_v) on the all-gather stream, ordered
  // after the work already queued on the current stream. `out` must stay alive and
  // unwritten until the returned collective was waited for.
  std::shared_ptr<PendingCollective> all_gather_v_async(const Communicator& comm, at::Tensor& out, at::Tensor& in,
                                                        const std::vector<int64_t>& starts,
                                                        const std::vector<int64_t>& numels, VarAlgo algo,
                                                        bool verify);

 private:
  struct Inflight {
    std::vector<at::Tensor> buffers;
    std::shared_ptr<PendingCollective> done;
  };
  void retire();

  c10::Device device_;
  StreamSet streams_;
  int64_t fault_delay_cycles_ = 0;
  at::Tensor nonfinite_, one_;  // the flag, and the scale the fused check multiplies by (1)
  std::optional<Inflight> inflight_;
};

}  // namespace mfsdp
