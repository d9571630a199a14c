// src/cuda/ht_notify.cu — instantiation and launch of the ht layout / count-exchange kernel.
#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/notify.cuh"
#include "cuda/tuning.h"

namespace epx::detail {

namespace {

template <bool kOld, bool kMasks>
void launch_variant(const HtNotifyParams& p, size_t smem, int ctas, cudaStream_t stream) {
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
  if (ctas == 1) {
    kernel<<<1, kNotifyThreads, smem, stream>>>(p);
    return;
  }
  // One cluster of `ctas` CTAs (portable size: at most 8), so that they share their counts
  // through distributed shared memory and barrier together.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(ctas));
  cfg.blockDim = dim3(kNotifyThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(ctas);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p), "ht count exchange: launch");
}

// Whether the count exchange may run on a cluster of CTAs here: an sm_90+ device and the kernels
// built for it (else one CTA; kernels/ht/notify.cuh).
bool notify_clusters_ok() {
  static DynSmemKernel k(reinterpret_cast<const void*>(ht_notify_kernel<false, true>));
  const DynSmemFacts f = k.facts("ht count exchange");
  return f.sm_major >= 9 && f.ptx >= 90;
}

}  // namespace

void launch_ht_notify(const HtNotifyParams& p, cudaStream_t stream) {
  const int ablate = ht_ablation();
  const bool old = (ablate & kHtNotifyOld) != 0;
  // The tokens split over a cluster of CTAs (the old kernel and the A/B: one CTA).
  const int ctas =
      old || (ablate & kHtNotifyOneCta) || !notify_clusters_ok() ? 1 : ht_notify_ctas(p.num_tokens);
  // Pass 2 reads the masks pass 1 kept (layout-only calls have no pass 2).
  const bool masks =
      !old && p.exchange && ht_notify_chunk(p.num_tokens, ctas) <= kNotifyMaxSmemMasks;
  const size_t smem = ht_notify_smem(p, masks, ctas);
  if (old) {
    launch_variant<true, false>(p, smem, ctas, stream);
  } else if (masks) {
    launch_variant<false, true>(p, smem, ctas, stream);
  } else {
    launch_variant<false, false>(p, smem, ctas, stream);
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht count exchange: launch");
}

}  // namespace epx::detail
