// a2a rank mask (A2a::set_active_ranks) on the cpu backend vs the mask-aware oracle
// (tests/support/oracle_a2a.h): random masks, tokens routed only to inactive ranks, the drop
// counters, a dead peer (Timeout, then the survivors continue bit-exactly), shrinking the mask
// twice, and the validation errors. Every cycle compares every element (support/a2a_cycle.h).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "epx/a2a.h"
#include "epx/error.h"
#include "support/a2a_cycle.h"
#include "support/harness.h"
#include "support/oracle_a2a.h"

namespace epx {
namespace {

using testing::A2aPayloadSpec;
using testing::A2aProblem;
using testing::CycleOptions;

std::string mask_str(const std::vector<bool>& m) {
  std::string s;
  for (bool b : m) s += b ? '1' : '0';
  return s;
}

// Collects failures of every rank thread.
struct Failures {
  std::mutex mu;
  std::string text;
  void add(const std::string& label, const std::string& err) {
    if (err.empty()) return;
    std::lock_guard<std::mutex> lock(mu);
    text += label + ":\n" + err + "\n";
  }
};

// Sleeps until `done` (or 10 s), keeping a rank's thread (and group) alive without taking part.
void idle_until(const std::atomic<bool>& done) {
  const auto start = std::chrono::steady_clock::now();
  while (!done && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

// Case: a full-mask cycle, then every rank of `mask` sets it and runs `cycles`, then (if
// `shrink`) the lowest rank of `mask` other than the highest is dropped too, and the rest run
// one more cycle.
void run_masked(const A2aProblem& config, const std::vector<bool>& mask, int cycles, bool shrink,
                std::mt19937_64& rng, const std::string& label) {
  const int R = config.num_ranks;
  std::vector<A2aProblem> problems;
  std::vector<CycleOptions> options;
  for (int c = 0; c < cycles + 2; ++c) {
    problems.push_back(testing::next_cycle(config, rng));
    options.push_back(testing::random_options(rng));
  }
  for (int c = 1; c <= cycles; ++c) problems[c].active = mask;
  std::vector<bool> smaller = mask;
  int last = R - 1;
  while (!mask[last]) --last;
  for (int p = 0; p < last; ++p)
    if (smaller[p]) {
      smaller[p] = false;
      break;
    }
  problems[cycles + 1].active = smaller;
  Failures f;
  testing::run_threads(R, [&](const Group& g) {
    const int r = g.rank();
    A2a a2a(g, config.shape());
    auto cycle = [&](int c) {
      f.add(label + " rank " + std::to_string(r) + " cycle " + std::to_string(c) + " (" +
                testing::describe(problems[c], options[c]) + ")",
            testing::run_cycle(a2a, problems[c], r, options[c]));
    };
    cycle(0);
    if (mask[r]) {
      a2a.set_active_ranks(mask);
      EXPECT_EQ(a2a.active_ranks(), mask);
      for (int c = 1; c <= cycles; ++c) cycle(c);
    }
    if (shrink && smaller[r]) {
      a2a.set_active_ranks(smaller);
      cycle(cycles + 1);
    }
  });
  EXPECT_TRUE(f.text.empty()) << f.text;
}

TEST(A2aMask, RandomMasksMatchOracle) {
  std::mt19937_64 rng(606);
  for (int c = 0; c < 36; ++c) {
    const int R = 2 + c % 3;
    const A2aProblem config = testing::random_config(rng, R);
    const std::vector<bool> mask = testing::random_active_mask(R, c % R, rng);
    run_masked(config, mask, 2, c % 4 == 0, rng,
               "case " + std::to_string(c) + " mask " + mask_str(mask));
    if (HasFailure()) return;
  }
}

TEST(A2aMask, EveryRankAlone) {
  std::mt19937_64 rng(607);
  for (int R : {2, 3, 4}) {
    for (int alone = 0; alone < R; ++alone) {
      const A2aProblem config = testing::random_config(rng, R);
      std::vector<bool> mask(R, false);
      mask[alone] = true;
      run_masked(config, mask, 2, false, rng,
                 "alone " + std::to_string(alone) + "/" + std::to_string(R));
      if (HasFailure()) return;
    }
  }
}

// Rank 2 of 3 inactive; tokens t % 3 == 0 select only experts of rank 2 (dropped, zeros),
// t % 3 == 1 mix ranks 0 and 2, t % 3 == 2 are all -1 (not a drop). Counted exactly, reset works.
TEST(A2aMask, TokensOnlyOnInactiveRanksAreZeroAndCounted) {
  std::mt19937_64 rng(608);
  const int R = 3;
  A2aProblem p = testing::random_config(rng, R);
  p.top_k = 2;
  p.num_experts = 2 * R;  // L = 2
  p.payloads = {{DType::kBF16, {64}}, {DType::kI32, {2}, A2aPayloadSpec::Fill::kExpertIds}};
  p.payload_bytes_per_token = {};
  p.expert_id_payload_index = 1;
  p.invalid_expert_id = -1;
  p.max_tokens_per_rank = 12;
  p = testing::next_cycle(p, rng);
  p.active = {true, true, false};
  for (int r = 0; r < R; ++r) {
    for (int64_t t = 0; t < p.num_tokens[r]; ++t) {
      int32_t* row = p.topk_idx[r].data() + t * 2;
      if (t % 3 == 0) {
        row[0] = 4;
        row[1] = 5;
      } else if (t % 3 == 1) {
        row[0] = 1;
        row[1] = 5;
      } else {
        row[0] = row[1] = -1;
      }
    }
  }
  Failures f;
  testing::run_threads(R, [&](const Group& g) {
    const int r = g.rank();
    A2a a2a(g, p.shape());  // collective over the whole group
    if (r == 2) return;     // inactive from here on: never calls anything
    a2a.set_active_ranks(p.active);
    int64_t want_tokens = 0, want_selections = 0;
    for (int64_t t = 0; t < p.num_tokens[r]; ++t) {
      want_tokens += t % 3 == 0;
      want_selections += t % 3 == 0 ? 2 : t % 3 == 1 ? 1 : 0;
    }
    EXPECT_EQ(testing::a2a_oracle(p, r).dropped.tokens, want_tokens);
    for (int round = 0; round < 2; ++round) {
      f.add("rank " + std::to_string(r), testing::run_cycle(a2a, p, r, {round == 1}));
      EXPECT_EQ(a2a.dropped_tokens(), want_tokens * (round + 1));
      EXPECT_EQ(a2a.dropped_counts().selections, want_selections * (round + 1));
    }
    a2a.reset_dropped_counts();
    EXPECT_EQ(a2a.dropped_counts().tokens, 0);
    EXPECT_EQ(a2a.dropped_counts().selections, 0);
  }, GroupOptions{std::chrono::milliseconds(5000)});
  EXPECT_TRUE(f.text.empty()) << f.text;
}

// The last rank stops after `good` full cycles (stage 0: before dispatch, 1: after its dispatch,
// before combine). The others get Timeout within the group timeout, are refused until they call
// set_active_ranks without it, then run bit-exact cycles among themselves. `extra_barrier`: rank
// 0 also runs into a timed-out group barrier, so the survivors' barrier generations differ.
void dead_peer(int R, int stage, bool extra_barrier) {
  std::mt19937_64 rng(700 + R * 10 + stage);
  const A2aProblem config = testing::random_config(rng, R);
  std::vector<A2aProblem> problems;
  for (int c = 0; c < 5; ++c) problems.push_back(testing::next_cycle(config, rng));
  std::vector<bool> survivors(R, true);
  survivors[R - 1] = false;
  for (int c = 2; c < 5; ++c) problems[c].active = survivors;
  GroupOptions o;
  // 1 s (the survivors' handshake waits 2x): 300 ms failed on a loaded 2-core machine.
  o.timeout = std::chrono::milliseconds(1000);
  std::atomic<bool> done{false};
  std::atomic<int> finished{0};
  Failures f;
  const std::string label = "R=" + std::to_string(R) + " stage " + std::to_string(stage);
  testing::run_threads(
      R,
      [&](const Group& g) {
        const int r = g.rank();
        A2a a2a(g, config.shape());
        f.add(label + " rank " + std::to_string(r) + " cycle 0",
              testing::run_cycle(a2a, problems[0], r, {}));
        if (r == R - 1) {  // dies
          if (stage == 1) {
            A2aDispatchArgs a;
            const A2aProblem& p = problems[1];
            a.topk_idx = TensorView::contiguous(const_cast<int32_t*>(p.topk_idx[r].data()),
                                                DType::kI32, {p.num_tokens[r], p.top_k});
            for (size_t i = 0; i < p.payloads.size(); ++i) {
              std::vector<int64_t> dims = {p.num_tokens[r]};
              dims.insert(dims.end(), p.payloads[i].row_shape.begin(),
                          p.payloads[i].row_shape.end());
              a.payloads.push_back(TensorView::contiguous(
                  const_cast<uint8_t*>(p.payload[r][i].data()), p.payloads[i].dtype, dims));
            }
            a.runtime_max_tokens_per_rank = p.runtime_max;
            a2a.dispatch(a);
          }
          idle_until(done);
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          testing::run_cycle(a2a, problems[1], r, {});
          ADD_FAILURE() << label << " rank " << r << ": expected Timeout";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          EXPECT_NE(std::string(e.what()).find(stage == 0 ? "a2a dispatch" : "a2a combine"),
                    std::string::npos)
              << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
        try {
          testing::run_cycle(a2a, problems[1], r, {});
          ADD_FAILURE() << label << " rank " << r << ": expected Internal (unusable)";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
          EXPECT_NE(std::string(e.what()).find("set_active_ranks"), std::string::npos) << e.what();
        }
        // Rank 0 runs into one more (timed-out) group barrier; the others wait as long, so all
        // reach set_active_ranks together (it waits 2x the group timeout for the others).
        if (extra_barrier && r == 0) EXPECT_THROW(g.barrier(), Error);
        if (extra_barrier && r != 0) std::this_thread::sleep_for(o.timeout);
        a2a.set_active_ranks(survivors);
        for (int c = 2; c < 5; ++c)
          f.add(label + " rank " + std::to_string(r) + " cycle " + std::to_string(c),
                testing::run_cycle(a2a, problems[c], r, testing::random_options(rng)));
        if (++finished == R - 1) done = true;
      },
      o);
  EXPECT_TRUE(f.text.empty()) << f.text;
}

TEST(A2aMaskDeadPeer, BeforeDispatchThenSurvivorsContinue) {
  for (int R : {2, 3, 4}) dead_peer(R, 0, false);
}
TEST(A2aMaskDeadPeer, BeforeCombineThenSurvivorsContinue) {
  for (int R : {2, 3, 4}) dead_peer(R, 1, false);
}
TEST(A2aMaskDeadPeer, SurvivorsAtDifferentBarrierGenerations) {
  dead_peer(3, 0, true);
  dead_peer(4, 1, true);
}

// Processes (the transport of the Python layer): one mask, then a smaller one.
TEST(A2aMask, ProcessesMatchOracle) {
  std::mt19937_64 rng(609);
  const int R = 3;
  const A2aProblem config = testing::random_config(rng, R);
  std::vector<A2aProblem> problems;
  for (int c = 0; c < 3; ++c) problems.push_back(testing::next_cycle(config, rng));
  problems[1].active = {true, false, true};
  problems[2].active = {false, false, true};
  int rc = testing::run_processes(R, [&](const Group& g) {
    A2a a2a(g, config.shape());
    std::string err = testing::run_cycle(a2a, problems[0], g.rank(), {});
    if (g.rank() != 1) {
      a2a.set_active_ranks(problems[1].active);
      err += testing::run_cycle(a2a, problems[1], g.rank(), {true});
    }
    if (g.rank() == 2) {
      a2a.set_active_ranks(problems[2].active);
      err += testing::run_cycle(a2a, problems[2], g.rank(), {});
    }
    if (!err.empty()) std::fprintf(stderr, "rank %d:\n%s\n", g.rank(), err.c_str());
    return err.empty() ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
}

// ---- validation --------------------------------------------------------------------------------

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(A2aMaskErrors, ArgumentsAreValidated) {
  std::mt19937_64 rng(610);
  const A2aProblem config = testing::random_config(rng, 2);
  testing::run_threads(2, [&](const Group& g) {
    A2a a2a(g, config.shape());
    expect_error([&] { a2a.set_active_ranks({true}); }, ErrorCode::kInvalidArgument,
                 "argument 'active' has 1 entries, expected 2");
    std::vector<bool> self_off(2, true);
    self_off[g.rank()] = false;
    expect_error([&] { a2a.set_active_ranks(self_off); }, ErrorCode::kInvalidArgument,
                 "argument 'active[" + std::to_string(g.rank()) + "]' (this rank) is false");
    EXPECT_EQ(a2a.active_ranks(), std::vector<bool>(2, true));  // unchanged
    EXPECT_EQ(a2a.dropped_tokens(), 0);
    // Alone from here on; the other rank cannot come back.
    std::vector<bool> alone(2, false);
    alone[g.rank()] = true;
    a2a.set_active_ranks(alone);
    const int other = 1 - g.rank();
    expect_error([&] { a2a.set_active_ranks({true, true}); }, ErrorCode::kInvalidArgument,
                 "argument 'active[" + std::to_string(other) + "]' is true but rank " +
                     std::to_string(other) + " was marked inactive earlier");
    EXPECT_EQ(a2a.active_ranks(), alone);
  });
}

// Rank 2 applies another mask than ranks 0 and 1: it raises InvalidArgument naming the argument;
// the others (whose masks agree) go on without it. `late`: rank 2 calls only after the others
// finished their whole cycle (their barriers ran ahead of anything rank 2 can wait for; this
// order used to leave rank 2 waiting for them until the timeout) — they keep their A2a until
// rank 2 is done, since it reads their headers.
TEST(A2aMaskErrors, MasksDifferingAcrossActiveRanks) {
  for (const bool late : {false, true}) {
    SCOPED_TRACE(late ? "rank 2 late" : "rank 2 at once");
    std::mt19937_64 rng(611);
    const A2aProblem config = testing::random_config(rng, 3);
    A2aProblem p = testing::next_cycle(config, rng);
    p.active = {true, true, false};
    Failures f;
    std::atomic<int> cycles_done{0};
    std::atomic<bool> rank2_done{false};
    auto wait_for = [](auto done) {  // bounded: a missing signal fails the test, never hangs it
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!done() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return done();
    };
    const auto start = std::chrono::steady_clock::now();
    testing::run_threads(3, [&](const Group& g) {
      A2a a2a(g, config.shape());
      if (g.rank() == 2) {
        if (late) EXPECT_TRUE(wait_for([&] { return cycles_done.load() == 2; }));
        expect_error([&] { a2a.set_active_ranks({true, true, true}); },
                     ErrorCode::kInvalidArgument, "argument 'active' differs across ranks");
        rank2_done = true;
        return;
      }
      a2a.set_active_ranks(p.active);
      f.add("rank " + std::to_string(g.rank()), testing::run_cycle(a2a, p, g.rank(), {}));
      ++cycles_done;
      if (late) EXPECT_TRUE(wait_for([&] { return rank2_done.load(); }));
    });
    EXPECT_TRUE(f.text.empty()) << f.text;
    // No rank waited for a timeout (the group's default is 30 s).
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
}

// Two ranks share the mask that differs: ranks 0 and 1 apply {1, 1, 1}, rank 2 {1, 0, 1} (and,
// in the second round, ranks 0 and 1 of four apply {1, 1, 0, 0}, ranks 2 and 3 {1, 1, 1, 1}).
// Every rank that sees a difference raises InvalidArgument, none waits for a timeout, and ranks
// that agree among themselves go on (here none does in round 1; ranks 0 and 1 in round 2). The
// ranks sharing a mask must not adopt different epochs while a differing rank's counter moves.
TEST(A2aMaskErrors, MasksDifferingWithSharedOddMask) {
  struct Round {
    int R;
    std::vector<std::vector<bool>> masks;
    std::vector<bool> raises;
  };
  const std::vector<Round> rounds = {
      {3, {{true, true, true}, {true, true, true}, {true, false, true}}, {true, true, true}},
      {4,
       {{true, true, false, false},
        {true, true, false, false},
        {true, true, true, true},
        {true, true, true, true}},
       {false, false, true, true}}};
  for (const Round& round : rounds) {
    for (int repeat = 0; repeat < 20; ++repeat) {  // different interleavings
      SCOPED_TRACE("R = " + std::to_string(round.R) + ", repeat " + std::to_string(repeat));
      std::mt19937_64 rng(613 + repeat);
      const A2aProblem config = testing::random_config(rng, round.R);
      GroupOptions o;
      o.timeout = std::chrono::milliseconds(3000);
      const auto start = std::chrono::steady_clock::now();
      testing::run_threads(
          round.R,
          [&](const Group& g) {
            A2a a2a(g, config.shape());
            const std::vector<bool>& mine = round.masks[g.rank()];
            if (round.raises[g.rank()]) {
              expect_error([&] { a2a.set_active_ranks(mine); }, ErrorCode::kInvalidArgument,
                           "argument 'active' differs across ranks");
            } else {
              a2a.set_active_ranks(mine);
              EXPECT_EQ(a2a.active_ranks(), mine);
            }
          },
          o);
      // A timeout would take 2 x 3 s.
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    }
  }
}

}  // namespace
}  // namespace epx
