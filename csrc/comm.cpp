#include "comm.h"

#include "comm_buffers.h"

#include <algorithm>
#include <array>
#include <atomic>

namespace mfsdp {
namespace {

struct AtomicCount {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> bytes{0};
};
std::array<AtomicCount, kNumCollectiveKinds>& counts() {
  static std::array<AtomicCount, kNumCollectiveKinds> c;
  return c;
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

int64_t total_nbytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += nbytes(t);
  return n;
}

}  // namespace

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllToAll: return "all_to_all";
  }
  return "collective";
}

CollectiveCount collective_count(CollectiveKind kind) {
  const auto& c = counts()[static_cast<size_t>(kind)];
  return {c.calls.load(std::memory_order_relaxed), c.bytes.load(std::memory_order_relaxed)};
}

void reset_collective_counts() {
  for (auto& c : counts()) {
    c.calls.store(0, std::memory_order_relaxed);
    c.bytes.store(0, std::memory_order_relaxed);
  }
}

Communicator::Communicator(ProcessGroupPtr pg) : pg_(std::move(pg)) {
  MFSDP_CHECK(pg_, "Communicator: process group is null");
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  cpu_caps_ = backend_caps(pg_, c10::DeviceType::CPU);
  cuda_caps_ = backend_caps(pg_, c10::DeviceType::CUDA);
}

const BackendCaps* Communicator::caps(c10::DeviceType type) const {
  if (type != c10::DeviceType::CPU && type != c10::DeviceType::CUDA) return nullptr;
  const auto& c = type == c10::DeviceType::CPU ? cpu_caps_ : cuda_caps_;
  return c ? &*c : nullptr;
}

const BackendCaps& Communicator::caps_for(const char* what, const at::Tensor& t) const {
  const BackendCaps* c = caps(t.device().type());
  MFSDP_CHECK_VALUE(c != nullptr, what, ": the process group (backend '", pg_->getBackendName(),
                    "') has no backend for ", t.device().str(), " tensors");
  return *c;
}

template <typename F>
void Communicator::issue(const char* what, const BackendCaps& caps, CollectiveKind kind, int64_t bytes,
                         F&& call) const {
  auto& count = counts()[static_cast<size_t>(kind)];
  count.calls.fetch_add(1, std::memory_order_relaxed);
  count.bytes.fetch_add(bytes, std::memory_order_relaxed);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = call();
    // NCCL with asyncOp=false may return no Work at all: the collective is already
    // ordered on the current stream. Gloo always returns one and finishes it in wait().
    if (work) work->wait();
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(DistBackendError, msg(what, " on backend '", caps.name, "' failed: ",
                                          e.what_without_backtrace()));
  }
  // The group's device communicator exists now: its backend can register memory with it.
  if (cuda_caps_ && &caps == &*cuda_caps_) note_device_collective(pg_);
}

void Communicator::check_buffer(const char* what, const char* which, const at::Tensor& t) const {
  MFSDP_CHECK(pg_, what, ": the communicator has no process group");
  MFSDP_CHECK(t.defined(), what, ": ", which, " is undefined");
  // Collectives read and write raw memory in element order: a strided, expanded or
  // overlapping view would be read wrongly or written out of bounds.
  MFSDP_CHECK(t.is_contiguous(), what, ": ", which, " must be contiguous (got sizes ", t.sizes(), ", strides ",
              t.strides(), "); pass .contiguous() or a flat buffer");
}

void Communicator::check_pair(const char* what, const at::Tensor& out, const at::Tensor& in) const {
  check_buffer(what, "output", out);
  check_buffer(what, "input", in);
  MFSDP_CHECK(out.device() == in.device(), what, ": output is on ", out.device(), " but input is on ",
              in.device());
  MFSDP_CHECK(out.scalar_type() == in.scalar_type(), what, ": dtype mismatch ", out.scalar_type(), " vs ",
              in.scalar_type());
}

void Communicator::all_gather_flat(at::Tensor& out, at::Tensor& in) const {
  check_pair("all_gather_flat", out, in);
  MFSDP_CHECK(out.numel() == in.numel() * size_, "all_gather_flat: output has ", out.numel(),
              " elements, expected ", in.numel(), " x ", size_);
  if (size_ == 1) {
    if (!out.is_same(in) && out.data_ptr() != in.data_ptr()) out.copy_(in);
    return;
  }
  if (out.numel() == 0) return;
  const BackendCaps& caps = caps_for("all_gather_flat", out);
  c10d::AllgatherOptions opts;
  opts.asyncOp = false;
  issue("all_gather_flat", caps, CollectiveKind::kAllGather, nbytes(out), [&] {
    if (caps.flat_all_gather) return pg_->_allgather_base(out, in, opts);
    std::vector<std::vector<at::Tensor>> outs{out.chunk(size_)};  // views: no copy-out
    std::vector<at::Tensor> ins{in};
    return pg_->allgather(outs, ins, opts);
  });
}

void Communicator::coalesced_pairs(const char* what, bool gather, std::vector<at::Tensor>& outs,
                                   std::vector<at::Tensor>& ins, std::vector<at::Tensor>& out_list,
                                   std::vector<at::Tensor>& in_list) const {
  MFSDP_CHECK(outs.size() == ins.size(), what, ": ", outs.size(), " outputs but ", ins.size(), " inputs");
  for (size_t i = 0; i < outs.size(); ++i) {
    check_pair(what, outs[i], ins[i]);
    const auto& whole = gather ? outs[i] : ins[i];
    const auto& part = gather ? ins[i] : outs[i];
    MFSDP_CHECK(whole.numel() == part.numel() * size_, what, gather ? ": output " : ": input ", i, " has ",
                whole.numel(), " elements, expected ", part.numel(), " x ", size_);
    if (size_ == 1) {
      if (outs[i].data_ptr() != ins[i].data_ptr()) outs[i].copy_(ins[i]);
    } else if (outs[i].numel() > 0) {
      out_list.push_back(outs[i]);
      in_list.push_back(ins[i]);
    }
  }
}

void Communicator::all_gather_flat_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) const {
  std::vector<at::Tensor> out_list, in_list;
  coalesced_pairs("all_gather_flat_coalesced", /*gather=*/true, outs, ins, out_list, in_list);
  if (out_list.empty()) return;
  const BackendCaps& caps = caps_for("all_gather_flat_coalesced", out_list[0]);
  if (out_list.size() == 1 || !caps.coalesced_all_gather) {
    for (size_t i = 0; i < out_list.size(); ++i) all_gather_flat(out_list[i], in_list[i]);
    return;
  }
  c10d::AllgatherOptions opts;
  opts.asyncOp = false;
  issue("all_gather_flat_coalesced", caps, CollectiveKind::kAllGather, total_nbytes(out_list), [&] {
    // The older names: torch releases before the renames to *_single_coalesced have only these.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return pg_->allgather_into_tensor_coalesced(out_list, in_list, opts);
#pragma GCC diagnostic pop
  });
}

void Communicator::reduce_scatter_flat(at::Tensor& out, at::Tensor& in) const {
  check_pair("reduce_scatter_flat", out, in);
  MFSDP_CHECK(in.numel() == out.numel() * size_, "reduce_scatter_flat: input has ", in.numel(),
              " elements, expected ", out.numel(), " x ", size_);
  if (size_ == 1) {
    if (out.data_ptr() != in.data_ptr()) out.copy_(in);
    return;
  }
  if (out.numel() == 0) return;
  const BackendCaps& caps = caps_for("reduce_scatter_flat", in);
  if (!caps.flat_reduce_scatter) {
    auto all = in.clone();
    all_reduce(all, c10d::ReduceOp::SUM);
    out.copy_(all.narrow(0, rank_ * out.numel(), out.numel()));
    return;
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;  // SUM then scale: AVG was unreliable on Gloo
  opts.asyncOp = false;
  issue("reduce_scatter_flat", caps, CollectiveKind::kReduceScatter, nbytes(in),
        [&] { return pg_->_reduce_scatter_base(out, in, opts); });
}

void Communicator::reduce_scatter_flat_coalesced(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) const {
  std::vector<at::Tensor> out_list, in_list;
  coalesced_pairs("reduce_scatter_flat_coalesced", /*gather=*/false, outs, ins, out_list, in_list);
  if (out_list.empty()) return;
  const BackendCaps& caps = caps_for("reduce_scatter_flat_coalesced", in_list[0]);
  if (out_list.size() == 1 || !caps.coalesced_reduce_scatter || !caps.flat_reduce_scatter) {
    for (size_t i = 0; i < out_list.size(); ++i) reduce_scatter_flat(out_list[i], in_list[i]);
    return;
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.asyncOp = false;
  issue("reduce_scatter_flat_coalesced", caps, CollectiveKind::kReduceScatter, total_nbytes(in_list), [&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return pg_->reduce_scatter_tensor_coalesced(out_list, in_list, opts);
#pragma GCC diagnostic pop
  });
}

void Communicator::all_reduce(at::Tensor& t, c10d::ReduceOp::RedOpType op) const {
  check_buffer("all_reduce", "tensor", t);
  if (size_ == 1 || t.numel() == 0) return;
  const BackendCaps& caps = caps_for("all_reduce", t);
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  opts.asyncOp = false;
  issue("all_reduce", caps, CollectiveKind::kAllReduce, nbytes(t), [&] { return pg_->allreduce(tensors, opts); });
}

void Communicator::broadcast(at::Tensor& t, int root) const {
  check_buffer("broadcast", "tensor", t);
  MFSDP_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of this group of ", size_);
  if (size_ == 1 || t.numel() == 0) return;
  const BackendCaps& caps = caps_for("broadcast", t);
  std::vector<at::Tensor> tensors{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.asyncOp = false;
  issue("broadcast", caps, CollectiveKind::kBroadcast, nbytes(t), [&] { return pg_->broadcast(tensors, opts); });
}

void Communicator::all_to_all_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& out_splits,
                                const std::vector<int64_t>& in_splits) const {
  check_pair("all_to_all_v", out, in);
  MFSDP_CHECK(static_cast<int>(out_splits.size()) == size_ && static_cast<int>(in_splits.size()) == size_,
              "all_to_all_v: expected ", size_, " output and input splits, got ", out_splits.size(), " and ",
              in_splits.size());
  int64_t out_total = 0, in_total = 0;
  for (int r = 0; r < size_; ++r) {
    MFSDP_CHECK(out_splits[r] >= 0 && in_splits[r] >= 0, "all_to_all_v: negative split for rank ", r);
    out_total += out_splits[r];
    in_total += in_splits[r];
  }
  MFSDP_CHECK(out.numel() == out_total && in.numel() == in_total, "all_to_all_v: output has ", out.numel(),
              " elements and input ", in.numel(), ", the splits add up to ", out_total, " and ", in_total);
  if (size_ == 1) {
    if (out_total > 0 && out.data_ptr() != in.data_ptr()) out.copy_(in);
    return;
  }
  const BackendCaps& caps = caps_for("all_to_all_v", out);
  MFSDP_CHECK(caps.all_to_all, "all_to_all_v: backend '", caps.name, "' has no all-to-all for ", out.device().type(),
              " tensors (register_backend_capabilities(..., all_to_all=True) if it does)");
  std::vector<int64_t> outs(out_splits), ins(in_splits);
  c10d::AllToAllOptions opts;
  opts.asyncOp = false;
  issue("all_to_all_v", caps, CollectiveKind::kAllToAll, nbytes(in), [&] {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return pg_->alltoall_base(out, in, outs, ins, opts);  // the name every torch this builds against has
#pragma GCC diagnostic pop
  });
}

void Communicator::check_segments(const char* what, const at::Tensor& flat,
                                  const std::vector<int64_t>& starts,
                                  const std::vector<int64_t>& numels) const {
  MFSDP_CHECK(static_cast<int>(starts.size()) == size_ && static_cast<int>(numels.size()) == size_,
              what, ": expected ", size_, " segment starts and numels, got ", starts.size(), " and ",
              numels.size());
  check_buffer(what, "flat buffer", flat);
  MFSDP_CHECK(flat.dim() == 1, what, ": flat buffer must be 1-D, got sizes ", flat.sizes());
  for (int r = 0; r < size_; ++r) {
    // Written so that no sum can overflow whatever the arguments.
    MFSDP_CHECK(numels[r] >= 0 && starts[r] >= 0 && starts[r] <= flat.numel() &&
                    numels[r] <= flat.numel() - starts[r],
                what,
                ": segment ", r, " [", starts[r], ", ", starts[r] + numels[r],
                ") is outside the flat buffer of ", flat.numel(), " elements");
  }
}

// Views of every rank's segment of `flat`: the grouped algorithms read/write them directly.
static std::vector<std::vector<at::Tensor>> segment_views(const at::Tensor& flat,
                                                          const std::vector<int64_t>& starts,
                                                          const std::vector<int64_t>& numels) {
  std::vector<std::vector<at::Tensor>> views(1);
  for (size_t r = 0; r < starts.size(); ++r) views[0].push_back(flat.narrow(0, starts[r], numels[r]));
  return views;
}

// One pass over the segment sizes: both the early exit and AUTO's size rule need them.
static SegmentExtent segment_extent(const std::vector<int64_t>& numels) {
  SegmentExtent extent;
  for (auto n : numels) {
    extent.total += n;
    extent.longest = std::max(extent.longest, n);
  }
  return extent;
}

VarAlgo auto_var_algo(bool all_gather, bool grouped, int64_t total_numel, int64_t longest_numel,
                      int world, int64_t element_size) {
  if (!grouped) return VarAlgo::kPadded;
  if (!all_gather) return VarAlgo::kGrouped;
  const int64_t padded_numel = longest_numel * world;
  const bool large = total_numel * element_size >= kPaddedAllGatherMinBytes;
  const bool balanced = 3 * padded_numel <= 4 * total_numel;
  return large && balanced ? VarAlgo::kPadded : VarAlgo::kGrouped;
}

void Communicator::check_grouped_available(VarAlgo algo, const at::Tensor& t) const {
  if (algo != VarAlgo::kGrouped) return;
  const BackendCaps* c = caps(t.device().type());
  MFSDP_CHECK_VALUE(c != nullptr && c->uneven_lists, "the GROUPED uneven algorithm needs a backend with uneven "
                    "collective lists (NCCL on CUDA tensors); backend '", c ? c->name : pg_->getBackendName(),
                    "' on ", t.device().str(), " tensors has none: use PADDED (or AUTO)");
}

VarAlgo Communicator::resolve(VarAlgo algo, bool all_gather, const at::Tensor& t,
                              const SegmentExtent& extent) const {
  const BackendCaps& caps = caps_for(all_gather ? "all_gather_v" : "reduce_scatter_v", t);
  if (algo != VarAlgo::kAuto) return algo;
  return auto_var_algo(all_gather, caps.uneven_lists, extent.total, extent.longest, size_, t.element_size());
}

std::vector<int64_t> Communicator::all_gather_host(const std::vector<int64_t>& values,
                                                   const c10::Device& device) const {
  auto mine = at::tensor(values, at::TensorOptions().dtype(at::kLong)).to(device);
  auto all = at::empty({size_ * mine.numel()}, mine.options());
  all_gather_flat(all, mine);
  auto host = all.cpu();
  const int64_t* p = host.const_data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + host.numel());
}

void Communicator::check_segments_agree(const char* what, const c10::Device& device,
                                        const std::vector<int64_t>& starts,
                                        const std::vector<int64_t>& numels) const {
  // Under a backend that moves nothing the exchange would compare this rank with itself.
  if (size_ == 1 || !moves_data(device.type())) return;
  const uint64_t h = fnv1a(numels.data(), numels.size() * sizeof(int64_t),
                           fnv1a(starts.data(), starts.size() * sizeof(int64_t)));
  const auto hashes = all_gather_host({static_cast<int64_t>(h)}, device);
  for (int r = 0; r < size_; ++r) {
    MFSDP_CHECK(hashes[r] == hashes[rank_], what, ": rank ", rank_, " and rank ", r,
                " passed different segment starts/numels (this rank: starts ", starts, ", numels ", numels,
                "); every rank must pass the same segment table");
  }
}

void Communicator::all_gather_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& numels, VarAlgo algo, bool verify) const {
  check_segments("all_gather_v", out, starts, numels);
  check_pair("all_gather_v", out, in);
  MFSDP_CHECK(in.numel() == numels[rank_], "all_gather_v: rank ", rank_, " passes ", in.numel(),
              " elements but its segment has ", numels[rank_]);
  MFSDP_CHECK(algo != VarAlgo::kAllReduce, "all_gather_v: kAllReduce applies to reduce_scatter_v only");
  check_grouped_available(algo, out);
  if (verify) check_segments_agree("all_gather_v", out.device(), starts, numels);
  auto mine = out.narrow(0, starts[rank_], numels[rank_]);
  if (size_ == 1) {
    if (mine.data_ptr() != in.data_ptr()) mine.copy_(in);
    return;
  }
  const SegmentExtent extent = segment_extent(numels);
  if (extent.longest == 0) return;
  const int64_t longest = extent.longest;
  switch (resolve(algo, /*all_gather=*/true, out, extent)) {
    case VarAlgo::kGrouped: {
      auto outs = segment_views(out, starts, numels);
      std::vector<at::Tensor> ins{in.contiguous()};
      c10d::AllgatherOptions opts;
      opts.asyncOp = false;
      issue("all_gather_v", caps_for("all_gather_v", out), CollectiveKind::kAllGather, nbytes(out),
            [&] { return pg_->allgather(outs, ins, opts); });
      return;
    }
    default: {  // kPadded
      auto padded_in = at::zeros({longest}, in.options());
      padded_in.narrow(0, 0, in.numel()).copy_(in);
      auto gathered = at::empty({longest * size_}, in.options());
      all_gather_flat(gathered, padded_in);
      for (int r = 0; r < size_; ++r) {
        if (numels[r] == 0) continue;
        out.narrow(0, starts[r], numels[r]).copy_(gathered.narrow(0, r * longest, numels[r]));
      }
      return;
    }
  }
}

void Communicator::reduce_scatter_v(at::Tensor& out, at::Tensor& in, const std::vector<int64_t>& starts,
                                    const std::vector<int64_t>& numels, VarAlgo algo, bool verify) const {
  check_segments("reduce_scatter_v", in, starts, numels);
  check_pair("reduce_scatter_v", out, in);
  MFSDP_CHECK(out.numel() == numels[rank_], "reduce_scatter_v: output has ", out.numel(),
              " elements but rank ", rank_, "'s segment has ", numels[rank_]);
  check_grouped_available(algo, in);
  if (verify) check_segments_agree("reduce_scatter_v", in.device(), starts, numels);
  if (size_ == 1) {
    out.copy_(in.narrow(0, starts[0], numels[0]));
    return;
  }
  const SegmentExtent extent = segment_extent(numels);
  if (extent.longest == 0) return;
  const int64_t longest = extent.longest;
  switch (resolve(algo, /*all_gather=*/false, in, extent)) {
    case VarAlgo::kGrouped: {
      auto ins = segment_views(in, starts, numels);
      std::vector<at::Tensor> outs{out};
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.asyncOp = false;
      issue("reduce_scatter_v", caps_for("reduce_scatter_v", in), CollectiveKind::kReduceScatter, nbytes(in),
            [&] { return pg_->reduce_scatter(outs, ins, opts); });
      return;
    }
    case VarAlgo::kAllReduce: {
      auto all = in.clone();
      all_reduce(all, c10d::ReduceOp::SUM);
      out.copy_(all.narrow(0, starts[rank_], numels[rank_]));
      return;
    }
    default: {  // kPadded
      auto padded = at::zeros({longest * size_}, in.options());
      for (int r = 0; r < size_; ++r) {
        if (numels[r] == 0) continue;
        padded.narrow(0, r * longest, numels[r]).copy_(in.narrow(0, starts[r], numels[r]));
      }
      auto reduced = at::empty({longest}, in.options());
      reduce_scatter_flat(reduced, padded);
      out.copy_(reduced.narrow(0, 0, numels[rank_]));
      return;
    }
  }
}

}  // namespace mfsdp
