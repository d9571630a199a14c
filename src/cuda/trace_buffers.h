// src/cuda/trace_buffers.h — the device buffers of a phase trace (profiling builds only:
// EPX_LL_TRACE, EPX_HT_TRACE): each owner (a CudaLl, a CudaBuffer) gets a zeroed buffer, and the
// newest live one per device is what the bench reads after each call. One instance per trace.
// Host code.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "cuda/cuda_check.h"

namespace epx::detail {

class TraceBuffers {
 public:
  // A zeroed buffer of `words` uint64 on `device` (current), now the newest there.
  uint64_t* create(int device, size_t words) {
    uint64_t* buf = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&buf, words * sizeof(uint64_t)), "Buffer");
    EPX_CUDA_CHECK(cudaMemset(buf, 0, words * sizeof(uint64_t)), "Buffer");
    std::lock_guard<std::mutex> lock(mu_);
    newest_[device] = buf;
    return buf;
  }
  // Frees it (destructors: no throwing); it is no longer found.
  void destroy(int device, uint64_t* buf) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = newest_.find(device);
      if (it != newest_.end() && it->second == buf) newest_.erase(it);
    }
    cudaFree(buf);
  }
  // The newest live buffer on `device`, or null.
  uint64_t* newest(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = newest_.find(device);
    return it == newest_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mu_;
  std::map<int, uint64_t*> newest_;
};

}  // namespace epx::detail
