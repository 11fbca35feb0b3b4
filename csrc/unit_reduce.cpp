// Unit: the gradient reduction. reduce_grads packs the unsharded gradients into a flat
// reduce-dtype buffer, plans where the result lands, reduces it on the reduce-scatter
// stream (then across replicas under HSDP) and lands it as the sharded .grad;
// reduce_together does the same for a bucket in one collective.
#include "unit.h"

#include "coalescing.h"
#include "flat_view.h"
#include "grad_buffers.h"
#include "pack.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

namespace mfsdp {

namespace {

// Under CUDA graph capture nothing may wait for or query the work being captured: the
// agreement word is then neither copied out nor checked (its all-reduce still runs).
bool capturing(const c10::Device& device) {
#ifdef WITH_CUDA
  return device.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  (void)device;
  return false;
#endif
}

}  // namespace

void Unit::set_gradient_divide_factor(double factor) {
  MFSDP_CHECK(factor >= 0 && std::isfinite(factor), "gradient divide factor must be finite and > 0 (0 restores the "
              "default, the group size), got ", factor);
  grad_divide_factor_ = factor;
}

at::Tensor Unit::flat_grad_behind_views() const {
  // The grads view either a segment-sized buffer from offset 0 (reduce-scatter, or a
  // cast after an all-reduce) or, for full-gradient strategies (no_shard, optim)
  // without a cast, this rank's segment of the whole all-reduced flat buffer.
  const int64_t seg = layout_.segment_numel(shard_index());
  int64_t base = 0;
  c10::Storage storage;
  for (size_t i = 0; i < sharded_params_.size(); ++i) {
    if (!has_grad_[i]) continue;
    const auto& g = sharded_params_[i].grad();
    if (!g.defined() || g.scalar_type() != orig_dtype_ || g.numel() != specs_[i].slice.numel) return {};
    if (specs_[i].slice.numel == 0) continue;  // an empty view may not share the storage object
    if (!storage) {
      storage = g.storage();
      const auto numel = static_cast<int64_t>(storage.nbytes() / g.element_size());
      if (numel == seg) {
        base = 0;  // a segment-sized buffer (reduce-scatter, or a cast after the all-reduce)
      } else if (full_grads() && numel == layout_.total_numel()) {
        base = layout_.segment_start(shard_index());  // this rank's segment of the all-reduced buffer
      } else {
        return {};
      }
    } else if (!g.storage().is_alias_of(storage)) {
      return {};
    }
    auto* expect = static_cast<const char*>(storage.data()) + (base + specs_[i].slice.shard_offset) * g.element_size();
    if (static_cast<const char*>(g.const_data_ptr()) != expect) return {};
  }
  if (!storage) return {};
  return at::empty({0}, sharded_flat_.options()).set_(storage, base, {seg}, {1});
}

bool Unit::reduce_grads(bool sync, bool may_join) {
  check_bound("reduce_grads");
  at::Tensor flat = pack_grads(sync);
  const bool defer = sync && replicate_comm_.defined() && !requires_all_reduce_;
  bool agreed = false;
  if (!flat.defined()) {
    if (!sync) return false;
    // No gradient here. Deferred shards still wait for their all-reduce, and the unit's
    // parameters may have gradients on other ranks (used there only): the reduction then
    // runs with zeros so that it happens on every rank of the group alike.
    const bool pending_partial = !defer && partial_.defined();
    if (!pending_partial) {
      if (!may_join || !joins_without_grads()) return false;
      agree_on_grads({this});
      agreed = true;
      expects_reduction_ = false;
      if (!any_agreed_grad()) return false;  // no rank had one: the same answer everywhere
    }
    flat = zeros_to_reduce();
  }
  if (!sync) {
    accumulated_ = flat;
    return true;
  }
  accumulated_ = at::Tensor();
  expects_reduction_ = false;
  if (!agreed) agree_on_grads({this});
  GradBuffers buffers = plan_reduction(std::move(flat), defer);
  at::Tensor partial = partial_;  // consumed by a non-deferred reduction: freed once it is done
  if (defer && !partial_.defined()) {
    partial_ = at::zeros({layout_.segment_numel(shard_index())}, device_options(reduce_dtype_));
    partial_scale_ = buffers.scale;
  }
  auto done = reduce(buffers, defer);
  if (defer) {
    // Nothing lands: has_grad_ keeps which parameters will get a gradient view.
    ctx().hold_reduction({buffers.flat, buffers.reduced, partial_}, std::move(done));
    return true;
  }
  partial_ = at::Tensor();
  land_grads(buffers, *done);
  ctx().hold_reduction({buffers.flat, buffers.reduced, buffers.target, buffers.host, partial}, done);
  const auto hooked = hooked_landings();
  std::fill(has_grad_.begin(), has_grad_.end(), false);
  run_post_accumulate_grad_hooks(hooked, buffers, *done);
  return true;
}

at::Tensor Unit::zeros_to_reduce() {
  ctx().make_room_for_reduction();
  packed_scale_ = pack_scale();
  return at::zeros({layout_.total_numel()}, device_options(reduce_dtype_));
}

void Unit::drop_unreduced_grads() {
  if (ctx_ != nullptr) ctx().wait_reductions();
  accumulated_ = at::Tensor();
  partial_ = at::Tensor();
  std::fill(has_grad_.begin(), has_grad_.end(), false);
}

at::Tensor Unit::pack_grads(bool sync) {
  const int64_t n = layout_.num_params();
  std::vector<at::Tensor> grads(n);
  bool any = false, all = true;
  for (int64_t i = 0; i < n; ++i) {
    const auto& g = unsharded_locals_[i].grad();
    if (g.defined()) {
      MFSDP_CHECK(g.numel() == layout_.param_numel(i), "gradient of '", specs_[i].name, "' has ",
                  g.numel(), " elements, expected ", layout_.param_numel(i));
      // The gathered parameters are freed before their gradients are packed (the
      // post-backward hook), so a gradient may not live in their memory.
      MFSDP_CHECK(state_ != UnitState::kSharded || aliases_shard() ||
                      g.storage().unsafeGetStorageImpl() != unsharded_flat_.storage().unsafeGetStorageImpl(),
                  "the gradient of '", specs_[i].name, "' in fully_shard unit '", label_,
                  "' is a view of the gathered parameters, which are freed after backward; a custom autograd "
                  "function must return a new tensor as the gradient (e.g. weight.clone())");
      grads[i] = g;
      any = true;
      has_grad_[i] = true;
    } else {
      all = false;
    }
  }
  if (!any && !accumulated_.defined()) return {};

  const bool accumulate = accumulated_.defined();
  // The held reduction's buffers are retired before new ones are allocated.
  if (!accumulate && sync) ctx().make_room_for_reduction();
  at::Tensor flat = accumulate ? accumulated_
                               : comm_buffer(rs_comm_, layout_.total_numel(), device_options(reduce_dtype_),
                                             reduce_buffer_from_group_ && ran_device_collective(rs_comm_.group()));
  // Scaled as packed (what is accumulated keeps the scale it started with); the reduction
  // scales again only if the factor changed meanwhile (finish_reduction).
  if (!accumulate) packed_scale_ = pack_scale();
  pack_into_flat(flat, grads, layout_.offsets(), accumulate, layout_.has_gaps() || !all, packed_scale_);
  // The packed copy is all we need: free the unsharded gradients right away.
  for (int64_t i = 0; i < n; ++i) {
    if (grads[i].defined()) unsharded_locals_[i].mutable_grad() = at::Tensor();
  }
  return flat;
}

GradBuffers Unit::plan_reduction(at::Tensor flat, bool defer) {
  wait_host_update();  // a step still reading the gradient this reduction lands in
  GradBuffers b;
  b.flat = std::move(flat);
  b.scale = packed_scale_;  // set by the pack (or the zero-filled stand-in) that made `flat`
  const int64_t seg = layout_.segment_numel(shard_index());
  if (defer) {
    b.reduced = full_grads() ? b.flat.narrow(0, layout_.segment_start(shard_index()), seg)
                             : at::empty({seg}, device_options(reduce_dtype_));
    return b;
  }
  bool all_none = true;
  for (size_t i = 0; i < has_grad_.size(); ++i) {
    if (has_grad_[i] && sharded_params_[i].grad().defined()) all_none = false;
  }
  if (offloaded_) {
    // Reduced and scaled on the device, then copied out: into the kept host buffer when
    // the .grads are fresh, else into host staging that land_grads adds per parameter
    // once the copy is done (a host wait, as FSDP2's accumulation into offloaded grads).
    b.landing = all_none ? GradLanding::kFresh : GradLanding::kMixed;
    b.target = at::empty({seg}, device_options(orig_dtype_));
    b.reduced = reduce_dtype_ == orig_dtype_ ? b.target : at::empty({seg}, device_options(reduce_dtype_));
    b.host = all_none ? host_grad_buffer()
                      : at::empty({seg}, at::TensorOptions().dtype(orig_dtype_).pinned_memory(pinned_));
    return b;
  }
  at::Tensor existing = all_none ? at::Tensor() : flat_grad_behind_views();
  b.landing = all_none ? GradLanding::kFresh : (existing.defined() ? GradLanding::kAccumulate : GradLanding::kMixed);
  const auto grad_options = device_options(orig_dtype_);
  // Full gradients (no_shard, optim) are all-reduced in place; this rank's segment of
  // the flat buffer is then its reduced shard, and in the fresh fp32 case the sharded
  // .grad views alias it, keeping the full buffer alive: ZeRO-1's full-gradient memory.
  const bool reduce_into_target = b.landing == GradLanding::kFresh && reduce_dtype_ == orig_dtype_;
  if (b.landing == GradLanding::kAccumulate) b.target = existing;
  if (full_grads()) {
    b.reduced = b.flat.narrow(0, layout_.segment_start(shard_index()), seg);
    if (b.landing != GradLanding::kAccumulate) b.target = reduce_into_target ? b.reduced : at::empty({seg}, grad_options);
  } else {
    if (b.landing != GradLanding::kAccumulate) b.target = at::empty({seg}, grad_options);
    b.reduced = reduce_into_target ? b.target : at::empty({seg}, grad_options.dtype(reduce_dtype_));
  }
  return b;
}

double Unit::grad_scale() const {
  const double mean_over = static_cast<double>(world_size()) * replicate_size();
  return 1.0 / (grad_divide_factor_ > 0 ? grad_divide_factor_ : mean_over);
}

double Unit::pack_scale() const {
  return reduce_dtype_ == at::kHalf ? 1.0 : grad_scale();
}

template <typename F>
std::shared_ptr<PendingCollective> Unit::on_reduce_stream(F&& issue) {
  // One event per unit, recorded again each reduction: the context retires the held
  // reduction before the next is recorded (at worst it then waits for the newer one,
  // which is ordered after it on the same stream).
  if (!reduction_done_) reduction_done_ = std::make_shared<PendingCollective>(device_);
  const auto& streams = ctx().streams();
  if (!streams.enabled()) {
    issue();
    return reduction_done_;
  }
  compute_ready_.record(current_stream(device_));
  c10::StreamGuard guard(streams.reduce_scatter());
  compute_ready_.block(streams.reduce_scatter());
  issue();
  reduction_done_->record(streams.reduce_scatter());
  return reduction_done_;
}

std::shared_ptr<PendingCollective> Unit::reduce(GradBuffers& b, bool defer) {
  return on_reduce_stream([&]() {
    if (full_grads()) {
      run_collective(CollectivePhase::kAllReduceGrads, rs_comm_, b.flat.numel(),
                     [&] { rs_comm_.all_reduce(b.flat, c10d::ReduceOp::SUM); });
    } else {
      run_collective(CollectivePhase::kReduceScatterGrads, rs_comm_, b.flat.numel(),
                     [&] { rs_comm_.reduce_scatter_flat(b.reduced, b.flat); });
    }
    if (defer) {
      partial_.add_(b.reduced, partial_scale_ / b.scale);
      return;
    }
    if (replicate_comm_.defined()) {
      // On the same stream, after the reduce-scatter: with one reduction in flight a
      // stream of its own would only reorder work the next reduction waits for anyway.
      if (partial_.defined()) b.reduced.add_(partial_, b.scale / partial_scale_);
      run_collective(CollectivePhase::kAllReduceReplicas, replicate_comm_, b.reduced.numel(),
                     [&] { replicate_comm_.all_reduce(b.reduced, c10d::ReduceOp::SUM); });
    }
    ctx().delay_after_collective();
    finish_reduction(b);
  });
}

void Unit::finish_reduction(GradBuffers& b) {
  cast_scale_into(b.target, b.reduced, grad_scale() / b.scale, b.landing == GradLanding::kAccumulate);
  if (check_nonfinite_) ctx().check_nonfinite({b.target});
  copy_out(b);
}


void Unit::reduce_together(const std::vector<Unit*>& units, bool may_join) {
  auto [together, alone] = split_for_coalescing(
      units, "reduce_together", [](Unit&) { return true; },
      [](const Unit& u) { return u.can_share_reduction() && u.ctx_ != nullptr; },
      [](const Unit& lead, const Unit& u) {
        return u.rs_comm_.group().get() == lead.rs_comm_.group().get() && u.reduce_dtype_ == lead.reduce_dtype_ &&
               u.ctx_ == lead.ctx_;
      });
  for (Unit* u : alone) u->reduce_grads(/*sync=*/true, may_join);
  // Pack every member's gradients (the first pack retires the held reduction). A unit
  // with no gradient here drops out, unless other ranks may reduce it
  // (joins_without_grads): then it takes part in the agreement and stays a member, with
  // zeros, if some rank had a gradient.
  std::vector<Unit*> members;
  std::vector<at::Tensor> flats;
  for (Unit* u : together) {
    u->check_bound("reduce_grads");
    at::Tensor flat = u->pack_grads(/*sync=*/true);
    const bool joins = flat.defined() || (may_join && u->joins_without_grads());
    u->accumulated_ = at::Tensor();
    if (!joins) continue;
    u->expects_reduction_ = false;
    members.push_back(u);
    flats.push_back(std::move(flat));
  }
  if (members.empty()) return;
  agree_on_grads(members);
  // The agreed flags are the same on every rank, so every rank drops the same members.
  size_t kept = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    Unit& u = *members[i];
    if (!flats[i].defined()) {
      if (!u.any_agreed_grad()) continue;
      flats[i] = u.zeros_to_reduce();
    }
    members[kept] = members[i];
    flats[kept] = std::move(flats[i]);
    ++kept;
  }
  members.resize(kept);
  flats.resize(kept);
  if (members.empty()) return;
  std::vector<GradBuffers> buffers;
  for (size_t i = 0; i < members.size(); ++i) {
    buffers.push_back(members[i]->plan_reduction(std::move(flats[i]), /*defer=*/false));
  }
  Unit& lead = *members.front();
  std::vector<at::Tensor> outs, ins;
  std::vector<int64_t> numels;
  for (auto& b : buffers) {
    outs.push_back(b.reduced);
    ins.push_back(b.flat);
    numels.push_back(b.flat.numel());
  }
  auto done = lead.on_reduce_stream([&]() {
    run_coalesced(CollectivePhase::kReduceScatterGrads, members, numels, lead.rs_comm_,
                  [&] { lead.rs_comm_.reduce_scatter_flat_coalesced(outs, ins); });
    lead.ctx().delay_after_collective();
    std::vector<at::Tensor> checked;  // one fused check for the bucket
    for (size_t i = 0; i < members.size(); ++i) {
      cast_scale_into(buffers[i].target, buffers[i].reduced, members[i]->grad_scale() / buffers[i].scale,
                      buffers[i].landing == GradLanding::kAccumulate);
      if (members[i]->check_nonfinite_) checked.push_back(buffers[i].target);
    }
    if (!checked.empty()) lead.ctx().check_nonfinite(checked);
    for (size_t i = 0; i < members.size(); ++i) members[i]->copy_out(buffers[i]);
  });
  std::vector<at::Tensor> held;
  std::vector<std::vector<int64_t>> hooked(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    Unit& u = *members[i];
    u.land_grads(buffers[i], *done);
    held.insert(held.end(), {buffers[i].flat, buffers[i].reduced, buffers[i].target, buffers[i].host});
    hooked[i] = u.hooked_landings();
    std::fill(u.has_grad_.begin(), u.has_grad_.end(), false);
  }
  lead.ctx().hold_reduction(std::move(held), done);
  for (size_t i = 0; i < members.size(); ++i) {
    members[i]->run_post_accumulate_grad_hooks(hooked[i], buffers[i], *done);
  }
}

bool Unit::lacks_some_grad() const {
  for (size_t i = 0; i < has_grad_.size(); ++i) {
    if (!has_grad_[i] && sharded_params_[i].requires_grad()) return true;
  }
  return false;
}

bool Unit::joins_without_grads() const {
  return expects_reduction_ && world_size() * replicate_size() > 1 && lacks_some_grad();
}

bool Unit::any_agreed_grad() const {
  return std::find(has_grad_.begin(), has_grad_.end(), true) != has_grad_.end();
}

void Unit::agree_on_grads(const std::vector<Unit*>& units) {
  Unit& lead = *units.front();
  if (lead.world_size() * lead.replicate_size() == 1) return;
  const bool captured = capturing(lead.device_);
  if (!captured) lead.check_previous_agreement();
  std::vector<int32_t> flags;
  std::vector<int64_t> numels;
  bool lacking = false;
  uint64_t which = 0;
  for (const Unit* u : units) {
    for (bool had : u->has_grad_) flags.push_back(had ? 1 : 0);
    numels.push_back(static_cast<int64_t>(u->has_grad_.size()));
    lacking = lacking || u->lacks_some_grad();
    which = which * 1000003u + static_cast<uint64_t>(u->label_hash_);
  }
  // h in [1, 2^30): h + (-h) and the maxima stay in int32.
  const auto h = static_cast<int32_t>(1 + which % ((uint64_t{1} << 30) - 1));
  const auto n = static_cast<int64_t>(flags.size());
  flags.push_back(h);
  flags.push_back(-h);
  // Pinned, so the copy is legal under CUDA graph capture; the host allocator keeps the
  // pinned block until the copy ran.
  at::Tensor host = at::tensor(flags, at::kInt);
  const bool cuda = lead.device_.is_cuda();
  if (cuda) host = host.pin_memory();
  at::Tensor mask;
  auto done = lead.on_reduce_stream([&]() {
    // Copied and allocated on the reduce-scatter stream, where the all-reduce writes it:
    // no copy on the compute stream, and the memory is not reused before it is done.
    mask = host.to(lead.device_, /*non_blocking=*/true);
    run_coalesced(CollectivePhase::kAllReduceGradMask, units, numels, lead.rs_comm_,
                  [&] { lead.rs_comm_.all_reduce(mask, c10d::ReduceOp::MAX); });
    if (lead.replicate_comm_.defined()) {
      run_coalesced(CollectivePhase::kAllReduceGradMask, units, numels, lead.replicate_comm_,
                    [&] { lead.replicate_comm_.all_reduce(mask, c10d::ReduceOp::MAX); });
    }
    if (!cuda || captured) return;  // on the CPU the host waited for the all-reduce: read below
    const at::Tensor word = mask.narrow(0, n, 1) + mask.narrow(0, n + 1, 1);
    lead.agreement_word_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
    lead.agreement_word_.copy_(word, /*non_blocking=*/true);
    if (!lead.agreement_copied_) lead.agreement_copied_ = std::make_unique<StreamEvent>(lead.device_);
    lead.agreement_copied_->record(current_stream(lead.device_));
  });
  // On the GPU a rank that got every gradient itself has nothing to learn: it does not
  // wait, and reads the word at its next agreement.
  if (cuda && !lacking) return;
  done->synchronize();
  const at::Tensor agreed = mask.cpu();
  const int32_t* any = agreed.const_data_ptr<int32_t>();
  lead.agreement_word_ = at::Tensor();
  lead.check_agreement_word(any[n] + any[n + 1], /*previous=*/false);
  if (!lacking) return;
  for (Unit* u : units) {
    for (size_t i = 0; i < u->has_grad_.size(); ++i, ++any) {
      if (*any != 0) u->has_grad_[i] = true;
    }
  }
}

void Unit::check_previous_agreement() {
  // Set on the GPU only, with its copy's event; not on the host yet: never wait for it.
  if (!agreement_word_.defined() || !agreement_copied_->query()) return;
  const int32_t word = agreement_word_.const_data_ptr<int32_t>()[0];
  agreement_word_ = at::Tensor();
  check_agreement_word(word, /*previous=*/true);
}

void Unit::check_agreement_word(int32_t word, bool previous) const {
  if (word == 0) return;
  C10_THROW_ERROR(DistBackendError,
                  msg("megatron_fsdp_ext: ranks reduced different fully_shard units together: where rank ", rank(),
                      " reduced the gradients of unit '", label_, "'", previous ? " in the previous backward" : "",
                      ", another rank of its group reduced another unit's, so their collectives were paired across "
                      "different units (their gathered parameters and reduced gradients are wrong). Every rank must "
                      "run the same fully_shard units in the same order in forward and backward: control flow that "
                      "skips a whole unit on some ranks only (LayerDrop, a rank-dependent branch), or leaves a unit's "
                      "output out of the loss on some ranks only (its backward then runs at another point there), is "
                      "not supported; keep such layers inside one unit (a parameter used on some ranks only is fine "
                      "there) or skip them on every rank alike."));
}

std::vector<int64_t> Unit::hooked_landings() const {
  std::vector<int64_t> hooked;
  for (size_t i = 0; i < sharded_params_.size(); ++i) {
    // Hooks live in the autograd meta; a tensor without one has none (and the accessor
    // expects one).
    if (has_grad_[i] && sharded_params_[i].unsafeGetTensorImpl()->autograd_meta() != nullptr &&
        torch::autograd::impl::post_acc_grad_hooks(sharded_params_[i]) != nullptr) {
      hooked.push_back(static_cast<int64_t>(i));
    }
  }
  return hooked;
}

void Unit::run_post_accumulate_grad_hooks(const std::vector<int64_t>& hooked, const GradBuffers& b,
                                          PendingCollective& done) {
  if (hooked.empty()) return;
  auto run_all = [&] {
    for (int64_t i : hooked) {
      auto& hook = torch::autograd::impl::post_acc_grad_hooks(sharded_params_[i]);
      if (hook) (*hook)(sharded_params_[i]);  // takes the GIL itself, as autograd's AccumulateGrad calls it
    }
  };
  const auto& streams = ctx().streams();
  if (offloaded_) {
    // The hooks read the gradient in host memory: the copy out must be done (FSDP2 makes
    // that copy blocking when a parameter has such a hook).
    done.synchronize();
    run_all();
  } else if (!streams.enabled() || b.landing == GradLanding::kMixed) {
    run_all();  // the gradient is final on the current stream (kMixed merged it there)
  } else {
    // On the reduce-scatter stream, where the gradient was just written: what the hooks
    // launch (an optimizer step in backward) follows it without holding the compute
    // stream back, and the done event, recorded after them, is what the end of backward
    // and the next reduction wait for.
    c10::StreamGuard guard(streams.reduce_scatter());
    run_all();
    done.record(streams.reduce_scatter());
  }
}

void Unit::land_grads(const GradBuffers& b, const PendingCollective& done) {
  const int64_t n = layout_.num_params();
  // Offloaded, the gradient lands in `host`, read by the host.
  const at::Tensor& landed = offloaded_ ? b.host : b.target;
  if (b.landing == GradLanding::kMixed) {
    // Per-parameter merge reads `target` on the current stream (or `host` on the host):
    // wait for it first.
    if (offloaded_) done.synchronize();
    else done.wait();
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < n; ++i) {
      if (!has_grad_[i]) continue;
      auto view = flat_range(landed, specs_[i].slice.shard_offset, specs_[i].slice.numel);
      auto& g = sharded_params_[i].mutable_grad();
      if (g.defined()) g.add_(view.view_as(g));
      else g = view;
    }
  } else if (b.landing == GradLanding::kFresh) {
    // Views only: the current stream reads them after the final callback's wait.
    for (int64_t i = 0; i < n; ++i) {
      if (!has_grad_[i]) continue;
      sharded_params_[i].mutable_grad() = flat_range(landed, specs_[i].slice.shard_offset, specs_[i].slice.numel);
    }
  }
}

}  // namespace mfsdp
