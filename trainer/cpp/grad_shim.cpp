// What the optimizer needs of gradients and parameters that tch does not expose: dropping a
// parameter's gradient (`p.grad = None` in PyTorch; tch's zero_grad only zeroes in place, and
// torchtitan's optimizers zero grads with set_to_none=True, so the next backward hands its fresh
// gradient buffer to the parameter instead of memsetting the old one and adding into it), adding
// into it outside autograd, torch's fused AdamW kernel over a group of parameters, and the
// multi-tensor norm and scale gradient clipping runs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/stack.h>
#include <c10/core/GradMode.h>

#include <vector>

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

// One step of torch's fused AdamW kernel (`torch._fused_adamw_`, what torchtitan's default
// `optimizer.implementation = "fused"` runs, on CPU and CUDA) over `n` parameters at once, as
// torch's optimizer calls it per (device, dtype) group: one launch sequence for the whole group
// instead of one per parameter. `step` is the group's float step count, already incremented
// (torch increments before calling the kernel); every parameter of a group has the same count,
// so one tensor serves them all (the kernel only reads it). All tensors are tch C_tensors.
// Returns 0, or 1 with `*err` (shim_error.h).
int titan_fused_adamw(void** params, void** grads, void** exp_avgs, void** exp_avg_sqs,
                      void* step, int64_t n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, char** err) {
  return titan_shim::guarded(err, [&] {
    auto list = [n](void** ps) {
      std::vector<at::Tensor> out;
      out.reserve(n);
      for (int64_t i = 0; i < n; ++i) out.push_back(*reinterpret_cast<at::Tensor*>(ps[i]));
      return out;
    };
    const auto& s = *reinterpret_cast<at::Tensor*>(step);
    std::vector<at::Tensor> steps(n, s);
    c10::AutoGradMode no_grad(false);
    at::_fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), {}, steps,
                      lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  });
}

// The 2-norm of each of `n` tensors (`torch._foreach_norm`, what `clip_grad_norm_` with
// `foreach=True` runs: one multi-tensor kernel on CUDA), as a new 1-D tensor of the `n` norms
// stacked in order (what `clip_grad_norm_` stacks before its total norm). Returns 0, or 1 with
// `*err`.
int titan_foreach_norm(void** tensors, int64_t n, void** out, char** err) {
  return titan_shim::guarded(err, [&] {
    std::vector<at::Tensor> ts;
    ts.reserve(n);
    for (int64_t i = 0; i < n; ++i) ts.push_back(*reinterpret_cast<at::Tensor*>(tensors[i]));
    c10::AutoGradMode no_grad(false);
    *out = new at::Tensor(at::stack(at::_foreach_norm(ts, 2), 0));
  });
}

// `t *= scale` for each of `n` tensors (`torch._foreach_mul_` with a tensor: how
// `clip_grad_norm_` applies its clip coefficient without reading it to the host). Returns 0, or
// 1 with `*err`.
int titan_foreach_mul_(void** tensors, int64_t n, void* scale, char** err) {
  return titan_shim::guarded(err, [&] {
    std::vector<at::Tensor> ts;
    ts.reserve(n);
    for (int64_t i = 0; i < n; ++i) ts.push_back(*reinterpret_cast<at::Tensor*>(tensors[i]));
    c10::AutoGradMode no_grad(false);
    at::_foreach_mul_(ts, *reinterpret_cast<at::Tensor*>(scale));
  });
}

}  // extern "C"
