// Out-of-step ranks on the cpu backend (docs/semantics.md §4.3). The straggler scenarios
// (tests/support/out_of_step.h) for ht, ht cached, ll, ll with hooks and the Dispatcher: every
// call returns exactly the rows of a fault-free run of the same step or raises Timeout /
// OutOfStep; a rank that timed out refuses its next call until the reset; after the reset a step
// without delays is exact on every rank. And the cases without timeouts: ranks mismatched by
// operation or by call number (two buffers on one group) raise OutOfStep on every rank; a reset
// that never meets a rank times out and a later one recovers.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "support/harness.h"
#include "support/out_of_step.h"

namespace epx {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::StepMode;

constexpr auto kTimeout = 250ms;
constexpr int64_t kH = 128, kTMax = 12;
constexpr int kK = 3, kE = 6;

// ranks_per_node 1: the 3 ranks are 3 nodes (the hierarchical ht and ll, docs/design.md §13).
void run_scenario(StepMode mode, int ranks_per_node = 0) {
  GroupOptions options;
  options.timeout = kTimeout;
  options.ranks_per_node = ranks_per_node;
  const testing::ScenarioReport report = testing::run_out_of_step_scenario(
      mode, kTimeout,
      [&](const std::function<void(const Group&)>& body) {
        testing::run_threads(testing::kOutOfStepRanks, body, options);
      },
      [](const Group&) { return testing::cpu_step_io(); }, {}, ranks_per_node);
  std::printf("%s\n", report.summary(mode).c_str());
  for (const auto& f : report.failures) ADD_FAILURE() << testing::step_mode_name(mode) << ": " << f;
  EXPECT_GT(report.failed_steps, 0) << "no step met a fault";
}

TEST(OutOfStep, HtStragglers) { run_scenario(StepMode::kHt); }
TEST(OutOfStep, HtCachedStragglers) { run_scenario(StepMode::kHtCached); }
TEST(OutOfStep, LlStragglers) { run_scenario(StepMode::kLl); }
TEST(OutOfStep, LlHookStragglers) { run_scenario(StepMode::kLlHook); }
TEST(OutOfStep, DispatcherStragglers) { run_scenario(StepMode::kDispatcher); }
TEST(OutOfStep, HtCachedStragglersAcrossNodes) {
  run_scenario(StepMode::kHtCached, 1);
}
TEST(OutOfStep, LlHookStragglersAcrossNodes) {
  run_scenario(StepMode::kLlHook, 1);
}
TEST(OutOfStep, DispatcherStragglersAcrossNodes) {
  run_scenario(StepMode::kDispatcher, 1);
}

// Random inputs of one rank for the cases below.
struct Input {
  int64_t T = 7;
  std::vector<uint16_t> x;
  std::vector<int64_t> topk;
  explicit Input(int seed) {
    std::mt19937_64 rng(seed);
    x.resize(T * kH);
    for (auto& v : x) v = static_cast<uint16_t>(0x3c00 + rng() % 0x0800);
    topk.resize(T * kK);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < kK; ++k) topk[t * kK + k] = (t + 2 * k) % kE;  // distinct per token
  }
  HtDispatchArgs args() {
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, kK});
    return a;
  }
};

// Two buffers on one group: rank 0 calls the first while rank 1 calls the second. Both pass the
// same barriers; each finds the peer's stamp of its buffer at another call: OutOfStep on both,
// naming the call numbers. After a reset of both buffers, calls in step work.
TEST(OutOfStep, TwoBuffersOnOneGroupNeverPair) {
  testing::run_threads(2, [](const Group& g) {
    const MoeShape shape{kH, kK, kE, kTMax};
    Buffer a(g, shape), b(g, shape);
    Input in(1 + g.rank());
    const HtDispatchArgs args = in.args();
    (void)a.ht_dispatch(args);  // both in step once
    try {
      (void)(g.rank() == 0 ? a : b).ht_dispatch(args);
      ADD_FAILURE() << "rank " << g.rank() << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfStep) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of step"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("call #"), std::string::npos) << e.what();
    }
    a.reset();
    b.reset();
    (void)a.ht_dispatch(args);
    (void)b.ht_dispatch(args);
  });
}

// Different operations at the same call: OutOfStep on both ranks naming both operations; the
// next call in step works.
TEST(OutOfStep, DifferentOperationsNameBoth) {
  testing::run_threads(2, [](const Group& g) {
    Buffer buf(g, MoeShape{kH, kK, kE, kTMax});
    Input in(3 + g.rank());
    const HtDispatchArgs args = in.args();
    HtDispatchResult d = buf.ht_dispatch(args);
    HtCombineArgs c;
    c.y = d.recv_x;
    c.handle = &d.handle;
    try {
      g.rank() == 0 ? (void)buf.ht_dispatch(args) : (void)buf.ht_combine(c);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfStep) << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find(g.rank() == 0 ? "called ht_combine" : "called ht_dispatch"),
                std::string::npos)
          << m;
    }
    (void)buf.ht_combine(c);
  });
}

// A reset that meets a rank which never comes fails with Timeout (bounded), leaves the buffer
// refusing, and a later reset with every rank succeeds.
TEST(OutOfStep, ResetWithoutEveryRankTimesOutThenRecovers) {
  GroupOptions o;
  o.timeout = kTimeout;
  testing::run_threads(
      2,
      [](const Group& g) {
        Buffer buf(g, MoeShape{kH, kK, kE, kTMax});
        Input in(5 + g.rank());
        const HtDispatchArgs args = in.args();
        if (g.rank() == 0) {
          EXPECT_THROW(buf.ht_dispatch(args), Error);  // rank 1 is not there: Timeout
          const auto t0 = Clock::now();
          try {
            buf.reset();
            ADD_FAILURE() << "reset without rank 1 succeeded";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          }
          EXPECT_LT(Clock::now() - t0, 4 * kTimeout);
          try {
            (void)buf.ht_dispatch(args);
            ADD_FAILURE() << "no refusal";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kOutOfStep) << e.what();
          }
        } else {
          std::this_thread::sleep_for(5 * kTimeout);  // misses rank 0's dispatch and reset
          try {
            (void)buf.ht_dispatch(args);  // meets rank 0's timed-out publication, then waits
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          }
        }
        // Rank 0 retries until rank 1, out of its dispatch, comes to its first reset: they meet.
        for (int attempt = 0;; ++attempt) {
          try {
            buf.reset();
            break;
          } catch (const Error& e) {
            ASSERT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
            ASSERT_LT(attempt, 4) << "resets never met";
          }
        }
        (void)buf.ht_dispatch(args);
      },
      o);
}

}  // namespace
}  // namespace epx
