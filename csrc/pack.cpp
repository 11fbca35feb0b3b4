#include "pack.h"

#include <algorithm>

namespace mfsdp {
namespace {

// The dtypes the fused CUDA kernels are instantiated for (float64 goes through ATen).
bool has_fused_kernel(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// dst = src * scale, or dst += src * scale, rounded once into dst's dtype: the product is
// taken in fp32 (or wider), as the CUDA kernel does, never after narrowing to a bf16/fp16
// buffer (a large fp32 gradient would overflow fp16 before its scale applied).
void copy_scaled(at::Tensor dst, const at::Tensor& src, double scale, bool accumulate) {
  if (!accumulate && scale == 1.0) {
    dst.copy_(src);
    return;
  }
  const auto wide = src.to(at::promote_types(src.scalar_type(), at::kFloat));
  if (accumulate) dst.add_(wide, scale);
  else if (dst.scalar_type() == wide.scalar_type()) at::mul_out(dst, wide, scale);
  else dst.copy_(wide * scale);  // mul_out's output must have the product's dtype
}

}  // namespace

std::vector<FlatRange> uncovered_ranges(int64_t total, const std::vector<at::Tensor>& tensors,
                                        const std::vector<int64_t>& offsets) {
  std::vector<FlatRange> covered;
  covered.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].numel() > 0) covered.push_back({offsets[i], tensors[i].numel()});
  }
  std::sort(covered.begin(), covered.end(), [](const FlatRange& a, const FlatRange& b) { return a.offset < b.offset; });
  std::vector<FlatRange> gaps;
  int64_t cursor = 0;  // everything before it is covered or listed
  for (const FlatRange& r : covered) {
    if (r.offset > cursor) gaps.push_back({cursor, r.offset - cursor});
    cursor = std::max(cursor, r.offset + r.numel);
  }
  if (cursor < total) gaps.push_back({cursor, total - cursor});
  return gaps;
}

void pack_into_flat(at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                    const std::vector<int64_t>& offsets, bool accumulate,
                    bool zero_fill_first, double scale) {
  MFSDP_CHECK(tensors.size() == offsets.size(), "pack_into_flat: ", tensors.size(),
              " tensors but ", offsets.size(), " offsets");
  MFSDP_CHECK(flat.defined() && flat.dim() == 1 && flat.is_contiguous(),
              "pack_into_flat: flat buffer must be 1-D contiguous");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined()) continue;
    MFSDP_CHECK(t.device() == flat.device(), "pack_into_flat: tensor ", i, " is on ", t.device(),
                " but the flat buffer is on ", flat.device());
    // Written so that no sum can overflow whatever the offset.
    MFSDP_CHECK(offsets[i] >= 0 && offsets[i] <= flat.numel() && t.numel() <= flat.numel() - offsets[i],
                "pack_into_flat: tensor ", i, " [", offsets[i], ", ", offsets[i] + t.numel(),
                ") exceeds the flat buffer of ", flat.numel());
  }
  // Only what no tensor covers is zeroed: a whole-buffer fill first would write the
  // buffer twice.
  const std::vector<FlatRange> zero_ranges =
      zero_fill_first && !accumulate ? uncovered_ranges(flat.numel(), tensors, offsets) : std::vector<FlatRange>{};

#ifdef WITH_CUDA
  if (flat.is_cuda() && has_fused_kernel(flat.scalar_type())) {
    // The fused kernel takes contiguous float tensors of one dtype; anything else
    // (rare: non-contiguous or mixed-dtype grads) goes through ATen below.
    std::vector<at::Tensor> fused;
    std::vector<int64_t> fused_offsets;
    std::vector<at::Tensor> rest;
    std::vector<int64_t> rest_offsets;
    at::ScalarType src_type = at::ScalarType::Undefined;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      if (!t.defined() || t.numel() == 0) continue;
      if (src_type == at::ScalarType::Undefined && has_fused_kernel(t.scalar_type())) src_type = t.scalar_type();
      if (t.is_contiguous() && t.scalar_type() == src_type) {
        fused.push_back(t);
        fused_offsets.push_back(offsets[i]);
      } else {
        rest.push_back(t);
        rest_offsets.push_back(offsets[i]);
      }
    }
    if (!fused.empty() || !zero_ranges.empty()) {
      pack_into_flat_cuda(flat, fused, fused_offsets, zero_ranges, accumulate, scale);
    }
    for (size_t i = 0; i < rest.size(); ++i) {
      auto dst = flat.narrow(0, rest_offsets[i], rest[i].numel());
      copy_scaled(dst, rest[i].reshape({-1}), scale, accumulate);
    }
    return;
  }
#endif
  for (const FlatRange& r : zero_ranges) flat.narrow(0, r.offset, r.numel).zero_();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.defined() || t.numel() == 0) continue;
    auto dst = flat.narrow(0, offsets[i], t.numel());
    copy_scaled(dst, t.reshape({-1}), scale, accumulate);
  }
}

void cast_scale_into(at::Tensor& dst, const at::Tensor& src, double scale, bool accumulate) {
  MFSDP_CHECK(dst.defined() && src.defined(), "cast_scale_into: tensors must be defined");
  MFSDP_CHECK(dst.device() == src.device(), "cast_scale_into: dst is on ", dst.device(), " but src is on ",
              src.device());
  MFSDP_CHECK(dst.numel() == src.numel(), "cast_scale_into: dst has ", dst.numel(),
              " elements, src has ", src.numel());
  MFSDP_CHECK(dst.is_contiguous() && src.is_contiguous(), "cast_scale_into: tensors must be contiguous");
  if (dst.numel() == 0) return;
  const bool in_place = dst.data_ptr() == src.data_ptr() && dst.scalar_type() == src.scalar_type();
  MFSDP_CHECK(!(in_place && accumulate), "cast_scale_into: cannot accumulate a buffer into itself");
  if (in_place && scale == 1.0) return;  // the usual case: the pack applied the scale
#ifdef WITH_CUDA
  if (dst.is_cuda() && has_fused_kernel(dst.scalar_type()) && has_fused_kernel(src.scalar_type())) {
    cast_scale_into_cuda(dst, src, scale, accumulate);
    return;
  }
#endif
  if (in_place) {  // RS wrote straight into the fp32 gradient; its factor changed since the pack
    dst.mul_(scale);
    return;
  }
  // Upcast first so that the scale is applied in the destination's precision.
  auto wide = src.scalar_type() == dst.scalar_type() ? src : src.to(dst.scalar_type());
  if (accumulate) dst.add_(wide, scale);
  else at::mul_out(dst, wide, scale);
}

}  // namespace mfsdp
