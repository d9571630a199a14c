// tests/support/a2a_cycle.h — one a2a dispatch + combine cycle of an A2aProblem on one rank,
// checked element by element against the oracle (oracle_a2a.h), and the random problem generator
// of the a2a unit tests. Host memory only (the cpu backend).
//
// Outputs are poisoned before the library writes them: out comes from an allocator that fills
// with 0xFF (NaN), the receive views are overwritten with 0xA5 after the checks (the next
// dispatch must rewrite every row and count), and the combine region is filled with 0xFF before
// a copying combine. The drop counters (A2a::dropped_counts) must advance exactly by the
// oracle's drops of the cycle.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "epx/a2a.h"
#include "support/oracle_a2a.h"
#include "support/routing.h"

namespace epx::testing {

// How one dispatch/combine cycle feeds the library.
struct CycleOptions {
  bool payload_in_workspace = false;
  bool topk_int64 = false;
  bool strided_y = false;  // copy path with a padded row stride
};

inline constexpr size_t kMemoryBudget = size_t{24} << 20;  // receive bytes over all ranks per case

std::string describe(const A2aProblem& p, const CycleOptions& o);
void poison(const TensorView& v, uint8_t byte);

// One dispatch + combine of problem p on rank r (p.active is the mask the object applies).
// Returns "" or what went wrong.
std::string run_cycle(A2a& a2a, const A2aProblem& p, int r, const CycleOptions& o);

// New token counts, M, routing and inputs for a problem's configuration.
A2aProblem next_cycle(const A2aProblem& config, std::mt19937_64& rng,
                      std::optional<Routing> routing = std::nullopt);
A2aPayloadSpec random_payload(std::mt19937_64& rng, int K, bool allow_big);
// A random configuration (no inputs yet) for R ranks.
A2aProblem random_config(std::mt19937_64& rng, int R);
CycleOptions random_options(std::mt19937_64& rng);

// Hand-made f16 combine sums (docs/semantics.md §3.3): up to three ranks' values y[d] (bits), in
// ascending rank order, and the f16 bits of the f32 sum rounded once, worked out by hand: sums
// that overflow to +-inf or round to 65504, subnormal results, ties, a sum that differs when
// rounded twice or summed out of order, NaN kept.
struct F16SumCase {
  const char* what;
  uint16_t y[3];
  uint16_t out;
};
const std::vector<F16SumCase>& f16_sum_cases();
// An f16 combine on R ranks, one token per rank that goes to every rank; column h of every token
// sums case h % size of f16_sum_cases() (ranks from 3 on add 0: the sum is the case's out for
// R >= 3). Inputs complete (no fill_a2a_inputs); hidden >= the number of cases covers each.
A2aProblem f16_sum_problem(int R, int64_t hidden);

}  // namespace epx::testing
