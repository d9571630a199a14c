// src/cuda/ht_combine.cu — instantiations and launch of the ht combine kernel (bf16 rows: the
// copy unit is at least 2 bytes).
#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/combine.cuh"
#include "cuda/kernels/ht/combine_staged.cuh"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace epx::detail {

namespace {

// The staged reducer: sm_90+, built for it (below, the bulk-copy instructions compile to a trap),
// and the staging's shared memory.
DynSmemKernel g_staged_kernel(reinterpret_cast<const void*>(ht_combine_staged_kernel));

}  // namespace

bool prepare_ht_combine_staged(int stages, int chunk) {
  EPX_CHECK(stages >= 2 && stages <= 8 && chunk >= 512 && chunk <= 16384 && chunk % 512 == 0,
            ErrorCode::kInvalidArgument, "ht_combine: staged reducer with ", stages, " x ", chunk,
            " bytes; expected 2..8 stages of a multiple of 512 bytes in [512, 16384]");
  const DynSmemFacts d = g_staged_kernel.facts("ht_combine");
  const int smem = pull_smem_bytes(stages, chunk);
  if (!d.hopper() || smem + d.static_smem > d.optin) return false;  // registers
  g_staged_kernel.allow(smem, "ht_combine");
  return true;
}

void launch_ht_combine_staged(const HtCombineParams& p, int grid, cudaStream_t stream) {
  launch_kernel(ht_combine_staged_kernel, grid, kHtThreads,
                pull_smem_bytes(p.pull_stages, p.pull_chunk), stream, p.pdl, "ht_combine: launch",
                p);
}

void launch_ht_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      if (p.ablate & kHtReduceNarrow) {
        launch_kernel(ht_combine_kernel<uint4, kStepNarrow>, grid, kHtThreads, 0, stream, p.pdl,
                      "ht_combine: launch", p);
      } else if (p.num_ranks + (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0) <= 2 &&
                 !(p.ablate & kHtReducePairOff)) {  // every token has <= 2 row sources
        launch_kernel(ht_combine_kernel<uint4, kStepPair>, grid, kHtThreads, 0, stream, p.pdl,
                      "ht_combine: launch", p);
      } else {
        launch_kernel(ht_combine_kernel<uint4, kStepWide>, grid, kHtThreads, 0, stream, p.pdl,
                      "ht_combine: launch", p);
      }
      break;
    case 8:
      launch_kernel(ht_combine_kernel<uint2>, grid, kHtThreads, 0, stream, p.pdl,
                    "ht_combine: launch", p);
      break;
    case 4:
      launch_kernel(ht_combine_kernel<uint32_t>, grid, kHtThreads, 0, stream, p.pdl,
                    "ht_combine: launch", p);
      break;
    default:
      launch_kernel(ht_combine_kernel<uint16_t>, grid, kHtThreads, 0, stream, p.pdl,
                    "ht_combine: launch", p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine: launch");
}

}  // namespace epx::detail
