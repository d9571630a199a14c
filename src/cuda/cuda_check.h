// src/cuda/cuda_check.h — turning CUDA and NCCL return codes into epx::Error (docs/semantics.md
// §4), and a scoped device switch. Host-only; usable from .cc and .cu files.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

namespace epx::detail {

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* where) {
  throw_error(ErrorCode::kCuda, cat(where, ": ", call, " failed: ", cudaGetErrorName(e), " (",
                                    cudaGetErrorString(e), ")"));
}

// EPX_CUDA_CHECK(cudaMalloc(...), "ht_dispatch") throws Cuda naming the call and the operation.
#define EPX_CUDA_CHECK(call, where)                                             \
  do {                                                                          \
    cudaError_t epx_e_ = (call);                                                \
    if (epx_e_ != cudaSuccess) ::epx::detail::throw_cuda(epx_e_, #call, where); \
  } while (0)

// Makes `device` current for the scope, restoring the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) EPX_CUDA_CHECK(cudaSetDevice(device), "DeviceGuard");
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace epx::detail
