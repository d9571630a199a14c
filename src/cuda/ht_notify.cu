// src/cuda/ht_notify.cu — instantiation and launch of the ht layout / count-exchange kernel.
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/notify.cuh"

namespace epx::detail {

void launch_ht_notify(const HtNotifyParams& p, cudaStream_t stream) {
  const size_t smem = 4 * static_cast<size_t>(p.num_experts + p.num_local_experts +
                                              p.num_ranks * p.num_ranks + 32 * p.num_ranks);
  static const size_t static_smem = [] {  // the kernel's own __shared__ arrays
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, ht_notify_kernel) == cudaSuccess ? a.sharedSizeBytes
                                                                      : size_t{4096};
  }();
  if (smem + static_smem > 48 * 1024) {
    EPX_CUDA_CHECK(
        cudaFuncSetAttribute(ht_notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        "ht count exchange");
  }
  ht_notify_kernel<<<1, kNotifyThreads, smem, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht count exchange: launch");
}

}  // namespace epx::detail
