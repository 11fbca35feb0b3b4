#include "cpu_optim.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "errors.h"

// Each chunk kernel is compiled once per instruction set and the loader picks the best
// (GCC function multiversioning); elsewhere it is compiled once for the baseline.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MFSDP_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MFSDP_SIMD_CLONES
#endif
#define MFSDP_INLINE inline __attribute__((always_inline))

namespace mfsdp {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements: four fp32 arrays of a chunk stay in L2

std::atomic<int> g_threads{0};

// Round to nearest even, as c10::BFloat16 does; written without branches on the value so
// that the loop vectorizes (a NaN becomes a quiet NaN).
MFSDP_INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

enum class CopyOut { kNone, kFloat, kBFloat16 };

struct AdamChunk {
  float* p;
  const float* g;
  float* m;
  float* v;
  void* out;
  int64_t n;
  // Per tensor: scalars as torch.optim.Adam(W) rounds them to float.
  float grad_scale;   // negative under maximize
  float decay_keep;   // AdamW: 1 - lr * weight_decay
  float l2;           // Adam: weight_decay added as l2 * p to the gradient
  float one_minus_b1, b2, one_minus_b2;
  float neg_step_size, bc2_sqrt, eps;
};

template <CopyOut kOut>
MFSDP_INLINE void adam_body(const AdamChunk& c) {
  // Everything in locals first: a store through `out` could otherwise alias the struct, and
  // the compiler would reload its fields every iteration instead of vectorizing.
  float* __restrict p = c.p;
  const float* __restrict g = c.g;
  float* __restrict m = c.m;
  float* __restrict v = c.v;
  float* __restrict out_f32 = static_cast<float*>(c.out);
  uint16_t* __restrict out_bf16 = static_cast<uint16_t*>(c.out);
  const int64_t n = c.n;
  const float grad_scale = c.grad_scale, decay_keep = c.decay_keep, l2w = c.l2;
  const float one_minus_b1 = c.one_minus_b1, b2 = c.b2, one_minus_b2 = c.one_minus_b2;
  const float neg_step_size = c.neg_step_size, bc2_sqrt = c.bc2_sqrt, eps = c.eps;
  // Terms torch skips when their factor is 0 are skipped too (0 * inf would be NaN); the
  // loop-invariant test is hoisted out of the loop by the compiler.
  const bool l2 = l2w != 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float param = p[i];
    float grad = g[i] * grad_scale;
    if (l2) grad += l2w * param;
    param = param * decay_keep;
    const float mi = m[i] + one_minus_b1 * (grad - m[i]);  // lerp(m, grad, 1 - beta1)
    const float vi = v[i] * b2 + (one_minus_b2 * grad) * grad;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    param = param + (neg_step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = param;
    if constexpr (kOut == CopyOut::kFloat) out_f32[i] = param;
    if constexpr (kOut == CopyOut::kBFloat16) out_bf16[i] = to_bf16(param);
  }
}

MFSDP_SIMD_CLONES void adam_chunk(const AdamChunk& c) { adam_body<CopyOut::kNone>(c); }
MFSDP_SIMD_CLONES void adam_chunk_f32(const AdamChunk& c) { adam_body<CopyOut::kFloat>(c); }
MFSDP_SIMD_CLONES void adam_chunk_bf16(const AdamChunk& c) { adam_body<CopyOut::kBFloat16>(c); }

struct SgdChunk {
  float* p;
  const float* g;
  float* buf;  // null without momentum
  void* out;
  int64_t n;
  float grad_scale;  // negative under maximize
  float weight_decay, momentum, one_minus_dampening, neg_lr;
  bool first, nesterov;
};

template <CopyOut kOut>
MFSDP_INLINE void sgd_body(const SgdChunk& c) {
  float* __restrict p = c.p;
  const float* __restrict g = c.g;
  float* __restrict buf = c.buf;
  float* __restrict out_f32 = static_cast<float*>(c.out);
  uint16_t* __restrict out_bf16 = static_cast<uint16_t*>(c.out);
  const int64_t n = c.n;
  const float grad_scale = c.grad_scale, weight_decay = c.weight_decay, momentum = c.momentum;
  const float one_minus_dampening = c.one_minus_dampening, neg_lr = c.neg_lr;
  const bool decay = weight_decay != 0.0f, first = c.first, nesterov = c.nesterov, has_buf = buf != nullptr;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] * grad_scale;
    if (decay) d += weight_decay * p[i];
    if (has_buf) {
      const float b = first ? d : buf[i] * momentum + one_minus_dampening * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    const float param = p[i] + neg_lr * d;
    p[i] = param;
    if constexpr (kOut == CopyOut::kFloat) out_f32[i] = param;
    if constexpr (kOut == CopyOut::kBFloat16) out_bf16[i] = to_bf16(param);
  }
}

MFSDP_SIMD_CLONES void sgd_chunk(const SgdChunk& c) { sgd_body<CopyOut::kNone>(c); }
MFSDP_SIMD_CLONES void sgd_chunk_f32(const SgdChunk& c) { sgd_body<CopyOut::kFloat>(c); }
MFSDP_SIMD_CLONES void sgd_chunk_bf16(const SgdChunk& c) { sgd_body<CopyOut::kBFloat16>(c); }

// Runs fn(0..count-1) on up to cpu_optim_threads() threads, the caller among them. Plain
// threads, not at::parallel_for: its OpenMP loop is inlined into the caller, and this
// extension does not link a second OpenMP runtime beside torch's.
template <typename F>
void run_chunks(int64_t count, F&& fn) {
  const int64_t threads = std::min<int64_t>(cpu_optim_threads(), count);
  if (threads <= 1) {
    for (int64_t c = 0; c < count; ++c) fn(c);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&] {
    try {
      for (int64_t c; (c = next.fetch_add(1)) < count;) fn(c);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(count);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

void check_tensor(const at::Tensor& t, int64_t numel, const char* what, size_t i, bool allow_bf16 = false) {
  MFSDP_CHECK_VALUE(t.defined(), "CPU optimizer: ", what, " of tensor ", static_cast<int64_t>(i), " is missing");
  MFSDP_CHECK_VALUE(t.device().is_cpu(), "CPU optimizer: ", what, " of tensor ", static_cast<int64_t>(i),
                    " is on ", t.device(), "; it steps host tensors (offloaded shards)");
  MFSDP_CHECK_VALUE(t.scalar_type() == at::kFloat || (allow_bf16 && t.scalar_type() == at::kBFloat16),
                    "CPU optimizer: ", what, " of tensor ", static_cast<int64_t>(i), " is ", t.scalar_type(),
                    "; it steps float32 master weights", allow_bf16 ? " (copy-outs: float32 or bfloat16)" : "");
  MFSDP_CHECK_VALUE(t.is_contiguous(), "CPU optimizer: ", what, " of tensor ", static_cast<int64_t>(i),
                    " is not contiguous");
  MFSDP_CHECK_VALUE(t.numel() == numel, "CPU optimizer: ", what, " of tensor ", static_cast<int64_t>(i), " has ",
                    t.numel(), " elements, its parameter ", numel);
}

struct Span {
  size_t tensor;
  int64_t begin, n;
};

std::vector<Span> spans_of(const std::vector<at::Tensor>& params) {
  std::vector<Span> spans;
  for (size_t i = 0; i < params.size(); ++i) {
    for (int64_t b = 0; b < params[i].numel(); b += kChunk) {
      spans.push_back({i, b, std::min(kChunk, params[i].numel() - b)});
    }
  }
  return spans;
}

CopyOut copy_kind(const at::Tensor& out) {
  if (!out.defined()) return CopyOut::kNone;
  return out.scalar_type() == at::kBFloat16 ? CopyOut::kBFloat16 : CopyOut::kFloat;
}

template <typename T>
T* offset_ptr(void* base, int64_t begin) {
  return static_cast<T*>(base) + begin;
}

// Every span of every tensor through the kernel matching the tensor's copy-out: `base[i]`
// holds tensor i's pointers and scalars, `advance(chunk, begin)` moves its arrays (all but
// the copy-out, moved here) to the span's first element.
template <typename Chunk, typename Advance>
void run_spans(const std::vector<at::Tensor>& params, const std::vector<Chunk>& base,
               const std::vector<at::Tensor>& copy_outs, void (*none)(const Chunk&), void (*to_f32)(const Chunk&),
               void (*to_bf16)(const Chunk&), Advance advance) {
  const auto spans = spans_of(params);
  run_chunks(static_cast<int64_t>(spans.size()), [&](int64_t k) {
    const Span& s = spans[k];
    Chunk c = base[s.tensor];
    advance(c, s.begin);
    c.n = s.n;
    const CopyOut kind = c.out == nullptr ? CopyOut::kNone : copy_kind(copy_outs[s.tensor]);
    if (kind == CopyOut::kBFloat16) {
      c.out = offset_ptr<uint16_t>(c.out, s.begin);
      to_bf16(c);
    } else if (kind == CopyOut::kFloat) {
      c.out = offset_ptr<float>(c.out, s.begin);
      to_f32(c);
    } else {
      none(c);
    }
  });
}

}  // namespace

int cpu_optim_threads() {
  const int t = g_threads.load();
  return t > 0 ? t : std::max(1, at::get_num_threads());
}

void set_cpu_optim_threads(int threads) {
  MFSDP_CHECK_VALUE(threads >= 0, "set_cpu_optim_threads: ", threads, " threads (0: torch's intra-op count)");
  g_threads.store(threads);
}

void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
               const std::vector<at::Tensor>& copy_outs, const std::vector<int64_t>& steps, const AdamHyper& h,
               double grad_scale) {
  const size_t n = params.size();
  MFSDP_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                        (copy_outs.empty() || copy_outs.size() == n),
                    "adam_step: lists of different lengths");
  MFSDP_CHECK_VALUE(h.lr >= 0 && h.eps >= 0 && h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1,
                    "adam_step: invalid hyperparameters (lr ", h.lr, ", betas (", h.beta1, ", ", h.beta2, "), eps ",
                    h.eps, ")");
  std::vector<AdamChunk> base(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    check_tensor(params[i], numel, "the parameter", i);
    check_tensor(grads[i], numel, "the gradient", i);
    check_tensor(exp_avgs[i], numel, "exp_avg", i);
    check_tensor(exp_avg_sqs[i], numel, "exp_avg_sq", i);
    const at::Tensor out = copy_outs.empty() ? at::Tensor() : copy_outs[i];
    if (out.defined()) check_tensor(out, numel, "the copy-out", i, /*allow_bf16=*/true);
    MFSDP_CHECK_VALUE(steps[i] >= 1, "adam_step: step ", steps[i], " of tensor ", static_cast<int64_t>(i),
                      " (counts from 1)");
    const double step = static_cast<double>(steps[i]);
    const double bc1 = 1.0 - std::pow(h.beta1, step);
    const double bc2 = 1.0 - std::pow(h.beta2, step);
    AdamChunk& c = base[i];
    c.p = params[i].data_ptr<float>();
    c.g = grads[i].const_data_ptr<float>();
    c.m = exp_avgs[i].data_ptr<float>();
    c.v = exp_avg_sqs[i].data_ptr<float>();
    c.out = out.defined() ? out.data_ptr() : nullptr;
    c.grad_scale = static_cast<float>(h.maximize ? -grad_scale : grad_scale);
    c.decay_keep = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
    c.l2 = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
    c.one_minus_b1 = static_cast<float>(1.0 - h.beta1);
    c.b2 = static_cast<float>(h.beta2);
    c.one_minus_b2 = static_cast<float>(1.0 - h.beta2);
    c.neg_step_size = static_cast<float>(-(h.lr / bc1));
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.eps = static_cast<float>(h.eps);
  }
  run_spans(params, base, copy_outs, &adam_chunk, &adam_chunk_f32, &adam_chunk_bf16, [](AdamChunk& c, int64_t at) {
    c.p += at;
    c.g += at;
    c.m += at;
    c.v += at;
  });
}

void sgd_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<at::Tensor>& momentum_buffers, const std::vector<at::Tensor>& copy_outs,
              const std::vector<bool>& first, const SgdHyper& h, double grad_scale) {
  const size_t n = params.size();
  const bool momentum = h.momentum != 0.0;
  MFSDP_CHECK_VALUE(grads.size() == n && (copy_outs.empty() || copy_outs.size() == n) &&
                        (!momentum || (momentum_buffers.size() == n && first.size() == n)),
                    "sgd_step: lists of different lengths");
  MFSDP_CHECK_VALUE(!h.nesterov || (momentum && h.dampening == 0.0),
                    "sgd_step: Nesterov momentum requires a momentum and zero dampening");
  std::vector<SgdChunk> base(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    check_tensor(params[i], numel, "the parameter", i);
    check_tensor(grads[i], numel, "the gradient", i);
    if (momentum) check_tensor(momentum_buffers[i], numel, "the momentum buffer", i);
    const at::Tensor out = copy_outs.empty() ? at::Tensor() : copy_outs[i];
    if (out.defined()) check_tensor(out, numel, "the copy-out", i, /*allow_bf16=*/true);
    SgdChunk& c = base[i];
    c.p = params[i].data_ptr<float>();
    c.g = grads[i].const_data_ptr<float>();
    c.buf = momentum ? momentum_buffers[i].data_ptr<float>() : nullptr;
    c.out = out.defined() ? out.data_ptr() : nullptr;
    c.grad_scale = static_cast<float>(h.maximize ? -grad_scale : grad_scale);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.momentum = static_cast<float>(h.momentum);
    c.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
    c.neg_lr = static_cast<float>(-h.lr);
    c.first = momentum && first[i];
    c.nesterov = h.nesterov;
  }
  run_spans(params, base, copy_outs, &sgd_chunk, &sgd_chunk_f32, &sgd_chunk_bf16, [](SgdChunk& c, int64_t at) {
    c.p += at;
    c.g += at;
    if (c.buf != nullptr) c.buf += at;
  });
}

}  // namespace mfsdp
