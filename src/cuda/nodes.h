// src/cuda/nodes.h — what the cuda ht and ll across virtual nodes share (ht_nodes.h,
// ll_nodes.h; docs/design.md §13.1): the checks, the node group, the rail leg and reset, the
// handle's state, and VirtualNodes, the base of CudaHtNodes and CudaLlNodes. Defined in
// ht_nodes.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "transport/rail.h"

namespace epx::detail {

class SymmetricMemory;
struct HtNodesPackParams;  // kernels/ht/nodes_pack.cuh

// Unsupported unless the ranks of `group` share one GPU (the virtual nodes this path is built
// for), naming `mode` ("ht", "ll") and the topology.
void require_virtual_nodes(const Group& group, const Topology& topology, const char* mode);
// Collective: this rank's node group, a Group::cuda_shared_device over its node's ranks ranked by
// local index (the parent's timeout and num_sms, so every rank of every node stays co-resident),
// its rendezvous name `prefix` + a serial every rank agrees on (rank 0's draw, allgathered).
Group make_virtual_node_group(const Group& group, const Topology& topology, const char* prefix);
// The pack kernel (kernels/ht/nodes_pack.cuh) at the widest vector that x, its stride, row_bytes
// and chunk_stride allow.
void launch_nodes_pack(const HtNodesPackParams& p, int grid, cudaStream_t stream, const char* what);
// One rail leg of rank `node`, `bytes` each way per other node m: the send at send_base + i *
// send_stride, the receive at recv_base + i * recv_stride, i = other_index(m, node).
void nodes_exchange(RailTransport& rail, const Topology& topology, int node, const char* what,
                    size_t bytes, char* send_base, size_t send_stride, char* recv_base,
                    size_t recv_stride, cudaStream_t stream);
// After the node-local reset on every rank: a resync of the whole group, the rail's (local)
// reset, and a closing barrier so no rank posts to a rail not yet reset (named `what`, `done`).
void nodes_reset_rail(const Group& group, RailTransport& rail, const char* what,
                      const char* done);
// The across-node state a dispatch left in a handle (HtHandle / LlHandle::backend_state): its
// N node-local handles (InvalidArgument naming `op` for a handle of another buffer or without).
template <typename State, typename Handle>
const State& nodes_state_of(const Handle& h, uint64_t buffer_id, int num_nodes, const char* op,
                            const char* dispatch) {
  EPX_CHECK_ARG(h.buffer_id == buffer_id, op, ": argument 'handle' comes from buffer ", h.buffer_id,
                ", expected one made by this buffer (", buffer_id, ")");
  const auto* st = static_cast<const State*>(h.backend_state.get());
  EPX_CHECK_ARG(st != nullptr && st->handles.size() == static_cast<size_t>(num_nodes), op,
                ": argument 'handle' carries no across-node routing, expected the handle of an ",
                dispatch, " of this buffer");
  return *st;
}

// What CudaHtNodes and CudaLlNodes hold alike: the group, its topology and this rank's node, the
// node group, the rail and one scratch allocation of the node group's transport (the rail's send
// slots [N - 1], then its receive slots [N - 1], then what the mode lays out behind them). The
// derived class makes its node-local mode between the constructor and open_scratch, on every rank
// in that order (each step is collective). Its members go before these: the node-local mode's
// destruction barrier comes first, so no node peer reads the scratch after it is freed.
class VirtualNodes {
 public:
  VirtualNodes(const VirtualNodes&) = delete;
  VirtualNodes& operator=(const VirtualNodes&) = delete;
  // "across nodes on cuda (N nodes of G ranks)".
  std::string where() const;

 protected:
  // Before any communication, Unsupported naming `mode` ("ht", "ll"): the ranks share one GPU
  // (require_virtual_nodes), at most `max_nodes` nodes (0: any). Then, collective, the node group
  // (make_virtual_node_group with `prefix`).
  VirtualNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id, const char* mode,
               const char* prefix, int max_nodes);
  ~VirtualNodes() = default;
  // Collective: the device-copy rail with chunks of `slot_bytes`, then the zeroed scratch of
  // `total_bytes` (slots first).
  void open_scratch(size_t slot_bytes, size_t total_bytes);
  // The scratch's and the rail's bytes.
  size_t shared_bytes() const;
  char* send_slot(int i) const { return scratch_ + i * slot_bytes_; }
  char* recv_slot(int i) const { return scratch_ + (topology_.num_nodes - 1 + i) * slot_bytes_; }

  Group group_;
  MoeShape shape_;
  uint64_t buffer_id_ = 0;
  Topology topology_;
  int node_ = 0, device_ = 0;
  std::optional<Group> node_group_;  // this node's ranks, ranked by local index
  std::unique_ptr<RailTransport> rail_;
  std::shared_ptr<SymmetricMemory> memory_;
  char* scratch_ = nullptr;
  size_t slot_bytes_ = 0;
};

}  // namespace epx::detail
