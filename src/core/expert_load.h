// src/core/expert_load.h — expert-load recording for the Dispatcher (docs/semantics.md §7): per
// local expert, the received tokens that selected it, accumulated over dispatches (a token that
// selected the same local expert several times counts once), readable and resettable.
//
// Counts from cpu tensors accumulate in a host int64 [L]; counts from cuda tensors accumulate in
// a device int64 [L] (allocated at construction for a cuda device, else on the first cuda tensor
// seen, on its device) by the kernels of
// src/cuda/quant.cu, queued on the caller's stream — nothing waits for the device except read().
// read() returns the sum of both (one Dispatcher uses one backend, so one of them is zero).
#pragma once

#include <cstdint>
#include <vector>

#include "epx/tensor.h"

namespace epx::detail {

class ExpertLoad {
 public:
  // With a cuda `device`, the device counter is allocated and zeroed here (a host wait), so no
  // dispatch allocates: recording is then CUDA-graph capturable. Otherwise it is allocated on
  // the first cuda tensor seen (zeroed on that call's stream: not inside a capture).
  explicit ExpertLoad(int num_local_experts, Device device = Device::cpu());

  int num_local_experts() const { return num_local_experts_; }

  // ht: ids [rows, K] int64/int32, local expert ids in [0, L) or -1 (rows past N in worst-case
  // mode are all -1).
  void add_local_ids(const TensorView& ids, Stream stream);
  // a2a: ids [R, M, K] int32 global expert ids (padding rows -1), counts [R] int32 received rows
  // per source (same device); ids of experts on `rank` count as local expert id % L.
  void add_global_ids(const TensorView& ids, const TensorView& counts, int rank, Stream stream);
  // ll: counts [L] int32 rows per local expert (each row is one token for one expert).
  void add_counts(const TensorView& counts, Stream stream);

  // [L] host copy. With device counts it synchronises `stream` (a host wait for the kernels
  // queued on it, the recording ones included).
  std::vector<int64_t> read(Stream stream) const;
  // Zeroes both counters (the device one with a kernel-ordered memset on `stream`).
  void reset(Stream stream);

 private:
  // The device counter for tensors on `device` (allocated and zeroed on first use).
  const Tensor& device_counter(const Device& device, Stream stream, const char* op);

  int num_local_experts_;
  std::vector<int64_t> host_;
  Tensor device_;  // int64 [L] on the first cuda device seen (undefined before)
};

}  // namespace epx::detail
