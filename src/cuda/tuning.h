// src/cuda/tuning.h — the one place the cuda backend turns "auto" tuning into numbers
// (STYLE: the problem apart from tuning). GroupOptions::num_sms (or EPX_NUM_SMS, read by
// src/core/env.cc) bounds the CTAs of every ht kernel; 0 means auto. Each default is the
// measured winner of a same-run A/B (docs/design.md, ht defaults); the losers are in git.
#pragma once

#include <cstddef>
#include <cstdint>

namespace epx::detail {

struct HtTuning {
  int num_sms = 16;            // CTAs of the dispatch and combine kernels (one per SM)
  int dispatch_send_ctas = 6;  // of which send (the rest receive)
  int combine_send_ctas = 6;
  int dispatch_send_ctas_kept = 8;  // senders when the copy engines copy the kept rows
  // Senders of a zero-copy dispatch: all CTAs (each then also receives).
  int dispatch_send_ctas_zero_copy = 16;
};

// Auto: 16 SMs (enough to saturate NVLink at EP2 with the copy-out alongside), clamped to the
// device; senders take 38% of the CTAs (none when R = 1: nothing leaves the rank), 50% when the
// copy engines copy the kept rows, all of them in a zero-copy dispatch (src/cuda/tuning.cc).
HtTuning resolve_ht_tuning(int requested_sms, int device_sms, int num_ranks);

// The zero-copy combine's staged reducer (kernels/ht/combine_staged.cuh): per warp `stages`
// shared-memory stages of two `chunk`-byte pieces (one per row source) loaded by cp.async.bulk;
// 16 warps x stages x (2 chunk + 32) bytes of shared memory per CTA. 2 x 3584 on at most 24 SMs;
// grids above that (and devices below sm_90, or without the shared memory) use the register
// pair step, which is as fast there.
struct HtPullStaging {
  int stages = 2;
  int chunk = 3584;
  int max_sms = 24;  // grids above this use the register pair step
};
inline constexpr HtPullStaging kHtPullStaging{};

// Where the host knows the layout (exact mode, and cached dispatch with its handle), the copy
// engines copy the rows a rank keeps (x -> recv_x) on a side stream beside the dispatch kernel,
// one cudaMemcpyAsync per run of consecutive kept tokens (≈ 6 µs of host time each), while the
// kernel pushes to the peers and copies out. Only while the kept tokens form at most this many
// runs (EP2 uniform: 17 runs at T = 4096); more (EP > 2, alternating routings) and the kernel
// places the kept rows itself, as in worst-case mode. The choice is this rank's own (no peer
// sees it).
inline constexpr size_t kHtKeptCopyMaxRuns = 32;
inline bool ht_kept_copies_pay(size_t kept_runs) {
  return kept_runs <= kHtKeptCopyMaxRuns;
}

// The copy engines push combine's y rows back (in kHtEngineChunks chunks, each signalled) when
// the kernel has at most 24 SMs and the largest block one rank sends another is at least 32 MB;
// else the kernel's senders push them. Both inputs are the same on every rank (the SM budget;
// the group-wide rank prefix matrix), so every rank decides alike.
inline bool ht_engine_combine_pays(int num_sms, int64_t max_pair_bytes) {
  return num_sms <= 24 && max_pair_bytes >= (int64_t{32} << 20);
}

// The overlapped ll combine's send CTAs (LlCombineOverlap::num_sms; docs/design.md §7.6): auto
// is 3 with one signal per block (DeepEP antgroup-opt's num_sms default, the SMs the GEMM leaves)
// and 32 with one per expert (hybrid-ep's send grid, what sglang keeps off its GEMM); clamped to
// [1, recv_ctas] (the receive's C CTAs: the send adds C to combine_ready in S shares).
inline int resolve_ll_overlap_ctas(int64_t block_rows, int requested, int recv_ctas) {
  const int s = requested > 0 ? requested : block_rows > 0 ? 3 : 32;
  return s < 1 ? 1 : s > recv_ctas ? recv_ctas : s;
}

// Ranks sharing one GPU (the one-GPU test mode): whether R ranks' overlapped combines with S send
// CTAs each can run, i.e. whatever the ranks' progress, a rank whose GEMM has not finished finds
// an SM for it. A rank's send spins until its GEMM's signals; its receive (C CTAs, after its
// send) until every rank's send is done; so at worst k ranks receive and R - k send, k < R:
// k C + (R - k) S SMs spin, most at k = R - 1 (S <= C), and (R - 1) C + S < SMs is the condition.
// Since the mode has R C <= SMs (its num_sms), that is R S < SMs (tests/unit/ll_ctas_test.cc).
inline bool ll_overlap_fits_shared_gpu(int num_ranks, int send_ctas, int device_sms) {
  return static_cast<int64_t>(num_ranks) * send_ctas < device_sms;
}

#ifdef EPX_DIAGNOSTICS
// Diagnostics builds only (-DEPX_DIAGNOSTICS=ON; the GPU benchmarks' --ablate, --send-pct).
//
// Ablations: leave one stage out to time the rest. Outputs are wrong while a bit is set; the
// protocol (waits, counters, sequence numbers) still runs.
enum HtAblate : int {
  kAblateSelf = 1,         // dispatch receivers skip the rows the rank keeps
  kAblateRemoteCopy = 2,   // dispatch receivers wait for blocks but do not copy them out
  kAblateReduce = 8,       // combine reducers wait for blocks but do not reduce
  kAblateEnginePush = 16,  // copy-engine combine: no pushes into the peers' slots
  kAblateEngineKept = 32,  // copy-engine dispatch: no kept-row copies
};
// HtAblate bits applied to every ht launch in this process while non-zero.
void set_ht_ablation(int bits);
int ht_ablation();
// The cuda ht across nodes (ht_nodes.cu) synchronises its stream after each of its steps and
// raises a CUDA error naming the step: a sticky device fault then names the step that made it
// (one-GPU mode, where every rank's next sync fails alike).
void set_ht_nodes_step_sync(bool on);
bool ht_nodes_step_sync();
// Values > 0 replace the SM count and the senders' share (percent) of the CTAs for buffers
// created afterwards in this process.
void set_ht_tuning_override(int num_sms, int dispatch_send_percent, int combine_send_percent);
// The same for ll (epx_ll_gpu_bench --ablate): one stage of the ll kernels left out, so that a
// benchmark row without it bounds what the stage costs there. The waits, counters and epochs still
// run, so the ops still complete.
enum LlAblate : int {
  kLlAblateSendRows = 1,     // dispatch send: no message rows (routing rows and headers still)
  kLlAblateRecvList = 2,     // dispatch receive: scan and counts only (no list, no copies);
                             // the combine then skips the selections it finds no row for
  kLlAblateRecvCopy = 4,     // dispatch receive: listed, src_info written, no row / scale copies
  kLlAblateCombinePull = 8,  // combine receive: rows resolved, no pulls, no reduce, no output
  kLlAblateRecvScales = 16,  // dispatch receive: rows copied, no scale vectors loaded or stored
  // Variants (bits 32 and up; outputs exact, the bench's check runs under each): candidates
  // measured before one becomes the only path, then deleted.
  // dispatch receive, fp8 with f32 scales, a CTA that copies whole experts (S = 1, one scan
  // round, R * T_max % 8 == 0): thread i stores 4 rows' scales of one group as one 16-byte vector,
  // lane pairs one full 32-byte sector, the rows past the expert's count in its last sector 0
  // (undefined rows, semantics.md 2.1), instead of a 4-byte word per row and group
  kLlVariantScaleSectors = 64,
};
// LlAblate bits applied to every ll launch in this process while non-zero.
void set_ll_ablation(int bits);
int ll_ablation();
// Whether HtAblate / LlAblate bit `bit` is set in `bits` (false in the library's default build,
// where neither exists).
#define EPX_HT_ABLATED(bits, bit) (((bits) & (bit)) != 0)
#define EPX_LL_ABLATED(bits, bit) (((bits) & (bit)) != 0)
#else
#define EPX_HT_ABLATED(bits, bit) false
#define EPX_LL_ABLATED(bits, bit) false
#endif

}  // namespace epx::detail
