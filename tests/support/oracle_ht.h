// tests/support/oracle_ht.h — a naive, independent oracle of the ht mode (docs/semantics.md §1).
//
// Given the inputs of ALL ranks, it computes what one rank must get, with plain loops straight
// from the spec. It shares no code with src/cpu/ht.cc (only the bf16 conversions of numeric.h), so
// the cpu backend is tested against an independent reading of the spec, and the cuda backend
// against both. The one ht oracle: used by tests/unit/ht_test.cc, by the GPU tests
// (tests/gpu/ht_test.cc, on the inputs of tests/gpu/ht_reference.h) and by epx-bench --check.
//
// Conventions: every array is row-major and contiguous; topk ids are int64 whatever dtype the
// caller passed; x rows and scale rows are raw bytes (the oracle only moves them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace epx::testing {

// The problem, equal on every rank.
struct HtProblem {
  int num_ranks = 1;           // R
  int num_experts = 1;         // E, a multiple of R
  int top_k = 1;               // K
  int64_t hidden = 0;          // H
  size_t x_row_bytes = 0;      // bytes of one x row: 2H (bf16) or H (fp8)
  size_t scale_row_bytes = 0;  // bytes of one scale row: 4 * H/128 (f32), 4 * ceil(H/512) (i32)
                               // or 0 (bf16)
  int expert_alignment = 1;
  int64_t num_worst_tokens = 0;  // > 0: worst-case mode
  int ranks_per_node = 0;        // GroupOptions::ranks_per_node: 0 = one node (only the
                                 // combine's summation order depends on it)
};

// One rank's dispatch inputs.
struct HtRankInput {
  int64_t num_tokens = 0;         // T
  std::vector<int64_t> topk_idx;  // [T, K]
  bool has_topk_weights = false;
  std::vector<float> topk_weights;  // [T, K] when has_topk_weights
  std::vector<uint8_t> x;           // [T, x_row_bytes]
  std::vector<uint8_t> scales;      // [T, scale_row_bytes]; empty for bf16
};

// One rank's combine inputs.
struct HtCombineRankInput {
  std::vector<uint16_t> y;  // [rows, H] bf16 (rows = N, or num_worst_tokens)
  bool has_topk_weights = false;
  std::vector<float> topk_weights;  // [rows, K] when has_topk_weights
  bool has_bias0 = false, has_bias1 = false;
  std::vector<uint16_t> bias0, bias1;  // [T, H] bf16 of this rank when has_bias*
};

struct HtExpectedLayout {
  std::vector<int32_t> num_tokens_per_rank;    // [R]
  std::vector<int32_t> num_tokens_per_expert;  // [E]
  std::vector<uint8_t> is_token_in_rank;       // [T, R], 0/1
};

struct HtExpectedDispatch {
  int64_t num_recv_tokens = 0;       // N
  bool overflow = false;             // worst-case mode and N > num_worst_tokens: must raise
                                     // OutOfCapacity on this rank (the fields below are then empty)
  int64_t num_rows = 0;              // rows of the outputs: N, or num_worst_tokens
  std::vector<uint8_t> recv_x;       // [rows, x_row_bytes]
  std::vector<uint8_t> recv_scales;  // [rows, scale_row_bytes]
  std::vector<int64_t> recv_topk_idx;           // [rows, K]
  std::vector<float> recv_topk_weights;         // [rows, K] (empty when weights were not given)
  std::vector<int32_t> recv_src_idx;            // [rows]
  std::vector<int> num_recv_tokens_per_expert;  // [L], empty in worst-case mode
  std::vector<int32_t> rank_prefix_matrix;      // [R, R]
  std::vector<int32_t> send_pos;                // [T, R] of this rank's tokens
  std::vector<uint8_t> is_token_in_rank;        // [T, R]
};

struct HtExpectedCombine {
  std::vector<uint16_t> out;                 // [T, H] bf16
  std::vector<float> combined_topk_weights;  // [T, K] (empty when weights were not given)
};

// Layout of one rank's topk_idx [T, K].
HtExpectedLayout ht_oracle_layout(const HtProblem& p, const std::vector<int64_t>& topk_idx,
                                  int64_t num_tokens);

// N of `rank`: the tokens it receives from a dispatch of `inputs`.
int64_t ht_oracle_num_recv_tokens(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                  int rank);

// What `rank` receives from a dispatch of `inputs` (one entry per rank).
HtExpectedDispatch ht_oracle_dispatch(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                      int rank);

// What `rank` gets back from a combine after the dispatch of `inputs`, with `combine[d]` the
// combine inputs of rank d. Sums exactly as docs/semantics.md §1.6 / src/cpu/ht_combine.cc
// document: float32, 0.0f + bias0 + bias1 + y of each destination rank of this rank's node
// ascending, then for every other node ascending that the token reached, the float32 sum (from
// 0.0f) of its ranks' y ascending; one rounding to bf16. One node: 0.0f + biases + y of d = 0..R-1.
HtExpectedCombine ht_oracle_combine(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                    const std::vector<HtCombineRankInput>& combine, int rank);

}  // namespace epx::testing
