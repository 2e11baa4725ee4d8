// What the optimizer needs of gradients and parameters that tch does not expose: dropping a
// parameter's gradient (`p.grad = None` in PyTorch; tch's zero_grad only zeroes in place, and
// torchtitan's optimizers zero grads with set_to_none=True, so the next backward hands its fresh
// gradient buffer to the parameter instead of memsetting the old one and adding into it), adding
// into it outside autograd, and torch's fused AdamW kernel.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_fused_adamw.h>
#include <c10/core/GradMode.h>

#include "shim_error.h"

extern "C" {

// `tensor` is a tch C_tensor, i.e. an `at::Tensor*`. Returns 0, or 1 with `*err` (shim_error.h).
int titan_clear_grad(void* tensor, char** err) {
  return titan_shim::guarded(
      err, [&] { reinterpret_cast<at::Tensor*>(tensor)->mutable_grad().reset(); });
}

// `tensor.grad += grad` outside autograd, or `tensor.grad = grad` when it has none: how FSDP's
// reduce-scattered gradients reach their shards once the background collective is done.
int titan_accumulate_grad(void* tensor, void* grad, char** err) {
  return titan_shim::guarded(err, [&] {
    auto& t = *reinterpret_cast<at::Tensor*>(tensor);
    const auto& g = *reinterpret_cast<at::Tensor*>(grad);
    c10::AutoGradMode no_grad(false);
    auto& slot = t.mutable_grad();
    if (slot.defined()) {
      slot.add_(g);
    } else {
      slot = g;
    }
  });
}

}  // extern "C"

extern "C" {

// One parameter's step of torch's fused AdamW kernel (`torch._fused_adamw_`, what torchtitan's
// default `optimizer.implementation = "fused"` runs, on CPU and CUDA). `step` is the parameter's
// float step count, already incremented (torch increments it before calling the kernel). All
// tensors are tch C_tensors. Returns 0, or 1 with `*err` (shim_error.h).
int titan_fused_adamw(void* param, void* grad, void* exp_avg, void* exp_avg_sq, void* step,
                      double lr, double beta1, double beta2, double weight_decay, double eps,
                      char** err) {
  return titan_shim::guarded(err, [&] {
    auto t = [](void* p) { return *reinterpret_cast<at::Tensor*>(p); };
    c10::AutoGradMode no_grad(false);
    at::_fused_adamw_({t(param)}, {t(grad)}, {t(exp_avg)}, {t(exp_avg_sq)}, {}, {t(step)}, lr,
                      beta1, beta2, weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
  });
}

}  // extern "C"
