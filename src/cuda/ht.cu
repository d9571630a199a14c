// src/cuda/ht.cu — host side of the cuda ht mode: allocation of outputs, kernel parameters,
// launches (kernels in kernels/ht/*.cuh, instantiated in ht_{notify,dispatch,combine}.cu).
//
//   ht_layout          notify kernel, layout only (no communication)
//   ht_dispatch exact  notify (count exchange, ticket) -> ONE bounded host wait for N and the
//                      per-expert counts (mapped memory) -> allocate N rows -> dispatch kernel
//   ht_dispatch worst  notify -> dispatch with num_worst_tokens rows; no host wait (graph-safe)
//   ht_dispatch cached dispatch kernel only, routing from the handle
//   copy engines       exact and cached (EPX_HT_COPY=ce:kept..., the default): the copy engines
//                      copy the kept rows on a side stream while the kernel pushes and copies
//                      out (kept_copies); EPX_HT_COPY=ce: every x row by copy engine, the
//                      kernel moves scales and metadata only (engine_copies)
//   ht_combine         combine kernel
// Every launch is on the caller's stream; nothing else synchronises the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/env.h"
#include "core/validate.h"
#include "cuda/cuda_buffer.h"
#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/launch.h"

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

// The copy-engine sync steps' common fields (ht_params.cuh); callers set step / chunk / seq_ahead.
HtEngineSyncParams engine_sync_params(int R, int me, const HtSymm& symm, const WaitContext& wait,
                                      int step) {
  HtEngineSyncParams sp{};
  sp.num_ranks = R;
  sp.rank = me;
  sp.step = step;
  sp.symm = symm;
  sp.wait = wait;
  return sp;
}

// Copies issued together: blocks of `height` rows of `width` bytes, rows `spitch` / `dpitch`
// apart; one cudaMemcpyAsync for a contiguous block, one cudaMemcpy2DAsync for a pitched one,
// one call per row where the source pitch is below the width (a stride-0 or overlapping view).
// (Measured on 2 x H200, 17 runs: ~105 µs of host time per call with one call per run, ~140 µs
// through one cudaMemcpyBatchAsync; docs/perf-cuda-ht.md.)
struct CopyList {
  struct Block {
    char* dst;
    const char* src;
    size_t dpitch, spitch, width, height;
  };
  std::vector<Block> blocks;
  void add(char* dst, size_t dpitch, const char* src, size_t spitch, size_t width, size_t height) {
    if (width == 0 || height == 0) return;
    blocks.push_back({dst, src, dpitch, spitch, width, height});
  }
  void issue(cudaStream_t stream, const char* op) const {
    for (const Block& b : blocks) {
      if (b.height == 1 || (b.spitch == b.width && b.dpitch == b.width)) {
        EPX_CUDA_CHECK(cudaMemcpyAsync(b.dst, b.src, b.width * b.height, cudaMemcpyDefault, stream),
                       op);
      } else if (b.spitch >= b.width && b.dpitch >= b.width) {
        EPX_CUDA_CHECK(cudaMemcpy2DAsync(b.dst, b.dpitch, b.src, b.spitch, b.width, b.height,
                                         cudaMemcpyDefault, stream),
                       op);
      } else {
        for (size_t i = 0; i < b.height; ++i)
          EPX_CUDA_CHECK(cudaMemcpyAsync(b.dst + i * b.dpitch, b.src + i * b.spitch, b.width,
                                         cudaMemcpyDefault, stream),
                         op);
      }
    }
  }
};

// Adds x rows [t0, t0 + n) as one block copied to the consecutive rows at dst (row_bytes pitch).
void add_x_rows(CopyList& list, const HtDispatchParams& p, int64_t t0, int64_t n, char* dst) {
  if (n <= 0) return;
  const auto rb = static_cast<size_t>(p.row_bytes);
  list.add(dst, rb, p.x + t0 * p.x_stride, static_cast<size_t>(p.x_stride), rb,
           static_cast<size_t>(n));
}

// Joins side stream work to `stream` if an exception leaves a forked section early (no-throw):
// records `done` on `side` and makes `stream` wait for it, so nothing the side stream still does
// outlives the call's ordering (or leaves a capture unjoined).
struct JoinOnUnwind {
  cudaStream_t side, stream;
  cudaEvent_t done;
  bool armed = true;
  ~JoinOnUnwind() {
    if (!armed) return;
    if (cudaEventRecord(done, side) == cudaSuccess) (void)cudaStreamWaitEvent(stream, done, 0);
  }
};

// Copies in kHtEngineChunks chunks on `side`, forked from `stream` at `fork`: per chunk c the
// copies fill(c, list) adds, then the arrive step signalling c (sp: the op's sync parameters);
// then `stream` joins `side` at `done` (also on unwind).
void chunks_with_arrive(cudaStream_t stream, cudaStream_t side, cudaEvent_t fork, cudaEvent_t done,
                        HtEngineSyncParams sp, const std::function<void(int, CopyList&)>& fill,
                        const char* what) {
  EPX_CUDA_CHECK(cudaStreamWaitEvent(side, fork, 0), what);
  JoinOnUnwind join{side, stream, done};
  for (int c = 0; c < kHtEngineChunks; ++c) {
    CopyList rows;
    fill(c, rows);
    rows.issue(side, what);
    sp.step = kEngineArrive;
    sp.chunk = c;
    launch_ht_engine_sync(sp, side);
  }
  join.armed = false;
  EPX_CUDA_CHECK(cudaEventRecord(done, side), what);
  EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, done, 0), what);
}

}  // namespace

// send_pos [T, R] and rank_prefix_matrix [R, R] (host copies) -> runs of consecutive tokens.
std::shared_ptr<HtCopyPlan> make_copy_plan(const std::vector<int32_t>& send_pos, int64_t T, int R,
                                           int me, std::vector<int32_t> rpm) {
  auto plan = std::make_shared<HtCopyPlan>();
  plan->runs.resize(R);
  for (int d = 0; d < R; ++d) {
    const int32_t excl = prefix_before(rpm.data(), R, me, d);
    auto& v = plan->runs[d];
    for (int64_t t = 0; t < T; ++t) {
      const int32_t pos = send_pos[static_cast<size_t>(t) * R + d];
      if (pos < 0) continue;
      const int32_t j = pos - excl, tt = static_cast<int32_t>(t);
      if (!v.empty() && v.back().t0 + v.back().n == tt && v.back().j0 + v.back().n == j) {
        ++v.back().n;
      } else {
        v.push_back({tt, j, 1});
      }
    }
  }
  plan->rank_prefix_matrix = std::move(rpm);
  plan->kept_runs = plan->runs[me].size();
  return plan;
}

// The ce:kept plan from the count exchange's mapped-host result (HtHostResult; no copy of
// send_pos, no stream synchronisation): the prefix matrix, and this rank's kept runs — listed
// when there are at most kHtHostKeptRuns, the only case in which the copy engines take them (else
// the kernel places the kept rows, ht_kept_copies_pay). `words` follows the per-expert counts.
static_assert(kHtHostKeptRuns >= static_cast<int>(kHtKeptCopyMaxRuns),
              "the count exchange lists every kept run the copy engines may take");

std::shared_ptr<HtCopyPlan> make_kept_plan(const volatile int32_t* words, int64_t T, int R,
                                           int me) {
  auto plan = std::make_shared<HtCopyPlan>();
  plan->runs.resize(R);
  plan->full = false;
  plan->rank_prefix_matrix.resize(static_cast<size_t>(R) * R);
  for (size_t i = 0; i < plan->rank_prefix_matrix.size(); ++i)
    plan->rank_prefix_matrix[i] = words[i];
  const volatile int32_t* runs = words + R * R;
  const int num_starts = runs[0], num_ends = runs[1];
  EPX_CHECK(num_starts >= 0 && num_ends >= 0 && num_ends <= num_starts &&
                (num_starts > kHtHostKeptRuns || num_ends >= num_starts - 1) && num_starts <= T &&
                T <= INT32_MAX,
            ErrorCode::kInternal, "ht_dispatch: ", num_starts, " kept runs with ", num_ends,
            " ends for T = ", T, ": inconsistent count-exchange result");
  plan->kept_runs = static_cast<size_t>(num_starts);
  if (num_starts > kHtHostKeptRuns) return plan;
  std::vector<int32_t> starts(num_starts), ends(num_ends);
  for (int i = 0; i < num_starts; ++i) starts[i] = runs[2 + i];
  for (int i = 0; i < num_ends; ++i) ends[i] = runs[2 + kHtHostKeptRuns + i];
  std::sort(starts.begin(), starts.end());
  std::sort(ends.begin(), ends.end());
  ends.push_back(static_cast<int32_t>(T));  // a run reaching T has no end listed
  int32_t j = 0;
  for (int i = 0; i < num_starts; ++i) {
    const int32_t n = ends[i] - starts[i];
    // Runs ascend, never touch, lie in [0, T) (a wrong word would misplace rows: say so instead).
    EPX_CHECK(starts[i] >= 0 && n > 0 && (i + 1 == num_starts || ends[i] < starts[i + 1]),
              ErrorCode::kInternal, "ht_dispatch: kept run ", i, " of ", num_starts, " is [",
              starts[i], ", ", ends[i], ") of T = ", T, ": inconsistent count-exchange result");
    plan->runs[me].push_back({starts[i], j, n});
    j += n;
  }
  EPX_CHECK(j == rows_between(plan->rank_prefix_matrix.data(), R, me, me), ErrorCode::kInternal,
            "ht_dispatch: the kept runs hold ", j, " tokens, the prefix matrix says ",
            rows_between(plan->rank_prefix_matrix.data(), R, me, me),
            ": inconsistent count-exchange result");
  return plan;
}

// Fills the parts every ht kernel shares.
static HtSymm make_symm(const SymmetricMemory& mem, const HtRegion& region, int R) {
  HtSymm s{};
  s.local = static_cast<char*>(mem.local());
  for (int p = 0; p < R; ++p) s.peers[p] = static_cast<char*>(mem.peer(p));
  s.region = region;
  return s;
}

static WaitContext make_wait(DeviceState* state, DeviceErrorRecord* error, uint64_t timeout_ns,
                             int rank, uint32_t op) {
  return WaitContext{state, error, timeout_ns, rank, op};
}

static void fill_topk(HtNotifyParams& p, const TensorView& topk_idx) {
  p.topk_idx = topk_idx.data;
  p.topk_stride = topk_idx.ndim == 2 ? topk_idx.strides[0] : 0;
  p.topk_is_i64 = topk_idx.dtype == DType::kI64;
}

namespace {
// Creates every stream and event given, or none (a failure part-way destroys what it made, leaves
// the outputs null and throws; the next call retries).
void create_streams(std::span<cudaStream_t> streams, std::span<cudaEvent_t> events,
                    const char* what) {
  std::vector<cudaStream_t> st(streams.size(), nullptr);
  std::vector<cudaEvent_t> ev(events.size(), nullptr);
  cudaError_t e = cudaSuccess;
  for (cudaStream_t& x : st)
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking);
  for (cudaEvent_t& x : ev)
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&x, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    for (cudaStream_t x : st)
      if (x) cudaStreamDestroy(x);
    for (cudaEvent_t x : ev)
      if (x) cudaEventDestroy(x);
    EPX_CUDA_CHECK(e, what);
  }
  std::copy(st.begin(), st.end(), streams.begin());
  std::copy(ev.begin(), ev.end(), events.begin());
}
}  // namespace

void CudaBuffer::ensure_engine_streams() {
  if (!engine_event_[2])
    create_streams(engine_stream_, engine_event_, "ht_dispatch: copy-engine streams");
}

void CudaBuffer::ensure_split_stream() {
  if (!split_event_[1])
    create_streams({&split_stream_, 1}, split_event_, "ht_dispatch: split dispatch stream");
}

// The kept rows' x (x -> recv_x, never in the symmetric region) on side stream 0, forked from
// `stream` at engine_event_[0], which the caller recorded: before the dispatch kernel for
// "ce:kept" (the copy engines copy while the kernel pushes and copies out; the calls are issued
// after the kernel's launch so the host's copy calls do not delay it), after it for "ce".
// Completion is engine_event_[1]; `join` makes `stream` wait for it here.
void CudaBuffer::kept_copies(const HtCopyPlan& plan, const HtDispatchParams& p, cudaStream_t stream,
                             bool join) {
  const int R = group.size(), me = group.rank();
  cudaStream_t kept = engine_stream_[0];
  EPX_CUDA_CHECK(cudaStreamWaitEvent(kept, engine_event_[0], 0), "ht_dispatch");
  CopyList self;
  const int64_t kept_base = prefix_before(plan.rank_prefix_matrix.data(), R, me, me);
  for (const HtCopyPlan::Run& run : plan.runs[me])
    add_x_rows(self, p, run.t0, run.n, p.recv_x + (kept_base + run.j0) * p.row_bytes);
  JoinOnUnwind unwind{kept, stream, engine_event_[1]};
  if (!(ht_ablation() & kAblateEngineKept)) self.issue(kept, "ht_dispatch: kept-row copy");
  EPX_CUDA_CHECK(cudaEventRecord(engine_event_[1], kept), "ht_dispatch");
  unwind.armed = false;
  if (join) EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, engine_event_[1], 0), "ht_dispatch");
}

// Copy-engine dispatch, after the dispatch kernel (which waited until every peer's slots were
// free and moved scales and metadata). Three streams, forked from and joined to `stream`:
//   stream     this rank's rows to each peer d, in kHtEngineChunks chunks of d's slot rows
//              (row j of chunk c: n_d * c / C <= j < n_d * (c + 1) / C), each chunk followed
//              by an arrive signal
//   side 0     the rows this rank keeps, x -> recv_x
//   side 1     per chunk: wait for every peer's arrive, then one contiguous copy per source slot
//              into recv_x (overlaps the next chunk's pushes)
// then, joined on `stream`, the ready signal (the slots may be overwritten).
void CudaBuffer::engine_copies(const HtCopyPlan& plan, const HtDispatchParams& p,
                               cudaStream_t stream) {
  const int R = group.size(), me = group.rank(), C = kHtEngineChunks;
  const std::vector<int32_t>& rpm = plan.rank_prefix_matrix;
  const int64_t rb = p.row_bytes;
  ensure_engine_streams();
  cudaStream_t out = engine_stream_[1];
  EPX_CUDA_CHECK(cudaEventRecord(engine_event_[0], stream), "ht_dispatch");
  kept_copies(plan, p, stream, /*join=*/false);  // joined at the end, after the pushes
  const int ablate = ht_ablation();
  // An exception below still joins both side streams (kept: engine_event_[1] is recorded).
  JoinOnUnwind kept_guard{engine_stream_[0], stream, engine_event_[1]};
  if (R > 1) {
    EPX_CUDA_CHECK(cudaStreamWaitEvent(out, engine_event_[0], 0), "ht_dispatch");
    JoinOnUnwind out_guard{out, stream, engine_event_[2]};
    HtEngineSyncParams sp = engine_sync_params(R, me, p.symm, p.wait, kEngineArrive);
    for (int c = 0; c < C; ++c) {
      CopyList push;
      for (int d = 0; d < R; ++d) {
        if (d == me) continue;
        const int64_t n = rows_between(rpm.data(), R, me, d);
        const int64_t lo = engine_chunk_begin(n, c), hi = engine_chunk_begin(n, c + 1);
        char* slot0 = region_.x_packed_row(static_cast<char*>(ht_mem_->peer(d)),
                                           HtRegion::slot_of(me, d), 0, rb);
        for (const HtCopyPlan::Run& run : plan.runs[d]) {
          const int64_t a = std::max<int64_t>(lo, run.j0);
          const int64_t b = std::min<int64_t>(hi, run.j0 + run.n);
          add_x_rows(push, p, run.t0 + (a - run.j0), b - a, slot0 + a * rb);
        }
      }
      if (!(ablate & kAblateEnginePush)) push.issue(stream, "ht_dispatch: copy-engine push");
      sp.step = kEngineArrive;
      sp.chunk = c;
      launch_ht_engine_sync(sp, stream);
      sp.step = kEngineWait;
      launch_ht_engine_sync(sp, out);
      CopyList copy_out;
      for (int s = 0; s < R; ++s) {
        if (s == me) continue;
        const int64_t n = rows_between(rpm.data(), R, s, me);
        const int64_t lo = engine_chunk_begin(n, c), hi = engine_chunk_begin(n, c + 1);
        const int64_t excl = prefix_before(rpm.data(), R, s, me);
        copy_out.add(p.recv_x + (excl + lo) * rb, static_cast<size_t>(rb),
                     region_.x_packed_row(ht_local(), HtRegion::slot_of(s, me), lo, rb),
                     static_cast<size_t>(rb), static_cast<size_t>(rb),
                     static_cast<size_t>(hi - lo));
      }
      if (!(ablate & kAblateEngineOut)) copy_out.issue(out, "ht_dispatch: copy-engine copy-out");
    }
    out_guard.armed = false;
    EPX_CUDA_CHECK(cudaEventRecord(engine_event_[2], out), "ht_dispatch");
    EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, engine_event_[2], 0), "ht_dispatch");
  }
  kept_guard.armed = false;
  EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, engine_event_[1], 0), "ht_dispatch");
  if (R > 1) launch_ht_engine_sync(engine_sync_params(R, me, p.symm, p.wait, kEngineReady), stream);
}

// Inputs of a dispatch or combine may not lie in this buffer's symmetric memory (a zero-copy
// recv_x): the peers write there during the op.
void CudaBuffer::check_outside_region(const TensorView& t, const char* op, const char* name) const {
  if (!t.defined() || t.numel() == 0) return;
  const auto lo = reinterpret_cast<uintptr_t>(t.data);
  uintptr_t hi = lo + dtype_size(t.dtype);  // one past the last element (strides >= 0)
  for (int i = 0; i < t.ndim; ++i)
    hi += static_cast<uintptr_t>(t.shape[i] - 1) * static_cast<uintptr_t>(t.strides[i]) *
          dtype_size(t.dtype);
  const auto base = reinterpret_cast<uintptr_t>(ht_local());
  EPX_CHECK_ARG(hi <= base || lo >= base + region_.total_bytes, op, ": argument '", name,
                "' lies in this buffer's symmetric memory (a zero-copy recv_x?), expected memory ",
                "of its own: the peers write there during the operation; copy it first");
}

TensorView CudaBuffer::ht_combine_buffer(const HtHandle& h) const {
  require_usable("ht_combine_buffer");
  return TensorView::contiguous(region_.combine_y_row(ht_local(), 0, shape.hidden * 2),
                                DType::kBF16, {ht_handle_rows(h), shape.hidden},
                                Device::cuda(device_));
}

HtLayout CudaBuffer::ht_layout(const TensorView& topk_idx, Stream stream,
                               const Allocator& alloc_fn) {
  require_usable("ht_layout");
  DeviceGuard guard(device_);
  const int R = group.size();
  const int64_t T = topk_idx.shape[0];
  HtLayout out;
  out.num_tokens_per_rank = alloc(alloc_fn, DType::kI32, {R}, device_);
  out.num_tokens_per_expert = alloc(alloc_fn, DType::kI32, {shape.num_experts}, device_);
  out.is_token_in_rank = alloc(alloc_fn, DType::kBool, {T, R}, device_);
  HtNotifyParams p{};
  fill_topk(p, topk_idx);
  p.num_tokens = static_cast<int>(T);
  p.top_k = shape.top_k;
  p.num_experts = shape.num_experts;
  p.num_local_experts = shape.num_experts / R;
  p.num_ranks = R;
  p.rank = group.rank();
  p.expert_alignment = 1;
  p.exchange = 0;
  p.num_tokens_per_rank = out.num_tokens_per_rank.ptr<int32_t>();
  p.num_tokens_per_expert = out.num_tokens_per_expert.ptr<int32_t>();
  p.is_token_in_rank = out.is_token_in_rank.ptr<bool>();
  p.symm = make_symm(*ht_mem_, region_, R);
  p.wait = make_wait(device_state(), error_dev_, timeout_ns_, group.rank(), kOpHtLayout);
  launch_ht_notify(p, static_cast<cudaStream_t>(stream));
  return out;
}

HtDispatchResult CudaBuffer::ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc_fn) {
  require_usable("ht_dispatch");
  DeviceGuard guard(device_);
  auto stream = static_cast<cudaStream_t>(args.stream);
  const int R = group.size(), me = group.rank(), K = shape.top_k;
  const int64_t H = shape.hidden;
  const bool cached = args.handle != nullptr;
  const TensorView& x = args.x;
  const int64_t T = x.shape[0];
  EPX_CHECK(T <= shape.max_tokens_per_rank, ErrorCode::kOutOfCapacity, "ht_dispatch: x has ", T,
            " tokens, expected at most max_tokens_per_rank = ", shape.max_tokens_per_rank);
  const bool fp8 = x.dtype == DType::kF8E4M3;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(x.dtype));
  const HtCopyConfig copy = copy_config();  // read once: every decision below uses the same
  const int ablate = ht_ablation();         // (likewise)
  check_outside_region(x, "ht_dispatch", "x");
  check_outside_region(args.x_scales, "ht_dispatch", "x_scales");

  HtDispatchResult res;
  HtHandle& h = res.handle;
  int64_t num_rows = 0;
  bool worst_case = false;
  const DType idx_dtype = cached ? DType::kI32 : args.topk_idx.dtype;

  // The dispatch kernel's parameters that do not depend on the outputs (N, allocated after the
  // count exchange in exact mode) or on the copy-engine plan.
  auto base_params = [&](int num_scales) {
    HtDispatchParams p{};
    p.x = static_cast<const char*>(x.data);
    p.x_stride = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
    p.row_bytes = row_bytes;
    if (num_scales > 0) {
      p.scales = static_cast<const char*>(args.x_scales.data);
      p.scale_stride0 = args.x_scales.strides[0];
      p.scale_stride1 = args.x_scales.strides[1];
      p.num_scales = num_scales;
    }
    if (!cached) {
      p.topk_idx = args.topk_idx.data;
      p.topk_stride = args.topk_idx.strides[0];
      p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
      if (args.topk_weights.defined()) {
        p.topk_weights = args.topk_weights.ptr<const float>();
        p.weights_stride = args.topk_weights.strides[0];
        p.weights_stride1 = args.topk_weights.strides[1];
      }
    }
    p.send_pos = h.send_pos.ptr<const int32_t>();
    p.rank_prefix_matrix = h.rank_prefix_matrix.ptr<const int32_t>();
    p.num_tokens = static_cast<int>(T);
    p.top_k = K;
    p.num_local_experts = shape.num_experts / R;
    p.num_ranks = R;
    p.rank = me;
    p.cached = cached;
    p.worst_case = worst_case;
    p.num_send_ctas = tuning_.dispatch_send_ctas;
    p.ablate = ablate;
    p.pdl = pdl_;
#ifdef EPX_HT_TRACE
    p.trace = trace_;
#endif
    p.symm = make_symm(*ht_mem_, region_, R);
    p.wait = make_wait(device_state(), error_dev_, timeout_ns_, me, kOpHtDispatch);
    p.send_batch = copy.send_batch;
    p.bulk_stages = copy.stages;
    p.bulk_chunk = copy.chunk;
    return p;
  };
  // Scale words per row (fp8 with scales; 0 otherwise).
  const int scales_in =
      fp8 && args.x_scales.defined() ? static_cast<int>(args.x_scales.shape[1]) : 0;
  // The split exact dispatch (opt-in, kHtSplitSend; not yet measured on two GPUs): the sender
  // CTAs as their own kernel on a side stream (split_stream_), forked right after the count
  // exchange, so that they push while the host waits for N and allocates; the receiver CTAs as a
  // second kernel on `stream` after that (it reads nothing the first writes: the rows it waits for
  // come from the peers, through the flags); `stream` then joins the side stream. Every kernel
  // copy path and ce:kept (its copy-engine fork follows the outputs' allocation on `stream`, as
  // unsplit; the send kernel has ce:kept's sender count, chosen before the host knows whether the
  // copy engines pay for this layout — if not, the receivers copy the kept rows themselves, with
  // the CTAs ce:kept left them). Not plain "ce" (no kernel senders), not zero-copy (its senders
  // place the kept rows' metadata in the outputs); not with ht PDL on.
  const bool kept_engines = copy.mode == HtCopyMode::kEngine && copy.engine_kept_only;
  const int split_send_ctas =
      kept_engines ? tuning_.dispatch_send_ctas_kept : tuning_.dispatch_send_ctas;
  // The copying dispatch through the zero-copy kernels (opt-in kHtDispatchViaZeroCopy; worst-case
  // mode excepted, decided below): not split.
  const bool via_zc_asked = !args.zero_copy && R > 1 && (ablate & kHtDispatchViaZeroCopy);
  const bool split = !cached && args.num_worst_tokens == 0 && !args.zero_copy && !via_zc_asked &&
                     !pdl_ && (!one_stream_ || one_gpu_side_streams()) && (ablate & kHtSplitSend) &&
                     R > 1 && (copy.mode != HtCopyMode::kEngine || kept_engines) &&
                     split_send_ctas > 0 && split_send_ctas < tuning_.num_sms;
  // A dispatch kernel's copy path, its rows aligned to vb bytes: bulk copies need 16-byte aligned
  // rows (the symmetric slots always are); the zero-copy kernels (zero_copy) copy by warp.
  auto copy_mode_for = [&](int vb, bool zero_copy) {
    return static_cast<int>(vb == 16 && copy.mode == HtCopyMode::kBulk && !zero_copy
                                ? HtCopyMode::kBulk
                                : HtCopyMode::kWarp);
  };
  // The split's receive kernel: the op's CTAs after the send kernel's.
  auto as_recv_kernel = [&](HtDispatchParams& p) {
    p.num_send_ctas = split_send_ctas;
    p.cta_offset = split_send_ctas;
    p.op_ctas = tuning_.num_sms;
    p.pdl = 0;
  };
  // From the send kernel's launch on, until `stream` joined the side stream: on an exception
  // before the receive kernel was launched, it is launched anyway with nothing to write (outputs
  // null, copies skipped), so that the op completes on this rank and its peers; in any case
  // `stream` then joins the side stream (the send kernel reads x and the routing). Then the
  // exception propagates.
  struct SplitGuard {
    HtDispatchParams p{};  // the receive kernel's, for the drain
    int vb = 1, grid = 0;
    cudaStream_t stream = nullptr, side = nullptr;
    cudaEvent_t join = nullptr;
    bool send_launched = false, recv_launched = false;
    // `stream` waits for everything on the side stream so far (the send kernel).
    void join_side(bool checked) const {
      const cudaError_t e = cudaEventRecord(join, side);
      const cudaError_t w = e == cudaSuccess ? cudaStreamWaitEvent(stream, join, 0) : e;
      if (checked) EPX_CUDA_CHECK(w, "ht_dispatch: split join");
    }
    ~SplitGuard() {
      if (!send_launched) return;
      if (!recv_launched) {
        try {
          p.recv_x = nullptr;
          p.recv_scales = nullptr;
          p.cached = 1;  // no metadata
          p.ablate |= kAblateSelf | kAblateRemoteCopy;
          launch_ht_dispatch(p, vb, grid, stream, /*launch_pdl=*/0);
        } catch (...) {  // the op's error is the one that propagates
        }
      }
      join_side(/*checked=*/false);
    }
  } split_guard;

  if (cached) {
    EPX_CHECK_ARG(args.handle->buffer_id == id, "ht_dispatch: argument 'handle' comes from buffer ",
                  args.handle->buffer_id, ", expected one made by this buffer (", id, ")");
    EPX_CHECK_ARG(args.handle->num_tokens == T, "ht_dispatch: x has ", T,
                  " tokens but the cached handle was made for ", args.handle->num_tokens);
    h = *args.handle;
    worst_case = h.num_worst_tokens > 0;
    num_rows = ht_handle_rows(h);
  } else {
    h.rank_prefix_matrix = alloc(alloc_fn, DType::kI32, {R, R}, device_);
    h.is_token_in_rank = alloc(alloc_fn, DType::kBool, {T, R}, device_);
    h.send_pos = alloc(alloc_fn, DType::kI32, {T, R}, device_);
    h.num_tokens = T;
    h.top_k = K;
    h.buffer_id = id;
    worst_case = args.num_worst_tokens > 0;
    HtNotifyParams np{};
    fill_topk(np, args.topk_idx);
    np.num_tokens = static_cast<int>(T);
    np.top_k = K;
    np.num_experts = shape.num_experts;
    np.num_local_experts = shape.num_experts / R;
    np.num_ranks = R;
    np.rank = me;
    np.expert_alignment = args.expert_alignment > 0 ? args.expert_alignment : 1;
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
    // Only ce:kept builds its plan from the published runs (below); other paths skip the search.
    const bool plan_from_words =
        copy.mode == HtCopyMode::kEngine && copy.engine_kept_only && !(ablate & kHtKeptPlanCopied);
    np.find_kept_runs = plan_from_words ? 1 : 0;
    np.ablate = ablate;
    np.symm = make_symm(*ht_mem_, region_, R);
    np.wait = make_wait(device_state(), error_dev_, timeout_ns_, me, kOpHtNotify);
#ifdef EPX_HT_TRACE
    np.trace = trace_;
#endif
    if (split) ensure_split_stream();  // (a failure here leaves no peer waiting)
    launch_ht_notify(np, stream);
    if (split) {
      HtDispatchParams sp = base_params(scales_in);
      sp.num_send_ctas = split_send_ctas;
      sp.op_ctas = tuning_.num_sms;
      const int vb_send =
          vector_bytes({reinterpret_cast<uint64_t>(sp.x), static_cast<uint64_t>(sp.x_stride),
                        static_cast<uint64_t>(row_bytes)});
      sp.copy_mode = copy_mode_for(vb_send, /*zero_copy=*/false);  // (split: never zero-copy)
      sp.pdl = 0;
      // The drain's parameters: the receive kernel's, without outputs.
      split_guard.p = sp;
      as_recv_kernel(split_guard.p);
      split_guard.p.copy_mode = static_cast<int>(HtCopyMode::kWarp);
      split_guard.vb = 1;
      split_guard.grid = tuning_.num_sms - split_send_ctas;
      split_guard.stream = stream;
      split_guard.side = split_stream_;
      split_guard.join = split_event_[1];
      EPX_CUDA_CHECK(cudaEventRecord(split_event_[0], stream), "ht_dispatch: split fork");
      EPX_CUDA_CHECK(cudaStreamWaitEvent(split_stream_, split_event_[0], 0),
                     "ht_dispatch: split fork");
      launch_ht_dispatch(sp, vb_send, split_send_ctas, split_stream_, /*launch_pdl=*/0);
      split_guard.send_launched = true;
    }
    if (worst_case) {
      num_rows = args.num_worst_tokens;
      h.num_recv_tokens = -1;
      h.num_worst_tokens = args.num_worst_tokens;
    } else {
      // The one host synchronisation of exact mode: wait for this launch's ticket. Bounded: the
      // device gives up after the timeout and reports; we allow it a few seconds more.
      volatile HtHostResult* r = result_host_;
      const auto deadline =
          std::chrono::steady_clock::now() + group.timeout() + std::chrono::seconds(5);
      for (uint32_t spins = 0; r->ticket != np.ticket; ++spins) {
        if (spins % 1024 == 1023) {
          if (error_host_->code == kDevErrTimeout) check();
          const cudaError_t q = cudaStreamQuery(stream);
          if (q != cudaSuccess && q != cudaErrorNotReady)
            throw_cuda(q, "count exchange", "ht_dispatch");
          if (std::chrono::steady_clock::now() > deadline) {
            broken_ = true;
            broken_why_ = "the count exchange did not complete in time";
            throw_error(ErrorCode::kTimeout,
                        cat("ht_dispatch: rank ", me, " waited ", group.timeout().count(),
                            " ms (+5 s) for the count ", "exchange to finish on its stream"));
          }
          std::this_thread::yield();
        }
      }
      std::atomic_thread_fence(std::memory_order_acquire);
      // Per-call values that differ across ranks (seen by every rank's count exchange before its
      // ticket): every rank raises here, before any dispatch kernel (the split's send kernel is
      // drained by split_guard), so no rows move with mismatched formats.
      if (error_host_->code == kDevErrHtCallDiffers) check();
      num_rows = r->num_recv_tokens;
      const volatile int32_t* per_expert =
          reinterpret_cast<const volatile int32_t*>(result_host_ + 1);
      res.num_recv_tokens_per_expert.resize(region_.num_local_experts);
      for (int l = 0; l < region_.num_local_experts; ++l)
        res.num_recv_tokens_per_expert[l] = per_expert[l];
      h.num_recv_tokens = num_rows;
      h.num_worst_tokens = 0;
      const volatile int32_t* plan_words = per_expert + region_.num_local_experts;
      const int32_t kept_runs = plan_from_words ? plan_words[R * R] : 0;
      // (More runs than are listed and a raised run limit: the plan from host copies below.)
      if (plan_from_words &&
          (kept_runs <= kHtHostKeptRuns || !ht_kept_copies_pay(static_cast<size_t>(kept_runs)))) {
        h.copy_plan = make_kept_plan(plan_words, T, R, me);  // ce:kept: all it needs, no sync
      } else if (copy.mode == HtCopyMode::kEngine) {
        // The copy engines need the layout on the host: send_pos and the prefix matrix (the
        // count exchange finished: this waits only for the two small copies).
        std::vector<int32_t> sp(static_cast<size_t>(T) * R), rpm(static_cast<size_t>(R) * R);
        if (T > 0)
          EPX_CUDA_CHECK(cudaMemcpyAsync(sp.data(), h.send_pos.data, sp.size() * 4,
                                         cudaMemcpyDeviceToHost, stream),
                         "ht_dispatch: copy plan");
        EPX_CUDA_CHECK(cudaMemcpyAsync(rpm.data(), h.rank_prefix_matrix.data, rpm.size() * 4,
                                       cudaMemcpyDeviceToHost, stream),
                       "ht_dispatch: copy plan");
        EPX_CUDA_CHECK(cudaStreamSynchronize(stream), "ht_dispatch: copy plan");
        auto plan = make_copy_plan(sp, T, R, me, std::move(rpm));
        // `full` from settings every rank shares (not from this rank's run count, which chose
        // this path when the run limit is raised above 32): plain "ce" must decide alike.
        plan->full = !plan_from_words;
        h.copy_plan = std::move(plan);
      }
    }
  }
  // Copy engines move x where the host knows the layout (for "ce", which changes the protocol,
  // every rank decides alike: same mode, same kind of call, handles made the same way; the kept
  // rows' copies, "ce:kept", are each rank's own choice: ht_kept_copies_pay). Zero-copy: at most
  // the kept rows ("ce" acts as "ce:kept"), and the kernel path for the rest (no bulk copies).
  // Via zero-copy (kHtDispatchViaZeroCopy): the zero-copy kernels into this rank's region, owned
  // outputs, the received rows copied out after the kernel (below).
  const bool via_zc = via_zc_asked && !worst_case;
  const bool zero_copy = args.zero_copy || via_zc;
  const bool engine_any = !worst_case && h.copy_plan != nullptr && copy.mode == HtCopyMode::kEngine;
  // (A plan from a ce:kept exact dispatch lists only the kept runs: plain "ce" then takes the
  // kernel path; every rank made its handle under the same mode, so all decide alike.)
  const bool engine = engine_any && !copy.engine_kept_only && !zero_copy && h.copy_plan->full;
  // (ce:kept: only while the kept rows form few runs, ht_kept_copies_pay; else the kernel.)
  const bool engine_kept = engine_any && (copy.engine_kept_only || zero_copy) &&
                           ht_kept_copies_pay(h.copy_plan->kept_runs) &&
                           h.copy_plan->runs[me].size() == h.copy_plan->kept_runs;  // listed

  // Outputs. Zero-copy: recv_x views this rank's x area, where the peers store the rows; no
  // storage of its own (valid until the next ht op and while the buffer lives; Python's tensor
  // keeps the Buffer object alive, python/src/torch_bridge.cc). Via zero-copy: owned outputs.
  char* const region_x = ht_local() + region_.x_off;
  char* const region_scales = ht_local() + region_.scale_off;
  if (zero_copy) {
    EPX_CHECK(num_rows <= static_cast<int64_t>(R) * region_.max_tokens, ErrorCode::kInternal,
              "ht_dispatch: zero-copy view of ", num_rows, " rows exceeds the region");
  }
  if (args.zero_copy) {
    static_cast<TensorView&>(res.recv_x) =
        TensorView::contiguous(region_x, x.dtype, {num_rows, H}, Device::cuda(device_));
  } else {
    res.recv_x = alloc(alloc_fn, x.dtype, {num_rows, H}, device_);
  }
  const int num_scales = scales_in;
  if (fp8 && args.x_scales.defined()) {
    if (args.zero_copy) {
      static_cast<TensorView&>(res.recv_x_scales) = TensorView::contiguous(
          region_scales, args.x_scales.dtype, {num_rows, num_scales}, Device::cuda(device_));
    } else {
      res.recv_x_scales = alloc(alloc_fn, args.x_scales.dtype, {num_rows, num_scales}, device_);
    }
  }
  if (!cached) {
    res.recv_topk_idx = alloc(alloc_fn, idx_dtype, {num_rows, K}, device_);
    if (args.topk_weights.defined())
      res.recv_topk_weights = alloc(alloc_fn, DType::kF32, {num_rows, K}, device_);
    res.recv_src_idx = alloc(alloc_fn, DType::kI32, {num_rows}, device_);
    h.recv_src_idx = res.recv_src_idx;
  }

  HtDispatchParams p = base_params(num_scales);
  if (num_scales > 0)
    p.recv_scales =
        zero_copy ? reinterpret_cast<uint32_t*>(region_scales) : res.recv_x_scales.ptr<uint32_t>();
  if (!cached) {
    if (args.topk_weights.defined()) p.recv_topk_weights = res.recv_topk_weights.ptr<float>();
    p.recv_topk_idx = res.recv_topk_idx.data;
    p.recv_src_idx = res.recv_src_idx.ptr<int32_t>();
  }
  p.recv_x = zero_copy ? region_x : static_cast<char*>(res.recv_x.data);
  p.num_rows = num_rows;
  const int vb =
      vector_bytes({reinterpret_cast<uint64_t>(p.x), static_cast<uint64_t>(p.x_stride),
                    static_cast<uint64_t>(row_bytes), reinterpret_cast<uint64_t>(p.recv_x)});
  p.copy_mode = copy_mode_for(vb, zero_copy);
  p.engine_x = engine ? 1 : 0;
  p.engine_kept = engine_kept ? 1 : 0;
  p.zero_copy = zero_copy ? 1 : 0;
  // Zero-copy receivers copy no x rows from the slots: every CTA sends, then receives.
  if (zero_copy) p.num_send_ctas = tuning_.dispatch_send_ctas_zero_copy;
  if (engine_kept) {
    if (!zero_copy) p.num_send_ctas = tuning_.dispatch_send_ctas_kept;
    ensure_engine_streams();
    EPX_CUDA_CHECK(cudaEventRecord(engine_event_[0], stream), "ht_dispatch");  // fork point
  }
  const int grid = tuning_.num_sms;
  if (split) {
    as_recv_kernel(p);
    launch_ht_dispatch(p, vb, grid - split_send_ctas, stream, /*launch_pdl=*/0);
    split_guard.recv_launched = true;  // nothing to drain
    split_guard.join_side(/*checked=*/true);
    split_guard.send_launched = false;  // joined: nothing left to do
  } else {
    launch_ht_dispatch(p, vb, grid, stream);
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_dispatch");
  if (engine) engine_copies(*h.copy_plan, p, stream);
  if (engine_kept) {
    HtDispatchParams kept = p;  // via zero-copy: the kept rows straight into recv_x
    if (via_zc) kept.recv_x = static_cast<char*>(res.recv_x.data);
    kept_copies(*h.copy_plan, kept, stream, /*join=*/true);
  }
  if (via_zc && num_rows > 0) {
    // The received rows out of the region (after the kernel, on `stream`): the other sources'
    // blocks where the copy engines put the kept rows in recv_x, else every row; all scales
    // (the kernel places the kept rows' scales in the region too).
    CopyList out;
    auto add_rows = [&](int64_t first, int64_t n) {
      out.add(static_cast<char*>(res.recv_x.data) + first * row_bytes,
              static_cast<size_t>(row_bytes), region_x + first * row_bytes,
              static_cast<size_t>(row_bytes), static_cast<size_t>(row_bytes),
              static_cast<size_t>(n));
    };
    if (engine_kept) {
      const int32_t* rpm = h.copy_plan->rank_prefix_matrix.data();
      for (int s = 0; s < R; ++s)
        if (s != me) add_rows(prefix_before(rpm, R, s, me), rows_between(rpm, R, s, me));
    } else {
      add_rows(0, num_rows);
    }
    if (num_scales > 0) {
      const size_t scale_row = static_cast<size_t>(num_scales) * 4;
      out.add(static_cast<char*>(res.recv_x_scales.data), scale_row, region_scales, scale_row,
              scale_row, static_cast<size_t>(num_rows));
    }
    out.issue(stream, "ht_dispatch: received rows out of the region");
  }
  // Exact mode already waited for the count exchange: an out-of-range expert id it found is
  // raised now, after the dispatch kernel was launched, so every peer's collective completes.
  if (!cached && !worst_case && error_host_->code != kDevErrNone) check();
  return res;
}

HtCombineResult CudaBuffer::ht_combine(const HtCombineArgs& args, const Allocator& alloc_fn) {
  require_usable("ht_combine");
  DeviceGuard guard(device_);
  auto stream = static_cast<cudaStream_t>(args.stream);
  const HtHandle& h = *args.handle;
  EPX_CHECK_ARG(h.buffer_id == id, "ht_combine: argument 'handle' comes from buffer ", h.buffer_id,
                ", expected one made by this buffer (", id, ")");
  const int R = group.size(), me = group.rank(), K = shape.top_k;
  const int64_t H = shape.hidden, T = h.num_tokens;
  // Zero-copy: y is the combine buffer (validate_ht_combine checked it).
  if (!args.zero_copy) check_outside_region(args.y, "ht_combine", "y");
  HtCombineResult res;
  res.out = alloc(alloc_fn, DType::kBF16, {T, H}, device_);
  const bool with_weights = args.topk_weights.defined();
  if (with_weights) res.combined_topk_weights = alloc(alloc_fn, DType::kF32, {T, K}, device_);

  HtCombineParams p{};
  p.y = static_cast<const char*>(args.y.data);
  p.y_stride = args.y.strides[0] * 2;
  p.num_y_rows = args.y.shape[0];
  p.row_bytes = H * 2;
  if (with_weights) {
    p.weights = args.topk_weights.ptr<const float>();
    p.weights_stride = args.topk_weights.strides[0];
    p.combined_weights = res.combined_topk_weights.ptr<float>();
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
  p.num_tokens = static_cast<int>(T);
  p.top_k = K;
  p.num_ranks = R;
  p.rank = me;
  p.out = static_cast<char*>(res.out.data);
  p.num_send_ctas = tuning_.combine_send_ctas;
  const int ablate = ht_ablation();  // read once
  p.ablate = ablate;
  p.pdl = pdl_;
#ifdef EPX_HT_TRACE
  p.trace = trace_;
#endif
  p.symm = make_symm(*ht_mem_, region_, R);
  p.wait = make_wait(device_state(), error_dev_, timeout_ns_, me, kOpHtCombine);
  // A copying combine through the pull protocol (opt-in kHtCombineViaPull, the same on every
  // rank): the y rows the peers need (those of their tokens; all rows where the host does not
  // know the layout) copied into this rank's combine buffer on `stream` (a copy engine, no SMs;
  // the buffer is free: the peers read it only during a pull combine, which ends with a barrier,
  // and write the region only during a dispatch, which this rank finished), then the zero-copy
  // combine below: the peers read those rows from the buffer, this rank its own from y.
  const bool via_pull = !args.zero_copy && R > 1 && (ablate & kHtCombineViaPull);
  // The rows the buffer (and the weights' mirror) can hold, R * T_max; the peers read only rows
  // below N <= R * T_max (a worst-case handle's y has num_worst_tokens rows, which a copying
  // dispatch does not bound: its rows past N are padding nobody reads).
  const int64_t mirror_rows = std::min<int64_t>(p.num_y_rows, int64_t{R} * region_.max_tokens);
  const int grid = tuning_.num_sms;
  // Where the host knows the layout, the peers' blocks are copied in kHtEngineChunks chunks on a
  // side stream beside the kernel, each chunk signalled (arrive steps), so the peers pull a chunk
  // as soon as it is there (p.pull_chunked); the arrive steps need an SM the kernels leave free.
  // Every rank decides alike (handles made under the same copy mode, equal SM counts, the same
  // switches). kHtCombineViaPullWhole: the whole copy before the kernel (the A/B). (One-GPU
  // mode: the ranks' kernels share the SMs, and side streams only with one_gpu_side_streams, as
  // in copy_config.)
  const bool sm_free = one_stream_ ? group.size() * grid < device_sms_ && one_gpu_side_streams()
                                   : grid < device_sms_;
  const bool pull_chunked = via_pull && h.copy_plan != nullptr && h.num_worst_tokens == 0 &&
                            sm_free && !(ablate & kHtCombineViaPullWhole);
  char* const buffer = region_.combine_y_row(ht_local(), 0, p.row_bytes);
  // Rows [first, first + n) of y into the buffer.
  auto add_y_rows = [&](CopyList& rows, int64_t first, int64_t n) {
    rows.add(buffer + first * p.row_bytes, static_cast<size_t>(p.row_bytes),
             p.y + first * p.y_stride, static_cast<size_t>(p.y_stride),
             static_cast<size_t>(p.row_bytes), static_cast<size_t>(n));
  };
  if (via_pull && !pull_chunked && mirror_rows > 0) {
    CopyList rows;
    if (h.copy_plan != nullptr && h.num_worst_tokens == 0) {
      const int32_t* rpm = h.copy_plan->rank_prefix_matrix.data();
      for (int s = 0; s < R; ++s)
        if (s != me) add_y_rows(rows, prefix_before(rpm, R, s, me), rows_between(rpm, R, s, me));
    } else {
      add_y_rows(rows, 0, mirror_rows);
    }
    rows.issue(stream, "ht_combine: y rows into the combine buffer");
  }
  const int vb =
      vector_bytes({reinterpret_cast<uint64_t>(p.y), static_cast<uint64_t>(p.y_stride),
                    static_cast<uint64_t>(p.row_bytes), reinterpret_cast<uint64_t>(p.out),
                    reinterpret_cast<uint64_t>(p.bias0), static_cast<uint64_t>(p.bias0_stride),
                    reinterpret_cast<uint64_t>(p.bias1), static_cast<uint64_t>(p.bias1_stride)});
  if (args.zero_copy || via_pull) {
    // Zero-copy combine: the peers read y where the caller wrote it and the weights from their
    // mirror in the region (one local copy); every CTA reduces.
    if (with_weights && mirror_rows > 0 && R > 1) {
      CopyList w;  // a 2-D copy, or one per row where the rows overlap (stride(0) < K)
      w.add(reinterpret_cast<char*>(region_.combine_w_row(ht_local(), 0)),
            static_cast<size_t>(K) * 4, reinterpret_cast<const char*>(p.weights),
            static_cast<size_t>(p.weights_stride) * 4, static_cast<size_t>(K) * 4,
            static_cast<size_t>(mirror_rows));
      w.issue(stream, "ht_combine: weights");
    }
    p.pull = 1;
    p.num_send_ctas = 0;
    // The staged reducer where every token has <= 2 row sources of 16-byte vectors (R + biases
    // <= 2) and no A/B switch asks for the register steps. (Decided first: its preparation may
    // throw, which must come before the chunked path's steps tell the peers anything.)
    const HtPullStaging st = ht_pull_staging();
    const int nbias = (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0);
    const bool staged = st.stages > 0 && grid <= st.max_sms && vb == 16 && R + nbias <= 2 &&
                        !(p.ablate & (kHtPullStagedOff | kHtReducePairOff | kHtReduceNarrow)) &&
                        prepare_ht_combine_staged(st.stages, st.chunk);
    HtEngineSyncParams sp{};
    if (pull_chunked) {
      // The op number for the arrive steps (state->engine_op: they run beside the kernel, which
      // advances state->seq when it ends), then the fork point, after the weights' copy.
      p.pull_chunked = 1;
      ensure_engine_streams();
      sp = engine_sync_params(R, me, p.symm, p.wait, kEngineWaitReady);
      sp.seq_ahead = 1;
      launch_ht_engine_sync(sp, stream);
      EPX_CUDA_CHECK(cudaEventRecord(engine_event_[0], stream), "ht_combine");
    }
    if (staged) {
      p.pull_stages = st.stages;
      p.pull_chunk = st.chunk;
      launch_ht_combine_staged(p, grid, stream);
    } else {
      launch_ht_combine(p, vb, grid, stream);
      EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
    }
    if (pull_chunked) {
      // Beside the kernel (issued after its launch, so these calls do not delay it): chunk c of
      // every peer's block, then its arrive step.
      const int32_t* rpm = h.copy_plan->rank_prefix_matrix.data();
      chunks_with_arrive(
          stream, engine_stream_[1], engine_event_[0], engine_event_[2], sp,
          [&](int c, CopyList& rows) {
            for (int s = 0; s < R; ++s) {
              if (s == me) continue;
              const int64_t n = rows_between(rpm, R, s, me);
              const int64_t lo = engine_chunk_begin(n, c), hi = engine_chunk_begin(n, c + 1);
              add_y_rows(rows, prefix_before(rpm, R, s, me) + lo, hi - lo);
            }
          },
          "ht_combine: y rows into the combine buffer");
    }
    return res;
  }
  const HtCopyConfig copy = copy_config();
  // The reducers wait for arrive kernels that run beside them: at least one SM must stay free
  // (the same on every rank: the SM counts are equal).
  bool engine_y = R > 1 && h.copy_plan != nullptr && copy.mode == HtCopyMode::kEngine &&
                  copy.engine_combine != HtEngineCombine::kOff && grid < device_sms_;
  if (engine_y && copy.engine_combine == HtEngineCombine::kAuto) {
    int64_t max_pair_rows = 0;  // the largest block any rank sends another (same on every rank)
    for (int s = 0; s < R; ++s)
      for (int d = 0; d < R; ++d)
        if (s != d)
          max_pair_rows = std::max<int64_t>(
              max_pair_rows, rows_between(h.copy_plan->rank_prefix_matrix.data(), R, s, d));
    engine_y = ht_engine_combine_pays(grid, max_pair_rows * p.row_bytes);
  }
  p.engine_y = engine_y ? 1 : 0;
  if (!engine_y) {
    launch_ht_combine(p, vb, grid, stream);
    EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
    return res;
  }
  // Copy engines push the y rows (EPX_HT_COPY=ce...:combine): wait until every peer finished
  // its previous op, fork a side stream there, run the kernel (senders: weights only; reducers
  // wait per chunk) beside the side stream's chunked pushes + arrive signals, join.
  p.engine_share = ht_engine_share();
  // All rows by copy engine: a few sender CTAs move the weights; else the usual senders.
  p.num_send_ctas =
      p.engine_share >= 100 ? std::max(1, grid / 8) : std::max(1, tuning_.combine_send_ctas);
  ensure_engine_streams();
  HtEngineSyncParams sp = engine_sync_params(R, me, p.symm, p.wait, kEngineWaitReady);
  sp.seq_ahead = 1;
  launch_ht_engine_sync(sp, stream);
  EPX_CUDA_CHECK(cudaEventRecord(engine_event_[0], stream), "ht_combine");
  launch_ht_combine(p, vb, grid, stream);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine");
  const std::vector<int32_t>& rpm = h.copy_plan->rank_prefix_matrix;
  const bool skip = (p.ablate & kAblateEnginePush) != 0;
  chunks_with_arrive(
      stream, engine_stream_[1], engine_event_[0], engine_event_[2], sp,
      [&](int c, CopyList& rows) {
        for (int s = 0; s < R && !skip; ++s) {
          if (s == me) continue;
          // The rows this rank received from s go back to row j of s's slot for this rank.
          const int64_t excl = prefix_before(rpm.data(), R, s, me);
          // The first m of the n rows (engine_split_rows); the senders push the others.
          const int64_t m = engine_split_rows(rows_between(rpm.data(), R, s, me), p.engine_share);
          const int64_t lo = engine_chunk_begin(m, c);
          const int64_t hi = std::min(engine_chunk_begin(m, c + 1), p.num_y_rows - excl);
          if (hi <= lo) continue;
          rows.add(
              region_.x_row(static_cast<char*>(ht_mem_->peer(s)), HtRegion::slot_of(me, s), lo),
              static_cast<size_t>(region_.x_row_bytes), p.y + (excl + lo) * p.y_stride,
              static_cast<size_t>(p.y_stride), static_cast<size_t>(p.row_bytes),
              static_cast<size_t>(hi - lo));
        }
      },
      "ht_combine: copy-engine row push");
  return res;
}

}  // namespace epx::detail
