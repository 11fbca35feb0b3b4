// RowExchange: moving per-parameter values between our flat layout (each rank holds one
// contiguous range of the unit's flat buffer) and FSDP2's placement (each rank holds
// torch.chunk's rows of dim 0 of every parameter), in one all-to-all in which every
// element moves once. This is how state dicts give torch's helpers FSDP2's DTensors, and
// take them back, without gathering whole units: each rank receives 1/world of a unit,
// not all of it.
//
// Both placements cut each parameter into one contiguous flat range per rank, so the
// plan is pure interval arithmetic (no torch), the same on every rank.
#pragma once

#include <cstdint>
#include <vector>

#include "layout.h"

namespace mfsdp {

// Rows [begin, end) of a dimension of `rows` rows that `rank` of `world` holds under
// torch.chunk (FSDP2's Shard): chunks of ceil(rows / world) rows, the last ones short or
// empty.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
};
RowRange chunk_rows(int64_t rows, int64_t world, int64_t rank);

// One contiguous run of one parameter's elements exchanged with one peer.
struct ExchangePiece {
  int64_t peer = 0;
  int64_t param = 0;
  int64_t src_offset = 0;  // in the sender's part of the parameter
  int64_t dst_offset = 0;  // in the receiver's part of the parameter
  int64_t numel = 0;
};

struct RowExchangePlan {
  // Ordered by peer, then parameter: the order of the all-to-all's buffers.
  std::vector<ExchangePiece> send, recv;
  std::vector<int64_t> send_splits, recv_splits;  // elements per peer
};

enum class ExchangeDirection { kToRows, kFromRows };

// `rows[i]`: the length of dim 0 of parameter i (its elements split evenly into rows).
// kToRows: this rank's layout pieces go out, its torch.chunk rows come in; kFromRows the
// reverse. `only`: the one parameter to exchange, or -1 for all of them.
RowExchangePlan row_exchange_plan(const FlatLayout& layout, const std::vector<int64_t>& rows, int64_t rank,
                                  ExchangeDirection direction, int64_t only = -1);

// The elements of parameter i that `rank` holds under FSDP2's placement: its rows, as a
// range of the parameter's flattened elements.
ShardSlice row_slice(const FlatLayout& layout, const std::vector<int64_t>& rows, int64_t param, int64_t rank);

}  // namespace mfsdp
