// The FP8 gather transform: torchao's tensorwise (per-tensor, dynamic) scaling of a
// Float8Linear weight, computed on this rank's shard of the fp32 master.
//
//  - amax: max |w| of each parameter's piece of the shard (one fused launch per unit on
//    GPU), then one all-reduce(max) over the ranks for the whole model (Unit).
//  - scale: float32(fp8_max / max(amax, 1e-12)) computed in float64, torchao's
//    amax_to_scale, so the FP8 bits equal torchao's.
//  - fill: each piece of the shard written into the gather's bytes: FP8 parameters as
//    saturate(w * scale) in the FP8 dtype, the others cast to the param dtype (one fused
//    launch per unit on GPU).
#pragma once

#include "errors.h"
#include <ATen/ATen.h>

#include <vector>

namespace mfsdp {

// One parameter's piece of this rank's shard.
struct GatherPiece {
  int64_t shard_offset = 0;  // its first element in the shard
  int64_t numel = 0;
  int64_t byte_offset = 0;   // where its gathered copy starts in the destination bytes
  int64_t param = 0;         // its parameter's index: the slot of its scale and amax
  bool fp8 = false;          // quantized with its scale, else cast
  bool copy = false;         // copied as bytes from the pre-quantized shard (MXFP8), else as above
};

bool is_fp8_dtype(at::ScalarType t);

// amax[p.param] = max(amax[p.param], max |shard piece|) for every FP8 piece; NaN propagates.
// `amax`: float32, one slot per parameter of the unit.
void fp8_piece_amax(const at::Tensor& shard, const std::vector<GatherPiece>& pieces, at::Tensor& amax);

// Writes every piece of `shard` into `bytes` (uint8) at its byte offset: FP8 pieces as
// saturate(x * scales[param]) in `fp8_dtype`, copy pieces as the bytes of `quantized`
// (uint8, laid out like the shard: one byte an element), the others cast to `cast_dtype`.
void fill_gather_bytes(at::Tensor& bytes, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                       const at::Tensor& scales, at::ScalarType fp8_dtype, at::ScalarType cast_dtype,
                       const at::Tensor& quantized = {});

// torchao's amax_to_scale for a float32 amax tensor (any shape).
at::Tensor fp8_scales_from_amax(const at::Tensor& amax, at::ScalarType fp8_dtype, at::ScalarType master_dtype);

#ifdef WITH_CUDA
// CUDA implementations (fp8_kernels.cu): contiguous float32/bfloat16/float16 shards.
void fp8_piece_amax_cuda(const at::Tensor& shard, const std::vector<GatherPiece>& pieces, at::Tensor& amax);
void fill_gather_bytes_cuda(at::Tensor& bytes, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                            const at::Tensor& scales, at::ScalarType fp8_dtype, at::ScalarType cast_dtype,
                            const at::Tensor& quantized);
#endif

}  // namespace mfsdp
