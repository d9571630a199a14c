// src/cuda/ht_dispatch.cu — instantiations and launch of the ht dispatch kernel.
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/dispatch.cuh"
#include "cuda/launch.h"

namespace epx::detail {

const void* ht_dispatch_kernel_address() {
  return reinterpret_cast<const void*>(ht_dispatch_kernel<uint4>);
}

void launch_ht_dispatch(const HtDispatchParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  const bool pdl = p.pdl != 0;
  switch (vec_bytes) {
    case 16:
      launch_kernel(ht_dispatch_kernel<uint4>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 8:
      launch_kernel(ht_dispatch_kernel<uint2>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 4:
      launch_kernel(ht_dispatch_kernel<uint32_t>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 2:
      launch_kernel(ht_dispatch_kernel<uint16_t>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    default:
      launch_kernel(ht_dispatch_kernel<uint8_t>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
  }
  // (launch_kernel checked the launch itself; no cudaGetLastError here, which could report an
  // earlier call's error after this kernel was queued.)
}

}  // namespace epx::detail
