// A custom autograd Function whose forward and backward are Rust callbacks (torch.autograd.Function
// for libtorch callers; tch binds none). The collectives of sharded training live in such
// functions: FSDP's all-gather (backward: reduce-scatter) and tensor parallelism's copies and
// reductions, so autograd runs them at the right point of the backward pass.
//
// Also two storage primitives FSDP2 uses to free the unsharded parameters after forward and bring
// them back before backward while autograd holds them: resizing a tensor's storage in place, and
// copying into a tensor without bumping its version counter (the saved tensors stay valid).
#include <ATen/core/ivalue.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include <stdexcept>

#include "rust_callback.h"

namespace {

struct Callbacks : torch::CustomClassHolder {
  void* ctx;
  titan_callback forward;
  titan_callback backward;
  titan_callback_drop drop;
  int64_t n_in, n_out;

  Callbacks(void* ctx, titan_callback f, titan_callback b, titan_callback_drop d, int64_t n_in,
            int64_t n_out)
      : ctx(ctx), forward(f), backward(b), drop(d), n_in(n_in), n_out(n_out) {}
  ~Callbacks() override { drop(ctx); }
};

struct RustFunction : public torch::autograd::Function<RustFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<Callbacks> cb) {
    ctx->saved_data["cb"] = c10::IValue::make_capsule(cb);
    return titan_shim::call_rust(cb->forward, cb->ctx, "forward", inputs.vec(), cb->n_out);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto cb = c10::static_intrusive_pointer_cast<Callbacks>(ctx->saved_data["cb"].toCapsule());
    auto out = titan_shim::call_rust(cb->backward, cb->ctx, "backward", grads, cb->n_in);
    out.emplace_back();  // the callbacks handle is not differentiable
    return out;
  }
};

}  // namespace

extern "C" {

// Applies a Rust-defined autograd Function to `n_in` tch tensors, writing `n_out` new tensors.
// `ctx` is owned from here on (`drop` frees it, also on error). Returns 0, or 1 with `*err`.
int titan_function_apply(void* ctx, titan_callback forward, titan_callback backward,
                         titan_callback_drop drop, void** inputs, int64_t n_in, void** outputs,
                         int64_t n_out, char** err) {
  return titan_shim::guarded(err, [&] {
    auto cb = c10::make_intrusive<Callbacks>(ctx, forward, backward, drop, n_in, n_out);
    auto in = titan_shim::lent_tensors(inputs, n_in);
    titan_shim::hand_to_rust(RustFunction::apply(at::TensorList(in), cb), outputs, n_out,
                             "the function");
  });
}

// Gives `tensor`'s storage `nbytes` bytes of fresh (uninitialised) memory from its own allocator,
// or frees it with 0, in place: every tensor sharing the storage (autograd's saved copies
// included) sees the change. FSDP2's free / alloc of unsharded parameters.
// The bytes `tensor`'s storage holds now (0 once freed by titan_storage_resize).
int titan_storage_nbytes(void* tensor, int64_t* out, char** err) {
  return titan_shim::guarded(err, [&] {
    auto& t = *reinterpret_cast<at::Tensor*>(tensor);
    *out = static_cast<int64_t>(t.storage().nbytes());
  });
}

int titan_storage_resize(void* tensor, int64_t nbytes, char** err) {
  return titan_shim::guarded(err, [&] {
    auto& t = *reinterpret_cast<at::Tensor*>(tensor);
    c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    c10::DeviceGuard guard(t.device());
    if (nbytes == 0) {
      s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
      s->set_nbytes(0);
    } else {
      at::Allocator* alloc = s->allocator();
      if (alloc == nullptr) throw std::runtime_error("the storage has no allocator");
      s->set_data_ptr_noswap(alloc->allocate(static_cast<size_t>(nbytes)));
      s->set_nbytes(static_cast<size_t>(nbytes));
    }
  });
}

// `dst.copy_(src)` without grad and without bumping `dst`'s version counter, so autograd's saved
// references to `dst` stay valid (torch.autograd._unsafe_preserve_version_counter).
int titan_copy_keep_version(void* dst, void* src, char** err) {
  return titan_shim::guarded(err, [&] {
    auto& d = *reinterpret_cast<at::Tensor*>(dst);
    const auto& s = *reinterpret_cast<at::Tensor*>(src);
    const auto version = d._version();
    {
      at::NoGradGuard no_grad;
      d.copy_(s, /*non_blocking=*/true);
    }
    // A copy of the handle shares the tensor's counter.
    c10::VariableVersion counter = torch::autograd::impl::version_counter(d);
    counter.set_version(version);
  });
}

}  // extern "C"
