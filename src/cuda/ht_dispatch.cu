// src/cuda/ht_dispatch.cu — instantiations and launch of the ht dispatch kernel.
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/dispatch.cuh"

namespace epx::detail {

namespace {

// The cp.async staging (16-byte rows only) is dynamic shared memory above 48 KB: opt in once
// per instantiation.
template <typename V>
void launch(const HtDispatchParams& p, int grid, cudaStream_t stream) {
  const size_t smem = sizeof(V) == 16 ? kCopySmemBytes : 0;
  if (smem > 48 * 1024) {
    static const cudaError_t attr = cudaFuncSetAttribute(
        ht_dispatch_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    EPX_CUDA_CHECK(attr, "ht kernel: shared memory opt-in");
  }
  ht_dispatch_kernel<V><<<grid, kHtThreads, smem, stream>>>(p);
}

}  // namespace

void launch_ht_dispatch(const HtDispatchParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      launch<uint4>(p, grid, stream);
      break;
    case 8:
      launch<uint2>(p, grid, stream);
      break;
    case 4:
      launch<uint32_t>(p, grid, stream);
      break;
    case 2:
      launch<uint16_t>(p, grid, stream);
      break;
    default:
      launch<uint8_t>(p, grid, stream);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_dispatch: launch");
}

}  // namespace epx::detail
