// src/cuda/ht_combine.cu — instantiations and launch of the ht combine kernel (bf16 rows: the
// copy unit is at least 2 bytes).
#include <mutex>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/combine.cuh"
#include "cuda/kernels/ht/combine_staged.cuh"
#include "cuda/launch.h"
#include "cuda/tuning.h"

namespace epx::detail {

namespace {

// The staged reducer's device facts, once per device; its dynamic shared memory limit is raised
// to the largest staging once per device (not a stream operation: safe under graph capture).
struct StagedDevice {
  int checked = 0;
  int sm_major = 0;
  int optin = 0;
  int static_smem = 0;
  int ptx = 0;  // the staged kernel's PTX version (90: built for sm_90)
  int raised = 0;
};
std::mutex g_staged_mutex;
StagedDevice g_staged[64];

}  // namespace

bool prepare_ht_combine_staged(int stages, int chunk) {
  EPX_CHECK(stages >= 2 && stages <= 8 && chunk >= 512 && chunk <= 16384 && chunk % 512 == 0,
            ErrorCode::kInvalidArgument, "ht_combine: staged reducer with ", stages, " x ", chunk,
            " bytes; expected 2..8 stages of a multiple of 512 bytes in [512, 16384]");
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev), "ht_combine");
  std::lock_guard<std::mutex> lock(g_staged_mutex);
  StagedDevice& d = g_staged[dev & 63];
  if (!d.checked) {
    EPX_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_major, cudaDevAttrComputeCapabilityMajor, dev),
                   "ht_combine");
    EPX_CUDA_CHECK(cudaDeviceGetAttribute(&d.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                   "ht_combine");
    cudaFuncAttributes attr{};
    EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, ht_combine_staged_kernel), "ht_combine");
    d.static_smem = static_cast<int>(attr.sharedSizeBytes);
    d.ptx = attr.ptxVersion;  // below 90 the bulk-copy instructions compile to a trap
    d.checked = 1;
  }
  const int smem = pull_smem_bytes(stages, chunk);
  if (d.sm_major < 9 || d.ptx < 90 || smem + d.static_smem > d.optin) return false;  // registers
  if (smem > d.raised) {
    EPX_CUDA_CHECK(cudaFuncSetAttribute(ht_combine_staged_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "ht_combine");
    d.raised = smem;
  }
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
