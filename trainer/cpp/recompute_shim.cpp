// Activation checkpointing for libtorch callers (torch.utils.checkpoint with use_reentrant=True):
// a custom autograd Function whose forward runs a region of the model (a Rust callback) without
// recording a graph, keeping only the region's inputs, and whose backward runs the region again
// with grad enabled on detached copies of those inputs and back-propagates the incoming
// gradients through that fresh graph. Parameters the region reads get their gradients from that
// inner backward (they accumulate into .grad as in a plain backward); the inputs' gradients are
// returned to the outer graph.
//
// The recompute runs under the autocast state the forward saw (torch.utils.checkpoint does the
// same), so a bf16 forward is recomputed in bf16.
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "rust_callback.h"

namespace {

struct AutocastState {
  bool enabled;
  at::ScalarType dtype;

  static AutocastState current(at::DeviceType device) {
    return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
  }
  void apply(at::DeviceType device) const {
    at::autocast::set_autocast_enabled(device, enabled);
    at::autocast::set_autocast_dtype(device, dtype);
  }
};

// The Rust closure plus the autocast state of the forward; freed with the autograd node.
struct Region : torch::CustomClassHolder {
  void* ctx;
  titan_callback run;
  titan_callback_drop drop;
  int64_t n_out;
  AutocastState cpu{false, at::kBFloat16};
  AutocastState cuda{false, at::kHalf};

  Region(void* ctx, titan_callback run, titan_callback_drop drop, int64_t n_out)
      : ctx(ctx), run(run), drop(drop), n_out(n_out) {}
  ~Region() override { drop(ctx); }

  torch::autograd::variable_list call(const torch::autograd::variable_list& inputs) const {
    return titan_shim::call_rust(run, ctx, "activation checkpoint region", inputs, n_out);
  }
};

// Puts the forward's autocast state in place for the recompute and restores the caller's after,
// with the nesting count torch.autocast keeps (so the cast cache is cleared when it ends).
struct AutocastReplay {
  AutocastState prev_cpu, prev_cuda;
  explicit AutocastReplay(const Region& r)
      : prev_cpu(AutocastState::current(at::kCPU)), prev_cuda(AutocastState::current(at::kCUDA)) {
    r.cpu.apply(at::kCPU);
    r.cuda.apply(at::kCUDA);
    at::autocast::increment_nesting();
  }
  ~AutocastReplay() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    prev_cpu.apply(at::kCPU);
    prev_cuda.apply(at::kCUDA);
  }
};

struct Recompute : public torch::autograd::Function<Recompute> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<Region> region) {
    region->cpu = AutocastState::current(at::kCPU);
    region->cuda = AutocastState::current(at::kCUDA);
    ctx->save_for_backward(inputs.vec());
    ctx->saved_data["region"] = c10::IValue::make_capsule(region);
    return region->call(inputs.vec());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto region = c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    torch::autograd::variable_list detached;
    for (const auto& t : ctx->get_saved_variables()) {
      detached.push_back(t.detach().requires_grad_(t.requires_grad()));
    }
    torch::autograd::variable_list outputs;
    {
      at::AutoGradMode grad(true);
      AutocastReplay autocast(*region);
      outputs = region->call(detached);
    }
    torch::autograd::variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list input_grads;
    for (const auto& t : detached) input_grads.push_back(t.requires_grad() ? t.grad() : at::Tensor());
    input_grads.emplace_back();  // the region handle is not differentiable
    return input_grads;
  }
};

// `y = x @ w.T` whose forward hands back an output kept from an earlier run of the same matmul
// (torchtitan's selective AC keeps matmul outputs instead of recomputing them) and whose backward
// is linear's: the same mm calls autograd makes for `matmul(x, w.t())` on a folded 2-D `x`.
struct KeptLinear : public torch::autograd::Function<KeptLinear> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& w,
                                                const std::vector<at::Tensor>& kept) {
    ctx->save_for_backward({x, w});
    return {kept.at(0)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    const auto g = grads[0].reshape({-1, grads[0].size(-1)});
    at::Tensor grad_x, grad_w;
    if (x.requires_grad()) grad_x = g.mm(w).reshape(x.sizes());
    if (w.requires_grad()) grad_w = g.t().mm(x.reshape({-1, x.size(-1)}));
    return {grad_x, grad_w, at::Tensor()};
  }
};

}  // namespace

extern "C" {

// `*out` = KeptLinear(x, w, kept) for tch tensors. Returns 0, or 1 with `*err`.
int titan_kept_linear(void* x, void* w, void* kept, void** out, char** err) {
  return titan_shim::guarded(err, [&] {
    auto y = KeptLinear::apply(*reinterpret_cast<at::Tensor*>(x), *reinterpret_cast<at::Tensor*>(w),
                               std::vector<at::Tensor>{*reinterpret_cast<at::Tensor*>(kept)});
    *out = new at::Tensor(std::move(y.at(0)));
  });
}

// Applies a checkpointed region to `n_in` tch tensors (`at::Tensor*`), writing `n_out` new tensors
// to `outputs`. `ctx` is owned from here on: `drop` frees it, also on error. Returns 0, or 1 with
// `*err`.
int titan_recompute_apply(void* ctx, titan_callback run, titan_callback_drop drop,
                          void** inputs, int64_t n_in, void** outputs, int64_t n_out, char** err) {
  return titan_shim::guarded(err, [&] {
    auto region = c10::make_intrusive<Region>(ctx, run, drop, n_out);
    auto in = titan_shim::lent_tensors(inputs, n_in);
    titan_shim::hand_to_rust(Recompute::apply(at::TensorList(in), region), outputs, n_out,
                             "the region");
  });
}

}  // extern "C"
