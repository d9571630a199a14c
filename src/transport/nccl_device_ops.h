// src/transport/nccl_device_ops.h — the two small device programs the NCCL transport needs,
// compiled by nvcc in src/cuda/nccl_device_ops.cu (transport code itself stays plain C++):
//   * reading every peer's LSA pointer of a window once (ncclGetLsaPointer is device-only in 2.28);
//   * the bounded device barrier behind Transport::barrier (flags in a transport-owned window).
#pragma once

#include <cstdint>
#include <vector>

#include "transport/transport.h"

namespace epx::detail {

// out[p] = ncclGetLsaPointer(window, 0, p) for p < num_ranks; `window` is an ncclWindow_t.
// Synchronous (runs on `stream` and waits for it).
void nccl_lsa_pointers(void* window, int num_ranks, void* stream, std::vector<void*>& out);

// Barrier slots, one window per transport: arrive[p] on rank r = the last barrier epoch rank p
// announced to r; aborted[p] = non-zero once rank p called abort().
struct BarrierSlots {
  uint32_t arrive[kMaxRanks];
  uint32_t aborted[kMaxRanks];
};

struct DeviceBarrierArgs {
  BarrierSlots* local = nullptr;
  BarrierSlots* peers[kMaxRanks] = {};  // LSA pointers of every rank's slots
  int rank = 0;
  int size = 1;
  uint32_t epoch = 0;
  uint64_t members = ~uint64_t{0};  // bit p: rank p takes part (others: neither told nor awaited)
  bool abort = false;  // announce abort instead of arriving; do not wait
  uint64_t timeout_ns = 0;
  int32_t* status = nullptr;  // mapped host memory [kMaxRanks]: 0 arrived (or not a member),
                              // 1 timed out, 2 aborted
};

// Enqueues the barrier on `stream` (the caller synchronises and reads `status`).
void launch_device_barrier(const DeviceBarrierArgs& args, void* stream);

}  // namespace epx::detail
