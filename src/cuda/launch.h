// src/cuda/launch.h — kernel launches with optional programmatic dependent launch (PDL).
//
// With PDL (Hopper; only with EPX_PDL=1, off by default: a PDL kernel is resident early and waits
// for its predecessor, so profiler rows would count that wait and its CTAs would hold SMs the
// predecessor could use; never where ranks share a GPU) a kernel is launched with
// cudaLaunchAttributeProgrammaticStreamSerialization: it may become resident while the previous
// kernel on the stream still runs, and waits at its first instruction (pdl_begin,
// griddepcontrol.wait) until that kernel completed and its memory is visible — so it reads
// nothing early, but its launch overlaps the previous kernel's tail. Our kernels also allow the
// next kernel to launch early (griddepcontrol.launch_dependents in pdl_begin): a dependent
// launched with PDL must itself wait before reading our outputs, as the attribute requires of
// any kernel. Captured into CUDA graphs as programmatic edges.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "core/env.h"
#include "cuda/cuda_check.h"

namespace epx::detail {

// Whether launches on `device` use PDL: requested (EPX_PDL=1, read once), the device is sm_90+,
// its ranks do not share it (waiting CTAs would hold a peer's SMs), and `kernel` (one of the family) was built for sm_90 (pdl_begin compiles
// to nothing below: ptxVersion >= 90).
inline bool pdl_usable(int device, bool ranks_share_device, const void* kernel) {
  static const int setting = env_pdl();
  if (setting != 1 || ranks_share_device) return false;
  int major = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                 "Buffer");
  if (major < 9) return false;
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel), "Buffer");
  return attr.ptxVersion >= 90;
}

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, bool pdl, const char* what, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not left behind for the next unrelated check
    throw_cuda(e, "cudaLaunchKernelEx", what);
  }
}

}  // namespace epx::detail
