// bench/sync_probe.cu — a diagnostic for issue 26 (not a test, not in ctest): what the primitives
// of the ll kernels' fixed chain cost on this GPU, each alone, so that a phase of the traces
// (docs/perf.md §5 items 52-56) can be set against the sum of its dependent steps. One GPU.
//
// Each row is timed inside its kernel with clock64 (SM cycles) and %globaltimer (ns) and printed
// in both, beside the SM clock they imply:
//   alu        one thread: a chain of 4096 dependent 32-bit integer multiply-adds (cycles each)
//   shfl       one warp: a chain of 1024 dependent __shfl_xor_sync, each with one add
//   redux      the same with __reduce_max_sync (redux.sync.max.u32: a warp's maximum in one
//              instruction, where a butterfly takes 5 shuffles, 4 for a half-warp's group)
//   smem       one thread: a pointer chase through 1024 shared-memory words (with each hop's
//              address arithmetic, as in real code)
//   l2 <load>  one thread: a pointer chase through 2048 lines of a 4 MB buffer written by the
//              previous kernel (L2-resident), each hop one 32-bit load through the kernels' own
//              helpers (cuda/kernels/sync.cuh): ld_landed (ld.cg), ld_relaxed_sys,
//              ld_acquire_gpu or ld_acquire_sys (the ll polls)
//   hbm        the same with ld.cg through a 2 GB buffer (beyond L2, which a 512 MB write
//              flushes first; TLB misses included), each launch going on where the previous one
//              stopped (lines not visited before)
//   tlb <P>    the l2 chase with one line per 2 MB page over P pages (8 ... 16384, up to 32 GB;
//              one untimed lap first): the cost of a translation that misses each TLB level, the
//              lines in L2
//   tlb first touch   one CTA reads a line of each of 64 (or 8192) other pages, then its thread 0
//              reaches 8 new pages' L2-resident lines: loads (a chase) or stores and a
//              fence.acq_rel.gpu; cold, or 4 us after a prefetch.L2 / a load of each (whether a
//              prefetch warms the translation), or after the prefetch and 32 other pages
//   ifetch     1 warp, then 1, 2 and 4 warps per scheduler (4, 8, 16 warps) of one CTA, each
//              running independent fma.rn.f32 (no dependency stall): a loop of 64-instruction
//              bodies (the issue rate, its code in the L0 cache) against 1,024 and 4,096 of them
//              straight-line (16 and 64 KB of code, each instruction fetched once per pass), right
//              after a 256 KB evictor on every SM and again: cycles per instruction per warp, what
//              code run once (the ll phases' straight-line stretches) pays for its fetch; with 8
//              and 16 warps also 4 KB blocks, and two teams of half the warps each on its own
//              block (4 or 16 KB), as the fused dispatch's teams run two code paths on the same
//              schedulers; with 1 and 8 warps a dependent chain (one accumulator), looped and
//              straight-line, again: whether fetch adds to code that stalls on its operands;
//              with 1 warp also 16 taken jumps (ijump_kernel), each over 2 KB of code it never
//              runs, after the evictor and again: cycles per jump, what a jump into code out of
//              the SM's instruction caches costs (the fused dispatch's sending warps jump over
//              the listing's code on their way to the copy)
//   bar512 / bar256   bar.sync of 512 threads (every warp of an ll CTA) / a named barrier of 256
//              (one team of the fused dispatch), all arriving together: cycles per barrier
//   fence <scope> <bytes>   C CTAs of 512 threads each store <bytes> (16-byte stores, the whole
//              CTA), __syncthreads, then thread 0 times fence.acq_rel.<scope> (what every ll
//              release pays before its red.add: the CTA's stores acknowledged)
//   flag       the ll grid flag: C CTAs each fence.acq_rel.gpu + red.add.relaxed.sys one counter
//              (after __syncthreads), then thread 0 polls it with ld.acquire.sys until it holds
//              C * epoch; per CTA, from the latest CTA's red (timed after its fence) to this CTA
//              seeing the count (the "flag seen" stamps of the traces), median and max over CTAs
//   flags      the same without an atomic: each CTA releases its own flag word, every CTA's
//              threads c < C poll flag c, then meet at a barrier (from the latest CTA's store)
//   neighbour  one CTA: thread 0's L2 chase (ld_landed, or __ldg as the send's x loads), or 8
//              warps streaming 16-byte loads and stores, with no other thread on the SM, with a
//              thread of warp 8 spinning on a flag with ld.acquire.sys (what wait_flag spins on:
//              each spin an L1 invalidate, CCTL.IVALL), or with ld.relaxed.sys: whether an ll
//              wait slows the other team's loads beside it (the fused dispatch's and the
//              combine's); first, and alone with --neighbour-only
// The grid rows (fence, flag, flags) hold one CTA per SM as the ll kernels do (a dynamic
// shared-memory request of more than half an SM's). Short rows are read in cycles: %globaltimer
// steps (printed first, with the SM clock of a 2 ms spin) are too coarse for them; ns = cycles /
// that clock. Rows: the median over `--iters` launches (after one warm-up), of the median CTA where
// several.
//   epx_sync_probe [--ctas C] [--iters I] [--neighbour-only]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_common.cuh"
#include "bench/trace_clock.cuh"
#include "cuda/kernels/sync.cuh"
#include "gpu/gpu_support.h"

namespace {

constexpr int kThreads = 512;

// The kernels' own primitives (cuda/kernels/sync.cuh), so each row times what they run.
using epx::bench::median;
using epx::detail::fence_acq_rel;
using epx::detail::ld_acquire_gpu;
using epx::detail::ld_acquire_sys;
using epx::detail::ld_landed;
using epx::detail::ld_relaxed_sys;
using epx::detail::red_add_relaxed_sys;
using epx::detail::seq_reached;
using epx::detail::st_relaxed_sys;
__device__ __forceinline__ uint64_t now_ns() {
  return epx::detail::globaltimer_ns();
}

// out[0..1]: {ns, cycles} of the timed region (or per CTA: out + 2 * blockIdx.x).
__device__ __forceinline__ void put(uint64_t* out, uint64_t ns, int64_t clk) {
  out[0] = ns;
  out[1] = static_cast<uint64_t>(clk);
}

// A use of a chain's last result before the end stamps, so that they wait for it (an unused load
// result is only awaited where it is used).
template <typename V, typename S>
__device__ __forceinline__ void settle(V v, S* sink) {
  if (v == static_cast<V>(0xfffffffeu)) *sink = static_cast<S>(v);
}

__global__ void alu_kernel(uint64_t* out, uint32_t seed, uint32_t* sink) {
  uint32_t a = seed;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
#pragma unroll 64
  for (int i = 0; i < 4096; ++i) asm volatile("mad.lo.u32 %0, %0, 3, %1;" : "+r"(a) : "r"(i));
  settle(a, sink);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  put(out, t1 - t0, c1 - c0);
  *sink = a;
}

__global__ void shfl_kernel(uint64_t* out, uint32_t seed, uint32_t* sink) {
  uint32_t a = seed + threadIdx.x;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
#pragma unroll 16
  for (int i = 0; i < 1024; ++i) a = __shfl_xor_sync(0xffffffffu, a, 1 + (i & 15)) + 1;
  settle(a, sink);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  if (threadIdx.x == 0) {
    put(out, t1 - t0, c1 - c0);
    *sink = a;
  }
}

__global__ void redux_kernel(uint64_t* out, uint32_t seed, uint32_t* sink) {
  uint32_t a = seed + threadIdx.x;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
#pragma unroll 16
  for (int i = 0; i < 1024; ++i) a = __reduce_max_sync(0xffffffffu, a) + threadIdx.x;
  settle(a, sink);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  if (threadIdx.x == 0) {
    put(out, t1 - t0, c1 - c0);
    *sink = a;
  }
}

__global__ void smem_kernel(uint64_t* out, const uint32_t* perm, uint32_t* sink) {
  __shared__ uint32_t next[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) next[i] = perm[i];
  __syncthreads();
  if (threadIdx.x != 0) return;
  uint32_t j = 0;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
  for (int i = 0; i < 1024; ++i) j = *static_cast<volatile uint32_t*>(&next[j]);
  settle(j, sink);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  put(out, t1 - t0, c1 - c0);
  *sink = j;
}

enum Load : int { kLdCg = 0, kLdRelaxedSys, kLdAcquireGpu, kLdAcquireSys, kLoads };
const char* const kLoadNames[kLoads] = {"ld_landed (ld.cg)", "ld_relaxed_sys", "ld_acquire_gpu",
                                        "ld_acquire_sys"};

template <int kLoad>
__device__ __forceinline__ uint32_t load_next(const uint32_t* p) {
  if constexpr (kLoad == kLdCg)
    return ld_landed<uint32_t>(p);
  else if constexpr (kLoad == kLdRelaxedSys)
    return ld_relaxed_sys(p);
  else if constexpr (kLoad == kLdAcquireGpu)
    return ld_acquire_gpu(p);
  else
    return ld_acquire_sys(p);
}

// The chain: word 0 of line i holds the index of the next line (lines kStride 32-bit words
// apart: 64, 256 bytes, in the l2 and hbm rows, kPageStride in the tlb rows; 32-bit words as the
// kernels' flags). A compile-time stride: each hop's address is one multiply-add.
template <int kLoad, uint64_t kStride = 64>
__global__ void chase_kernel(uint64_t* out, const uint32_t* lines, uint64_t start, int hops,
                             uint64_t* sink, int untimed) {
  uint32_t j = static_cast<uint32_t>(start);
  for (int i = 0; i < untimed; ++i) j = load_next<kLoad>(lines + kStride * j);  // (a lap first)
  settle(j, sink);
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
  for (int i = 0; i < hops; ++i) j = load_next<kLoad>(lines + kStride * j);
  settle(j, sink);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  put(out, t1 - t0, c1 - c0);
  *sink = j;
}

// Writes the chain (the L2-resident case: this kernel's stores are what the chase then reads).
__global__ void chain_write_kernel(uint32_t* lines, const uint64_t* next, int64_t n,
                                   uint64_t stride = 64) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    lines[stride * i] = static_cast<uint32_t>(next[i]);
}

// The tlb rows' buffer: one line per 2 MB page (the pages of a large cudaMalloc; +256 bytes per
// page so the lines do not share L2 sets): kTlbPages pages for the ladder and the sweeps, then 8
// target pages, then 32 more that the "then 32 other pages" rows touch between warm-up and use.
constexpr uint64_t kPageStride = ((uint64_t{2} << 20) + 256) / sizeof(uint32_t);
constexpr int64_t kTlbPages = 16384;  // 32 GB
constexpr int64_t kTlbTargets = kTlbPages, kTlbOthers = kTlbPages + 8, kTlbAlloc = kTlbPages + 40;

// A CTA's first touch of 8 pages (the ll receive's first access to an output or a row map): all
// threads first read one line of each of `sweep` other pages (this SM's translations of the
// targets gone), then thread 0 warms the 8 target pages (kWarm 1: prefetch.L2 of each line, as
// branch warm-pages; 2: a load of each, waited for; 3: the prefetch, then all threads read one
// line of each of 32 other pages, as the send touches its own between the warm-up and the
// receive; 0: nothing), waits 4 us, and times either a chase through the 8 targets' lines (each
// visited once) or (kStore) a store to each and the fence that waits for them, as the receive's
// end waits for its stores.
template <int kWarm, bool kStore>
__global__ void tlb_touch_kernel(uint64_t* out, const uint32_t* pages, int sweep, uint32_t* sink) {
  uint32_t* targets = const_cast<uint32_t*>(pages) + kPageStride * kTlbTargets;
  uint32_t acc = 0;
  for (int i = threadIdx.x; i < sweep; i += blockDim.x)
    acc += ld_landed<uint32_t>(pages + kPageStride * i);
  __syncthreads();
  if (threadIdx.x == 0) {
    if constexpr (kWarm == 1 || kWarm == 3) {
      for (int i = 0; i < 8; ++i)
        asm volatile("prefetch.L2 [%0];" ::"l"(targets + kPageStride * i) : "memory");
    } else if constexpr (kWarm == 2) {
      for (int i = 0; i < 8; ++i) acc += ld_landed<uint32_t>(targets + kPageStride * i);
    }
  }
  if constexpr (kWarm == 3) {
    if (threadIdx.x < 32)
      acc += ld_landed<uint32_t>(pages + kPageStride * (kTlbOthers + threadIdx.x));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t spin = now_ns() + 4000;
    while (now_ns() < spin) {
    }
    uint32_t j = 0;
    const uint64_t t0 = now_ns();
    const int64_t c0 = clock64();
    if constexpr (kStore) {
      for (int i = 0; i < 8; ++i) targets[kPageStride * i + 1] = acc;  // word 1: not the chain's
      fence_acq_rel(true);
    } else {
      for (int i = 0; i < 8; ++i) j = ld_landed<uint32_t>(targets + kPageStride * j);
      settle(j, sink);
    }
    const int64_t c1 = clock64();
    const uint64_t t1 = now_ns();
    put(out, t1 - t0, c1 - c0);
    acc += j;
  }
  settle(acc, sink);  // (keeps the loads)
}

// Instruction issue and fetch: the first `warps` warps of one CTA (warp w on scheduler w % 4)
// each run N independent fma.rn.f32 (8 accumulators: no dependency stall, so at best one per
// cycle per scheduler), either as a loop (kN / 64 laps of a 64-instruction body, in the
// scheduler's L0 cache after the first lap) or straight-line (kN instructions, 16 B each, every
// one fetched once per pass), twice in one launch: pass 0 right after a launch of the evictor
// (another instantiation of this kernel, 256 KB of straight-line code, on every SM: this code is
// out of the SMs' instruction caches, in L2), pass 1 the same code again.
// out[2 * (pass * 16 + w)] = the warp's cycles.
// kTeams = 2: the second half of the warps runs a second straight-line block of the same size
// (other operands, so other code) beside the first half's, as the fused ll dispatch's two teams
// run two code paths on the same schedulers: whether each scheduler's L0 cache holds both.
// kDep: one accumulator, so every fma waits for the one before (a dependent chain, as most of the
// ll send's instructions): whether fetching code run once adds to a warp that stalls anyway.
template <bool kStraight, int kN, int kSalt = 0, int kTeams = 1, bool kDep = false>
__global__ void __launch_bounds__(kThreads, 1)
    ifetch_kernel(uint64_t* out, float m, float c, float* sink, int warps) {
  const int w = static_cast<int>(threadIdx.x) / 32;
  if (w >= warps) return;
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = static_cast<float>(threadIdx.x + j + kSalt);
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    __syncwarp();
    const int64_t c0 = clock64();
    if constexpr (kStraight) {
      if (kTeams == 2 && w >= warps / 2) {
#pragma unroll
        for (int i = 0; i < kN; ++i) a[kDep ? 0 : i & 7] = fmaf(a[kDep ? 0 : i & 7], c, m);
      } else {
#pragma unroll
        for (int i = 0; i < kN; ++i) a[kDep ? 0 : i & 7] = fmaf(a[kDep ? 0 : i & 7], m, c);
      }
    } else {
#pragma unroll 1
      for (int o = 0; o < kN / 64; ++o) {
#pragma unroll
        for (int i = 0; i < 64; ++i) a[kDep ? 0 : i & 7] = fmaf(a[kDep ? 0 : i & 7], m, c);
      }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += a[j];
    settle(s, sink);
    const int64_t c1 = clock64();
    if ((threadIdx.x & 31) == 0) out[2 * (pass * 16 + w)] = static_cast<uint64_t>(c1 - c0);
  }
}

// Taken jumps into code not yet fetched: one warp runs kJ blocks of 8 independent fma, each
// followed by a block of kGap fma (kGap * 16 B of code) that `skip` (true at run time, hidden from
// the front end, so no version without the gaps is made: the SASS has the 16 branches 2.2 KB
// apart, CUDA 13.0) jumps over, twice in one launch as ifetch_kernel: pass 0 right after the
// evictor, pass 1 again. Each jump lands past what the fetch has streamed ahead, as the fused
// dispatch's sending warps jump over the listing team's scan and list (docs/perf.md §5 item 79).
// out[2 * pass * 16] = the warp's cycles (ifetch_kernel's place for warp 0).
template <int kJ, int kGap>
__global__ void __launch_bounds__(kThreads, 1)
    ijump_kernel(uint64_t* out, float m, float c, float* sink, int skip) {
  if (threadIdx.x >= 32) return;
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = static_cast<float>(threadIdx.x + j);
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    __syncwarp();
    const int64_t c0 = clock64();
#pragma unroll
    for (int b = 0; b < kJ; ++b) {
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = fmaf(a[i], m, c);
      int v = skip;
      asm volatile("mov.b32 %0, %0;" : "+r"(v));
      if (v == 0) {
#pragma unroll
        for (int i = 0; i < kGap; ++i) a[i & 7] = fmaf(a[i & 7], c, m);
      }
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += a[j];
    settle(s, sink);
    const int64_t c1 = clock64();
    if (threadIdx.x == 0) out[2 * pass * 16] = static_cast<uint64_t>(c1 - c0);
  }
}

template <bool kNamed>
__global__ void bar_kernel(uint64_t* out) {
  constexpr int kBars = 1024;
  if (kNamed && threadIdx.x >= 256) return;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
#pragma unroll 8  // (fully unrolled, 16 KB of code would time its fetch)
  for (int i = 0; i < kBars; ++i) {
    if constexpr (kNamed)
      asm volatile("bar.sync 2, 256;" ::: "memory");
    else
      __syncthreads();
  }
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  if (threadIdx.x == 0) put(out, t1 - t0, c1 - c0);
}

template <bool kSys>
__global__ void fence_kernel(uint64_t* out, uint4* dst, int64_t bytes_per_cta) {
  uint4* mine = dst + blockIdx.x * (bytes_per_cta / 16);
  for (int64_t i = threadIdx.x; i < bytes_per_cta / 16; i += blockDim.x)
    mine[i] = make_uint4(static_cast<uint32_t>(i), blockIdx.x, 1u, 2u);
  __syncthreads();
  if (threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  const int64_t c0 = clock64();
  fence_acq_rel(!kSys);
  const int64_t c1 = clock64();
  const uint64_t t1 = now_ns();
  put(out + 2 * blockIdx.x, t1 - t0, c1 - c0);
}

// out per CTA: {red issued (ns), count seen (ns)}.
__global__ void flag_kernel(uint64_t* out, uint32_t* counter, uint32_t want) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  fence_acq_rel(true);
  const uint64_t t_red = now_ns();  // after the fence: the red's own issue
  red_add_relaxed_sys(counter, 1u);
  uint32_t v = 0;
  const uint64_t give_up = t_red + 100000000ull;  // 100 ms: a probe never hangs
  do {
    v = ld_acquire_sys(counter);
  } while (!seq_reached(v, want) && now_ns() < give_up);
  const uint64_t t_seen = now_ns();
  out[2 * blockIdx.x] = t_red;
  out[2 * blockIdx.x + 1] = seq_reached(v, want) ? t_seen : 0;
}

// The alternative without an atomic: CTA b releases its own word flags[b] = epoch (fence +
// relaxed store, one 32-byte sector per flag), then threads c < C of every CTA poll flags[c]
// (ld.acquire.sys) and the CTA meets at a barrier. out per CTA: {flag stored (ns), all seen (ns)}.
__global__ void flags_kernel(uint64_t* out, uint32_t* flags, uint32_t epoch) {
  __shared__ uint64_t s_signal;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel(true);
    s_signal = now_ns();
    st_relaxed_sys(flags + 8 * blockIdx.x, epoch);
  }
  bool ok = true;
  if (threadIdx.x < gridDim.x) {
    const uint32_t* f = flags + 8 * threadIdx.x;
    const uint64_t give_up = now_ns() + 100000000ull;  // 100 ms: a probe never hangs
    uint32_t v = 0;
    do {
      v = ld_acquire_sys(f);
    } while (!seq_reached(v, epoch) && (ok = now_ns() < give_up));
  }
  ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = s_signal;
    out[2 * blockIdx.x + 1] = ok ? now_ns() : 0;
  }
}


// Neighbour poll: whether a thread spinning on a flag, as every ll wait does (thread 0 of a team,
// one load per round trip), slows the loads of the other warps on its SM. kPoll 0: no poller;
// 1: ld.acquire.sys per spin (LDG.E.STRONG.SYS and CCTL.IVALL, an L1 invalidate, each time: what
// wait_flag spins on); 2: ld.relaxed.sys per spin (no invalidate). The poller is thread 256
// (warp 8) and spins until the workers' end (their release of `want` into *flag, 100 ms at
// most). The workers, timed by thread 0: kWork 0, thread 0 chases `hops` L2-resident lines with
// ld_landed (the receive's loads of landed rows); 1, the same chase through __ldg (the read-only
// path of the send's x loads, through L1); 2, warps 0-7 stream: per round each thread loads 8
// 16-byte vectors of `src` through __ldg, then stores them to `dst` (`hops` rounds over distinct
// L2-resident lines; the send's and the copy's pattern), a barrier of the 256 threads after the
// last round.
template <int kPoll, int kWork>
__global__ void neighbour_kernel(uint64_t* out, const uint32_t* lines, int hops, const uint4* src,
                                 uint4* dst, uint32_t* flag, uint32_t want, uint64_t* sink) {
  const int w = static_cast<int>(threadIdx.x) >> 5;
  if (w == 8) {
    if (kPoll != 0 && threadIdx.x == 256) {
      const uint64_t give_up = now_ns() + 100000000ull;  // a probe never hangs
      uint32_t v = 0;
      do {
        v = kPoll == 1 ? ld_acquire_sys(flag) : ld_relaxed_sys(flag);
      } while (v != want && now_ns() < give_up);
    }
    return;
  }
  if (w > 8 || (kWork < 2 && threadIdx.x != 0)) return;
  uint64_t t0 = 0;
  int64_t c0 = 0;
  if constexpr (kWork < 2) {
    uint32_t j = 0;
    t0 = now_ns();
    c0 = clock64();
    for (int i = 0; i < hops; ++i)
      j = kWork == 0 ? ld_landed<uint32_t>(lines + 64 * j) : __ldg(lines + 64 * j);
    settle(j, sink);
    *sink = j;
  } else {
    asm volatile("bar.sync 1, 256;" ::: "memory");
    t0 = now_ns();
    c0 = clock64();
    for (int r = 0; r < hops; ++r) {
      uint4 v[8];
      const int64_t base = (static_cast<int64_t>(r) * 8) * 256 + threadIdx.x;
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __ldg(src + base + 256 * i);
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[base + 256 * i] = v[i];
    }
    asm volatile("bar.sync 1, 256;" ::: "memory");
  }
  if (threadIdx.x == 0) {
    const int64_t c1 = clock64();
    const uint64_t t1 = now_ns();
    put(out, t1 - t0, c1 - c0);
    epx::detail::st_release_sys(flag, want);
  }
}

struct Timed {
  std::vector<double> ns, clk;
};

epx::bench::TraceClock g_clock;  // the SM clock of a 2 ms spin and the %globaltimer step

// One row: the region's median cycles and timer ns, per `unit` in cycles and in ns at the spin's
// clock, and the clock the timer implies where the region spans >= 20 timer steps.
void row(const char* name, const Timed& t, double per, const char* unit) {
  const double ns = median(t.ns), clk = median(t.clk);
  char mhz[32] = "-";
  if (ns >= 20 * std::max(g_clock.mean_step_ns, 1.0))
    std::snprintf(mhz, sizeof mhz, "%.0f", 1e3 * clk / ns);
  std::printf("%-90s %9.0f cycles %9.1f ns | %8.1f cycles %8.1f ns / %-8s | timer MHz %s\n", name,
              clk, ns, clk / per, clk * g_clock.ns_per_clk / per, unit, mhz);
}

// A random cycle through n items (item i -> next[i]), as indices.
std::vector<uint64_t> random_cycle(int64_t n, uint32_t seed) {
  std::vector<uint64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin() + 1, order.end(), rng);  // the chase starts at item 0
  std::vector<uint64_t> next(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) next[order[i]] = order[(i + 1) % n];
  return next;
}

}  // namespace

int main(int argc, char** argv) {
  int ctas = 128, iters = 20;
  bool neighbour_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--neighbour-only") {
      neighbour_only = true;
    } else if ((a == "--ctas" || a == "--iters") && i + 1 < argc) {
      const int v = std::atoi(argv[++i]);
      if (v < 1 || v > (a == "--ctas" ? 1024 : 10000)) {
        std::printf("epx_sync_probe: %s %d is out of range\n", a.c_str(), v);
        return 2;
      }
      (a == "--ctas" ? ctas : iters) = v;
    } else {
      std::printf("usage: epx_sync_probe [--ctas C] [--iters I] [--neighbour-only]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (epx::gpu_testing::visible_gpus() == 0) {
    std::printf("epx_sync_probe: no GPU visible\n");
    return 0;
  }
  CUDA_OK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  g_clock = epx::bench::probe_clock(0);
  std::printf(
      "epx_sync_probe: %s, %d SMs, %d CTAs of %d threads (one per SM) where a row uses a grid, "
      "%d launches per row (medians); SM clock %.0f MHz (a 2 ms spin), %%globaltimer steps of "
      "%.0f ns (mean %.0f)\n",
      prop.name, prop.multiProcessorCount, ctas, kThreads, iters,
      g_clock.ns_per_clk > 0 ? 1e3 / g_clock.ns_per_clk : 0.0, g_clock.step_ns,
      g_clock.mean_step_ns);
  // More than half an SM's shared memory per CTA: the grid rows' CTAs one per SM, as ll's.
  const int one_per_sm = static_cast<int>(prop.sharedMemPerMultiprocessor / 2 + 1024);
  CUDA_OK(cudaFuncSetAttribute(fence_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               one_per_sm));
  CUDA_OK(cudaFuncSetAttribute(fence_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               one_per_sm));
  CUDA_OK(
      cudaFuncSetAttribute(flag_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, one_per_sm));
  CUDA_OK(
      cudaFuncSetAttribute(flags_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, one_per_sm));

  uint64_t *out = nullptr, *sink = nullptr;
  uint32_t* sink32 = nullptr;
  CUDA_OK(cudaMalloc(&out, 2 * sizeof(uint64_t) * 1024));
  CUDA_OK(cudaMalloc(&sink, sizeof(uint64_t)));
  CUDA_OK(cudaMalloc(&sink32, sizeof(uint32_t)));
  std::vector<uint64_t> h(2 * 1024);
  auto fetch = [&](int words) {
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(h.data(), out, sizeof(uint64_t) * words, cudaMemcpyDeviceToHost));
  };
  // One launch's {ns, cycles} (word 0, 1) into t, after a warm-up launch.
  auto timed = [&](auto launch) {
    Timed t;
    launch();
    fetch(2);
    for (int i = 0; i < iters; ++i) {
      launch();
      fetch(2);
      t.ns.push_back(static_cast<double>(h[0]));
      t.clk.push_back(static_cast<double>(h[1]));
    }
    return t;
  };

  // Neighbour poll: the workers' time with no poller, an acquiring one and a relaxed one on
  // their SM, the three in turn per launch round (one CTA).
  {
    constexpr int64_t kLines = int64_t{1} << 14;  // 4 MB, L2-resident, 256 bytes apart
    constexpr int kChaseHops = 2048, kRounds = 64;
    constexpr int64_t kVecs = int64_t{kRounds} * 8 * 256;  // 2 MB of 16-byte vectors
    const std::vector<uint64_t> next = random_cycle(kLines, 5);
    uint32_t *lines = nullptr, *flag = nullptr;
    uint64_t* dnext = nullptr;
    uint4 *src = nullptr, *dst = nullptr;
    CUDA_OK(cudaMalloc(&lines, 256 * static_cast<size_t>(kLines)));
    CUDA_OK(cudaMalloc(&dnext, sizeof(uint64_t) * next.size()));
    CUDA_OK(cudaMalloc(&src, sizeof(uint4) * kVecs));
    CUDA_OK(cudaMalloc(&dst, sizeof(uint4) * kVecs));
    CUDA_OK(cudaMalloc(&flag, sizeof(uint32_t)));
    CUDA_OK(cudaMemset(flag, 0, sizeof(uint32_t)));
    CUDA_OK(cudaMemcpy(dnext, next.data(), sizeof(uint64_t) * next.size(), cudaMemcpyHostToDevice));
    uint32_t want = 0;
    const char* const polls[3] = {"no poller", "ld.acquire.sys poller", "ld.relaxed.sys poller"};
    const char* const works[3] = {"chase ld_landed", "chase __ldg", "stream 8 warps"};
    using Neighbour = decltype(&neighbour_kernel<0, 0>);
    const Neighbour kernels[3][3] = {  // [work][poll]
        {neighbour_kernel<0, 0>, neighbour_kernel<1, 0>, neighbour_kernel<2, 0>},
        {neighbour_kernel<0, 1>, neighbour_kernel<1, 1>, neighbour_kernel<2, 1>},
        {neighbour_kernel<0, 2>, neighbour_kernel<1, 2>, neighbour_kernel<2, 2>}};
    for (int work = 0; work < 3; ++work) {
      Timed t[3];
      for (int i = 0; i <= iters; ++i) {
        for (int poll = 0; poll < 3; ++poll) {
          chain_write_kernel<<<256, 256>>>(lines, dnext, kLines);  // (every line in L2)
          CUDA_OK(cudaMemset(src, 1, sizeof(uint4) * kVecs));
          ++want;
          const int hops = work < 2 ? kChaseHops : kRounds;
          kernels[work][poll]<<<1, kThreads>>>(out, lines, hops, src, dst, flag, want, sink);
          fetch(2);
          if (i == 0) continue;  // warm-up
          t[poll].ns.push_back(static_cast<double>(h[0]));
          t[poll].clk.push_back(static_cast<double>(h[1]));
        }
      }
      for (int poll = 0; poll < 3; ++poll) {
        char name[96];
        std::snprintf(name, sizeof name, "neighbour: %s, %s", works[work], polls[poll]);
        row(name, t[poll], work < 2 ? kChaseHops : kRounds, work < 2 ? "hop" : "round");
      }
    }
    CUDA_OK(cudaFree(lines));
    CUDA_OK(cudaFree(dnext));
    CUDA_OK(cudaFree(src));
    CUDA_OK(cudaFree(dst));
    CUDA_OK(cudaFree(flag));
  }
  if (neighbour_only) {
    CUDA_OK(cudaFree(out));
    CUDA_OK(cudaFree(sink));
    CUDA_OK(cudaFree(sink32));
    return 0;
  }

  row("alu: dependent mad.lo.u32", timed([&] { alu_kernel<<<1, 1>>>(out, 7u, sink32); }), 4096,
      "op");
  row("shfl: dependent __shfl_xor_sync", timed([&] { shfl_kernel<<<1, 32>>>(out, 7u, sink32); }),
      1024, "shuffle");
  row("redux: dependent __reduce_max_sync",
      timed([&] { redux_kernel<<<1, 32>>>(out, 7u, sink32); }), 1024, "reduce");
  {
    const std::vector<uint64_t> next = random_cycle(1024, 1);
    std::vector<uint32_t> perm(next.begin(), next.end());
    uint32_t* dperm = nullptr;
    CUDA_OK(cudaMalloc(&dperm, sizeof(uint32_t) * perm.size()));
    CUDA_OK(cudaMemcpy(dperm, perm.data(), sizeof(uint32_t) * perm.size(), cudaMemcpyHostToDevice));
    row("smem: dependent ld.shared",
        timed([&] { smem_kernel<<<1, kThreads>>>(out, dperm, sink32); }), 1024, "load");
    CUDA_OK(cudaFree(dperm));
  }

  // Pointer chases: lines 256 bytes apart, a random cycle through them.
  auto chase = [&](int64_t lines_n, bool l2, int hops) {
    const std::vector<uint64_t> next = random_cycle(lines_n, 2);
    uint32_t* lines = nullptr;
    uint64_t* dnext = nullptr;
    CUDA_OK(cudaMalloc(&lines, 256 * static_cast<size_t>(lines_n)));
    CUDA_OK(cudaMalloc(&dnext, sizeof(uint64_t) * next.size()));
    CUDA_OK(cudaMemcpy(dnext, next.data(), sizeof(uint64_t) * next.size(), cudaMemcpyHostToDevice));
    auto write = [&] { chain_write_kernel<<<256, 256>>>(lines, dnext, lines_n); };
    write();
    if (!l2) {  // the written lines out of L2 (50 MB on an H200): a 512 MB write after them
      void* scratch = nullptr;
      CUDA_OK(cudaMalloc(&scratch, size_t{512} << 20));
      CUDA_OK(cudaMemset(scratch, 1, size_t{512} << 20));
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaFree(scratch));
    }
    CUDA_OK(cudaDeviceSynchronize());
    char name[64];
    auto one = [&](auto kernel, int load) {
      std::snprintf(name, sizeof name, "%s: %s", l2 ? "l2" : "hbm", kLoadNames[load]);
      uint64_t start = 0;
      row(name, timed([&] {
            if (l2) write();  // the lines in L2, as the staging a receive reads
            kernel<<<1, 1>>>(out, lines, start, hops, sink, 0);
            if (!l2) {  // beyond L2: the next launch goes on to lines not read yet
              CUDA_OK(cudaDeviceSynchronize());
              CUDA_OK(cudaMemcpy(&start, sink, sizeof start, cudaMemcpyDeviceToHost));
            }
          }),
          hops, "hop");
    };
    one(chase_kernel<kLdCg>, kLdCg);
    if (l2) {
      one(chase_kernel<kLdRelaxedSys>, kLdRelaxedSys);
      one(chase_kernel<kLdAcquireGpu>, kLdAcquireGpu);
      one(chase_kernel<kLdAcquireSys>, kLdAcquireSys);
    }
    CUDA_OK(cudaFree(lines));
    CUDA_OK(cudaFree(dnext));
  };
  chase(int64_t{1} << 14, true, 2048);   // 4 MB
  chase(int64_t{1} << 23, false, 2048);  // 2 GB

  // Address translation: the L2-resident chase with one line per 2 MB page over P pages, one
  // untimed lap (this SM's first touch of each page), then max(2048, P) timed hops. Past the reach
  // of a TLB level every hop misses there and pays the next level (or the page walk); the lines
  // stay in L2.
  {
    uint32_t* pages = nullptr;
    uint64_t* dnext = nullptr;
    if (cudaMalloc(&pages, sizeof(uint32_t) * kPageStride * kTlbAlloc) != cudaSuccess) {
      (void)cudaGetLastError();  // (clears the failed allocation's error)
      std::printf("tlb: rows left out (no %lld GB free)\n",
                  static_cast<long long>(kTlbAlloc * kPageStride * 4 >> 30));
    } else {
      CUDA_OK(cudaMalloc(&dnext, sizeof(uint64_t) * kTlbPages));
      for (int64_t p : {8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}) {
        const std::vector<uint64_t> next = random_cycle(p, 3);
        CUDA_OK(
            cudaMemcpy(dnext, next.data(), sizeof(uint64_t) * next.size(), cudaMemcpyHostToDevice));
        const int hops = static_cast<int>(std::max<int64_t>(2048, p));
        char name[64];
        std::snprintf(name, sizeof name, "tlb: %lld pages (2 MB apart)", static_cast<long long>(p));
        row(name, timed([&] {
              chain_write_kernel<<<64, 256>>>(pages, dnext, p, kPageStride);
              chase_kernel<kLdCg, kPageStride>
                  <<<1, 1>>>(out, pages, 0, hops, sink, static_cast<int>(p));
            }),
            hops, "hop");
      }
      // First touch: the 8 targets' chain written once (L2-resident; the sweep evicts the
      // translations its writer left), then per row 8 pages after `sweep` others.
      const std::vector<uint64_t> next = random_cycle(8, 4);
      CUDA_OK(
          cudaMemcpy(dnext, next.data(), sizeof(uint64_t) * next.size(), cudaMemcpyHostToDevice));
      chain_write_kernel<<<1, 32>>>(pages + kPageStride * kTlbTargets, dnext, 8, kPageStride);
      CUDA_OK(cudaDeviceSynchronize());
      auto touch = [&](const char* what, int sweep, auto kernel) {
        char name[112];
        std::snprintf(name, sizeof name, "tlb first touch: 8 pages after %d others, %s", sweep,
                      what);
        row(name, timed([&] { kernel<<<1, kThreads>>>(out, pages, sweep, sink32); }), 8, "page");
      };
      for (int sweep : {64, 8192}) {
        touch("load, cold", sweep, tlb_touch_kernel<0, false>);
        touch("load, after prefetch.L2", sweep, tlb_touch_kernel<1, false>);
        touch("load, after a load", sweep, tlb_touch_kernel<2, false>);
        touch("load, after prefetch.L2 then 32 other pages", sweep, tlb_touch_kernel<3, false>);
        touch("store + fence, cold", sweep, tlb_touch_kernel<0, true>);
        touch("store + fence, after prefetch.L2", sweep, tlb_touch_kernel<1, true>);
        touch("store + fence, after a load", sweep, tlb_touch_kernel<2, true>);
        touch("store + fence, after prefetch.L2 then 32 other pages", sweep,
              tlb_touch_kernel<3, true>);
      }
      CUDA_OK(cudaFree(dnext));
      CUDA_OK(cudaFree(pages));
    }
  }

  // Instruction issue and fetch (ifetch_kernel): cycles per instruction per warp, the median
  // warp of the median launch, with 1 warp, 1, 2 and 4 warps per scheduler.
  {
    float* fsink = nullptr;
    CUDA_OK(cudaMalloc(&fsink, sizeof(float)));
    const int sms = prop.multiProcessorCount;
    auto evict = [&] {  // 256 KB of other code on every SM
      ifetch_kernel<true, 16384, 1><<<sms, kThreads>>>(out + 128, 1.0001f, 0.5f, fsink, 16);
    };
    for (int warps : {1, 4, 8, 16}) {
      auto per_instr = [&](const char* what, int n, int pass, auto evict, auto launch,
                           const char* unit = "instr") {
        Timed t;
        for (int i = 0; i <= iters; ++i) {
          evict();
          launch();
          fetch(64);
          if (i == 0) continue;  // warm-up
          std::vector<double> clk;
          for (int wi = 0; wi < warps; ++wi)
            clk.push_back(static_cast<double>(h[2 * (pass * 16 + wi)]));
          t.clk.push_back(median(clk));
          t.ns.push_back(median(clk) * g_clock.ns_per_clk);
        }
        char name[96];
        std::snprintf(name, sizeof name, "ifetch: %d warp%s, %s", warps, warps > 1 ? "s" : "",
                      what);
        row(name, t, n, unit);
      };
      auto none = [] {};
      per_instr("loop of 64 x 64 fma (L0-resident)", 4096, 1, none, [&] {
        ifetch_kernel<false, 4096><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink, warps);
      });
      auto straight16 = [&] {
        ifetch_kernel<true, 1024><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink, warps);
      };
      auto straight64 = [&] {
        ifetch_kernel<true, 4096><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink, warps);
      };
      per_instr("1024 fma straight (16 KB), after the evictor", 1024, 0, evict, straight16);
      per_instr("1024 fma straight (16 KB), again", 1024, 1, evict, straight16);
      per_instr("4096 fma straight (64 KB), after the evictor", 4096, 0, evict, straight64);
      per_instr("4096 fma straight (64 KB), again", 4096, 1, evict, straight64);
      if (warps == 1) {  // taken jumps (ijump_kernel): the difference per jump, cold - again,
                         // is what a jump into code out of the SM's instruction caches costs
        auto jumps = [&] { ijump_kernel<16, 128><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink, 1); };
        per_instr("16 jumps over 2 KB each, after the evictor", 16, 0, evict, jumps, "jump");
        per_instr("16 jumps over 2 KB each, again", 16, 1, evict, jumps, "jump");
      }
      if (warps == 1 || warps == 8) {  // dependent chains (kDep): one warp, 2 per scheduler
        per_instr("dependent fma, loop of 64 x 64 (L0-resident)", 4096, 1, none, [&] {
          ifetch_kernel<false, 4096, 0, 1, true><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink,
                                                                   warps);
        });
        per_instr("dependent fma, 1024 straight (16 KB), again", 1024, 1, evict, [&] {
          ifetch_kernel<true, 1024, 0, 1, true><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink,
                                                                  warps);
        });
      }
      if (warps == 8 || warps == 16) {  // the fused dispatch's case: two teams, two code paths
        per_instr("256 fma straight (4 KB), again", 256, 1, evict, [&] {
          ifetch_kernel<true, 256><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink, warps);
        });
        per_instr("two teams, each its own 256 fma straight (2 x 4 KB), again", 256, 1, evict,
                  [&] {
                    ifetch_kernel<true, 256, 0, 2><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink,
                                                                    warps);
                  });
        per_instr("two teams, each its own 1024 fma straight (2 x 16 KB), again", 1024, 1, evict,
                  [&] {
                    ifetch_kernel<true, 1024, 0, 2><<<1, kThreads>>>(out, 1.0001f, 0.5f, fsink,
                                                                     warps);
                  });
      }
    }
    CUDA_OK(cudaFree(fsink));
  }

  row("bar512: __syncthreads, 512 threads", timed([&] { bar_kernel<false><<<1, kThreads>>>(out); }),
      1024, "barrier");
  row("bar256: bar.sync 2, 256 threads", timed([&] { bar_kernel<true><<<1, kThreads>>>(out); }),
      1024, "barrier");

  // Fences after the CTA's stores: per launch the median CTA.
  {
    const int64_t sizes[] = {0, 1024, 8192, 57344};
    uint4* dst = nullptr;
    CUDA_OK(cudaMalloc(&dst, static_cast<size_t>(57344) * ctas));
    for (int sys = 0; sys < 2; ++sys) {
      for (int64_t bytes : sizes) {
        Timed t;
        for (int i = 0; i <= iters; ++i) {
          if (sys)
            fence_kernel<true><<<ctas, kThreads, one_per_sm>>>(out, dst, bytes);
          else
            fence_kernel<false><<<ctas, kThreads, one_per_sm>>>(out, dst, bytes);
          fetch(2 * ctas);
          if (i == 0) continue;  // warm-up
          std::vector<double> ns, clk;
          for (int c = 0; c < ctas; ++c) {
            ns.push_back(static_cast<double>(h[2 * c]));
            clk.push_back(static_cast<double>(h[2 * c + 1]));
          }
          t.ns.push_back(median(ns));
          t.clk.push_back(median(clk));
        }
        char name[64];
        std::snprintf(name, sizeof name, "fence.acq_rel.%s after %lld B/CTA", sys ? "sys" : "gpu",
                      static_cast<long long>(bytes));
        row(name, t, 1, "fence");
      }
    }
    CUDA_OK(cudaFree(dst));
  }

  // The grid flag: from the latest CTA's signal to each CTA seeing every signal. `launch(i)`
  // runs launch i (epoch i + 1); per CTA out = {signalled (ns), all seen (ns, 0: never)}.
  auto grid_flag = [&](const char* name, auto launch) {
    std::vector<double> med, mx;
    int lost = 0;
    for (int i = 0; i <= iters; ++i) {
      launch(i);
      fetch(2 * ctas);
      if (i == 0) continue;
      uint64_t last = 0;
      for (int c = 0; c < ctas; ++c) last = std::max(last, h[2 * c]);
      std::vector<double> after;
      for (int c = 0; c < ctas; ++c) {
        if (h[2 * c + 1] == 0) {
          ++lost;
          continue;
        }
        after.push_back(h[2 * c + 1] > last ? static_cast<double>(h[2 * c + 1] - last) : 0.0);
      }
      med.push_back(median(after));
      mx.push_back(after.empty() ? 0 : *std::max_element(after.begin(), after.end()));
    }
    std::printf("%-90s %9.1f ns (median CTA, timer) %9.1f ns (latest CTA)%s\n", name, median(med),
                median(mx), lost ? "  (some CTAs never saw it: not co-resident?)" : "");
  };
  {
    uint32_t* counter = nullptr;
    CUDA_OK(cudaMalloc(&counter, sizeof(uint32_t)));
    CUDA_OK(cudaMemset(counter, 0, sizeof(uint32_t)));
    grid_flag("flag: latest red -> count seen", [&](int i) {
      flag_kernel<<<ctas, kThreads, one_per_sm>>>(out, counter,
                                                  static_cast<uint32_t>(ctas) * (i + 1));
    });
    CUDA_OK(cudaFree(counter));
  }
  if (ctas <= kThreads) {
    uint32_t* flags = nullptr;
    CUDA_OK(cudaMalloc(&flags, 32 * static_cast<size_t>(ctas)));
    CUDA_OK(cudaMemset(flags, 0, 32 * static_cast<size_t>(ctas)));
    grid_flag("flags: latest store -> all seen", [&](int i) {
      flags_kernel<<<ctas, kThreads, one_per_sm>>>(out, flags, static_cast<uint32_t>(i + 1));
    });
    CUDA_OK(cudaFree(flags));
  }
  CUDA_OK(cudaFree(out));
  CUDA_OK(cudaFree(sink));
  CUDA_OK(cudaFree(sink32));
  return 0;
}
