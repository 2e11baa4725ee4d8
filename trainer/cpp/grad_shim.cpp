// Drops a parameter's gradient (`p.grad = None` in PyTorch), which tch does not expose: its
// zero_grad only zeroes in place. torchtitan's optimizers zero grads with set_to_none=True, so
// the next backward hands its fresh gradient buffer to the parameter instead of memsetting the
// old one and adding into it.
#include <ATen/core/Tensor.h>
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
