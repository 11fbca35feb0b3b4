#include "host_tasks.h"

#include <unistd.h>

#include <atomic>
#include <chrono>

#include "errors.h"

namespace mfsdp {

namespace {
std::atomic<int64_t> g_delay_ms{0};
}  // namespace

void set_host_task_delay_ms(int64_t ms) { g_delay_ms.store(ms); }

void HostTask::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return done_; });
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      MFSDP_CHECK(false, what_, " failed: ", std::string(e.what()));
    }
  }
}

bool HostTask::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void HostTask::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

HostTaskQueue::~HostTaskQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    if (owner_pid_ == static_cast<long>(getpid())) {
      worker_.join();
    } else {
      worker_.detach();  // inherited from the parent by fork: no thread behind it here
    }
  }
}

std::shared_ptr<HostTask> HostTaskQueue::submit(std::function<void()> fn, std::string what) {
  auto task = std::make_shared<HostTask>(std::move(what));
  std::lock_guard<std::mutex> lock(mutex_);
  const long pid = static_cast<long>(getpid());
  if (owner_pid_ != pid) {
    if (worker_.joinable()) worker_.detach();  // the parent's thread, not ours after fork
    queue_.clear();
    worker_ = std::thread([this] { run(); });
    owner_pid_ = pid;
  }
  queue_.emplace_back(std::move(fn), task);
  cv_.notify_one();
  return task;
}

void HostTaskQueue::run() {
  for (;;) {
    std::pair<std::function<void()>, std::shared_ptr<HostTask>> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    if (const int64_t delay = g_delay_ms.load(); delay > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    }
    try {
      item.first();
    } catch (...) {
      error = std::current_exception();
    }
    // What the work held (tensors) is released before anyone waiting hears it is done.
    item.first = nullptr;
    item.second->finish(error);
  }
}

}  // namespace mfsdp
