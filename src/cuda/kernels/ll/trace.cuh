// src/cuda/kernels/ll/trace.cuh — the ll phase trace (profiling builds only: CMake option
// EPX_LL_TRACE -> the EPX_LL_TRACE define). Without the define this header defines only no-op
// macros: no code, no kernel parameter.
//
// With it, thread 0 (and 256) of every CTA of the ll kernels stores, at each phase boundary below,
// a pair {%globaltimer ns, clock64} into a device buffer owned by CudaLl:
//   stamps[op][phase][cta]   op 0 = dispatch, 1 = combine; kLlTracePhases x kLlMaxCtas pairs each
// A phase a CTA does not reach (no tokens, not the last CTA, a failed wait) keeps the value the
// reader cleared it to (0). The reader (bench/ll_gpu_bench.cu --trace) clears the buffer
// before a launch and copies it back after; ll_trace_buffer(device) returns it.
// "Virtual" phases (marked V) are not instants: the kernel adds up the time it spent in a step
// that is interleaved with another (scan / copy in the dispatch receive, row resolution /
// pulls in the combine) and stores the previous real stamp + that sum, so the printed offsets
// read as if the steps had run one after the other.
//
// The overlapped combine's send (combine.cuh O1-O4, docs/design.md §7.6) also stamps each of its
// items (l, b) — one block of rows of local expert l, taken by one CTA — behind the phase words:
//   items[i] = {cta + 1, wait, seen, stored}   i = l * blocks + b (the item's signal), i < 4096
// thread 0's %globaltimer when it starts waiting for the item's signal, when it saw it reached,
// and after the barrier that ends the item's last chunk (every row's stores issued); cta + 1 = 0:
// the item was not sent in this launch. Its phases (op 1): kTrCEntry, kTrCRouted (after O2),
// kTrCSendCopy (after O3, every item of the CTA), kTrCSignal (after O4).
#pragma once

#include <cstdint>

namespace epx::detail {

inline constexpr int kLlTracePhases = 21;
inline constexpr int kLlTraceOps = 2;

// Dispatch phases (op 0).
enum LlDispatchPhase : int {
  kTrDEntry = 0,  // send half: kernel entry (the fused kernel: its entry)
  kTrDFreed,      // after step 1 (dispatch_freed wait)
  kTrDRouted,     // send: the CTA's first token's routing ids loaded and shared (its rows stored,
                  // except in the fused launch: kTrDRoutedSig)
  kTrDStored,     // default send: thread 0 (warp 0) issued its last stores (before the barrier)
  kTrDSent,       // after step 3 (tokens stored) and the barrier before the signal
  kTrDSignal,     // after step 4 (fence + red to every rank)
  kTrDRecvEntry,  // receive half entry (hook kernel entry, or right after the signal)
  kTrDRecvWait,   // after the dispatch_sent wait (units only)
  kTrDScan,       // V: + time in the routing scans / compactions
  kTrDListed,     // the CTA's last unit group listed (its rows' entries in shared memory, barrier)
  kTrDCopied,     // the same group's copy call returned (barrier): src_info, rows, scales
  kTrDCopy,       // after every unit group (rows copied, layout_range / recv_count / stats)
  kTrDExit,       // every CTA: leaving the receive half (or the send kernel)
  kTrDRoutedSig,  // fused launch, warps 8-15: their dispatch_routed releases issued (thread 256)
  kTrDSentWait,   // fused launch, warps 0-7: after their dispatch_sent wait (units only)
  kTrDScanStart,  // the listing team's first scan round begins (units only)
  kTrDListEnd,    // the listing team's last round listed, before the copy's barrier
  kTrDFollowNt,   // fused launch, warps 0-7: past the barrier that tells them NT (units only)
  kTrDFollowBar,  // fused launch, warps 0-7: at the copy's barrier of the last round, before it
  kTrDTeamListed, // fused launch, warps 8-15: every one of them past its last list (a barrier of
                  // theirs that trace builds alone add)
  kTrDNum
};
// Combine phases (op 1).
enum LlCombinePhase : int {
  kTrCEntry = 0,  // send half entry
  kTrCSendCopy,   // after step 1 (copy mode: the rows for the peers) and step 2; overlapped
                  // send: after O3 (the CTA's items)
  kTrCSignal,     // after step 3 (combine_ready releases); overlapped send: after O4
  kTrCRecvEntry,  // receive half entry
  kTrCPrefix,     // after step 4 (per-expert counts of the tokens before the chunk); by default
                  // (steps 4 and 5 overlapped) after the barrier that ends both
  kTrCReadyWait,  // after step 5's wait (combine_ready of every peer)
  kTrCRange,      // after the begin/count table (remote loads of comb_layout)
  kTrCIds,        // V: + time in step 6 (ids, rows, sources) over all chunks
  kTrCPull,       // after step 7 over all chunks (real; = kTrCIds + pull/reduce time)
  kTrCExit,       // every CTA: leaving the receive half (or the send kernel)
  kTrCRouted,     // overlapped send: after O2 (combine_routed of every rank)
  kTrCNum
};
// Not a time: the last phase slot of each op holds {%smid + 1, rows} of the CTA's newest launch
// (EPX_LL_TRACE_SM; rows: the dispatch receive's listed rows, 0 in the combine), so the reader
// can tell whether a late CTA is late for its SM or for its work.
inline constexpr int kLlTraceSmSlot = kLlTracePhases - 1;
static_assert(kTrDNum <= kLlTraceSmSlot && kTrCNum <= kLlTraceSmSlot);

// uint64 words of the buffer: {ns, clock} per (op, phase, cta), then the overlapped send's items
// (kLlTraceItemWords each, from word kLlTraceItemBase).
inline constexpr size_t kLlTraceItemBase = size_t{2} * kLlTraceOps * kLlTracePhases * 128;
inline constexpr int64_t kLlTraceItems = 4096;
inline constexpr size_t kLlTraceItemWords = 4;
inline constexpr size_t kLlTraceWords = kLlTraceItemBase + kLlTraceItemWords * kLlTraceItems;
// The first word ({ns, clock}) of (op, phase, cta): where the kernels write and the readers read
// (constexpr: device code calls it under --expt-relaxed-constexpr, cmake/cuda.cmake).
inline constexpr size_t ll_trace_word(int op, int phase, unsigned cta) {
  return 2 * ((static_cast<size_t>(op) * kLlTracePhases + phase) * 128 + cta);
}

// EPX_LL_TRACE_DUMP=<path> (trace builds; src/cuda/ll.cu): the phase words [0, kLlTraceItemBase)
// of every dispatch call, with its hooks' and the next combine's, appended to <path>.rank<r> as
// one record each (this header, then the words), so that launches inside another program's loop
// (DeepEP's harness) can be traced; `epx_ll_gpu_bench --trace-file <path>.rank<r>` summarises
// them. EPX_LL_TRACE_FROM=<n>: from the n-th dispatch of the buffer (1-based; default 1). Each
// record costs a synchronisation of its calls' streams at the next dispatch call (or at the
// buffer's end), then the copy and file write of its words; calls captured into a CUDA graph are
// not recorded.
struct LlTraceRecord {
  char magic[4];   // "EPX2"
  uint32_t words;  // kLlTraceItemBase
  uint64_t call;   // the buffer's n-th dispatch
  int32_t hook;    // return_recv_hook
  int32_t rank;
  int64_t tokens;   // T
  int64_t dump_ns;  // host ns from the previous record's streams found done to this dispatch's
                    // launch: the dump's own copy, write and clearing (0 when none preceded it),
                    // the part of the GPU's gap before this dispatch that the dump made
};
inline constexpr char kLlTraceMagic[4] = {'E', 'P', 'X', '2'};

#if defined(EPX_LL_TRACE) && defined(__CUDACC__)
__device__ __forceinline__ void ll_trace_put(uint64_t* buf, int op, int phase, uint64_t ns,
                                             uint64_t clk) {
  // Thread 0, and thread 256 for the fused dispatch's warps 8-15 (where both run a phase, the
  // later of two stamps a few cycles apart stays).
  if (buf == nullptr || (threadIdx.x & 255) != 0 || blockIdx.x >= 128) return;
  uint64_t* w = buf + ll_trace_word(op, phase, blockIdx.x);
  w[0] = ns;
  w[1] = clk;
}
__device__ __forceinline__ uint64_t ll_trace_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// A real stamp.
#define EPX_LL_STAMP(params, op, phase) \
  ::epx::detail::ll_trace_put((params).trace, op, phase, ::epx::detail::ll_trace_ns(), clock64())
// The CTA's SM + 1 (0: no stamp) and a count (`count` of thread 0 or 256, the later) into the op's
// kLlTraceSmSlot.
#define EPX_LL_TRACE_SM(params, op, count)                                                  \
  do {                                                                                      \
    uint32_t sm_;                                                                           \
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));                                        \
    ::epx::detail::ll_trace_put((params).trace, op, ::epx::detail::kLlTraceSmSlot, sm_ + 1, \
                                static_cast<uint64_t>(count));                              \
  } while (0)
// A per-CTA count for EPX_LL_TRACE_SM (thread 0's or 256's value is stored).
#define EPX_LL_TRACE_COUNT(name) int64_t name##_n = 0
#define EPX_LL_TRACE_ADD(name, v) (name##_n += (v))
// Accumulators for a virtual phase (declare, start, stop, then store base + sum).
#define EPX_LL_TRACE_DECL(name) uint64_t name##_ns = 0, name##_clk = 0, name##_t0 = 0, name##_c0 = 0
#define EPX_LL_TRACE_BEGIN(name)                \
  do {                                          \
    if ((threadIdx.x & 255) == 0) {             \
      name##_t0 = ::epx::detail::ll_trace_ns(); \
      name##_c0 = clock64();                    \
    }                                           \
  } while (0)
#define EPX_LL_TRACE_END(name)                               \
  do {                                                       \
    if ((threadIdx.x & 255) == 0) {                          \
      name##_ns += ::epx::detail::ll_trace_ns() - name##_t0; \
      name##_clk += clock64() - name##_c0;                   \
    }                                                        \
  } while (0)
// Stores {base_ns + sum, base_clk + sum} where base is the real stamp `base_phase` of this CTA.
#define EPX_LL_STAMP_V(params, op, phase, base_phase, name)                                     \
  do {                                                                                          \
    if ((params).trace != nullptr && (threadIdx.x & 255) == 0 && blockIdx.x < 128) {            \
      const uint64_t* b_ =                                                                      \
          (params).trace + ::epx::detail::ll_trace_word(op, base_phase, blockIdx.x);            \
      ::epx::detail::ll_trace_put((params).trace, op, phase, b_[0] + name##_ns,                 \
                                  b_[1] + name##_clk);                                          \
    }                                                                                           \
  } while (0)
// The overlapped send's item stamps: declare, take (thread 0, when `cond`), store item `i`.
#define EPX_LL_ITEM_DECL(name) uint64_t name##_wait = 0, name##_seen = 0
#define EPX_LL_ITEM_NOW(name, field, cond)                                         \
  do {                                                                             \
    if (threadIdx.x == 0 && (cond)) name##_##field = ::epx::detail::ll_trace_ns(); \
  } while (0)
#define EPX_LL_ITEM_PUT(params, name, i)                                                       \
  do {                                                                                         \
    if ((params).trace != nullptr && threadIdx.x == 0 && (i) < ::epx::detail::kLlTraceItems) { \
      uint64_t* w_ = (params).trace + ::epx::detail::kLlTraceItemBase +                        \
                     ::epx::detail::kLlTraceItemWords * static_cast<size_t>(i);                \
      w_[0] = blockIdx.x + 1;                                                                  \
      w_[1] = name##_wait;                                                                     \
      w_[2] = name##_seen;                                                                     \
      w_[3] = ::epx::detail::ll_trace_ns();                                                    \
    }                                                                                          \
  } while (0)
#else
#define EPX_LL_STAMP(params, op, phase) ((void)0)
#define EPX_LL_TRACE_SM(params, op, count) ((void)0)
#define EPX_LL_TRACE_COUNT(name) ((void)0)
#define EPX_LL_TRACE_ADD(name, v) ((void)0)
#define EPX_LL_ITEM_DECL(name) ((void)0)
#define EPX_LL_ITEM_NOW(name, field, cond) ((void)0)
#define EPX_LL_ITEM_PUT(params, name, i) ((void)0)
#define EPX_LL_TRACE_DECL(name) ((void)0)
#define EPX_LL_TRACE_BEGIN(name) ((void)0)
#define EPX_LL_TRACE_END(name) ((void)0)
#define EPX_LL_STAMP_V(params, op, phase, base_phase, name) ((void)0)
#endif

#if defined(EPX_LL_TRACE)
// The trace buffer of the newest live CudaLl on `device` (device memory, kLlTraceWords uint64),
// or null; _of_thread: the newest the calling thread made (ranks sharing a GPU). Bench only
// (src/cuda/ll.cu).
uint64_t* ll_trace_buffer(int device);
uint64_t* ll_trace_buffer_of_thread();
#endif

}  // namespace epx::detail
