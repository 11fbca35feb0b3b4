// Unit: full values and FSDP2 rows for state dicts and checkpoints. gather_full_params /
// gather_full gather the unit synchronously; to_row_chunks / piece_from_rows exchange
// rows with one all-to-all instead (row_exchange.h).
#include "unit.h"

namespace mfsdp {

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
