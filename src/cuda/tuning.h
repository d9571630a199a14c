// src/cuda/tuning.h — the one place the cuda backend turns "auto" tuning into numbers
// (STYLE: the problem apart from tuning). GroupOptions::num_sms (or EPX_NUM_SMS, read by
// src/core/env.cc) bounds the CTAs of every ht kernel; 0 means auto.
#pragma once

#include <string>

namespace epx::detail {

// Benchmark ablations (epx_ht_gpu_bench --ablate): leave one stage out to time the rest. Outputs
// are wrong when set, except for the switches marked "not an ablation" below (output-preserving
// A/B switches, also used by the ht GPU tests); the protocol (waits, counters, sequence numbers)
// still runs.
enum HtAblate : int {
  kAblateSelf = 1,         // dispatch receivers skip the rows the rank keeps
  kAblateRemoteCopy = 2,   // dispatch receivers wait for blocks but do not copy them out
  kAblateReduce = 8,       // combine reducers wait for blocks but do not reduce
  kAblateEnginePush = 16,  // copy-engine dispatch: no pushes into the peers' slots
  kAblateEngineKept = 32,  // copy-engine dispatch: no kept-row copies
  kAblateEngineOut = 64,   // copy-engine dispatch: no copy-out of the slots
  // Not an ablation (outputs unchanged): combine rounds with the float32 -> bf16 emulation
  // (f32_to_bf16, the code before the hardware conversion) — the same-run A/B of that change.
  kHtEmulatedBf16 = 128,
  // Not an ablation either: the combine reducers' narrow step (kReduceUnrollNarrow vectors per
  // lane, kReduceGroupNarrow sources at a time; kernels/ht/combine.cuh; rows of 16-byte vectors
  // only, ignored otherwise) — the step before the sixth session's wide default, the same-run A/B.
  kHtReduceNarrow = 256,
  // Not an ablation either: tokens with <= 2 row sources take the general reducer step too, not
  // reduce_row_pair (the sixth session's pair step; its same-run A/B).
  kHtReducePairOff = 512,
  // Not an ablation either: the zero-copy combine reduces with the register pair step, not the
  // staged reducer (kernels/ht/combine_staged.cuh, seventh session) — its same-run A/B.
  kHtPullStagedOff = 1024,
  // Not an ablation either: dispatch sender warps take their token batches in the fixed order
  // (warp gw: batches gw, gw + G, ...) instead of drawing them from a shared counter (the
  // eighth session's dynamic order) — its same-run A/B.
  kHtSendStatic = 2048,
  // Not an ablation either: an exact-mode ce:kept dispatch builds its copy plan from host copies
  // of send_pos and the prefix matrix after a stream synchronisation (the plan before the ninth
  // session), not from the count exchange's mapped-host result — the same-run A/B.
  kHtKeptPlanCopied = 4096,
  // Not an ablation either: the count exchange (ht_notify_kernel) as before the tenth session —
  // each token's expert ids loaded one after the other, and pass 2 loading them again instead of
  // reading the masks pass 1 kept in shared memory — the same-run A/B.
  kHtNotifyOld = 8192,
  // Not an ablation either: routing metadata loads as before the eleventh session — each kept
  // row's and sent row's ids and weights loaded when its metadata is stored, the weight after the
  // id (dispatch_meta_word), instead of a token's ids and weights loaded into registers when the
  // token starts (load_token_meta, overlapping its row copy) — the same-run A/B.
  kHtKeptMetaLate = 16384,
  // Not an ablation either: dispatch receivers copy a block's routing metadata out row by row
  // (one warp per row, the rows of a warp one after the other) instead of with every thread of the
  // CTA at once (eleventh session) — the same-run A/B.
  kHtRecvMetaRows = 32768,
  // Not an ablation either: the count exchange finds each expert id's rank by a division, not by
  // its expert -> rank table in shared memory (eleventh session) — the same-run A/B.
  kHtNotifyDivide = 65536,
  // Not an ablation either: the count exchange on one CTA, not a cluster of up to kNotifyMaxCtas
  // CTAs splitting the tokens (eleventh session) — the same-run A/B.
  kHtNotifyOneCta = 131072,
  // Not an ablation either, and the other way round (opt-in, prepared in the eleventh session,
  // not yet measured on two GPUs): the exact dispatch split in two kernels, the senders on a side
  // stream right after the count exchange (before the host waits for it) and the receivers after
  // the outputs are allocated (ht.cu).
  kHtSplitSend = 262144,
  // Opt-in too (twelfth session, not yet measured on two GPUs): a copying combine (y the caller's
  // tensor) through the pull protocol — y copied into this rank's combine buffer on the caller's
  // stream (one copy-engine copy), then the zero-copy combine (ht.cu). Every rank must set it
  // alike (the two protocols do not mix).
  kHtCombineViaPull = 524288,
  // Opt-in too (twelfth session, not yet measured on two GPUs): a copying dispatch (recv_x the
  // caller's tensor) through the zero-copy kernels — the rows land in this rank's region as in a
  // zero-copy dispatch, ce:kept's kept rows go straight to recv_x, and copies on the caller's
  // stream move the received rows (and scales) out after the kernel (ht.cu). Exact and cached
  // dispatch, not worst-case mode. Every rank must set it alike (as HtDispatchArgs::zero_copy:
  // the zero-copy senders place rows where the receiver's zero-copy kernel expects them).
  kHtDispatchViaZeroCopy = 1048576,
  // Not an ablation: kHtCombineViaPull's y rows copied whole before the kernel, not in chunks
  // beside it (the A/B of the chunked copy, twelfth session).
  kHtCombineViaPullWhole = 2097152,
};

struct HtTuning {
  int num_sms = 16;            // CTAs of the dispatch and combine kernels (one per SM)
  int dispatch_send_ctas = 6;  // of which send (the rest receive)
  int combine_send_ctas = 6;
  int dispatch_send_ctas_kept = 8;  // senders when the copy engines copy the kept rows (ce:kept)
  // Senders of a zero-copy dispatch: all CTAs (each then also receives), unless overridden.
  int dispatch_send_ctas_zero_copy = 16;
};

// Auto: 16 SMs (enough to saturate NVLink at EP2 with the copy-out alongside), clamped to the
// device; senders take 38% of the CTAs (none when R = 1: nothing leaves the rank).
HtTuning resolve_ht_tuning(int requested_sms, int device_sms, int num_ranks);

// Benchmark hook (never set by the library itself): values > 0 replace the SM count and the
// senders' share (percent) of the CTAs for buffers created afterwards in this process.
void set_ht_tuning_override(int num_sms, int dispatch_send_percent, int combine_send_percent);

// Benchmark hook: the percent (1..100) of each slot's rows the copy engines push when combine
// uses them (":combine" / ":combine-auto"); the kernel's senders push the rest. 100 (the
// default, and any value outside 1..99) = all. For combine launches after the call.
void set_ht_engine_share_override(int percent);
int ht_engine_share();

// The zero-copy combine's staged reducer (kernels/ht/combine_staged.cuh): per warp `stages`
// shared-memory stages of two `chunk`-byte pieces (one per row source) loaded by cp.async.bulk.
// 16 warps x stages x (2 chunk + 32) bytes of shared memory per CTA.
// Default 2 x 3584 on at most 24 SMs (seventh session, T = 4096 graph, medians of 4 runs at 16
// SMs: 2 x 3584 192.3-193.1 us, 2 x 3072 194.4-195.3, 3 x 2048 204.5, the register pair step
// 249.7-250.5; at 24 SMs all stagings 193-195, the register step 199.6; at 32 SMs the register
// step is as fast at T = 4096 / 8192 and 5-9 % faster at T = 512 / 1024, so it stays there).
struct HtPullStaging {
  int stages = 2;
  int chunk = 3584;
  int max_sms = 24;  // grids above this use the register pair step
};
// The staging of later zero-copy combines: the override below when set (stages 0: the register
// pair step; any SM count), else the default above.
HtPullStaging ht_pull_staging();
// Benchmark / test hook: stages x chunk for later zero-copy combines in this process (stages 0:
// off; stages < 0: back to the default). Checked at launch: InvalidArgument unless 2 <= stages
// <= 8 and chunk is a multiple of 512 in [512, 16384]; a staging the device's shared memory
// cannot hold (or a device below sm_90) runs the register pair step instead.
void set_ht_pull_staging_override(int stages, int chunk);

// How the ht dispatch moves x rows (docs/perf-cuda-ht.md, designs v4 and v5). kBulk applies only
// where every row address and size is a multiple of 16 bytes and the device is sm_90+; otherwise
// kWarp. kEngine: the copy engines move x rows (cudaMemcpyAsync of runs of consecutive tokens)
// wherever the host knows the layout (exact mode and cached dispatch with its handle): all of them
// ("ce") or only the rows a rank keeps ("ce:kept"); worst-case mode keeps the kernels (kWarp).
// ":combine" / ":combine-auto" (the default is "ce:kept:combine-auto"): combine's y rows by copy
// engine too (always / where ht_engine_combine_pays). Every rank must use the same mode: warp,
// bulk and ce:kept interoperate, but "ce" and ":combine" change who writes the symmetric slots and
// when, so a rank on another mode reads wrong rows or times out (not detected). After a timeout,
// copy-engine pushes already queued on a stream still land in the peers' slots (a copy cannot be
// cancelled; the group is failing).
enum class HtCopyMode : int { kWarp = 0, kBulk = 1, kEngine = 2 };
// Who pushes combine's y rows under kEngine: the kernel (kOff), the copy engines (kOn, while an SM
// stays free for their arrive kernels), or the copy engines where that measured faster (kAuto,
// the default: ht_engine_combine_pays).
enum class HtEngineCombine : int { kOff = 0, kOn = 1, kAuto = 2 };

struct HtCopyConfig {
  // Default "ce:kept:combine-auto" (docs/perf-cuda-ht.md run 12: 16 SMs cached bf16 306 -> 261 us,
  // fp8 209 -> 176 us vs warp); worst-case mode and handles without a copy plan use the warp loops.
  HtCopyMode mode = HtCopyMode::kEngine;
  int stages = 4;      // kBulk: shared-memory stages per warp (2..8)
  int chunk = 3072;    // kBulk: bytes per stage (multiple of 16); 16 warps x stages x chunk
  int send_batch = 0;  // tokens per sender warp between two signals (0: the kernel's default, 4)
  // kEngine: ":combine" kOn, ":combine-auto" kAuto (the default), neither kOff.
  HtEngineCombine engine_combine = HtEngineCombine::kAuto;
  bool engine_kept_only = true;  // kEngine ("ce:kept"): copy engines move only the kept rows
                                 // (concurrently with the kernel, which pushes and copies out)
};

// Parses "warp" | "ce[:kept][:combine|:combine-auto]" | "bulk" with optional ":SxC" (stages x
// chunk bytes) and ":bN" (send batch), e.g. "bulk:3x4096:b8". Throws InvalidArgument (naming
// `what`) on anything else.
HtCopyConfig parse_ht_copy(const std::string& spec, const char* what);

// kAuto's rule: the copy engines push combine's rows when the kernel would have at most 24 SMs
// and the largest block one rank sends another is at least 32 MB (docs/perf.md, fourth session,
// sweep item 6: EP2 wins at T >= 4096 on 8-24 SMs, losses at T <= 1024 and at 32 SMs, where the
// kernel's senders are fast or the per-chunk cost dominates). Both inputs are the same on every
// rank (the SM budget; the group-wide rank prefix matrix), so every rank decides alike.
bool ht_engine_combine_pays(int num_sms, int64_t max_pair_bytes);

// ce:kept copies the rows a rank keeps with one cudaMemcpyAsync per run of consecutive kept
// tokens, ≈ 6 µs of host time each (2 x H200: 17 runs ≈ 105 µs per call, docs/perf-cuda-ht.md
// run 12). Where the rank's kept tokens form more runs than this (EP > 2, where a rank keeps
// about 1 - (1 - 1/R)^K of the tokens in scattered runs, or routings that alternate) the
// dispatch kernel places the kept rows itself, as the warp path does: thousands of copy calls
// would cost milliseconds per call. The choice is this rank's own (no peer sees it). Plain "ce"
// (copy engines move every row; not the default) has no such limit: its pushes change the
// protocol, so every rank would have to choose alike.
inline constexpr size_t kHtKeptCopyMaxRuns = 32;
bool ht_kept_copies_pay(size_t kept_runs);
// Benchmark hook (never set by the library): the run limit of ht_kept_copies_pay (>= 0), or the
// default again (< 0). For dispatches after the call.
void set_ht_kept_copy_max_runs_override(int64_t max_runs);

// The copy path of ht dispatch launches: the override below when set, else EPX_HT_COPY (read
// once, src/core/env.cc), else ce:kept:combine-auto. Read at every launch, so one process can time
// both.
HtCopyConfig ht_copy_config();
// Benchmark / test hook: replaces EPX_HT_COPY for later launches in this process; null resets.
void set_ht_copy_override(const HtCopyConfig* config);


// Benchmark / test hook: HtAblate bits (above) applied to every ht launch in this process while
// non-zero. Outputs are wrong while an ablation bit is set (not the output-preserving switches).
// 0 in the library.
void set_ht_ablation(int bits);
int ht_ablation();

}  // namespace epx::detail
