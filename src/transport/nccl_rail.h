// src/transport/nccl_rail.h — the NCCL send/recv rail (rail.h's seam, docs/design.md §13).
// CUDA builds only (no stub): implemented in nccl_rail.cc; nothing in a cpu build calls it.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "transport/rail.h"

namespace epx::detail {

// Splits `parent_comm` (an ncclComm_t of the whole group, ranks node-major, bound to
// `cuda_device`) into this rank's rail communicator (rail_split(): the ranks of this local index,
// ranked by node) and returns the rail on it, which owns it. Collective over the parent.
// exchange() posts plan_rail_exchange()'s operations as one group of ncclSend / ncclRecv of
// uint8 on `stream` (capturable in a CUDA graph), from and into the caller's memory (no staging:
// bytes_allocated() is 0); its host call is bounded by `timeout` (a Watchdog aborts the
// communicator and exchange() raises Timeout). What NCCL's kernels wait for on the device is
// bounded by the caller (RailTransport::abort). reset() has nothing to renumber: the algorithms'
// chunks carry their source's stamp, which is where ranks out of step show.
std::unique_ptr<RailTransport> make_nccl_rail(void* parent_comm, Topology topology,
                                              size_t max_chunk_bytes, int cuda_device,
                                              std::chrono::milliseconds timeout);

}  // namespace epx::detail
