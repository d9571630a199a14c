// src/cuda/ht_dispatch.cu — instantiations and launch of the ht dispatch kernel.
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/dispatch.cuh"

namespace epx::detail {

void launch_ht_dispatch(const HtDispatchParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      ht_dispatch_kernel<uint4><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    case 8:
      ht_dispatch_kernel<uint2><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    case 4:
      ht_dispatch_kernel<uint32_t><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    case 2:
      ht_dispatch_kernel<uint16_t><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    default:
      ht_dispatch_kernel<uint8_t><<<grid, kHtThreads, 0, stream>>>(p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_dispatch: launch");
}

}  // namespace epx::detail
