// Which units share one coalesced collective (a bucket): Unit::unshard_together and
// Unit::reduce_together split their units with split_for_coalescing.
#pragma once

#include "errors.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace mfsdp {

// Splits `units` for one coalesced collective: those `needed` (a unit listed twice
// counts once), divided into the ones that may share it with the first such unit
// (`eligible`, `compatible` with it) and the rest. A lone candidate joins the rest:
// it is served by the unit's own collective.
template <typename T, typename Needed, typename Eligible, typename Compatible>
std::pair<std::vector<T*>, std::vector<T*>> split_for_coalescing(const std::vector<T*>& units, const char* what,
                                                                Needed needed, Eligible eligible,
                                                                Compatible compatible) {
  std::vector<T*> together, alone;
  for (size_t i = 0; i < units.size(); ++i) {
    T* u = units[i];
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

}  // namespace mfsdp
