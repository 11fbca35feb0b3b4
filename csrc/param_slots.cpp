#include "param_slots.h"

#include <torch/csrc/autograd/python_variable.h>

namespace mfsdp {

void ParamSlots::add(py::dict params_dict, py::str name, int64_t param_index) {
  MFSDP_CHECK(param_index >= 0, "ParamSlots.add: parameter index ", param_index, " is negative");
  MFSDP_CHECK(!objects_set_ || param_index < static_cast<int64_t>(sharded_.size()), "ParamSlots.add: parameter index ",
              param_index, " is past the ", sharded_.size(), " parameters given to set_objects");
  slots_.push_back({std::move(params_dict), std::move(name), param_index});
}

void ParamSlots::set_objects(std::vector<py::object> sharded, std::vector<py::object> unsharded) {
  MFSDP_CHECK(sharded.size() == unsharded.size(), "ParamSlots: ", sharded.size(),
              " sharded vs ", unsharded.size(), " unsharded objects");
  for (const auto& s : slots_) {
    MFSDP_CHECK(s.index >= 0 && s.index < static_cast<int64_t>(sharded.size()),
                "ParamSlots: slot index ", s.index, " out of range");
  }
  sharded_ = std::move(sharded);
  unsharded_ = std::move(unsharded);
  objects_set_ = true;
}

std::vector<int64_t> ParamSlots::install(bool unsharded) {
  MFSDP_CHECK(objects_set_, "ParamSlots.install: set_objects was not called");
  if (unsharded) {
    // The user freezes and unfreezes the parameters they see (the sharded ones); the
    // unsharded ones autograd sees follow at every install, so a frozen parameter gets no
    // gradient and an unfrozen one gets one again.
    for (size_t i = 0; i < sharded_.size(); ++i) {
      const bool wanted = THPVariable_Unpack(sharded_[i].ptr()).requires_grad();
      at::Tensor u = THPVariable_Unpack(unsharded_[i].ptr());
      if (u.requires_grad() != wanted) u.set_requires_grad(wanted);
    }
  }
  std::vector<int64_t> replaced;
  const auto& want = unsharded ? unsharded_ : sharded_;
  const auto& other = unsharded ? sharded_ : unsharded_;
  for (size_t k = 0; k < slots_.size(); ++k) {
    auto& s = slots_[k];
    PyObject* cur = PyDict_GetItem(s.dict.ptr(), s.name.ptr());  // borrowed
    PyObject* target = want[s.index].ptr();
    if (cur == target) continue;
    if (cur != other[s.index].ptr()) {
      replaced.push_back(static_cast<int64_t>(k));
      continue;
    }
    if (PyDict_SetItem(s.dict.ptr(), s.name.ptr(), target) != 0) throw py::error_already_set();
  }
  return replaced;
}

}  // namespace mfsdp
