// tests/support/ll_masks.h — the ll rank-mask scenarios (enable_shrink, docs/semantics.md §2.6)
// that the cpu tests (tests/unit/ll_mask_test.cc) and the GPU tier (tests/gpu/ll_mask_gpu_test.cc)
// both run: what each rank does in each round and what every live rank must get.
//
// The dead-peer scenario follows DeepEP's test_low_latency.py --shrink-test: ranks stop calling
// (they "die") at their first dispatch, combine or ll_clean of a round, the live ranks go on and
// their masks grow. Rounds (each: dispatch, combine, ll_clean; a = at_dispatch, b = at_combine,
// c = at_clean):
//   0  every rank; no mask
//   1  a stops before its dispatch: the live ranks' waits for it time out and mask it
//   2  b dispatches (its tokens arrive), then stops before its combine: masked there
//   3  c runs dispatch and combine, then stops before ll_clean: masked by the live ranks' clean
//   4  the live ranks only, every dead rank masked: no wait for anyone (fast)
// Expected outputs come from the oracle with the round's masks (LlProblem::masked_dispatch /
// masked_combine); y rows past the counts are NaN, so a read of a masked rank's block shows.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "support/ll_cases.h"

namespace epx::testing {

inline constexpr int kLlMaskRounds = 5;

// The steps' clock: seconds from t0 to now (what LlDeathPlan::check_time takes).
using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct LlDeathPlan {
  int at_dispatch = -1, at_combine = -1, at_clean = -1;  // ranks that stop there (-1: none)

  // DeepEP's ranks (1, 3, 5) where R allows: rank 1 at the dispatch (R >= 2); rank 3 at the
  // combine (R >= 4; rank 2 at R = 3); rank 5 at the clean (R >= 6, with `clean_death`).
  static LlDeathPlan for_ranks(int num_ranks, bool clean_death = true);
  // Whether `rank` stops before `step` (0 dispatch, 1 combine, 2 ll_clean) of `round`, or has
  // stopped earlier.
  bool stopped(int rank, int round, int step) const;
  // The ranks every live rank masks while running `step` of `round` (after it: the next step's).
  uint64_t masked(int round, int step) const;
  // "" when a live rank's `step` of `round` that took `took` seconds waited as it should, with
  // the group's timeout `timeout` (seconds): a step that meets a rank dead just before it waits
  // one timeout (ll_clean: two, its barrier waits twice the timeout) — at least 0.9 of that and
  // less than one timeout plus `slack` more; any other step less than 0.9 timeouts. Else what
  // is wrong.
  std::string check_time(int round, int step, double took, double timeout, double slack) const;
};

// The Buffer of the mask tests: ll only, enable_shrink.
BufferConfig ll_mask_config();

// One scenario: a small problem (R ranks, uniform routing over every rank's experts), the plan,
// and one batch per round whose expected outputs use that round's masks.
struct LlMaskScenario {
  LlCase c;
  LlDeathPlan plan;
  std::vector<LlBatch> rounds;  // [kLlMaskRounds]
  // Call options of round i: hooks on odd rounds, fp8 from the seed.
  bool hook(int round) const { return round % 2 == 1; }
};
LlMaskScenario make_ll_mask_scenario(int num_ranks, uint64_t seed, bool clean_death = true);

// The batch of `c`'s problem with masks (masked_dispatch, masked_combine): inputs from `rng`,
// expected outputs from the oracle with those masks.
LlBatch make_ll_masked_batch(const LlCase& c, uint64_t masked_dispatch, uint64_t masked_combine,
                             std::mt19937_64& rng);

// "" when mask_status (int32 [R] as read back) holds exactly `want` (bit p <-> element p != 0;
// DeepEP's query returns 1 for a masked rank), else what differs.
std::string check_mask_status(const std::vector<int32_t>& mask_status, uint64_t want);

}  // namespace epx::testing
