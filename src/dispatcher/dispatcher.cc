// src/dispatcher/dispatcher.cc — epx::Dispatcher over Buffer (ht + ll) or A2a.
//
// Data flow per call:
//   dispatch_a: resolve the mode (normal -> ht, low_latency -> ll, auto: extend -> ht,
//               decode -> ll; ht -> ll switches clean the ll state), quantise when the mode
//               moves quantised rows (ht: fp8 rows + scales; a2a: fp8 or NVFP4 payloads; ll
//               quantises inside its kernel, fp8 or NVFP4), start the dispatch (ll with the hook:
//               send only).
//               ht with UE8M0: the received row-major scale words are re-laid column-major,
//               TMA-aligned (core/quant.h) on the same stream.
//   hooks:      run in registration order.
//   dispatch_b: finish the receive (ll: call the hook), record expert load, build the output.
//   combine_a:  start the combine (ll with the hook: send only).
//   combine_b:  finish it and return out [T, H] bf16.
// Expert load counts, per local expert, the received tokens that selected it (a token that
// selected the same local expert twice counts once): core/expert_load.h, on the host for cpu
// tensors, on the device for cuda tensors.
//
// Devices and streams: the same code runs on cpu and cuda tensors; quantisation, the a2a id
// narrowing and the load recording go through core/quant.h and core/expert_load.h, which run
// cuda tensors through src/cuda/quant.cu. Every stage queues all its cuda work on one stream,
// State::stream: the stage's argument, else the previous stage's (dispatcher.h lists the rules);
// stage b given another stream orders it after stage a's first (ll's receive hook runs on stage
// a's stream). Host waits: ht exact mode (learning N, inside Buffer::ht_dispatch), the ht -> ll
// switch (ll_clean), expert_load(); the first two refuse to start under CUDA-graph capture
// (they would wait for work the capture never runs).
#include "epx/dispatcher.h"

#include <algorithm>

#include "core/agree.h"
#include "core/check.h"
#include "core/cuda_runtime_shim.h"
#include "core/expert_load.h"
#include "core/quant.h"
#include "core/validate.h"
#include "transport/transport.h"

namespace epx {

const char* dispatch_mode_name(DispatchMode m) {
  switch (m) {
    case DispatchMode::kNormal: return "normal";
    case DispatchMode::kLowLatency: return "low_latency";
    case DispatchMode::kAuto: return "auto";
  }
  return "?";
}

const char* dispatch_quant_name(DispatchQuant q) {
  switch (q) {
    case DispatchQuant::kBf16: return "bf16";
    case DispatchQuant::kFp8: return "fp8";
    case DispatchQuant::kFp8Ue8m0: return "fp8_ue8m0";
    case DispatchQuant::kNvfp4: return "nvfp4";
  }
  return "?";
}

const char* output_format_name(OutputFormat f) {
  switch (f) {
    case OutputFormat::kHt: return "ht";
    case OutputFormat::kLl: return "ll";
    case OutputFormat::kA2a: return "a2a";
  }
  return "?";
}

namespace {

enum class Stage { kInitial, kAfterDispatchA, kAfterDispatchB, kAfterCombineA };

const char* stage_str(Stage s) {
  switch (s) {
    case Stage::kInitial: return "initial";
    case Stage::kAfterDispatchA: return "after_dispatch_a";
    case Stage::kAfterDispatchB: return "after_dispatch_b";
    case Stage::kAfterCombineA: return "after_combine_a";
  }
  return "?";
}

}  // namespace

struct Dispatcher::State {
  Group group;
  DispatcherConfig config;
  int num_ranks = 1;
  int num_local_experts = 1;
  std::unique_ptr<Buffer> buffer;  // backend kDeepEp
  std::unique_ptr<A2a> a2a;        // backend kA2a
  std::vector<std::function<void()>> hooks;
  std::unique_ptr<detail::ExpertLoad> load;
  Stage stage = Stage::kInitial;
  OutputFormat format = OutputFormat::kHt;
  bool last_was_ht = false;
  Stream stream = nullptr;  // of the last stage (what the next one defaults to)
  Device device;            // of the call in flight (cpu: streams are ignored)

  // In-flight call state.
  int64_t num_tokens = 0;
  TensorView topk_idx, topk_weights;
  HtDispatchResult ht;
  LlDispatchResult ll;
  LlCombineResult ll_combine;
  HtCombineResult ht_combine;
  A2aDispatchResult a2a_recv;
  Tensor a2a_out;
  std::vector<Tensor> keep_alive;  // quantised payloads and index copies used by a2a
  Tensor out;

  State(const Group& g, const DispatcherConfig& c) : group(g), config(c) {}

  // Why stages are refused (a Timeout escaped one) until reset(); empty while usable.
  std::string refused;
  void failed(const Error& e) {
    if (e.code() == ErrorCode::kTimeout && refused.empty()) refused = e.what();
  }

  void expect(Stage want, const char* call) {
    EPX_CHECK(refused.empty(), ErrorCode::kOutOfStep, "Dispatcher::", call,
              ": refused, since an earlier stage timed out (", refused,
              "); expected every rank to call reset() first");
    EPX_CHECK_ARG(stage == want, "Dispatcher::", call, ": called in stage ", stage_str(stage),
                  ", expected stage ", stage_str(want),
                  " (order: dispatch_a -> dispatch_b -> combine_a -> combine_b)");
  }

  // Stage b: its own stream, ordered after stage a's (whose work, ll's receive hook included,
  // is queued by then), or stage a's.
  void enter_stage_b(std::optional<Stream> given) {
    if (!given || *given == stream) return;
    if (device.type == DeviceType::kCuda) detail::cuda_stream_wait_stream(*given, stream, device.index);
    stream = *given;
  }

  // Host waits cannot run while `stream` is being captured: they would wait for device work
  // that the capture only records.
  void refuse_under_capture(const char* what, const char* instead) const {
    EPX_CHECK(device.type != DeviceType::kCuda ||
                  !detail::cuda_stream_is_capturing(stream, device.index),
              ErrorCode::kUnsupported, "Dispatcher::dispatch_a: ", what,
              " waits on the host and cannot run while its stream (", stream,
              ") is being captured into a CUDA graph; expected ", instead);
  }
};

namespace {

std::string show_backend(int64_t v) {
  return v == static_cast<int64_t>(DispatcherBackend::kA2a) ? "a2a" : "deepep";
}
std::string show_mode(int64_t v) { return dispatch_mode_name(static_cast<DispatchMode>(v)); }
std::string show_quant(int64_t v) { return dispatch_quant_name(static_cast<DispatchQuant>(v)); }

}  // namespace

Dispatcher::Dispatcher(const Group& group, const DispatcherConfig& c)
    : s_(std::make_unique<State>(group, c)) {
  const int R = group.size();
  // Every rank must pass the same config (all of it but the allocator): compared first, in one
  // small exchange (core/agree.h), so a difference is an InvalidArgument on every rank and the
  // checks below reach the same verdict everywhere.
  detail::agree(group, "Dispatcher",
                {{"config.num_experts", c.num_experts},
                 {"config.hidden", c.hidden},
                 {"config.top_k", c.top_k},
                 {"config.max_tokens_per_rank", c.max_tokens_per_rank},
                 {"config.backend", static_cast<int64_t>(c.backend), show_backend},
                 {"config.mode", static_cast<int64_t>(c.mode), show_mode},
                 {"config.quant", static_cast<int64_t>(c.quant), show_quant},
                 {"config.num_worst_tokens", c.num_worst_tokens},
                 {"config.return_recv_hook", c.return_recv_hook, detail::show_bool},
                 {"config.ht_zero_copy", c.ht_zero_copy, detail::show_bool}});
  EPX_CHECK_ARG(c.num_experts > 0 && c.num_experts % R == 0, "Dispatcher: 'num_experts' is ",
                c.num_experts, ", expected a positive multiple of the group size ", R);
  EPX_CHECK_ARG(c.hidden > 0 && c.hidden % 128 == 0, "Dispatcher: 'hidden' is ", c.hidden,
                ", expected a positive multiple of 128");
  EPX_CHECK_ARG(c.top_k >= 1 && c.top_k <= 32, "Dispatcher: 'top_k' is ", c.top_k,
                ", expected 1..32");
  EPX_CHECK_ARG(c.max_tokens_per_rank >= 1, "Dispatcher: 'max_tokens_per_rank' is ",
                c.max_tokens_per_rank, ", expected >= 1");
  s_->num_ranks = R;
  s_->num_local_experts = c.num_experts / R;
  // On a cuda group the device counter is made here, so no dispatch allocates it (capture).
  s_->load = std::make_unique<detail::ExpertLoad>(s_->num_local_experts, group.transport()->device());
  if (c.backend == DispatcherBackend::kDeepEp) {
    const char* mode = dispatch_mode_name(c.mode);
    EPX_CHECK(c.quant != DispatchQuant::kNvfp4 || c.mode == DispatchMode::kLowLatency,
              ErrorCode::kUnsupported,
              "Dispatcher: 'quant' nvfp4 with backend deepep needs mode low_latency (ll quantises "
              "NVFP4 in its dispatch; ht moves bf16 or fp8 rows), got mode ",
              mode, "; expected mode low_latency or backend a2a");
    MoeShape shape{c.hidden, c.top_k, c.num_experts, c.max_tokens_per_rank};
    BufferConfig bc;
    bc.enable_ht = c.mode != DispatchMode::kLowLatency;
    bc.enable_ll = c.mode != DispatchMode::kNormal;
    s_->buffer = std::make_unique<Buffer>(group, shape, bc);
  } else {
    EPX_CHECK_ARG(c.mode != DispatchMode::kLowLatency,
                  "Dispatcher: 'mode' low_latency needs backend deepep, expected normal or auto "
                  "with backend a2a");
    A2aShape shape;
    shape.max_tokens_per_rank = c.max_tokens_per_rank;
    shape.top_k = c.top_k;
    shape.num_experts = c.num_experts;
    const size_t H = static_cast<size_t>(c.hidden);
    switch (c.quant) {
      case DispatchQuant::kBf16: shape.payload_bytes_per_token = {H * 2}; break;
      case DispatchQuant::kFp8: shape.payload_bytes_per_token = {H, H / 128 * 4}; break;
      case DispatchQuant::kFp8Ue8m0:
        shape.payload_bytes_per_token = {H, (H / 128 + 3) / 4 * 4};
        break;
      case DispatchQuant::kNvfp4: shape.payload_bytes_per_token = {H / 2, H / 16}; break;
    }
    shape.payload_bytes_per_token.push_back(c.top_k * 4);  // expert ids, int32
    shape.payload_bytes_per_token.push_back(c.top_k * 4);  // weights, f32
    shape.combine_bytes_per_token = H * 2;
    s_->a2a = std::make_unique<A2a>(group, shape);
  }
}

Dispatcher::~Dispatcher() = default;
Dispatcher::Dispatcher(Dispatcher&&) noexcept = default;
Dispatcher& Dispatcher::operator=(Dispatcher&&) noexcept = default;

void Dispatcher::register_hook(std::function<void()> hook) { s_->hooks.push_back(std::move(hook)); }
void Dispatcher::clear_hooks() { s_->hooks.clear(); }
std::vector<int64_t> Dispatcher::expert_load(std::optional<Stream> stream) const {
  return s_->load->read(stream.value_or(s_->stream));
}
void Dispatcher::reset_expert_load(std::optional<Stream> stream) {
  s_->load->reset(stream.value_or(s_->stream));
}
void Dispatcher::reset(std::optional<Stream> stream) {
  State& s = *s_;
  if (s.buffer) s.buffer->reset();
  if (s.a2a)
    s.a2a->set_active_ranks(std::vector<bool>(s.num_ranks, true), stream.value_or(s.stream));
  s.stage = Stage::kInitial;
  s.refused.clear();
  s.ht = {};
  s.ll = {};
  s.ll_combine = {};
  s.ht_combine = {};
  s.a2a_recv = {};
  s.a2a_out = {};
  s.keep_alive.clear();
  s.out = {};
  s.topk_idx = s.topk_weights = TensorView{};
  s.num_tokens = 0;
}
Stream Dispatcher::stream() const { return s_->stream; }
OutputFormat Dispatcher::last_format() const { return s_->format; }
const char* Dispatcher::stage_name() const { return stage_str(s_->stage); }

void Dispatcher::dispatch_a(const TensorView& x, const TensorView& topk_idx,
                            const TensorView& topk_weights, ForwardMode forward_mode,
                            std::optional<float> global_scale, Stream stream) try {
  State& s = *s_;
  s.expect(Stage::kInitial, "dispatch_a");
  const DispatcherConfig& c = s.config;
  detail::check_defined(x, "Dispatcher::dispatch_a", "x");
  detail::check_dtype(x, "Dispatcher::dispatch_a", "x", {DType::kBF16});
  detail::check_shape(x, "Dispatcher::dispatch_a", "x", {-1, c.hidden});
  detail::check_defined(topk_weights, "Dispatcher::dispatch_a", "topk_weights");
  detail::check_dtype(topk_weights, "Dispatcher::dispatch_a", "topk_weights", {DType::kF32});
  detail::check_shape(topk_weights, "Dispatcher::dispatch_a", "topk_weights", {x.shape[0], c.top_k});
  EPX_CHECK_ARG(c.quant != DispatchQuant::kNvfp4 || global_scale.has_value(),
                "Dispatcher::dispatch_a: argument 'global_scale' is required with quant nvfp4");
  const Allocator alloc = s.config.allocator ? s.config.allocator : default_allocator();
  s.stream = stream;
  s.device = x.device;
  s.num_tokens = x.shape[0];
  s.topk_idx = topk_idx;
  s.topk_weights = topk_weights;
  s.keep_alive.clear();

  if (c.backend == DispatcherBackend::kA2a) {
    // topk_idx is read (narrowed to int32) here, before the a2a validation sees it: validate it
    // first (values too, where the host can read them), so a short tensor is not overread and an
    // int64 id is never wrapped onto a valid expert (on cuda, ids outside int32 narrow to
    // INT32_MIN and are reported as out of range on the device).
    detail::validate_topk_idx(topk_idx, c.top_k, c.num_experts, x.device, "Dispatcher::dispatch_a");
    detail::check_shape(topk_idx, "Dispatcher::dispatch_a", "topk_idx", {x.shape[0], c.top_k});
    s.format = OutputFormat::kA2a;
    // Payloads: [x (or quantised values), (scales), expert ids int32, weights f32].
    std::vector<TensorView> payloads;
    if (c.quant == DispatchQuant::kBf16) {
      payloads.push_back(x);
    } else {
      // The payload moves contiguous per-token rows, so UE8M0 words are written row-major.
      detail::QuantizedTensor q =
          c.quant == DispatchQuant::kNvfp4
              ? detail::quantize_nvfp4(x, *global_scale, alloc, stream)
              : detail::quantize_fp8(x, c.quant == DispatchQuant::kFp8Ue8m0, alloc, stream,
                                     detail::Ue8m0Layout::kRowMajor);
      s.keep_alive.push_back(q.values);
      s.keep_alive.push_back(q.scales);
      payloads.push_back(q.values);
      payloads.push_back(q.scales);
    }
    // Expert ids travel as int32 (the a2a routing input too), narrowed on x's device.
    Tensor ids = detail::narrow_topk_idx(topk_idx, alloc, stream);
    s.keep_alive.push_back(ids);
    payloads.push_back(ids);
    payloads.push_back(topk_weights);
    A2aDispatchArgs args;
    args.topk_idx = ids;
    args.payloads = payloads;
    args.runtime_max_tokens_per_rank = c.max_tokens_per_rank;
    args.invalid_expert_id = -1;
    args.expert_id_payload_index = static_cast<int>(payloads.size()) - 2;
    args.stream = stream;
    s.a2a_recv = s.a2a->dispatch(args);
  } else {
    const bool use_ll = c.mode == DispatchMode::kLowLatency ||
                        (c.mode == DispatchMode::kAuto && forward_mode == ForwardMode::kDecode);
    if (use_ll) {
      s.format = OutputFormat::kLl;
      if (s.last_was_ht) {
        s.refuse_under_capture("the switch from ht to ll (ll_clean synchronises the device)",
                               "one decode batch run before capturing");
        s.buffer->ll_clean();
      }
      s.last_was_ht = false;
      LlDispatchArgs args;
      args.x = x;
      args.topk_idx = topk_idx;
      args.use_fp8 = c.quant == DispatchQuant::kFp8 || c.quant == DispatchQuant::kFp8Ue8m0;
      args.round_scale = c.quant == DispatchQuant::kFp8Ue8m0;
      args.use_ue8m0 = c.quant == DispatchQuant::kFp8Ue8m0;
      args.use_nvfp4 = c.quant == DispatchQuant::kNvfp4;
      if (args.use_nvfp4) args.global_scale = global_scale;  // by value: capturable as is
      args.return_recv_hook = c.return_recv_hook;
      args.stream = stream;
      s.ll = s.buffer->ll_dispatch(args, alloc);
    } else {
      if (c.num_worst_tokens == 0)
        s.refuse_under_capture("ht exact mode (num_worst_tokens = 0: the count exchange)",
                               "num_worst_tokens > 0 (ht worst-case mode) or ll (mode "
                               "low_latency, or decode batches under auto)");
      s.format = OutputFormat::kHt;
      s.last_was_ht = true;
      HtDispatchArgs args;
      args.topk_idx = topk_idx;
      args.topk_weights = topk_weights;
      args.num_worst_tokens = c.num_worst_tokens;
      args.zero_copy = c.ht_zero_copy;
      args.stream = stream;
      if (c.quant == DispatchQuant::kBf16) {
        args.x = x;
        s.ht = s.buffer->ht_dispatch(args, alloc);
      } else {
        // ht moves each token's scale row with it: UE8M0 words go out row-major and the received
        // rows are re-laid column-major, TMA-aligned (what grouped GEMMs read; quant.h).
        const bool ue8m0 = c.quant == DispatchQuant::kFp8Ue8m0;
        detail::QuantizedTensor q =
            detail::quantize_fp8(x, ue8m0, alloc, stream, detail::Ue8m0Layout::kRowMajor);
        args.x = q.values;
        args.x_scales = q.scales;
        s.ht = s.buffer->ht_dispatch(args, alloc);
        if (ue8m0)
          s.ht.recv_x_scales = detail::ue8m0_to_column_major(s.ht.recv_x_scales, alloc, stream);
      }
    }
  }
  s.stage = Stage::kAfterDispatchA;
  for (auto& hook : s.hooks) hook();
} catch (const Error& e) {
  s_->failed(e);
  throw;
}

DispatchOutput Dispatcher::dispatch_b(std::optional<Stream> stream) try {
  State& s = *s_;
  s.expect(Stage::kAfterDispatchA, "dispatch_b");
  const DispatcherConfig& c = s.config;
  const int R = s.num_ranks, K = c.top_k;
  DispatchOutput out;
  out.format = s.format;
  if (s.format == OutputFormat::kHt) {
    out.x = s.ht.recv_x;
    out.x_scale = s.ht.recv_x_scales;
    out.topk_idx = s.ht.recv_topk_idx;
    out.topk_weights = s.ht.recv_topk_weights;
    out.num_recv_tokens_per_expert = s.ht.num_recv_tokens_per_expert;
    if (c.ht_zero_copy) out.moe_output_view = s.buffer->ht_combine_buffer(s.ht.handle);
    s.enter_stage_b(stream);
    s.load->add_local_ids(s.ht.recv_topk_idx, s.stream);
  } else if (s.format == OutputFormat::kLl) {
    if (s.ll.hook) s.ll.hook();  // on dispatch_a's stream
    s.enter_stage_b(stream);
    out.x = s.ll.recv_x;
    out.x_scale = s.ll.recv_scales;
    out.masked_m = s.ll.recv_count;
    out.topk_idx = Tensor{s.topk_idx, nullptr};  // ll experts see the original routing
    out.topk_weights = Tensor{s.topk_weights, nullptr};
    out.expected_m = (s.num_tokens * R * K + c.num_experts) / c.num_experts;
    s.load->add_counts(s.ll.recv_count, s.stream);
  } else {
    s.enter_stage_b(stream);
    const auto& recv = s.a2a_recv.recv;
    const size_t n = recv.size();
    out.x = Tensor{recv[0], nullptr};
    if (n == 4) out.x_scale = Tensor{recv[1], nullptr};
    out.topk_idx = Tensor{recv[n - 2], nullptr};
    out.topk_weights = Tensor{recv[n - 1], nullptr};
    out.moe_output_view =
        s.a2a->combine_payload_view(c.max_tokens_per_rank, c.hidden, DType::kBF16);
    s.load->add_global_ids(recv[n - 2], s.a2a_recv.recv_counts, s.group.rank(), s.stream);
  }
  s.stage = Stage::kAfterDispatchB;
  return out;
} catch (const Error& e) {
  s_->failed(e);
  throw;
}

void Dispatcher::combine_a(const CombineInput& input) try {
  State& s = *s_;
  s.expect(Stage::kAfterDispatchB, "combine_a");
  if (input.stream) s.stream = *input.stream;
  const Stream stream = s.stream;  // every cuda operation of this stage
  const Allocator alloc = s.config.allocator ? s.config.allocator : default_allocator();
  EPX_CHECK_ARG(!input.overlap || s.format == OutputFormat::kLl,
                "combine_a: CombineInput::overlap is given for a",
                s.format == OutputFormat::kHt ? "n ht" : " a2a",
                " dispatch, expected it only with ll (mode low_latency, or auto for decode)");
  if (s.format == OutputFormat::kHt) {
    HtCombineArgs args;
    args.y = input.y;
    args.handle = &s.ht.handle;
    args.stream = stream;
    if (input.y_in_output_view) {
      EPX_CHECK_ARG(s.config.ht_zero_copy, "combine_a: CombineInput::y_in_output_view is true for ",
                    "an ht dispatch, expected DispatcherConfig::ht_zero_copy = true (ht has an ",
                    "output view only then)");
      args.y = s.buffer->ht_combine_buffer(s.ht.handle);
      args.zero_copy = true;
    }
    s.out = s.buffer->ht_combine(args, alloc).out;
  } else if (s.format == OutputFormat::kLl) {
    LlCombineArgs args;
    args.y = input.y;
    args.topk_idx = s.topk_idx;
    args.topk_weights = s.topk_weights;
    args.handle = &s.ll.handle;
    args.return_recv_hook = s.config.return_recv_hook;
    args.overlap = input.overlap;
    args.stream = stream;
    s.ll_combine = s.buffer->ll_combine(args, alloc);
    s.out = s.ll_combine.out;
  } else {
    const int64_t M = s.config.max_tokens_per_rank;
    if (input.y_in_output_view) {
      TensorView view = s.a2a->combine_payload_view(M, s.config.hidden, DType::kBF16);
      s.out = s.a2a->combine(view, M, /*payload_in_workspace=*/true, stream, alloc);
    } else {
      s.out = s.a2a->combine(input.y, M, false, stream, alloc);
    }
  }
  s.stage = Stage::kAfterCombineA;
} catch (const Error& e) {
  s_->failed(e);
  throw;
}

Tensor Dispatcher::combine_b(std::optional<Stream> stream) try {
  State& s = *s_;
  s.expect(Stage::kAfterCombineA, "combine_b");
  if (s.format == OutputFormat::kLl && s.ll_combine.hook) s.ll_combine.hook();  // combine_a's stream
  s.enter_stage_b(stream);
  s.stage = Stage::kInitial;
  s.keep_alive.clear();
  Tensor out = s.out;
  s.out = Tensor{};
  return out;
} catch (const Error& e) {
  s_->failed(e);
  throw;
}

DispatchOutput Dispatcher::dispatch(const TensorView& x, const TensorView& topk_idx,
                                    const TensorView& topk_weights, ForwardMode forward_mode,
                                    std::optional<float> global_scale, Stream stream) {
  dispatch_a(x, topk_idx, topk_weights, forward_mode, global_scale, stream);
  return dispatch_b();
}

Tensor Dispatcher::combine(const CombineInput& input) {
  combine_a(input);
  return combine_b();
}

}  // namespace epx
