// src/cuda/dyn_smem.h — one kernel that uses dynamic shared memory (the bulk-copy ht dispatch, the
// staged zero-copy combine): the current device's facts about it, read once per device, and its
// dynamic shared memory limit raised once per device to the largest size asked for
// (cudaFuncSetAttribute is not a stream operation, so a launch under graph capture only reads the
// cache). Host code.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

#include "cuda/cuda_check.h"

namespace epx::detail {

struct DynSmemFacts {
  int device = 0;
  int sm_major = 0;     // compute capability major
  int optin = 0;        // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int static_smem = 0;  // the kernel's static shared memory
  int ptx = 0;          // the kernel's PTX version (90: built for sm_90)
  // An sm_90+ device running the kernel as built for sm_90 (Hopper instructions present).
  bool hopper() const { return sm_major >= 9 && ptx >= 90; }
};

class DynSmemKernel {
 public:
  explicit DynSmemKernel(const void* kernel) : kernel_(kernel) {}

  // The current device's facts (queried on its first use); `what` names the operation in errors.
  DynSmemFacts facts(const char* what) {
    int dev = 0;
    EPX_CUDA_CHECK(cudaGetDevice(&dev), what);
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entry_[dev & 63];
    if (!e.checked) {
      e.facts.device = dev;
      EPX_CUDA_CHECK(
          cudaDeviceGetAttribute(&e.facts.sm_major, cudaDevAttrComputeCapabilityMajor, dev), what);
      EPX_CUDA_CHECK(
          cudaDeviceGetAttribute(&e.facts.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
          what);
      cudaFuncAttributes attr{};
      EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel_), what);
      e.facts.static_smem = static_cast<int>(attr.sharedSizeBytes);
      e.facts.ptx = attr.ptxVersion;
      e.checked = true;
    }
    return e.facts;
  }

  // Lets launches on the current device use `smem` bytes (the caller checked that they fit).
  void allow(int smem, const char* what) {
    int dev = 0;
    EPX_CUDA_CHECK(cudaGetDevice(&dev), what);
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entry_[dev & 63];
    if (smem > e.raised) {
      EPX_CUDA_CHECK(
          cudaFuncSetAttribute(kernel_, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), what);
      e.raised = smem;
    }
  }

 private:
  struct Entry {
    bool checked = false;
    int raised = 0;  // dynamic shared memory the kernel is allowed so far
    DynSmemFacts facts;
  };
  const void* kernel_;
  std::mutex mu_;
  Entry entry_[64];
};

}  // namespace epx::detail
