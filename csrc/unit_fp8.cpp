// Unit: the quantized gathers. Tensorwise FP8 (scales from an all-reduced amax) and MXFP8
// (a shard quantized in Python) both gather one byte an element for their parameters
// (gather_bytes.h); the bytes are written by fill_gather_bytes (fp8.h).
#include "unit.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace mfsdp {

void Unit::set_fp8_gather(const std::vector<int64_t>& params, at::ScalarType fp8_dtype) {
  set_byte_gather(params, fp8_dtype, GatherTransform::kFp8);
  fp8_scales_ = at::ones({layout_.num_params()}, device_options(at::kFloat));
}

void Unit::set_mx_gather(const std::vector<int64_t>& params, int64_t block) {
  MFSDP_CHECK_VALUE(block > 0 && layout_.alignment() % block == 0, "set_mx_gather: unit '", label_,
                    "' has alignment ", layout_.alignment(), ", not a multiple of the MX block ", block,
                    ": shards would split blocks");
  for (int64_t i : params) {
    MFSDP_CHECK_VALUE(i >= 0 && i < layout_.num_params(), "set_mx_gather: parameter index ", i, " out of range");
    const auto& shape = specs_[i].shape;
    MFSDP_CHECK_VALUE(shape.size() >= 2 && shape.back() % block == 0, "set_mx_gather: parameter '", specs_[i].name,
                      "' of shape ", shape, " is not a matrix whose last dim is a multiple of ", block);
  }
  mx_block_ = block;
  set_byte_gather(params, at::kFloat8_e4m3fn, GatherTransform::kMxfp8);
  const int64_t shard = sharded_flat_.numel();
  mx_data_ = at::zeros({shard}, sharded_flat_.options().dtype(at::kByte));
  mx_scales_ = at::zeros({shard / block}, sharded_flat_.options().dtype(at::kByte));
}

std::vector<at::Tensor> Unit::mx_scale_views() const {
  MFSDP_CHECK(mx_block_ > 0, "unit '", label_, "' has no MXFP8 gather");
  std::vector<at::Tensor> out(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].transform != GatherTransform::kMxfp8) continue;
    std::vector<int64_t> shape = specs_[i].shape;
    shape.back() /= mx_block_;
    out[i] = unsharded_view(at::kByte, shape, mx_scales_offset() + layout_.param_offset(i) / mx_block_);
  }
  return out;
}

void Unit::mark_quantized() {
  MFSDP_CHECK(gathers_bytes(), "unit '", label_, "' has no FP8 gather");
  scales_generation_ = shard_generation_;
  scales_version_ = sharded_flat_._version();
  if (!aliases_shard()) stale_ = true;  // a kept or in-flight copy holds the old bytes
}

void Unit::set_byte_gather(const std::vector<int64_t>& params, at::ScalarType fp8_dtype, GatherTransform transform) {
  MFSDP_CHECK(!gathers_bytes(), "unit '", label_, "' already gathers in FP8");
  MFSDP_CHECK(sharded_params_.empty(), "the FP8 gather is set before bind_params");
  MFSDP_CHECK_VALUE(is_fp8_dtype(fp8_dtype), "the FP8 gather: ", fp8_dtype,
                    " is not an FP8 dtype (float8_e4m3fn or float8_e5m2)");
  MFSDP_CHECK_VALUE(!params.empty(), "the FP8 gather: no parameter to gather in FP8");
  MFSDP_CHECK_VALUE(layout_.kind() == SegmentKind::kEven, "the FP8 gather: unit '", label_,
                    "' has an owner layout (layer-wise optimizer); the FP8 gather needs the even layout");
  std::vector<int64_t> widths(specs_.size(), static_cast<int64_t>(c10::elementSize(param_dtype_)));
  for (int64_t i : params) {
    MFSDP_CHECK_VALUE(i >= 0 && i < layout_.num_params(), "the FP8 gather: parameter index ", i,
                      " out of range [0, ", layout_.num_params(), ")");
    widths[i] = 1;
    specs_[i].gather_dtype = fp8_dtype;
    specs_[i].transform = transform;
  }
  GatherBytes bytes = gather_bytes_of(layout_, widths);
  for (size_t i = 0; i < specs_.size(); ++i) {
    MFSDP_CHECK_VALUE(bytes.param_starts[i] % widths[i] == 0, "the FP8 gather: parameter '", specs_[i].name,
                      "' would start at byte ", bytes.param_starts[i], ", not a multiple of its ", widths[i],
                      "-byte dtype; use an alignment of at least 16 elements");
  }
  const int r = shard_index();
  for (size_t i = 0; i < specs_.size(); ++i) {
    const auto& sl = specs_[i].slice;
    if (sl.numel == 0) continue;
    const bool one_byte = widths[i] == 1;
    gather_pieces_.push_back(GatherPiece{sl.shard_offset, sl.numel,
                                         bytes.param_starts[i] + sl.param_offset * widths[i] - bytes.segment_starts[r],
                                         static_cast<int64_t>(i), one_byte && transform == GatherTransform::kFp8,
                                         one_byte && transform == GatherTransform::kMxfp8});
  }
  gather_bytes_ = std::move(bytes);
  fp8_dtype_ = fp8_dtype;
  transform_ = transform;
  make_unsharded_buffer();
}

const GatherBytes& Unit::gather_bytes() const {
  MFSDP_CHECK(gathers_bytes(), "unit '", label_, "' has no FP8 gather");
  return *gather_bytes_;
}

bool Unit::fp8_scales_stale() const {
  return gathers_bytes() &&
         (scales_generation_ != shard_generation_ || scales_version_ != sharded_flat_._version());
}

void Unit::refresh_fp8_scales(const std::vector<Unit*>& units, bool only_stale) {
  std::vector<std::vector<Unit*>> by_group;  // in first-seen order: the same on every rank
  for (Unit* u : units) {
    MFSDP_CHECK(u != nullptr, "refresh_fp8_scales: a unit is None");
    // MXFP8 units are quantized by Python (fp8.py) and need no all-reduce.
    if (!u->fp8_scales_.defined() || (only_stale && !u->fp8_scales_stale())) continue;
    auto it = std::find_if(by_group.begin(), by_group.end(), [&](const std::vector<Unit*>& g) {
      return g.front()->ag_comm_.group().get() == u->ag_comm_.group().get() && g.front()->device_ == u->device_ &&
             g.front()->replicated() == u->replicated();
    });
    if (it == by_group.end()) by_group.push_back({u});
    else it->push_back(u);
  }
  for (auto& group : by_group) {
    Unit& lead = *group.front();
    int64_t n = 0;
    for (Unit* u : group) n += u->layout_.num_params();
    at::Tensor amax = at::zeros({n}, lead.sharded_flat_.options().dtype(at::kFloat));
    int64_t at = 0;
    for (Unit* u : group) {
      auto slot = amax.narrow(0, at, u->layout_.num_params());
      fp8_piece_amax(u->sharded_flat_, u->gather_pieces_, slot);
      at += u->layout_.num_params();
    }
    // Replicated units hold every element: their amax is already the global one.
    if (!lead.replicated() && lead.ag_comm_.size() > 1) {
      // Reduced as int32 bits: non-negative floats order like their bits, and a NaN made
      // the positive quiet NaN sorts above +inf, so one rank's NaN reaches every rank
      // whatever the backend's float max does with NaN (NCCL's drops it).
      amax.masked_fill_(amax.isnan(), std::numeric_limits<float>::quiet_NaN());
      at::Tensor bits = amax.view(at::kInt);
      lead.run_collective(CollectivePhase::kAllReduceFp8Amax, lead.ag_comm_, n,
                          [&] { lead.ag_comm_.all_reduce(bits, c10d::ReduceOp::MAX); });
    }
    at = 0;
    for (Unit* u : group) {
      const int64_t k = u->layout_.num_params();
      u->fp8_scales_.copy_(fp8_scales_from_amax(amax.narrow(0, at, k), u->fp8_dtype_, u->orig_dtype_));
      at += k;
      u->mark_quantized();  // a kept or in-flight copy was quantized with the old scales
    }
  }
}

}  // namespace mfsdp
