// ParamSlots: every (module._parameters, name) entry that holds a parameter of a unit
// (tied parameters have several), and the swap between the unit's sharded and unsharded
// nn.Parameter objects in those entries. The objects are the unit's own
// (Unit::sharded_params / unsharded_params): nothing here holds them. Done in C++ so a
// hook costs O(1) Python.
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
  // `unit` null: a state without parameters (no slots).
  explicit ParamSlots(std::shared_ptr<Unit> unit) : unit_(std::move(unit)) {}
  void add(py::dict params_dict, py::str name, int64_t param_index);
  // Put the unsharded (or sharded) objects into every slot. A slot holding neither
  // object was re-assigned by the user: it is left alone and its index returned.
  // Installing the unsharded objects first gives each the sharded one's requires_grad.
  std::vector<int64_t> install(bool unsharded);
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
};

}  // namespace mfsdp
