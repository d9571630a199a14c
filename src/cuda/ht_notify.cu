// src/cuda/ht_notify.cu — instantiation and launch of the ht layout / count-exchange kernel.
#include <atomic>

#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/notify.cuh"

namespace epx::detail {

namespace {

// The launch's status (the cluster launch's own, or the plain launch's cudaGetLastError).
template <bool kMasks>
cudaError_t launch_variant(const HtNotifyParams& p, size_t smem, int ctas, cudaStream_t stream) {
  auto kernel = ht_notify_kernel<kMasks>;
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
    return cudaGetLastError();
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
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// Set once a cluster launch failed here (e.g. no GPC with enough free SMs): one CTA from then on.
std::atomic<bool> g_notify_one_cta{false};

// Whether the count exchange may run on a cluster of CTAs here: an sm_90+ device and the kernels
// built for it (else one CTA; kernels/ht/notify.cuh).
bool notify_clusters_ok() {
  if (g_notify_one_cta.load(std::memory_order_relaxed)) return false;
  static DynSmemKernel k(reinterpret_cast<const void*>(ht_notify_kernel<true>));
  return k.facts("ht count exchange").hopper();
}

}  // namespace

void launch_ht_notify(const HtNotifyParams& p, cudaStream_t stream) {
  // The tokens split over a cluster of CTAs.
  int ctas = notify_clusters_ok() ? ht_notify_ctas(p.num_tokens) : 1;
  for (;;) {
    // Pass 2 reads the masks pass 1 kept (layout-only calls have no pass 2).
    const bool masks = p.exchange && ht_notify_chunk(p.num_tokens, ctas) <= kNotifyMaxSmemMasks;
    const size_t smem = ht_notify_smem(p, masks, ctas);
    const cudaError_t err = masks ? launch_variant<true>(p, smem, ctas, stream)
                                  : launch_variant<false>(p, smem, ctas, stream);
    if (err == cudaSuccess || ctas == 1) {
      EPX_CUDA_CHECK(err, "ht count exchange: launch");
      return;
    }
    // The cluster could not be launched here: the same kernel on one CTA, now and from now on.
    (void)cudaGetLastError();
    g_notify_one_cta.store(true, std::memory_order_relaxed);
    ctas = 1;
  }
}

}  // namespace epx::detail
