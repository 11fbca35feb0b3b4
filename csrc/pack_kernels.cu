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

// One piece of a pack: a gradient read from `src`, scaled, into the flat buffer at dst_offset, or,
// with src null, a range of the flat buffer zero-filled (padding, or a parameter without a
// gradient). `vectorized`: src and dst are aligned for whole-vector loads and stores.
struct PackTensor {
  const void* src;
  int64_t dst_offset;
  int64_t numel;
  bool vectorized;
};

// Elements a thread moves per load: 16 bytes of the source.
template <typename Src>
__host__ __device__ constexpr int pack_vector_elems() {
  return static_cast<int>(16 / sizeof(Src));
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename Src, typename Dst, bool kAccumulate>
__global__ void pack_kernel(multi_tensor::ChunkTable<PackTensor> table, Dst* __restrict__ flat, float scale) {
  const multi_tensor::BlockChunk chunk = multi_tensor::block_chunk(table);
  const PackTensor& t = table.tensors[chunk.tensor];
  Dst* __restrict__ dst = flat + t.dst_offset;
  if (t.src == nullptr) {
    for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) dst[i] = static_cast<Dst>(0.f);
    return;
  }
  const Src* __restrict__ src = static_cast<const Src*>(t.src);
  int64_t scalar_from = chunk.begin;
  if (t.vectorized) {
    // A chunk starts at a multiple of kChunkElems, so its vectors stay aligned; only a
    // tensor's last chunk can end in a partial vector, left to the scalar loop.
    constexpr int V = pack_vector_elems<Src>();
    static_assert(multi_tensor::kChunkElems % V == 0, "chunks must start on a vector boundary");
    const int64_t vec_end = chunk.begin + (chunk.end - chunk.begin) / V * V;
    for (int64_t i = chunk.begin + static_cast<int64_t>(threadIdx.x) * V; i < vec_end;
         i += static_cast<int64_t>(blockDim.x) * V) {
      const Vec<Src, V> in = *reinterpret_cast<const Vec<Src, V>*>(src + i);
      Vec<Dst, V> out;
      if (kAccumulate) out = *reinterpret_cast<const Vec<Dst, V>*>(dst + i);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float v = static_cast<float>(in.v[k]) * scale;
        if (kAccumulate) v += static_cast<float>(out.v[k]);
        out.v[k] = static_cast<Dst>(v);
      }
      *reinterpret_cast<Vec<Dst, V>*>(dst + i) = out;
    }
    scalar_from = vec_end;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < chunk.end; i += blockDim.x) {
    float v = static_cast<float>(src[i]) * scale;
    if (kAccumulate) v += static_cast<float>(dst[i]);
    dst[i] = static_cast<Dst>(v);
  }
}

bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
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
                         const std::vector<int64_t>& offsets, const std::vector<FlatRange>& zero_ranges,
                         bool accumulate, double scale) {
  const at::ScalarType src_type = tensors.empty() ? flat.scalar_type() : tensors.front().scalar_type();
  c10::cuda::CUDAGuard guard(flat.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.device().index()).stream();
  dispatch_float(flat.scalar_type(), "pack_into_flat", [&](auto dst_tag) {
    using Dst = decltype(dst_tag);
    dispatch_float(src_type, "pack_into_flat", [&](auto src_tag) {
      using Src = decltype(src_tag);
      constexpr int V = pack_vector_elems<Src>();
      Dst* base = flat.data_ptr<Dst>();
      std::vector<PackTensor> descs;
      descs.reserve(tensors.size() + zero_ranges.size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        const void* src = tensors[i].data_ptr();
        const bool vectorized = aligned_to(src, V * sizeof(Src)) && aligned_to(base + offsets[i], V * sizeof(Dst));
        descs.push_back(PackTensor{src, offsets[i], tensors[i].numel(), vectorized});
      }
      for (const FlatRange& r : zero_ranges) descs.push_back(PackTensor{nullptr, r.offset, r.numel, false});
      auto kernel = accumulate ? pack_kernel<Src, Dst, true> : pack_kernel<Src, Dst, false>;
      multi_tensor::launch(kernel, descs, stream, base, static_cast<float>(scale));
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
