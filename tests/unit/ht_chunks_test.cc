// tests/unit/ht_chunks_test.cc — the copy engines' chunk arithmetic that the host (which copies
// rows chunk by chunk and signals each chunk) and the kernels (which wait for the chunk holding a
// row) must agree on (src/cuda/kernels/ht/ht_region.cuh). A disagreement would make a reducer
// read a row before it arrived, or wait for a signal that never comes; it compiles for the CPU
// (the same inline functions the CUDA code uses), so the CPU tier checks it.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda/kernels/ht/ht_region.cuh"

namespace epx::detail {
namespace {

TEST(HtChunks, ChunksPartitionTheRowsAndEveryRowIsFoundInItsOwnChunk) {
  const int C = kHtEngineChunks;
  for (int64_t n = 0; n <= 1200; ++n) {
    // The chunks tile [0, n) in order: chunk 0 starts at 0, the last ends at n, none goes back.
    ASSERT_EQ(engine_chunk_begin(n, 0), 0) << "n " << n;
    ASSERT_EQ(engine_chunk_begin(n, C), n) << "n " << n;
    std::vector<int> owner(static_cast<size_t>(n), -1);
    for (int c = 0; c < C; ++c) {
      const int64_t lo = engine_chunk_begin(n, c), hi = engine_chunk_begin(n, c + 1);
      ASSERT_LE(lo, hi) << "n " << n << " chunk " << c;
      for (int64_t j = lo; j < hi; ++j) {
        ASSERT_EQ(owner[static_cast<size_t>(j)], -1) << "row " << j << " of " << n << " twice";
        owner[static_cast<size_t>(j)] = c;
      }
    }
    // The kernels' lookup names the chunk the host copied the row in, for every row.
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(engine_chunk(j, n), owner[static_cast<size_t>(j)]) << "row " << j << " of " << n;
    }
  }
}

TEST(HtChunks, LargeBlocks) {
  // Row counts of real blocks (R * T_max up to a few hundred thousand rows): no overflow in
  // n * c, and the same agreement at the chunk edges.
  for (int64_t n : {int64_t{4080}, int64_t{65536}, int64_t{1} << 20, (int64_t{1} << 31) + 7}) {
    for (int c = 0; c < kHtEngineChunks; ++c) {
      const int64_t lo = engine_chunk_begin(n, c), hi = engine_chunk_begin(n, c + 1);
      if (lo < hi) {
        EXPECT_EQ(engine_chunk(lo, n), c) << n;
        EXPECT_EQ(engine_chunk(hi - 1, n), c) << n;
      }
    }
    EXPECT_EQ(engine_chunk_begin(n, kHtEngineChunks), n);
  }
}

}  // namespace
}  // namespace epx::detail
