// src/cuda/cuda_buffer.cc — CudaBuffer set-up, teardown, device-error reporting, the cuda
// sizing functions and factories, and the tuning resolution. The ht operations are in ht.cu.
//
// Buffer memory per rank: one symmetric allocation of HtRegion::total_bytes (see
// kernels/ht/ht_region.cuh for its layout), plus two small mapped pinned host blocks: the
// DeviceErrorRecord kernels write on failure and the HtHostResult of the exact-mode count exchange.
#include "cuda/cuda_buffer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>

#include "core/agree.h"
#include "core/check.h"
#include "core/env.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels/ht/trace.cuh"
#include "cuda/launch.h"
#include "cuda/trace_buffers.h"

namespace epx::detail {

// The ll mode (src/cuda/ll.cu).
std::shared_ptr<CudaLl> cuda_ll_create(const Group& group, const MoeShape& shape);
size_t cuda_ll_allocated(const CudaLl* ll);
void cuda_ll_check(CudaLl& ll);
LlDispatchResult cuda_ll_dispatch(CudaLl& ll, const LlDispatchArgs& args, const Allocator& alloc,
                                  uint64_t buffer_id);
LlCombineResult cuda_ll_combine(CudaLl& ll, const LlCombineArgs& args, const Allocator& alloc);
TensorView cuda_ll_next_combine_buffer(CudaLl& ll, const LlHandle& handle);
void cuda_ll_clean(CudaLl& ll);
size_t cuda_ll_layout_bytes(const MoeShape& shape, int num_ranks);

static std::string ht_call_differs_message(const DeviceErrorRecord& e);

void rearm_device_error(volatile DeviceErrorRecord* record, uint32_t* claim_on_device, int device) {
  record->code = kDevErrNone;
  DeviceGuard guard(device);
  const uint32_t zero = 0;
  EPX_CUDA_CHECK(cudaMemcpy(claim_on_device, &zero, sizeof(zero), cudaMemcpyHostToDevice), "check");
}

const char* device_op_name(uint32_t op) {
  switch (op) {
    case kOpHtLayout:
      return "ht_layout";
    case kOpHtNotify:
      return "ht_dispatch (count exchange)";
    case kOpHtDispatch:
      return "ht_dispatch";
    case kOpHtCombine:
      return "ht_combine";
    case kOpBarrier:
      return "barrier";
    default:
      return "device operation";
  }
}

const char* device_wait_name(uint32_t what) {
  switch (what) {
    case kWaitReady:
      return "the peer to finish its previous operation";
    case kWaitCounts:
      return "the peer's token counts";
    case kWaitRows:
      return "rows from the peer";
    case kWaitBarrier:
      return "the peer at a barrier";
    case kWaitBulkCopy:
      return "its own bulk copy to land (bulk-copy path)";
    default:
      return "the peer";
  }
}

// ---- tuning ------------------------------------------------------------------------------------

static std::atomic<int> g_num_sms_override{0};
static std::atomic<int> g_ablation{0};

void set_ht_ablation(int bits) {
  g_ablation = bits;
}
int ht_ablation() {
  return g_ablation.load();
}
// parse_ht_copy: src/core/ht_copy.cc (every build checks EPX_HT_COPY at group creation).

namespace {
std::mutex g_copy_mutex;
bool g_copy_overridden = false;
HtCopyConfig g_copy_override;
}  // namespace

HtCopyConfig ht_copy_config() {
  {
    std::lock_guard<std::mutex> lock(g_copy_mutex);
    if (g_copy_overridden) return g_copy_override;
  }
  static const HtCopyConfig from_env = [] {
    const std::string v = env_ht_copy();
    return v.empty() ? HtCopyConfig{} : parse_ht_copy(v, "EPX_HT_COPY");
  }();
  return from_env;
}

bool ht_engine_combine_pays(int num_sms, int64_t max_pair_bytes) {
  return num_sms <= 24 && max_pair_bytes >= (int64_t{32} << 20);
}

static std::atomic<int64_t> g_kept_copy_max_runs{-1};

void set_ht_kept_copy_max_runs_override(int64_t max_runs) {
  g_kept_copy_max_runs = max_runs < 0 ? -1 : max_runs;
}

bool ht_kept_copies_pay(size_t kept_runs) {
  const int64_t o = g_kept_copy_max_runs.load();
  return kept_runs <= (o >= 0 ? static_cast<size_t>(o) : kHtKeptCopyMaxRuns);
}

bool CudaBuffer::one_gpu_side_streams() const {
  return env_one_gpu_side_streams() && env_cuda_device_max_connections() >= 5 * group.size();
}

HtCopyConfig CudaBuffer::copy_config() const {
  HtCopyConfig c = ht_copy_config();
  if (!one_stream_ || c.mode != HtCopyMode::kEngine) return c;
  // One GPU for every rank. Work on a side stream that the driver put in the same hardware queue
  // as a peer's stream waits behind that peer's kernels: a kept-row copy behind a peer's kernel
  // of the next op (which waits for this rank's next op, which waits for the copy) stalls until
  // the timeout. So by default the kernels move every row here; with EPX_ONE_GPU_SIDE_STREAMS=1
  // (tests of the side-stream paths) and room for five streams per rank (its own, the split
  // dispatch's, the two copy-engine streams, the per-thread one), "ce:kept" only — plain "ce" and
  // ":combine" run sync kernels on the side streams that need free SMs the other ranks hold.
  if (one_gpu_side_streams()) {
    c.engine_kept_only = true;
    c.engine_combine = HtEngineCombine::kOff;
  } else {
    c.mode = HtCopyMode::kWarp;
  }
  return c;
}

void set_ht_copy_override(const HtCopyConfig* config) {
  std::lock_guard<std::mutex> lock(g_copy_mutex);
  g_copy_overridden = config != nullptr;
  if (config) g_copy_override = *config;
}

static std::atomic<int> g_dispatch_send_percent{0};
static std::atomic<int> g_combine_send_percent{0};

static std::atomic<int> g_engine_share{100};

void set_ht_engine_share_override(int percent) {
  g_engine_share = percent >= 1 && percent <= 99 ? percent : 100;
}

int ht_engine_share() {
  return g_engine_share.load();
}

#ifdef EPX_HT_TRACE
static TraceBuffers g_ht_traces;  // ht_trace_buffer: the newest live CudaBuffer's (bench only)
#endif

static std::atomic<int> g_pull_stages{-1};
static std::atomic<int> g_pull_chunk{0};

HtPullStaging ht_pull_staging() {
  HtPullStaging s;
  if (g_pull_stages.load() >= 0) {
    s.stages = g_pull_stages.load();
    s.chunk = g_pull_chunk.load();
    s.max_sms = 1 << 30;
  }
  return s;
}

void set_ht_pull_staging_override(int stages, int chunk) {
  EPX_CHECK_ARG(stages <= 0 || (stages >= 2 && stages <= 8 && chunk >= 512 && chunk <= 16384 &&
                                chunk % 512 == 0),
                "set_ht_pull_staging_override: ", stages, " x ", chunk,
                " bytes; expected stages <= 0 (off / default) or 2..8 stages of a multiple of 512 "
                "bytes in [512, 16384]");
  g_pull_chunk = chunk;
  g_pull_stages = stages;
}

void set_ht_tuning_override(int num_sms, int dispatch_send_percent, int combine_send_percent) {
  g_num_sms_override = num_sms;
  g_dispatch_send_percent = dispatch_send_percent;
  g_combine_send_percent = combine_send_percent;
}

HtTuning resolve_ht_tuning(int requested_sms, int device_sms, int num_ranks) {
  HtTuning t;
  t.num_sms = g_num_sms_override > 0 ? g_num_sms_override.load()
              : requested_sms > 0    ? requested_sms
                                     : 16;
  t.num_sms = std::max(2, std::min(t.num_sms, std::max(2, device_sms)));
  auto split = [&](int percent) {
    // 38% senders measured best at 16 and 24 SMs (docs/perf-cuda-ht.md, runs 2 and 5): the
    // receivers also copy the rows a rank keeps, so both sides then take about as long.
    const int p = percent > 0 ? percent : 38;
    return std::clamp((t.num_sms * p + 50) / 100, 1, t.num_sms - 1);
  };
  t.dispatch_send_ctas = num_ranks == 1 ? 0 : split(g_dispatch_send_percent.load());
  t.combine_send_ctas = num_ranks == 1 ? 0 : split(g_combine_send_percent.load());
  // ce:kept: the receivers only copy out, so half the CTAs send (docs/perf-cuda-ht.md, run 11).
  const int kept_pct = g_dispatch_send_percent.load() > 0 ? g_dispatch_send_percent.load() : 50;
  t.dispatch_send_ctas_kept = num_ranks == 1 ? 0 : split(kept_pct);
  // Zero-copy: the receivers only wait for the blocks and copy the metadata out, so every CTA
  // sends and then receives (14 senders + 2 receivers measured 204 us bf16 at 16 SMs,
  // docs/perf.md sixth session). A --send-pct override splits them as the other paths do.
  t.dispatch_send_ctas_zero_copy = num_ranks == 1                       ? 0
                                   : g_dispatch_send_percent.load() > 0 ? t.dispatch_send_ctas
                                                                        : t.num_sms;
  return t;
}

// ---- CudaBuffer --------------------------------------------------------------------------------

CudaBuffer::CudaBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config,
                       uint64_t id)
    : BufferImpl(group, shape, config, id) {
  const int R = group.size();
  EPX_CHECK(R <= kMaxHtRanks, ErrorCode::kUnsupported, "Buffer: the group has ", R,
            " ranks; the cuda ht kernels support at most ", kMaxHtRanks);
  device_ = group.transport()->device().index;
  DeviceGuard guard(device_);
  int sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_), "Buffer");
  device_sms_ = sms;
  one_stream_ = group.transport()->ranks_share_device();
  pdl_ = pdl_usable(device_, one_stream_, ht_dispatch_kernel_address());
  tuning_ = resolve_ht_tuning(group.options().num_sms, sms, R);
  timeout_ns_ = static_cast<uint64_t>(group.timeout().count()) * 1000000ull;
  region_ =
      HtRegion::make(shape.hidden, shape.top_k, shape.num_experts, shape.max_tokens_per_rank, R);
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(DeviceErrorRecord),
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 "Buffer");
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_host_, 0),
                 "Buffer");
  *error_host_ = DeviceErrorRecord{};
  const size_t result_bytes =
      sizeof(HtHostResult) + 4 * ht_host_result_words(region_.num_local_experts, R);
  EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&result_host_), result_bytes,
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 "Buffer");
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&result_dev_), result_host_, 0),
                 "Buffer");
  result_host_->ticket = 0;
  if (config.enable_ht) ht_mem_ = group.transport()->allocate(region_.total_bytes);
  if (config.enable_ll) ll_ = cuda_ll_create(group, shape);  // collective, like the ht region
#ifdef EPX_HT_TRACE
  trace_ = g_ht_traces.create(device_, kHtTraceWords);
#endif
}

#ifdef EPX_HT_TRACE
uint64_t* ht_trace_buffer(int device) {
  return g_ht_traces.newest(device);
}
uint64_t* ht_trace_buffer_of_thread() {
  return g_ht_traces.newest_of_thread();
}
#endif

CudaBuffer::~CudaBuffer() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  // Kernels are bounded, so this returns; then nothing of this rank uses the region. Local: the
  // transport frees the region once every rank released it (no barrier, so ranks may destroy
  // their Buffers at different times, as Python's garbage collector does) — except in the
  // one-GPU test mode (Transport::destruction_barrier).
  cudaDeviceSynchronize();
  if (!broken_ && ht_mem_) group.transport()->destruction_barrier("Buffer destruction");
  ht_mem_.reset();
  for (cudaStream_t& s : engine_stream_)
    if (s) cudaStreamDestroy(s);
  for (cudaEvent_t& e : engine_event_)
    if (e) cudaEventDestroy(e);
  if (split_stream_) cudaStreamDestroy(split_stream_);
  for (cudaEvent_t& e : split_event_)
    if (e) cudaEventDestroy(e);
  if (error_host_) cudaFreeHost(error_host_);
  if (result_host_) cudaFreeHost(result_host_);
#ifdef EPX_HT_TRACE
  g_ht_traces.destroy(device_, trace_);
#endif
  cudaSetDevice(previous);
}

size_t CudaBuffer::bytes_allocated() const {
  return (ht_mem_ ? ht_mem_->bytes() : 0) + cuda_ll_allocated(ll_.get());
}

// HtRegion::make reserves 64 bytes for the state at state_off.
static_assert(sizeof(DeviceState) <= 64, "DeviceState outgrew its 64 bytes in HtRegion");

DeviceState* CudaBuffer::device_state() const {
  return reinterpret_cast<DeviceState*>(ht_local() + region_.state_off);
}

void CudaBuffer::require_usable(const char* op) const {
  EPX_CHECK(!broken_, ErrorCode::kInternal, op,
            ": this buffer is unusable after an earlier error (", broken_why_, ")");
  EPX_CHECK(ht_mem_ != nullptr, ErrorCode::kInvalidArgument, op,
            ": this buffer was created with BufferConfig::enable_ht = false, expected true");
}

// ", flag W wanted, V seen" for a flag wait's timeout (wait_flag packs both into b); "" for the
// bulk-copy wait, whose b is a parity.
static std::string timeout_flag_values(const DeviceErrorRecord& e) {
  if (e.a == kWaitBulkCopy) return "";
  const auto b = static_cast<uint64_t>(e.b);
  return cat(", flag ", b >> 32, " wanted, ", b & 0xffffffffu, " seen");
}

void CudaBuffer::check() {
  if (broken_) require_usable("check");
  if (ll_) cuda_ll_check(*ll_);
  volatile DeviceErrorRecord* rec = error_host_;
  if (rec->code == kDevErrNone) return;
  std::atomic_thread_fence(std::memory_order_acquire);
  const DeviceErrorRecord e{rec->code, rec->op, rec->rank, rec->peer, rec->a, rec->b};
  raise_device_error();  // clears the record; may mark the buffer broken
  const char* op = device_op_name(e.op);
  const int64_t E = shape.num_experts;
  switch (e.code) {
    case kDevErrTimeout:
      throw_error(ErrorCode::kTimeout,
                  cat(op, ": rank ", e.rank, " waited ", group.timeout().count(), " ms for ",
                      device_wait_name(static_cast<uint32_t>(e.a)), " (rank ", e.peer,
                      timeout_flag_values(e),
                      "); the buffer is unusable (every rank must call the "
                      "same operations in the same order)"));
    case kDevErrBadExpert:
      throw_error(
          ErrorCode::kInvalidArgument,
          cat(op, ": argument 'topk_idx' has value ", e.b, " at [", e.a / 64, ", ", e.a % 64,
              "] (found on the device of rank ", e.rank, "), expected -1 or an expert id in [0, ",
              E, "); that selection was dropped"));
    case kDevErrOutOfCapacity:
      throw_error(
          ErrorCode::kOutOfCapacity,
          cat(op, ": rank ", e.rank, " receives N = ", e.a,
              " tokens, more than argument 'num_worst_tokens' = ", e.b,
              "; expected num_worst_tokens >= N (found on the device; rows past it were not "
              "written)"));
    case kDevErrHtCallDiffers:
      throw_error(ErrorCode::kInvalidArgument, ht_call_differs_message(e));
    default:
      throw_error(ErrorCode::kInternal, cat(op, ": unknown device error code ", e.code));
  }
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
    if (part(theirs, 17, 1) != part(mine, 17, 1))
      add(both("argument 'topk_weights' (given or absent)", part(theirs, 17, 1), part(mine, 17, 1),
               [](int64_t v) { return std::string(v ? "given" : "absent"); }));
  } else if (field == kHtCallWorst) {
    add(both("argument 'num_worst_tokens'", theirs, mine, show_int));
  } else {
    add(both("argument 'expert_alignment'", theirs, mine, show_int));
  }
  return cat("ht_dispatch: ", what,
             "; expected the same on every rank (found in the count exchange; the outputs of a "
             "worst-case dispatch are undefined)");
}

void CudaBuffer::raise_device_error() {
  volatile DeviceErrorRecord* rec = error_host_;
  const uint32_t code = rec->code;
  if (code == kDevErrTimeout) {
    broken_ = true;
    broken_why_ = "a device wait timed out";
    return;  // the device state is inconsistent; keep the record
  }
  rearm_device_error(rec, &device_state()->error_claim, device_);
}

// ll: validated by epx::Buffer (enable_ll, so ll_ exists); the mode lives in ll.cu.
LlDispatchResult CudaBuffer::ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  return cuda_ll_dispatch(*ll_, args, alloc, id);
}
LlCombineResult CudaBuffer::ll_combine(const LlCombineArgs& args, const Allocator& alloc) {
  return cuda_ll_combine(*ll_, args, alloc);
}
TensorView CudaBuffer::ll_next_combine_buffer(const LlHandle& handle) {
  return cuda_ll_next_combine_buffer(*ll_, handle);
}
void CudaBuffer::ll_clean() {
  cuda_ll_clean(*ll_);
}

// ---- factories and sizing ----------------------------------------------------------------------

std::unique_ptr<BufferImpl> make_cuda_buffer(const Group& group, const MoeShape& shape,
                                             const BufferConfig& config, uint64_t id) {
  EPX_CHECK(group.backend() == Backend::kCuda, ErrorCode::kInvalidArgument,
            "Buffer: the cuda backend needs a cuda group");
  return std::make_unique<CudaBuffer>(group, shape, config, id);
}

std::unique_ptr<A2aImpl> make_cuda_a2a(const Group& group, const A2aShape& shape) {
  std::unique_ptr<A2aImpl> cuda_a2a_create(const Group&, const A2aShape&);  // src/cuda/a2a.cu
  return cuda_a2a_create(group, shape);
}

size_t cuda_ht_bytes(const MoeShape& shape, int num_ranks) {
  return HtRegion::make(shape.hidden, shape.top_k, shape.num_experts, shape.max_tokens_per_rank,
                        num_ranks)
      .total_bytes;
}
size_t cuda_ll_bytes(const MoeShape& shape, int num_ranks) {
  return cuda_ll_layout_bytes(shape, num_ranks);
}
size_t cuda_a2a_bytes(const A2aShape& shape, int num_ranks) {
  size_t cuda_a2a_layout_bytes(const A2aShape&, int);  // src/cuda/a2a.cu
  return cuda_a2a_layout_bytes(shape, num_ranks);
}

}  // namespace epx::detail
