// tests/support/oracle_a2a.h — a naive, independent oracle of the a2a mode (docs/semantics.md §3),
// shared by the unit tests and epx-bench --check.
//
// An A2aProblem holds the configuration and EVERY rank's inputs in host memory, generated from
// one rng, so each rank (a thread, a forked process, or a GPU process that regenerates it from the
// same seed) can compute its own expected outputs with a2a_oracle(problem, rank) and compare the
// library's outputs (copied to the host first when they live on a GPU) with a2a_compare_*.
// The oracle is plain loops over docs/semantics.md §3 and shares no code with src/cpu/a2a.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "epx/a2a.h"
#include "support/routing.h"

namespace epx::testing {

struct A2aPayloadSpec {
  enum class Fill {
    kRandom,     // random bytes
    kExpertIds,  // the token's topk_idx row as int32 (requires dtype i32, row_shape {K})
    kWeights,    // topk weights as f32 (requires dtype f32, row_shape {K}), 0 where id is -1
  };
  DType dtype = DType::kBF16;
  std::vector<int64_t> row_shape;  // the payload's dims after T
  Fill fill = Fill::kRandom;

  int64_t row_elems() const;
  size_t row_bytes() const;
};

struct A2aProblem {
  // Configuration.
  int num_ranks = 1;
  int top_k = 1;
  int num_experts = 1;
  int64_t max_tokens_per_rank = 1;
  int64_t runtime_max = 1;  // M, the same on every rank, >= every rank's T
  std::vector<A2aPayloadSpec> payloads;
  std::vector<size_t> payload_bytes_per_token;  // configured sizes; empty = each row_bytes()
  std::optional<int32_t> invalid_expert_id;
  int expert_id_payload_index = -1;
  int64_t hidden = 1;                  // H of the combine payload
  DType combine_dtype = DType::kBF16;  // bf16, f16 or f32
  size_t combine_bytes_per_token = 0;  // configured size; 0 = hidden * element size
  // The rank mask the active ranks apply (A2a::set_active_ranks); empty = every rank active. The
  // oracle of a rank is defined only for an active rank.
  std::vector<bool> active;

  // Every rank's inputs (fill_a2a_inputs).
  std::vector<int64_t> num_tokens;                         // [R]
  std::vector<std::vector<int32_t>> topk_idx;              // [R][T_r * K]
  std::vector<std::vector<std::vector<uint8_t>>> payload;  // [R][i][T_r * row_bytes(i)]
  std::vector<std::vector<uint8_t>> combine_y;             // [R][R * M * H * elem], rank d's y

  // The A2aShape to construct the A2a object with.
  A2aShape shape() const;
  size_t combine_elem_bytes() const;
};

// Generates topk_idx (with routing[rank], one entry per rank), payloads and combine_y for every
// rank from p.num_tokens. Payload values are random bytes (or ids / weights per Fill); combine_y
// holds finite random values in every row, padding rows included, so a wrong slot shows.
void fill_a2a_inputs(A2aProblem& p, const std::vector<Routing>& routing, std::mt19937_64& rng);

struct A2aExpected {
  std::vector<int32_t> recv_counts;                 // [R]
  std::vector<std::vector<uint8_t>> recv;           // [i] bytes of [R, M, row]; unspecified rows 0
  std::vector<std::vector<uint8_t>> row_specified;  // [i] [R * M]: 1 where the row is defined
                                                    // (valid rows, sanitised padding: semantics §3)
  std::vector<uint8_t> combine_out;                 // bytes of [T, H] in combine_dtype
  A2aDropCounts dropped;                            // what the mask drops of this rank's tokens
};

// What `rank` must receive from dispatch and get from combine, from all ranks' inputs.
A2aExpected a2a_oracle(const A2aProblem& p, int rank);

// A mask with every rank active but a random subset of the others (each kept with probability
// 1/2), `rank` always active.
std::vector<bool> random_active_mask(int num_ranks, int rank, std::mt19937_64& rng);

// Compare outputs held in host memory with the oracle. Each returns "" when everything matches,
// else the first `max_reports` mismatches and the number of mismatching elements.
// check_unspecified_zero: also require padding rows semantics.md §3.2 leaves unspecified to be
// zero (a property of the cpu backend, not of the semantics).
std::string a2a_compare_dispatch(const A2aProblem& p, int rank, const A2aExpected& expected,
                                 const A2aDispatchResult& actual, bool check_unspecified_zero,
                                 int max_reports = 8);
std::string a2a_compare_combine(const A2aProblem& p, int rank, const A2aExpected& expected,
                                const TensorView& out, int max_reports = 8);

}  // namespace epx::testing
