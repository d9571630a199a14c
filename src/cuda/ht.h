// src/cuda/ht.h — CudaHt, the cuda backend of the ht mode (host side): the symmetric region and
// the device-error record (its DeviceObject, device_object.h), the count-exchange result in
// mapped host memory, the copy engines' side streams, and the launchers of ht_layout /
// ht_dispatch / ht_combine (src/cuda/ht.cu). CudaBuffer
// (cuda_buffer.h) owns one when BufferConfig::enable_ht and forwards its ht_* methods here.
//
// Kernels: kernels/ht/*.cuh (region layout: ht_region.cuh; protocols: notify.cuh, dispatch.cuh,
// combine.cuh, combine_staged.cuh), launched through ht_launch.h; the copy engines' part:
// ht_copy_engine.h; tuning: tuning.h.
//
// Errors found on the device (timeouts, out-of-range expert ids, worst-case overflow) are raised
// by the next host call on the buffer or by check(). After a timeout ht is unusable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/buffer_impl.h"
#include "cuda/device_error.h"
#include "cuda/device_object.h"
#include "cuda/ht_copy_engine.h"
#include "cuda/kernels/ht/ht_region.cuh"
#include "cuda/tuning.h"
#include "transport/transport.h"

namespace epx::detail {

// cuda/kernels/ht/ht_params.cuh (device code: not included here)
struct HtNotifyParams;
struct HtSymm;

// What the host decided for one dispatch before allocating its outputs.
struct HtDispatchPlan {
  bool cached = false;       // routing from the handle: no count exchange, only x (and scales)
  bool worst_case = false;   // num_worst_tokens rows, no host wait
  bool zero_copy = false;    // recv_x (and scales) are views of the region
  bool engine_kept = false;  // the copy engines copy the kept rows (the handle's copy plan)
  int64_t num_rows = 0;      // rows of the outputs: N, or num_worst_tokens
  int num_scales = 0;        // scale words per row (fp8 with scales), else 0
};

class CudaHt {
 public:
  // Collective (allocates the symmetric region).
  CudaHt(const Group& group, const MoeShape& shape, uint64_t buffer_id);
  ~CudaHt();
  CudaHt(const CudaHt&) = delete;
  CudaHt& operator=(const CudaHt&) = delete;

  size_t bytes() const { return dev_.bytes(); }
  const HtTuning& tuning() const { return tuning_; }
  // Internal error naming `op` when an earlier timeout left ht unusable.
  void require_usable(const char* op) const { dev_.require_usable(op); }
  // Raises the error a kernel recorded, if any (clears it unless it was a timeout).
  void check();
  // Collective: usable again after a timeout (Buffer::reset).
  void reset();

  HtLayout layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc);
  // The layout of `num_ranks` ranks and `num_experts` experts (local, no communication): the
  // hierarchical ht's (ht_nodes.h) over the whole group, from its node-local CudaHt.
  HtLayout layout_of(const TensorView& topk_idx, Stream stream, const Allocator& alloc,
                     int num_ranks, int num_experts);
  HtDispatchResult dispatch(const HtDispatchArgs& args, const Allocator& alloc);
  HtCombineResult combine(const HtCombineArgs& args, const Allocator& alloc);
  // The combine's kernel-sender path with the sums unrounded: out [T, H] and combined_weights
  // [T, K] (with args.topk_weights) float32, this rank's memory (the hierarchical ht's node-local
  // partials, ht_nodes.h). Not zero-copy.
  void combine_partial(const HtCombineArgs& args, float* out, float* combined_weights);
  TensorView combine_buffer(const HtHandle& handle) const;

 private:
  // Dispatch steps (ht.cu): the handle of the routing (count exchange or cached), the plan, the
  // outputs, the kernel.
  HtHandle cached_handle(const HtDispatchArgs& args) const;
  HtHandle exchange_counts(const HtDispatchArgs& args, const Allocator& alloc, cudaStream_t stream,
                           std::vector<int>& num_recv_per_expert);
  void wait_count_exchange(uint32_t ticket, cudaStream_t stream);
  HtDispatchPlan plan_dispatch(const HtDispatchArgs& args, const HtHandle& h) const;
  void allocate_outputs(const HtDispatchArgs& args, const HtDispatchPlan& plan,
                        const Allocator& alloc, HtDispatchResult& res) const;
  void launch_dispatch(const HtDispatchArgs& args, const HtDispatchPlan& plan,
                       HtDispatchResult& res, cudaStream_t stream);
  // Combine paths (ht.cu).
  void check_combine_handle(const HtHandle& h) const;
  HtCombineParams combine_params(const HtCombineArgs& args, char* out, float* combined_weights,
                                 int& vb) const;
  bool engine_combine_pays(const HtHandle& h) const;
  void combine_pull(const HtCombineArgs& args, HtCombineParams& p, int vb, cudaStream_t stream);
  void combine_engine_push(const HtHandle& h, HtCombineParams& p, int vb, cudaStream_t stream);
  // Pieces every launch shares.
  char* local() const { return dev_.local(); }
  HtSymm symm() const;
  // What every ht kernel's params carry from this object: symm, wait context of `op`, PDL, the
  // trace buffer and (diagnostics builds) the ablation bits. Defined in ht.cu.
  template <typename Params>
  void fill_launch_common(Params& p, uint32_t op) const;
  void fill_notify(HtNotifyParams& p, const TensorView& topk_idx, int64_t T) const;
  void check_outside_region(const TensorView& t, const char* op, const char* name) const;
  const HtCopyPlan* copy_plan(const HtHandle& h) const;

  Group group_;
  MoeShape shape_;
  uint64_t buffer_id_ = 0;
  // The device, the symmetric region, the error record, unusable after a timeout; closed first
  // in ~CudaHt.
  DeviceObject dev_;
  bool one_stream_ = false;  // ranks share the GPU (one-GPU test mode)
  bool pdl_ = false;  // kernels with programmatic dependent launch (cuda/launch.h: EPX_PDL, sm_90,
                      // never when one_stream_: waiting CTAs would hold a peer's SMs)
  // Who may use the copy engines (side streams): where ranks have GPUs of their own, the kept
  // rows and combine's pushes (ht_kept_copies_pay, ht_engine_combine_pays decide per call). In
  // the one-GPU test mode the kernels move every row: work on a side stream that the driver put
  // in the same hardware queue as a peer's stream waits behind that peer's kernels (a kept-row
  // copy behind a peer's kernel of the next op, which waits for this rank's next op, which waits
  // for the copy, stalls until the timeout) — except with EPX_ONE_GPU_SIDE_STREAMS=1 and room
  // for five hardware queues per rank (core/env.h), where the kept rows go by copy engine (tests
  // of that path); combine's pushes never there (their arrive steps need SMs the peers hold).
  bool engine_kept_ = false;
  bool engine_combine_ = false;
  HtTuning tuning_;
  HtRegion region_;
  HtHostResult* result_host_ = nullptr;  // mapped pinned memory
  HtHostResult* result_dev_ = nullptr;
#ifdef EPX_HT_TRACE
  uint64_t* trace_ = nullptr;  // kernels/ht/trace.cuh: kHtTraceWords, device memory
#endif
  uint32_t ticket_ = 0;  // of the last exact-mode count exchange
  HtCopyEngines engines_;
};

}  // namespace epx::detail
