#include "host_memory.h"

#include <cstdlib>

#include "errors.h"

#ifdef WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace mfsdp {

bool can_pin_host_memory() {
#ifdef WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

at::Tensor empty_host(int64_t numel, at::ScalarType dtype, bool pin) {
  MFSDP_CHECK_VALUE(numel >= 0, "empty_host: negative size ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (!pin || bytes == 0) return at::empty({numel}, options);
  MFSDP_CHECK_VALUE(can_pin_host_memory(), "pinned host memory needs CUDA (this process has no CUDA device); "
                    "offload with pin_memory=False");
#ifdef WITH_CUDA
  constexpr size_t kPage = 4096;
  const size_t rounded = (bytes + kPage - 1) / kPage * kPage;
  void* ptr = std::aligned_alloc(kPage, rounded);
  MFSDP_CHECK(ptr != nullptr, "out of host memory: ", static_cast<int64_t>(bytes), " bytes for an offloaded buffer");
  const cudaError_t err = cudaHostRegister(ptr, rounded, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    // Some sandboxes refuse to register memory they did not allocate; torch's pinned
    // allocator (cudaHostAlloc, sizes rounded up to a power of two) still serves.
    (void)cudaGetLastError();
    std::free(ptr);
    TORCH_WARN_ONCE("megatron_fsdp_ext: cudaHostRegister failed (", cudaGetErrorString(err),
                    "); offloaded buffers come from torch's pinned allocator, which rounds sizes up to a power of two");
    return at::empty({numel}, options.pinned_memory(true));
  }
  return at::from_blob(
      ptr, {numel},
      [](void* p) {
        // A failure here (the driver shut down first at exit) leaves nothing to undo.
        (void)cudaHostUnregister(p);
        (void)cudaGetLastError();
        std::free(p);
      },
      options);
#else
  return {};
#endif
}

}  // namespace mfsdp
