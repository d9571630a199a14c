// src/cuda/ll_nodes_layout.h — the host-side sizes of CudaLlNodes (cuda/ll_nodes.h; docs/design.md
// §13.1): its rail chunks and its scratch allocation, the same on every rank. Plain C++ (the CPU
// tier tests it: tests/unit/ll_nodes_layout_test.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace epx::detail {

struct LlNodesLayout {
  // A dispatch chunk: C token slots of bf16 rows [C, 2H] then ids [C, K] i32 (ht's pack layout,
  // HtNodesChunk::make(C, 2H, 0, K, false, false)).
  int64_t dispatch_rows_off = 0, dispatch_ids_off = 0, dispatch_bytes = 0;
  // The combine's first leg: ids [C, K] i32 then weights [C, K] f32
  // (HtNodesChunk::make(C, 0, 0, K, true, false)).
  int64_t route_ids_off = 0, route_weights_off = 0, route_bytes = 0;
  // The combine's second leg: the partial [C, H] f32.
  int64_t partial_bytes = 0;
  // One rail slot holds the largest of the three. The scratch: N - 1 send slots, N - 1 receive
  // slots (the combine's), this node's partial [C, H] f32, this node's ids [C, K] i32 (the
  // combine's), then two dispatch batches (dispatch i uses batch i % 2: two dispatches may wait
  // for their hooks, docs/semantics.md §2.4) of batch_bytes each: the N - 1 received dispatch
  // chunks (dispatch_bytes apart), this node's ids [C, K] i32 and this rank's rows [C, H] bf16
  // (copied by a dispatch with the hook, whose own node-local dispatch runs in the hook).
  int64_t slot = 0, own_off = 0, own_ids_off = 0;
  int64_t batch_off = 0, batch_ids_off = 0, batch_rows_off = 0, batch_bytes = 0, total = 0;

  static int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

  static LlNodesLayout make(int64_t max_tokens, int64_t hidden, int top_k, int num_nodes) {
    const int64_t C = max_tokens, H = hidden, K = top_k;
    LlNodesLayout x;
    x.dispatch_ids_off = align16(C * 2 * H);
    x.dispatch_bytes = x.dispatch_ids_off + align16(C * K * 4);
    x.route_weights_off = align16(C * K * 4);
    x.route_bytes = x.route_weights_off + align16(C * K * 4);
    x.partial_bytes = align16(C * H * 4);
    x.slot = std::max({x.dispatch_bytes, x.route_bytes, x.partial_bytes});
    x.own_off = 2 * (num_nodes - 1) * x.slot;
    x.own_ids_off = x.own_off + x.partial_bytes;
    x.batch_off = x.own_ids_off + align16(C * K * 4);
    x.batch_ids_off = (num_nodes - 1) * x.dispatch_bytes;
    x.batch_rows_off = x.batch_ids_off + align16(C * K * 4);
    x.batch_bytes = x.batch_rows_off + align16(C * 2 * H);
    x.total = x.batch_off + 2 * x.batch_bytes;
    return x;
  }
};

}  // namespace epx::detail
