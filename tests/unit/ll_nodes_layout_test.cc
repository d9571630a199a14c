// tests/unit/ll_nodes_layout_test.cc — the host-side sizes of the cuda ll across nodes
// (src/cuda/ll_nodes_layout.h, docs/design.md §13.1): every part 16-byte aligned, the parts of a
// chunk disjoint and inside it, every chunk inside a rail slot, the slots, this node's partial and
// ids disjoint and inside the scratch, for shapes from one token to DeepSeek's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ll_nodes_layout.h"

namespace epx::detail {
namespace {

TEST(LlNodesLayout, PartsAlignedDisjointAndInsideTheirSlots) {
  for (int64_t C : {1, 7, 128, 513})
    for (int64_t H : {128, 384, 7168})
      for (int K : {1, 8, 9, 32})
        for (int N : {2, 3, 4, 16}) {
          const LlNodesLayout x = LlNodesLayout::make(C, H, K, N);
          SCOPED_TRACE(testing::Message() << "C " << C << " H " << H << " K " << K << " N " << N);
          for (int64_t v :
               {x.dispatch_ids_off, x.dispatch_bytes, x.route_weights_off, x.route_bytes,
                x.partial_bytes, x.slot, x.own_off, x.own_ids_off, x.batch_off, x.batch_ids_off,
                x.batch_rows_off, x.batch_bytes, x.total})
            EXPECT_EQ(v % 16, 0);
          // Dispatch chunk: rows [C, 2H] bf16, then ids [C, K] i32 (ht's pack layout).
          EXPECT_EQ(x.dispatch_rows_off, 0);
          EXPECT_GE(x.dispatch_ids_off, C * 2 * H);
          EXPECT_GE(x.dispatch_bytes, x.dispatch_ids_off + C * K * 4);
          // Routing chunk: ids then weights.
          EXPECT_EQ(x.route_ids_off, 0);
          EXPECT_GE(x.route_weights_off, C * K * 4);
          EXPECT_GE(x.route_bytes, x.route_weights_off + C * K * 4);
          EXPECT_GE(x.partial_bytes, C * H * 4);
          EXPECT_GE(x.slot, x.dispatch_bytes);
          EXPECT_GE(x.slot, x.route_bytes);
          EXPECT_GE(x.slot, x.partial_bytes);
          // Scratch: 2 (N - 1) slots, own partial, own ids, then two dispatch batches of N - 1
          // chunks, ids and rows; nothing more than 15 bytes of padding per part.
          EXPECT_EQ(x.own_off, 2 * (N - 1) * x.slot);
          EXPECT_GE(x.own_ids_off, x.own_off + C * H * 4);
          EXPECT_GE(x.batch_off, x.own_ids_off + C * K * 4);
          EXPECT_LT(x.batch_off, x.own_ids_off + C * K * 4 + 16);
          EXPECT_EQ(x.batch_ids_off, (N - 1) * x.dispatch_bytes);
          EXPECT_GE(x.batch_rows_off, x.batch_ids_off + C * K * 4);
          EXPECT_GE(x.batch_bytes, x.batch_rows_off + C * 2 * H);
          EXPECT_LT(x.batch_bytes, x.batch_rows_off + C * 2 * H + 16);
          EXPECT_EQ(x.total, x.batch_off + 2 * x.batch_bytes);
          EXPECT_LT(x.slot, std::max({C * (2 * H + 4 * K), C * 8 * K, C * 4 * H}) + 32);
        }
}

TEST(LlNodesLayout, DeepSeekShapeByHand) {
  // C = 128, H = 7168, K = 8, N = 2: the partial (C * 4H = 3670016 bytes) is the largest part.
  const LlNodesLayout x = LlNodesLayout::make(128, 7168, 8, 2);
  EXPECT_EQ(x.dispatch_bytes, 128 * 2 * 7168 + 128 * 8 * 4);
  EXPECT_EQ(x.route_bytes, 2 * 128 * 8 * 4);
  EXPECT_EQ(x.partial_bytes, 128 * 4 * 7168);
  EXPECT_EQ(x.slot, 3670016);
  // Two batches of one received dispatch chunk, ids and rows [C, H] bf16.
  const int64_t batch = x.dispatch_bytes + 128 * 8 * 4 + 128 * 2 * 7168;
  EXPECT_EQ(x.batch_bytes, batch);
  EXPECT_EQ(x.total, 2 * 3670016 + 3670016 + 128 * 8 * 4 + 2 * batch);
}

}  // namespace
}  // namespace epx::detail
