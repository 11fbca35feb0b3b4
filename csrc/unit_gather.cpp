// Unit: the parameter gather and its state machine, SHARDED -> GATHERING -> UNSHARDED ->
// SHARDED (unshard, unshard_together for a bucket, wait_unshard, reshard).
#include "unit.h"

#include "coalescing.h"
#include "flat_view.h"

#include <ATen/record_function.h>

namespace mfsdp {

bool Unit::needs_gather() {
  check_bound("unshard");
  wait_host_update();
  if (state_ == UnitState::kGathering) return false;  // wait_unshard() checks for re-links
  MFSDP_CHECK_VALUE(offloaded_ || sharded_flat_.device() == device_, "unit '", label_, "': its parameters are on ",
                    sharded_flat_.device(), " (moved by module.to() / .cpu()); move the model back to ", device_,
                    " (model.to(\"", device_, "\")) before its forward or unshard()");
  // Cheap (a pointer compare per parameter), and needed even for a kept copy: after
  // `p.data = x` the gathered copy no longer matches the parameter.
  adopt_data_writes();
  return !(state_ == UnitState::kUnsharded && !unsharded_is_stale());
}

void Unit::prepare_gather() {
  gathered_version_ = sharded_flat_._version();
  stale_ = false;
  allocate_unsharded();  // a no-op when the stale copy's storage is still there
}

at::Tensor Unit::gather_input(bool in_place) {
  if (gathers_bytes()) {
    // Quantize / cast every piece of the shard into this rank's bytes of the gather.
    const int r = shard_index();
    at::Tensor input = in_place
        ? unsharded_flat_.narrow(0, gather_bytes_->segment_starts[r], gather_bytes_->segment_bytes[r])
        : at::empty({gather_bytes_->segment_bytes[r]}, unsharded_flat_.options());
    fill_gather_bytes(input, sharded_flat_, gather_pieces_, fp8_scales_, fp8_dtype_, param_dtype_, mx_data_);
    return input;
  }
  if (offloaded_) {
    const int r = ag_comm_.rank();
    at::Tensor input = in_place ? flat_range(unsharded_flat_, layout_.segment_start(r), layout_.segment_numel(r))
                                : at::empty({sharded_flat_.numel()}, device_options(param_dtype_));
    copy_shard_in(input);
    return input;
  }
  if (transform_ == GatherTransform::kNone) return sharded_flat_;
  if (!in_place) return sharded_flat_.to(param_dtype_);
  // Cast straight into this rank's slot of the output: an in-place all-gather.
  const int r = ag_comm_.rank();
  at::Tensor input = flat_range(unsharded_flat_, layout_.segment_start(r), layout_.segment_numel(r));
  input.copy_(sharded_flat_);
  return input;
}

void Unit::unshard() {
  if (!needs_gather()) return;
  // Normally refreshed for the whole model before any gather (fp8.py); a shard changed
  // since (e.g. `p.data = x` adopted just above) is refreshed here, for this unit alone:
  // every rank gathers it at this point, so the all-reduce pairs up.
  if (fp8_scales_.defined() && fp8_scales_stale()) refresh_fp8_scales({this}, /*only_stale=*/true);
  MFSDP_CHECK(!fp8_scales_stale(), "unit '", label_, "': its quantized MXFP8 shard is older than its shard (a load "
              "or a write since it was made); the root's forward, unshard() and start_param_sync() quantize it "
              "first (megatron_fsdp_ext.refresh_fp8_scales(model) does it by hand)");
  RECORD_USER_SCOPE(unshard_scope_.c_str());
  // The copy kept after forward (reshard_after_forward=int) is read by this gather, over
  // the smaller group, only while it matches the shard; else it goes and the shard is read.
  at::Tensor post_forward = gathers_post_forward() ? post_forward_flat_ : at::Tensor();
  post_forward_flat_ = at::Tensor();
  prepare_gather();
  if (post_forward.defined()) {
    unshard_from_post_forward(post_forward);
    return;
  }
  if (replicated()) {  // a cast, no communication
    if (gathers_bytes()) {
      gather_input(/*in_place=*/true);
      if (mx_block_) unsharded_flat_.narrow(0, mx_scales_offset(), mx_scales_.numel()).copy_(mx_scales_);
    } else {
      unsharded_flat_.narrow(0, 0, sharded_flat_.numel()).copy_(sharded_flat_);
    }
    state_ = UnitState::kUnsharded;
    return;
  }
  // The FP8 gather: ranks contribute unequal byte counts (gather_bytes.h).
  auto all_gather = [&](at::Tensor& input) {
    if (gathers_bytes()) {
      at::Tensor data = unsharded_flat_.narrow(0, 0, gather_bytes_->total);
      ag_comm_.all_gather_v(data, input, gather_bytes_->segment_starts, gather_bytes_->segment_bytes);
      if (mx_block_) {  // every rank's scale bytes, even (segments are whole blocks)
        at::Tensor scales = unsharded_flat_.narrow(0, mx_scales_offset(), layout_.total_numel() / mx_block_);
        ag_comm_.all_gather_flat(scales, mx_scales_);
      }
    } else {
      ag_comm_.all_gather_flat(unsharded_flat_, input);
    }
  };
  on_gather_stream([&](bool on_stream) {
    at::Tensor input = gather_input(/*in_place=*/on_stream);
    run_collective(CollectivePhase::kAllGatherParams, ag_comm_, unsharded_flat_.numel(), [&] { all_gather(input); });
  });
}

template <typename F>
bool Unit::on_gather_stream(F&& issue) {
  const auto& streams = ctx().streams();
  if (!streams.enabled()) {
    issue(/*on_stream=*/false);
    state_ = UnitState::kUnsharded;
    return false;
  }
  compute_ready_.record(current_stream(device_));
  c10::StreamGuard guard(streams.all_gather());
  compute_ready_.block(streams.all_gather());
  issue(/*on_stream=*/true);
  ctx().delay_after_collective();
  all_gather_done_->record(streams.all_gather());
  gathered_ = all_gather_done_;
  state_ = UnitState::kGathering;
  return true;
}

void Unit::unshard_from_post_forward(at::Tensor kept) {
  const bool on_stream = on_gather_stream([&](bool) {
    run_collective(CollectivePhase::kAllGatherPostForward, post_forward_comm_, unsharded_flat_.numel(),
                   [&] { post_forward_comm_.all_gather_flat(unsharded_flat_, kept); });
  });
  if (on_stream) post_forward_in_flight_ = std::move(kept);  // freed once the compute stream waited (wait_unshard)
}

void Unit::unshard_together(const std::vector<Unit*>& units) {
  auto [together, alone] = split_for_coalescing(
      units, "unshard_together", [](Unit& u) { return u.needs_gather(); },
      // An FP8 unit's uneven byte gather runs alone.
      // So does one gathering from its post-forward copy, over a group of its own.
      [](const Unit& u) {
        return !u.replicated() && u.ctx_ != nullptr && !u.gathers_bytes() && !u.gathers_post_forward();
      },
      [](const Unit& lead, const Unit& u) {
        return u.ag_comm_.group().get() == lead.ag_comm_.group().get() && u.param_dtype_ == lead.param_dtype_ &&
               u.ctx_ == lead.ctx_;
      });
  for (Unit* u : alone) u->unshard();
  if (together.empty()) return;

  Unit& lead = *together.front();
  for (Unit* u : together) {
    RECORD_USER_SCOPE(u->unshard_scope_.c_str());  // UnitTrace sees every unit start gathering
    u->prepare_gather();
  }
  std::vector<at::Tensor> outs, ins;
  std::vector<int64_t> numels;
  for (Unit* u : together) {
    outs.push_back(u->unsharded_flat_);
    numels.push_back(u->unsharded_flat_.numel());
  }
  auto issue = [&] {
    run_coalesced(CollectivePhase::kAllGatherParams, together, numels, lead.ag_comm_,
                  [&] { lead.ag_comm_.all_gather_flat_coalesced(outs, ins); });
  };
  const auto& streams = lead.ctx().streams();
  if (streams.enabled()) {
    lead.compute_ready_.record(current_stream(lead.device_));
    c10::StreamGuard guard(streams.all_gather());
    lead.compute_ready_.block(streams.all_gather());
    for (Unit* u : together) ins.push_back(u->gather_input(/*in_place=*/true));
    issue();
    lead.ctx().delay_after_collective();
    lead.all_gather_done_->record(streams.all_gather());
    for (Unit* u : together) {
      u->gathered_ = lead.all_gather_done_;
      u->state_ = UnitState::kGathering;
    }
    return;
  }
  for (Unit* u : together) ins.push_back(u->gather_input(/*in_place=*/false));
  issue();
  for (Unit* u : together) u->state_ = UnitState::kUnsharded;
}

void Unit::unshard_all(const std::vector<Unit*>& units, bool bucketed) {
  if (bucketed && units.size() > 1) {
    unshard_together(units);
    return;
  }
  for (Unit* u : units) {
    MFSDP_CHECK(u != nullptr, "unshard_all: a unit is None");
    u->unshard();
  }
}

void Unit::wait_unshard() {
  if (state_ == UnitState::kSharded) return;
  if (state_ == UnitState::kGathering) {
    gathered_->block(current_stream(device_));
    post_forward_in_flight_ = at::Tensor();
    state_ = UnitState::kUnsharded;
    // A `p.data = x` while the gather was in flight (e.g. an EMA swap after
    // start_param_sync) makes the gathered copy stale.
    adopt_data_writes();
  }
  if (unsharded_is_stale()) {
    // The shard was written after the gather was issued (e.g. a second optimizer or an
    // EMA after start_param_sync), or since (a strategy that keeps params unsharded):
    // the gathered copy may be stale or torn. Gather again into the same storage.
    unshard();
    wait_unshard();
  }
}

void Unit::reshard(bool keep_post_forward) {
  if (!keep_post_forward) post_forward_flat_ = at::Tensor();
  if (state_ == UnitState::kSharded || aliases_shard()) return;
  RECORD_USER_SCOPE(reshard_scope_.c_str());
  wait_unshard();  // never free memory a collective may still write
  if (keep_post_forward && post_forward_comm_.defined() && !unsharded_is_stale()) {
    // This rank's 1/N, copied on the compute stream (where the buffer is freed next).
    const int64_t numel = layout_.total_numel() / post_forward_comm_.size();
    post_forward_flat_ = unsharded_flat_.narrow(0, post_forward_comm_.rank() * numel, numel).clone();
    post_forward_version_ = gathered_version_;
    post_forward_generation_ = shard_generation_;
  }
  free_unsharded();
  state_ = UnitState::kSharded;
}

}  // namespace mfsdp
