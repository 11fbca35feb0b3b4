#include "param_slots.h"

#include <torch/csrc/autograd/python_variable.h>

namespace mfsdp {

namespace {
// The tensor behind a slot's entry, or null when it holds no tensor (or is missing). A
// TensorImpl has at most one Python object, so comparing impls compares the objects.
const c10::TensorImpl* impl_of(PyObject* entry) {
  return entry != nullptr && THPVariable_Check(entry) ? THPVariable_Unpack(entry).unsafeGetTensorImpl() : nullptr;
}
}  // namespace

void ParamSlots::add(py::dict params_dict, py::str name, int64_t param_index) {
  MFSDP_CHECK(unit_ != nullptr, "ParamSlots.add: no unit (a state without parameters has no slots)");
  MFSDP_CHECK(param_index >= 0, "ParamSlots.add: parameter index ", param_index, " is negative");
  const int64_t n = unit_->layout().num_params();
  MFSDP_CHECK(param_index < n, "ParamSlots.add: parameter index ", param_index, " is past the ", n,
              " parameters of unit '", unit_->label(), "'");
  slots_.push_back({std::move(params_dict), std::move(name), param_index});
}

std::vector<int64_t> ParamSlots::install(bool unsharded) {
  MFSDP_CHECK(unit_ != nullptr, "ParamSlots.install: no unit (a state without parameters has nothing to install)");
  unit_->check_bound("ParamSlots.install");
  const auto& sharded = unit_->sharded_params();
  const auto& gathered = unit_->unsharded_params();
  if (holds_unsharded_ && given_requires_grad_.size() == sharded.size()) {
    // While the slots held the unsharded objects (a unit that keeps them after forward,
    // the root), those are the parameters the user saw: one frozen or unfrozen then
    // (between forward and backward) is frozen or unfrozen for good, as on a plain module.
    for (size_t i = 0; i < sharded.size(); ++i) {
      const bool now = gathered[i].requires_grad();
      if (now != static_cast<bool>(given_requires_grad_[i])) {
        at::Tensor s = sharded[i];
        s.set_requires_grad(now);
      }
    }
  }
  if (unsharded) {
    // The user freezes and unfreezes the parameters they see (the sharded ones); the
    // unsharded ones autograd sees follow at every install, so a frozen parameter gets no
    // gradient and an unfrozen one gets one again.
    given_requires_grad_.assign(sharded.size(), 0);
    for (size_t i = 0; i < sharded.size(); ++i) {
      const bool wanted = sharded[i].requires_grad();
      at::Tensor u = gathered[i];
      if (u.requires_grad() != wanted) u.set_requires_grad(wanted);
      given_requires_grad_[i] = wanted;
    }
  }
  holds_unsharded_ = unsharded;
  std::vector<int64_t> replaced;
  const auto& want = unsharded ? gathered : sharded;
  const auto& other = unsharded ? sharded : gathered;
  for (size_t k = 0; k < slots_.size(); ++k) {
    auto& s = slots_[k];
    const c10::TensorImpl* cur = impl_of(PyDict_GetItem(s.dict.ptr(), s.name.ptr()));  // borrowed
    const at::Tensor& target = want[s.index];
    if (cur == target.unsafeGetTensorImpl()) continue;
    if (cur != other[s.index].unsafeGetTensorImpl()) {
      replaced.push_back(static_cast<int64_t>(k));
      continue;
    }
    // The tensor's own Python object (created as an nn.Parameter by make_unit).
    py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(target));
    if (!obj || PyDict_SetItem(s.dict.ptr(), s.name.ptr(), obj.ptr()) != 0) throw py::error_already_set();
  }
  return replaced;
}

std::vector<int64_t> ParamSlots::use(const std::vector<Unit*>& gathers, bool bucketed) {
  {
    // Waiting on a collective: a Gloo worker finishing an earlier one may need the GIL.
    py::gil_scoped_release no_gil;
    Unit::unshard_all(gathers, bucketed);
    if (unit_) unit_->wait_unshard();
  }
  if (!unit_) return {};
  return install(/*unsharded=*/true);
}

std::vector<int64_t> ParamSlots::release(bool keep_unsharded, bool keep_post_forward) {
  if (!unit_) return {};
  if (keep_unsharded) {
    if (!holds_unsharded_) return {};
  } else {
    py::gil_scoped_release no_gil;
    unit_->reshard(keep_post_forward);
  }
  return install(/*unsharded=*/false);
}

}  // namespace mfsdp
