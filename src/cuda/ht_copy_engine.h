// src/cuda/ht_copy_engine.h — the copy engines' part of the cuda ht mode (host side): which rows
// they move (HtCopyPlan, from the count exchange), the copies themselves as cudaMemcpy(2D)Async
// calls (CopyList), and the side streams they run on beside the kernels (HtCopyEngines).
//
//   dispatch  the rows a rank keeps, x -> recv_x (never in the symmetric region), one copy per
//             run of consecutive kept tokens on side stream 0, forked from the caller's stream
//             before the dispatch kernel (which pushes to the peers and copies out meanwhile) and
//             joined after it; where the kept tokens form at most kHtKeptCopyMaxRuns runs
//   combine   where ht_engine_combine_pays: every y block this rank sends back, into the peers'
//             slots, in kHtEngineChunks chunks on side stream 1 beside the combine kernel, each
//             chunk followed by a one-warp arrive step the peers' reducers wait for
// Every launch and copy is queued on streams ordered after the caller's; nothing synchronises the
// device. After a timeout, copies already queued still land in the peers' slots (a copy cannot be
// cancelled; the group is failing).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace epx::detail {

// cuda/kernels/ht/ht_params.cuh (device code: not included here)
struct HtDispatchParams;
struct HtCombineParams;
struct HtEngineSyncParams;

// What the host learnt from one exact-mode count exchange (HtHostResult's words), kept in the
// handle (HtHandle::backend_state) for the cached dispatches and the combine of that handle.
struct HtCopyPlan {
  struct Run {
    int32_t t0, j0, n;  // tokens [t0, t0 + n) are this rank's kept rows [j0, j0 + n)
  };
  std::vector<int32_t> rank_prefix_matrix;  // [R * R], as the handle's tensor
  size_t num_kept_runs = 0;                 // runs of consecutive tokens this rank keeps
  std::vector<Run> kept;  // those runs, ascending; listed only when num_kept_runs <=
                          // kHtHostKeptRuns (else empty: the kernel places the kept rows)
};

// The plan from the count exchange's mapped-host words after the per-expert counts
// (HtHostResult): the prefix matrix [R * R], the kept runs' and ends' counts, then up to
// kHtHostKeptRuns starts and as many ends, each in any order. Internal error for words the
// count exchange cannot have written.
std::shared_ptr<HtCopyPlan> make_kept_plan(const volatile int32_t* words, int64_t T, int R, int me);

// Copies issued together: blocks of `height` rows of `width` bytes, rows `spitch` / `dpitch`
// apart; one cudaMemcpyAsync for a contiguous block, one cudaMemcpy2DAsync for a pitched one,
// one call per row where the source pitch is below the width (a stride-0 or overlapping view).
// (2 x H200, 17 runs: ~105 µs of host time per call with one call per run, ~140 µs through one
// cudaMemcpyBatchAsync.)
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
  void issue(cudaStream_t stream, const char* op) const;
};

// The side streams of one buffer's ht mode and the events that fork them from and join them to
// the caller's stream; created on first use (a failure creates none and throws; the next call
// retries), destroyed with the buffer.
class HtCopyEngines {
 public:
  HtCopyEngines() = default;
  ~HtCopyEngines();
  HtCopyEngines(const HtCopyEngines&) = delete;
  HtCopyEngines& operator=(const HtCopyEngines&) = delete;

  // Destroys the streams and events (no-throw; the destructor's work, for owners that must do it
  // with their device current).
  void destroy();
  // Creates the streams and events unless they exist (before anything is queued that the copies
  // must follow, so a failure leaves no peer waiting).
  void ensure_streams();
  // The fork point of the copies below: records on `stream` (before the kernel they run beside).
  void fork(cudaStream_t stream, const char* op);
  // Dispatch: the kept rows of `plan` (all listed), x -> p.recv_x, on side stream 0 from the fork
  // point; `stream` then waits for them (issued after the kernel's launch, so the host's copy
  // calls do not delay it). `skip`: queue no copies (an ablation; the streams still fork and join).
  void copy_kept_rows(const HtCopyPlan& plan, const HtDispatchParams& p, cudaStream_t stream,
                      bool skip);
  // Combine: the y rows this rank received from each peer s (p.y) back into s's slot for this
  // rank (sp.symm), in kHtEngineChunks chunks on side stream 1 from the fork point, each followed
  // by its arrive step (sp: the op's sync parameters); `stream` then waits for them. `skip`: no
  // row copies (an ablation; the arrive steps still run).
  void push_combine_rows(const HtCopyPlan& plan, const HtCombineParams& p,
                         const HtEngineSyncParams& sp, cudaStream_t stream, bool skip);

 private:
  cudaStream_t stream_[2] = {nullptr, nullptr};         // 0: kept rows, 1: combine pushes
  cudaEvent_t event_[3] = {nullptr, nullptr, nullptr};  // fork, kept rows done, pushes done
};

}  // namespace epx::detail
