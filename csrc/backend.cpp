#include "backend.h"

#include <map>
#include <mutex>
#include <utility>

namespace mfsdp {
namespace {

using Key = std::pair<std::string, c10::DeviceType>;

BackendCaps caps(std::string name) {
  BackendCaps c;
  c.name = std::move(name);
  return c;
}

// What torch's own backends can do (checked against ProcessGroupNCCL/Gloo and
// FakeProcessGroup on torch 2.11 and 2.13; tests/gpu/probe_backends.py re-checks it).
std::map<Key, BackendCaps> builtin_table() {
  std::map<Key, BackendCaps> table;

  BackendCaps nccl = caps("nccl");
  nccl.enqueues_on_stream = true;
  nccl.coalesced_all_gather = nccl.coalesced_reduce_scatter = true;
  nccl.uneven_lists = true;
  nccl.all_to_all = true;
  table[{"nccl", c10::DeviceType::CUDA}] = nccl;

  // Gloo: every collective runs on the host in a worker thread; Work::wait blocks.
  BackendCaps gloo_cpu = caps("gloo");
  gloo_cpu.coalesced_all_gather = gloo_cpu.coalesced_reduce_scatter = true;
  gloo_cpu.all_to_all = true;
  table[{"gloo", c10::DeviceType::CPU}] = gloo_cpu;
  // CUDA tensors are copied to pinned host memory and back. Its coalesced all-gather has
  // no CUDA path (it hands device pointers to the host algorithm: pytorch#152645,
  // SIGSEGV); its coalesced reduce-scatter is one all-reduce per pair, which has one.
  // Uneven allgather lists are refused on either device.
  BackendCaps gloo_cuda = caps("gloo");
  gloo_cuda.coalesced_reduce_scatter = true;
  gloo_cuda.all_to_all = true;  // staged through host memory like its other collectives
  table[{"gloo", c10::DeviceType::CUDA}] = gloo_cuda;

  // torch's fake backend: one process plays rank r of W; collectives return at once and
  // move nothing (some copy the local input into the output). Uneven allgather lists
  // would fail its size-matching copy.
  for (auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA}) {
    BackendCaps fake = caps("fake");
    fake.moves_data = false;
    fake.enqueues_on_stream = true;
    fake.coalesced_all_gather = fake.coalesced_reduce_scatter = true;
    table[{"fake", type}] = fake;
  }
  return table;
}

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

std::map<Key, BackendCaps>& table() {
  static std::map<Key, BackendCaps> t = builtin_table();
  return t;
}

}  // namespace

BackendCaps known_backend_caps(const std::string& name, c10::DeviceType device_type) {
  std::lock_guard<std::mutex> lock(table_mutex());
  auto it = table().find({name, device_type});
  if (it != table().end()) return it->second;
  // Unknown: the plain collectives every backend implements, no flat ones (MPI, for
  // one, has no _allgather_base).
  BackendCaps plain = caps(name);
  plain.flat_all_gather = plain.flat_reduce_scatter = false;
  return plain;
}

void register_backend_caps(c10::DeviceType device_type, const BackendCaps& c) {
  TORCH_CHECK_VALUE(!c.name.empty(), "register_backend_capabilities: the backend needs a name");
  std::lock_guard<std::mutex> lock(table_mutex());
  table()[{c.name, device_type}] = c;
}

std::optional<BackendCaps> backend_caps(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                        c10::DeviceType device_type) {
  if (!pg) return std::nullopt;
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg->getBackend(device_type);
  } catch (const c10::Error&) {
    return std::nullopt;  // no backend registered for this device type
  }
  if (!backend) return std::nullopt;
  std::string name;
  try {
    name = backend->getBackendName();
  } catch (const c10::Error&) {
    name = "unnamed";  // a backend that does not name itself gets the plain collectives
  }
  return known_backend_caps(name, device_type);
}

}  // namespace mfsdp
