#include "post_backward.h"

#include <torch/csrc/autograd/custom_function.h>

#include "errors.h"

namespace mfsdp {

namespace {

// Never destroyed: the interpreter may be gone by the time static destructors run.
py::object* callback_slot() {
  static auto* slot = new py::object();
  return slot;
}

struct PostBackwardMarker : public torch::autograd::Function<PostBackwardMarker> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, int64_t key,
                                                at::TensorList inputs) {
    ctx->saved_data["key"] = key;
    ctx->set_materialize_grads(false);  // undefined gradients pass through as they are
    return inputs.vec();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const int64_t key = ctx->saved_data["key"].toInt();
    {
      py::gil_scoped_acquire gil;
      (*callback_slot())(key);
    }
    torch::autograd::variable_list out;
    out.reserve(grads.size() + 1);
    out.emplace_back();  // the key
    for (auto& g : grads) out.push_back(std::move(g));
    return out;
  }
};

}  // namespace

void set_post_backward_callback(py::object callback) { *callback_slot() = std::move(callback); }

std::vector<at::Tensor> mark_post_backward(int64_t key, const std::vector<at::Tensor>& inputs) {
  MFSDP_CHECK(!callback_slot()->is_none() && callback_slot()->ptr() != nullptr,
              "mark_post_backward: no post-backward callback is set (internal error)");
  return PostBackwardMarker::apply(key, at::TensorList(inputs));
}

}  // namespace mfsdp
