// Fused FP8 kernels (see fp8.h): one launch per unit for the amax of its FP8 pieces, one
// for quantizing and casting its pieces into the gather's bytes.
#include "fp8.h"

#include "dispatch_float.h"
#include "multi_tensor_launch.cuh"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <iterator>

namespace mfsdp {
namespace {

// The chunk table's descriptors are the pieces themselves (GatherPiece, fp8.h).
using PieceTable = multi_tensor::ChunkTable<GatherPiece>;
constexpr const char* kWhat = "FP8 kernels";

// Non-negative floats (and NaN with its sign cleared, above +inf) order like their bits.
__device__ inline void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <typename Src>
__global__ void amax_kernel(PieceTable table, const Src* __restrict__ shard, float* __restrict__ amax) {
  const multi_tensor::BlockChunk chunk = multi_tensor::block_chunk(table);
  const GatherPiece& piece = table.tensors[chunk.tensor];
  const Src* src = shard + piece.shard_offset;
  float m = 0.f;
  for (int64_t i = chunk.begin + threadIdx.x; i < chunk.end; i += blockDim.x) {
    const float v = fabsf(static_cast<float>(src[i]));
    m = (v > m || v != v) ? v : m;  // keeps NaN
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_down_sync(0xffffffffu, m, offset);
    m = (o > m || o != o) ? o : m;
  }
  __shared__ float warp_max[multi_tensor::kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      const float o = warp_max[w];
      b = (o > b || o != o) ? o : b;
    }
    if (b != b) b = __int_as_float(0x7fc00000);  // a positive NaN: above +inf as bits
    atomic_max_nonneg(amax + piece.param, b);
  }
}

template <typename Src, typename Cast, typename Fp8>
__global__ void fill_kernel(PieceTable table, const Src* __restrict__ shard, uint8_t* __restrict__ bytes,
                            const float* __restrict__ scales, float fp8_max, const uint8_t* __restrict__ quantized) {
  const multi_tensor::BlockChunk chunk = multi_tensor::block_chunk(table);
  const GatherPiece& piece = table.tensors[chunk.tensor];
  const int64_t begin = chunk.begin, end = chunk.end;
  const Src* src = shard + piece.shard_offset;
  if (piece.copy) {
    const uint8_t* from = quantized + piece.shard_offset;
    uint8_t* out = bytes + piece.byte_offset;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i] = from[i];
  } else if (piece.fp8) {
    Fp8* out = reinterpret_cast<Fp8*>(bytes + piece.byte_offset);
    const float s = scales[piece.param];
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float v = static_cast<float>(src[i]) * s;
      v = v > fp8_max ? fp8_max : (v < -fp8_max ? -fp8_max : v);  // saturate; NaN stays NaN
      out[i] = static_cast<Fp8>(v);
    }
  } else {
    Cast* out = reinterpret_cast<Cast*>(bytes + piece.byte_offset);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i] = static_cast<Cast>(static_cast<float>(src[i]));
  }
}

}  // namespace

void fp8_piece_amax_cuda(const at::Tensor& shard, const std::vector<GatherPiece>& pieces, at::Tensor& amax) {
  c10::cuda::CUDAGuard guard(shard.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shard.device().index()).stream();
  std::vector<GatherPiece> fp8_pieces;  // the cast pieces have no amax
  std::copy_if(pieces.begin(), pieces.end(), std::back_inserter(fp8_pieces), [](const GatherPiece& p) { return p.fp8; });
  dispatch_float(shard.scalar_type(), kWhat, [&](auto src_tag) {
    using Src = decltype(src_tag);
    multi_tensor::launch(amax_kernel<Src>, fp8_pieces, stream, static_cast<const Src*>(shard.data_ptr()),
                         amax.data_ptr<float>());
  });
}

void fill_gather_bytes_cuda(at::Tensor& bytes, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                            const at::Tensor& scales, at::ScalarType fp8_dtype, at::ScalarType cast_dtype,
                            const at::Tensor& quantized) {
  c10::cuda::CUDAGuard guard(shard.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shard.device().index()).stream();
  const float max = fp8_dtype == at::kFloat8_e4m3fn ? 448.f : 57344.f;
  auto scales_f = scales.defined() ? scales.contiguous() : at::ones({1}, shard.options().dtype(at::kFloat));
  dispatch_float(shard.scalar_type(), kWhat, [&](auto src_tag) {
    using Src = decltype(src_tag);
    dispatch_float(cast_dtype, kWhat, [&](auto cast_tag) {
      using Cast = decltype(cast_tag);
      auto run = [&](auto fp8_tag) {
        using Fp8 = decltype(fp8_tag);
        multi_tensor::launch(fill_kernel<Src, Cast, Fp8>, pieces, stream, static_cast<const Src*>(shard.data_ptr()),
                             bytes.data_ptr<uint8_t>(), scales_f.data_ptr<float>(), max, quantized.data_ptr<uint8_t>());
      };
      if (fp8_dtype == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
      else run(c10::Float8_e5m2{});
    });
  });
}

}  // namespace mfsdp
