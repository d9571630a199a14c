// src/cuda/ht_copy_engine.cu — the copy engines' part of the cuda ht mode (ht_copy_engine.h):
// the copy plan from the count exchange's words, the copy calls, and the side streams.
#include "cuda/ht_copy_engine.h"

#include <algorithm>
#include <span>
#include <vector>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/ht_launch.h"
#include "cuda/tuning.h"

namespace epx::detail {

// The count exchange lists every kept run the copy engines may take.
static_assert(kHtHostKeptRuns >= static_cast<int>(kHtKeptCopyMaxRuns),
              "the count exchange lists every kept run the copy engines may take");

std::shared_ptr<HtCopyPlan> make_kept_plan(const volatile int32_t* words, int64_t T, int R,
                                           int me) {
  auto plan = std::make_shared<HtCopyPlan>();
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
  plan->num_kept_runs = static_cast<size_t>(num_starts);
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
    plan->kept.push_back({starts[i], j, n});
    j += n;
  }
  EPX_CHECK(j == rows_between(plan->rank_prefix_matrix.data(), R, me, me), ErrorCode::kInternal,
            "ht_dispatch: the kept runs hold ", j, " tokens, the prefix matrix says ",
            rows_between(plan->rank_prefix_matrix.data(), R, me, me),
            ": inconsistent count-exchange result");
  return plan;
}

void CopyList::issue(cudaStream_t stream, const char* op) const {
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

namespace {

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

HtCopyEngines::~HtCopyEngines() {
  destroy();
}

void HtCopyEngines::destroy() {
  for (cudaStream_t& s : stream_) {
    if (s) cudaStreamDestroy(s);
    s = nullptr;
  }
  for (cudaEvent_t& e : event_) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  }
}

void HtCopyEngines::ensure_streams() {
  if (!event_[2]) create_streams(stream_, event_, "ht: copy-engine streams");
}

void HtCopyEngines::fork(cudaStream_t stream, const char* op) {
  ensure_streams();
  EPX_CUDA_CHECK(cudaEventRecord(event_[0], stream), op);
}

void HtCopyEngines::copy_kept_rows(const HtCopyPlan& plan, const HtDispatchParams& p,
                                   cudaStream_t stream, bool skip) {
  const int R = p.num_ranks, me = p.rank;
  cudaStream_t kept = stream_[0];
  EPX_CUDA_CHECK(cudaStreamWaitEvent(kept, event_[0], 0), "ht_dispatch");
  CopyList self;
  const int64_t kept_base = prefix_before(plan.rank_prefix_matrix.data(), R, me, me);
  const auto rb = static_cast<size_t>(p.row_bytes);
  for (const HtCopyPlan::Run& run : plan.kept) {
    // x rows [t0, t0 + n) as one block to the consecutive rows of recv_x (row_bytes pitch).
    if (run.n <= 0) continue;
    self.add(p.recv_x + (kept_base + run.j0) * p.row_bytes, rb, p.x + run.t0 * p.x_stride,
             static_cast<size_t>(p.x_stride), rb, static_cast<size_t>(run.n));
  }
  JoinOnUnwind unwind{kept, stream, event_[1]};
  if (!skip) self.issue(kept, "ht_dispatch: kept-row copy");
  EPX_CUDA_CHECK(cudaEventRecord(event_[1], kept), "ht_dispatch");
  unwind.armed = false;
  EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, event_[1], 0), "ht_dispatch");
}

void HtCopyEngines::push_combine_rows(const HtCopyPlan& plan, const HtCombineParams& p,
                                      const HtEngineSyncParams& sync, cudaStream_t stream,
                                      bool skip) {
  const char* what = "ht_combine: copy-engine row push";
  const int R = sync.num_ranks, me = sync.rank;
  const int32_t* rpm = plan.rank_prefix_matrix.data();
  const HtRegion& region = sync.symm.region;
  cudaStream_t side = stream_[1];
  EPX_CUDA_CHECK(cudaStreamWaitEvent(side, event_[0], 0), what);
  JoinOnUnwind join{side, stream, event_[2]};
  HtEngineSyncParams sp = sync;
  for (int c = 0; c < kHtEngineChunks; ++c) {
    CopyList rows;
    for (int s = 0; s < R && !skip; ++s) {
      if (s == me) continue;
      // The rows this rank received from s go back to row j of s's slot for this rank.
      const int64_t excl = prefix_before(rpm, R, s, me);
      const int64_t n = rows_between(rpm, R, s, me);
      const int64_t lo = engine_chunk_begin(n, c);
      const int64_t hi = std::min(engine_chunk_begin(n, c + 1), p.num_y_rows - excl);
      if (hi <= lo) continue;
      rows.add(region.x_row(sp.symm.peers[s], HtRegion::slot_of(me, s), lo),
               static_cast<size_t>(region.x_row_bytes), p.y + (excl + lo) * p.y_stride,
               static_cast<size_t>(p.y_stride), static_cast<size_t>(p.row_bytes),
               static_cast<size_t>(hi - lo));
    }
    rows.issue(side, what);
    sp.step = kEngineArrive;
    sp.chunk = c;
    launch_ht_engine_sync(sp, side);
  }
  join.armed = false;
  EPX_CUDA_CHECK(cudaEventRecord(event_[2], side), what);
  EPX_CUDA_CHECK(cudaStreamWaitEvent(stream, event_[2], 0), what);
}

}  // namespace epx::detail
