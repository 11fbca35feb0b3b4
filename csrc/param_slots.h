// ParamSlots: every (module._parameters, name) entry that holds a parameter of a unit
// (tied parameters have several), and the swap between the unit's sharded and unsharded
// nn.Parameter objects in those entries. The objects are the unit's own
// (Unit::sharded_params / unsharded_params): nothing here holds them. use() and
// release() do one hook's whole C++ part in one call, so a hook costs O(1) Python.
#pragma once

#include "errors.h"
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <vector>

#include "unit.h"

namespace mfsdp {

namespace py = pybind11;

class ParamSlots {
 public:
  // `unit` null: a state without parameters (no slots; use() only gathers others).
  explicit ParamSlots(std::shared_ptr<Unit> unit) : unit_(std::move(unit)) {}
  void add(py::dict params_dict, py::str name, int64_t param_index);
  // Put the unsharded (or sharded) objects into every slot. A slot holding neither
  // object was re-assigned by the user: it is left alone and its index returned.
  // Installing the unsharded objects first gives each the sharded one's requires_grad;
  // a requires_grad the user changed on an installed unsharded object goes to the
  // sharded one first.
  std::vector<int64_t> install(bool unsharded);
  // Before a use of the unit: all-gather `gathers` (itself and prefetch targets;
  // Unit::unshard_all), wait for this unit's gather and install the unsharded objects.
  // Returns the re-assigned slots, as install() does.
  std::vector<int64_t> use(const std::vector<Unit*>& gathers, bool bucketed);
  // After a use: free the unsharded storage and install the sharded objects; with
  // `keep_unsharded` (the strategy keeps the copy, or backward keeps it) the storage
  // stays and the slots change only if they hold the unsharded objects; with
  // `keep_post_forward` the unit keeps its post-forward copy (Unit::reshard).
  std::vector<int64_t> release(bool keep_unsharded, bool keep_post_forward = false);
  // Which objects the slots were last given (the sharded ones until the first install).
  bool holds_unsharded() const { return holds_unsharded_; }
  int64_t size() const { return static_cast<int64_t>(slots_.size()); }
  int64_t param_index(int64_t slot) const { return slots_.at(slot).index; }
  py::dict params_dict(int64_t slot) const { return slots_.at(slot).dict; }
  py::str name(int64_t slot) const { return slots_.at(slot).name; }

 private:
  struct Slot {
    py::dict dict;
    py::str name;
    int64_t index;
  };
  std::shared_ptr<Unit> unit_;
  std::vector<Slot> slots_;
  bool holds_unsharded_ = false;
  // requires_grad each unsharded object was given at the last install of them: a change
  // since is the user's, made while the slots held them.
  std::vector<char> given_requires_grad_;
};

}  // namespace mfsdp
