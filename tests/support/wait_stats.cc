// tests/support/wait_stats.cc — see wait_stats.h.
#include "support/wait_stats.h"

namespace epx::testing {

std::string show_values(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string check_wait_added(const std::string& what, const WaitExpectation& want,
                             const std::vector<int64_t>& before,
                             const std::vector<int64_t>& after) {
  if (before.size() != after.size()) return what + ": the vector changed size";
  const int r = want.rank;
  std::string err;
  for (size_t i = 0; i < before.size(); ++i) {
    const int s = static_cast<int>(i);
    const int64_t added = after[i] - before[i];
    const std::string where = what + " stats[" + std::to_string(s) + "] added " +
                              std::to_string(added) + " ns (" + show_values(before) + " -> " +
                              show_values(after) + ")";
    const bool there_before = r == want.straggler || s == r;
    std::string bad;
    if (added < 0) {
      bad = "negative";
    } else if (want.combine && s == r) {
      if (added != 0) bad = "expected 0 (a rank does not wait for its own rows)";
    } else if (s == want.straggler && r != want.straggler) {
      if (added < kWaitDelayNs / 2)
        bad = "expected >= " + std::to_string(kWaitDelayNs / 2) + " (the straggler's " +
              std::to_string(kWaitDelayMs) + " ms)";
    } else if (want.exact_zero && there_before) {
      if (added != 0) bad = "expected 0 (the data was there before the receive began)";
    } else if (added >= want.punctual_below) {
      bad = "expected < " + std::to_string(want.punctual_below) +
            " (data that was there, or came on time)";
    }
    if (!bad.empty()) err += where + ": " + bad + "\n";
  }
  return err;
}

}  // namespace epx::testing
