// tests/support/ll_cases.h — one ll test case (problem + call options) and its batches: every
// rank's inputs and what every rank must get from the oracle (oracle_ll.h). Shared by the cpu
// tests (tests/unit/ll_test.cc) and the GPU tier (tests/gpu/ll_gpu_test.cc), which differ in how
// they pick cases and run them, not in what a case means.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/oracle_ll.h"
#include "support/routing.h"

namespace epx::testing {

inline constexpr uint16_t kLlPoisonBf16 = 0x7FC1;  // NaN: a wrong y row read shows up in out

struct LlCase {
  LlProblem p;
  Routing routing = Routing::kUniform;
  bool topk_i32 = false, hook = false, reverse_hooks = false, zero_copy = false;
  bool out_given = false, stats = false, padded = false;
  // With padded: y's row stride H + 1 (its rows not 16-byte aligned) instead of H + 64.
  bool unaligned_y = false;
  // With padded: x's row stride H + 1 (its rows not 16-byte aligned) instead of H + 64.
  bool unaligned_x = false;
  int num_batches = 1;  // dispatches in flight together
  int num_iters = 1;    // dispatch + combine rounds on one buffer
  uint64_t seed = 0;
  std::vector<int64_t> fixed_tokens;  // T per rank, or empty for random T in [0, T_max]

  std::string describe() const;
};

// One dispatch + combine: every rank's inputs and what every rank must get.
struct LlBatch {
  std::vector<LlRankInput> in;                  // [R]
  std::vector<std::vector<uint16_t>> y;         // [R] bf16 [L, R*T_max, H], NaN past counts
                                                // (use_logfmt: make_logfmt_bf16 rows)
  std::vector<LlExpectedDispatch> want;         // [R]
  std::vector<std::vector<uint16_t>> want_out;  // [R] [T, H]
  std::vector<std::vector<int32_t>> stats0;     // [R] [L] initial cumulative stats
};

// A random case from `seed`: problem (R ranks, or R picked from {1, 2, 3, 4, 8} when R <= 0),
// dtype options, routing and call options (use_logfmt in 30 %), sized to keep memory and time
// modest; two rounds on one buffer with probability `two_iters`.
LlCase random_ll_case(int R, uint64_t seed, double two_iters);

// bf16 rows [rows, cols] (cols % 128 == 0) whose 128-channel groups take every LogFMT case
// (docs/semantics.md §2.3.1), group by group at random: cast groups of random scale, with zeros
// (+0 and -0), with bf16 subnormals, spanning more than 2^32 (lb clipped), with a single non-zero
// value; raw groups with one magnitude, a value >= 1, NaN or Inf, all zeros.
std::vector<uint16_t> make_logfmt_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng);

// NVFP4 edge cases on R ranks (both tiers): DeepSeek's H with two batches in flight, rows per
// expert not a multiple of 128 (a partial tile) with K > E, H = 128 (two scale words a row),
// saturating (g = 5000) and flushing (g = 1e-3) global scales, every routing once, rows wider than
// the cuda send's prefetch (H = 16512); g as a tensor on odd seeds, a host value on even ones.
std::vector<LlCase> nvfp4_ll_cases(int R, uint64_t seed);

// New random inputs for every rank (T per rank from c.fixed_tokens or random), then
// finish_ll_batch.
LlBatch make_ll_batch(const LlCase& c, std::mt19937_64& rng);
// The expected outputs (and the expert outputs y) of b's inputs.
void finish_ll_batch(const LlCase& c, LlBatch& b, std::mt19937_64& rng);
// c.num_iters * c.num_batches batches from c.seed.
std::vector<LlBatch> make_ll_batches(const LlCase& c);

}  // namespace epx::testing
