#include "row_exchange.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mfsdp {

RowRange chunk_rows(int64_t rows, int64_t world, int64_t rank) {
  if (world <= 0 || rank < 0 || rank >= world || rows < 0) {
    throw std::invalid_argument("chunk_rows: rank " + std::to_string(rank) + " of " + std::to_string(world) +
                                " ranks, " + std::to_string(rows) + " rows");
  }
  const int64_t chunk = (rows + world - 1) / world;
  return {std::min(rank * chunk, rows), std::min((rank + 1) * chunk, rows)};
}

ShardSlice row_slice(const FlatLayout& layout, const std::vector<int64_t>& rows, int64_t param, int64_t rank) {
  const int64_t numel = layout.param_numel(param);
  const int64_t n_rows = rows.at(param);
  if (numel == 0) return {};
  if (n_rows <= 0 || numel % n_rows != 0) {
    throw std::invalid_argument("row_slice: parameter " + std::to_string(param) + " of " + std::to_string(numel) +
                                " elements does not split into " + std::to_string(n_rows) + " rows");
  }
  const RowRange r = chunk_rows(n_rows, layout.world_size(), rank);
  const int64_t row_numel = numel / n_rows;
  ShardSlice s;
  s.param_offset = r.begin * row_numel;
  s.numel = (r.end - r.begin) * row_numel;
  return s;
}

RowExchangePlan row_exchange_plan(const FlatLayout& layout, const std::vector<int64_t>& rows, int64_t rank,
                                  ExchangeDirection direction, int64_t only) {
  const int64_t world = layout.world_size();
  const int64_t n = layout.num_params();
  if (static_cast<int64_t>(rows.size()) != n) {
    throw std::invalid_argument("row_exchange_plan: " + std::to_string(rows.size()) + " row counts for " +
                                std::to_string(n) + " parameters");
  }
  if (rank < 0 || rank >= world || only < -1 || only >= n) {
    throw std::invalid_argument("row_exchange_plan: rank " + std::to_string(rank) + " or parameter " +
                                std::to_string(only) + " out of range");
  }
  // The part of parameter i that rank r holds before (source) and after (destination).
  const bool to_rows = direction == ExchangeDirection::kToRows;
  auto source = [&](int64_t i, int64_t r) { return to_rows ? layout.shard_slice(i, r) : row_slice(layout, rows, i, r); };
  auto dest = [&](int64_t i, int64_t r) { return to_rows ? row_slice(layout, rows, i, r) : layout.shard_slice(i, r); };
  // Where src and dst overlap, as a piece: offsets relative to each part's start.
  auto overlap = [](const ShardSlice& src, const ShardSlice& dst, int64_t peer, int64_t i, std::vector<ExchangePiece>& out) {
    const int64_t lo = std::max(src.param_offset, dst.param_offset);
    const int64_t hi = std::min(src.param_offset + src.numel, dst.param_offset + dst.numel);
    if (hi <= lo) return int64_t{0};
    out.push_back({peer, i, lo - src.param_offset, lo - dst.param_offset, hi - lo});
    return hi - lo;
  };
  RowExchangePlan plan;
  plan.send_splits.assign(world, 0);
  plan.recv_splits.assign(world, 0);
  const int64_t first = only < 0 ? 0 : only, last = only < 0 ? n : only + 1;
  for (int64_t peer = 0; peer < world; ++peer) {
    for (int64_t i = first; i < last; ++i) {
      plan.send_splits[peer] += overlap(source(i, rank), dest(i, peer), peer, i, plan.send);
      plan.recv_splits[peer] += overlap(source(i, peer), dest(i, rank), peer, i, plan.recv);
    }
  }
  return plan;
}

}  // namespace mfsdp
