// The device caching allocator's statistics (what torch.cuda.memory_stats reads and torchtitan's
// DeviceMemoryMonitor logs), which tch does not expose. Through c10's device-generic allocator
// interface, so this compiles against a CPU-only libtorch too, with no CUDA headers: there the
// call fails with libtorch's message (no CUDA allocator registered), as it does on a machine
// without a GPU. Errors follow shim_error.h.
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>

#include "shim_error.h"

extern "C" {

// CUDA device `index`'s allocator statistics since the last reset, into `out`: [0] the peak of
// bytes in active blocks ("active_bytes.all.peak"), [1] the peak of bytes reserved
// ("reserved_bytes.all.peak"), [2] num_alloc_retries, [3] num_ooms, [4] the device's total
// memory in bytes. With `reset_peak`, the peaks start again from the current values afterwards
// (torchtitan resets them after each logged step). Returns 0, or 1 with `*err`.
int titan_cuda_memory_stats(int64_t index, int reset_peak, int64_t* out, char** err) {
  return titan_shim::guarded(err, [&] {
    auto* allocator = at::getDeviceAllocator(c10::DeviceType::CUDA);
    const auto device = static_cast<c10::DeviceIndex>(index);
    const auto stats = allocator->getDeviceStats(device);
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.active_bytes[all].peak;
    out[1] = stats.reserved_bytes[all].peak;
    out[2] = stats.num_alloc_retries;
    out[3] = stats.num_ooms;
    out[4] = static_cast<int64_t>(allocator->getMemoryInfo(device).second);
    if (reset_peak != 0) {
      allocator->resetPeakStats(device);
    }
  });
}

}  // extern "C"
