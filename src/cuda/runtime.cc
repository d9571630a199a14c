// src/cuda/runtime.cc — the CUDA runtime services core code uses (src/core/cuda_runtime_shim.h).
// Note: cuda_available() / cuda_device_count() initialise CUDA in the calling process; a process
// that forks ranks afterwards (launch_local) must not have called them (CUDA does not survive
// fork). Tests count GPUs in a throw-away child for that reason.
#include <cuda_runtime.h>

#include "core/cuda_runtime_shim.h"
#include "cuda/cuda_check.h"

namespace epx::detail {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

bool cuda_available() {
  return cuda_device_count() > 0;
}

std::shared_ptr<void> cuda_alloc_shared(size_t bytes, int device) {
  if (bytes == 0) return std::shared_ptr<void>();
  DeviceGuard guard(device);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw_error(ErrorCode::kCuda, cat("cuda allocation: cudaMalloc of ", bytes, " bytes on cuda:",
                                      device, " failed: ", cudaGetErrorString(e)));
  }
  return std::shared_ptr<void>(p, [device](void* q) {
    int previous = 0;  // no throwing guard inside a deleter
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaFree(q);
    cudaSetDevice(previous);
  });
}

bool cuda_stream_is_capturing(Stream stream, int device) {
  DeviceGuard guard(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  if (e == cudaErrorStreamCaptureImplicit || e == cudaErrorStreamCaptureUnsupported) {
    // The legacy default stream queried while another stream captures in global mode: treat it
    // as capturing, so the caller raises its Unsupported message instead of a Cuda error.
    (void)cudaGetLastError();
    return true;
  }
  EPX_CUDA_CHECK(e, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

void cuda_stream_wait_stream(Stream waiter, Stream waited, int device) {
  if (waiter == waited) return;
  DeviceGuard guard(device);
  cudaEvent_t event = nullptr;
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "stream order");
  cudaError_t e = cudaEventRecord(event, static_cast<cudaStream_t>(waited));
  if (e == cudaSuccess) e = cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), event, 0);
  cudaEventDestroy(event);  // released once the wait is resolved
  EPX_CUDA_CHECK(e, "stream order");
}

}  // namespace epx::detail
