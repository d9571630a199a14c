// src/transport/device_copy_rail.h — the device-copy rail (rail.h's seam, docs/design.md §13.1):
// the rail of "virtual nodes" where every rank shares one GPU (Group::cuda_shared_device), so
// the cuda backend's hierarchical path runs on one GPU through the same scheduling code as over
// the NCCL rail, its send / receive replaced by device copies. CUDA builds only (no stub):
// implemented in src/cuda/device_copy_rail.cu, kernel in src/cuda/kernels/rail/device_copy.cuh.
#pragma once

#include <cstddef>
#include <memory>

#include "epx/group.h"
#include "transport/rail.h"

namespace epx::detail {

// Collective over `group` (a small symmetric region of control words; no staging: the receiver
// copies straight from its partner's chunk). `topology` splits the group's ranks into nodes (it
// need not be the group's own: a one-node group may carry a rail of any split of its ranks, as
// the rail's GPU test does). The ranks must share one GPU (else Unsupported naming why).
// exchange() checks the chunks (plan_rail_exchange) and launches one kernel on the caller's
// stream: no host synchronisation, capturable in a CUDA graph (the exchange number lives on the
// device, so a replay is the next exchange). Its waits are bounded by the group's timeout; what
// the kernel finds — a wait timed out (Timeout), a partner at another exchange or leg
// (OutOfStep), a partner's chunk of another size (Internal) — is raised by check() or the next
// exchange(), and leaves the rail unusable (OutOfStep) until reset() on every rank (after the
// owner's device synchronisation and resync; the rail's reset itself is local: it zeroes the
// control words). abort() refuses later exchanges (Internal) until reset().
std::unique_ptr<RailTransport> make_device_copy_rail(const Group& group, Topology topology,
                                                     size_t max_chunk_bytes);
// The symmetric bytes per rank one takes (its control words; what bytes_allocated() returns).
size_t device_copy_rail_bytes();

}  // namespace epx::detail
