// src/cuda/ll_nodes.h — CudaLlNodes, the cuda backend's ll across nodes (docs/design.md §13.1),
// built for "virtual nodes" as CudaHtNodes (ht_nodes.h): a Group::cuda_shared_device group with
// ranks_per_node < R, every rank a thread on one GPU, the rail the device-copy rail.
//
// Rank (n, g) of N nodes x G ranks owns a node-local CudaLl (ll.cu) over its node's G ranks with
// E / N experts (the ll kernels of one node, unchanged but for the combine's float32-out
// instantiation), the rail, and a scratch allocation (ll_nodes_layout.h).
//
//   ll_dispatch
//     pack (ht's, kernels/ht/nodes.cuh): per other node m a chunk of C = T_max token slots (token
//     t's bf16 row when it selects an expert of m, its ids renumbered to m's experts, -1
//     elsewhere) -> rail to (m, g) -> one node-local dispatch per source node m = 0 .. N - 1 (m =
//     n: this rank's tokens, ids renumbered; fp8 quantised there from the bf16 rows, per row, as
//     the source would) -> assemble (kernels/ll/nodes.cuh): per local expert, block m's rows
//     behind the earlier blocks' = semantics §2's order (source rank, then token).
//     return_recv_hook: the send half is the pack and the rail leg (plus a copy of x, which this
//     node's dispatch reads in the hook: the hook reads only epx's memory, semantics §2.4); the
//     hook runs the N node-local dispatches and the assembly. The rail leg waits for its
//     partner's send half (the same call on (m, g), as a grouped ncclSend / ncclRecv would), not
//     for any hook. Dispatch i uses batch i % 2 of the scratch (received chunks, ids, rows), so
//     two dispatches may wait for their hooks, as on one node; a third into a busy batch, a second
//     hook call, a hook after ll_clean and a combine through the handle of a dispatch whose hook
//     was not called are InvalidArgument.
//   ll_combine (copy mode)
//     pack: this rank's ids renumbered and weights per other node -> rail -> per source node m:
//     y's block m restaged into the node-local combine buffer, a node-local zero-copy combine
//     with float32 out (m = n: this rank's partial; else (m, g)'s tokens' partial into the rail
//     chunk for m) -> rail -> add: bf16(own + the partials of the nodes each token reached,
//     ascending): the cpu backend's order.
// CUDA graphs: both calls are capturable (no host wait; outputs and the node-local temporaries
// from the caller's allocator, nothing else allocated). The rail's exchange numbers and the
// node-local ll's per-slot epochs live on the device; the node-local slots (N dispatches per call,
// the host's parity) are fixed at capture, alike on every rank, so a replay is each slot's next
// operation everywhere (tests/gpu/ll_nodes_gpu_test.cc LlNodesOneGpuGraph).
// Not built here (Unsupported naming the option and "across nodes on cuda"): ll_combine's
// return_recv_hook, use_nvfp4, dispatch_wait_recv_cost_stats, zero-copy (ll_next_combine_buffer),
// use_logfmt, overlap, combine_wait_recv_cost_stats, the rank masks (enable_shrink, Buffer
// refuses it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "core/buffer_impl.h"
#include "cuda/ll_nodes_layout.h"
#include "cuda/nodes.h"
#include "transport/rail.h"

namespace epx::detail {

class CudaLl;

// Symmetric bytes per rank of the hierarchical ll (N > 1 nodes of R / N ranks).
size_t cuda_ll_nodes_bytes(const MoeShape& shape, int num_ranks, int num_nodes);

class CudaLlNodes : private VirtualNodes {
 public:
  // Collective over the group (the node group, the node-local CudaLl, the rail, the scratch).
  // The group shares one GPU (else Unsupported).
  CudaLlNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id);

  size_t bytes() const;
  // Raises what the rail or a node-local kernel recorded.
  void check();
  // Collective: the node-local ll (ll_clean) and the rail start over.
  void clean();

  LlDispatchResult dispatch(const LlDispatchArgs& args, const Allocator& alloc);
  LlCombineResult combine(const LlCombineArgs& args, const Allocator& alloc);
  // Unsupported: "<what> across nodes on cuda (...) is not built; expected <expected>".
  [[noreturn]] void unsupported(const char* what, const char* expected) const;

 private:
  struct State;  // LlHandle::backend_state: the N node-local handles
  // What the dispatch hooks check (a hook holds it weakly: a destroyed buffer shows).
  struct Hooks {
    uint64_t generation = 0;             // bumped by clean(); older hooks refuse to run
    bool in_flight[2] = {false, false};  // per dispatch batch: its hook not yet called
  };
  const State& state_of(const LlHandle& h, const char* op) const;
  // Pack kernel: rows (dispatch) or weights (combine) with renumbered ids per other node into the
  // send slots, this node's renumbered ids into `own_ids`.
  void pack(const TensorView& x, const TensorView& topk_idx, const TensorView& weights,
            int64_t num_tokens, int32_t* own_ids, cudaStream_t stream, const char* what);
  // The rail leg from the send slots into the N - 1 chunks at `recv`, `recv_stride` apart.
  void exchange(const char* what, size_t bytes, char* recv, int64_t recv_stride,
                cudaStream_t stream);
  // The dispatch's receive: one node-local dispatch per source node m (this node's from `a`'s
  // x and batch b's ids, the others' from batch b's chunks), then, with `res`, the assembly into
  // its outputs; the node-local handles into `st`.
  void receive(const LlDispatchArgs& a, int b, const Allocator& alloc, LlDispatchResult* res,
               State& st);
  char* batch(int b) const { return scratch_ + layout_.batch_off + b * layout_.batch_bytes; }

  int grid_ = 1;
  LlNodesLayout layout_;
  std::shared_ptr<CudaLl> ll_;  // the node-local ll over node_group_
  float* own_ = nullptr;
  int32_t* own_ids_ = nullptr;
  uint64_t num_dispatches_ = 0;  // the batch of the next dispatch: its parity
  std::shared_ptr<Hooks> hooks_ = std::make_shared<Hooks>();
};

}  // namespace epx::detail
