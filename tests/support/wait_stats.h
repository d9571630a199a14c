// tests/support/wait_stats.h — what one ll call may add to a wait-cost statistics vector
// (docs/semantics.md §2.5), in a call where one rank (the straggler) made its call a known delay
// late. Shared by the cpu tests (tests/unit/ll_wait_stats_test.cc) and the GPU tier
// (tests/gpu/ll_wait_stats_gpu_test.cc), which differ only in how tight "there already" is.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epx::testing {

inline constexpr int64_t kWaitDelayMs = 200;  // how late the straggler makes its calls
inline constexpr int64_t kWaitDelayNs = kWaitDelayMs * 1'000'000;
// The small ll problem both tiers run (H, T_max, K; E = 4 R) and the value of the guard elements
// around the [R] views (anything written outside the view shows up).
inline constexpr int64_t kWaitHidden = 256, kWaitMaxTokens = 16;
inline constexpr int kWaitTopK = 4;
inline constexpr int64_t kWaitGuard = 0x5EED5EED5EED;

struct WaitExpectation {
  int rank = 0;        // the rank whose vector this is
  int straggler = -1;  // the late rank (-1: none)
  bool combine = false;
  // cpu: data that was there before the receive began (the own element, everything on the
  // straggler) costs exactly 0; cuda: the time of a flag read, below `punctual_below`.
  bool exact_zero = false;
  int64_t punctual_below = kWaitDelayNs / 2;  // bound for sources that were on time
};

// "" or, per element, what is wrong with after - before: never negative; a combine adds 0 to the
// own element (no rank waits for its own rows); the straggler's element at least half the delay
// (on every rank but the straggler); every other element less than `punctual_below` (0 where
// `exact_zero` and the data was there before the receive began).
std::string check_wait_added(const std::string& what, const WaitExpectation& want,
                             const std::vector<int64_t>& before, const std::vector<int64_t>& after);

std::string show_values(const std::vector<int64_t>& v);  // "[a, b, ...]"

}  // namespace epx::testing
