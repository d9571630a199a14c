// src/cuda/kernels/ht/trace.cuh — the ht phase trace (profiling builds only: CMake option
// EPX_HT_TRACE -> the EPX_HT_TRACE define). Without the define: no-op macros, no kernel parameter.
//
// With it, thread 0 of each of the first kHtTraceCtas CTAs of the ht dispatch kernel and of the
// staged zero-copy combine kernel (and thread 0 of the count exchange's first CTA) stores
// %globaltimer (ns) at each phase below into a device buffer owned by CudaBuffer:
// stamps[op][phase][cta], op 0 = dispatch, 1 = combine, 2 = count exchange. Thread 0 is
// lane 0 of warp 0, so the "work" phases are warp 0's progress; kHtTrDone follows a CTA-wide
// barrier. The reader (bench/ht_gpu_bench.cc --trace) clears the buffer before a call and
// reads it after; ht_trace_buffer(device) returns it (ht_trace_buffer_of_thread: the newest made
// by the calling thread, for rank threads sharing a device). A phase a CTA does not reach stays 0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx::detail {

inline constexpr int kHtTracePhases = 8;
inline constexpr int kHtTraceCtas = 64;
inline constexpr int kHtTraceOps = 3;  // dispatch, combine, count exchange
inline constexpr size_t kHtTraceWords = size_t{kHtTraceOps} * kHtTracePhases * kHtTraceCtas;

enum HtTracePhase : int {
  kHtTrEntry = 0,  // kernel entry (after pdl_begin)
  kHtTrStart,      // dispatch: every peer's ready acquired (senders may write); combine: warp 0's
                   // first token set up (its peers' yready acquired)
  kHtTrWork,       // dispatch: warp 0 sent its rows; combine: warp 0 reduced its tokens
  kHtTrRecv,       // dispatch: the CTA's receive items done (blocks acquired); combine: unused
  kHtTrDone,       // every warp of the CTA done (after a CTA barrier), before finish_operation
  kHtTrExit,       // leaving the kernel (the last CTA: after the counter reset, the ready signal
                   // and, for the combine, the end barrier)
  // The count exchange (op 2, one CTA) stamps the same slots: entry; start = pass 1 done; work =
  // every peer's counts received; recv = N published to the host (ticket); done = pass 2 done;
  // exit = after its finish_operation.
  kHtTrNum,
  // The count exchange's two more: its set-up done (shared counters zeroed), pass 1's first
  // round of kNotifyThreads tokens done.
  kHtTrNotifySetUp = kHtTrNum,
  kHtTrNotifyRound0,
};
static_assert(kHtTrNotifyRound0 < kHtTracePhases);

#if defined(EPX_HT_TRACE) && defined(__CUDACC__)
__device__ __forceinline__ void ht_trace_put(uint64_t* buf, int op, int phase) {
  const int cta = static_cast<int>(blockIdx.x);
  if (buf == nullptr || threadIdx.x != 0 || cta >= kHtTraceCtas) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  buf[(static_cast<size_t>(op) * kHtTracePhases + phase) * kHtTraceCtas + cta] = t;
}
#define EPX_HT_STAMP(params, op, phase) ::epx::detail::ht_trace_put((params).trace, op, phase)
// A CTA barrier that exists only in trace builds (so kHtTrDone means every warp).
#define EPX_HT_TRACE_SYNC() __syncthreads()
#else
#define EPX_HT_STAMP(params, op, phase) ((void)0)
#define EPX_HT_TRACE_SYNC() ((void)0)
#endif

#if defined(EPX_HT_TRACE)
// The trace buffer (device memory, kHtTraceWords uint64) of the newest live cuda Buffer on
// `device`, or null. Bench only (src/cuda/cuda_buffer.cc).
uint64_t* ht_trace_buffer(int device);
// The trace buffer of the newest live cuda Buffer the calling thread made, or null (bench only).
uint64_t* ht_trace_buffer_of_thread();
#endif

}  // namespace epx::detail
