// src/cuda/ht.cu — CudaHt (cuda/ht.h): set-up, teardown, device-error reporting, and the host
// side of ht_layout / ht_dispatch / ht_combine: outputs, kernel parameters, launches (kernels in
// kernels/ht/*.cuh, instantiated in ht_{notify,dispatch,combine}.cu; the copy engines' part in
// ht_copy_engine.cu). The lifecycle every mode shares (device, region, error record, decode,
// teardown) is its DeviceObject (device_object.h).
//
//   ht_layout          notify kernel, layout only (no communication)
//   ht_dispatch        plan: exact mode — notify (count exchange, ticket) -> ONE bounded host
//                      wait for N, the per-expert counts and the copy plan (mapped memory);
//                      worst-case mode — notify, num_worst_tokens rows, no host wait
//                      (graph-safe); cached mode — the handle's routing, no notify.
//                      Then the outputs (N rows, or views of the region: zero-copy) and the
//                      dispatch kernel, beside it the copy engines' kept-row copies where the
//                      plan lists few runs (ht_kept_copies_pay)
//   ht_combine         one path per call: zero-copy (pull; the staged reducer where it applies),
//                      copy-engine pushes (ht_engine_combine_pays), or the kernel's senders
// Every launch is on the caller's stream (side streams fork from it and join it); nothing else
// synchronises the device.
#include "cuda/ht.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/env.h"
#include "core/validate.h"
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/trace.cuh"
#include "cuda/launch.h"
#include "cuda/trace_buffers.h"

namespace epx::detail {

namespace {

// Largest copy unit (16/8/4/2/1 bytes) dividing every address and byte stride given.
int vector_bytes(std::initializer_list<uint64_t> values) {
  uint64_t acc = 0;
  for (uint64_t v : values) acc |= v;
  for (int b : {16, 8, 4, 2}) {
    if (acc % b == 0) return b;
  }
  return 1;
}

Tensor alloc(const Allocator& a, DType dtype, std::vector<int64_t> shape, int device) {
  return a(dtype, shape, Device::cuda(device));
}

// ", flag W wanted, V seen" for a flag wait's timeout (wait_flag packs both into b); "" for the
// bulk-copy wait, whose b is a parity.
#ifdef EPX_HT_TRACE
TraceBuffers g_ht_traces;  // ht_trace_buffer: the newest live CudaHt's (bench only)
#endif

}  // namespace

#ifdef EPX_HT_TRACE
uint64_t* ht_trace_buffer(int device) {
  return g_ht_traces.newest(device);
}
uint64_t* ht_trace_buffer_of_thread() {
  return g_ht_traces.newest_of_thread();
}
#endif

// HtRegion::make reserves 64 bytes for the state at state_off.
static_assert(sizeof(DeviceState) <= 64, "DeviceState outgrew its 64 bytes in HtRegion");

// ---- set-up, teardown, errors -------------------------------------------------------------------

CudaHt::CudaHt(const Group& group, const MoeShape& shape, uint64_t buffer_id)
    : group_(group), shape_(shape), buffer_id_(buffer_id), dev_(group, "Buffer") {
  const int R = group.size();
  DeviceGuard guard(dev_.device());
  one_stream_ = group.transport()->ranks_share_device();
  pdl_ = pdl_usable(dev_.device(), one_stream_, ht_dispatch_kernel_address());
  // (Five streams per rank in the one-GPU mode: its own, the two copy-engine streams, the
  // per-thread one, and one spare — the margin that mode's tests ran with.)
  engine_kept_ = !one_stream_ || (env_one_gpu_side_streams() &&
                                  env_cuda_device_max_connections() >= 5 * group.size());
  engine_combine_ = !one_stream_;
  tuning_ = resolve_ht_tuning(group.options().num_sms, dev_.multiprocessors(), R);
  region_ =
      HtRegion::make(shape.hidden, shape.top_k, shape.num_experts, shape.max_tokens_per_rank, R);
  const size_t result_bytes =
      sizeof(HtHostResult) + 4 * ht_host_result_words(region_.num_local_experts, R);
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&result_host_), result_bytes,
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 "Buffer");
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&result_dev_), result_host_, 0),
                 "Buffer");
  result_host_->ticket = 0;
  dev_.allocate_region(region_.total_bytes, region_.state_off);  // collective; zeroed
#ifdef EPX_HT_TRACE
  trace_ = g_ht_traces.create(dev_.device(), kHtTraceWords);
#endif
}

CudaHt::~CudaHt() {
  // The destruction barrier only while ht is usable (after a timeout a peer may never come).
  dev_.close(dev_.usable() ? "Buffer destruction" : nullptr, [this] {
    engines_.destroy();
    if (result_host_) cudaFreeHost(result_host_);
#ifdef EPX_HT_TRACE
    g_ht_traces.destroy(dev_.device(), trace_);
#endif
  });
}

// Collective (DeviceObject::reset_region, as CudaLl::clean): no ht kernel runs on any rank, then
// the control words of the region (everything before the rows) and the host's mirrors of them
// start over as at construction.
void CudaHt::reset() {
  dev_.reset_region("reset (ht)", "reset (ht, done)", region_.x_off, [this] {
    result_host_->ticket = 0;
    ticket_ = 0;
  });
}

// kDevErrHtCallDiffers: which per-call value differs between the source (e.peer) and the rank
// that found it (e.rank), with both values, in the format of core/agree.h.
static std::string ht_call_differs_message(const DeviceErrorRecord& e) {
  const auto field = static_cast<uint32_t>(static_cast<uint64_t>(e.a) >> 32);
  const auto theirs = static_cast<uint32_t>(e.a & 0xffffffff);
  const auto mine = static_cast<uint32_t>(e.b);
  // Both ranks' values of one part, lower rank first.
  auto both = [&](const char* what, int64_t t, int64_t m, ShowValue show) {
    std::vector<int64_t> v = {t, m};
    std::vector<int> ranks = {e.peer, e.rank};
    if (e.rank < e.peer) {
      std::swap(v[0], v[1]);
      std::swap(ranks[0], ranks[1]);
    }
    return cat(what, " differs across ranks: rank ", ranks[0], " has ", show(v[0]), ", rank ",
               ranks[1], " has ", show(v[1]));
  };
  std::string what;
  auto add = [&](const std::string& part) { what += cat(what.empty() ? "" : "; ", part); };
  if (field == kHtCallFormat) {
    auto part = [](uint32_t w, int shift, uint32_t mask) {
      return static_cast<int64_t>((w >> shift) & mask);
    };
    if (part(theirs, 0, 0xff) != part(mine, 0, 0xff))
      add(both("the dtype of argument 'x'", part(theirs, 0, 0xff), part(mine, 0, 0xff),
               show_dtype));
    if (part(theirs, 8, 0xff) != part(mine, 8, 0xff))
      add(both("the dtype of argument 'x_scales'", part(theirs, 8, 0xff) - 1,
               part(mine, 8, 0xff) - 1, show_dtype));
    if (part(theirs, 16, 1) != part(mine, 16, 1))
      add(both("argument 'zero_copy'", part(theirs, 16, 1), part(mine, 16, 1), show_bool));
    if (part(theirs, 24, 0xff) != part(mine, 24, 0xff))
      add(both("the operation", part(theirs, 24, 0xff), part(mine, 24, 0xff), [](int64_t v) {
        return std::string(v == kHtCallCombine  ? "called ht_combine"
                           : v == kHtCallCached ? "called ht_dispatch (cached)"
                                                : "called ht_dispatch");
      }));
    if (part(theirs, 17, 1) != part(mine, 17, 1))
      add(both("argument 'topk_weights' (given or absent)", part(theirs, 17, 1), part(mine, 17, 1),
               [](int64_t v) { return std::string(v ? "given" : "absent"); }));
  } else if (field == kHtCallWorst) {
    add(both("argument 'num_worst_tokens'", theirs, mine, show_int));
  } else {
    add(both("argument 'expert_alignment'", theirs, mine, show_int));
  }
  if (e.op == kOpHtNotify)
    return cat("ht_dispatch: ", what,
               "; expected the same on every rank (found in the count exchange; the outputs of a "
               "worst-case dispatch are undefined)");
  return cat(e.op == kOpHtCombine ? "ht_combine: " : "ht_dispatch (cached): ", what,
             "; expected the same on every rank (found when the rows arrived; the outputs of that "
             "call are undefined and the ht state of this buffer is unusable until reset() on "
             "every rank)");
}

// What a timeout or an unfinished count exchange leaves: require_usable's refusal.
static std::string ht_unusable_after(const char* why) {
  return cat("the ht state of this buffer is unusable after an earlier error (", why,
             "); call reset() on every rank to reset it");
}

void CudaHt::check() {
  require_usable("check");
  const std::optional<DeviceErrorRecord> rec = dev_.recorded();
  if (!rec) return;
  const DeviceErrorRecord& e = *rec;
  if (e.code == kDevErrTimeout) {
    // The device state is inconsistent: keep the record; ht stays unusable.
    dev_.set_unusable(ErrorCode::kOutOfStep, ht_unusable_after("a device wait timed out"));
    dev_.raise_timeout(e, {.awaited = device_wait_name(static_cast<uint32_t>(e.a)),
                           .unusable = "the ht state of this buffer is unusable until reset() on "
                                       "every rank (every rank must call the same operations in "
                                       "the same order)",
                           .seen = DeviceObject::flag_values(e)});
  }
  dev_.rearm();  // not fatal: the collective completed; the device may report the next error
  switch (e.code) {
    case kDevErrOutOfCapacity:
      throw_error(
          ErrorCode::kOutOfCapacity,
          cat(device_op_name(e.op), ": rank ", e.rank, " receives N = ", e.a,
              " tokens, more than argument 'num_worst_tokens' = ", e.b,
              "; expected num_worst_tokens >= N (found on the device; rows past it were not "
              "written)"));
    case kDevErrHtCallDiffers:
      // Found by a cached dispatch or a combine on arrival: the kernel stopped with its counters
      // half consumed, so ht waits for reset() (the count exchange's finds leave ht usable).
      if (e.op != kOpHtNotify)
        dev_.set_unusable(ErrorCode::kOutOfStep,
                          ht_unusable_after("ranks passed different per-call values"));
      throw_error(ErrorCode::kInvalidArgument, ht_call_differs_message(e));
    default:
      DeviceObject::raise_common(e, shape_.num_experts);  // out-of-range expert ids, unknown codes
  }
}

// ---- pieces every launch shares
// ------------------------------------------------------------------

HtSymm CudaHt::symm() const {
  HtSymm s{};
  s.local = local();
  for (int p = 0; p < group_.size(); ++p) s.peers[p] = dev_.peer(p);
  s.region = region_;
  return s;
}

template <typename Params>
void CudaHt::fill_launch_common(Params& p, uint32_t op) const {
#ifdef EPX_DIAGNOSTICS
  p.ablate = ht_ablation();
#endif
  p.pdl = pdl_;
#ifdef EPX_HT_TRACE
  p.trace = trace_;
#endif
  p.symm = symm();
  p.wait = dev_.wait_context(op);
}

// The count kernel's routing and shape fields (layout and count exchange alike).
void CudaHt::fill_notify(HtNotifyParams& p, const TensorView& topk_idx, int64_t T) const {
  const int R = group_.size();
  p.topk_idx = topk_idx.data;
  p.topk_stride = topk_idx.ndim == 2 ? topk_idx.strides[0] : 0;
  p.topk_is_i64 = topk_idx.dtype == DType::kI64;
  p.num_tokens = static_cast<int>(T);
  p.top_k = shape_.top_k;
  p.num_experts = shape_.num_experts;
  p.num_local_experts = shape_.num_experts / R;
  p.num_ranks = R;
  p.rank = group_.rank();
  p.symm = symm();
}

// Inputs of a dispatch or combine may not lie in this buffer's symmetric memory (a zero-copy
// recv_x): the peers write there during the op.
void CudaHt::check_outside_region(const TensorView& t, const char* op, const char* name) const {
  if (!t.defined() || t.numel() == 0) return;
  const auto lo = reinterpret_cast<uintptr_t>(t.data);
  uintptr_t hi = lo + dtype_size(t.dtype);  // one past the last element (strides >= 0)
  for (int i = 0; i < t.ndim; ++i)
    hi += static_cast<uintptr_t>(t.shape[i] - 1) * static_cast<uintptr_t>(t.strides[i]) *
          dtype_size(t.dtype);
  const auto base = reinterpret_cast<uintptr_t>(local());
  EPX_CHECK_ARG(hi <= base || lo >= base + region_.total_bytes, op, ": argument '", name,
                "' lies in this buffer's symmetric memory (a zero-copy recv_x?), expected memory ",
                "of its own: the peers write there during the operation; copy it first");
}

// The copy plan an exact dispatch of this buffer left in the handle (null: none — worst-case
// mode, or made where the copy engines take no rows).
const HtCopyPlan* CudaHt::copy_plan(const HtHandle& h) const {
  return static_cast<const HtCopyPlan*>(h.backend_state.get());
}

TensorView CudaHt::combine_buffer(const HtHandle& h) const {
  require_usable("ht_combine_buffer");
  return TensorView::contiguous(region_.combine_y_row(local(), 0, shape_.hidden * 2), DType::kBF16,
                                {ht_handle_rows(h), shape_.hidden}, Device::cuda(dev_.device()));
}

// ---- ht_layout ---------------------------------------------------------------------------------

HtLayout CudaHt::layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc_fn) {
  return layout_of(topk_idx, stream, alloc_fn, group_.size(), shape_.num_experts);
}

HtLayout CudaHt::layout_of(const TensorView& topk_idx, Stream stream, const Allocator& alloc_fn,
                           int num_ranks, int num_experts) {
  require_usable("ht_layout");
  DeviceGuard guard(dev_.device());
  const int R = num_ranks;
  const int64_t T = topk_idx.shape[0];
  HtLayout out;
  out.num_tokens_per_rank = alloc(alloc_fn, DType::kI32, {R}, dev_.device());
  out.num_tokens_per_expert = alloc(alloc_fn, DType::kI32, {num_experts}, dev_.device());
  out.is_token_in_rank = alloc(alloc_fn, DType::kBool, {T, R}, dev_.device());
  HtNotifyParams p{};
  fill_notify(p, topk_idx, T);
  p.num_experts = num_experts;
  p.num_local_experts = num_experts / R;
  p.num_ranks = R;
  p.expert_alignment = 1;
  p.exchange = 0;
  p.num_tokens_per_rank = out.num_tokens_per_rank.ptr<int32_t>();
  p.num_tokens_per_expert = out.num_tokens_per_expert.ptr<int32_t>();
  p.is_token_in_rank = out.is_token_in_rank.ptr<bool>();
  p.wait = dev_.wait_context(kOpHtLayout);
  launch_ht_notify(p, static_cast<cudaStream_t>(stream));
  return out;
}

// ---- ht_dispatch -------------------------------------------------------------------------------

HtDispatchResult CudaHt::dispatch(const HtDispatchArgs& args, const Allocator& alloc_fn) {
  require_usable("ht_dispatch");
  DeviceGuard guard(dev_.device());
  auto stream = static_cast<cudaStream_t>(args.stream);
  const int64_t T = args.x.shape[0];
  EPX_CHECK(T <= shape_.max_tokens_per_rank, ErrorCode::kOutOfCapacity, "ht_dispatch: x has ", T,
            " tokens, expected at most max_tokens_per_rank = ", shape_.max_tokens_per_rank);
  check_outside_region(args.x, "ht_dispatch", "x");
  check_outside_region(args.x_scales, "ht_dispatch", "x_scales");
  HtDispatchResult res;
  // The plan: the routing (the count exchange's, or the cached handle's), then what moves where.
  res.handle = args.handle != nullptr
                   ? cached_handle(args)
                   : exchange_counts(args, alloc_fn, stream, res.num_recv_tokens_per_expert);
  const HtDispatchPlan plan = plan_dispatch(args, res.handle);
  allocate_outputs(args, plan, alloc_fn, res);
  launch_dispatch(args, plan, res, stream);
  // Exact mode already waited for the count exchange: an out-of-range expert id it found is
  // raised now, after the dispatch kernel was launched, so every peer's collective completes.
  if (!plan.cached && !plan.worst_case && dev_.recorded_code() != kDevErrNone) check();
  return res;
}

HtHandle CudaHt::cached_handle(const HtDispatchArgs& args) const {
  const HtHandle& h = *args.handle;
  EPX_CHECK_ARG(h.buffer_id == buffer_id_, "ht_dispatch: argument 'handle' comes from buffer ",
                h.buffer_id, ", expected one made by this buffer (", buffer_id_, ")");
  EPX_CHECK_ARG(h.num_tokens == args.x.shape[0], "ht_dispatch: x has ", args.x.shape[0],
                " tokens but the cached handle was made for ", h.num_tokens);
  return h;
}

// The count exchange of an exact or worst-case dispatch: the handle's routing tensors, and in
// exact mode (after the one host wait) N, the per-expert counts and the copy plan.
HtHandle CudaHt::exchange_counts(const HtDispatchArgs& args, const Allocator& alloc_fn,
                                 cudaStream_t stream, std::vector<int>& num_recv_per_expert) {
  const int R = group_.size(), me = group_.rank();
  const int64_t T = args.x.shape[0];
  const bool worst_case = args.num_worst_tokens > 0;
  HtHandle h;
  h.rank_prefix_matrix = alloc(alloc_fn, DType::kI32, {R, R}, dev_.device());
  h.is_token_in_rank = alloc(alloc_fn, DType::kBool, {T, R}, dev_.device());
  h.send_pos = alloc(alloc_fn, DType::kI32, {T, R}, dev_.device());
  h.num_tokens = T;
  h.top_k = shape_.top_k;
  h.buffer_id = buffer_id_;
  HtNotifyParams np{};
  fill_notify(np, args.topk_idx, T);
  np.expert_alignment = args.expert_alignment > 0 ? args.expert_alignment : 1;
  // The per-call values every rank must pass alike, compared by every receiver of the exchange
  // (kDevErrHtCallDiffers).
  const bool fp8 = args.x.dtype == DType::kF8E4M3;
  np.call[kHtCallFormat] =
      ht_call_format(static_cast<int>(args.x.dtype),
                     fp8 && args.x_scales.defined() ? static_cast<int>(args.x_scales.dtype) : -1,
                     args.zero_copy, args.topk_weights.defined());
  np.call[kHtCallWorst] = static_cast<uint32_t>(args.num_worst_tokens) ^
                          static_cast<uint32_t>(static_cast<uint64_t>(args.num_worst_tokens) >> 32);
  np.call[kHtCallAlignment] = static_cast<uint32_t>(args.expert_alignment);
  np.exchange = 1;
  np.is_token_in_rank = h.is_token_in_rank.ptr<bool>();
  np.send_pos = h.send_pos.ptr<int32_t>();
  np.rank_prefix_matrix = h.rank_prefix_matrix.ptr<int32_t>();
  np.host = result_dev_;
  if (!worst_case && ++ticket_ == 0) ++ticket_;  // 0 means "do not publish"
  np.ticket = worst_case ? 0u : ticket_;
  // The kept runs are searched for only where the copy engines may copy them.
  np.find_kept_runs = engine_kept_ ? 1 : 0;
  np.wait = dev_.wait_context(kOpHtNotify);
#ifdef EPX_HT_TRACE
  np.trace = trace_;
#endif
  launch_ht_notify(np, stream);
  if (worst_case) {
    h.num_recv_tokens = -1;
    h.num_worst_tokens = args.num_worst_tokens;
    return h;
  }
  wait_count_exchange(np.ticket, stream);
  // Per-call values that differ across ranks (seen by every rank's count exchange before its
  // ticket): every rank raises here, before any dispatch kernel, so no rows move with mismatched
  // formats.
  if (dev_.recorded_code() == kDevErrHtCallDiffers) check();
  const volatile HtHostResult* r = result_host_;  // mapped memory the device wrote
  h.num_recv_tokens = r->num_recv_tokens;
  h.num_worst_tokens = 0;
  const volatile int32_t* per_expert = reinterpret_cast<const volatile int32_t*>(result_host_ + 1);
  num_recv_per_expert.resize(region_.num_local_experts);
  for (int l = 0; l < region_.num_local_experts; ++l) num_recv_per_expert[l] = per_expert[l];
  // The copy plan from the words after the counts: no copy of send_pos, no stream
  // synchronisation.
  if (engine_kept_)
    h.backend_state = make_kept_plan(per_expert + region_.num_local_experts, T, R, me);
  return h;
}

// The one host synchronisation of exact mode: wait for this launch's ticket. Bounded: the device
// gives up after the timeout and reports; we allow it a few seconds more.
void CudaHt::wait_count_exchange(uint32_t ticket, cudaStream_t stream) {
  volatile HtHostResult* r = result_host_;
  const auto deadline =
      std::chrono::steady_clock::now() + group_.timeout() + std::chrono::seconds(5);
  for (uint32_t spins = 0; r->ticket != ticket; ++spins) {
    if (spins % 1024 == 1023) {
      if (dev_.recorded_code() == kDevErrTimeout) check();
      const cudaError_t q = cudaStreamQuery(stream);
      if (q != cudaSuccess && q != cudaErrorNotReady)
        throw_cuda(q, "count exchange", "ht_dispatch");
      if (std::chrono::steady_clock::now() > deadline) {
        dev_.set_unusable(ErrorCode::kOutOfStep,
                          ht_unusable_after("the count exchange did not complete in time"));
        throw_error(ErrorCode::kTimeout,
                    cat("ht_dispatch: rank ", group_.rank(), " waited ", group_.timeout().count(),
                        " ms (+5 s) for the count ", "exchange to finish on its stream"));
      }
      std::this_thread::yield();
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
}

HtDispatchPlan CudaHt::plan_dispatch(const HtDispatchArgs& args, const HtHandle& h) const {
  HtDispatchPlan plan;
  plan.cached = args.handle != nullptr;
  plan.worst_case = h.num_worst_tokens > 0;
  plan.zero_copy = args.zero_copy;
  plan.num_rows = ht_handle_rows(h);
  const bool fp8 = args.x.dtype == DType::kF8E4M3;
  plan.num_scales = fp8 && args.x_scales.defined() ? static_cast<int>(args.x_scales.shape[1]) : 0;
  // The copy engines copy the kept rows where the host knows their runs (an exact dispatch's
  // plan, also for the cached dispatches of its handle; never worst-case mode) and they are few
  // (ht_kept_copies_pay: else the kernel places them). This rank's own choice.
  const HtCopyPlan* cp = copy_plan(h);
  plan.engine_kept = !plan.worst_case && cp != nullptr && engine_kept_ &&
                     ht_kept_copies_pay(cp->num_kept_runs) &&
                     cp->kept.size() == cp->num_kept_runs;  // listed
  EPX_CHECK(!plan.zero_copy || plan.num_rows <= int64_t{group_.size()} * region_.max_tokens,
            ErrorCode::kInternal, "ht_dispatch: zero-copy view of ", plan.num_rows,
            " rows exceeds the region");
  return plan;
}

// Zero-copy: recv_x (and its scales) view this rank's x area, where the peers store the rows; no
// storage of their own (valid until the next ht op and while the buffer lives; Python's tensor
// keeps the Buffer object alive, python/src/torch_bridge.cc). The other outputs are tensors.
void CudaHt::allocate_outputs(const HtDispatchArgs& args, const HtDispatchPlan& plan,
                              const Allocator& alloc_fn, HtDispatchResult& res) const {
  const int64_t H = shape_.hidden, K = shape_.top_k, rows = plan.num_rows;
  const TensorView& x = args.x;
  if (plan.zero_copy) {
    static_cast<TensorView&>(res.recv_x) = TensorView::contiguous(
        local() + region_.x_off, x.dtype, {rows, H}, Device::cuda(dev_.device()));
  } else {
    res.recv_x = alloc(alloc_fn, x.dtype, {rows, H}, dev_.device());
  }
  if (x.dtype == DType::kF8E4M3 && args.x_scales.defined()) {
    const DType dt = args.x_scales.dtype;
    if (plan.zero_copy) {
      static_cast<TensorView&>(res.recv_x_scales) = TensorView::contiguous(
          local() + region_.scale_off, dt, {rows, plan.num_scales}, Device::cuda(dev_.device()));
    } else {
      res.recv_x_scales = alloc(alloc_fn, dt, {rows, plan.num_scales}, dev_.device());
    }
  }
  if (!plan.cached) {
    res.recv_topk_idx = alloc(alloc_fn, args.topk_idx.dtype, {rows, K}, dev_.device());
    if (args.topk_weights.defined())
      res.recv_topk_weights = alloc(alloc_fn, DType::kF32, {rows, K}, dev_.device());
    res.recv_src_idx = alloc(alloc_fn, DType::kI32, {rows}, dev_.device());
    res.handle.recv_src_idx = res.recv_src_idx;
  }
}

void CudaHt::launch_dispatch(const HtDispatchArgs& args, const HtDispatchPlan& plan,
                             HtDispatchResult& res, cudaStream_t stream) {
  const HtHandle& h = res.handle;
  const TensorView& x = args.x;
  HtDispatchParams p{};
  p.x = static_cast<const char*>(x.data);
  p.x_stride = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
  p.row_bytes = shape_.hidden * static_cast<int64_t>(dtype_size(x.dtype));
  if (plan.num_scales > 0) {
    p.scales = static_cast<const char*>(args.x_scales.data);
    p.scale_stride0 = args.x_scales.strides[0];
    p.scale_stride1 = args.x_scales.strides[1];
    p.num_scales = plan.num_scales;
    p.recv_scales = static_cast<uint32_t*>(res.recv_x_scales.data);
  }
  if (!plan.cached) {
    p.topk_idx = args.topk_idx.data;
    p.topk_stride = args.topk_idx.strides[0];
    p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
    if (args.topk_weights.defined()) {
      p.topk_weights = args.topk_weights.ptr<const float>();
      p.weights_stride = args.topk_weights.strides[0];
      p.weights_stride1 = args.topk_weights.strides[1];
      p.recv_topk_weights = res.recv_topk_weights.ptr<float>();
    }
    p.recv_topk_idx = res.recv_topk_idx.data;
    p.recv_src_idx = res.recv_src_idx.ptr<int32_t>();
  }
  p.send_pos = h.send_pos.ptr<const int32_t>();
  p.rank_prefix_matrix = h.rank_prefix_matrix.ptr<const int32_t>();
  p.num_tokens = static_cast<int>(x.shape[0]);
  p.top_k = shape_.top_k;
  p.num_local_experts = shape_.num_experts / group_.size();
  p.num_ranks = group_.size();
  p.rank = group_.rank();
  p.cached = plan.cached;
  if (plan.cached)
    p.call_word = ht_call_format(
        static_cast<int>(x.dtype),
        plan.num_scales > 0 ? static_cast<int>(args.x_scales.dtype) : -1, plan.zero_copy, false,
        kHtCallCached);
  p.worst_case = plan.worst_case;
  // Zero-copy receivers copy no x rows from the slots: every CTA sends, then receives. With the
  // kept rows by copy engine the receivers only copy out: more senders.
  p.num_send_ctas = plan.zero_copy     ? tuning_.dispatch_send_ctas_zero_copy
                    : plan.engine_kept ? tuning_.dispatch_send_ctas_kept
                                       : tuning_.dispatch_send_ctas;
  fill_launch_common(p, kOpHtDispatch);
  p.recv_x = static_cast<char*>(res.recv_x.data);
  p.num_rows = plan.num_rows;
  p.engine_kept = plan.engine_kept ? 1 : 0;
  p.zero_copy = plan.zero_copy ? 1 : 0;
  const int vb =
      vector_bytes({reinterpret_cast<uint64_t>(p.x), static_cast<uint64_t>(p.x_stride),
                    static_cast<uint64_t>(p.row_bytes), reinterpret_cast<uint64_t>(p.recv_x)});
  if (plan.engine_kept) engines_.fork(stream, "ht_dispatch");
  launch_ht_dispatch(p, vb, tuning_.num_sms, stream);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_dispatch");
  if (plan.engine_kept)
    engines_.copy_kept_rows(*copy_plan(h), p, stream, EPX_HT_ABLATED(p.ablate, kAblateEngineKept));
}

// ---- ht_combine --------------------------------------------------------------------------------

HtCombineResult CudaHt::combine(const HtCombineArgs& args, const Allocator& alloc_fn) {
  require_usable("ht_combine");
  DeviceGuard guard(dev_.device());
  auto stream = static_cast<cudaStream_t>(args.stream);
  const HtHandle& h = *args.handle;
  check_combine_handle(h);
  // Zero-copy: y is the combine buffer (validate_ht_combine checked it).
  if (!args.zero_copy) check_outside_region(args.y, "ht_combine", "y");
  HtCombineResult res;
  res.out = alloc(alloc_fn, DType::kBF16, {h.num_tokens, shape_.hidden}, dev_.device());
  if (args.topk_weights.defined())
    res.combined_topk_weights =
        alloc(alloc_fn, DType::kF32, {h.num_tokens, shape_.top_k}, dev_.device());
  int vb = 0;
  HtCombineParams p = combine_params(args, static_cast<char*>(res.out.data),
                                     res.combined_topk_weights.ptr<float>(), vb);
  if (args.zero_copy) {
    combine_pull(args, p, vb, stream);
  } else if (engine_combine_pays(h)) {
    combine_engine_push(h, p, vb, stream);
  } else {
    launch_ht_combine(p, vb, tuning_.num_sms, stream);  // the kernel's senders push the rows
    EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
  }
  return res;
}

void CudaHt::combine_partial(const HtCombineArgs& args, float* out, float* combined_weights) {
  require_usable("ht_combine");
  DeviceGuard guard(dev_.device());
  check_combine_handle(*args.handle);
  check_outside_region(args.y, "ht_combine", "y");
  int vb = 0;
  HtCombineParams p = combine_params(args, reinterpret_cast<char*>(out), combined_weights, vb);
  launch_ht_combine_f32(p, vb, tuning_.num_sms, static_cast<cudaStream_t>(args.stream));
}

void CudaHt::check_combine_handle(const HtHandle& h) const {
  EPX_CHECK_ARG(h.buffer_id == buffer_id_, "ht_combine: argument 'handle' comes from buffer ",
                h.buffer_id, ", expected one made by this buffer (", buffer_id_, ")");
}

// The combine kernel's parameters (the copying path's; the paths adjust them) and the copy unit
// `vb` the addresses allow.
HtCombineParams CudaHt::combine_params(const HtCombineArgs& args, char* out,
                                       float* combined_weights, int& vb) const {
  const HtHandle& h = *args.handle;
  HtCombineParams p{};
  p.y = static_cast<const char*>(args.y.data);
  p.y_stride = args.y.strides[0] * 2;
  p.num_y_rows = args.y.shape[0];
  p.row_bytes = shape_.hidden * 2;
  if (args.topk_weights.defined()) {
    p.weights = args.topk_weights.ptr<const float>();
    p.weights_stride = args.topk_weights.strides[0];
    p.combined_weights = combined_weights;
  }
  if (args.bias0.defined()) {
    p.bias0 = static_cast<const char*>(args.bias0.data);
    p.bias0_stride = args.bias0.strides[0] * 2;
  }
  if (args.bias1.defined()) {
    p.bias1 = static_cast<const char*>(args.bias1.data);
    p.bias1_stride = args.bias1.strides[0] * 2;
  }
  p.send_pos = h.send_pos.ptr<const int32_t>();
  p.rank_prefix_matrix = h.rank_prefix_matrix.ptr<const int32_t>();
  p.num_tokens = static_cast<int>(h.num_tokens);
  p.top_k = shape_.top_k;
  p.num_ranks = group_.size();
  p.rank = group_.rank();
  p.out = out;
  p.num_send_ctas = tuning_.combine_send_ctas;
  p.call_word = ht_call_format(static_cast<int>(DType::kBF16), -1, args.zero_copy,
                               args.topk_weights.defined(), kHtCallCombine);
  fill_launch_common(p, kOpHtCombine);
  vb = vector_bytes({reinterpret_cast<uint64_t>(p.y), static_cast<uint64_t>(p.y_stride),
                     static_cast<uint64_t>(p.row_bytes), reinterpret_cast<uint64_t>(p.out),
                     reinterpret_cast<uint64_t>(p.bias0), static_cast<uint64_t>(p.bias0_stride),
                     reinterpret_cast<uint64_t>(p.bias1), static_cast<uint64_t>(p.bias1_stride)});
  return p;
}

// Zero-copy combine: the peers read y where the caller wrote it and the weights from their mirror
// in the region (one local copy); every CTA reduces — with the staged reducer where every token
// has <= 2 row sources of 16-byte vectors (R + biases <= 2) on at most kHtPullStaging.max_sms
// SMs of an sm_90+ device, else with the register steps.
void CudaHt::combine_pull(const HtCombineArgs& args, HtCombineParams& p, int vb,
                          cudaStream_t stream) {
  const int R = group_.size(), K = shape_.top_k, grid = tuning_.num_sms;
  // The rows the mirror can hold, R * T_max; the peers read only rows below N <= R * T_max.
  const int64_t mirror_rows = std::min<int64_t>(p.num_y_rows, int64_t{R} * region_.max_tokens);
  if (args.topk_weights.defined() && mirror_rows > 0 && R > 1) {
    CopyList w;  // a 2-D copy, or one per row where the rows overlap (stride(0) < K)
    w.add(reinterpret_cast<char*>(region_.combine_w_row(local(), 0)), static_cast<size_t>(K) * 4,
          reinterpret_cast<const char*>(p.weights), static_cast<size_t>(p.weights_stride) * 4,
          static_cast<size_t>(K) * 4, static_cast<size_t>(mirror_rows));
    w.issue(stream, "ht_combine: weights");
  }
  p.pull = 1;
  p.num_send_ctas = 0;
  const HtPullStaging st = kHtPullStaging;
  const int nbias = (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0);
  const bool staged = st.stages > 0 && grid <= st.max_sms && vb == 16 && R + nbias <= 2 &&
                      prepare_ht_combine_staged(st.stages, st.chunk);
  if (staged) {
    p.pull_stages = st.stages;
    p.pull_chunk = st.chunk;
    launch_ht_combine_staged(p, grid, stream);
  } else {
    launch_ht_combine(p, vb, grid, stream);
    EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
  }
}

// Whether the copy engines push this combine's y rows (ht_engine_combine_pays, from the handle's
// copy plan: the same on every rank). The reducers wait for arrive kernels that run beside them,
// so at least one SM must stay free (the same on every rank: the SM counts are equal).
bool CudaHt::engine_combine_pays(const HtHandle& h) const {
  const int R = group_.size(), grid = tuning_.num_sms;
  const HtCopyPlan* cp = copy_plan(h);
  if (R <= 1 || cp == nullptr || !engine_combine_ || grid >= dev_.multiprocessors()) return false;
  int64_t max_pair_rows = 0;  // the largest block any rank sends another (same on every rank)
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d)
      if (s != d)
        max_pair_rows =
            std::max<int64_t>(max_pair_rows, rows_between(cp->rank_prefix_matrix.data(), R, s, d));
  return ht_engine_combine_pays(grid, max_pair_rows * shape_.hidden * 2);
}

// Copy engines push the y rows: wait until every peer finished its previous op, fork a side
// stream there, run the kernel (a few sender CTAs move the weights; the reducers wait per chunk)
// beside the side stream's chunked pushes + arrive signals, join.
void CudaHt::combine_engine_push(const HtHandle& h, HtCombineParams& p, int vb,
                                 cudaStream_t stream) {
  const int grid = tuning_.num_sms;
  p.engine_y = 1;
  p.num_send_ctas = std::max(1, grid / 8);
  engines_.ensure_streams();
  HtEngineSyncParams sp{};
  sp.num_ranks = group_.size();
  sp.rank = group_.rank();
  sp.step = kEngineWaitReady;
  sp.symm = p.symm;
  sp.wait = p.wait;
  launch_ht_engine_sync(sp, stream);
  engines_.fork(stream, "ht_combine");
  launch_ht_combine(p, vb, grid, stream);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
  engines_.push_combine_rows(*copy_plan(h), p, sp, stream,
                             EPX_HT_ABLATED(p.ablate, kAblateEnginePush));
}

}  // namespace epx::detail
