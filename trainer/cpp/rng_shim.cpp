// A C ABI over libtorch's default CPU generator state (what torch.get_rng_state() /
// torch.set_rng_state() read and write), which tch does not expose. Checkpoints carry it so a
// resumed run draws the same random numbers. Errors follow shim_error.h.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#include "shim_error.h"

extern "C" {

// Writes the state's size to `*size` and copies the state into `out` when it fits in `cap`
// bytes. Returns 0, or 1 with `*err`.
int titan_cpu_rng_get_state(uint8_t* out, int64_t cap, int64_t* size, char** err) {
  return titan_shim::guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    const int64_t n = state.numel();
    if (out != nullptr && n <= cap) {
      std::memcpy(out, state.data_ptr<uint8_t>(), static_cast<size_t>(n));
    }
    *size = n;
  });
}

// Restores a state from titan_cpu_rng_get_state; returns 0, or 1 with `*err` when libtorch
// rejects it.
int titan_cpu_rng_set_state(const uint8_t* data, int64_t n, char** err) {
  return titan_shim::guarded(err, [&] {
    at::Tensor state = at::empty({n}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr<uint8_t>(), data, static_cast<size_t>(n));
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
}

}  // extern "C"
