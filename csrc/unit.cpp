// Unit: construction, storage and layout state (the flat shard, the unsharded buffer and
// its views), the parameter objects, shard changes and the unit's groups. Its other
// concerns have files of their own (unit.h lists them).
#include "unit.h"

#include "dtypes.h"
#include "freed_storage.h"

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <limits>
#include <utility>

namespace mfsdp {
namespace {

// Where the unit's memory lives: the parameters' device, or for meta parameters the
// device they are to be materialized on.
c10::Device unit_device(const std::vector<at::Tensor>& params, const std::optional<c10::Device>& materialize_on) {
  MFSDP_CHECK(!params.empty(), "Unit needs at least one parameter");
  const c10::Device device = params.front().device();
  if (device.is_meta()) {
    MFSDP_CHECK_VALUE(materialize_on.has_value() && !materialize_on->is_meta(),
                      "Unit: parameters on the meta device need a real device to materialize the shard on");
    return *materialize_on;
  }
  // Parameters built on the CPU may be sharded onto a device (CPU offload: the unit computes
  // there, its shard goes back to host memory).
  MFSDP_CHECK_VALUE(!materialize_on || *materialize_on == device || device.is_cpu(), "Unit: materialize_on=",
                    *materialize_on, " is only for meta or CPU parameters; these are on ", device);
  return materialize_on.value_or(device);
}

std::vector<int64_t> numels_of(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> n;
  n.reserve(params.size());
  for (const auto& p : params) n.push_back(p.numel());
  return n;
}
}  // namespace

Unit::Unit(const std::vector<at::Tensor>& params, std::vector<std::string> names,
           ProcessGroupPtr pg, int64_t alignment, std::optional<at::ScalarType> param_dtype,
           std::optional<at::ScalarType> reduce_dtype, ShardingStrategy strategy,
           std::optional<c10::Device> materialize_on)
    : strategy_(strategy),
      // Replicated: one segment holding everything, kept by every rank.
      layout_(FlatLayout::even(numels_of(params),
                               traits(strategy).replicated ? 1 : (pg ? pg->getSize() : 1),
                               alignment)),
      ag_comm_(pg),
      rs_comm_(pg),
      device_(unit_device(params, materialize_on)),
      compute_ready_(device_),
      all_gather_done_(std::make_shared<StreamEvent>(device_)),
      gathered_(all_gather_done_) {
  MFSDP_CHECK(names.size() == params.size(), "Unit: ", names.size(), " names for ",
              params.size(), " parameters");
  set_label(names.size() == 1 ? names[0] : names[0] + ", ... (" + std::to_string(names.size()) + " parameters)");
  orig_dtype_ = params.front().scalar_type();
  const bool deferred = params.front().device().is_meta();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    MFSDP_CHECK(p.device() == params.front().device(), "parameter '", names[i], "' is on ", p.device(),
                " but parameter '", names[0], "' is on ", params.front().device(),
                "; all parameters of one fully_shard unit must be on one device");
    MFSDP_CHECK(p.scalar_type() == orig_dtype_, "parameter '", names[i], "' has dtype ",
                p.scalar_type(), " but '", names[0], "' has ", orig_dtype_,
                "; one fully_shard unit needs a single parameter dtype");
  }
  MFSDP_CHECK(is_supported_float(orig_dtype_), "fully_shard needs ", kSupportedFloatNames, " parameters, got ",
              orig_dtype_);
  param_dtype_ = param_dtype.value_or(orig_dtype_);
  reduce_dtype_ = reduce_dtype.value_or(param_dtype_);
  MFSDP_CHECK(is_supported_float(param_dtype_), "param_dtype must be ", kSupportedFloatNames, ", got ", param_dtype_);
  MFSDP_CHECK(is_supported_float(reduce_dtype_), "reduce_dtype must be ", kSupportedFloatNames, ", got ",
              reduce_dtype_);

  transform_ = param_dtype_ == orig_dtype_ ? GatherTransform::kNone : GatherTransform::kCast;
  const auto slices = layout_.shard_slices(shard_index());
  for (size_t i = 0; i < params.size(); ++i) {
    specs_.push_back(ParamSpec{std::move(names[i]), params[i].sizes().vec(), orig_dtype_, param_dtype_, transform_,
                               device_, slices[i]});
  }
  const auto opts = params.front().options().device(device_).requires_grad(false);
  sharded_flat_ = at::zeros({layout_.segment_numel(shard_index())}, opts);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& s = specs_[i].slice;
      if (s.numel == 0) continue;
      auto slot = sharded_flat_.narrow(0, s.shard_offset, s.numel);
      if (deferred) {
        slot.fill_(std::numeric_limits<double>::quiet_NaN());  // unset until materialized: loud if read
      } else {
        slot.copy_(local_piece(static_cast<int64_t>(i), params[i].detach()));
      }
    }
  }
  has_grad_.assign(params.size(), false);
  make_unsharded_buffer();
}

void Unit::make_unsharded_buffer() {
  if (aliases_shard()) {
    unsharded_flat_ = sharded_flat_;  // nothing to gather, ever
    unsharded_nbytes_ = 0;
    state_ = UnitState::kUnsharded;
    return;
  }
  // The unsharded buffer starts freed; nothing of the unit's full size is allocated
  // before the first unshard (a model built on the meta device never exists in full).
  const at::ScalarType dtype = gathers_bytes() ? at::kByte : param_dtype_;
  // MXFP8: the data, then every rank's scale bytes (one a block) in rank order.
  const int64_t numel = gathers_bytes() ? gather_bytes_->total + (mx_block_ ? layout_.total_numel() / mx_block_ : 0)
                                        : layout_.total_numel();
  unsharded_nbytes_ = numel * static_cast<int64_t>(c10::elementSize(dtype));
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(device_.type()), /*resizable=*/false);
  storage.unsafeGetStorageImpl()->set_nbytes(unsharded_nbytes_);  // sized for the view below, no memory yet
  unsharded_flat_ = at::empty({0}, device_options(dtype)).set_(storage, 0, {numel}, {1});
  state_ = UnitState::kSharded;
  free_unsharded();
}

int64_t Unit::unsharded_storage_bytes() const {
  if (aliases_shard()) return 0;  // the shard's own storage: nothing extra
  return static_cast<int64_t>(unsharded_flat_.storage().nbytes());
}

std::vector<at::Tensor> Unit::sharded_views() const {
  std::vector<at::Tensor> out;
  for (const auto& p : specs_) out.push_back(sharded_flat_.narrow(0, p.slice.shard_offset, p.slice.numel));
  return out;
}

at::Tensor Unit::unsharded_view(at::ScalarType dtype, const std::vector<int64_t>& shape, int64_t offset) const {
  // A fresh TensorImpl on the flat storage (not view(), not set_()):
  //  - it has its own version counter, so writing the flat buffer (all-gather) does
  //    not invalidate tensors autograd saved from it;
  //  - nothing reads or resizes the storage, which may be freed (set_() would
  //    re-allocate the whole buffer just to check the view fits).
  auto v = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(unsharded_flat_.storage()),
                                                    unsharded_flat_.key_set(), c10::scalarTypeToTypeMeta(dtype));
  v.unsafeGetTensorImpl()->set_sizes_and_strides(shape, c10::contiguous_strides(shape), offset);
  return v;
}

std::vector<at::Tensor> Unit::unsharded_views() const {
  // With the FP8 gather the buffer is bytes: each view takes its gathered dtype at its
  // byte offset (aligned to its width: set_byte_gather).
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    const at::ScalarType dtype = gathers_bytes() ? specs_[i].gather_dtype : unsharded_flat_.scalar_type();
    const int64_t offset = gathers_bytes()
        ? gather_bytes_->param_starts[i] / static_cast<int64_t>(c10::elementSize(dtype))
        : layout_.param_offset(i);
    out.push_back(unsharded_view(dtype, specs_[i].shape, offset));
  }
  return out;
}

void Unit::bind_params(std::vector<at::Tensor> sharded_params, std::vector<at::Tensor> unsharded_params,
                       std::vector<at::Tensor> unsharded_locals) {
  const size_t n = static_cast<size_t>(layout_.num_params());
  if (unsharded_locals.empty()) unsharded_locals = unsharded_params;
  MFSDP_CHECK(sharded_params.size() == n && unsharded_params.size() == n && unsharded_locals.size() == n,
              "bind_params: expected ", n, " sharded and unsharded parameters (and unsharded locals, if any)");
  for (size_t i = 0; i < n; ++i) {
    const auto& s = sharded_params[i];
    const auto& u = unsharded_params[i];
    const auto& local = unsharded_locals[i];
    MFSDP_CHECK(s.defined() && s.dim() == 1 && s.numel() == specs_[i].slice.numel && s.scalar_type() == orig_dtype_,
                "bind_params: sharded parameter '", specs_[i].name, "' must be a 1-D ", orig_dtype_, " tensor of ",
                specs_[i].slice.numel, " elements (one of sharded_views())");
    MFSDP_CHECK(local.defined() && local.sizes().vec() == specs_[i].shape && local.scalar_type() == param_dtype_,
                "bind_params: unsharded ", (local.is_same(u) ? "parameter '" : "local of '"), specs_[i].name,
                "' must be a ", param_dtype_, " tensor of shape ", specs_[i].shape, " (one of unsharded_views())");
    MFSDP_CHECK(u.defined() && u.scalar_type() == param_dtype_, "bind_params: unsharded parameter '",
                specs_[i].name, "' must be a ", param_dtype_, " tensor");
  }
  sharded_params_ = std::move(sharded_params);
  unsharded_params_ = std::move(unsharded_params);
  unsharded_locals_ = std::move(unsharded_locals);
}

void Unit::set_context(std::shared_ptr<CommContext> ctx) {
  MFSDP_CHECK(ctx && ctx->device() == device_, "set_context: context device does not match the unit's ",
              device_);
  ctx_ = std::move(ctx);
}

namespace {
Communicator same_ranks_or_throw(ProcessGroupPtr pg, const Communicator& unit_comm, const char* what) {
  Communicator c(std::move(pg));
  MFSDP_CHECK(c.size() == unit_comm.size() && c.rank() == unit_comm.rank(), what, " group has rank ", c.rank(),
              " of ", c.size(), " but the unit's process group has rank ", unit_comm.rank(), " of ",
              unit_comm.size(), "; both must span the same ranks in the same order");
  return c;
}
}  // namespace

void Unit::set_all_gather_group(ProcessGroupPtr pg) {
  ag_comm_ = same_ranks_or_throw(std::move(pg), rs_comm_, "all-gather");
  set_comm_buffer_source(comm_buffer_source_);  // decided again for the new group
}

void Unit::set_reduce_scatter_group(ProcessGroupPtr pg) {
  rs_comm_ = same_ranks_or_throw(std::move(pg), ag_comm_, "reduce-scatter");
  set_comm_buffer_source(comm_buffer_source_);
}

bool Unit::set_comm_buffer_source(CommBufferSource source) {
  const bool from_group = source == CommBufferSource::kProcessGroup;
  const bool gather_can = !replicated() && group_allocates(ag_comm_, device_);
  const bool reduce_can = group_allocates(rs_comm_, device_);
  comm_buffer_source_ = source;
  gather_buffer_from_group_ = from_group && gather_can && !aliases_shard();
  reduce_buffer_from_group_ = from_group && reduce_can;
  return gather_can || reduce_can;
}

at::Tensor Unit::comm_buffer(const Communicator& comm, int64_t numel, const at::TensorOptions& options,
                             bool from_group) const {
  try {
    return allocate_comm_buffer(comm, numel, options, from_group);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(Error, c10::str("fully_shard unit '", label_, "': allocating ", numel, " elements of ",
                                    options.dtype(), " from its process group (backend '",
                                    comm.group()->getBackendName(), "'; set_allocate_memory_from_process_group_for_comm"
                                    "(True)) failed: ", e.what_without_backtrace()));
  }
}

void Unit::set_replicate_group(ProcessGroupPtr pg) {
  Communicator c(std::move(pg));
  MFSDP_CHECK(!partial_.defined(), "set_replicate_group: fully_shard unit '", label_,
              "' holds a deferred gradient reduction; set the replicate group before training");
  replicate_comm_ = c.size() > 1 ? std::move(c) : Communicator();
}

void Unit::set_post_forward_group(ProcessGroupPtr pg) {
  Communicator c(std::move(pg));
  const int world = rs_comm_.size();
  MFSDP_CHECK(!replicated() && layout_.kind() == SegmentKind::kEven, "reshard_after_forward=int: fully_shard unit '",
              label_, "' does not shard its parameters evenly (sharding_strategy or layout); there is nothing to "
              "reshard to a smaller group");
  MFSDP_CHECK(!gathers_bytes(), "reshard_after_forward=int: fully_shard unit '", label_,
              "' gathers FP8 bytes (torchao's FP8 all-gather), which keeps no post-forward copy; use "
              "reshard_after_forward=True for it");
  MFSDP_CHECK(c.size() > 1 && c.size() < world && world % c.size() == 0, "reshard_after_forward=int: the group has ",
              c.size(), " ranks; fully_shard unit '", label_, "' needs a factor of its ", world,
              " ranks other than 1 and ", world);
  MFSDP_CHECK(c.rank() == rank() % c.size(), "reshard_after_forward=int: this rank is ", c.rank(), " of ", c.size(),
              " in the post-forward group but ", rank(), " of ", world, " in unit '", label_,
              "''s group; the post-forward group must hold consecutive ranks of the shard group, in order");
  post_forward_flat_ = at::Tensor();
  post_forward_comm_ = std::move(c);
}

int64_t Unit::post_forward_nbytes() const {
  return post_forward_flat_.defined() ? post_forward_flat_.numel() * post_forward_flat_.element_size() : 0;
}

bool Unit::post_forward_copy_valid() const {
  return !stale_ && post_forward_generation_ == shard_generation_ &&
         post_forward_version_ == sharded_flat_._version();
}

void Unit::check_bound(const char* what) const {
  MFSDP_CHECK(static_cast<int64_t>(sharded_params_.size()) == layout_.num_params(), what,
              ": fully_shard unit '", label_, "' has no parameters bound yet (call bind_params first)");
}

CommContext& Unit::ctx() {
  MFSDP_CHECK(ctx_, "fully_shard unit has no communication context (internal error: lazy init did not run)");
  return *ctx_;
}

bool Unit::views_its_slot(size_t i) const {
  const auto& p = sharded_params_[i];
  const auto& s = specs_[i].slice;
  if (p.numel() != s.numel || p.scalar_type() != orig_dtype_) return false;
  // An empty tensor's data_ptr() is null: an empty slice is intact while it still
  // shares the flat shard's storage. Checking that too keeps the answer the same on
  // every rank when all of them assign `p.data`, so a kept copy is re-gathered by all.
  if (s.numel == 0) return p.storage().is_alias_of(sharded_flat_.storage());
  return p.data_ptr() == static_cast<char*>(sharded_flat_.data_ptr()) + s.shard_offset * sharded_flat_.element_size();
}

bool Unit::adopt_data_writes() {
  // Optimizers update shards in place through the views; `param.data = x` breaks the
  // link, found here by a pointer compare per parameter.
  std::vector<size_t> replaced;
  for (size_t i = 0; i < sharded_params_.size(); ++i) {
    if (views_its_slot(i)) continue;
    const auto& p = sharded_params_[i];
    const auto& s = specs_[i].slice;
    MFSDP_CHECK(p.numel() == s.numel && p.dim() == 1,
                "sharded parameter '", specs_[i].name, "' was replaced by a tensor of shape ",
                p.sizes(), "; its shard has shape [", s.numel,
                "] (full shape ", specs_[i].shape,
                "). Update sharded parameters in place (e.g. `with torch.no_grad(): p.copy_(x)`) "
                "or use load_full_state_dict()");
    replaced.push_back(i);
  }
  if (replaced.empty()) return false;
  // The value `p.data` handed out before the replacement views the slot the new value
  // would be written into: an EMA swap (`p.data, e.data = e.data, p.data`, swapped back
  // after evaluation) would find its saved weights overwritten. On a plain module that
  // value keeps its storage; here the shard moves instead. (An offloaded shard is the
  // host optimizer's: it stays.)
  if (!offloaded_) move_shard_to_fresh_storage();
  for (size_t i : replaced) shard_changed(static_cast<int64_t>(i), sharded_params_[i].detach());
  return true;
}

void Unit::move_shard_to_fresh_storage() { rebind_shard(sharded_flat_.clone(at::MemoryFormat::Contiguous)); }

void Unit::rebind_shard(at::Tensor flat) {
  for (size_t i = 0; i < sharded_params_.size(); ++i) {
    if (!views_its_slot(i)) continue;  // a replaced value stays the caller's until adopted
    const auto& s = specs_[i].slice;
    sharded_params_[i].set_data(flat.narrow(0, s.shard_offset, s.numel));
  }
  sharded_flat_ = std::move(flat);
  if (aliases_shard() && !unsharded_locals_.empty()) {
    // The unsharded parameters view the shard itself (nothing is gathered): they move too.
    unsharded_flat_ = sharded_flat_;
    auto views = unsharded_views();
    for (size_t i = 0; i < unsharded_locals_.size(); ++i) unsharded_locals_[i].set_data(views[i]);
  }
}

void Unit::move_shard_to(c10::Device device) {
  check_bound("move_shard_to");
  wait_host_update();
  MFSDP_CHECK_VALUE(!offloaded_, "unit '", label_, "' is CPU-offloaded (offload_policy): its shard lives in host "
                    "memory by that policy and is not moved");
  MFSDP_CHECK_VALUE(!gathers_bytes(), "unit '", label_, "' gathers FP8/MX bytes: moving its shard to ", device,
                    " is not supported (its quantized shard and scales stay on ", device_, ")");
  MFSDP_CHECK_VALUE(aliases_shard() || state_ == UnitState::kSharded, "unit '", label_, "' is gathered: reshard() it "
                    "before moving its shard to ", device);
  if (sharded_flat_.device() == device) return;
  adopt_data_writes();  // values assigned through `p.data = x` are the unit's before it moves
  // Every parameter views its slot now, so all of them move.
  rebind_shard(sharded_flat_.to(device, /*non_blocking=*/false, /*copy=*/true));
  for (auto& spec : specs_) spec.storage_device = device;
  post_forward_flat_ = at::Tensor();  // a kept 1/N copy lives on the unit's device
  stale_ = true;
}

void Unit::shard_changed(std::optional<int64_t> index, const std::optional<at::Tensor>& value) {
  check_bound("shard_changed");
  ++shard_generation_;
  if (!aliases_shard()) stale_ = true;
  if (!index) {  // a report (e.g. of the step still running on the host): nothing written here
    MFSDP_CHECK(!value, "shard_changed: a value needs the index of its parameter");
    return;
  }
  wait_host_update();
  const int64_t i = *index;
  MFSDP_CHECK(i >= 0 && i < layout_.num_params(), "shard_changed: parameter index ", i, " out of range [0, ",
              layout_.num_params(), ")");
  MFSDP_CHECK(value && value->defined(), "shard_changed: parameter '", specs_[i].name, "' needs its new value");
  const auto& s = specs_[i].slice;
  const bool full = value->sizes().vec() == specs_[i].shape;
  MFSDP_CHECK_VALUE(full || (value->dim() == 1 && value->numel() == s.numel), "parameter '", specs_[i].name,
              "' of fully_shard unit '", label_, "' was replaced by one of shape ", value->sizes(),
              ", but the sharded parameter has full shape ", specs_[i].shape, " (this rank's shard: [", s.numel,
              "]); a replacement must keep the shape (or build the model again before fully_shard)");
  auto slot = sharded_flat_.narrow(0, s.shard_offset, s.numel);
  {
    at::NoGradGuard no_grad;
    if (s.numel > 0) slot.copy_(full ? local_piece(i, *value) : value->reshape({-1}));
  }
  if (!views_its_slot(static_cast<size_t>(i))) sharded_params_[i].set_data(slot);
}

at::Tensor Unit::local_piece(int64_t index, const at::Tensor& full) const {
  MFSDP_CHECK_VALUE(index >= 0 && index < layout_.num_params(), "local_piece: parameter index ", index,
                    " out of range [0, ", layout_.num_params(), ")");
  const auto& s = specs_[index].slice;
  MFSDP_CHECK_VALUE(full.numel() == layout_.param_numel(index), "parameter '", specs_[index].name, "' of fully_shard unit '",
                    label_, "': a full value of shape ", full.sizes(), " (", full.numel(),
                    " elements) for a parameter of shape ", specs_[index].shape, " (", layout_.param_numel(index), " elements)");
  return full.reshape({-1}).narrow(0, s.param_offset, s.numel);
}

void Unit::allocate_unsharded() {
  if (aliases_shard()) return;
  // Allocated on the current (compute) stream: the memory is then only ever reused in
  // that stream's order, so freeing it needs no record_stream.
  auto* impl = unsharded_flat_.storage().unsafeGetStorageImpl();
  allow_access(impl);  // also for a unit of zero-size parameters, whose 0 bytes are "allocated" already
  const bool want_group = gather_buffer_from_group_ && ran_device_collective(ag_comm_.group());
  if (static_cast<int64_t>(impl->nbytes()) == unsharded_nbytes_) {
    if (want_group == unsharded_from_group_ || unsharded_nbytes_ == 0) return;
    // The source changed since this buffer was allocated: the gather about to run
    // rewrites all of it, so it moves now.
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
    impl->set_nbytes(0);
  }
  if (want_group) {
    // The group's registered memory: its DataPtr moves into the unsharded storage, so
    // freeing that storage hands the block back to the group's pool.
    at::Tensor block = comm_buffer(ag_comm_, unsharded_nbytes_, device_options(at::kByte), /*from_group=*/true);
    impl->set_data_ptr_noswap(block.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, device_)));
    impl->set_nbytes(unsharded_nbytes_);
    unsharded_from_group_ = true;
    return;
  }
  c10::Allocator* alloc = impl->allocator();
  MFSDP_CHECK(alloc != nullptr, "unsharded storage has no allocator");
  impl->set_data_ptr_noswap(alloc->allocate(unsharded_nbytes_));
  impl->set_nbytes(unsharded_nbytes_);
  unsharded_from_group_ = false;
}

void Unit::free_unsharded() {
  if (aliases_shard()) return;
  auto* impl = unsharded_flat_.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, device_));
  impl->set_nbytes(0);
  // A tensor kept from an unsharded parameter (or any view of one) keeps its full
  // shape; reading it must raise, not dereference the freed (null) memory.
  refuse_access(impl, freed_message_);
}

}  // namespace mfsdp
