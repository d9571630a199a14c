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

}  // namespace epx::testing
