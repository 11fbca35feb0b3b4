// Host work that runs beside the training loop: an offloaded unit's share of an optimizer
// step (optim.CPUAdamW(overlap_step=True)) runs on a background thread while the next
// forward already computes the units stepped before it. The unit waits for its task
// before anything reads or writes its shard or its gradient (unit.h, wait_host_update).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace mfsdp {

// One submitted piece of work; wait() returns once it ran and rethrows what it threw.
class HostTask {
 public:
  explicit HostTask(std::string what) : what_(std::move(what)) {}
  void wait();
  bool done() const;
  const std::string& what() const { return what_; }

 private:
  friend class HostTaskQueue;
  void finish(std::exception_ptr error);

  std::string what_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Fault injection for tests: every task then starts this many milliseconds late, so that a
// reader that does not wait for it sees the values from before it.
void set_host_task_delay_ms(int64_t ms);

// One worker thread running tasks in submission order (the order units are gathered in).
// Destroying the queue runs what is queued, then joins the thread.
class HostTaskQueue {
 public:
  HostTaskQueue() = default;
  ~HostTaskQueue();
  HostTaskQueue(const HostTaskQueue&) = delete;
  HostTaskQueue& operator=(const HostTaskQueue&) = delete;

  std::shared_ptr<HostTask> submit(std::function<void()> fn, std::string what);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<HostTask>>> queue_;
  std::thread worker_;
  long owner_pid_ = 0;  // a forked child has no worker thread: it starts its own
  bool stop_ = false;
};

}  // namespace mfsdp
