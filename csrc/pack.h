// Cast/copy kernels of the hot path.
//
//  pack_into_flat:  many gradients (any float dtype) -> one flat buffer at given offsets,
//                   cast to the buffer's dtype, overwriting or accumulating, the
//                   uncovered ranges zero-filled. One fused multi-tensor CUDA launch
//                   (vectorized where aligned) on GPU; ATen copies on CPU.
//  cast_scale_into: dst = src * scale (or dst += src * scale) with a dtype cast, used to
//                   turn a reduce-scattered shard into the fp32 sharded gradient.
#pragma once

#include "errors.h"
#include <ATen/ATen.h>

#include <vector>

namespace mfsdp {

// A range of a flat buffer's elements.
struct FlatRange {
  int64_t offset;
  int64_t numel;
};

// The ranges of [0, total) that no defined tensor covers (tensors[i] at offsets[i]), in order.
std::vector<FlatRange> uncovered_ranges(int64_t total, const std::vector<at::Tensor>& tensors,
                                        const std::vector<int64_t>& offsets);

// Undefined entries in `tensors` are skipped. With zero_fill_first (and not accumulate),
// every element no tensor covers (undefined entries' ranges, alignment gaps, the tail) is
// zero-filled, in the same launch as the copies: the buffer is written once. Each value is
// multiplied by `scale` (in fp32) as it is packed: flat = t * scale, or flat += t * scale.
void pack_into_flat(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets, bool accumulate,
                    bool zero_fill_first, double scale = 1.0);

// In place (dst is src) with scale 1 and no accumulation there is nothing to do: no kernel.
void cast_scale_into(at::Tensor& dst, const at::Tensor& src, double scale, bool accumulate);

#ifdef WITH_CUDA
// CUDA implementations (pack_kernels.cu). Preconditions checked by the callers above.
void pack_into_flat_cuda(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, const std::vector<FlatRange>& zero_ranges,
                         bool accumulate, double scale);
void cast_scale_into_cuda(at::Tensor& dst, const at::Tensor& src, double scale,
                          bool accumulate);
#endif

}  // namespace mfsdp
