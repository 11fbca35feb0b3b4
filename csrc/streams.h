// StreamSet: the side streams of one communication context, plus a tiny event type.
//
// Uses c10's device-generic stream/event API, so this header needs no CUDA headers;
// on CPU (and in builds without WITH_CUDA) there are no side streams and every
// operation here is a no-op: collectives then complete synchronously.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

namespace mfsdp {

inline bool uses_side_streams(const c10::Device& device) {
#ifdef WITH_CUDA
  return device.is_cuda();
#else
  (void)device;
  return false;
#endif
}

inline c10::Stream current_stream(const c10::Device& device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device);
}

// One stream per role, taken from the pool once and kept (the pool hands streams out
// round-robin, so asking again could alias another role's stream).
class StreamSet {
 public:
  explicit StreamSet(c10::Device device) : device_(device) {
    if (!uses_side_streams(device)) return;
    c10::impl::VirtualGuardImpl impl(device.type());
    all_gather_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
    reduce_scatter_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  }

  const c10::Device& device() const { return device_; }
  bool enabled() const { return all_gather_.has_value(); }
  const c10::Stream& all_gather() const { return *all_gather_; }
  const c10::Stream& reduce_scatter() const { return *reduce_scatter_; }

 private:
  c10::Device device_;
  std::optional<c10::Stream> all_gather_, reduce_scatter_;
};

// A recordable event; a no-op on CPU.
class StreamEvent {
 public:
  explicit StreamEvent(const c10::Device& device) {
    if (uses_side_streams(device)) event_ = std::make_unique<c10::Event>(device.type());
  }
  void record(const c10::Stream& stream) {
    if (!event_) return;
    event_->record(stream);
    ++records_;
  }
  // `stream` waits (on the device) until the last record() is done. A second wait of the
  // same stream for the same record is skipped: everything queued on `stream` after the
  // first wait is already ordered after it (units of one bucket share one event).
  void block(const c10::Stream& stream) const {
    if (!event_) return;
    if (waited_ && waited_->first == stream && waited_->second == records_) return;
    event_->block(stream);
    waited_ = std::make_pair(stream, records_);
  }
  // The host waits until the last record() is done.
  void synchronize() const {
    if (event_) event_->synchronize();
  }
  // Whether the last record() is done, without waiting.
  bool query() const { return !event_ || event_->query(); }

 private:
  std::unique_ptr<c10::Event> event_;
  uint64_t records_ = 0;
  // The last (stream, record) a wait was issued for.
  mutable std::optional<std::pair<c10::Stream, uint64_t>> waited_;
};

}  // namespace mfsdp
