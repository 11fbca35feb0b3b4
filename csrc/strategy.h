// What a sharding strategy means, defined once. The unit, and through the bindings every
// Python module (options, fully_shard, state dicts, checkpoints, clipping, the memory
// estimator), ask this table instead of comparing strategy names.
#pragma once

#include <array>
#include <stdexcept>
#include <string>

namespace mfsdp {

// What is sharded across the group (Megatron-FSDP's names).
//   kNoShard          params and grads replicated; grads all-reduced; no gather at all
//   kOptim            ZeRO-1: full grads (all-reduced); params stay unsharded between steps
//   kOptimGrads       ZeRO-2: grads reduce-scattered; params stay unsharded between steps
//   kOptimGradsParams ZeRO-3: grads reduce-scattered; params gathered per use, then freed
enum class ShardingStrategy { kNoShard = 0, kOptim = 1, kOptimGrads = 2, kOptimGradsParams = 3 };

struct StrategyTraits {
  ShardingStrategy strategy;
  const char* name;  // Megatron-FSDP's name, as fully_shard(sharding_strategy=...) takes it
  // Every rank holds every parameter (and its optimizer state) in full: nothing is
  // gathered, the shard index is 0 on every rank, and checkpoints write one copy.
  bool replicated;
  // The unsharded parameters stay allocated between uses (gathered again only after the
  // shards changed); false: freed after each use and gathered for the next (ZeRO-3),
  // which is also what reshard_after_forward defaults to.
  bool keeps_unsharded;
  // Gradients are all-reduced in full (every rank sees the whole gradient, then keeps
  // its segment); false: reduce-scattered. Full-gradient units reduce one at a time,
  // never in a shared reduce bucket.
  bool full_grads;
  // Parameters are all-gathered before use: sharded and not replicated.
  constexpr bool gathers() const { return !replicated; }
  // A gathered copy is kept between uses (optim, optim_grads): memory the estimator counts.
  constexpr bool keeps_gathered() const { return gathers() && keeps_unsharded; }
};

inline constexpr std::array<StrategyTraits, 4> kStrategies{{
    {ShardingStrategy::kNoShard, "no_shard", /*replicated=*/true, /*keeps_unsharded=*/true, /*full_grads=*/true},
    {ShardingStrategy::kOptim, "optim", false, true, true},
    {ShardingStrategy::kOptimGrads, "optim_grads", false, true, false},
    {ShardingStrategy::kOptimGradsParams, "optim_grads_params", false, false, false},
}};

constexpr const StrategyTraits& traits(ShardingStrategy s) { return kStrategies[static_cast<int>(s)]; }

constexpr bool table_follows_enum() {
  for (size_t i = 0; i < kStrategies.size(); ++i)
    if (static_cast<size_t>(kStrategies[i].strategy) != i) return false;
  return true;
}
static_assert(table_follows_enum(), "kStrategies must list the strategies in enum order");

// The strategy called `name`; an unknown name raises listing the known ones.
inline ShardingStrategy strategy_from_name(const std::string& name) {
  std::string known;
  for (const auto& t : kStrategies) {
    if (name == t.name) return t.strategy;
    known += std::string(known.empty() ? "" : ", ") + "'" + t.name + "'";
  }
  throw std::invalid_argument("unknown sharding_strategy '" + name + "'; choose from " + known);
}

}  // namespace mfsdp
