// The post-backward marker: an autograd node between a unit's forward inputs and the
// unit, identity in forward. Its backward runs once the unit's whole backward is done
// (the inputs' gradients are the last thing the unit produces) and notifies Python with
// the unit's key. A plain C++ autograd Node, not a (Python or C++) custom Function: no
// ctx, no saved state, no gradient materialization; one GIL acquisition per backward call.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace mfsdp {

namespace py = pybind11;

// The Python callable that receives the key of a unit whose backward finished. Set once
// per process; every node calls it (with the GIL) from the autograd thread.
void set_post_backward_callback(py::object callback);

// `inputs` through the marker node: views whose backward notifies `key` (pass only
// inputs that need a gradient). A subclass with only __torch_function__ comes back as a
// plain tensor: the caller restores its type.
std::vector<at::Tensor> mark_post_backward(int64_t key, const std::vector<at::Tensor>& inputs);

}  // namespace mfsdp
