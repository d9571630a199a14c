// Group and cpu transport: join, barrier, timeout naming the missing rank, processes.
#include <gtest/gtest.h>

#include <thread>

#include "epx/error.h"
#include "epx/group.h"
#include "support/harness.h"
#include "transport/transport.h"

namespace epx {
namespace {

TEST(Group, ThreadsJoinAndBarrier) {
  for (int R : {1, 2, 3, 4, 8}) {
    testing::run_threads(R, [&](const Group& g) {
      EXPECT_EQ(g.size(), R);
      EXPECT_EQ(g.backend(), Backend::kCpu);
      for (int i = 0; i < 20; ++i) g.barrier();
    });
  }
}

TEST(Group, SymmetricMemoryVisibleToPeers) {
  testing::run_threads(4, [](const Group& g) {
    auto mem = g.transport()->allocate(4096);
    static_cast<int*>(mem->local())[0] = 100 + g.rank();
    g.barrier();
    for (int p = 0; p < g.size(); ++p) EXPECT_EQ(static_cast<int*>(mem->peer(p))[0], 100 + p);
    g.barrier();
  });
}

TEST(Group, ProcessesExchangeThroughSharedMemory) {
  int rc = testing::run_processes(4, [](const Group& g) {
    auto mem = g.transport()->allocate(1 << 20);
    static_cast<int*>(mem->local())[1000] = 7 * g.rank() + 1;
    g.barrier();
    int bad = 0;
    for (int p = 0; p < g.size(); ++p) bad += static_cast<int*>(mem->peer(p))[1000] != 7 * p + 1;
    g.barrier();
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

TEST(Group, MissingRankTimesOutNamingIt) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(300);
  const std::string name = testing::unique_group_name("timeout");
  // Rank 1 joins, then never calls the barrier rank 0 waits in.
  std::thread other([&] { Group g = Group::cpu_threads(1, 2, name, o); });
  Group g = Group::cpu_threads(0, 2, name, o);
  other.join();
  auto start = std::chrono::steady_clock::now();
  try {
    g.barrier();
    FAIL() << "expected Timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("ranks [1]"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(Group, RankThatNeverJoinsTimesOut) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(200);
  try {
    Group::cpu_threads(0, 3, testing::unique_group_name("nojoin"), o);
    FAIL() << "expected Timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("ranks [1, 2]"), std::string::npos) << e.what();
  }
}

TEST(Group, AbortEndsPeersWaitWithItsReason) {
  GroupOptions o;
  o.timeout = std::chrono::seconds(20);
  EXPECT_THROW(
      {
        try {
          testing::run_threads(2, [](const Group& g) {
            if (g.rank() == 1) {
              g.transport()->abort("rank 1 found a bad thing");
              return;
            }
            g.barrier();
          }, o);
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInternal);
          EXPECT_NE(std::string(e.what()).find("bad thing"), std::string::npos);
          throw;
        }
      },
      Error);
}

// Several ranks abort at once: the waiting rank's error names one of them and quotes that rank's
// own reason (the first abort() wins; a later one must not rewrite the message being read).
TEST(Group, ConcurrentAbortsQuoteTheRankTheyName) {
  GroupOptions o;
  o.timeout = std::chrono::seconds(20);
  for (int round = 0; round < 10; ++round) {
    std::string seen;
    ErrorCode code = ErrorCode::kInvalidArgument;
    testing::run_threads(
        4,
        [&](const Group& g) {
          if (g.rank() != 0) {
            g.transport()->abort("reason of rank " + std::to_string(g.rank()));
            return;
          }
          try {
            g.barrier();
          } catch (const Error& e) {
            seen = e.what();
            code = e.code();
          }
        },
        o);
    EXPECT_EQ(code, ErrorCode::kInternal) << seen;
    bool consistent = false;
    for (int r = 1; r < 4; ++r) {
      const std::string n = std::to_string(r);
      consistent |= seen.find("rank " + n + " aborted the collective (reason of rank " + n + ")") !=
                    std::string::npos;
    }
    EXPECT_TRUE(consistent) << seen;
  }
}

TEST(Group, BadRankAndSizeAreInvalidArguments) {
  try {
    Group::cpu_threads(2, 2, "x");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'rank' is 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Group::cpu_processes(0, 0, "y"), Error);
}

TEST(Group, CudaWithoutCudaIsUnsupportedOrWorks) {
  // In a build without CUDA this must say so; with CUDA it is covered by the GPU tier.
  try {
    UniqueId id = new_unique_id();
    (void)id;
    GTEST_SKIP() << "built with CUDA/NCCL; the cuda group is tested in the GPU tier";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  }
}

}  // namespace
}  // namespace epx
