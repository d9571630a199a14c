// bench/baselines.h — what epx-bench measures epx against, on the cuda backend, in the same run:
// NCCL's all-to-all of the same bytes and the NVLink ceiling (an SM-driven peer copy of the same
// bytes through the group's symmetric memory). Also the device timer used for epx's own ops.
// Implemented in baselines_cuda.cu (cuda builds) and baselines_stub.cc (throws Unsupported).
#pragma once

#include <cstddef>
#include <functional>

#include "epx/group.h"

namespace epx::bench {

struct Timing {
  double median_us = 0, min_us = 0, max_us = 0;
};

// How time_on_device times a call (epx-bench --timing):
//   kBarrier    each call alone: a group barrier, then CUDA events right around the call (the
//               call pays its launch and host time, and the ranks' skew after the barrier)
//   kPipelined  after one group barrier, the calls back to back, each between its own pair of
//               events (a call's start event completes when the previous call ends on the
//               stream): the GPU time per call when the host keeps ahead — how DeepEP's tests
//               time their kernels (tests/utils.py bench), so comparable with its figures
enum class TimeMethod { kBarrier, kPipelined };

// Times `body` (which enqueues work on `stream`) `iters` times after `warmup` untimed calls, with
// CUDA events around each call; all ranks of `group` must call together (collective ops inside).
Timing time_on_device(const Group& group, void* stream, int warmup, int iters,
                      const std::function<void()>& body, TimeMethod method = TimeMethod::kBarrier);

// NCCL all-to-all (grouped ncclSend/ncclRecv, bf16) moving `bytes_per_peer` to every other rank.
Timing nccl_all_to_all(const Group& group, size_t bytes_per_peer, int warmup, int iters,
                       TimeMethod method = TimeMethod::kBarrier);

// The NVLink ceiling: `num_sms` CTAs push `bytes_per_peer` into every peer's symmetric memory with
// 16-byte stores, all ranks at once; time per iteration.
Timing nvlink_copy_ceiling(const Group& group, size_t bytes_per_peer, int num_sms, int warmup,
                           int iters, TimeMethod method = TimeMethod::kBarrier);

// Enqueues one empty kernel (one CTA of 32 threads) on `stream`: timed like an op, it gives the
// launch and timing overhead that every op pays, whatever it does.
void launch_empty_kernel(void* stream);

}  // namespace epx::bench
