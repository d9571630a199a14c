// src/transport/nccl_transport.h — the cuda backend's transport factory (NCCL communicator +
// symmetric windows + LSA pointers). Implemented in nccl_transport.cc when built with CUDA and
// NCCL; otherwise src/core/cuda_stub.cc throws Unsupported.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "epx/group.h"
#include "transport/rail.h"
#include "transport/transport.h"

namespace epx::detail {

UniqueId nccl_new_unique_id();
std::shared_ptr<Transport> make_nccl_transport(int rank, int size, const UniqueId& id,
                                               int cuda_device, std::chrono::milliseconds timeout);
std::shared_ptr<Transport> make_nccl_transport_from_comm(void* nccl_comm, int cuda_device,
                                                         std::chrono::milliseconds timeout);

// CUDA builds only (no stub): the communicator of this rank's node (`node` true) or of its rail
// (rail_split()'s colors and keys) split from `parent_comm` (an ncclComm_t of the whole group,
// ranks node-major), bound to `cuda_device`; `*rank` gets this rank's rank in the parent. Checks
// the parent's size and the new communicator's rank and size (Internal naming `what`). The
// caller owns the returned ncclComm_t. Collective over the parent.
void* nccl_split(void* parent_comm, Topology topology, bool node, int cuda_device, int* rank,
                 const char* what);

// CUDA builds only (no stub), for the hierarchical path (docs/design.md §13): the transport of
// this rank's node, on the communicator split from `parent_comm` (an ncclComm_t of the whole
// group, ranks node-major) with rail_split()'s node color and key, which the transport owns. Its
// LSA windows then span one node: NCCL 2.28.9's ncclDevCommCreate turns GIN on for a
// communicator that spans nodes. Collective over the parent communicator.
std::shared_ptr<Transport> make_nccl_node_transport(void* parent_comm, Topology topology,
                                                    int cuda_device,
                                                    std::chrono::milliseconds timeout);

// CUDA builds only (no stub): the ncclComm_t behind a cuda group's transport (nullptr for any
// other transport). For baselines that need NCCL collectives on the group's communicator.
void* nccl_comm_of(const Transport& transport);

// CUDA builds only (no stub), for tests: the symmetric windows a cuda group's transport still
// holds (its own barrier and release-board windows included), released or not; -1 for any other
// transport. Released windows are freed by the next allocation every rank agreed on.
int64_t nccl_window_count(const Transport& transport);

}  // namespace epx::detail
