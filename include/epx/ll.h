// epx/ll.h — low-latency dispatch/combine (decode). docs/semantics.md §2.
//
// Data flow on rank r (L local experts, capacity T_max = shape.max_tokens_per_rank):
//   ll_dispatch(x[T, H], topk_idx[T, K]) ->
//     recv_x[L, R * T_max, H]   expert-major: local expert l's rows packed from row 0, grouped by
//                               source rank ascending, then source token index ascending
//     recv_scales               fp8: f32 [L, R*T_max, H/128] or packed UE8M0 i32
//                               [L, R*T_max, ceil(H/512)] (group g in byte g % 4 of int g / 4,
//                               unused bytes 0), column-major in the last two dims (strides
//                               {cols * R*T_max, 1, R*T_max})
//     recv_count[L] int32       rows per local expert (masked_m); rows >= recv_count[l] of
//                               recv_x, recv_scales and src_info are unspecified (not written)
//   With use_nvfp4 (the layout of DeepEP's NVFP4 forks, what the cute-dsl masked grouped GEMM
//   reads; docs/semantics.md §2.2):
//     recv_x                    u8 storage [L, R*T_max, H/2] (e2m1 pairs, element 2i in the
//                               low nibble), returned as the view (R*T_max, H/2, L) with strides
//                               {H/2, 1, R*T_max*H/2}
//     recv_scales               e4m3 storage [L, ceil(R*T_max/128), H/64, 32, 4, 4], returned as
//                               the view (32, 4, ceil(R*T_max/128), 4, H/64, L): scale j of row
//                               `row` of expert l at byte l*ceil(R*T_max/128)*128*H/16 + the
//                               offset of (row, j) in epx/nvfp4.h's interleaved layout
//   ll_combine(y[L, R*T_max, H]) -> out[t] = sum over k of w[t][k] * y(t, k), float32 fma in k
//                               order, one rounding to bf16 (use_logfmt: y(t, k) as LogFMT-10
//                               decodes it)
// A token that selects the same local expert twice gets one row; both selections read it back.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include "epx/tensor.h"

namespace epx {

struct LlHandle {
  Tensor src_info;      // [L, R * T_max] int32: source token index of each received row
  Tensor layout_range;  // [L, R] int64: (begin << 32) | count of each source rank's block
  int64_t max_tokens = 0;  // T_max
  int64_t hidden = 0;
  int num_experts = 0;
  int64_t num_tokens = 0;  // T on this rank at dispatch
  int slot = 0;            // double-buffer half used by this dispatch
  uint64_t buffer_id = 0;
  uint64_t serial = 0;  // cuda: this dispatch's number on its Buffer (what its combine may read)
  // Backend-private state the dispatch left for the combine of this handle (cuda across nodes:
  // the node-local handles); null otherwise.
  std::shared_ptr<const void> backend_state;
};

// Waits for and finishes the receive half of an operation sent with return_recv_hook.
// Call exactly once, in the same order on every rank; a second call, or a call after ll_clean,
// raises InvalidArgument. The library-allocated outputs are kept alive by the hook; caller-owned
// views it writes (cumulative_local_expert_recv_stats, the wait-cost stats, LlCombineArgs::out)
// must stay alive until it has run. See Buffer for how many operations may wait for their hooks
// at once.
using LlHook = std::function<void()>;

struct LlDispatchArgs {
  TensorView x;         // [T, H] bf16, T <= T_max (else OutOfCapacity), H % 128 == 0, stride(1) 1
  TensorView topk_idx;  // [T, K] int64 or int32, values in [-1, E)
  // use_fp8 and round_scale are equal on every rank (else every rank raises InvalidArgument).
  bool use_fp8 = true;
  bool round_scale = false;  // power-of-two scales
  bool use_ue8m0 = false;    // packed exponent bytes; requires use_fp8 and round_scale
  // NVFP4: e2m1 values with an e4m3 scale per 16 values from the global scale g
  // (docs/semantics.md §2.2). Requires use_fp8 = false (InvalidArgument) and use_ue8m0 = false
  // (Unsupported); round_scale is not used. Every rank passes the same use_nvfp4 and g (else
  // InvalidArgument on every rank).
  bool use_nvfp4 = false;
  // g for use_nvfp4, exactly one of the two (else InvalidArgument): x_global_scale, a float32
  // tensor of >= 1 element on the buffer's device whose element 0 the dispatch reads in stream
  // order (capturable: a replay reads the value of its time; DeepEP's x_global_scale), or
  // global_scale, a value on the host (finite, > 0). Not read without use_nvfp4.
  TensorView x_global_scale;
  std::optional<float> global_scale;
  bool return_recv_hook = false;
  // Optional [L] int32: recv_count is added to it when the receive finishes (in the hook with
  // return_recv_hook), not when the receive raises an error.
  TensorView cumulative_local_expert_recv_stats;
  // Optional [R] int64, contiguous, on the buffer's device (DeepEP's
  // dispatch_wait_recv_cost_stats): element s is ADDED the nanoseconds this rank's receive waited
  // for source rank s's tokens (docs/semantics.md §2.5; with return_recv_hook, in the hook).
  TensorView dispatch_wait_recv_cost_stats;
  Stream stream = nullptr;
};

// Two allocations of `allocator` (docs/semantics.md §2.1): recv_x and recv_scales are views of
// one block, the handle's tensors and recv_count of another (each Tensor's storage is its block's).
struct LlDispatchResult {
  Tensor recv_x;       // see above
  Tensor recv_scales;  // fp8 and NVFP4 only
  Tensor recv_count;   // [L] int32
  LlHandle handle;
  LlHook hook;         // set when return_recv_hook: outputs are valid after hook() returns
};

// Combine overlapped with the expert GEMM (docs/semantics.md §2.7; DeepEP antgroup-opt's
// comp_signal and hybrid-ep's src_signals). The caller's down GEMM writes y (its tensor, or
// ll_next_combine_buffer with zero_copy) and raises `signals` as parts of it are stored; the
// combine, called after the GEMM was enqueued (on another stream, so that both run at once),
// sends each part to its source ranks as soon as its signal is reached, on `num_sms` SMs. The
// result is the plain combine's, bit for bit, whatever order the signals come in. A signal that
// is never reached ends the send in Timeout naming (l, block, wanted, seen) after the group's
// timeout. epx never writes the signals: the caller zeroes them before each GEMM (CUDA-graph
// replays included).
struct LlCombineOverlap {
  // int32, contiguous, on the buffer's device (cpu backend: host memory, read with atomic loads
  // while another thread raises it). With block_rows > 0: at least L * ceil(R*T_max /
  // block_rows) elements, signal l * ceil(R*T_max / block_rows) + b covering rows
  // [b * block_rows, min((b + 1) * block_rows, recv_count[l])) of local expert l; with
  // block_rows = 0: at least L elements, signal l covering all of expert l's rows. Experts
  // without rows are not waited for. (uint32 signals travel as their int32 view: only the bits
  // count.)
  TensorView signals;
  int64_t block_rows = 0;
  // A signal is reached when (int32_t)(value - expected) >= 0 (wrap-safe). 1 .. 2^31 - 1.
  int64_t expected = 1;
  // SMs (CTAs) of the send half: 0 = auto (3 with block_rows > 0, 32 without, the forks'
  // defaults), clamped to the ll kernels' CTAs on cuda. The GEMM should leave them free.
  int num_sms = 0;
  // Optional [L] int32 on the buffer's device: the dispatch's recv_count (DeepEP's
  // packed_recv_count). A value that differs from the handle's raises InvalidArgument (cuda:
  // from the device, by the next call or check()).
  TensorView recv_count;
};

struct LlCombineArgs {
  TensorView y;             // [L, R * T_max, H] bf16, stride(2) 1 (ignored when zero_copy); only
                            // rows < recv_count[l] are read
  TensorView topk_idx;      // [T, K], the dispatch's (counts that disagree with what the expert
                            // ranks received raise InvalidArgument)
  TensorView topk_weights;  // [T, K] f32 (entries where topk_idx is -1 are not used)
  const LlHandle* handle = nullptr;
  bool zero_copy = false;   // y was written into ll_next_combine_buffer(handle)
  bool return_recv_hook = false;
  // LogFMT-10 (DeepEP's use_logfmt, docs/semantics.md §2.3.1): every expert row y(t, k) crosses
  // as 10-bit log-domain codes per 128-channel group where the group allows it, and the sum uses
  // the decoded values. Equal on every rank (else InvalidArgument). With zero_copy the rows of
  // ll_next_combine_buffer are encoded in place (their contents after the call are unspecified).
  bool use_logfmt = false;
  TensorView out;  // optional [T, H] bf16 (stride(1) 1) to write into
  // Optional [R] int64, contiguous, on the buffer's device (DeepEP's
  // combine_wait_recv_cost_stats): element s is ADDED the nanoseconds this rank's receive waited
  // for the expert outputs of rank s (docs/semantics.md §2.5; with return_recv_hook, in the hook).
  TensorView combine_wait_recv_cost_stats;
  // Signal-driven send, overlapped with the expert GEMM (above). Not with use_logfmt
  // (Unsupported). Every rank passes it, or none (else every rank raises InvalidArgument). y is
  // read while the GEMM writes it: each part only after its signal was reached.
  std::optional<LlCombineOverlap> overlap;
  Stream stream = nullptr;
};

struct LlCombineResult {
  Tensor out;  // [T, H] bf16 (aliases args.out when given: a view without storage)
  LlHook hook;
};

}  // namespace epx
