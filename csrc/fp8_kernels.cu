// Fused FP8 kernels (see fp8.h): one launch per unit for the amax of its FP8 pieces, one
// for quantizing and casting its pieces into the gather's bytes.
#include "fp8.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace mfsdp {
namespace {

constexpr int kMaxPiecesPerLaunch = 48;
constexpr int kMaxBlocksPerLaunch = 256;
constexpr int64_t kChunkElems = 16384;
constexpr int kThreads = 512;

// Passed by value as a kernel argument (< 4 KiB): no H2D copy per launch.
struct PieceLaunch {
  int64_t shard_offset[kMaxPiecesPerLaunch];
  int64_t numel[kMaxPiecesPerLaunch];
  int64_t byte_offset[kMaxPiecesPerLaunch];
  int32_t param[kMaxPiecesPerLaunch];
  bool fp8[kMaxPiecesPerLaunch];
  bool copy[kMaxPiecesPerLaunch];
  int16_t block_piece[kMaxBlocksPerLaunch];
  int32_t block_chunk[kMaxBlocksPerLaunch];
};

// Non-negative floats (and NaN with its sign cleared, above +inf) order like their bits.
__device__ inline void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

template <typename Src>
__global__ void amax_kernel(PieceLaunch a, const Src* __restrict__ shard, float* __restrict__ amax) {
  const int t = a.block_piece[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(a.block_chunk[blockIdx.x]) * kChunkElems;
  const int64_t end = min(a.numel[t], begin + kChunkElems);
  const Src* src = shard + a.shard_offset[t];
  float m = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = fabsf(static_cast<float>(src[i]));
    m = (v > m || v != v) ? v : m;  // keeps NaN
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_down_sync(0xffffffffu, m, offset);
    m = (o > m || o != o) ? o : m;
  }
  __shared__ float warp_max[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = 0.f;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
      const float o = warp_max[w];
      b = (o > b || o != o) ? o : b;
    }
    if (b != b) b = __int_as_float(0x7fc00000);  // a positive NaN: above +inf as bits
    atomic_max_nonneg(amax + a.param[t], b);
  }
}

template <typename Src, typename Cast, typename Fp8>
__global__ void fill_kernel(PieceLaunch a, const Src* __restrict__ shard, uint8_t* __restrict__ bytes,
                            const float* __restrict__ scales, float fp8_max, const uint8_t* __restrict__ quantized) {
  const int t = a.block_piece[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(a.block_chunk[blockIdx.x]) * kChunkElems;
  const int64_t end = min(a.numel[t], begin + kChunkElems);
  const Src* src = shard + a.shard_offset[t];
  if (a.copy[t]) {
    const uint8_t* from = quantized + a.shard_offset[t];
    uint8_t* out = bytes + a.byte_offset[t];
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i] = from[i];
  } else if (a.fp8[t]) {
    Fp8* out = reinterpret_cast<Fp8*>(bytes + a.byte_offset[t]);
    const float s = scales[a.param[t]];
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float v = static_cast<float>(src[i]) * s;
      v = v > fp8_max ? fp8_max : (v < -fp8_max ? -fp8_max : v);  // saturate; NaN stays NaN
      out[i] = static_cast<Fp8>(v);
    }
  } else {
    Cast* out = reinterpret_cast<Cast*>(bytes + a.byte_offset[t]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) out[i] = static_cast<Cast>(static_cast<float>(src[i]));
  }
}

template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: MFSDP_CHECK(false, "FP8 kernels: unsupported dtype ", t);
  }
}

// Splits `pieces` (those `take` accepts) into launches of at most kMaxPiecesPerLaunch
// pieces and kMaxBlocksPerLaunch chunks, calling `launch(args, blocks)` for each.
template <typename Take, typename Launch>
void for_each_launch(const std::vector<GatherPiece>& pieces, Take&& take, Launch&& launch) {
  PieceLaunch args;
  int n_pieces = 0, n_blocks = 0;
  auto flush = [&] {
    if (n_blocks > 0) launch(args, n_blocks);
    n_pieces = 0;
    n_blocks = 0;
  };
  for (const auto& p : pieces) {
    if (p.numel == 0 || !take(p)) continue;
    const int64_t chunks = (p.numel + kChunkElems - 1) / kChunkElems;
    int slot = -1;
    for (int64_t c = 0; c < chunks; ++c) {
      if (n_blocks == kMaxBlocksPerLaunch) {
        flush();
        slot = -1;
      }
      if (slot < 0) {
        if (n_pieces == kMaxPiecesPerLaunch) flush();
        slot = n_pieces++;
        args.shard_offset[slot] = p.shard_offset;
        args.numel[slot] = p.numel;
        args.byte_offset[slot] = p.byte_offset;
        args.param[slot] = static_cast<int32_t>(p.param);
        args.fp8[slot] = p.fp8;
        args.copy[slot] = p.copy;
      }
      args.block_piece[n_blocks] = static_cast<int16_t>(slot);
      args.block_chunk[n_blocks] = static_cast<int32_t>(c);
      ++n_blocks;
    }
  }
  flush();
}

}  // namespace

void fp8_piece_amax_cuda(const at::Tensor& shard, const std::vector<GatherPiece>& pieces, at::Tensor& amax) {
  c10::cuda::CUDAGuard guard(shard.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shard.device().index()).stream();
  dispatch_float(shard.scalar_type(), [&](auto src_tag) {
    using Src = decltype(src_tag);
    const Src* src = static_cast<const Src*>(shard.data_ptr());
    float* out = amax.data_ptr<float>();
    for_each_launch(pieces, [](const GatherPiece& p) { return p.fp8; }, [&](PieceLaunch& args, int blocks) {
      amax_kernel<Src><<<blocks, kThreads, 0, stream>>>(args, src, out);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void fill_gather_bytes_cuda(at::Tensor& bytes, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                            const at::Tensor& scales, at::ScalarType fp8_dtype, at::ScalarType cast_dtype,
                            const at::Tensor& quantized) {
  c10::cuda::CUDAGuard guard(shard.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(shard.device().index()).stream();
  const float max = fp8_dtype == at::kFloat8_e4m3fn ? 448.f : 57344.f;
  auto scales_f = scales.defined() ? scales.contiguous() : at::ones({1}, shard.options().dtype(at::kFloat));
  dispatch_float(shard.scalar_type(), [&](auto src_tag) {
    using Src = decltype(src_tag);
    dispatch_float(cast_dtype, [&](auto cast_tag) {
      using Cast = decltype(cast_tag);
      auto run = [&](auto fp8_tag) {
        using Fp8 = decltype(fp8_tag);
        for_each_launch(pieces, [](const GatherPiece&) { return true; }, [&](PieceLaunch& args, int blocks) {
          fill_kernel<Src, Cast, Fp8><<<blocks, kThreads, 0, stream>>>(
              args, static_cast<const Src*>(shard.data_ptr()), bytes.data_ptr<uint8_t>(),
              scales_f.data_ptr<float>(), max, quantized.data_ptr<uint8_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      };
      if (fp8_dtype == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
      else run(c10::Float8_e5m2{});
    });
  });
}

}  // namespace mfsdp
