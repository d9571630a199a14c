// src/cuda/kernels/ht/bulk_copy.cuh — row copies through Hopper's bulk-copy engine (1-D TMA):
// the HtCopyMode::kBulk path of the ht dispatch (cuda/tuning.h; docs/perf-cuda-ht.md, design v4).
//
// Why: the warp copy loops (copy_row) move ~35 GB/s per SM, whatever the bytes in flight per
// warp; a bulk copy moves up to one chunk (kilobytes) per instruction, global -> shared and
// shared -> global (the peer's NVLink-mapped buffer is an ordinary global address).
//
// One pipeline per WARP (each warp already owns whole rows in the dispatch; per-warp state needs
// no CTA barrier): a ring of `stages` shared-memory chunks of `chunk` bytes in dynamic shared
// memory, one mbarrier per stage. Only lane 0 calls it (the other lanes go on with scales and
// metadata). A row is cut into chunks; per chunk:
//   load:   mbarrier.arrive.expect_tx(bytes) ; cp.async.bulk global -> stage (complete_tx)
//   retire: mbarrier.try_wait.parity ; cp.async.bulk stage -> global (bulk_group) ; commit_group
// At most stages - 1 loads are pending, so a stage being refilled was stored at least one retire
// earlier: cp.async.bulk.wait_group.read N (N >= 1 newer groups may stay in flight) before the
// refill. Loads never cross a flush(): the caller flushes before any acquire it depends on.
//
// Memory ordering (generic proxy = ordinary loads/stores and the sync.cuh flags; async proxy =
// the bulk copies):
//   * Stores -> signal (sender): drain() = retire every load, then cp.async.bulk.wait_group 0
//     (all writes performed and visible to this thread; .read would only say the stage was read),
//     then fence.proxy.async (orders those async-proxy writes before this thread's later
//     generic-proxy operations), then the caller's __syncwarp + fence.acq_rel.sys + red.add
//     (sync.cuh's release pattern, cumulative over what lane 0 observed).
//   * Acquire -> load (receiver): the peer's rows are acquired by ld.acquire.sys of the block
//     counter (thread 0) + __syncthreads; lane 0 then executes fence.proxy.async before issuing
//     bulk loads of those rows, so the async proxy reads no older data than the acquire saw.
//   * Ready -> stores (sender): a peer's slots are written only after its ready flag is acquired
//     (wait_peer_ready + __syncthreads); lane 0 executes fence.proxy.async before its first bulk
//     store, so the async-proxy writes are ordered after the acquire (no write-after-read on the
//     rows the peer read in its previous operation).
//   * Inputs (x) were written before the kernel started: no fence needed.
//   * Stage reuse is entirely within the async proxy (bulk store reads, bulk load writes), ordered
//     by wait_group.read and the mbarrier; no generic access ever touches a stage. A
//     fence.proxy.async.shared::cta after each mbarrier wait is cheap insurance that the store
//     reads what the load wrote.
//   * End of kernel: every warp drains (+ fence.proxy.async) before finish_operation, so no bulk
//     read of a landed row is outstanding when the peers are told they may overwrite the region
//     (its release), and no store is outstanding when the CTA's shared memory goes away.
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

// Bytes of per-stage bookkeeping after the data: mbarrier (8) + destination (8) + size (4) + pad.
inline constexpr int kBulkStageMetaBytes = 24;

// Dynamic shared memory one bulk-mode dispatch CTA needs.
EPX_HT_HD int bulk_smem_bytes(int stages, int chunk) {
  return kHtWarps * stages * (chunk + kBulkStageMetaBytes);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define EPX_BULK_ASM(...) asm volatile(__VA_ARGS__)
#else
#define EPX_BULK_ASM(...) __trap()  // the host never selects kBulk below sm_90
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
        record_error(ctx, kDevErrTimeout, ctx.rank, kWaitBulkCopy, parity);
        atomicExch(&ctx.state->abort, 1u);
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
__device__ __forceinline__ void bulk_store(void* dst, uint32_t stage, uint32_t bytes) {
  EPX_BULK_ASM("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(stage),
               "r"(bytes)
               : "memory");
  EPX_BULK_ASM("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  EPX_BULK_ASM("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  EPX_BULK_ASM("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Orders this thread's generic-proxy and async-proxy accesses (all state spaces).
__device__ __forceinline__ void fence_proxy_async() {
  EPX_BULK_ASM("fence.proxy.async;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_smem() {
  EPX_BULK_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

inline constexpr int kBulkMaxStages = 8;

extern __shared__ __align__(128) unsigned char ht_dyn_smem[];

// One warp's pipeline (see the top of this file). Construct in every lane; call the methods
// from lane 0 only. rows: src, dst 16-byte aligned and bytes a multiple of 16 (the host selects
// kBulk only then).
class BulkPipe {
 public:
  __device__ void init(int warp, int stages, int chunk) {
    stages_ = stages;
    chunk_ = chunk;
    data_ = smem_u32(ht_dyn_smem) + static_cast<uint32_t>(warp * stages * chunk);
    meta_ = ht_dyn_smem + kHtWarps * stages * chunk + warp * stages * kBulkStageMetaBytes;
    for (int s = 0; s < stages; ++s) mbar_init(bar(s));
    fence_mbar_init();
  }

  // Queues the copy of `bytes` from src to dst; returns once every chunk's load is issued (some
  // chunks may still be loading: flush() or drain() to finish them).
  __device__ void copy(const char* src, char* dst, int64_t bytes, const WaitContext& w) {
    if (broken_) return;
    for (int64_t off = 0; off < bytes; off += chunk_) {
      const uint32_t n = static_cast<uint32_t>(min(static_cast<int64_t>(chunk_), bytes - off));
      if (pending_ == stages_ - 1) retire(w);
      if (broken_) return;
      // The stage's previous chunk was stored `stages_ - 1 - pending_` (>= 1) groups ago.
      wait_stage_read(stages_ - 1 - pending_);
      const uint32_t b = bar(head_);
      mbar_arrive_expect_tx(b, n);
      bulk_load(stage(head_), src + off, n, b);
      *dst_slot(head_) = dst + off;
      *size_slot(head_) = n;
      head_ = head_ + 1 == stages_ ? 0 : head_ + 1;
      ++pending_;
    }
  }
  // Every issued load is waited for and its store issued (stores may still be in flight).
  __device__ void flush(const WaitContext& w) {
    while (pending_ > 0 && !broken_) retire(w);
  }
  // Every copy complete: stores performed and visible to this thread (async proxy); callers that
  // signal a peer follow with fence_proxy_async() and the release pattern.
  __device__ void drain(const WaitContext& w) {
    flush(w);
    bulk_wait_all();
  }

 private:
  __device__ uint32_t stage(int s) const { return data_ + static_cast<uint32_t>(s * chunk_); }
  __device__ uint32_t bar(int s) const { return smem_u32(meta_ + s * kBulkStageMetaBytes); }
  __device__ char** dst_slot(int s) const {
    return reinterpret_cast<char**>(meta_ + s * kBulkStageMetaBytes + 8);
  }
  __device__ uint32_t* size_slot(int s) const {
    return reinterpret_cast<uint32_t*>(meta_ + s * kBulkStageMetaBytes + 16);
  }
  __device__ void retire(const WaitContext& w) {
    const int s = tail_;
    if (!mbar_wait(bar(s), (phase_ >> s) & 1u, w)) {
      broken_ = true;  // reported; the kernel winds down through its bounded waits
      pending_ = 0;
      return;
    }
    phase_ ^= 1u << s;
    fence_proxy_async_smem();
    bulk_store(*dst_slot(s), stage(s), *size_slot(s));
    tail_ = tail_ + 1 == stages_ ? 0 : tail_ + 1;
    --pending_;
  }
  // cp.async.bulk.wait_group.read takes an immediate: at most `newer` groups may stay pending.
  __device__ static void wait_stage_read(int newer) {
    switch (newer) {
      case 0:
        bulk_wait_read<0>();
        break;
      case 1:
        bulk_wait_read<1>();
        break;
      case 2:
        bulk_wait_read<2>();
        break;
      case 3:
        bulk_wait_read<3>();
        break;
      case 4:
        bulk_wait_read<4>();
        break;
      case 5:
        bulk_wait_read<5>();
        break;
      case 6:
        bulk_wait_read<6>();
        break;
      default:
        bulk_wait_read<7>();
        break;  // newer <= kBulkMaxStages - 1
    }
  }

  bool broken_ = false;
  uint32_t data_ = 0;
  unsigned char* meta_ = nullptr;
  int stages_ = 2, chunk_ = 16;
  int head_ = 0, tail_ = 0, pending_ = 0;  // next stage to load, next to retire, loads pending
  uint32_t phase_ = 0;                     // bit s: parity of stage s's next completion
};

}  // namespace epx::detail
