// src/cuda/ht_combine.cu — instantiations and launch of the ht combine kernel (bf16 rows: the
// copy unit is at least 2 bytes).
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/combine.cuh"

namespace epx::detail {

namespace {

// The cp.async staging (16-byte rows only) is dynamic shared memory above 48 KB: opt in once
// per instantiation.
template <typename V>
void launch(const HtCombineParams& p, int grid, cudaStream_t stream) {
  const size_t smem = sizeof(V) == 16 ? kCombineSmemBytes : 0;
  if (smem > 48 * 1024) {
    static const cudaError_t attr = cudaFuncSetAttribute(
        ht_combine_kernel<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    EPX_CUDA_CHECK(attr, "ht kernel: shared memory opt-in");
  }
  ht_combine_kernel<V><<<grid, kHtThreads, smem, stream>>>(p);
}

}  // namespace

void launch_ht_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream) {
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
    default:
      launch<uint16_t>(p, grid, stream);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine: launch");
}

}  // namespace epx::detail
