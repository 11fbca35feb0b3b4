// Fused multi-tensor cast/copy kernels (see pack.h).
#include "pack.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

namespace mfsdp {
namespace {

constexpr int kMaxTensorsPerLaunch = 48;
constexpr int kMaxBlocksPerLaunch = 256;
constexpr int64_t kChunkElems = 16384;
constexpr int kThreads = 512;

// Passed by value as a kernel argument (< 4 KiB), so one launch needs no H2D copy.
struct PackLaunch {
  const void* src[kMaxTensorsPerLaunch];
  int64_t dst_offset[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int16_t block_tensor[kMaxBlocksPerLaunch];
  int32_t block_chunk[kMaxBlocksPerLaunch];
};

template <typename Src, typename Dst, bool kAccumulate>
__global__ void pack_kernel(PackLaunch args, Dst* __restrict__ flat) {
  const int t = args.block_tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(args.block_chunk[blockIdx.x]) * kChunkElems;
  const int64_t end = min(args.numel[t], begin + kChunkElems);
  const Src* __restrict__ src = static_cast<const Src*>(args.src[t]);
  Dst* __restrict__ dst = flat + args.dst_offset[t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
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

template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: MFSDP_CHECK(false, what, ": unsupported dtype ", t);
  }
}

template <typename Src, typename Dst>
void launch_pack(PackLaunch& args, int blocks, Dst* flat, bool accumulate, cudaStream_t stream) {
  if (accumulate) pack_kernel<Src, Dst, true><<<blocks, kThreads, 0, stream>>>(args, flat);
  else pack_kernel<Src, Dst, false><<<blocks, kThreads, 0, stream>>>(args, flat);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
      Dst* dst = flat.data_ptr<Dst>();
      PackLaunch args;
      int n_tensors = 0, n_blocks = 0;
      auto flush = [&]() {
        if (n_blocks > 0) launch_pack<Src, Dst>(args, n_blocks, dst, accumulate, stream);
        n_tensors = 0;
        n_blocks = 0;
      };
      for (size_t i = 0; i < tensors.size(); ++i) {
        const int64_t numel = tensors[i].numel();
        const int64_t chunks = (numel + kChunkElems - 1) / kChunkElems;
        int slot = -1;  // this tensor's slot in the current launch
        for (int64_t c = 0; c < chunks; ++c) {
          if (n_blocks == kMaxBlocksPerLaunch) {
            flush();
            slot = -1;
          }
          if (slot < 0) {
            if (n_tensors == kMaxTensorsPerLaunch) flush();
            slot = n_tensors++;
            args.src[slot] = tensors[i].data_ptr();
            args.dst_offset[slot] = offsets[i];
            args.numel[slot] = numel;
          }
          args.block_tensor[n_blocks] = static_cast<int16_t>(slot);
          args.block_chunk[n_blocks] = static_cast<int32_t>(c);
          ++n_blocks;
        }
      }
      flush();
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
