// src/cuda/ht_nodes.h — CudaHtNodes, the cuda backend's ht across nodes (docs/design.md §13,
// §13.1), built for "virtual nodes": a Group::cuda_shared_device group with ranks_per_node < R,
// every rank a thread on one GPU, the rail the device-copy rail (device_copy_rail.h).
//
// Rank (n, g) of N nodes x G ranks owns a node-local CudaHt (ht.h) over a group of its node's G
// ranks (the node-local kernels of §7.2, unchanged, with E / N experts), the rail, and a scratch
// allocation (rail chunks, this node's ids and partial). CudaBuffer (cuda_buffer.h) owns one
// instead of a CudaHt when the group spans nodes.
//
//   ht_dispatch (exact, cached)
//     pack (kernels/ht/nodes.cuh) -> rail: chunk of C = max_tokens_per_rank token slots to every
//     (m, g) -> one node-local dispatch per source node m = 0 .. N - 1, in node order (m = n: this
//     rank's tokens; else the chunk received from (m, g)): block m of the outputs holds the rows
//     of the sources (m, 0 .. G - 1), ordered (source, token), so the blocks concatenated are in
//     the order of docs/semantics.md §1.2 with no reordering pass; exact mode waits on the host
//     once per block (each node-local count exchange) -> the blocks copied into the outputs ->
//     exact: this node's columns of the count matrix over the rail, the handle's
//     rank_prefix_matrix, is_token_in_rank and send_pos (the flat ones).
//   ht_combine
//     one node-local combine per source node m of y's block m, float32 out (no rounding): for
//     m = n this rank's partial with the biases, else the partial of (m, g)'s tokens, into the
//     rail chunk for m -> rail -> out = bf16(own + the other nodes' partials, nodes ascending).
// Not built here (Unsupported naming the mode and "across nodes on cuda"): worst-case dispatch,
// zero-copy dispatch and combine, ht_combine_buffer.
// CUDA graphs: the cached dispatch and the combine are stream-ordered and capturable; the exact
// dispatch (host waits) is Unsupported on a capturing stream, raised before anything is enqueued.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "cuda/ht.h"
#include "transport/rail.h"

namespace epx::detail {

class SymmetricMemory;
struct HtNodesChunk;       // kernels/ht/nodes.cuh
struct HtNodesPackParams;  // kernels/ht/nodes.cuh

// Shared with the ll across nodes (ll_nodes.cu):
// Unsupported unless the ranks of `group` share one GPU (the virtual nodes this path is built
// for), naming `mode` ("ht", "ll") and the topology.
void require_virtual_nodes(const Group& group, const Topology& topology, const char* mode);
// Collective: this rank's node group, a Group::cuda_shared_device over its node's ranks ranked by
// local index (the parent's timeout and num_sms, so every rank of every node stays co-resident),
// its rendezvous name `prefix` + a serial every rank agrees on (rank 0's draw, allgathered).
Group make_virtual_node_group(const Group& group, const Topology& topology, const char* prefix);
// The pack kernel (kernels/ht/nodes.cuh) at the widest vector that x, its stride, row_bytes and
// chunk_stride allow.
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

// Symmetric bytes per rank of the hierarchical ht (N > 1 nodes of R / N ranks).
size_t cuda_ht_nodes_bytes(const MoeShape& shape, int num_ranks, int num_nodes);

class CudaHtNodes {
 public:
  // Collective over the group (creates the node groups, the node-local CudaHt, the rail and the
  // scratch allocation). The group shares one GPU (else Unsupported).
  CudaHtNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id);
  ~CudaHtNodes();
  CudaHtNodes(const CudaHtNodes&) = delete;
  CudaHtNodes& operator=(const CudaHtNodes&) = delete;

  size_t bytes() const;
  const HtTuning& tuning() const { return ht_->tuning(); }
  void require_usable(const char* op) const { ht_->require_usable(op); }
  // Raises what the rail or a node-local kernel recorded.
  void check();
  // Collective: the node-local ht and the rail start over (Buffer::reset).
  void reset();

  HtLayout layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc);
  HtDispatchResult dispatch(const HtDispatchArgs& args, const Allocator& alloc);
  HtCombineResult combine(const HtCombineArgs& args, const Allocator& alloc);
  TensorView combine_buffer(const HtHandle& handle) const;  // Unsupported

 private:
  // What a dispatch leaves in HtHandle::backend_state: the N node-local handles and their rows.
  struct State;
  const State& state_of(const HtHandle& h, const char* op) const;
  void pack(const HtDispatchArgs& args, const HtNodesChunk& chunk, cudaStream_t stream);
  void exchange(const char* what, size_t bytes, char* send_base, size_t send_stride,
                char* recv_base, size_t recv_stride, cudaStream_t stream);
  void finish_handle(const HtDispatchArgs& args, const std::vector<HtDispatchResult>& blocks,
                     const Allocator& alloc, HtHandle& h, cudaStream_t stream);
  char* send_slot(int i) const { return scratch_ + i * slot_bytes_; }
  char* recv_slot(int i) const { return scratch_ + (num_other() + i) * slot_bytes_; }
  int num_other() const { return topology_.num_nodes - 1; }

  Group group_;
  MoeShape shape_;
  uint64_t buffer_id_ = 0;
  Topology topology_;
  int node_ = 0, device_ = 0;
  std::optional<Group> node_group_;  // this node's ranks, ranked by local index
  std::unique_ptr<CudaHt> ht_;       // the node-local ht over node_group_
  std::unique_ptr<RailTransport> rail_;
  // Scratch (one allocation of this node's transport): send slots [N - 1], receive slots
  // [N - 1] of slot_bytes_ (a dispatch chunk or a combine partial), then own_ (this node's
  // partial [C, H] f32 and weights [C, K] f32), own_ids_ [C, K] i32, cols_ [R, G] i32 sent and
  // [N - 1][R, G] received.
  std::shared_ptr<SymmetricMemory> memory_;
  char* scratch_ = nullptr;
  size_t slot_bytes_ = 0;
  float* own_ = nullptr;
  float* own_w_ = nullptr;
  int32_t* own_ids_ = nullptr;
  int32_t* cols_ = nullptr;
  char* recv_cols_ = nullptr;
};

}  // namespace epx::detail
