// epx/dispatcher.h — the layer an engine's MoE layer talks to (docs/semantics.md §7).
//
// One Dispatcher per MoE layer group. It owns the mode buffers (ht + ll, or a2a), picks the mode
// per call (normal -> ht, low_latency -> ll, auto: extend batches -> ht, decode batches -> ll),
// quantises activations for the expert GEMMs, runs registered hooks between the two dispatch
// stages and records expert load.
//
//   dispatch_a(x, topk) -> [hooks] -> dispatch_b() -> DispatchOutput
//   (experts run on DispatchOutput)
//   combine_a(CombineInput) -> combine_b() -> out[T, H] bf16
//
// Stage machine: initial -> after_dispatch_a -> after_dispatch_b -> after_combine_a -> initial.
// A stage called out of order raises InvalidArgument naming the stage that was expected.
// dispatch() and combine() are dispatch_a + dispatch_b and combine_a + combine_b.
// All calls are collective over the group (every rank calls the same sequence).
// Streams (cuda tensors; the cpu backend runs every call synchronously on the calling thread and
// ignores every stream argument): each stage takes a stream (a cudaStream_t as void*; nullptr =
// the legacy default stream) and queues ALL its device work on it — quantisation, the mode
// kernels (ht, ll, a2a), the UE8M0 re-layout, expert-load recording — and never synchronises the
// device or the legacy stream behind the caller's back.
//   dispatch_a  the given stream (default nullptr)
//   dispatch_b  the stream of its dispatch_a unless given; ll's receive (the hook of an ll
//               dispatch sent with return_recv_hook) always runs on dispatch_a's stream, and a
//               different given stream is ordered after it (event, no host wait)
//   combine_a   CombineInput::stream, else the stream the dispatch ended on
//   combine_b   like dispatch_b, for combine_a's stream
// Outputs are ready on the stream of the stage that returns them; the caller keeps the inputs
// of each stage (x, topk_idx, topk_weights, y) alive and unmodified until the work queued on that
// stream has consumed them — ll reads topk_idx/topk_weights up to combine_b's completion, a2a and
// ht read x until dispatch_b's. Host waits: ht exact mode (one per dispatch_a, the count
// exchange), an ht -> ll switch under auto (ll_clean: a device-wide synchronisation and a
// barrier), expert_load(), and the construction.
// CUDA graphs: ll (bf16, fp8 and NVFP4, with or without return_recv_hook), a2a and ht
// worst-case mode (num_worst_tokens > 0) are capturable on a non-default stream; ht exact mode
// and the ht -> ll switch raise Unsupported while the stream is capturing. Outputs of a captured
// call come from the allocator at capture time (replays rewrite the same memory).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "epx/a2a.h"
#include "epx/buffer.h"
#include "epx/group.h"
#include "epx/tensor.h"

namespace epx {

enum class DispatcherBackend { kDeepEp /* ht + ll */, kA2a };
enum class DispatchMode { kNormal, kLowLatency, kAuto };
// What the experts receive: bf16, fp8 e4m3 per token per 128 channels with f32 scales or with
// packed UE8M0 scales (int32, ceil(H/512) per token), or NVFP4 (e2m1 pairs + e4m3 scale per 16
// values and a float32 global scale). Scale layouts in DispatchOutput: f32 scales row-major in
// ht; UE8M0 column-major and TMA-aligned in ht (see DispatchOutput); ll column-major in the last
// two dims (as ll_dispatch returns them); a2a row-major per received row (payload views).
// NVFP4 needs backend a2a, or backend deepep with mode low_latency (ll's NVFP4 dispatch: x and
// x_scale in the interleaved layout of epx/ll.h); with deepep and mode normal or auto it is
// Unsupported (ht moves bf16 or fp8 rows).
enum class DispatchQuant { kBf16, kFp8, kFp8Ue8m0, kNvfp4 };
enum class ForwardMode { kExtend, kDecode };
enum class OutputFormat { kHt, kLl, kA2a };

const char* dispatch_mode_name(DispatchMode m);
const char* dispatch_quant_name(DispatchQuant q);
const char* output_format_name(OutputFormat f);

struct DispatcherConfig {
  int num_experts = 0;             // E
  int64_t hidden = 0;              // H
  int top_k = 0;                   // K
  int64_t max_tokens_per_rank = 0; // largest T of any call (ll T_max, a2a max tokens)
  DispatcherBackend backend = DispatcherBackend::kDeepEp;
  DispatchMode mode = DispatchMode::kAuto;
  DispatchQuant quant = DispatchQuant::kBf16;
  // ht worst-case rows (0 = exact mode with one host sync per dispatch).
  int64_t num_worst_tokens = 0;
  // ll: dispatch_a only sends; dispatch_b (after the hooks) receives.
  bool return_recv_hook = true;
  // ht zero-copy (HtDispatchArgs / HtCombineArgs::zero_copy): DispatchOutput::x and x_scale (fp8;
  // ue8m0 scales are re-laid into a tensor of their own) are views of the buffer, valid until
  // the next dispatch_a / combine_a; moe_output_view is where the experts may write y for
  // CombineInput::y_in_output_view (it shares memory with a bf16 x: in place is fine).
  bool ht_zero_copy = false;
  // Allocates the outputs (empty: default_allocator()); the Python package passes PyTorch's.
  Allocator allocator;
};

struct DispatchOutput {
  OutputFormat format = OutputFormat::kHt;
  // ht:  x [N, H] (num_worst_tokens rows in worst-case mode), x_scale, topk_idx [N, K] local ids
  //      or -1, topk_weights [N, K], num_recv_tokens_per_expert (host list, empty in worst-case
  //      mode).
  //      x_scale with kFp8: f32 [N, H/128] contiguous. With kFp8Ue8m0: int32 [N, W],
  //      W = ceil(H/512), 4 UE8M0 bytes per int (group g in byte g % 4 of word g / 4, bytes of
  //      groups >= H/128 are 0), in the MN-major TMA-aligned layout DeepGEMM-style grouped GEMMs
  //      read (get_mn_major_tma_aligned_packed_ue8m0_tensor's): strides {1, M} with
  //      M = align4(N) = (N + 3) / 4 * 4 (16 bytes), i.e. word (m, w) is at int offset
  //      m + w * M from x_scale.data; the storage is int32 [W, M] and its padding words
  //      (m in [N, M)) are 0. (Worst-case rows past the received ones are 0 too.)
  // ll:  x [L, R*T_max, H], x_scale, masked_m [L] int32, expected_m; topk_idx and topk_weights
  //      are the caller's dispatch_a views (not owned: keep them alive until combine_a).
  //      NVFP4: x and x_scale are ll_dispatch's NVFP4 views (epx/ll.h): x (R*T_max, H/2, L)
  //      e2m1 pairs, x_scale (32, 4, ceil(R*T_max/128), 4, H/64, L) e4m3, interleaved.
  // a2a: M = max_tokens_per_rank. x [R, M, H] (or NVFP4 [R, M, H/2] u8), x_scale, topk_idx
  //      [R, M, K] int32 global ids (padding rows -1), topk_weights [R, M, K], moe_output_view
  //      [R, M, H] bf16 to write into. Views of the workspace, valid until the next dispatch.
  // ht with DispatcherConfig::ht_zero_copy: x (and fp8 x_scale) are views of the buffer, and
  //      moe_output_view is the [N, H] bf16 combine buffer (Buffer::ht_combine_buffer).
  Tensor x;
  Tensor x_scale;
  Tensor topk_idx;
  Tensor topk_weights;
  std::vector<int> num_recv_tokens_per_expert;
  Tensor masked_m;
  int64_t expected_m = 0;
  TensorView moe_output_view;
};

struct CombineInput {
  // ht: [N, H] bf16, the rows of DispatchOutput::x (weighted by the caller, as in DeepEP);
  // ll: [L, R*T_max, H] bf16 (combine applies topk weights);
  // a2a: ignored when the experts wrote into moe_output_view, else [R, M, H] bf16 (each rank's
  // local experts already weighted and summed).
  TensorView y;
  // a2a, and ht with ht_zero_copy: the experts wrote into DispatchOutput::moe_output_view.
  bool y_in_output_view = false;
  // The stream of combine_a; unset: the stream the dispatch ended on (see the top).
  std::optional<Stream> stream;
  // ll only: combine overlapped with the expert GEMM (epx/ll.h LlCombineOverlap): combine_a,
  // called on another stream after the GEMM was enqueued, sends each block of y once its
  // signal is reached; combine_b receives. Other formats: InvalidArgument.
  std::optional<LlCombineOverlap> overlap;
};

class Dispatcher {
 public:
  // Collective. Every rank passes the same config (all of it but the allocator): compared first,
  // in one small exchange; a difference is InvalidArgument on every rank naming each field and
  // every rank's value.
  Dispatcher(const Group& group, const DispatcherConfig& config);
  ~Dispatcher();
  Dispatcher(Dispatcher&&) noexcept;
  Dispatcher& operator=(Dispatcher&&) noexcept;

  // x [T, H] bf16, topk_idx [T, K] int64/int32 in [-1, E), topk_weights [T, K] f32.
  // kNvfp4 needs `global_scale` (float32 scalar; dequant = e2m1 * scale_e4m3 / global_scale).
  // The hooks run at the end of dispatch_a. ll keeps views of topk_idx and topk_weights until
  // combine_a (the caller keeps them alive). `stream`: see the top (ignored on cpu).
  // Raises Unsupported when `stream` is being captured into a CUDA graph and the call resolves
  // to ht exact mode or switches from ht to ll (both wait on the host).
  void dispatch_a(const TensorView& x, const TensorView& topk_idx, const TensorView& topk_weights,
                  ForwardMode forward_mode = ForwardMode::kExtend,
                  std::optional<float> global_scale = std::nullopt, Stream stream = nullptr);
  // `stream` unset: dispatch_a's.
  DispatchOutput dispatch_b(std::optional<Stream> stream = std::nullopt);
  void combine_a(const CombineInput& input);
  // `stream` unset: combine_a's.
  Tensor combine_b(std::optional<Stream> stream = std::nullopt);

  DispatchOutput dispatch(const TensorView& x, const TensorView& topk_idx,
                          const TensorView& topk_weights,
                          ForwardMode forward_mode = ForwardMode::kExtend,
                          std::optional<float> global_scale = std::nullopt,
                          Stream stream = nullptr);
  Tensor combine(const CombineInput& input);

  // Collective: back in step after a Timeout (docs/semantics.md §4.3). Buffer::reset() (backend
  // deep_ep) or A2a::set_active_ranks with every rank active (backend a2a, on `stream`, unset:
  // stream()); the stage returns to initial and the call in flight is dropped.
  void reset(std::optional<Stream> stream = std::nullopt);

  // The stream of the last stage called (what the next stage defaults to; nullptr initially).
  Stream stream() const;

  // Hooks run, in registration order, on the calling thread at the end of dispatch_a (the stage
  // is already after_dispatch_a), i.e. between dispatch_a's send and dispatch_b's receive. Device
  // work a hook queues belongs on the stream of the dispatch it runs in: stream() (the Python
  // package runs hooks with that stream current).
  void register_hook(std::function<void()> hook);
  void clear_hooks();

  // Expert-load recording: received (token, local expert) pairs per local expert (a token that
  // lists the same expert twice counts once, as in ll's masked_m), accumulated over dispatches
  // since the last reset. [L] int64 copy. Local.
  // On cuda the counts accumulate on the device, recorded on the stream of each dispatch;
  // expert_load() copies them to the host and so synchronises `stream` (unset: stream(), the
  // stream of the last stage; it must be ordered after every recording dispatch).
  // reset_expert_load() is queued on `stream` (unset: stream()); no host wait.
  std::vector<int64_t> expert_load(std::optional<Stream> stream = std::nullopt) const;
  void reset_expert_load(std::optional<Stream> stream = std::nullopt);

  // The mode the last dispatch_a resolved to.
  OutputFormat last_format() const;
  const char* stage_name() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace epx
