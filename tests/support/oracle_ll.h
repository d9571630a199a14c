// tests/support/oracle_ll.h — a naive, independent oracle of the ll mode (docs/semantics.md §2).
//
// Given every rank's inputs, computes what one rank must receive from ll_dispatch and what its
// ll_combine must return, with plain loops over experts, ranks and tokens (no code shared with
// src/cpu/ll*.cc; the fp8/bf16 conversions of core/numeric.h are the reference formats). Used by
// tests/unit/ll_test.cc and by epx-bench --check; check_* compare a backend's result (host-readable
// tensors: copy device tensors to the host first) bit for bit on every row the spec defines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/ll.h"
#include "epx/shape.h"
#include "epx/tensor.h"

namespace epx::testing {

struct LlProblem {
  int num_ranks = 1;       // R
  int64_t max_tokens = 1;  // T_max
  int64_t hidden = 128;    // H, a multiple of 128
  int top_k = 1;           // K
  int num_experts = 1;     // E, a multiple of R
  bool use_fp8 = false;
  bool round_scale = false;
  bool use_ue8m0 = false;
  bool use_logfmt = false;  // combine: y(t, k) as LogFMT-10 decodes it (support/logfmt_ref.h)
  int ranks_per_node = 0;   // GroupOptions::ranks_per_node: 0 = one node (only the combine's
                            // summation order depends on it)
  bool use_nvfp4 = false;     // dispatch: NVFP4 messages (set by name: fields after this one)
  float global_scale = 1.0f;  // NVFP4's g (every rank's)
  // The ll rank masks (enable_shrink, docs/semantics.md §2.6), bit p = rank p, the same on every
  // live rank: masked during the dispatch (the rank's tokens are absent) and during the combine
  // (the rank's experts' terms are left out; a superset of the dispatch's).
  uint64_t masked_dispatch = 0;
  uint64_t masked_combine = 0;

  int num_local_experts() const { return num_experts / num_ranks; }
  int64_t rows_per_expert() const { return num_ranks * max_tokens; }  // R * T_max
  int64_t num_groups() const { return hidden / 128; }                 // G
  MoeShape moe_shape() const { return MoeShape{hidden, top_k, num_experts, max_tokens}; }
  std::string describe() const;
};

// One rank's inputs, row-major.
struct LlRankInput {
  int64_t num_tokens = 0;           // T
  std::vector<uint16_t> x;          // [T, H] bf16 bits
  std::vector<int64_t> topk_idx;    // [T, K], values in [-1, E)
  std::vector<float> topk_weights;  // [T, K]
};

// What one rank receives, in logical row-major layouts; rows >= recv_count[l] are undefined and
// hold zeros here.
struct LlExpectedDispatch {
  std::vector<int32_t> recv_count;    // [L]
  std::vector<uint8_t> recv_x;        // [L, R*T_max, H * (fp8 ? 1 : 2)] bytes, NVFP4 [.., H/2]
  std::vector<uint8_t> recv_sf;       // [L, R*T_max, H/16] e4m3 bytes   NVFP4
  std::vector<float> recv_scales;     // [L, R*T_max, G]            fp8 without ue8m0
  std::vector<int32_t> recv_packed;   // [L, R*T_max, ceil(G / 4)]  fp8 with ue8m0
  std::vector<int32_t> src_info;      // [L, R*T_max]
  std::vector<int64_t> layout_range;  // [L, R]
};

LlExpectedDispatch oracle_ll_dispatch(const LlProblem& p, const std::vector<LlRankInput>& inputs,
                                      int rank);

// y[d]: rank d's expert outputs, bf16 [L, R*T_max, H] (only rows < rank d's recv_count are read).
// Returns rank `rank`'s out [T, H] bf16: per node, the fmaf chain over the token's k in order
// whose expert lives on that node (from 0.0f); this rank's node's chain, plus each other node's
// that the token reached, nodes ascending; one rounding (src/cpu/ll_combine.cc). One node: the
// fmaf chain over every k. p.use_logfmt: every y row as logfmt_ref_row decodes it. Experts of
// ranks in p.masked_combine are left out of every chain.
std::vector<uint16_t> oracle_ll_combine(const LlProblem& p, const std::vector<LlRankInput>& inputs,
                                        const std::vector<std::vector<uint16_t>>& y, int rank);
// Every rank's out at once (walks the routing once for all ranks).
std::vector<std::vector<uint16_t>> oracle_ll_combine_all(
    const LlProblem& p, const std::vector<LlRankInput>& inputs,
    const std::vector<std::vector<uint16_t>>& y);

// NVFP4 of one token row, written here from the definitions of docs/semantics.md §2.2 with
// core/numeric.h's e4m3 conversions (the e2m1 code by nearest-value search, ties to the even
// code; independent of core/quant.h): q [H/2] pairs (element 2i low nibble), sf [H/16].
void oracle_nvfp4_row(const uint16_t* x, int64_t hidden, float global_scale, uint8_t* q,
                      uint8_t* sf);

// "" when `got` matches `want` on every defined element, else a description of the first
// mismatch (and how many there were). Tensors are read through their strides; NVFP4 outputs
// through DeepEP's logical views (recv_x (RT, H/2, L); scale j of row `row` of expert l at
// (row % 32, row % 128 / 32, row / 128, j % 4, j / 4, l) of the 6-dim view).
std::string check_ll_dispatch(const LlProblem& p, const LlExpectedDispatch& want,
                              const LlDispatchResult& got);
std::string check_ll_combine(const LlProblem& p, const std::vector<uint16_t>& want,
                             const TensorView& out);

}  // namespace epx::testing
