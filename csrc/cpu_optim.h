// The CPU optimizer step for offloaded shards (megatron_fsdp_ext.optim): Adam/AdamW and
// SGD over fp32 master weights held in host memory.
//
// One call steps every tensor of a parameter group: the elements are cut into fixed
// chunks shared out to threads, and each chunk is one pass over its arrays (read the
// parameter, gradient and state once, write them once), compiled for AVX-512, AVX2+FMA and
// a baseline, the best picked at load time. The same pass can scale the gradient (a
// clipping coefficient) and write the updated weight in the gather dtype (`copy_outs`), so
// the next all-gather copies it to the device as it is: passes torch's optimizer plus
// clip_grad_norm_ and the cast would each make over all of memory.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace mfsdp {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;  // AdamW; false: Adam's L2 term added to the gradient
  bool maximize = false;
};

struct SgdHyper {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// One Adam(W) step, as torch.optim.Adam(W) computes it, for tensor i: its gradient read
// times `grad_scale`, `steps[i]` the step count including this step. Every tensor is a
// contiguous float32 host tensor of one size per i; copy_outs[i] (undefined: none) a
// contiguous float32 or bfloat16 host tensor of that size.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& copy_outs, const std::vector<int64_t>& steps, const AdamHyper& hyper,
               double grad_scale);

// One SGD step, as torch.optim.SGD computes it. momentum_buffers[i] is defined when
// momentum is on; `first[i]` says the buffer is new (it takes the gradient, as torch's
// clone does).
void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& copy_outs,
              const std::vector<bool>& first, const SgdHyper& hyper, double grad_scale);

// The threads a step runs on (at::get_num_threads() by default).
int cpu_optim_threads();
void set_cpu_optim_threads(int threads);

}  // namespace mfsdp
