// src/cuda/kernels/ht/row_copy.cuh — how a warp moves whole rows fast: a list of rows (src[i] ->
// dst[i], nv vectors each) streamed through a kCopyStages-deep cp.async pipeline in shared
// memory, so ~(kCopyStages - 1) * kCopyVecs * 512 bytes per warp are in flight without holding
// registers (row copies here are latency-bound, not bandwidth-bound, at 16 warps per SM).
//
// Pipeline per lane over the flattened (row, chunk) sequence, chunk = 32 * kCopyVecs vectors:
//   issue(k):  cp.async.cg 16 B x kCopyVecs of chunk k into stage k % kCopyStages; commit
//   step k:    issue(k + kCopyStages - 1); wait_group(kCopyStages - 1) -> chunk k landed in this
//              lane's own slots; store it to dst (plain st.global: local or a peer's LSA address)
// Each lane reads back only the slots it filled itself, so no cross-lane synchronisation. The
// reads are L2 reads (.cg), valid for rows written by a peer after an acquire (generic proxy).
// Rows whose copy unit is narrower than 16 bytes take a plain register loop.
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

inline constexpr int kCopyStages = 5;
inline constexpr int kCopyVecs = 4;                                  // per lane per chunk
inline constexpr int kCopyStageVecs = kCopyStages * kCopyVecs * 32;  // uint4 per warp
inline constexpr size_t kCopySmemBytes = size_t(kHtWarps) * kCopyStageVecs * 16;
inline constexpr int kMaxListRows = 8;  // rows per warp list

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Plain register copy of one row (any copy unit).
template <typename V, bool kLanded>
__device__ __forceinline__ void copy_row_regs(const V* src, V* dst, int64_t nv, int lane) {
  for (int64_t v0 = 0; v0 < nv; v0 += 32 * kCopyUnroll) {
    V r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < nv) r[u] = kLanded ? ld_landed(src + v) : ld_input(src + v);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < nv) dst[v] = r[u];
    }
  }
}

// Copies n rows (src[i] -> dst[i]); `stage` is this warp's kCopyStageVecs uint4 of shared memory.
// All lanes of the warp call it with the same arguments.
template <typename V, bool kLanded>
__device__ void warp_copy_rows(const V* const* src, V* const* dst, int n, int64_t nv, int lane,
                               uint4* stage) {
  if constexpr (sizeof(V) != 16) {
    for (int i = 0; i < n; ++i) copy_row_regs<V, kLanded>(src[i], dst[i], nv, lane);
  } else {
    const int cpr = static_cast<int>((nv + 32 * kCopyVecs - 1) / (32 * kCopyVecs));
    const int total = n * cpr;
    auto issue = [&](int k) {
      if (k < total) {
        const int row = k / cpr, c = k - row * cpr;
        const uint4* s = reinterpret_cast<const uint4*>(src[row]);
        uint4* st = stage + (k % kCopyStages) * (kCopyVecs * 32);
#pragma unroll
        for (int u = 0; u < kCopyVecs; ++u) {
          const int64_t idx = static_cast<int64_t>(c) * 32 * kCopyVecs + u * 32 + lane;
          if (idx < nv) cp_async16(st + u * 32 + lane, s + idx);
        }
      }
      cp_async_commit();  // empty groups keep the count uniform
    };
#pragma unroll
    for (int s = 0; s < kCopyStages - 1; ++s) issue(s);
    for (int k = 0; k < total; ++k) {
      issue(k + kCopyStages - 1);
      cp_async_wait<kCopyStages - 1>();
      const int row = k / cpr, c = k - row * cpr;
      uint4* d = reinterpret_cast<uint4*>(dst[row]);
      const uint4* st = stage + (k % kCopyStages) * (kCopyVecs * 32);
#pragma unroll
      for (int u = 0; u < kCopyVecs; ++u) {
        const int64_t idx = static_cast<int64_t>(c) * 32 * kCopyVecs + u * 32 + lane;
        if (idx < nv) d[idx] = st[u * 32 + lane];
      }
    }
    cp_async_wait<0>();
  }
}

}  // namespace epx::detail
