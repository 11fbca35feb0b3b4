#include "post_backward.h"

#include <ATen/FuncTorchTLS.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <type_traits>

#include "errors.h"

namespace mfsdp {

namespace {

namespace autograd = torch::autograd;

// Never destroyed: the interpreter may be gone by the time static destructors run.
py::object* callback_slot() {
  static auto* slot = new py::object();
  return slot;
}

// The marker's backward: the gradients pass through untouched (undefined ones too), and
// the callback learns the unit's key. A plain autograd Node, not a custom Function: the
// custom Function's backward wrapper (saved-state copy, gradient materialization, output
// checks) cost more than the callback itself, once per unit per backward.
struct PostBackwardNode : public autograd::Node {
  explicit PostBackwardNode(int64_t key) : key_(key) {}

  // Compiled autograd refuses the node by this name (it has no compiled form: a unit's
  // reduction is a side effect a graph cannot hold; forward_hooks.py refuses the global
  // switch with an explanation).
  std::string name() const override { return "mfsdp::PostBackwardMarker"; }

  autograd::variable_list apply(autograd::variable_list&& grads) override {
    {
      py::gil_scoped_acquire gil;
      (*callback_slot())(key_);
    }
    return std::move(grads);
  }

  const int64_t key_;
};

// torch holds autograd nodes by std::shared_ptr in some versions and c10::intrusive_ptr
// in others: make the node the way this torch's Edge holds it.
using NodePtr = decltype(autograd::Edge::function);

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

}  // namespace

void set_post_backward_callback(py::object callback) { *callback_slot() = std::move(callback); }

std::vector<at::Tensor> mark_post_backward(int64_t key, const std::vector<at::Tensor>& inputs) {
  MFSDP_CHECK(!callback_slot()->is_none() && callback_slot()->ptr() != nullptr,
              "mark_post_backward: no post-backward callback is set (internal error)");
  // As for a custom Function: under torch.func transforms the unit's reduction would run
  // on gradients that never reach .grad, so the transforms are refused here, loudly.
  if (const auto& functorch = at::functorch::functorchTLSAccessor()) functorch->checkSupportsCppAutogradFunction();
  bool any_requires_grad = false;
  for (const auto& t : inputs) {
    MFSDP_CHECK(t.defined(), "mark_post_backward: an input is undefined");
    MFSDP_CHECK(!autograd::isFwGradDefined(t), "a fully_shard unit's input carries a forward-mode (dual) gradient: "
                "forward-mode AD through fully_shard units is not supported");
    any_requires_grad = any_requires_grad || t.requires_grad();
  }
  if (!at::GradMode::is_enabled() || !any_requires_grad) return inputs;
  NodePtr node = make_node<PostBackwardNode>(key);
  node->set_next_edges(autograd::collect_next_edges(inputs));
  std::vector<at::Tensor> outputs;
  outputs.reserve(inputs.size());
  for (const auto& input : inputs) {
    // As a custom Function returns an input: a view of it, made without grad, whose
    // history is the node. An in-place write to the view then fails loudly: autograd
    // could not rebuild the input's history through the node (the same rule, and error
    // class, as for any custom Function's output that is an input).
    at::Tensor output;
    {
      at::AutoFwGradMode no_forward_grad(false);
      at::AutoGradMode no_grad(false);
      output = input.view_as(input);
    }
    if (output.is_view()) {
      autograd::impl::get_view_autograd_meta(output)->set_creation_meta(autograd::CreationMeta::IN_CUSTOM_FUNCTION);
    }
    autograd::set_history(output, node);
    outputs.push_back(std::move(output));
  }
  return outputs;
}

}  // namespace mfsdp
