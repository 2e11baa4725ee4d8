// CUDA events with timing, for titan-obs's GPU clock (trainer/src/gpu_clock.rs), which tch does
// not expose. Through c10's device-generic c10::Event (BACKEND_DEFAULT: timing enabled, what
// torch.cuda.Event(enable_timing=True) creates), so this compiles against a CPU-only libtorch
// too: there creating an event fails with libtorch's message, as it does without a GPU. Errors
// follow shim_error.h.
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <optional>

#include "shim_error.h"

namespace {

c10::Device cuda(int64_t index) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
}

// A stream of the device's pool that titan-train enqueues nothing on, for clock anchors: an
// event recorded there completes as soon as the device sees it, whatever the training stream
// has queued. One per process (the GPU clock serves one device).
std::optional<c10::Stream> anchor_stream;

}  // namespace

extern "C" {

// A new timing-enabled CUDA event (recorded on device `index` when first recorded), into
// `*out`; free it with titan_cuda_event_free. Returns 0, or 1 with `*err`.
int titan_cuda_event_new(void** out, char** err) {
  return titan_shim::guarded(err, [&] {
    // The guard implementation for CUDA exists only when libtorch_cuda is loaded: fail here,
    // with its message, rather than at the first record.
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    *out = new c10::Event(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
  });
}

void titan_cuda_event_free(void* event) { delete static_cast<c10::Event*>(event); }

// Makes CUDA device `index` the calling thread's current device (cudaSetDevice), so a thread
// that only queries and times events works in that device's context. Returns 0, or 1.
int titan_cuda_use_device(int64_t index, char** err) {
  return titan_shim::guarded(err, [&] {
    c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(cuda(index));
  });
}

// Records `event` on the calling thread's current stream of CUDA device `index` (where the
// work it times is enqueued), or with `anchor`, on the anchor stream. Returns 0, or 1.
int titan_cuda_event_record(void* event, int64_t index, int anchor, char** err) {
  return titan_shim::guarded(err, [&] {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    if (anchor != 0) {
      if (!anchor_stream.has_value()) {
        anchor_stream = impl.getStreamFromGlobalPool(cuda(index), /*isHighPriority=*/true);
      }
      static_cast<c10::Event*>(event)->record(*anchor_stream);
    } else {
      static_cast<c10::Event*>(event)->record(impl.getStream(cuda(index)));
    }
  });
}

// Whether the device has reached `event` (an event never recorded counts as reached), into
// `*done` (no wait: cudaEventQuery). Returns 0, or 1 with `*err`.
int titan_cuda_event_query(void* event, int* done, char** err) {
  return titan_shim::guarded(err, [&] { *done = static_cast<c10::Event*>(event)->query() ? 1 : 0; });
}

// Milliseconds of device time from `start` to `end`, both reached, into `*ms`
// (cudaEventElapsedTime: about half a microsecond of resolution). Returns 0, or 1 with `*err`.
int titan_cuda_event_elapsed_ms(void* start, void* end, double* ms, char** err) {
  return titan_shim::guarded(err, [&] {
    *ms = static_cast<c10::Event*>(start)->elapsedTime(*static_cast<c10::Event*>(end));
  });
}

}  // extern "C"
