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

}  // namespace epx::detail
