// Fused multi-tensor cast/copy kernels (see pack.h).
#include "pack.h"

#include "dispatch_float.h"
#include "multi_tensor_launch.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

namespace mfsdp {
namespace {

// One gradient of a pack: where it is read from and where it lands in the flat buffer.
struct PackTensor {
  const void* src;
  int64_t dst_offset;
  int64_t numel;
};

template <typename Src, typename Dst, bool kAccumulate>
__global__ void pack_kernel(multi_tensor::ChunkTable<PackTensor> table, Dst* __restrict__ flat) {
  const multi_tensor::BlockChunk chunk = multi_tensor::block_chunk(table);
  const PackTensor& t = table.tensors[chunk.tensor];
  const Src* __restrict__ src = static_cast<const Src*>(t.src);
  Dst* __restrict__ dst = flat + t.dst_offset;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    float v = static_cast<float>(src[i]);
    if (kAccumulate) v += static_cast<float>(dst[i]);
    dst[i] = static_cast<Dst>(v);
  }
}

template <typename Src, typename Dst, bool kAccumulate>
__global__ void cast_scale_kernel(const Src* __restrict__ src, Dst* __restrict__ dst,
                                  int64_t n, float scale) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float v = static_cast<float>(src[i]) * scale;
    if (kAccumulate) v += static_cast<float>(dst[i]);
    dst[i] = static_cast<Dst>(v);
  }
}

}  // namespace

void pack_into_flat_cuda(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, bool accumulate) {
  const at::ScalarType src_type = tensors.front().scalar_type();
  c10::cuda::CUDAGuard guard(flat.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.device().index()).stream();
  dispatch_float(flat.scalar_type(), "pack_into_flat", [&](auto dst_tag) {
    using Dst = decltype(dst_tag);
    dispatch_float(src_type, "pack_into_flat", [&](auto src_tag) {
      using Src = decltype(src_tag);
      std::vector<PackTensor> descs;
      descs.reserve(tensors.size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        descs.push_back(PackTensor{tensors[i].data_ptr(), offsets[i], tensors[i].numel()});
      }
      auto kernel = accumulate ? pack_kernel<Src, Dst, true> : pack_kernel<Src, Dst, false>;
      multi_tensor::launch(kernel, descs, stream, flat.data_ptr<Dst>());
    });
  });
}

void cast_scale_into_cuda(at::Tensor& dst, const at::Tensor& src, double scale, bool accumulate) {
  const int64_t n = dst.numel();
  c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dst.device().index()).stream();
  const int threads = 512;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dst.device().index()));
  const int64_t max_blocks = static_cast<int64_t>(sms) * 8;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, max_blocks));
  dispatch_float(dst.scalar_type(), "cast_scale_into", [&](auto dst_tag) {
    using Dst = decltype(dst_tag);
    dispatch_float(src.scalar_type(), "cast_scale_into", [&](auto src_tag) {
      using Src = decltype(src_tag);
      // In place (src aliases dst) is safe: each element is read then written by one thread.
      if (accumulate)
        cast_scale_kernel<Src, Dst, true><<<blocks, threads, 0, stream>>>(
            static_cast<const Src*>(src.data_ptr()), dst.data_ptr<Dst>(), n, static_cast<float>(scale));
      else
        cast_scale_kernel<Src, Dst, false><<<blocks, threads, 0, stream>>>(
            static_cast<const Src*>(src.data_ptr()), dst.data_ptr<Dst>(), n, static_cast<float>(scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace mfsdp
