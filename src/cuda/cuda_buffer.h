// src/cuda/cuda_buffer.h — the cuda backend behind epx::Buffer.
//
// State per buffer: the ht symmetric region (HtRegion: count slots, block counters, per-source
// row slots; sized from the MoeShape by cuda_ht_bytes), a DeviceErrorRecord and an HtHostResult
// in mapped pinned host memory, and the host ticket of the last exact-mode count exchange.
// Mode code: ht.cu (ht_layout / ht_dispatch / ht_combine launchers); ll.cu (CudaLl: the ll region,
// its state and launchers, created with the buffer when enable_ll).
//
// Errors found on the device (timeouts, out-of-range expert ids, worst-case overflow) are raised
// by the next host call on the buffer or by check(). After a timeout the buffer is unusable.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "core/buffer_impl.h"
#include "cuda/device_error.h"
#include "cuda/kernels/ht/ht_region.cuh"
#include "cuda/tuning.h"
#include "transport/transport.h"

namespace epx::detail {

class CudaLl;             // src/cuda/ll.cu
struct HtDispatchParams;  // cuda/kernels/ht/ht_params.cuh

// Copy-engine dispatch (HtCopyMode::kEngine): what the host learnt from one exact-mode count
// exchange, kept in the handle for cached dispatch. runs[d] lists this rank's tokens that go to
// rank d as runs of consecutive tokens {first token, first row j, count}; j is the row in d's
// slot for this rank (d == rank: the row among the rows this rank keeps).
struct HtCopyPlan {
  struct Run {
    int32_t t0, j0, n;
  };
  std::vector<std::vector<Run>> runs;       // [R]
  std::vector<int32_t> rank_prefix_matrix;  // [R * R], as the handle's tensor
  // Runs of the rows this rank keeps (ht_kept_copies_pay decides on it), and whether runs[d] is
  // known for every d (plain "ce" needs that) or only for this rank (ce:kept from the count
  // exchange's mapped result: runs[rank] listed when kept_runs <= kHtHostKeptRuns, else empty).
  size_t kept_runs = 0;
  bool full = true;
};

// send_pos [T, R] and the prefix matrix (host copies) -> the full plan (src/cuda/ht.cu).
std::shared_ptr<HtCopyPlan> make_copy_plan(const std::vector<int32_t>& send_pos, int64_t T, int R,
                                           int me, std::vector<int32_t> rpm);
// The ce:kept plan from the count exchange's mapped-host words after the per-expert counts
// (HtHostResult): the prefix matrix [R * R], the kept runs' and ends' counts, then up to
// kHtHostKeptRuns starts and as many ends, each in any order (src/cuda/ht.cu).
std::shared_ptr<HtCopyPlan> make_kept_plan(const volatile int32_t* words, int64_t T, int R, int me);

class CudaBuffer final : public BufferImpl {
 public:
  CudaBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config, uint64_t id);
  ~CudaBuffer() override;

  size_t bytes_allocated() const override;
  Device device() const override { return Device::cuda(device_); }
  void check() override;

  HtLayout ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) override;
  HtDispatchResult ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) override;
  HtCombineResult ht_combine(const HtCombineArgs& args, const Allocator& alloc) override;
  TensorView ht_combine_buffer(const HtHandle& handle) const override;

  LlDispatchResult ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) override;
  LlCombineResult ll_combine(const LlCombineArgs& args, const Allocator& alloc) override;
  TensorView ll_next_combine_buffer(const LlHandle& handle) override;
  void ll_clean() override;

  const HtTuning& tuning() const { return tuning_; }

 private:
  // Pieces shared by the ht launchers (ht.cu).
  void require_usable(const char* op) const;
  char* ht_local() const { return static_cast<char*>(ht_mem_->local()); }
  DeviceState* device_state() const;
  void raise_device_error();
  void check_outside_region(const TensorView& t, const char* op, const char* name) const;

  int device_ = 0;
  int device_sms_ = 0;       // multiprocessors of device_
  bool one_stream_ = false;  // ranks share the GPU (one-GPU test mode): copy_config() limits the
                             // copy engines
  bool pdl_ = false;  // ht kernels with programmatic dependent launch (cuda/launch.h: EPX_PDL,
                      // sm_90, never when one_stream_: waiting CTAs would hold a peer's SMs)
  // ht_copy_config(), except when one_stream_: kEngine becomes "ce:kept" (one_gpu_side_streams)
  // or kWarp.
  HtCopyConfig copy_config() const;
  // one_stream_ only: whether the side-stream paths may run (EPX_ONE_GPU_SIDE_STREAMS=1 and a
  // hardware queue for each of a rank's five streams; core/env.h).
  bool one_gpu_side_streams() const;
  HtTuning tuning_;
  uint64_t timeout_ns_ = 0;
  HtRegion region_;
  std::shared_ptr<SymmetricMemory> ht_mem_;
  DeviceErrorRecord* error_host_ = nullptr;  // mapped pinned memory
  DeviceErrorRecord* error_dev_ = nullptr;
  HtHostResult* result_host_ = nullptr;  // mapped pinned memory
  HtHostResult* result_dev_ = nullptr;
#ifdef EPX_HT_TRACE
  uint64_t* trace_ = nullptr;  // kernels/ht/trace.cuh: kHtTraceWords, device memory
#endif
  uint32_t ticket_ = 0;
  bool broken_ = false;
  std::string broken_why_;
  std::shared_ptr<CudaLl> ll_;  // enable_ll: the ll mode (ll.cu)
  // Copy-engine dispatch (ht.cu): side streams for the kept rows and the copy-out, and the
  // events that fork them from and join them to the caller's stream. Created on first use.
  void ensure_engine_streams();
  void engine_copies(const HtCopyPlan& plan, const HtDispatchParams& p, cudaStream_t stream);
  void kept_copies(const HtCopyPlan& plan, const HtDispatchParams& p, cudaStream_t stream,
                   bool join);
  cudaStream_t engine_stream_[2] = {nullptr, nullptr};
  cudaEvent_t engine_event_[3] = {nullptr, nullptr, nullptr};
  // The split exact dispatch (ht.cu, kHtSplitSend): the send kernel's stream, the events that
  // fork it after the count exchange and join it after the receive kernel. Created on first use.
  void ensure_split_stream();
  cudaStream_t split_stream_ = nullptr;
  cudaEvent_t split_event_[2] = {nullptr, nullptr};
};

}  // namespace epx::detail
