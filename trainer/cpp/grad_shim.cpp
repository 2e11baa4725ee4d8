// Drops a parameter's gradient (`p.grad = None` in PyTorch), which tch does not expose: its
// zero_grad only zeroes in place. torchtitan's optimizers zero grads with set_to_none=True, so
// the next backward hands its fresh gradient buffer to the parameter instead of memsetting the
// old one and adding into it.
#include <ATen/core/Tensor.h>

extern "C" {

// `tensor` is a tch C_tensor, i.e. an `at::Tensor*`. Returns 0, or 1 on a C++ exception.
int titan_clear_grad(void* tensor) {
  try {
    reinterpret_cast<at::Tensor*>(tensor)->mutable_grad().reset();
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // extern "C"
