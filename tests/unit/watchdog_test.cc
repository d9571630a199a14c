// core/watchdog.h: the bound the NCCL rail puts on host calls that take no timeout
// (ncclGroupEnd, ncclCommFinalize), run here with plain blocking calls in place of NCCL's.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "core/watchdog.h"

namespace epx::detail {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// A call that blocks until released, and the expire() that releases it (the role of
// ncclCommAbort for a blocked ncclGroupEnd).
struct Blocker {
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::atomic<int> expirations{0};
  void block() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return released; });
    released = false;  // the next block() blocks again
  }
  void release() {
    ++expirations;
    {
      std::lock_guard<std::mutex> lock(mu);
      released = true;
    }
    cv.notify_all();
  }
};

TEST(Watchdog, CallsThatReturnInTimeAreNotExpired) {
  Blocker b;
  Watchdog dog([&] { b.release(); });
  int ran = 0;
  // Deadlines far above the calls' time, so a loaded machine's scheduling delays do not reach them.
  for (int i = 0; i < 200; ++i) EXPECT_FALSE(dog.run(milliseconds(200), [&] { ++ran; }));
  EXPECT_EQ(ran, 200);
  std::this_thread::sleep_for(milliseconds(300));  // past every deadline: nothing fires late
  EXPECT_EQ(b.expirations.load(), 0);
}

TEST(Watchdog, BlockedCallIsEndedByExpireAndReported) {
  Blocker b;
  Watchdog dog([&] { b.release(); });
  for (int round = 1; round <= 3; ++round) {
    const auto start = Clock::now();
    EXPECT_TRUE(dog.run(milliseconds(50), [&] { b.block(); })) << round;
    const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    EXPECT_GE(took, 50) << round;
    EXPECT_LT(took, 5000) << round;
    EXPECT_EQ(b.expirations.load(), round);
    // The next call that returns in time is not reported (no late expiry of an earlier run).
    EXPECT_FALSE(dog.run(milliseconds(1000), [] {})) << round;
  }
}

TEST(Watchdog, ExceptionsPropagateAndDisarm) {
  Blocker b;
  Watchdog dog([&] { b.release(); });
  // A process's first throw may take tens of ms on a loaded machine (the unwinder reads the
  // binary's unwind tables): the bound is far above that, and checked.
  constexpr int kTimeoutMs = 500;
  const auto start = Clock::now();
  EXPECT_THROW(dog.run(milliseconds(kTimeoutMs), [] { throw std::runtime_error("call failed"); }),
               std::runtime_error);
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
  ASSERT_LT(took, kTimeoutMs) << "the throwing call outlived its bound: nothing to check";
  std::this_thread::sleep_for(milliseconds(kTimeoutMs - took + 200));  // past the deadline
  EXPECT_EQ(b.expirations.load(), 0);
}

}  // namespace
}  // namespace epx::detail
