#include "comm_buffers.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace mfsdp {
namespace {

// Groups that ran a device collective in this process; weak, so a destroyed group's
// address reused by a new one is not taken for it.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>>& registry() {
  static std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>> groups;
  return groups;
}

bool listed(const std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>>& groups, const ProcessGroupPtr& pg) {
  return std::any_of(groups.begin(), groups.end(), [&](const auto& w) { return w.lock().get() == pg.get(); });
}

}  // namespace

bool group_allocates(const Communicator& comm, const c10::Device& device) {
  if (!comm.defined() || comm.size() == 1 || !device.is_cuda()) return false;
  const auto& pg = comm.group();
  if (!pg->hasBackends()) return false;
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg->getBackend(device.type());
  } catch (const c10::Error&) {
    return false;  // no backend for device tensors: nothing to allocate from
  }
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  return backend && backend->supportsTensorAlloc(index);
}

void note_device_collective(const ProcessGroupPtr& pg) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& groups = registry();
  if (!groups.empty() && groups.back().lock().get() == pg.get()) return;  // the common case, cheaply
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& w) { return w.expired(); }),
               groups.end());
  if (!listed(groups, pg)) groups.emplace_back(pg);
}

bool ran_device_collective(const ProcessGroupPtr& pg) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return listed(registry(), pg);
}

at::Tensor allocate_comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                                bool from_group) {
  if (!from_group) return at::empty({numel}, options);
  return comm.group()->getBackend(options.device().type())->allocateTensor(numel, options);
}

}  // namespace mfsdp
