// tests/support/ll_masks.cc — the ll rank-mask scenarios (ll_masks.h).
#include "support/ll_masks.h"

#include <utility>

#include "core/check.h"

namespace epx::testing {
namespace {

// Where each planned death happens: (round, step) with step 0 dispatch, 1 combine, 2 ll_clean.
struct Death {
  int rank, round, step;
};

std::vector<Death> deaths(const LlDeathPlan& p) {
  std::vector<Death> d;
  if (p.at_dispatch >= 0) d.push_back({p.at_dispatch, 1, 0});
  if (p.at_combine >= 0) d.push_back({p.at_combine, 2, 1});
  if (p.at_clean >= 0) d.push_back({p.at_clean, 3, 2});
  return d;
}

bool reached(const Death& d, int round, int step) {
  return round > d.round || (round == d.round && step >= d.step);
}

}  // namespace

LlDeathPlan LlDeathPlan::for_ranks(int num_ranks, bool clean_death) {
  LlDeathPlan p;
  if (num_ranks >= 2) p.at_dispatch = 1;
  if (num_ranks >= 4)
    p.at_combine = 3;
  else if (num_ranks == 3)
    p.at_combine = 2;
  if (num_ranks >= 6 && clean_death) p.at_clean = 5;
  return p;
}

bool LlDeathPlan::stopped(int rank, int round, int step) const {
  for (const Death& d : deaths(*this))
    if (d.rank == rank && reached(d, round, step)) return true;
  return false;
}

uint64_t LlDeathPlan::masked(int round, int step) const {
  uint64_t m = 0;
  for (const Death& d : deaths(*this))
    if (reached(d, round, step)) m |= uint64_t{1} << d.rank;
  return m;
}

std::string LlDeathPlan::check_time(int round, int step, double took, double timeout,
                                    double slack) const {
  const uint64_t before = step > 0 ? masked(round, step - 1) : round > 0 ? masked(round - 1, 2) : 0;
  const double waits = masked(round, step) == before ? 0 : step == 2 ? 2 : 1;
  const bool ok = waits == 0
                      ? took < 0.9 * timeout
                      : took >= 0.9 * waits * timeout && took < (waits + 1) * timeout + slack;
  if (ok) return "";
  const char* names[3] = {"dispatch", "combine", "ll_clean"};
  return detail::cat(
      names[step], " took ", took, " s, expected ",
      waits == 0 ? std::string("no wait") : detail::cat(waits, " timeouts of ", timeout, " s"));
}

BufferConfig ll_mask_config() {
  BufferConfig c;
  c.enable_ht = false;
  c.enable_ll = true;
  c.enable_shrink = true;
  return c;
}

LlBatch make_ll_masked_batch(const LlCase& c, uint64_t masked_dispatch, uint64_t masked_combine,
                             std::mt19937_64& rng) {
  LlCase masked = c;
  masked.p.masked_dispatch = masked_dispatch;
  masked.p.masked_combine = masked_combine;
  return make_ll_batch(masked, rng);
}

LlMaskScenario make_ll_mask_scenario(int num_ranks, uint64_t seed, bool clean_death) {
  LlMaskScenario s;
  LlProblem& p = s.c.p;
  p.num_ranks = num_ranks;
  p.max_tokens = 16;
  p.hidden = 256;
  p.top_k = 4;
  p.num_experts = 4 * num_ranks;
  p.use_fp8 = seed % 2 == 1;
  s.c.routing = Routing::kUniform;
  s.c.seed = seed;
  s.plan = LlDeathPlan::for_ranks(num_ranks, clean_death);
  std::mt19937_64 rng(seed);
  for (int round = 0; round < kLlMaskRounds; ++round)
    s.rounds.push_back(
        make_ll_masked_batch(s.c, s.plan.masked(round, 0), s.plan.masked(round, 1), rng));
  return s;
}

std::string check_mask_status(const std::vector<int32_t>& mask_status, uint64_t want) {
  std::string got, expected;
  for (size_t q = 0; q < mask_status.size(); ++q) {
    got += detail::cat(q ? " " : "", mask_status[q]);
    expected += detail::cat(q ? " " : "", (want >> q) & 1);
  }
  bool ok = true;
  for (size_t q = 0; q < mask_status.size(); ++q)
    ok &= mask_status[q] == static_cast<int32_t>((want >> q) & 1);
  return ok ? "" : detail::cat("mask_status is [", got, "], expected [", expected, "]");
}

}  // namespace epx::testing
