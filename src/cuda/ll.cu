// src/cuda/ll.cu — the cuda backend of the ll mode (docs/semantics.md §2): CudaLl (set-up, the host
// state machine of hooks and slots, device-error reporting, ll_clean, teardown) and the dispatch
// / combine launchers. Device code is in kernels/ll/ (region layout: ll_layout.cuh; protocols:
// dispatch.cuh, combine.cuh). CudaBuffer (cuda_buffer.cc) owns one CudaLl when enable_ll and
// forwards its ll_* methods here. The lifecycle every mode shares (device, region, error record,
// decode, teardown) is its DeviceObject (device_object.h).
//
// Data flow, rank r of R, C CTAs of 512 threads per kernel (resolve_ll_ctas), on the caller's
// stream, no host synchronisation:
//   construction  symmetric region (transport allocate: collective, zeroed; part of the Buffer's
//                 collective construction, so no ll call ever allocates)
//   ll_dispatch   outputs from the allocator; ONE kernel (send + receive), or with
//                 return_recv_hook the send kernel now (ll_send.cu: a module of its own, the
//                 same kernel name) and the receive kernel when the hook runs
//   ll_combine    out from the allocator (or the caller's); ONE kernel (publish + pull/reduce),
//                 or with the hook the publish now and the pull/reduce when the hook runs;
//                 with overlap (docs/design.md §7.6) the signal-driven send on S CTAs now and
//                 the receive (C CTAs) right after it on the stream, or when the hook runs
// Both are CUDA-graph capturable: epochs live on the device and advance in the kernels; slots,
// T, pointers and flags are fixed at capture like any kernel argument.
//
// Double buffering: dispatch i uses slot i % 2 (host count), and its combine uses the handle's
// slot. The legal interleavings and the misuse errors are those of the cpu backend (src/cpu/ll.cc):
// at most two dispatches waiting for their hooks, at most one combine per slot waiting for its
// hook, hooks once each and not after ll_clean. A combine completes on a rank only once every
// peer finished pulling from it, so when its hook ran (stream order) the slot's combine buffer
// may be rewritten. Hooks launch on the stream of their call.
//
// Errors found on the device (timeouts, out-of-range expert ids, ranks disagreeing on the
// quantisation options, the NVFP4 global scale or use_logfmt, a combine topk_idx that is not the
// dispatch's) are raised by the next host call on the Buffer or by check(). After a timeout ll is
// unusable until ll_clean() (collective) resets it.
//
// Rank mask (enable_shrink, docs/semantics.md §2.6): a word in the region (LlMask) that the ll
// kernels read and set (a wait for a peer that times out masks it: no error, no unusable state),
// that ll_update_mask / ll_clean_mask / ll_query_mask reach with one small kernel on the
// caller's stream (kernels/ll/mask.cuh), and that ll_clean keeps: its barriers run over the
// unmasked ranks and mask the ones that miss them (DeviceObject::reset_region_masked).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/agree.h"
#include "core/buffer_impl.h"
#include "core/check.h"
#include "core/env.h"
#include "core/quant.h"
#include "core/validate.h"
#include "cuda/cuda_check.h"
#include "cuda/device_object.h"
#include "cuda/dyn_smem.h"
#include "cuda/kernels/ll/combine.cuh"
#include "cuda/kernels/ll/dispatch.cuh"
#include "cuda/kernels/ll/mask.cuh"
#include "cuda/launch.h"
#include "cuda/ll.h"
#include "cuda/ll_send.h"
#include "cuda/trace_buffers.h"
#include "cuda/tuning.h"
#include "transport/transport.h"

namespace epx::detail {

namespace {

// Auto tuning of the ll kernels, in one place: C CTAs of 512 threads, one per token and one per
// local expert where possible (T = 128 at EP2: 128 tokens, 128 local experts), at most 128 and
// at most the device's SMs (every CTA of a kernel must be resident at once: CTAs wait for each
// other through the peers). Every rank must resolve the same C (the flag targets are e * C):
// ranks use the same GPU model and the same GroupOptions::num_sms.
int resolve_ll_ctas(const MoeShape& shape, int num_ranks, int requested, int device_sms) {
  const int64_t L = shape.num_experts / num_ranks;
  int64_t c = std::max<int64_t>({shape.max_tokens_per_rank, L, 1});
  c = std::min<int64_t>({c, kLlMaxCtas, std::max(1, device_sms)});
  if (requested > 0) c = std::min<int64_t>(c, requested);
  return static_cast<int>(std::max<int64_t>(c, 1));
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// What a timeout leaves of the ll state (the end of its message).
constexpr const char* kLlUnusable =
    "the ll state of this buffer is unusable until ll_clean() (every rank must call the same ll "
    "operations and hooks in the same order)";

// What an ll wait awaited (DeviceErrorRecord::a), in the words of the ll protocol.
const char* ll_awaited(const DeviceErrorRecord& e) {
  switch (e.a) {
    case kWaitReady:
      return e.op == kOpLlDispatch
                 ? "the peer to finish reading the previous dispatch of this slot"
                 : "the peer to start this combine (its routing, for the overlapped send)";
    case kWaitCounts:
      return "the routing rows the peer sends";
    case kWaitRows:
      return e.op == kOpLlDispatch ? "the tokens the peer sends" : "the peer's expert outputs";
    case kWaitBarrier:
      return e.op == kOpLlDispatch
                 ? "this rank's other receive CTAs (enable_shrink: they agree on the mask)"
                 : "the peer to finish pulling its rows of this combine";
    default:
      return "the peer";
  }
}

// The limits of the ll kernels, checked before anything is allocated.
void check_ll_supported(const Group& group, const MoeShape& shape) {
  const int R = group.size();
  EPX_CHECK(R <= kMaxRanks, ErrorCode::kUnsupported, "Buffer: the group has ", R,
            " ranks; the cuda ll kernels support at most ", kMaxRanks);
  EPX_CHECK(shape.num_experts <= kLlMaxExperts, ErrorCode::kUnsupported,
            "Buffer: shape.num_experts is ", shape.num_experts,
            "; the cuda ll kernels support at most ", kLlMaxExperts);
  EPX_CHECK(shape.top_k >= 1 && shape.top_k <= kLlMaxTopK, ErrorCode::kUnsupported,
            "Buffer: shape.top_k is ", shape.top_k, "; the cuda ll kernels support 1..",
            kLlMaxTopK);
  EPX_CHECK(shape.max_tokens_per_rank * R <= (int64_t{1} << 30), ErrorCode::kUnsupported,
            "Buffer: shape.max_tokens_per_rank is ", shape.max_tokens_per_rank, " on ", R,
            " ranks; the cuda ll kernels support at most 2^30 rows per local expert");
}

// The overlapped combine's dynamic shared memory (its send's; LogFMT's is under the default
// limit), both instantiations (kShrink).
DynSmemKernel g_ll_combine_smem[2] = {
    DynSmemKernel(reinterpret_cast<const void*>(ll::combine<kLlCombineOverlap, false>)),
    DynSmemKernel(reinterpret_cast<const void*>(ll::combine<kLlCombineOverlap, true>))};

// One launch of the combine instantiation of `mode` (kernels/ll/combine.cuh, LlCombineMode):
// plain and LogFMT with the row map (`direct`, kDirect) or the prefix counts; the overlapped
// form reads neither. kShrink = symm.shrink (BufferConfig::enable_shrink, fixed per Buffer).
template <bool kShrink, bool kDirect>
void launch_combine_rows(int mode, int ctas, size_t smem, cudaStream_t stream, const char* what,
                         const LlCombineParams& p) {
  if (mode == kLlCombineLogfmt)
    launch_kernel(ll::combine<kLlCombineLogfmt, kShrink, false, kDirect>, ctas, kLlThreads, smem,
                  stream, p.pdl, what, p);
  else
    launch_kernel(ll::combine<kLlCombinePlain, kShrink, false, kDirect>, ctas, kLlThreads, smem,
                  stream, p.pdl, what, p);
}
template <bool kShrink>
void launch_combine_form(int mode, bool direct, int ctas, size_t smem, cudaStream_t stream,
                         const char* what, const LlCombineParams& p) {
  if (mode == kLlCombineOverlap)
    launch_kernel(ll::combine<kLlCombineOverlap, kShrink>, ctas, kLlThreads, smem, stream, p.pdl,
                  what, p);
  else if (direct)
    launch_combine_rows<kShrink, true>(mode, ctas, smem, stream, what, p);
  else
    launch_combine_rows<kShrink, false>(mode, ctas, smem, stream, what, p);
}
void launch_combine(int mode, bool direct, int ctas, size_t smem, cudaStream_t stream,
                    const char* what, const LlCombineParams& p) {
  if (p.symm.shrink)
    launch_combine_form<true>(mode, direct, ctas, smem, stream, what, p);
  else
    launch_combine_form<false>(mode, direct, ctas, smem, stream, what, p);
}

// One launch of the dispatch instantiation of p's form (kernels/ll/dispatch.cuh): LlQuant from
// use_fp8 / use_nvfp4 (ll_with_quant); kShrink = symm.shrink (BufferConfig::enable_shrink, fixed
// per Buffer); kFused: both halves in this launch without enable_shrink. A hook's send half is
// the send module's kernel of the same name (ll_send.cu).
template <bool kShrink, bool kFused>
void launch_dispatch_form(int ctas, cudaStream_t stream, const char* what,
                          const LlDispatchParams& p) {
  ll_with_quant(p, [&](auto quant) {
    launch_kernel(ll::dispatch<decltype(quant)::value, kShrink, kFused>, ctas, kLlThreads, 0,
                  stream, p.pdl, what, p);
  });
}

void launch_dispatch(int ctas, cudaStream_t stream, const char* what, const LlDispatchParams& p) {
  if (p.phases == kLlPhaseSend)
    launch_ll_dispatch_send(ctas, stream, what, p);
  else if (p.symm.shrink)
    launch_dispatch_form<true, false>(ctas, stream, what, p);
  else if (p.phases == kLlPhaseBoth)
    launch_dispatch_form<false, true>(ctas, stream, what, p);
  else
    launch_dispatch_form<false, false>(ctas, stream, what, p);
}

#ifdef EPX_LL_TRACE
TraceBuffers g_ll_traces;  // ll_trace_buffer: the newest live CudaLl's (bench only)

// EPX_LL_TRACE_DUMP (kernels/ll/trace.cuh LlTraceRecord): a buffer's dispatch calls from
// EPX_LL_TRACE_FROM on, each call's stamps (its hooks' and the next combine's with them) written
// once the next dispatch call (or the buffer's end) finds them complete: it synchronises the
// streams those calls used, not the device (ranks sharing a GPU would wait for each other). Calls
// on a capturing stream are not recorded.
class LlTraceDump {
 public:
  using Clock = std::chrono::steady_clock;
  void open(int rank) {
    const std::string path = env_ll_trace_dump();
    if (path.empty()) return;
    const std::string file = cat(path, ".rank", rank);
    f_ = std::fopen(file.c_str(), "ab");
    EPX_CHECK(f_ != nullptr, ErrorCode::kInvalidArgument,
              "Buffer: environment variable EPX_LL_TRACE_DUMP is '", path, "', but '", file,
              "' cannot be opened for appending");
    from_ = static_cast<uint64_t>(env_ll_trace_from());
    rank_ = rank;
    host_.resize(kLlTraceItemBase);
  }
  // Before dispatch call `call` (1-based) is launched on `stream`: the previous recorded call's
  // stamps out, then the stamps cleared for this one.
  void before_dispatch(uint64_t* buf, cudaStream_t stream, uint64_t call, bool hook, int64_t T) {
    if (f_ == nullptr) return;
    const std::optional<Clock::time_point> done = flush(buf);
    if (call < from_ || capturing(stream)) return;
    EPX_CUDA_CHECK(cudaMemsetAsync(buf, 0, kLlTraceItemBase * sizeof(uint64_t), stream),
                   "ll_dispatch");
    std::memcpy(rec_.magic, kLlTraceMagic, 4);
    rec_.words = static_cast<uint32_t>(kLlTraceItemBase);
    rec_.call = call;
    rec_.hook = hook ? 1 : 0;
    rec_.rank = rank_;
    rec_.tokens = T;
    rec_.dump_ns =
        done ? std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - *done).count()
             : 0;
    pending_ = true;
    used(stream);
  }
  // A combine of the pending call (its stamps go with it) on `stream`.
  void before_combine(cudaStream_t stream) {
    if (pending_) used(stream);
  }
  // The pending record, once its streams are done; at the buffer's end too (no throwing: a
  // failure leaves the record out). Returns when its streams were found done (none pending: no
  // value).
  std::optional<Clock::time_point> flush(uint64_t* buf) noexcept {
    if (f_ == nullptr || !pending_) return std::nullopt;
    pending_ = false;
    bool ok = true;
    for (cudaStream_t s : streams_) ok = cudaStreamSynchronize(s) == cudaSuccess && ok;
    streams_.clear();
    const Clock::time_point done = Clock::now();
    if (!ok || cudaMemcpy(host_.data(), buf, host_.size() * sizeof(uint64_t),
                          cudaMemcpyDeviceToHost) != cudaSuccess)
      return done;
    std::fwrite(&rec_, sizeof rec_, 1, f_);
    std::fwrite(host_.data(), sizeof(uint64_t), host_.size(), f_);
    std::fflush(f_);
    return done;
  }
  void close(uint64_t* buf) noexcept {
    flush(buf);
    if (f_ != nullptr) std::fclose(f_);
    f_ = nullptr;
  }

 private:
  static bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(stream, &st) != cudaSuccess || st != cudaStreamCaptureStatusNone;
  }
  void used(cudaStream_t stream) {
    if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end())
      streams_.push_back(stream);
  }
  std::FILE* f_ = nullptr;
  uint64_t from_ = 1;
  int32_t rank_ = 0;
  bool pending_ = false;
  LlTraceRecord rec_{};
  std::vector<cudaStream_t> streams_;  // the pending call's (dispatch, hooks, combine)
  std::vector<uint64_t> host_;         // a record's words (sized when a dump is open)
};
#endif

}  // namespace

class CudaLl : public std::enable_shared_from_this<CudaLl> {
 public:
  CudaLl(const Group& group, const MoeShape& shape, bool enable_shrink);
  ~CudaLl();
  CudaLl(const CudaLl&) = delete;
  CudaLl& operator=(const CudaLl&) = delete;

  size_t bytes() const { return dev_.bytes(); }
  void check();
  LlDispatchResult dispatch(const LlDispatchArgs& args, const Allocator& alloc, uint64_t id);
  // `partial` (CudaLlNodes; the plain form without hook): the float32 sums into it, [T, H]
  // contiguous, instead of an out.
  LlCombineResult combine(const LlCombineArgs& args, const Allocator& alloc,
                          float* partial = nullptr);
  TensorView next_combine_buffer(const LlHandle& handle);
  void clean();
  // The rank mask's kernel (kernels/ll/mask.cuh) on `stream`: op, and its rank or output.
  void mask_op(LlMaskOp op, int rank, const TensorView& out, cudaStream_t stream);

 private:
  char* local() const { return dev_.local(); }
  // What both ll kernels' params carry from this object.
  template <typename Params>
  void fill_launch_common(Params& p, uint32_t op) const {
    p.symm = symm_;
    p.wait = dev_.wait_context(op);
    p.pdl = pdl_;
#ifdef EPX_DIAGNOSTICS
    p.ablate = ll_ablation();
#endif
#ifdef EPX_LL_TRACE
    p.trace = trace_;
#endif
  }
  void require_usable(const char* op) const {
    dev_.require_usable(op);
  }
  // After a timeout of `op` on `rank`: unusable until ll_clean or reset.
  void set_unusable(const char* op, int rank) {
    dev_.set_unusable(ErrorCode::kOutOfStep,
                      cat("the ll state of this buffer is unusable after a device wait of ", op,
                          " timed out on rank ", rank,
                          "; call ll_clean() or reset() on every rank to reset it"));
  }
  Tensor allocate(const Allocator& alloc, DType dtype, const std::vector<int64_t>& shape,
                  const char* op, const char* name) const {
    return allocate_ll_output(alloc, dev_.device(), dtype, shape, op, name);
  }
  LlHook make_hook(bool is_dispatch, int slot, std::function<void()> launch);
  LlCombineResult combine_overlapped(const LlCombineArgs& args, LlCombineParams p,
                                     LlCombineResult res, std::exception_ptr failed);

  Group group_;
  MoeShape shape_;
  // The device, the symmetric region, the error record, unusable after a timeout; closed first
  // in ~CudaLl.
  DeviceObject dev_;
  int num_ctas_ = 1;
  int units_per_expert_ = 1;
  bool pdl_ = false;  // programmatic dependent launch (cuda/launch.h: EPX_PDL, sm_90, own GPU)
  LlLayout layout_;
  LlSymm symm_{};
  // Per slot, [T_max * K] routing (i64) and weights (f32) the hooked combine's send copies for
  // its receive (kernels/ll/combine.cuh, copy_own).
  int64_t* stash_ids_ = nullptr;
  float* stash_w_ = nullptr;
  // Host state machine (equal on every rank that follows the same sequence), as on cpu.
  uint64_t num_dispatches_ = 0;
  uint64_t generation_ = 0;  // bumped by ll_clean; older hooks refuse to run
  bool dispatch_in_flight_[2] = {false, false};
  bool combine_in_flight_[2] = {false, false};
  // Dispatches made by this object (never reset: LlHandle::serial), and per slot the serial of
  // the dispatch whose row map the slot holds (0 after ll_clean, which zeroes the maps): a
  // combine reads the row map only through that dispatch's handle (slot_holds).
  uint64_t dispatch_serial_ = 0;
  uint64_t slot_serial_[2] = {0, 0};
  bool slot_holds(uint64_t serial, int slot) const {
    return serial != 0 && serial == slot_serial_[slot];
  }
#ifdef EPX_LL_TRACE
  uint64_t* trace_ = nullptr;  // trace.cuh: kLlTraceWords, zeroed
  LlTraceDump trace_dump_;     // EPX_LL_TRACE_DUMP
#endif
};

CudaLl::CudaLl(const Group& group, const MoeShape& shape, bool enable_shrink)
    : group_(group), shape_(shape), dev_(group, "Buffer") {
  const int R = group.size();
  DeviceGuard guard(dev_.device());
  num_ctas_ = resolve_ll_ctas(shape, R, group.options().num_sms, dev_.multiprocessors());
  pdl_ = pdl_usable(dev_.device(), group.transport()->ranks_share_device(),
                    reinterpret_cast<const void*>(ll::dispatch<kLlQuantFp8, false, true>));
  const int L = shape.num_experts / R;
  units_per_expert_ = std::max(1, num_ctas_ / std::max(1, L));
  layout_ = LlLayout::make(shape, R);
  // The overlapped send's dynamic shared memory is allowed here, once, before any ll kernel of
  // this Buffer runs, rather than at a first overlapped call. Where it does not fit, the
  // overlapped call raises Unsupported. (LogFMT's instantiation stays under the default limit.)
  DynSmemKernel& overlap_kernel = g_ll_combine_smem[enable_shrink ? 1 : 0];
  const DynSmemFacts facts = overlap_kernel.facts("Buffer");
  const size_t overlap_smem = ll_overlap_smem_bytes(layout_);
  if (facts.static_smem + overlap_smem <= static_cast<size_t>(facts.optin))
    overlap_kernel.allow(static_cast<int>(overlap_smem), "Buffer");
  const size_t stash = 2 * static_cast<size_t>(shape.max_tokens_per_rank) * shape.top_k;
  EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&stash_ids_), stash * sizeof(int64_t)),
                 "Buffer");
  EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&stash_w_), stash * sizeof(float)),
                 "Buffer");
  // The region (collective; zeroed).
  dev_.allocate_region(layout_.total_bytes, kLlStateOff + offsetof(LlState, dev));
  symm_.local = local();
  for (int p = 0; p < R; ++p) symm_.peers[p] = dev_.peer(p);
  symm_.layout = layout_;
  symm_.shrink = enable_shrink;
  symm_.one_gpu = R == 1 || group.transport()->ranks_share_device();
#ifdef EPX_LL_TRACE
  trace_dump_.open(group.rank());  // (may throw: before the buffer it would leak)
  trace_ = g_ll_traces.create(dev_.device(), kLlTraceWords);
#endif
}

CudaLl::~CudaLl() {
  dev_.close("Buffer destruction (ll)", [this] {
    if (stash_ids_) cudaFree(stash_ids_);
    if (stash_w_) cudaFree(stash_w_);
#ifdef EPX_LL_TRACE
    trace_dump_.close(trace_);
    g_ll_traces.destroy(dev_.device(), trace_);
#endif
  });
}

void CudaLl::check() {
  require_usable("ll");
  const std::optional<DeviceErrorRecord> rec = dev_.recorded();
  if (!rec) return;
  const DeviceErrorRecord& e = *rec;
  const char* op = device_op_name(e.op);
  // A timeout (t), reported first or after `earlier` had claimed the record.
  auto raise_timeout = [&](const DeviceErrorRecord& t, const std::string& earlier) {
    if ((t.a & 0xFF) == kWaitSignal) {  // kernels/ll/combine.cuh, ll_overlap_wait_signal
      throw_error(ErrorCode::kTimeout,
                  cat(op, ": rank ", t.rank, " waited ", group_.timeout().count(),
                      " ms for the GEMM's signal of local expert ", (t.a >> 8) & 0xFFFFFF,
                      ", block ", t.peer, " (overlap.signals[", t.a >> 32, "] wanted >= ",
                      static_cast<uint64_t>(t.b) >> 32, ", seen ", t.b & 0xFFFFFFFF, ")",
                      earlier, "; ", kLlUnusable));
    }
    dev_.raise_timeout(t, {.awaited = ll_awaited(t),
                           .unusable = kLlUnusable,
                           .seen = DeviceObject::flag_values(t),
                           .earlier = earlier});
  };
  if (e.code == kDevErrTimeout) {
    set_unusable(op, e.rank);
    raise_timeout(e, "");
  }
  // Not fatal: the collective completed. Let the device report the next error.
  dev_.rearm();
  // Unless a wait timed out after this error had claimed the record (it set the abort word,
  // read here after the re-arm so no timeout goes unseen, and kept its fields in the device
  // state): then the state is unusable as after any timeout.
  if (dev_.abort_raised("ll check")) {
    set_unusable(op, group_.rank());
    raise_timeout(dev_.lost_timeout(e),
                  cat(", after device error code ", e.code, " (from rank ", e.peer, ") was reported"));
  }
  switch (e.code) {
    case kDevErrLlFormat: {
      // Each option that differs, both ranks' values, lower rank first (core/agree.h's format);
      // the global scale only when both use NVFP4 (bits 32-63 of the words).
      const bool source_first = e.peer < e.rank;
      const int64_t first = source_first ? e.a : e.b, second = source_first ? e.b : e.a;
      std::string what;
      auto note = [&](const char* name, int64_t v1, int64_t v2, ShowValue show) {
        if (v1 == v2) return;
        what += cat(what.empty() ? "" : "; ", "argument '", name, "' differs across ranks: rank ",
                    std::min(e.peer, e.rank), " has ", show(v1), ", rank ",
                    std::max(e.peer, e.rank), " has ", show(v2));
      };
      const char* names[3] = {"use_fp8", "round_scale", "use_nvfp4"};
      for (int bit = 0; bit < 3; ++bit)
        note(names[bit], first >> bit & 1, second >> bit & 1, show_bool);
      if ((first >> 2 & 1) && (second >> 2 & 1))
        note("x_global_scale", first >> 32 & 0xFFFFFFFF, second >> 32 & 0xFFFFFFFF, show_f32_bits);
      throw_error(ErrorCode::kInvalidArgument,
                  cat(op, ": ", what,
                      "; expected the same on every rank (the outputs of this call are "
                      "undefined)"));
    }
    case kDevErrLlCombineFormat: {
      // The format word: use_logfmt | overlap << 1 (kernels/ll/combine.cuh).
      const bool peer_first = e.peer < e.rank;
      const int64_t first = peer_first ? e.a : e.b, second = peer_first ? e.b : e.a;
      const bool logfmt = (first ^ second) & 1;
      throw_error(
          ErrorCode::kInvalidArgument,
          cat(op, ": ", logfmt ? "argument 'use_logfmt'" : "whether argument 'overlap' is given",
              " differs across ranks: rank ", std::min(e.peer, e.rank), " has ",
              show_bool(first >> (logfmt ? 0 : 1) & 1), ", rank ", std::max(e.peer, e.rank),
              " has ", show_bool(second >> (logfmt ? 0 : 1) & 1),
              "; expected the same on every rank (the outputs of this call are "
              "undefined)"));
    }
    case kDevErrLlOverlapCount:
      throw_error(
          ErrorCode::kInvalidArgument,
          cat(op, ": argument 'overlap.recv_count' has [", e.a, "] = ", e.b >> 32, ", expected ",
              e.b & 0xFFFFFFFF, " (the recv_count of the dispatch that made 'handle')"));
    case kDevErrLlOverlapRoute:
      throw_error(ErrorCode::kInvalidArgument,
                  cat(op, ": argument 'topk_idx' of rank ", e.peer, " does not select expert ", e.b,
                      " for its token ", e.a, ", which the dispatch delivered to rank ", e.rank,
                      "; expected the topk_idx of the dispatch that made 'handle' (that "
                      "row was not sent)"));
    case kDevErrLlCombineRows:
      throw_error(ErrorCode::kInvalidArgument,
                  cat(op, ": argument 'topk_idx' selects expert ", e.b, " at [", e.a / 64, ", ",
                      e.a % 64, "] more often than rank ", e.peer, " received from rank ", e.rank,
                      "; expected the topk_idx of the dispatch that made 'handle' (that selection "
                      "was skipped)"));
    case kDevErrLlCombineNotSent:
      throw_error(ErrorCode::kInvalidArgument,
                  cat(op, ": argument 'topk_idx' selects expert ", e.b, " at [", e.a / 64, ", ",
                      e.a % 64, "], which the dispatch that made 'handle' did not deliver to rank ",
                      e.peer, " for this token; expected the topk_idx of that dispatch (that "
                      "selection was skipped)"));
    default:
      DeviceObject::raise_common(e, shape_.num_experts);  // out-of-range expert ids, unknown codes
  }
}

Tensor allocate_ll_output(const Allocator& alloc, int device, DType dtype,
                          const std::vector<int64_t>& shape, const char* op, const char* name) {
  Tensor t = alloc(dtype, shape, Device::cuda(device));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  bool ok = t.dtype == dtype && t.ndim == static_cast<int>(shape.size()) && t.is_contiguous() &&
            t.device == Device::cuda(device) && (n == 0 || (t.data && aligned16(t.data)));
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = t.shape[i] == shape[i];
  if (!ok) {
    std::string dims;
    for (size_t i = 0; i < shape.size(); ++i) dims += cat(i ? ", " : "", shape[i]);
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": the allocator returned ", t.describe(), " for '", name,
                    "', expected a contiguous 16-byte aligned ", dtype_name(dtype), "[", dims,
                    "] on cuda:", device));
  }
  return t;
}

void allocate_ll_dispatch_outputs(LlDispatchResult& res, const Allocator& alloc, int device,
                                  const LlDispatchArgs& args, int L, int R, int64_t RT,
                                  int64_t H, const char* op) {
  allocate_ll_dispatch_outputs(
      res,
      [&](DType dtype, const std::vector<int64_t>& shape) {
        // The blocks: the handle's (int64), recv_x alone (bf16) or with its scales (uint8).
        return allocate_ll_output(alloc, device, dtype, shape, op,
                                  dtype == DType::kI64  ? "handle and recv_count"
                                  : dtype == DType::kU8 ? "recv_x and recv_scales"
                                                        : "recv_x");
      },
      args, L, R, RT, H);
}

void ll_hook_begin(const char* op, bool alive, bool& called, bool discarded) {
  EPX_CHECK_ARG(alive, op,
                ": its Buffer was destroyed, expected the hook to be called while it lives");
  EPX_CHECK_ARG(!called, op, ": called a second time, expected exactly one call per operation");
  EPX_CHECK_ARG(!discarded, op,
                ": its operation was discarded by ll_clean, expected the hook to be called "
                "before ll_clean");
  called = true;
}

void ll_require_dispatch_slot(const char* op, int slot, bool in_flight) {
  EPX_CHECK_ARG(!in_flight, op, ": dispatch slot ", slot,
                " still holds a dispatch whose hook was not called; expected at most two "
                "dispatches waiting for their hooks (call the older hook first)");
}

// Wraps a receive launch into the hook handed to the caller: once only, not after ll_clean, not
// after the Buffer was destroyed; frees its slot whatever happens.
LlHook CudaLl::make_hook(bool is_dispatch, int slot, std::function<void()> launch) {
  std::weak_ptr<CudaLl> weak = weak_from_this();
  const uint64_t generation = generation_;
  auto called = std::make_shared<bool>(false);
  return [weak, is_dispatch, slot, launch = std::move(launch), called, generation]() {
    const char* op = is_dispatch ? "ll_dispatch hook" : "ll_combine hook";
    std::shared_ptr<CudaLl> self = weak.lock();
    ll_hook_begin(op, self != nullptr, *called, self && self->generation_ != generation);
    bool& in_flight =
        is_dispatch ? self->dispatch_in_flight_[slot] : self->combine_in_flight_[slot];
    in_flight = false;
    self->require_usable(op);
    DeviceGuard guard(self->dev_.device());
    launch();
    EPX_CUDA_CHECK(cudaGetLastError(), op);
  };
}

LlDispatchResult CudaLl::dispatch(const LlDispatchArgs& args, const Allocator& alloc,
                                  uint64_t buffer_id) {
  const char* op = "ll_dispatch";
  require_usable(op);
  const int slot = static_cast<int>(num_dispatches_ % 2);
  ll_require_dispatch_slot(op, slot, dispatch_in_flight_[slot]);
  DeviceGuard guard(dev_.device());
  const int R = group_.size(), L = layout_.num_local_experts;
  const int64_t H = layout_.hidden, RT = layout_.rows_per_expert;
  const int64_t T = args.x.shape[0];
  auto stream = static_cast<cudaStream_t>(args.stream);
  ++num_dispatches_;
#ifdef EPX_LL_TRACE
  trace_dump_.before_dispatch(trace_, stream, num_dispatches_, args.return_recv_hook, T);
#endif

  // Outputs. If the allocator fails, still run the collective (no outputs written) so the peers
  // complete, then report.
  LlDispatchResult res;
  std::exception_ptr failed;
  try {
    allocate_ll_dispatch_outputs(res, alloc, dev_.device(), args, L, R, RT, H, op);
  } catch (...) {
    failed = std::current_exception();
  }
  res.handle.max_tokens = layout_.max_tokens;
  res.handle.hidden = H;
  res.handle.num_experts = shape_.num_experts;
  res.handle.num_tokens = T;
  res.handle.slot = slot;
  res.handle.buffer_id = buffer_id;
  res.handle.serial = slot_serial_[slot] = ++dispatch_serial_;

  LlDispatchParams p{};
  p.x = static_cast<const uint16_t*>(args.x.data);
  p.x_stride = args.x.strides[0];
  p.topk_idx = args.topk_idx.data;
  p.topk_stride = args.topk_idx.strides[0];
  p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
  p.num_tokens = static_cast<int32_t>(T);
  p.x_vec16 = aligned16(args.x.data) && (args.x.strides[0] * 2) % 16 == 0;
  p.use_fp8 = args.use_fp8;
  p.round_scale = args.round_scale;
  p.use_ue8m0 = args.use_ue8m0;
  p.use_nvfp4 = args.use_nvfp4;
  if (args.use_nvfp4) {
    // Validated: exactly one of them; the tensor is float32 on this device.
    p.global_scale_ptr = static_cast<const float*>(args.x_global_scale.data);
    p.global_scale = args.global_scale.value_or(0.0f);
  }
  p.slot = slot;
  p.rank = group_.rank();
  p.units_per_expert = units_per_expert_;
  if (!failed) {
    p.recv_x = static_cast<uint8_t*>(res.recv_x.data);
    p.recv_scales = res.recv_scales.data;
    p.recv_count = res.recv_count.ptr<int32_t>();
    p.src_info = res.handle.src_info.ptr<int32_t>();
    p.layout_range = res.handle.layout_range.ptr<int64_t>();
    const TensorView& stats = args.cumulative_local_expert_recv_stats;
    if (stats.defined()) {
      p.stats = stats.ptr<int32_t>();
      p.stats_stride = stats.strides[0];
    }
    // Validated: int64 [R], contiguous, on this device (null: not measured).
    p.wait_stats = static_cast<int64_t*>(args.dispatch_wait_recv_cost_stats.data);
  }
  fill_launch_common(p, kOpLlDispatch);

  if (failed || !args.return_recv_hook) {
    p.phases = kLlPhaseBoth;
    launch_dispatch(num_ctas_, stream, op, p);
    if (failed) std::rethrow_exception(failed);
    return res;
  }
  p.phases = kLlPhaseSend;
  launch_dispatch(num_ctas_, stream, op, p);
  dispatch_in_flight_[slot] = true;
  // The receive reads only epx's memory; the hook keeps the outputs it writes alive (the caller
  // keeps its stats tensors alive until the hook ran: the Python hook holds them).
  p.phases = kLlPhaseRecv;
  const int ctas = num_ctas_;
  res.hook =
      make_hook(true, slot, [p, ctas, stream, keep = std::make_shared<LlDispatchResult>(res)]() {
        launch_dispatch(ctas, stream, "ll_dispatch hook", p);
      });
  return res;
}

LlCombineResult CudaLl::combine(const LlCombineArgs& args, const Allocator& alloc,
                                float* partial) {
  const char* op = "ll_combine";
  require_usable(op);
  const LlHandle& h = *args.handle;
  const int slot = h.slot;
  EPX_CHECK_ARG(!combine_in_flight_[slot], op, ": combine slot ", slot,
                " still holds a combine whose hook was not called; expected its hook to be called "
                "before another combine through a handle of slot ",
                slot);
  DeviceGuard guard(dev_.device());
  const int64_t H = layout_.hidden, T = h.num_tokens;
  auto stream = static_cast<cudaStream_t>(args.stream);
#ifdef EPX_LL_TRACE
  trace_dump_.before_combine(stream);
#endif

  LlCombineResult res;
  std::exception_ptr failed;
  if (args.out.defined()) {
    static_cast<TensorView&>(res.out) = args.out;
  } else if (!partial) {
    try {
      res.out = allocate(alloc, DType::kBF16, {T, H}, op, "out");
    } catch (...) {
      failed = std::current_exception();
    }
  }

  LlCombineParams p{};
  if (!args.zero_copy) {
    p.y = static_cast<const uint16_t*>(args.y.data);
    p.y_stride0 = args.y.strides[0];
    p.y_stride1 = args.y.strides[1];
    p.y_vec16 = aligned16(args.y.data) && (args.y.strides[0] * 2) % 16 == 0 &&
                (args.y.strides[1] * 2) % 16 == 0;
    // The receive's pulls read 16-byte vectors only: this rank's rows of an unaligned y go
    // through comb_y as the peers' (kernels/ll/combine.cuh, copy_own).
    p.copy_own = !p.y_vec16;
  }
  p.zero_copy = args.zero_copy;
  p.use_logfmt = args.use_logfmt;
  p.layout_range = h.layout_range.ptr<int64_t>();
  p.layout_stride = h.layout_range.strides[0];
  p.units_per_expert = units_per_expert_;
  p.topk_idx = args.topk_idx.data;
  p.topk_stride = args.topk_idx.strides[0];
  p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
  p.weights = args.topk_weights.ptr<float>();
  p.weights_stride = args.topk_weights.strides[0];
  if (!failed && !partial) {
    p.out = res.out.ptr<uint16_t>();
    p.out_stride = res.out.strides[0];
    p.out_vec16 = aligned16(res.out.data) && (res.out.strides[0] * 2) % 16 == 0;
    // Validated: int64 [R], contiguous, on this device (null: not measured). Read by the
    // receive half only (the hook's launch with return_recv_hook).
    p.wait_stats = static_cast<int64_t*>(args.combine_wait_recv_cost_stats.data);
  }
  p.num_tokens = static_cast<int32_t>(T);
  p.slot = slot;
  p.rank = group_.rank();
  fill_launch_common(p, kOpLlCombine);
  if (partial) {
    p.out_f32 = partial;
    p.out_stride = H;
    p.phases = kLlPhaseBoth;
    // The ll across nodes' node-local group, created without enable_shrink (ll_nodes.cu).
    EPX_CHECK(!symm_.shrink, ErrorCode::kInternal, op,
              ": float32 partials on a group with enable_shrink");
    if (slot_holds(h.serial, slot))
      launch_kernel(ll::combine<kLlCombinePlain, false, true, true>, num_ctas_, kLlThreads, 0,
                    stream, p.pdl, op, p);
    else
      launch_kernel(ll::combine<kLlCombinePlain, false, true>, num_ctas_, kLlThreads, 0, stream,
                    p.pdl, op, p);
    return res;
  }
  if (args.overlap) return combine_overlapped(args, p, std::move(res), failed);

  // LogFMT's shared memory is dynamic (kernels/ll/logfmt.cuh), below the 48 KB default limit.
  const size_t smem = args.use_logfmt ? ll_logfmt_smem_bytes() : 0;
  const int mode = args.use_logfmt ? kLlCombineLogfmt : kLlCombinePlain;
  if (failed || !args.return_recv_hook) {
    p.phases = kLlPhaseBoth;
    launch_combine(mode, slot_holds(h.serial, slot), num_ctas_, smem, stream, op, p);
    if (failed) std::rethrow_exception(failed);
    return res;
  }
  // With a hook the send copies everything the receive reads (this rank's own rows, routing,
  // weights, its layout) into epx's memory: the caller may drop or overwrite y, topk_idx,
  // topk_weights and the handle once this returns. The receive reads them there.
  const size_t stash = static_cast<size_t>(slot) * shape_.max_tokens_per_rank * shape_.top_k;
  p.phases = kLlPhaseSend;
  p.copy_own = 1;
  p.stash_ids = stash_ids_ + stash;
  p.stash_w = stash_w_ + stash;
  // Both halves from one instantiation (one profiler name per op, as DeepEP's harness expects):
  // the row map's when the slot holds the handle's now; the hook re-checks (a dispatch into the
  // slot may come between the call and its hook, and then it takes the prefix counts).
  launch_combine(mode, slot_holds(h.serial, slot), num_ctas_, smem, stream, op, p);
  combine_in_flight_[slot] = true;
  LlCombineParams pr = p;
  pr.phases = kLlPhaseRecv;
  pr.copy_own = 0;
  pr.stash_ids = nullptr;
  pr.stash_w = nullptr;
  pr.y = nullptr;
  pr.zero_copy = 1;  // every rank's rows, this one's included, are in comb_y
  pr.layout_range = reinterpret_cast<const int64_t*>(layout_.comb_layout(local(), slot));
  pr.layout_stride = group_.size();
  pr.topk_idx = p.stash_ids;
  pr.topk_is_i64 = 1;
  pr.topk_stride = shape_.top_k;
  pr.weights = p.stash_w;
  pr.weights_stride = shape_.top_k;
  // The hook keeps an allocated out alive; a given out must stay alive until it ran. make_hook
  // runs it only while this object lives.
  const int ctas = num_ctas_;
  // (A serial the slot no longer holds never comes back: the check now is the call's too.)
  const uint64_t serial = h.serial;
  res.hook = make_hook(false, slot, [this, pr, ctas, mode, smem, stream, serial, slot,
                                     keep = res.out]() {
    launch_combine(mode, slot_holds(serial, slot), ctas, smem, stream, "ll_combine hook", pr);
  });
  return res;
}

// The overlapped combine (docs/design.md §7.6, kernels/ll/combine.cuh O1-O4): the send on S CTAs
// now; the receive on C CTAs right after it on the stream, or when the hook runs. The receive
// reads only epx's memory (land, route, the layout, the weights the send stashed), so the caller
// may drop its inputs once the send ran; y is read by the send while the GEMM writes it.
LlCombineResult CudaLl::combine_overlapped(const LlCombineArgs& args, LlCombineParams p,
                                           LlCombineResult res, std::exception_ptr failed) {
  const char* op = "ll_combine";
  const LlCombineOverlap& o = *args.overlap;
  const LlHandle& h = *args.handle;
  const int R = group_.size(), K = shape_.top_k, slot = h.slot;
  auto stream = static_cast<cudaStream_t>(args.stream);
  const int S = resolve_ll_overlap_ctas(o.block_rows, o.num_sms, num_ctas_);
  // Ranks sharing a GPU (the one-GPU test mode) wait for each other's sends, which wait for
  // their GEMMs: the GEMMs need SMs that the sends and receives do not hold (cuda/tuning.h).
  EPX_CHECK_ARG(!group_.transport()->ranks_share_device() ||
                    ll_overlap_fits_shared_gpu(R, S, dev_.multiprocessors()),
                op, ": argument 'overlap.num_sms' resolves to ", S, " send CTAs per rank; ", R,
                " ranks share one GPU of ", dev_.multiprocessors(),
                " SMs, expected ranks x send CTAs below that (the GEMMs need SMs too)");
  const size_t smem = ll_overlap_smem_bytes(layout_);
  const DynSmemFacts facts = g_ll_combine_smem[symm_.shrink ? 1 : 0].facts(op);
  EPX_CHECK(facts.static_smem + smem <= static_cast<size_t>(facts.optin), ErrorCode::kUnsupported,
            op, ": the overlapped send needs ", facts.static_smem + smem,
            " bytes of shared memory per CTA for L * R = ", layout_.num_local_experts * R,
            " layout ranges; this GPU allows ", facts.optin);

  p.overlap = 1;
  p.signals = o.signals.ptr<int32_t>();
  p.block_rows = o.block_rows;
  p.blocks = ll_overlap_blocks(shape_, R, o.block_rows);
  p.expected = static_cast<uint32_t>(o.expected);
  p.recv_count = o.recv_count.defined() ? o.recv_count.ptr<int32_t>() : nullptr;
  p.src_info = h.src_info.ptr<int32_t>();
  p.src_info_stride = h.src_info.strides[0];
  p.recv_ctas = num_ctas_;
  p.stash_w = stash_w_ + static_cast<size_t>(slot) * shape_.max_tokens_per_rank * K;
  p.phases = kLlPhaseSend;
  launch_combine(kLlCombineOverlap, false, S, smem, stream, op, p);

  LlCombineParams pr = p;
  pr.phases = kLlPhaseRecv;
  pr.y = nullptr;
  pr.layout_range = reinterpret_cast<const int64_t*>(layout_.comb_layout(local(), slot));
  pr.layout_stride = R;
  pr.topk_idx = layout_.comb_route(local(), slot);
  pr.topk_is_i64 = 0;
  pr.topk_stride = K;
  pr.weights = p.stash_w;
  pr.weights_stride = K;
  const int ctas = num_ctas_;
  if (failed || !args.return_recv_hook) {
    launch_combine(kLlCombineOverlap, false, ctas, 0, stream, op, pr);
    if (failed) std::rethrow_exception(failed);
    return res;
  }
  combine_in_flight_[slot] = true;
  // The hook keeps an allocated out alive; a given out must stay alive until it ran.
  res.hook = make_hook(false, slot, [pr, ctas, stream, keep = res.out]() {
    launch_combine(kLlCombineOverlap, false, ctas, 0, stream, "ll_combine hook", pr);
  });
  return res;
}

TensorView CudaLl::next_combine_buffer(const LlHandle& handle) {
  EPX_CHECK_ARG(!combine_in_flight_[handle.slot], "ll_next_combine_buffer: combine slot ",
                handle.slot,
                " still holds a combine whose hook was not called; expected its "
                "hook to be called before writing the next expert outputs there");
  return TensorView::contiguous(
      layout_.comb_y(local(), handle.slot), DType::kBF16,
      {layout_.num_local_experts, layout_.rows_per_expert, layout_.hidden},
      Device::cuda(dev_.device()));
}

void CudaLl::clean() {
  auto host_reset = [this] {
    num_dispatches_ = 0;
    slot_serial_[0] = slot_serial_[1] = 0;
    ++generation_;
    for (int q = 0; q < 2; ++q) dispatch_in_flight_[q] = combine_in_flight_[q] = false;
  };
  if (symm_.shrink) {
    dev_.reset_region_masked("ll_clean", "ll_clean (reset)", layout_.control_bytes(),
                             layout_.mask(local()), host_reset);
  } else {
    dev_.reset_region("ll_clean", "ll_clean (reset)", layout_.control_bytes(), host_reset);
  }
}

void CudaLl::mask_op(LlMaskOp op, int rank, const TensorView& out, cudaStream_t stream) {
  DeviceGuard guard(dev_.device());
  LlMaskParams p{};
  p.mask = layout_.mask(local());
  p.op = op;
  p.rank = rank;
  p.out = static_cast<int32_t*>(out.data);
  p.out_stride = out.defined() ? out.strides[0] : 0;
  p.num_ranks = group_.size();
  launch_kernel(ll::mask, 1, 1, 0, stream, false, "ll mask", p);
}

// ---- entry points for CudaBuffer (src/cuda/cuda_buffer.cc) ------------------------------------

std::shared_ptr<CudaLl> cuda_ll_create(const Group& group, const MoeShape& shape,
                                       bool enable_shrink) {
  check_ll_supported(group, shape);
  return std::make_shared<CudaLl>(group, shape, enable_shrink);
}
size_t cuda_ll_allocated(const CudaLl* ll) {
  return ll ? ll->bytes() : 0;
}
void cuda_ll_check(CudaLl& ll) {
  ll.check();
}
LlDispatchResult cuda_ll_dispatch(CudaLl& ll, const LlDispatchArgs& args, const Allocator& alloc,
                                  uint64_t buffer_id) {
  return ll.dispatch(args, alloc, buffer_id);
}
LlCombineResult cuda_ll_combine(CudaLl& ll, const LlCombineArgs& args, const Allocator& alloc) {
  return ll.combine(args, alloc);
}
void cuda_ll_combine_f32(CudaLl& ll, const LlCombineArgs& args, float* out) {
  ll.combine(args, Allocator{}, out);
}
TensorView cuda_ll_next_combine_buffer(CudaLl& ll, const LlHandle& handle) {
  return ll.next_combine_buffer(handle);
}
void cuda_ll_clean(CudaLl& ll) {
  ll.clean();
}
void cuda_ll_update_mask(CudaLl& ll, int rank, bool mask, Stream stream) {
  ll.mask_op(mask ? kLlMaskSet : kLlMaskClear, rank, {}, static_cast<cudaStream_t>(stream));
}
void cuda_ll_query_mask(CudaLl& ll, const TensorView& mask_status, Stream stream) {
  ll.mask_op(kLlMaskQuery, 0, mask_status, static_cast<cudaStream_t>(stream));
}
void cuda_ll_clean_mask(CudaLl& ll, Stream stream) {
  ll.mask_op(kLlMaskClearAll, 0, {}, static_cast<cudaStream_t>(stream));
}
size_t cuda_ll_layout_bytes(const MoeShape& shape, int num_ranks) {
  return LlLayout::make(shape, num_ranks).total_bytes;
}
int cuda_ll_num_ctas(const Group& group, const MoeShape& shape) {
  const int device = group.transport()->device().index;
  int sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "Buffer");
  return resolve_ll_ctas(shape, group.size(), group.options().num_sms, sms);
}
#ifdef EPX_LL_TRACE
uint64_t* ll_trace_buffer(int device) {
  return g_ll_traces.newest(device);
}
uint64_t* ll_trace_buffer_of_thread() {
  return g_ll_traces.newest_of_thread();
}
#endif

}  // namespace epx::detail
