// The device caching allocator's statistics (what torch.cuda.memory_stats reads and torchtitan's
// DeviceMemoryMonitor logs), which tch does not expose. Through c10's device-generic allocator
// interface, so this compiles against a CPU-only libtorch too, with no CUDA headers: there the
// call fails with libtorch's message (no CUDA allocator registered), as it does on a machine
// without a GPU. Errors follow shim_error.h.
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <atomic>
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

namespace {

// The CPU allocator titan-train installs over c10's default: the same memory (c10::alloc_cpu,
// 64-byte aligned), with the live and peak bytes of CPU tensors counted, the quantity the memory
// estimate predicts (RSS also counts freed memory the C library keeps, and libtorch's own). The
// size rides in a 64-byte header before the data, so the data pointer is its own context (c10's
// "simple" data pointer: copy-on-write clones and raw allocations keep working).
constexpr size_t kHeader = 64;
std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};

void raise_peak(int64_t now) {
  int64_t peak = peak_bytes.load(std::memory_order_relaxed);
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void counted_free(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* base = static_cast<char*>(data) - kHeader;
  const auto n = *reinterpret_cast<int64_t*>(base);
  live_bytes.fetch_sub(n, std::memory_order_relaxed);
  c10::free_cpu(base);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &counted_free, c10::Device(c10::DeviceType::CPU)};
    }
    auto* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<int64_t*>(base) = static_cast<int64_t>(n);
    raise_peak(live_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
               static_cast<int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator counting_allocator;

}  // namespace

extern "C" {

// Makes the counting allocator libtorch's CPU allocator (tensors allocated before keep their
// own deleter and are not counted). Idempotent. Returns 0, or 1 with `*err`.
int titan_cpu_count_tensor_bytes(char** err) {
  return titan_shim::guarded(err, [&] { c10::SetCPUAllocator(&counting_allocator, 1); });
}

// The counting allocator's live CPU tensor bytes and their peak since the last reset, into
// out[0], out[1]; with `reset_peak`, the peak starts again from the live bytes.
void titan_cpu_tensor_bytes(int reset_peak, int64_t* out) {
  out[0] = live_bytes.load(std::memory_order_relaxed);
  out[1] = std::max(peak_bytes.load(std::memory_order_relaxed), out[0]);
  if (reset_peak != 0) {
    peak_bytes.store(out[0], std::memory_order_relaxed);
  }
}

}  // extern "C"
