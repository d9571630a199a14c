// src/cuda/ht_notify.cu — instantiation and launch of the ht layout / count-exchange kernel.
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/notify.cuh"
#include "cuda/tuning.h"

namespace epx::detail {

namespace {

template <bool kOld, bool kMasks>
void launch_variant(const HtNotifyParams& p, size_t smem, cudaStream_t stream) {
  auto kernel = ht_notify_kernel<kOld, kMasks>;
  static const size_t static_smem = [kernel] {  // the kernel's own __shared__ arrays
    cudaFuncAttributes a{};
    return cudaFuncGetAttributes(&a, kernel) == cudaSuccess ? a.sharedSizeBytes : size_t{4096};
  }();
  if (smem + static_smem > 48 * 1024) {
    EPX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)),
                   "ht count exchange");
  }
  kernel<<<1, kNotifyThreads, smem, stream>>>(p);
}

}  // namespace

void launch_ht_notify(const HtNotifyParams& p, cudaStream_t stream) {
  const bool old = (ht_ablation() & kHtNotifyOld) != 0;
  // Pass 2 reads the masks pass 1 kept (layout-only calls have no pass 2).
  const bool masks = !old && p.exchange && p.num_tokens <= kNotifyMaxSmemMasks;
  const size_t smem = ht_notify_smem(p, masks);
  if (old) {
    launch_variant<true, false>(p, smem, stream);
  } else if (masks) {
    launch_variant<false, true>(p, smem, stream);
  } else {
    launch_variant<false, false>(p, smem, stream);
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht count exchange: launch");
}

}  // namespace epx::detail
