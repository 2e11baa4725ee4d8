// torch.autocast(device_type, dtype) for libtorch callers: tch only exposes the deprecated
// CUDA-only switch, and CPU autocast needs its device type and dtype set (bf16 on CPU is the
// mixed precision torchtitan runs without FSDP). Enter/exit do what torch.autocast's
// __enter__/__exit__ do: enable for the device with the dtype, count nesting, and clear the
// cast-weight cache when the outermost region ends.
#include <ATen/autocast_mode.h>

#include "shim_error.h"

extern "C" {

// `cuda` selects the device type (else CPU); `dtype` is a c10::ScalarType code. The previous
// state goes to `prev_enabled` / `prev_dtype` for titan_autocast_exit. Returns 0, or 1 with
// `*err` (shim_error.h).
int titan_autocast_enter(int cuda, int dtype, int* prev_enabled, int* prev_dtype, char** err) {
  return titan_shim::guarded(err, [&] {
    const auto device = cuda ? at::kCUDA : at::kCPU;
    *prev_enabled = at::autocast::is_autocast_enabled(device) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(device));
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
  });
}

int titan_autocast_exit(int cuda, int prev_enabled, int prev_dtype, char** err) {
  return titan_shim::guarded(err, [&] {
    const auto device = cuda ? at::kCUDA : at::kCPU;
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(device, prev_enabled != 0);
    at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(prev_dtype));
  });
}

}  // extern "C"
