// Cast/copy kernels of the hot path.
//
//  pack_into_flat:  many gradients (any float dtype) -> one flat buffer at given offsets,
//                   cast to the buffer's dtype, overwriting or accumulating. One fused
//                   multi-tensor CUDA launch on GPU; ATen copies on CPU.
//  cast_scale_into: dst = src * scale (or dst += src * scale) with a dtype cast, used to
//                   turn a reduce-scattered shard into the fp32 sharded gradient.
#pragma once

#include "errors.h"
#include <ATen/ATen.h>

#include <vector>

namespace mfsdp {

// Undefined entries in `tensors` are skipped; their ranges (and any gap between ranges)
// are zero-filled unless `accumulate` is set. Each defined tensor must have exactly
// numels[i] elements.
void pack_into_flat(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets, bool accumulate,
                    bool zero_fill_first);

void cast_scale_into(at::Tensor& dst, const at::Tensor& src, double scale, bool accumulate);

#ifdef WITH_CUDA
// CUDA implementations (pack_kernels.cu). Preconditions checked by the callers above.
void pack_into_flat_cuda(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, bool accumulate);
void cast_scale_into_cuda(at::Tensor& dst, const at::Tensor& src, double scale,
                          bool accumulate);
#endif

}  // namespace mfsdp
