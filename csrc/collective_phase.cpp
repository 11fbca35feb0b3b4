#include "collective_phase.h"

namespace mfsdp {

const char* phase_name(CollectivePhase phase) {
  switch (phase) {
    case CollectivePhase::kAllGatherParams: return "all-gather of parameters";
    case CollectivePhase::kReduceScatterGrads: return "reduce-scatter of gradients";
    case CollectivePhase::kAllReduceGrads: return "all-reduce of gradients";
    case CollectivePhase::kAllGatherFullParams: return "all-gather of full parameters";
    case CollectivePhase::kAllReduceReplicas: return "all-reduce of gradient shards across replicas";
    case CollectivePhase::kExchangeRows: return "exchange of state-dict rows";
    case CollectivePhase::kAllReduceFp8Amax: return "all-reduce(max) of FP8 weight amaxes";
    case CollectivePhase::kAllReduceGradMask: return "all-reduce(max) of which parameters got gradients";
    case CollectivePhase::kAllGatherPostForward: return "all-gather of parameters kept after forward";
  }
  return "collective";
}

}  // namespace mfsdp
