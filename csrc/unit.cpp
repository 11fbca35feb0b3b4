#include "unit.h"

#include "dtypes.h"
#include "host_memory.h"
#include "pack.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <iterator>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace mfsdp {
namespace {

// Every label this process gave a unit, by hash: the collective check names the unit
// another rank is at (all ranks built the same units, so the same labels).
std::mutex& labels_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<int64_t, std::string>& labels_by_hash() {
  static std::unordered_map<int64_t, std::string> labels;
  return labels;
}

constexpr const char* kDesyncHint =
    "\nEvery rank must run the same fully_shard units in the same order (same model and sharding strategy, "
    "forward and backward on every rank). A rank that stalls, skips backward or runs an extra unit leaves the "
    "others waiting until the collective timeout (fully_shard(timeout=...), else the process group's).";

// Rethrows a failed collective as DistBackendError naming what it was for (`subject`:
// "unit 'x'" or the units of a coalesced gather), the rank and the likely causes.
[[noreturn]] void throw_collective_failure(CollectivePhase phase, const std::string& subject, int rank, int world,
                                           const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string cause = c10_error ? c10_error->what_without_backtrace() : e.what();
  C10_THROW_ERROR(DistBackendError, msg("megatron_fsdp_ext: ", phase_name(phase), " of fully_shard ", subject,
                                        " failed on rank ", rank, " of ", world, ": ", cause, kDesyncHint));
}

// torch lets a storage refuse data access with a custom message (what CUDA-graph trees
// use for freed memory). Detected rather than assumed, so the extension still builds
// against a torch without it; freed storage then simply has a null pointer.
template <typename S, typename = void>
struct CanRefuseAccess : std::false_type {};
template <typename S>
struct CanRefuseAccess<S, std::void_t<decltype(std::declval<S&>().clear_data_ptr_access_error_msg_()),
                                      decltype(std::declval<S&>().release_data_and_set_meta_custom_data_ptr_error_msg_(
                                          std::optional<std::string>()))>> : std::true_type {};

// How a coalesced collective's failure names its units: 'a', 'b', 'c'.
std::string quoted_labels(const std::vector<Unit*>& units) {
  std::string labels;
  for (const Unit* u : units) labels += (labels.empty() ? "'" : ", '") + u->label() + "'";
  return labels;
}

// Splits `units` for one coalesced collective: those `needed` (a unit listed twice
// counts once), divided into the ones that may share it with the first such unit
// (`eligible`, `compatible` with it) and the rest. A lone candidate joins the rest:
// it is served by the unit's own collective.
template <typename Needed, typename Eligible, typename Compatible>
std::pair<std::vector<Unit*>, std::vector<Unit*>> split_for_coalescing(const std::vector<Unit*>& units,
                                                                      const char* what, Needed needed,
                                                                      Eligible eligible, Compatible compatible) {
  std::vector<Unit*> together, alone;
  for (size_t i = 0; i < units.size(); ++i) {
    Unit* u = units[i];
    MFSDP_CHECK(u != nullptr, what, ": a unit is None");
    if (std::find(units.begin(), units.begin() + i, u) != units.begin() + i) continue;
    if (!needed(*u)) continue;
    const bool joins = eligible(*u) && (together.empty() || compatible(*together.front(), *u));
    (joins ? together : alone).push_back(u);
  }
  if (together.size() == 1) {
    alone.push_back(together.front());
    together.clear();
  }
  return {std::move(together), std::move(alone)};
}

}  // namespace

bool freed_storage_guard() { return CanRefuseAccess<c10::StorageImpl>::value; }

namespace {

template <typename S>
void refuse_access(S* impl, const std::string& why) {
  if constexpr (CanRefuseAccess<S>::value) impl->release_data_and_set_meta_custom_data_ptr_error_msg_(why);
}

template <typename S>
void allow_access(S* impl) {
  if constexpr (CanRefuseAccess<S>::value) impl->clear_data_ptr_access_error_msg_();
}

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

// ---------------------------------------------------------------- Unit

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

void Unit::offload_to_host(bool pin_memory) {
  MFSDP_CHECK(sharded_params_.empty(), "offload_to_host: unit '", label_, "' already has its parameters (call it "
              "before bind_params)");
  if (offloaded_) return;
  MFSDP_CHECK_VALUE(!replicated() && !full_grads(), "CPU offload of unit '", label_, "' needs a sharding strategy that "
                    "reduce-scatters gradients ('optim_grads_params' or 'optim_grads'), not '", traits(strategy_).name,
                    "'");
  MFSDP_CHECK_VALUE(!gathers_bytes(), "CPU offload of unit '", label_, "': the FP8 gather does not combine with "
                    "offloading yet");
  pinned_ = pin_memory && device_.is_cuda();
  at::Tensor host = empty_host(sharded_flat_.numel(), orig_dtype_, pinned_);
  host.copy_(sharded_flat_);
  sharded_flat_ = host;
  for (auto& spec : specs_) spec.storage_device = host.device();
  if (param_dtype_ == at::kBFloat16 && orig_dtype_ == at::kFloat) {
    host_gather_copy_ = empty_host(sharded_flat_.numel(), param_dtype_, pinned_);
  }
  offloaded_ = true;
}

void Unit::set_host_update(std::shared_ptr<HostTask> task) {
  wait_host_update();  // one in flight at a time
  host_update_ = std::move(task);
}

void Unit::wait_host_update() {
  if (!host_update_) return;
  auto task = std::move(host_update_);
  task->wait();
}

void Unit::mark_host_copy_fresh() {
  MFSDP_CHECK(host_gather_copy_.defined(), "mark_host_copy_fresh: unit '", label_, "' has no host gather copy");
  host_copy_generation_ = shard_generation_;
  host_copy_version_ = sharded_flat_._version();
}

int64_t Unit::host_nbytes() const {
  if (!offloaded_) return 0;
  int64_t bytes = sharded_flat_.nbytes();
  if (host_gather_copy_.defined()) bytes += host_gather_copy_.nbytes();
  if (host_grad_.defined()) bytes += host_grad_.nbytes();
  return bytes;
}

void Unit::copy_shard_in(at::Tensor& dst) const {
  if (host_copy_fresh() && dst.scalar_type() == host_gather_copy_.scalar_type()) {
    dst.copy_(host_gather_copy_, /*non_blocking=*/pinned_);
  } else if (dst.scalar_type() == orig_dtype_ || !dst.is_cuda()) {
    dst.copy_(sharded_flat_, /*non_blocking=*/pinned_);
  } else {
    // Copied as stored, then cast on the device: a cross-device copy that casts would cast
    // on the host first, synchronously.
    at::Tensor staging = at::empty({sharded_flat_.numel()}, device_options(orig_dtype_));
    staging.copy_(sharded_flat_, /*non_blocking=*/pinned_);
    dst.copy_(staging);
  }
}

at::Tensor Unit::host_grad_buffer() {
  if (!host_grad_.defined()) {
    host_grad_ = empty_host(sharded_flat_.numel(), orig_dtype_, pinned_);
  } else if (host_grad_.storage().use_count() > 1) {
    // A .grad view (or anything else) still holds the kept buffer: leave it to them. The
    // successor comes from torch's caching pinned allocator: registering pages anew each
    // step (the caller keeps every step's gradients) would cost far more than its rounding.
    host_grad_ = at::Tensor();
    host_grad_ = at::empty({sharded_flat_.numel()}, at::TensorOptions().dtype(orig_dtype_).pinned_memory(pinned_));
  }
  return host_grad_;
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
}

void Unit::set_reduce_scatter_group(ProcessGroupPtr pg) {
  rs_comm_ = same_ranks_or_throw(std::move(pg), ag_comm_, "reduce-scatter");
}

void Unit::set_replicate_group(ProcessGroupPtr pg) {
  Communicator c(std::move(pg));
  MFSDP_CHECK(!partial_.defined(), "set_replicate_group: fully_shard unit '", label_,
              "' holds a deferred gradient reduction; set the replicate group before training");
  replicate_comm_ = c.size() > 1 ? std::move(c) : Communicator();
}

void Unit::check_bound(const char* what) const {
  MFSDP_CHECK(static_cast<int64_t>(sharded_params_.size()) == layout_.num_params(), what,
              ": fully_shard unit '", label_, "' has no parameters bound yet (call bind_params first)");
}

const char* phase_name(CollectivePhase phase) {
  switch (phase) {
    case CollectivePhase::kAllGatherParams: return "all-gather of parameters";
    case CollectivePhase::kReduceScatterGrads: return "reduce-scatter of gradients";
    case CollectivePhase::kAllReduceGrads: return "all-reduce of gradients";
    case CollectivePhase::kAllGatherFullParams: return "all-gather of full parameters";
    case CollectivePhase::kAllReduceReplicas: return "all-reduce of gradient shards across replicas";
    case CollectivePhase::kExchangeRows: return "exchange of state-dict rows";
    case CollectivePhase::kAllReduceFp8Amax: return "all-reduce(max) of FP8 weight amaxes";
  }
  return "collective";
}

void Unit::set_gradient_divide_factor(double factor) {
  MFSDP_CHECK(factor >= 0 && std::isfinite(factor), "gradient divide factor must be finite and > 0 (0 restores the "
              "default, the group size), got ", factor);
  grad_divide_factor_ = factor;
}

void Unit::set_label(std::string label) {
  label_ = std::move(label);
  label_hash_ = static_cast<int64_t>(fnv1a(label_.data(), label_.size()));
  // Built here, not at every reshard: free_unsharded() is on the hot path.
  freed_message_ = msg("megatron_fsdp_ext: this tensor is an unsharded parameter (or a view of one) of fully_shard "
                       "unit '", label_, "', whose memory was freed by reshard(); it holds no data until the unit "
                       "is unsharded again. Keep a copy (tensor.detach().clone()) while it is unsharded, or read the "
                       "sharded parameter / model.state_dict() instead.");
  static constexpr const char* kScopes[] = {"all_gather", "reduce_scatter", "all_reduce", "all_gather_full",
                                             "all_reduce_replicas", "exchange_rows", "all_reduce_fp8_amax"};
  static_assert(std::size(kScopes) == std::tuple_size_v<decltype(profile_scopes_)>);
  for (size_t i = 0; i < profile_scopes_.size(); ++i) profile_scopes_[i] = msg("mfsdp::", kScopes[i], "[", label_, "]");
  unshard_scope_ = msg("mfsdp::unshard[", label_, "]");
  reshard_scope_ = msg("mfsdp::reshard[", label_, "]");
  std::lock_guard<std::mutex> lock(labels_mutex());
  labels_by_hash()[label_hash_] = label_;
}

void Unit::check_in_step(CollectivePhase phase, const Communicator& comm, int64_t numel, int64_t together) const {
  // Under a backend that moves nothing (fake) every rank would only see itself.
  if (!comm.moves_data(device_.type())) return;
  const int n = comm.size();
  const std::vector<int64_t> mine{label_hash_, static_cast<int64_t>(phase), numel, together};
  const auto all = comm.all_gather_host(mine, device_);
  const auto how = [](int64_t units) {
    return units > 1 ? msg(", in one collective of ", units, " units") : std::string();
  };
  for (int r = 0; r < n; ++r) {
    const int64_t* theirs = all.data() + 4 * r;
    if (std::equal(mine.begin(), mine.end(), theirs)) continue;
    std::string their_label = "(a unit this rank does not have)";
    {
      std::lock_guard<std::mutex> lock(labels_mutex());
      auto it = labels_by_hash().find(theirs[0]);
      if (it != labels_by_hash().end()) their_label = it->second;
    }
    const auto their_phase = static_cast<CollectivePhase>(theirs[1]);
    C10_THROW_ERROR(DistBackendError,
                    msg("megatron_fsdp_ext: collectives out of step: rank ", comm.rank(), " is at the ",
                        phase_name(phase), " of fully_shard unit '", label_, "' (", numel, " elements", how(together),
                        ") but rank ", r, " is at the ", phase_name(their_phase), " of unit '", their_label, "' (",
                        theirs[2], " elements", how(theirs[3]), ").", kDesyncHint,
                        together != theirs[3] ? " Ranks that bucket differently (gather_bucket_bytes, "
                                                "reduce_bucket_bytes) are out of step too." : ""));
  }
}

template <typename F>
void Unit::run_collective(CollectivePhase phase, const Communicator& comm, int64_t numel, F&& issue) {
  RECORD_USER_SCOPE(profile_scopes_[static_cast<size_t>(phase)].c_str());
  if (check_collectives_) check_in_step(phase, comm, numel);
  try {
    issue();
  } catch (const std::exception& e) {
    throw_collective_failure(phase, msg("unit '", label_, "'"), rank(), world_size(), e);
  }
}

template <typename F>
void Unit::run_coalesced(CollectivePhase phase, const std::vector<Unit*>& units, const std::vector<int64_t>& numels,
                         const Communicator& comm, F&& issue) {
  const Unit& lead = *units.front();
  // "mfsdp::all_gather[x]" -> "mfsdp::all_gather[x +2 units]"
  std::string scope = lead.profile_scopes_[static_cast<size_t>(phase)];
  if (units.size() > 1) scope.insert(scope.size() - 1, msg(" +", units.size() - 1, " units"));
  RECORD_USER_SCOPE(scope.c_str());
  int64_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    if (lead.check_collectives_) {
      units[i]->check_in_step(phase, comm, numels[i], static_cast<int64_t>(units.size()));
    }
    total += numels[i];
  }
  try {
    issue();
  } catch (const std::exception& e) {
    throw_collective_failure(phase, msg("units ", quoted_labels(units), " (one coalesced collective of ", total,
                                        " elements)"),
                             lead.rank(), lead.world_size(), e);
  }
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
  bool found = false;
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
    shard_changed(static_cast<int64_t>(i), p.detach());
    found = true;
  }
  return found;
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
  if (static_cast<int64_t>(impl->nbytes()) == unsharded_nbytes_) return;
  c10::Allocator* alloc = impl->allocator();
  MFSDP_CHECK(alloc != nullptr, "unsharded storage has no allocator");
  impl->set_data_ptr_noswap(alloc->allocate(unsharded_nbytes_));
  impl->set_nbytes(unsharded_nbytes_);
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

bool Unit::needs_gather() {
  check_bound("unshard");
  wait_host_update();
  if (state_ == UnitState::kGathering) return false;  // wait_unshard() checks for re-links
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
    at::Tensor input = in_place ? unsharded_flat_.narrow(0, layout_.segment_start(r), layout_.segment_numel(r))
                                : at::empty({sharded_flat_.numel()}, device_options(param_dtype_));
    copy_shard_in(input);
    return input;
  }
  if (transform_ == GatherTransform::kNone) return sharded_flat_;
  if (!in_place) return sharded_flat_.to(param_dtype_);
  // Cast straight into this rank's slot of the output: an in-place all-gather.
  const int r = ag_comm_.rank();
  at::Tensor input = unsharded_flat_.narrow(0, layout_.segment_start(r), layout_.segment_numel(r));
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
  prepare_gather();
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
  const auto& streams = ctx().streams();
  if (streams.enabled()) {
    compute_ready_.record(current_stream(device_));
    c10::StreamGuard guard(streams.all_gather());
    compute_ready_.block(streams.all_gather());
    at::Tensor input = gather_input(/*in_place=*/true);
    run_collective(CollectivePhase::kAllGatherParams, ag_comm_, unsharded_flat_.numel(), [&] { all_gather(input); });
    ctx().delay_after_collective();
    all_gather_done_->record(streams.all_gather());
    gathered_ = all_gather_done_;
    state_ = UnitState::kGathering;
    return;
  }
  at::Tensor input = gather_input(/*in_place=*/false);
  run_collective(CollectivePhase::kAllGatherParams, ag_comm_, unsharded_flat_.numel(), [&] { all_gather(input); });
  state_ = UnitState::kUnsharded;
}

void Unit::unshard_together(const std::vector<Unit*>& units) {
  auto [together, alone] = split_for_coalescing(
      units, "unshard_together", [](Unit& u) { return u.needs_gather(); },
      // An FP8 unit's uneven byte gather runs alone.
      [](const Unit& u) { return !u.replicated() && u.ctx_ != nullptr && !u.gathers_bytes(); },
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

void Unit::reshard() {
  if (state_ == UnitState::kSharded || aliases_shard()) return;
  RECORD_USER_SCOPE(reshard_scope_.c_str());
  wait_unshard();  // never free memory a collective may still write
  free_unsharded();
  state_ = UnitState::kSharded;
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

bool Unit::reduce_grads(bool sync) {
  check_bound("reduce_grads");
  at::Tensor flat = pack_grads(sync);
  const bool defer = sync && replicate_comm_.defined() && !requires_all_reduce_;
  if (!flat.defined()) {
    // No gradient this time, but deferred shards still wait for their all-reduce: the
    // reduction runs with zeros so that it happens (every rank of the group alike).
    if (!sync || defer || !partial_.defined()) return false;
    ctx().make_room_for_reduction();
    flat = at::zeros({layout_.total_numel()}, device_options(reduce_dtype_));
  }
  if (!sync) {
    accumulated_ = flat;
    return true;
  }
  accumulated_ = at::Tensor();
  GradBuffers buffers = plan_reduction(std::move(flat), defer);
  at::Tensor partial = partial_;  // consumed by a non-deferred reduction: freed once it is done
  if (defer && !partial_.defined()) {
    partial_ = at::zeros({layout_.segment_numel(shard_index())}, device_options(reduce_dtype_));
  }
  auto done = reduce(buffers, defer);
  if (defer) {
    // Nothing lands: has_grad_ keeps which parameters will get a gradient view.
    ctx().hold_reduction({buffers.flat, buffers.reduced, partial_}, std::move(done));
    return true;
  }
  partial_ = at::Tensor();
  land_grads(buffers, *done);
  ctx().hold_reduction({buffers.flat, buffers.reduced, buffers.target, buffers.host, partial}, std::move(done));
  std::fill(has_grad_.begin(), has_grad_.end(), false);
  return true;
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
  at::Tensor flat = accumulate
      ? accumulated_
      : at::empty({layout_.total_numel()}, device_options(reduce_dtype_));
  pack_into_flat(flat, grads, layout_.offsets(), accumulate, layout_.has_gaps() || !all);
  // The packed copy is all we need: free the unsharded gradients right away.
  for (int64_t i = 0; i < n; ++i) {
    if (grads[i].defined()) unsharded_locals_[i].mutable_grad() = at::Tensor();
  }
  return flat;
}

Unit::GradBuffers Unit::plan_reduction(at::Tensor flat, bool defer) {
  wait_host_update();  // a step still reading the gradient this reduction lands in
  GradBuffers b;
  b.flat = std::move(flat);
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
    b.landing = all_none ? Landing::kFresh : Landing::kMixed;
    b.target = at::empty({seg}, device_options(orig_dtype_));
    b.reduced = reduce_dtype_ == orig_dtype_ ? b.target : at::empty({seg}, device_options(reduce_dtype_));
    b.host = all_none ? host_grad_buffer()
                      : at::empty({seg}, at::TensorOptions().dtype(orig_dtype_).pinned_memory(pinned_));
    return b;
  }
  at::Tensor existing = all_none ? at::Tensor() : flat_grad_behind_views();
  b.landing = all_none ? Landing::kFresh : (existing.defined() ? Landing::kAccumulate : Landing::kMixed);
  const auto grad_options = device_options(orig_dtype_);
  // Full gradients (no_shard, optim) are all-reduced in place; this rank's segment of
  // the flat buffer is then its reduced shard, and in the fresh fp32 case the sharded
  // .grad views alias it, keeping the full buffer alive: ZeRO-1's full-gradient memory.
  const bool reduce_into_target = b.landing == Landing::kFresh && reduce_dtype_ == orig_dtype_;
  if (b.landing == Landing::kAccumulate) b.target = existing;
  if (full_grads()) {
    b.reduced = b.flat.narrow(0, layout_.segment_start(shard_index()), seg);
    if (b.landing != Landing::kAccumulate) b.target = reduce_into_target ? b.reduced : at::empty({seg}, grad_options);
  } else {
    if (b.landing != Landing::kAccumulate) b.target = at::empty({seg}, grad_options);
    b.reduced = reduce_into_target ? b.target : at::empty({seg}, grad_options.dtype(reduce_dtype_));
  }
  return b;
}

double Unit::grad_scale() const {
  const double mean_over = static_cast<double>(world_size()) * replicate_size();
  return 1.0 / (grad_divide_factor_ > 0 ? grad_divide_factor_ : mean_over);
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
      partial_.add_(b.reduced);
      return;
    }
    if (replicate_comm_.defined()) {
      // On the same stream, after the reduce-scatter: with one reduction in flight a
      // stream of its own would only reorder work the next reduction waits for anyway.
      if (partial_.defined()) b.reduced.add_(partial_);
      run_collective(CollectivePhase::kAllReduceReplicas, replicate_comm_, b.reduced.numel(),
                     [&] { replicate_comm_.all_reduce(b.reduced, c10d::ReduceOp::SUM); });
    }
    ctx().delay_after_collective();
    finish_reduction(b);
  });
}

void Unit::finish_reduction(GradBuffers& b) {
  cast_scale_into(b.target, b.reduced, grad_scale(), b.landing == Landing::kAccumulate);
  if (check_nonfinite_) ctx().check_nonfinite({b.target});
  copy_out(b);
}

void Unit::copy_out(const GradBuffers& b) const {
  if (b.host.defined()) b.host.copy_(b.target, /*non_blocking=*/pinned_);
}

void Unit::reduce_together(const std::vector<Unit*>& units) {
  auto [together, alone] = split_for_coalescing(
      units, "reduce_together", [](Unit&) { return true; },
      [](const Unit& u) { return u.can_share_reduction() && u.ctx_ != nullptr; },
      [](const Unit& lead, const Unit& u) {
        return u.rs_comm_.group().get() == lead.rs_comm_.group().get() && u.reduce_dtype_ == lead.reduce_dtype_ &&
               u.ctx_ == lead.ctx_;
      });
  for (Unit* u : alone) u->reduce_grads(/*sync=*/true);
  // Pack every member's gradients (the first pack retires the held reduction); units
  // without any gradient drop out, as reduce_grads would skip them.
  std::vector<Unit*> members;
  std::vector<GradBuffers> buffers;
  for (Unit* u : together) {
    u->check_bound("reduce_grads");
    at::Tensor flat = u->pack_grads(/*sync=*/true);
    if (!flat.defined()) continue;
    u->accumulated_ = at::Tensor();
    members.push_back(u);
    buffers.push_back(u->plan_reduction(std::move(flat), /*defer=*/false));
  }
  if (members.empty()) return;
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
      cast_scale_into(buffers[i].target, buffers[i].reduced, members[i]->grad_scale(),
                      buffers[i].landing == Landing::kAccumulate);
      if (members[i]->check_nonfinite_) checked.push_back(buffers[i].target);
    }
    if (!checked.empty()) lead.ctx().check_nonfinite(checked);
    for (size_t i = 0; i < members.size(); ++i) members[i]->copy_out(buffers[i]);
  });
  std::vector<at::Tensor> held;
  for (size_t i = 0; i < members.size(); ++i) {
    Unit& u = *members[i];
    u.land_grads(buffers[i], *done);
    held.insert(held.end(), {buffers[i].flat, buffers[i].reduced, buffers[i].target, buffers[i].host});
    std::fill(u.has_grad_.begin(), u.has_grad_.end(), false);
  }
  lead.ctx().hold_reduction(std::move(held), std::move(done));
}

void Unit::land_grads(const GradBuffers& b, const PendingCollective& done) {
  const int64_t n = layout_.num_params();
  // Offloaded, the gradient lands in `host`, read by the host.
  const at::Tensor& landed = offloaded_ ? b.host : b.target;
  if (b.landing == Landing::kMixed) {
    // Per-parameter merge reads `target` on the current stream (or `host` on the host):
    // wait for it first.
    if (offloaded_) done.synchronize();
    else done.wait();
    at::NoGradGuard no_grad;
    for (int64_t i = 0; i < n; ++i) {
      if (!has_grad_[i]) continue;
      auto view = landed.narrow(0, specs_[i].slice.shard_offset, specs_[i].slice.numel);
      auto& g = sharded_params_[i].mutable_grad();
      if (g.defined()) g.add_(view.view_as(g));
      else g = view;
    }
  } else if (b.landing == Landing::kFresh) {
    // Views only: the current stream reads them after the final callback's wait.
    for (int64_t i = 0; i < n; ++i) {
      if (!has_grad_[i]) continue;
      sharded_params_[i].mutable_grad() = landed.narrow(0, specs_[i].slice.shard_offset, specs_[i].slice.numel);
    }
  }
}

std::vector<at::Tensor> Unit::gather_full_params() {
  check_bound("gather_full_params");
  wait_host_update();
  adopt_data_writes();
  return gather_segments(sharded_flat_);
}

std::vector<at::Tensor> Unit::gather_full(const std::vector<std::optional<at::Tensor>>& pieces,
                                          at::ScalarType dtype) {
  check_bound("gather_full");
  wait_host_update();
  MFSDP_CHECK_VALUE(static_cast<int64_t>(pieces.size()) == layout_.num_params(), "gather_full: ", pieces.size(),
                    " pieces for the ", layout_.num_params(), " parameters of unit '", label_, "'");
  auto segment = at::zeros({sharded_flat_.numel()}, device_options(dtype));
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i]) continue;
    const auto& s = specs_[i].slice;
    MFSDP_CHECK_VALUE(pieces[i]->numel() == s.numel, "gather_full: the piece of parameter '", specs_[i].name,
                      "' of unit '", label_, "' has ", pieces[i]->numel(), " elements; this rank holds ", s.numel);
    if (s.numel > 0) segment.narrow(0, s.shard_offset, s.numel).copy_(pieces[i]->reshape({-1}));
  }
  return gather_segments(segment);
}

std::vector<at::Tensor> Unit::gather_segments(at::Tensor segment) {
  if (segment.device() != device_) segment = segment.to(device_);  // an offloaded shard
  auto full = at::empty({layout_.total_numel()}, segment.options());
  if (replicated()) {
    full.copy_(segment);
  } else {
    if (ctx_ == nullptr && !check_collectives_) {
      check_in_step(CollectivePhase::kAllGatherFullParams, ag_comm_, full.numel());
    }
    run_collective(CollectivePhase::kAllGatherFullParams, ag_comm_, full.numel(),
                   [&] { ag_comm_.all_gather_flat(full, segment); });
  }
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    out.push_back(full.narrow(0, layout_.param_offset(i), layout_.param_numel(i)).view(specs_[i].shape));
  }
  return out;
}

void Unit::set_state_dict_dims(const std::vector<int64_t>& dims) {
  MFSDP_CHECK_VALUE(static_cast<int64_t>(dims.size()) == layout_.num_params(), "set_state_dict_dims: ", dims.size(),
                    " dims for the ", layout_.num_params(), " parameters of unit '", label_, "'");
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto ndim = static_cast<int64_t>(specs_[i].shape.size());
    MFSDP_CHECK_VALUE(dims[i] == 0 || (dims[i] > 0 && dims[i] < ndim), "parameter '", specs_[i].name,
                      "' of shape ", specs_[i].shape, " cannot be sharded on dim ", dims[i]);
  }
  for (size_t i = 0; i < dims.size(); ++i) specs_[i].state_dict_dim = dims[i];
}

bool Unit::exchanges_rows() const {
  if (replicated()) return false;
  for (const auto& spec : specs_) {
    if (spec.shape.empty() || spec.state_dict_dim != 0) return false;
  }
  const BackendCaps* caps = ag_comm_.caps(device_.type());
  return caps != nullptr && caps->all_to_all;
}

std::vector<int64_t> Unit::row_counts() const {
  std::vector<int64_t> rows;
  for (const auto& spec : specs_) rows.push_back(spec.shape.empty() ? 1 : spec.shape[0]);
  return rows;
}

template <typename Src, typename Dst>
void Unit::exchange(const RowExchangePlan& plan, at::ScalarType dtype, Src&& parts, Dst&& dest) {
  MFSDP_CHECK(exchanges_rows(), "unit '", label_, "' cannot exchange state-dict rows (replicated, a 0-dim "
              "parameter, or a backend without all-to-all): gather it instead");
  at::NoGradGuard no_grad;
  const auto options = device_options(dtype);  // offloaded pieces travel through the device
  std::vector<at::Tensor> cut;
  for (const auto& p : plan.send) cut.push_back(parts(p).narrow(0, p.src_offset, p.numel).to(options));
  auto send = cut.empty() ? at::empty({0}, options) : at::cat(cut);
  int64_t received = 0;
  for (auto n : plan.recv_splits) received += n;
  auto recv = at::empty({received}, options);
  // Every rank checks the same size (the unit's), since what each sends differs.
  if (ctx_ == nullptr && !check_collectives_) {
    check_in_step(CollectivePhase::kExchangeRows, ag_comm_, layout_.total_numel());
  }
  run_collective(CollectivePhase::kExchangeRows, ag_comm_, layout_.total_numel(),
                 [&] { ag_comm_.all_to_all_v(recv, send, plan.recv_splits, plan.send_splits); });
  int64_t offset = 0;
  for (const auto& p : plan.recv) {
    dest(p).narrow(0, p.dst_offset, p.numel).copy_(recv.narrow(0, offset, p.numel));
    offset += p.numel;
  }
}

std::vector<at::Tensor> Unit::to_row_chunks(const std::vector<std::optional<at::Tensor>>& pieces,
                                            at::ScalarType dtype) {
  check_bound("to_row_chunks");
  wait_host_update();
  const int64_t n = layout_.num_params();
  MFSDP_CHECK_VALUE(pieces.empty() || static_cast<int64_t>(pieces.size()) == n, "to_row_chunks: ", pieces.size(),
                    " pieces for the ", n, " parameters of unit '", label_, "'");
  adopt_data_writes();
  const auto rows = row_counts();
  std::vector<at::Tensor> sources, out;
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = specs_[i].slice;
    at::Tensor src = pieces.empty() ? sharded_flat_.narrow(0, s.shard_offset, s.numel) : at::Tensor();
    if (!pieces.empty() && pieces[i]) {
      MFSDP_CHECK_VALUE(pieces[i]->numel() == s.numel, "to_row_chunks: the piece of parameter '", specs_[i].name,
                        "' of unit '", label_, "' has ", pieces[i]->numel(), " elements; this rank holds ", s.numel);
      src = pieces[i]->reshape({-1});
    }
    sources.push_back(src.defined() ? src : at::zeros({s.numel}, device_options(dtype)));
    std::vector<int64_t> shape(specs_[i].shape);
    const RowRange mine = chunk_rows(rows[i], layout_.world_size(), shard_index());
    shape[0] = mine.end - mine.begin;
    out.push_back(at::empty(shape, sharded_flat_.options().dtype(dtype)));
  }
  const auto plan = row_exchange_plan(layout_, rows, shard_index(), ExchangeDirection::kToRows);
  exchange(plan, dtype, [&](const ExchangePiece& p) { return sources[p.param]; },
           [&](const ExchangePiece& p) { return out[p.param].view({-1}); });
  return out;
}

at::Tensor Unit::piece_from_rows(int64_t index, const at::Tensor& rows_value) {
  check_bound("piece_from_rows");
  MFSDP_CHECK_VALUE(index >= 0 && index < layout_.num_params(), "piece_from_rows: parameter index ", index,
                    " out of range [0, ", layout_.num_params(), ")");
  const auto rows = row_counts();
  const ShardSlice mine = row_slice(layout_, rows, index, shard_index());
  MFSDP_CHECK_VALUE(rows_value.numel() == mine.numel, "parameter '", specs_[index].name, "' of fully_shard unit '",
                    label_, "': rank ", shard_index(), " holds ", mine.numel, " elements of its rows, got a value of ",
                    rows_value.numel());
  auto source = rows_value.reshape({-1});
  auto out = at::empty({specs_[index].slice.numel}, rows_value.options());
  const auto plan = row_exchange_plan(layout_, rows, shard_index(), ExchangeDirection::kFromRows, index);
  exchange(plan, rows_value.scalar_type(), [&](const ExchangePiece&) { return source; },
           [&](const ExchangePiece&) { return out; });
  return out;
}

}  // namespace mfsdp
