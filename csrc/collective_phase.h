// What a unit's collective is for: named in errors, compared across ranks by the
// collective check (Unit::set_check_collectives).
#pragma once

namespace mfsdp {

enum class CollectivePhase {
  kAllGatherParams = 0,
  kReduceScatterGrads = 1,
  kAllReduceGrads = 2,
  kAllGatherFullParams = 3,
  kAllReduceReplicas = 4,  // HSDP: reduced gradient shards across the replicas
  kExchangeRows = 5,       // state dicts: our layout pieces <-> FSDP2's rows (row_exchange.h)
  kAllReduceFp8Amax = 6,   // FP8 gather: every FP8 parameter's amax, max over the ranks
  kAllReduceGradMask = 7,  // which parameters got a gradient on any rank (Unit::agree_on_grads)
  kAllGatherPostForward = 8,  // reshard_after_forward=int: the post-forward pieces, over the smaller group
};
const char* phase_name(CollectivePhase phase);

}  // namespace mfsdp
