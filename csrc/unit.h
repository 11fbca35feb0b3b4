// Unit: the parameters of one fully_shard call, their flat sharded/unsharded storage,
// and the state machine SHARDED -> GATHERING -> UNSHARDED -> SHARDED that moves them.
//
// Storage:
//  - sharded_flat (original dtype, this rank's segment): sharded params are 1-D views.
//  - unsharded_flat (param dtype, padded total): unsharded params are tensors of their
//    own on its storage, so they own a version counter (writes by collectives never
//    trip autograd); the storage is freed (0 bytes) while SHARDED and re-allocated by
//    unshard(). While freed, any read of it raises (never a null dereference).
//  - gradients: unsharded grads are packed into a flat reduce-dtype buffer, reduce-
//    scattered, scaled by 1/world and land in a flat fp32 buffer whose 1-D views become
//    the sharded params' .grad.
//
// The shared side streams and the in-flight reduction live in CommContext (comm_context.h).
// One class, its definitions split by concern (unit.cpp: construction and storage;
// unit_gather, unit_reduce, unit_offload, unit_fp8, unit_state_dict, unit_collectives):
// every concern reads and writes the same state (the shard, the unsharded buffer, the
// state machine), which one class keeps in one place.
#pragma once

#include "errors.h"
#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collective_phase.h"
#include "comm.h"
#include "comm_buffers.h"
#include "comm_context.h"
#include "fp8.h"
#include "gather_bytes.h"
#include "host_tasks.h"
#include "layout.h"
#include "param_spec.h"
#include "row_exchange.h"
#include "strategy.h"
#include "streams.h"

namespace mfsdp {

enum class UnitState { kSharded = 0, kGathering = 1, kUnsharded = 2 };

struct GradBuffers;  // one gradient reduction's buffers (grad_buffers.h)

class Unit {
 public:
  // `params` on the meta device (deferred init): only their shapes are read, this rank's
  // shard is allocated on `materialize_on` and holds NaN until written through
  // shard_changed(index, full_value); nothing of the full size is ever allocated.
  Unit(const std::vector<at::Tensor>& params, std::vector<std::string> names, ProcessGroupPtr pg,
       int64_t alignment, std::optional<at::ScalarType> param_dtype,
       std::optional<at::ScalarType> reduce_dtype,
       ShardingStrategy strategy = ShardingStrategy::kOptimGradsParams,
       std::optional<c10::Device> materialize_on = std::nullopt);

  const FlatLayout& layout() const { return layout_; }

  // The FP8 gather (torchao's tensorwise Float8Linear weights): parameters `params` are
  // gathered as FP8 `fp8_dtype` bytes quantized with their scale (fp8.h), the others
  // cast to the param dtype as before, all in one uneven all-gather of bytes
  // (gather_bytes.h). The master shard, gradients and state dicts are unchanged. Called
  // once, before bind_params (the unsharded views change dtype).
  void set_fp8_gather(const std::vector<int64_t>& params, at::ScalarType fp8_dtype);
  // MXFP8 with block-aligned shards: parameters `params` (each a matrix whose last dim is
  // a multiple of `block`; the layout's alignment a multiple of `block`, so every rank's
  // piece is whole blocks) are gathered as FP8 data and one E8M0 scale byte per block,
  // both quantized by this rank from its own blocks: no amax all-reduce. The quantized
  // shard (mx_data, mx_scales) is written by Python with torchao's own quantizer after
  // each shard change (fp8.py), then mark_quantized(); the gather copies its bytes.
  void set_mx_gather(const std::vector<int64_t>& params, int64_t block);
  int64_t mx_block() const { return mx_block_; }
  // uint8 laid out like the shard (one byte an element) / one byte a block of it.
  const at::Tensor& mx_data() const { return mx_data_; }
  const at::Tensor& mx_scales() const { return mx_scales_; }
  // The gathered E8M0 scales of each MXFP8 parameter, shaped [rows..., last dim / block]
  // (undefined for the others): views of the unsharded buffer.
  std::vector<at::Tensor> mx_scale_views() const;
  // The quantized shard (or the FP8 scales) now match the shard.
  void mark_quantized();
  bool gathers_bytes() const { return gather_bytes_.has_value(); }
  const GatherBytes& gather_bytes() const;
  // One float32 scale per parameter (1 for those not in FP8): what the gather quantizes
  // with and what the gathered FP8 weights are read with (a view of each is the scale of
  // its unsharded Float8 tensor). Empty without the FP8 gather.
  const at::Tensor& fp8_scales() const { return fp8_scales_; }
  // Whether the shard changed since the scales (MXFP8: the quantized shard) were computed.
  // A gather then refreshes this unit's tensorwise scales itself (collective), and
  // refuses a stale MXFP8 shard (quantized in Python).
  bool fp8_scales_stale() const;
  // Recomputes the scales of `units` (those with the FP8 gather; with `only_stale`, only
  // those whose scales are stale): each unit's amax over its shard (one fused launch),
  // one all-reduce(max) per all-gather group for all of them, scales as torchao computes
  // them. Collective: every rank passes the same units in the same order.
  static void refresh_fp8_scales(const std::vector<Unit*>& units, bool only_stale);
  // CPU offload (FSDP2's CPUOffloadPolicy): the shard (the master weights) and its
  // gradient, and so the optimizer state, live in host memory, pinned with `pin_memory`
  // (host_memory.h); forward and backward compute on the unit's device. Each gather copies
  // the shard in on the all-gather stream before the collective; each reduction copies the
  // reduced shard out on the reduce-scatter stream, into a host gradient buffer the unit
  // reuses once no .grad views it. The host reads the gradients after the context's
  // synchronize_reductions() (end of backward). Needs a strategy that reduce-scatters
  // (optim_grads_params, optim_grads); not with the FP8 gather. Called once, before bind_params.
  void offload_to_host(bool pin_memory);
  bool offloaded() const { return offloaded_; }
  // module.cpu() / module.to(device) after fully_shard (RL trainers park the model in
  // host memory between phases, as FSDP2's sharded parameters allow): the shard moves to
  // `device` and every sharded parameter with it (the same objects, so optimizers keep
  // them). While the shard is not on the unit's device the unit cannot gather: unshard()
  // raises, naming the move back. Needs the unit SHARDED (no gathered copy) and is
  // refused for offloaded units (their shard lives in host memory by policy) and for
  // FP8/MX gathers (their quantized shard and scales stay on the device).
  void move_shard_to(c10::Device device);
  // Where the shard lives now: the unit's device unless moved (or offloaded).
  c10::Device shard_device() const { return sharded_flat_.device(); }
  bool pinned() const { return pinned_; }
  // Host memory in the param dtype, laid out like the shard, for an optimizer whose step
  // writes the updated weights in the gathered dtype as well (CPUAdamW's copy-out): while
  // fresh, the gather copies it in as it is (half the bytes of fp32, no cast on the
  // device). Undefined unless offloaded with a cast to bfloat16.
  const at::Tensor& host_gather_copy() const { return host_gather_copy_; }
  // host_gather_copy() matches the shard as it is now: called by the optimizer that wrote
  // both, after its shard_changed(). Any later change of the shard makes it stale again.
  void mark_host_copy_fresh();
  bool host_copy_fresh() const {
    return host_gather_copy_.defined() && host_copy_generation_ == shard_generation_ &&
           host_copy_version_ == sharded_flat_._version();
  }
  // Host bytes the unit holds: the shard, the gather copy and the kept gradient buffer.
  int64_t host_nbytes() const;
  // This unit's share of an optimizer step, running on the host beside the next forward
  // (optim.CPUAdamW(overlap_step=True)). Everything that reads or writes the shard or its
  // gradient waits for it first: the gather, a reduction's landing, shard writes, the
  // gathers of state dicts. The wait rethrows the step's error.
  void set_host_update(std::shared_ptr<HostTask> task);
  void wait_host_update();
  bool host_update_pending() const { return host_update_ && !host_update_->done(); }
  const std::vector<ParamSpec>& param_specs() const { return specs_; }
  GatherTransform gather_transform() const { return transform_; }
  // How errors name this unit (the module's path once the root knows it).
  const std::string& label() const { return label_; }
  void set_label(std::string label);
  // Debug mode: before each collective the ranks exchange (unit, phase, size); ranks
  // out of step then get an error naming both sides, instead of a backend abort (Gloo:
  // size mismatch) or two different units' collectives silently paired. Costs one
  // small all-gather and a host sync per collective.
  void set_check_collectives(bool on) { check_collectives_ = on; }
  // check_for_nan_in_grad: every reduced gradient shard is checked for NaN/Inf on the
  // reduce-scatter stream, into the context's flag (CommContext::check_nonfinite).
  void set_check_nonfinite(bool on) { check_nonfinite_ = on; }
  bool check_nonfinite() const { return check_nonfinite_; }
  // Where the all-gather output (the unsharded buffer) and the reduce-scatter input (the
  // packed gradients) are allocated from (comm_buffers.h); no collective. With
  // kProcessGroup a buffer comes from its group's backend where that backend allocates
  // device memory and the group has run a collective on the device; a buffer already
  // allocated moves at its next gather. Returns whether the unit's groups can allocate
  // at all (false: Gloo, fake, no multicast support, world 1).
  bool set_comm_buffer_source(CommBufferSource source);
  CommBufferSource comm_buffer_source() const { return comm_buffer_source_; }
  // Per buffer: whether it is to come from its group's backend.
  bool gather_buffer_from_group() const { return gather_buffer_from_group_; }
  bool reduce_buffer_from_group() const { return reduce_buffer_from_group_; }
  // Whether the unsharded buffer now allocated came from the group's backend.
  bool unsharded_from_group() const { return unsharded_from_group_; }
  // Reduced gradients are the sum over ranks divided by this (FSDP2's
  // set_gradient_divide_factor); 0: the group size, i.e. the mean.
  void set_gradient_divide_factor(double factor);
  double gradient_divide_factor() const { return grad_divide_factor_; }
  bool check_collectives() const { return check_collectives_; }
  int rank() const { return rs_comm_.rank(); }
  int world_size() const { return rs_comm_.size(); }
  UnitState state() const { return state_; }
  ShardingStrategy strategy() const { return strategy_; }
  // Which layout segment this rank holds: its rank, or 0 when nothing is sharded.
  int shard_index() const { return replicated() ? 0 : rank(); }
  at::ScalarType orig_dtype() const { return orig_dtype_; }
  at::ScalarType param_dtype() const { return param_dtype_; }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  const c10::Device& device() const { return device_; }
  const at::Tensor& sharded_flat() const { return sharded_flat_; }
  // Bytes the unsharded buffer holds now (0 while SHARDED).
  int64_t unsharded_storage_bytes() const;
  // What a gathered copy occupies while unsharded (0 when it aliases the shard).
  int64_t unsharded_nbytes() const { return aliases_shard() ? 0 : unsharded_nbytes_; }

  std::vector<at::Tensor> sharded_views() const;
  std::vector<at::Tensor> unsharded_views() const;
  // The tensors the user sees (nn.Parameter objects made from the views above). The unit
  // is their one holder: a tensor keeps its Python object (type, attributes) alive, so
  // reading them back from Python gives the same objects.
  // `unsharded_locals`: where the unit reads each parameter's unsharded gradient, one per
  // parameter, shaped like its spec (empty: the unsharded parameters themselves). A
  // parameter shown wrapped (a tensor-parallel DTensor around its local view) gets its
  // gradient on the wrapper; Python moves the wrapper's local gradient onto its local
  // view before the unit packs (tensor_parallel.py).
  void bind_params(std::vector<at::Tensor> sharded_params, std::vector<at::Tensor> unsharded_params,
                   std::vector<at::Tensor> unsharded_locals = {});
  const std::vector<at::Tensor>& sharded_params() const { return sharded_params_; }
  const std::vector<at::Tensor>& unsharded_params() const { return unsharded_params_; }
  const std::vector<at::Tensor>& unsharded_locals() const { return unsharded_locals_; }
  // Refuses `what` until bind_params() gave the unit its parameter objects.
  void check_bound(const char* what) const;
  void set_context(std::shared_ptr<CommContext> ctx);
  // Separate communicators (same ranks, same order as the unit's group), so that
  // all-gathers and reduce-scatters can run at the same time.
  void set_all_gather_group(ProcessGroupPtr pg);
  void set_reduce_scatter_group(ProcessGroupPtr pg);
  // Hybrid sharding (HSDP): the unit is sharded over its group and replicated over
  // `pg` (the other replicas hold the same shards). Gradient shards, once reduced inside
  // the shard group, are all-reduced across `pg`; the mean runs over both groups.
  void set_replicate_group(ProcessGroupPtr pg);
  int replicate_size() const { return replicate_comm_.defined() ? replicate_comm_.size() : 1; }
  int replicate_rank() const { return replicate_comm_.defined() ? replicate_comm_.rank() : 0; }
  // Under HSDP, false defers the all-reduce across replicas (gradient accumulation):
  // reduced shards add up in a partial sum, all-reduced once by the next reduction that
  // requires it (FSDP2's set_requires_all_reduce). No effect without a replicate group.
  void set_requires_all_reduce(bool on) { requires_all_reduce_ = on; }
  bool requires_all_reduce() const { return requires_all_reduce_; }
  // Whether reduced shards wait in the partial sum for a later all-reduce.
  bool has_partial_reduction() const { return partial_.defined(); }

  // Issue the all-gather (on the all-gather stream for CUDA). No-op while GATHERING or
  // while UNSHARDED with an up-to-date copy; an UNSHARDED copy older than the shard
  // (optimizer step under a strategy that keeps params unsharded) is gathered again.
  void unshard();
  // unshard() for several units with one collective: those that need a gather and
  // share the first such unit's all-gather communicator, parameter dtype and context are
  // gathered by one coalesced all-gather (one c10d call); the others by their own.
  static void unshard_together(const std::vector<Unit*>& units);
  // unshard_together() when `bucketed` and more than one unit, else each unit's unshard().
  static void unshard_all(const std::vector<Unit*>& units, bool bucketed);
  // Make the current stream wait for the all-gather. No-op unless GATHERING.
  void wait_unshard();
  // Free the unsharded storage (waiting first if an all-gather is in flight). With
  // `keep_post_forward` and a post-forward group (set_post_forward_group), this rank's
  // 1/N of the gathered buffer is kept first: the next unshard() gathers from it over the
  // N ranks of that group, unless the shard changed since. Without, any kept copy goes too.
  void reshard(bool keep_post_forward = false);
  // FSDP2's reshard_after_forward=int: `pg` holds N consecutive ranks of the shard group
  // (1 < N < world, N divides world), this rank among them. Index j in it keeps segment
  // range j of N of the gathered buffer, which covers ranks j*world/N .. (j+1)*world/N - 1.
  void set_post_forward_group(ProcessGroupPtr pg);
  // N, or 0 without a post-forward group.
  int post_forward_size() const { return post_forward_comm_.defined() ? post_forward_comm_.size() : 0; }
  // Bytes the kept post-forward copy holds now (0 when none).
  int64_t post_forward_nbytes() const;
  // The one entry point for "the shard changed" other than by a collective:
  //  - no `index`: the shards were updated in place (an optimizer step). A kept
  //    unsharded copy must be gathered again before its next use; the shard's version
  //    counter is only a backstop (fused optimizers and `.data` writes do not move it).
  //  - `index` and `value`: parameter `index` takes `value`, shaped either like the
  //    full parameter (the module's parameter was replaced) or like this rank's shard
  //    (`sharded_param.data = x`). This rank's slice is copied into the flat shard, the
  //    sharded parameter viewing it again, and the kept copy is stale.
  // Every rank must see the same changes: the next use of the unit gathers again.
  void shard_changed(std::optional<int64_t> index = std::nullopt, const std::optional<at::Tensor>& value = {});
  // This rank's 1-D piece of parameter `index` cut from `full`, its full value (any shape
  // of the full element count): a view, no copy. The one place a full value becomes a
  // shard piece: shard_changed, state-dict loads and materialize use it.
  at::Tensor local_piece(int64_t index, const at::Tensor& full) const;

  // Move the gradients sitting on the unsharded params into this unit. With `sync`,
  // reduce-scatter them (plus anything accumulated earlier) into the sharded .grad;
  // without, accumulate them locally in the reduce dtype. Returns false when there
  // was nothing to reduce.
  // `may_join`: whether a rank with no gradient here may join the others' reduction
  // (expect_reduction); false in a backward that accumulates into no parameter
  // (autograd.grad with respect to inputs), where no rank reduces anything.
  bool reduce_grads(bool sync, bool may_join = true);
  // This rank ran the unit's forward with grad enabled (the forward hook says so): every
  // rank then reduces the unit at its next synced reduction, so a rank on which none of
  // its parameters got a gradient (they were used on other ranks only) still joins the
  // agreement and, where another rank has a gradient, reduces zeros. Cleared by that
  // reduction; without it such a rank would skip a collective the others run.
  void expect_reduction() { expects_reduction_ = true; }
  // Forget the gradients not reduced yet: those accumulated with sync off and a deferred
  // HSDP partial sum (module.zero_grad() between micro-batches, where plain PyTorch drops
  // what .grad held). Waits for a reduction still adding into the partial sum.
  void drop_unreduced_grads();
  // reduce_grads(true) for several units with one collective: those that reduce-scatter
  // (not HSDP, not the full-gradient strategies) on the first such unit's reduce-scatter
  // communicator, reduce dtype and context are packed and reduce-scattered by one
  // coalesced collective (one c10d call), each then scaled into its own .grad; the
  // others by their own reduction. Units without a gradient take no part.
  static void reduce_together(const std::vector<Unit*>& units, bool may_join = true);
  // Whether this unit's reduction can join others' in reduce_together: it reduce-scatters
  // (not an all-reduce of full gradients) and nothing follows it (HSDP's all-reduce).
  bool can_share_reduction() const { return !full_grads() && !replicate_comm_.defined(); }

  // Full-precision unsharded copy of every parameter (synchronous collective).
  std::vector<at::Tensor> gather_full_params();
  // Full values, shaped like the parameters, of per-parameter state laid out like them
  // (optimizer state): `pieces[i]` is this rank's 1-D piece of parameter i (none: zeros),
  // gathered in `dtype` on the unit's device (synchronous collective). With
  // gather_full_params, the one way a unit is gathered for state dicts and checkpoints.
  std::vector<at::Tensor> gather_full(const std::vector<std::optional<at::Tensor>>& pieces, at::ScalarType dtype);
  // Whether to_row_chunks / piece_from_rows exchange rows (one all-to-all moving 1/world of
  // the unit): the unit is sharded, every parameter has a dim 0, and the backend has an
  // all-to-all. Otherwise state dicts gather the unit (gather_full) and cut the rows.
  bool exchanges_rows() const;
  // The dim state dicts shard each parameter on (shard_placement_fn's Shard(dim); 0 by
  // default), one per parameter, each in [0, its number of dims).
  void set_state_dict_dims(const std::vector<int64_t>& dims);
  // FSDP2's Shard(0) rows of per-parameter state laid out like the parameters (`pieces`
  // as in gather_full; none: the parameters themselves): element i is this rank's
  // torch.chunk rows of parameter i, shaped [rows, *shape[1:]], in `dtype`. Collective
  // over the unit's group (needs exchanges_rows()).
  std::vector<at::Tensor> to_row_chunks(const std::vector<std::optional<at::Tensor>>& pieces, at::ScalarType dtype);
  // The reverse for parameter `index`: this rank's 1-D piece of it, from every rank's
  // torch.chunk rows (`rows`: this rank's). Collective over the unit's group.
  at::Tensor piece_from_rows(int64_t index, const at::Tensor& rows);

 private:
  bool replicated() const { return traits(strategy_).replicated; }
  // unshard()'s first step: whether a gather is due (not in flight, no up-to-date
  // copy; `p.data = x` writes adopted first).
  bool needs_gather();
  // unshard()'s second step: the bookkeeping and allocation before the collective.
  void prepare_gather();
  // The all-gather input: the shard, cast into this rank's slot of the output when the
  // dtypes differ and `in_place` (side-stream path), else cast into a new tensor.
  at::Tensor gather_input(bool in_place);
  // unshard()'s collective when it gathers from the post-forward copy `kept`.
  void unshard_from_post_forward(at::Tensor kept);
  // Runs `issue(on_stream)` on the all-gather stream after the work queued on the current
  // one (directly on the CPU: on_stream false), then marks the unit GATHERING (its event
  // recorded after the collective) or UNSHARDED. Returns on_stream.
  template <typename F>
  bool on_gather_stream(F&& issue);
  // Every rank's `segment` (this rank's, laid out like the shard) gathered into full
  // values shaped like the parameters. Before lazy init (no context yet: the layouts were
  // not compared across ranks) the ranks first check they gather the same sizes.
  std::vector<at::Tensor> gather_segments(at::Tensor segment);
  // Options of the buffers the device computes and communicates with (the shard's own
  // options name the host when offloaded).
  at::TensorOptions device_options(at::ScalarType dtype) const {
    return at::TensorOptions().device(device_).dtype(dtype);
  }
  // Offloaded: writes this rank's shard, in `dst`'s dtype, into `dst` on the device (the
  // gather copy while fresh, else the master shard, cast on the device).
  void copy_shard_in(at::Tensor& dst) const;
  // Offloaded: the host buffer a fresh gradient lands in: the kept one while nothing else
  // holds it (no .grad views it any more), else a new one.
  at::Tensor host_grad_buffer();
  // Every parameter's dim 0 (the rows FSDP2 chunks).
  std::vector<int64_t> row_counts() const;
  // Runs one exchange of `plan` over the unit's all-gather group: `parts(piece)` gives the
  // source part a send piece is cut from, `dest(piece)` the destination part a received
  // piece lands in.
  template <typename Src, typename Dst>
  void exchange(const RowExchangePlan& plan, at::ScalarType dtype, Src&& parts, Dst&& dest);
  // Runs one collective; a failure (a timeout, a peer that left, a desynchronized rank)
  // is rethrown naming this unit, the phase and the likely causes.
  void run_collective(CollectivePhase phase, const Communicator& comm, int64_t numel, c10::function_ref<void()> issue);
  // `together`: how many units share the collective (a bucket), 1 for a unit's own; ranks
  // that bucket differently are out of step too.
  void check_in_step(CollectivePhase phase, const Communicator& comm, int64_t numel, int64_t together = 1) const;
  // One coalesced collective of `units` (the first leads, its communicator `comm`) for
  // `phase`: under the scope "mfsdp::<collective>[<lead> +N units]", after the cross-rank
  // check of every unit's size (`numels`) when the lead checks, a failure naming them all.
  static void run_coalesced(CollectivePhase phase, const std::vector<Unit*>& units,
                            const std::vector<int64_t>& numels, const Communicator& comm,
                            c10::function_ref<void()> issue);
  // The unsharded buffer, sized (and typed) for the gather: the param dtype, or bytes.
  void make_unsharded_buffer();
  // A tensor of `dtype` and `shape` at element `offset` (in `dtype`) of the unsharded
  // storage, with a version counter of its own.
  at::Tensor unsharded_view(at::ScalarType dtype, const std::vector<int64_t>& shape, int64_t offset) const;
  // set_fp8_gather / set_mx_gather: parameters `params` gather one byte an element.
  void set_byte_gather(const std::vector<int64_t>& params, at::ScalarType fp8_dtype, GatherTransform transform);
  // MXFP8: where the gathered scales start in the unsharded buffer (after the data).
  int64_t mx_scales_offset() const { return gather_bytes_->total; }
  // The kept post-forward copy still matches the shard (no write, load or step since).
  bool post_forward_copy_valid() const;
  // Whether unshard() would gather from the kept post-forward copy (then alone: its group
  // differs from every bucket's).
  bool gathers_post_forward() const { return post_forward_flat_.defined() && post_forward_copy_valid(); }
  // No-shard without a cast: the unsharded params are the shards themselves.
  bool aliases_shard() const { return replicated() && transform_ == GatherTransform::kNone; }
  bool unsharded_is_stale() const {
    return !aliases_shard() && (stale_ || sharded_flat_._version() != gathered_version_);
  }
  // Finds sharded parameters whose `.data` was replaced and hands each to
  // shard_changed(), on fresh shard storage (move_shard_to_fresh_storage); true if
  // there was one.
  bool adopt_data_writes();
  // The flat shard copied to new storage, every parameter still viewing its slot moved
  // with it: tensors handed out before (`old = p.data`) keep the values they had.
  void move_shard_to_fresh_storage();
  // `flat` becomes the flat shard: every sharded parameter still viewing its slot is
  // pointed at the same slot of it, and so are the unsharded parameters where they are
  // the shard itself (aliases_shard).
  void rebind_shard(at::Tensor flat);
  // Whether sharded parameter i still views its slot of the flat shard.
  bool views_its_slot(size_t i) const;
  bool full_grads() const { return traits(strategy_).full_grads; }
  void allocate_unsharded();
  void free_unsharded();
  // `numel` elements of `options` for a collective over `comm`: from its backend when
  // `from_group` (the caller checked the group is ready), else the caching allocator; a
  // failure names the unit and the option.
  at::Tensor comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                         bool from_group) const;
  // The flat fp32 gradient buffer behind the sharded .grad views, if every param that
  // got a gradient still has a view of one such buffer at its slot; else undefined.
  // Derived from the grads themselves: the unit keeps no reference, so
  // zero_grad(set_to_none=True) really frees the memory.
  at::Tensor flat_grad_behind_views() const;
  CommContext& ctx();

  // reduce_grads, in its three steps (unit_reduce.cpp).
  // Packs the unsharded grads (added to any accumulated ones) into a flat reduce-dtype
  // buffer and frees them; undefined when there was nothing to pack.
  at::Tensor pack_grads(bool sync);
  // What a rank with no gradient reduces where others reduce theirs: a zero flat buffer in
  // the reduce dtype (packed_scale_ set as pack_grads sets it; the held reduction retired).
  at::Tensor zeros_to_reduce();
  // `defer`: the reduced shard goes into the partial sum (no target, no landing).
  GradBuffers plan_reduction(at::Tensor flat, bool defer);
  // Reduce on the reduce-scatter stream (then across replicas, unless deferred, adding
  // the partial sum first), then scale/cast into `target` or add into the partial sum.
  std::shared_ptr<PendingCollective> reduce(GradBuffers& b, bool defer);
  // Runs `issue` on the reduce-scatter stream after the work queued on the current one
  // (directly on CPU) and returns this unit's reduction event, recorded after it.
  template <typename F>
  std::shared_ptr<PendingCollective> on_reduce_stream(F&& issue);
  // What reduced gradients are multiplied by: 1 / (divide factor, or the ranks averaged over).
  double grad_scale() const;
  // The factor pack_grads applies: grad_scale(), except for an fp16 reduction, which sums
  // unscaled and scales after (1/W applied first could flush small fp16 gradients to zero).
  double pack_scale() const;
  void land_grads(const GradBuffers& b, const PendingCollective& done);
  // A parameter used on some ranks only (a layer skipped by rank-dependent control flow,
  // an expert no local token reached) still has a reduced gradient on every rank, as in
  // plain PyTorch: which parameters got one anywhere is agreed before the reduction is
  // planned, by an all-reduce(max) of has_grad_ over the unit's group (and its replicas).
  // Only a rank that lacks some gradient waits for it. `units` share the collective (a
  // reduce bucket; the first leads).
  static void agree_on_grads(const std::vector<Unit*>& units);
  bool lacks_some_grad() const;
  // With no gradient packed on this rank: whether it must still take part in the unit's
  // synced reduction (expect_reduction, trainable parameters, other ranks in the group).
  bool joins_without_grads() const;
  bool any_agreed_grad() const;
  // The same all-reduce carries h and -h, h a hash of the reduced units' labels: the sum
  // of their maxima over the ranks (the agreement word) is 0 unless some rank reduced other
  // units at this point (rank-dependent control flow that skips whole units: collectives
  // paired across different units, silently wrong where their sizes match). A rank that
  // waits for the flags (every rank on the CPU) checks it at once; the others read it
  // from pinned host memory at their next agreement, without waiting.
  void check_agreement_word(int32_t word, bool previous) const;
  void check_previous_agreement();
  // The parameters whose sharded .grad this reduction landed and that carry
  // post-accumulate-grad hooks (Tensor.register_post_accumulate_grad_hook); read before
  // has_grad_ is reset.
  std::vector<int64_t> hooked_landings() const;
  // Runs those hooks once the gradients landed, as FSDP2 runs them after its
  // reduce-scatter: autograd runs such hooks only for the leaves it accumulates into (the
  // unsharded parameters), so the sharded ones would never see theirs. `done` is
  // recorded again after them when they ran on the reduce-scatter stream.
  void run_post_accumulate_grad_hooks(const std::vector<int64_t>& hooked, const GradBuffers& b,
                                      PendingCollective& done);
  // The end of a reduction on the reduce-scatter stream: the reduced segment scaled and
  // cast into `target`, checked when asked, and copied out to `host` when offloaded.
  // (An offloaded unit never lands as GradLanding::kAccumulate: plan_reduction makes it kMixed.)
  void finish_reduction(GradBuffers& b);
  // Offloaded: `target` copied out into `host` on the current (reduce-scatter) stream.
  void copy_out(const GradBuffers& b) const;

  ShardingStrategy strategy_;
  FlatLayout layout_;
  // One per parameter, in the unit's order: what every step below reads about it.
  std::vector<ParamSpec> specs_;
  // The unit's: kNone / kCast (one stored and one gathered dtype), kFp8 when any
  // parameter gathers in FP8 (then per parameter in specs_).
  GatherTransform transform_ = GatherTransform::kNone;
  // The FP8 gather (set_fp8_gather): the byte layout of the gathered buffer, this rank's
  // pieces (byte offsets inside its contribution), the scales and when they were made.
  std::optional<GatherBytes> gather_bytes_;
  std::vector<GatherPiece> gather_pieces_;
  at::ScalarType fp8_dtype_ = at::kFloat8_e4m3fn;
  at::Tensor fp8_scales_;
  int64_t mx_block_ = 0;         // MXFP8 block (0: no MXFP8 gather)
  at::Tensor mx_data_, mx_scales_;
  uint64_t shard_generation_ = 0;         // bumped by every shard_changed()
  uint64_t scales_generation_ = ~uint64_t{0};
  uint32_t scales_version_ = 0;           // the shard's version counter when the scales were made
  std::string label_;
  int64_t label_hash_ = 0;
  // Profiler scope per CollectivePhase, "mfsdp::<collective>[<label>]": a trace shows
  // which unit every collective belongs to. Built in set_label, off the hot path.
  std::array<std::string, 9> profile_scopes_{"mfsdp::all_gather", "mfsdp::reduce_scatter", "mfsdp::all_reduce",
                                             "mfsdp::all_gather_full", "mfsdp::all_reduce_replicas",
                                             "mfsdp::exchange_rows", "mfsdp::all_reduce_fp8_amax",
                                             "mfsdp::all_reduce_grad_mask", "mfsdp::all_gather_post_forward"};
  // "mfsdp::unshard[<label>]" / "mfsdp::reshard[<label>]": when a unit starts gathering
  // (or casting) its parameters and when it frees them; tests replay these from a trace.
  std::string unshard_scope_ = "mfsdp::unshard";
  std::string reshard_scope_ = "mfsdp::reshard";
  std::string freed_message_;  // what a read of the freed unsharded storage raises
  bool check_collectives_ = false;
  bool check_nonfinite_ = false;
  CommBufferSource comm_buffer_source_ = CommBufferSource::kCachingAllocator;
  bool gather_buffer_from_group_ = false;
  bool reduce_buffer_from_group_ = false;
  bool unsharded_from_group_ = false;
  double grad_divide_factor_ = 0;
  Communicator ag_comm_, rs_comm_;
  Communicator replicate_comm_;  // undefined unless HSDP
  bool requires_all_reduce_ = true;
  at::Tensor partial_;  // reduce dtype, this rank's segment: shards whose all-reduce is deferred
  double partial_scale_ = 1.0;  // the factor partial_'s values carry (the gradient scale they were packed with)
  c10::Device device_;
  at::ScalarType orig_dtype_, param_dtype_, reduce_dtype_;

  at::Tensor sharded_flat_;
  at::Tensor unsharded_flat_;
  bool offloaded_ = false, pinned_ = false;
  at::Tensor host_gather_copy_;  // offloaded with a bfloat16 gather: see host_gather_copy()
  uint64_t host_copy_generation_ = ~uint64_t{0};
  uint32_t host_copy_version_ = 0;
  at::Tensor host_grad_;         // offloaded: the host gradient buffer, reused (host_grad_buffer)
  std::shared_ptr<HostTask> host_update_;  // set_host_update: the step in flight, if any
  int64_t unsharded_nbytes_ = 0;
  std::vector<at::Tensor> sharded_params_, unsharded_params_;
  std::vector<at::Tensor> unsharded_locals_;  // gradient holders (bind_params)
  std::vector<bool> has_grad_;  // per param: received a gradient since the last sync
  bool expects_reduction_ = false;  // forward ran with grad since the last synced reduction
  // The last agreement's word (agree_on_grads) on its way to the host, and its copy's event.
  at::Tensor agreement_word_;
  std::unique_ptr<StreamEvent> agreement_copied_;
  at::Tensor accumulated_;      // reduce dtype, unsharded: grads kept while sync is off
  // The factor the last packed flat buffer's values carry: the gradient scale (1/W, or the
  // divide factor's inverse) is applied as the gradients are packed, so the reduced shard
  // needs no pass of its own; gradients accumulated without sync keep their first scale.
  double packed_scale_ = 1.0;

  // reshard_after_forward=int (set_post_forward_group): the smaller group, this rank's
  // 1/N of the gathered buffer kept by reshard(true), and the shard it was gathered from.
  Communicator post_forward_comm_;
  at::Tensor post_forward_flat_;
  uint32_t post_forward_version_ = 0;
  uint64_t post_forward_generation_ = 0;
  // The kept copy an issued gather reads on the all-gather stream: held until the compute
  // stream waited for that gather (wait_unshard), so its memory is not reused before.
  at::Tensor post_forward_in_flight_;

  UnitState state_ = UnitState::kSharded;
  uint32_t gathered_version_ = 0;  // shard version the in-flight gather read
  bool stale_ = false;             // shard_changed() since the last gather
  std::shared_ptr<CommContext> ctx_;
  StreamEvent compute_ready_;
  // Recorded after this unit's own all-gather; `gathered_` is the event that marks the
  // gather in flight: this one, or the bucket lead's when gathered by unshard_together
  // (one record and, per stream, one wait for the whole bucket).
  std::shared_ptr<StreamEvent> all_gather_done_, gathered_;
  // Recorded by each gradient reduction of this unit (see reduce()).
  std::shared_ptr<PendingCollective> reduction_done_;
};

}  // namespace mfsdp
