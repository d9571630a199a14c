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
//     pack (kernels/ht/nodes_pack.cuh) -> rail: chunk of C = max_tokens_per_rank token slots to
//     every (m, g) -> one node-local dispatch per source node m = 0 .. N - 1, in node order
//     (m = n: this rank's tokens; else the chunk received from (m, g)): block m of the outputs
//     holds the rows of the sources (m, 0 .. G - 1), ordered (source, token), so the blocks
//     concatenated are in the order of docs/semantics.md §1.2 with no reordering pass; exact
//     mode waits on the host once per block (each node-local count exchange) -> the blocks
//     copied into the outputs -> exact: this node's columns of the count matrix over the rail,
//     the handle's rank_prefix_matrix, is_token_in_rank and send_pos (the flat ones).
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
#include "cuda/nodes.h"
#include "transport/rail.h"

namespace epx::detail {

struct HtNodesChunk;  // kernels/ht/nodes_pack.cuh

// Symmetric bytes per rank of the hierarchical ht (N > 1 nodes of R / N ranks).
size_t cuda_ht_nodes_bytes(const MoeShape& shape, int num_ranks, int num_nodes);

class CudaHtNodes : private VirtualNodes {
 public:
  // Collective over the group (creates the node groups, the node-local CudaHt, the rail and the
  // scratch allocation). The group shares one GPU (else Unsupported).
  CudaHtNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id);

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

  std::unique_ptr<CudaHt> ht_;  // the node-local ht over node_group_
  // Scratch behind the slots (a dispatch chunk or a combine partial each): own_ (this node's
  // partial [C, H] f32 and weights [C, K] f32), own_ids_ [C, K] i32, cols_ [R, G] i32 sent and
  // [N - 1][R, G] received.
  float* own_ = nullptr;
  float* own_w_ = nullptr;
  int32_t* own_ids_ = nullptr;
  int32_t* cols_ = nullptr;
  char* recv_cols_ = nullptr;
};

}  // namespace epx::detail
