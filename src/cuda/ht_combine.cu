// src/cuda/ht_combine.cu — instantiations and launch of the ht combine kernel (bf16 rows: the
// copy unit is at least 2 bytes).
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/combine.cuh"
#include "cuda/tuning.h"

namespace epx::detail {

void launch_ht_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      if (p.ablate & kHtReduceNarrow) {
        ht_combine_kernel<uint4, kStepNarrow><<<grid, kHtThreads, 0, stream>>>(p);
      } else if (p.num_ranks + (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0) <= 2 &&
                 !(p.ablate & kHtReducePairOff)) {  // every token has <= 2 row sources
        ht_combine_kernel<uint4, kStepPair><<<grid, kHtThreads, 0, stream>>>(p);
      } else {
        ht_combine_kernel<uint4, kStepWide><<<grid, kHtThreads, 0, stream>>>(p);
      }
      break;
    case 8:
      ht_combine_kernel<uint2><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    case 4:
      ht_combine_kernel<uint32_t><<<grid, kHtThreads, 0, stream>>>(p);
      break;
    default:
      ht_combine_kernel<uint16_t><<<grid, kHtThreads, 0, stream>>>(p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine: launch");
}

}  // namespace epx::detail
