#include "fp8.h"

#include <algorithm>
#include <limits>

namespace mfsdp {
namespace {

// Dtypes the fused kernels take (float32 master, bf16/fp16 casts, both FP8 formats).
bool fused(const at::Tensor& shard, at::ScalarType fp8_dtype, at::ScalarType cast_dtype) {
  auto floaty = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  return shard.is_cuda() && shard.is_contiguous() && floaty(shard.scalar_type()) && floaty(cast_dtype) &&
         (fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2);
}

double fp8_max(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return 448.0;
    case at::kFloat8_e5m2: return 57344.0;
    default: MFSDP_CHECK(false, "not an FP8 dtype: ", t);
  }
  return 0;
}

void check_pieces(const char* what, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                  int64_t slots) {
  for (const auto& p : pieces) {
    MFSDP_CHECK(p.shard_offset >= 0 && p.numel >= 0 && p.shard_offset + p.numel <= shard.numel(), what,
                ": piece [", p.shard_offset, ", ", p.shard_offset + p.numel, ") exceeds the shard of ",
                shard.numel());
    MFSDP_CHECK(p.param >= 0 && p.param < slots, what, ": parameter index ", p.param, " out of range [0, ",
                slots, ")");
  }
}

}  // namespace

bool is_fp8_dtype(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void fp8_piece_amax(const at::Tensor& shard, const std::vector<GatherPiece>& pieces, at::Tensor& amax) {
  MFSDP_CHECK(amax.scalar_type() == at::kFloat && amax.dim() == 1 && amax.is_contiguous() &&
                  amax.device() == shard.device(),
              "fp8_piece_amax: amax must be a contiguous 1-D float32 tensor on ", shard.device());
  check_pieces("fp8_piece_amax", shard, pieces, amax.numel());
#ifdef WITH_CUDA
  if (fused(shard, at::kFloat8_e4m3fn, at::kFloat)) {
    fp8_piece_amax_cuda(shard, pieces, amax);
    return;
  }
#endif
  for (const auto& p : pieces) {
    if (!p.fp8 || p.numel == 0) continue;
    auto slot = amax.narrow(0, p.param, 1);
    // at::maximum propagates NaN, as torchao's inf-norm does.
    slot.copy_(at::maximum(slot, shard.narrow(0, p.shard_offset, p.numel).abs().max().to(at::kFloat).reshape({1})));
  }
}

void fill_gather_bytes(at::Tensor& bytes, const at::Tensor& shard, const std::vector<GatherPiece>& pieces,
                       const at::Tensor& scales, at::ScalarType fp8_dtype, at::ScalarType cast_dtype,
                       const at::Tensor& quantized) {
  MFSDP_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 && bytes.is_contiguous(),
              "fill_gather_bytes: the destination must be contiguous 1-D uint8");
  MFSDP_CHECK(is_fp8_dtype(fp8_dtype), "fill_gather_bytes: ", fp8_dtype, " is not an FP8 dtype");
  const bool any_fp8 = std::any_of(pieces.begin(), pieces.end(), [](const GatherPiece& p) { return p.fp8; });
  MFSDP_CHECK(!any_fp8 || (scales.defined() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                           scales.device() == shard.device()),
              "fill_gather_bytes: scales must be 1-D float32 on ", shard.device());
  for (const auto& p : pieces) {
    MFSDP_CHECK(p.param >= 0 && (!p.fp8 || p.param < scales.numel()), "fill_gather_bytes: no scale for parameter ",
                p.param);
  }
  check_pieces("fill_gather_bytes", shard, pieces, std::numeric_limits<int64_t>::max());
  const int64_t cast_width = c10::elementSize(cast_dtype);
  for (const auto& p : pieces) {
    MFSDP_CHECK(!p.copy || (quantized.defined() && quantized.scalar_type() == at::kByte &&
                            quantized.numel() == shard.numel() && quantized.device() == shard.device()),
                "fill_gather_bytes: a copied piece needs the quantized shard (uint8, one byte an element)");
    const int64_t width = (p.fp8 || p.copy) ? 1 : cast_width;
    MFSDP_CHECK(p.byte_offset >= 0 && p.byte_offset + p.numel * width <= bytes.numel() &&
                    p.byte_offset % width == 0,
                "fill_gather_bytes: piece of parameter ", p.param, " at byte ", p.byte_offset,
                " does not fit (aligned) in ", bytes.numel(), " bytes");
  }
#ifdef WITH_CUDA
  if (fused(shard, fp8_dtype, cast_dtype)) {
    fill_gather_bytes_cuda(bytes, shard, pieces, scales, fp8_dtype, cast_dtype,
                           quantized.defined() ? quantized : at::empty({0}, shard.options().dtype(at::kByte)));
    return;
  }
#endif
  const double max = fp8_max(fp8_dtype);
  for (const auto& p : pieces) {
    if (p.numel == 0) continue;
    if (p.copy) {
      bytes.narrow(0, p.byte_offset, p.numel).copy_(quantized.narrow(0, p.shard_offset, p.numel));
      continue;
    }
    const auto src = shard.narrow(0, p.shard_offset, p.numel);
    const int64_t width = p.fp8 ? 1 : cast_width;
    auto dst = bytes.narrow(0, p.byte_offset, p.numel * width).view(p.fp8 ? fp8_dtype : cast_dtype);
    if (p.fp8) {
      // torchao: (x.to(float32) * scale).clamp(-max, max).to(fp8)
      dst.copy_(at::clamp(src.to(at::kFloat) * scales.narrow(0, p.param, 1), -max, max));
    } else {
      dst.copy_(src);
    }
  }
}

at::Tensor fp8_scales_from_amax(const at::Tensor& amax, at::ScalarType fp8_dtype, at::ScalarType master_dtype) {
  // Clamped in float32, then divided in float64: torchao's precompute for FSDP.
  auto scale = fp8_max(fp8_dtype) / at::clamp_min(amax, 1e-12).to(at::kDouble);
  if (master_dtype == at::kHalf) scale = at::clamp_max(scale, 65504.0);
  return scale.to(at::kFloat);
}

}  // namespace mfsdp
