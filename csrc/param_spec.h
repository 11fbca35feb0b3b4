// ParamSpec: one parameter of a unit as every part of the library sees it. The unit's
// views, the shard cut (local_piece), the gather's copy-out and gradient landing read
// these fields, and Python reads them as `Unit.param_specs`. A new kind of parameter
// becomes a new field or value here: an FP8 gather a GatherTransform, offloaded storage
// a storage_device other than the unit's, tensor-parallel placements a field holding the
// local tensor's outer placements (docs/design.md, "Adding a parameter kind").
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "layout.h"

namespace mfsdp {

// How the sharded (master) value becomes the gathered copy the forward computes with.
enum class GatherTransform {
  kNone = 0,  // gathered as stored
  kCast = 1,  // cast to the unit's param dtype before the all-gather (mixed precision)
  kFp8 = 2,   // quantized with its tensorwise scale into an FP8 dtype before the all-gather
              // (fp8.h); the unit's gather is then bytes (gather_bytes.h)
  kMxfp8 = 3, // MXFP8: FP8 data and one E8M0 scale per block of 32, quantized per rank from
              // its own whole blocks (block-aligned shards), gathered as bytes
};
inline const char* gather_transform_name(GatherTransform transform) {
  switch (transform) {
    case GatherTransform::kCast: return "cast";
    case GatherTransform::kFp8: return "fp8";
    case GatherTransform::kMxfp8: return "mxfp8";
    default: return "none";
  }
}

struct ParamSpec {
  std::string name;            // the name fully_shard found it under first (tied names: param_index.py)
  std::vector<int64_t> shape;  // the local full shape: what the module computes with
  at::ScalarType dtype;        // the stored (sharded master) dtype
  at::ScalarType gather_dtype; // the gathered copy's dtype
  GatherTransform transform;   // how dtype becomes gather_dtype
  c10::Device storage_device;  // where the shard and its gradient live
  ShardSlice slice;            // this rank's piece of the parameter, and where it sits in the shard
  int64_t state_dict_dim = 0;  // the dim state dicts shard it on over the data-parallel group
                               // (FSDP2's Shard(dim), from shard_placement_fn); the flat
                               // layout, and so training, do not depend on it

  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

}  // namespace mfsdp
