// The Rust callbacks the autograd shims call (function_shim.cpp's forward and backward,
// recompute_shim.cpp's region), one ABI for both: the C side of trainer/src/autograd.rs
// `Callback`, and the one way the shims call one and hand tensors across.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shim_error.h"

extern "C" {
// Maps `n_in` tensors (lent for the call: they stay the caller's) to `n_out` new tensors
// (ownership passes to the caller). Returns 0, or non-zero with `*err` (shim_error.h).
typedef int (*titan_callback)(void* ctx, at::Tensor** in, int64_t n_in, at::Tensor** out,
                              int64_t n_out, char** err);
// Frees `ctx` once the callback can be called no more.
typedef void (*titan_callback_drop)(void* ctx);
}

namespace titan_shim {

// Calls `fn` on `in` and returns its `n_out` tensors (an undefined one where it wrote none);
// throws "`what`: <its message>" when it fails.
inline std::vector<at::Tensor> call_rust(titan_callback fn, void* ctx, const char* what,
                                         const std::vector<at::Tensor>& in, int64_t n_out) {
  std::vector<at::Tensor*> ins;
  ins.reserve(in.size());
  for (const auto& t : in) ins.push_back(const_cast<at::Tensor*>(&t));
  std::vector<at::Tensor*> outs(n_out, nullptr);
  char* err = nullptr;
  const int rc = fn(ctx, ins.data(), static_cast<int64_t>(ins.size()), outs.data(), n_out, &err);
  std::vector<at::Tensor> result;
  result.reserve(n_out);
  for (auto* t : outs) {
    if (t != nullptr) {
      result.push_back(std::move(*t));
      delete t;
    } else {
      result.emplace_back();
    }
  }
  if (rc != 0) {
    throw std::runtime_error(std::string(what) + ": " +
                             take_message(err, "failed without a message"));
  }
  return result;
}

// The `n` tch tensors (at::Tensor*) a Rust caller lends an entry point, as tensors.
inline std::vector<at::Tensor> lent_tensors(void** tensors, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) out.push_back(*reinterpret_cast<at::Tensor*>(tensors[i]));
  return out;
}

// Hands `out` to a Rust caller's `n` output slots (it owns them from here on); throws, naming
// `what`, when their count is not `n`.
inline void hand_to_rust(std::vector<at::Tensor> out, void** outputs, int64_t n,
                         const char* what) {
  if (static_cast<int64_t>(out.size()) != n) {
    throw std::runtime_error(std::string(what) + " returned " + std::to_string(out.size()) +
                             " tensors, expected " + std::to_string(n));
  }
  for (int64_t i = 0; i < n; ++i) outputs[i] = new at::Tensor(std::move(out[i]));
}

}  // namespace titan_shim
