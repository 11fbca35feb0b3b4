#include "comm_buffers.h"

#include <algorithm>
#include <mutex>
#include <vector>

namespace mfsdp {
namespace {

// Groups whose communicator this process has connected; weak, so a destroyed group's
// address reused by a new one is not taken for connected.
std::mutex& connected_mutex() {
  static std::mutex m;
  return m;
}
std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>>& connected() {
  static std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>> groups;
  return groups;
}

bool is_connected(const ProcessGroupPtr& pg) {
  std::lock_guard<std::mutex> lock(connected_mutex());
  auto& groups = connected();
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& w) { return w.expired(); }),
               groups.end());
  return std::any_of(groups.begin(), groups.end(), [&](const auto& w) { return w.lock().get() == pg.get(); });
}

void mark_connected(const ProcessGroupPtr& pg) {
  std::lock_guard<std::mutex> lock(connected_mutex());
  connected().emplace_back(pg);
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

void connect_for_allocation(const Communicator& comm, const c10::Device& device) {
  if (!group_allocates(comm, device) || is_connected(comm.group())) return;
  at::Tensor probe = at::zeros({1}, at::TensorOptions().device(device).dtype(at::kFloat));
  comm.all_reduce(probe, c10d::ReduceOp::SUM);
  mark_connected(comm.group());
}

at::Tensor allocate_comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                                bool from_group) {
  if (!from_group) return at::empty({numel}, options);
  return comm.group()->getBackend(options.device().type())->allocateTensor(numel, options);
}

}  // namespace mfsdp
