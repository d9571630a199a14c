// src/cuda/kernels/ht/bulk_copy.cuh — Hopper's bulk-copy engine (cp.async.bulk, 1-D TMA) and
// its mbarriers, for the zero-copy combine's staged reducer (combine_staged.cuh): a bulk load
// moves up to one chunk (kilobytes) global -> shared per instruction and needs no registers.
//
// Memory ordering (generic proxy = ordinary loads/stores and the sync.cuh flags; async proxy =
// the bulk copies): data acquired by a generic-proxy acquire is read by a bulk load only after
// the issuing thread's fence.proxy.async; a shared-memory stage read by generic loads is
// refilled by a bulk load only after fence.proxy.async.shared::cta. Built below sm_90 the
// instructions compile to a trap (the host never selects the staged reducer there).
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define EPX_BULK_ASM(...) asm volatile(__VA_ARGS__)
#else
#define EPX_BULK_ASM(...) __trap()  // the host never selects bulk copies below sm_90
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  EPX_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Makes the mbarrier inits visible to the async proxy (the bulk copies complete_tx on them).
__device__ __forceinline__ void fence_mbar_init() {
  EPX_BULK_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  EPX_BULK_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  EPX_BULK_ASM(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// Bounded like every epx wait (a load that never lands must not hang the kernel): on timeout it
// reports (kWaitBulkCopy), raises the abort word and returns false. It does not stop on another
// wait's abort: the load is this warp's own (local memory, it lands within microseconds), and
// leaving first could end the CTA with a bulk load still writing its shared memory.
__device__ __forceinline__ bool mbar_wait(uint32_t bar, uint32_t parity, const WaitContext& ctx) {
  if (mbar_try_wait(bar, parity)) return true;
  const uint64_t start = globaltimer_ns();
  for (uint32_t spins = 0;; ++spins) {
    if (mbar_try_wait(bar, parity)) return true;
    if ((spins & 63u) == 63u) {
      if (globaltimer_ns() - start > ctx.timeout_ns) {
        record_timeout(ctx, ctx.rank, kWaitBulkCopy, parity);
        return false;
      }
    }
  }
}
__device__ __forceinline__ void bulk_load(uint32_t stage, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  EPX_BULK_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(stage),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Orders this thread's generic-proxy and async-proxy accesses (all state spaces).
__device__ __forceinline__ void fence_proxy_async() {
  EPX_BULK_ASM("fence.proxy.async;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  EPX_BULK_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

extern __shared__ __align__(128) unsigned char ht_dyn_smem[];

}  // namespace epx::detail
