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
#include <thread>

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
    newest_of_thread_[std::this_thread::get_id()] = buf;
    return buf;
  }
  // Frees it (destructors: no throwing); it is no longer found.
  void destroy(int device, uint64_t* buf) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = newest_.find(device);
      if (it != newest_.end() && it->second == buf) newest_.erase(it);
      for (auto t = newest_of_thread_.begin(); t != newest_of_thread_.end();)
        t = t->second == buf ? newest_of_thread_.erase(t) : std::next(t);
    }
    cudaFree(buf);
  }
  // The newest live buffer on `device`, or null.
  uint64_t* newest(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = newest_.find(device);
    return it == newest_.end() ? nullptr : it->second;
  }
  // The newest live buffer the calling thread created, or null.
  uint64_t* newest_of_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = newest_of_thread_.find(std::this_thread::get_id());
    return it == newest_of_thread_.end() ? nullptr : it->second;
  }

 private:
  std::mutex mu_;
  std::map<int, uint64_t*> newest_;
  std::map<std::thread::id, uint64_t*> newest_of_thread_;
};

}  // namespace epx::detail
