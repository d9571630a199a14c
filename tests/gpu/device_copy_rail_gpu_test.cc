// GPU tier: the device-copy rail (src/transport/device_copy_rail.h), the rail of "virtual nodes"
// in the one-GPU multi-rank mode (Group::cuda_shared_device), at 2 x 2, 2 x 4 and 4 x 2. Each
// rank of node n exchanges with the rank of its local index on every other node m a chunk of a
// size drawn for the pair {n, m} (1 byte to 3 MB, odd sizes and unaligned addresses included),
// fresh random bytes per round, receives poisoned, every byte checked against the partner's.
//   * Exchange: four rounds, eager, every topology;
//   * GraphReplay: the exchange captured in a CUDA graph between eager ones, replayed with new
//     data three times (the exchange number lives on the device);
//   * Straggler: a rank skips an exchange; its partner raises Timeout within the bound (no hang),
//     then OutOfStep until reset(); the others complete; after reset() on every rank all exact;
//   * OtherLeg: two partners at the same exchange number but different legs both raise
//     OutOfStep naming both legs; after reset() all exact;
//   * GpusOfTheirOwn: a group whose ranks have GPUs of their own is refused (Unsupported).
// The host logic (plan, checks) is tests/unit/rail_plan_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/group.h"
#include "gpu/gpu_support.h"
#include "transport/device_copy_rail.h"
#include "transport/transport.h"

namespace epx {
namespace {

using detail::RailChunk;
using detail::RailTransport;
using detail::Topology;
using gpu_testing::rank_stream;

constexpr size_t kMaxChunk = size_t(3) << 20;

GroupOptions with_timeout(int ms) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(ms);
  return o;
}

// Bytes of the chunk between nodes n and m (the same both ways, as every algorithm leg) in
// `round`: from 1 byte to kMaxChunk.
size_t pair_bytes(int n, int m, int round) {
  static const size_t kSizes[] = {1, 7, 4099, size_t(1) << 16, (size_t(1) << 20) + 3, kMaxChunk};
  const int a = std::min(n, m), b = std::max(n, m);
  return kSizes[(a * 5 + b * 3 + round) % 6];
}

// The bytes rank `from` sends to node `to` in `round`.
std::vector<uint8_t> payload(int from, int to, int round, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  std::mt19937_64 rng(0x7a11 + 977 * from + 131 * to + 7919 * round);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// One rank's chunks with every other node: device buffers of kMaxChunk + 16 bytes (so a chunk
// can start one byte in: the kernel's unaligned path), allocated once.
class RankChunks {
 public:
  RankChunks(const Group& group, Topology t) : group_(group), t_(t) {
    for (int m = 0; m < t.num_nodes; ++m) {
      send_.push_back(alloc());
      recv_.push_back(alloc());
    }
  }
  // Fresh payloads and poisoned receives for `round` (offset 1 on odd rounds); the chunks.
  void refill(int round, std::vector<RailChunk>& sends, std::vector<RailChunk>& recvs) {
    sends.clear();
    recvs.clear();
    const int n = t_.node_of(group_.rank()), off = round % 2;
    for (int m = 0; m < t_.num_nodes; ++m) {
      if (m == n) continue;
      const size_t bytes = pair_bytes(n, m, round);
      char* s = static_cast<char*>(send_[m].data) + off;
      char* r = static_cast<char*>(recv_[m].data) + off;
      const std::vector<uint8_t> host = payload(group_.rank(), m, round, bytes);
      gpu_testing::upload_on_rank_stream(s, host.data(), bytes, rank_stream());
      CUDA_OK(cudaMemsetAsync(r, 0xA5, bytes, rank_stream()));
      sends.push_back({m, s, bytes});
      recvs.push_back({m, r, bytes});
    }
    CUDA_OK(cudaStreamSynchronize(rank_stream()));
  }
  // Failures: every received byte against the partner's payload of `round`.
  int check(int round) const {
    const int me = group_.rank(), n = t_.node_of(me), g = t_.local_of(me), off = round % 2;
    int failures = 0;
    for (int m = 0; m < t_.num_nodes; ++m) {
      if (m == n) continue;
      const size_t bytes = pair_bytes(n, m, round);
      const int partner = t_.rank_of(m, g);
      const std::vector<uint8_t> want = payload(partner, n, round, bytes);
      std::vector<uint8_t> got(bytes);
      CUDA_OK(cudaMemcpyAsync(got.data(), static_cast<char*>(recv_[m].data) + off, bytes,
                              cudaMemcpyDeviceToHost, rank_stream()));
      CUDA_OK(cudaStreamSynchronize(rank_stream()));
      for (size_t i = 0; i < bytes; ++i) {
        if (got[i] != want[i]) {
          std::fprintf(stderr, "[rank %d] round %d: byte %zu of %zu from rank %d is %d, want %d\n",
                       me, round, i, bytes, partner, got[i], want[i]);
          ++failures;
          break;
        }
      }
    }
    return failures;
  }

 private:
  Tensor alloc() const {
    return gpu_testing::device_allocator()(DType::kU8, {int64_t(kMaxChunk + 16)},
                                           Device::cuda(gpu_testing::device_of(group_)));
  }
  const Group& group_;
  Topology t_;
  std::vector<Tensor> send_, recv_;
};

// One exchange of `round` on every rank, checked.
int exchange_round(RailTransport& rail, RankChunks& c, int round,
                   const char* what = "test (rail)") {
  std::vector<RailChunk> sends, recvs;
  c.refill(round, sends, recvs);
  rail.exchange(what, sends, recvs, rank_stream());
  CUDA_OK(cudaStreamSynchronize(rank_stream()));
  rail.check();
  return c.check(round);
}

// Every rank: stream drained, then the rail's reset between a resync (a rank may arrive a
// timeout late: its wait timed out) and a barrier, as an owner's reset does.
void reset_all(const Group& group, RailTransport& rail) {
  CUDA_OK(cudaStreamSynchronize(rank_stream()));
  const auto& t = group.transport();
  t->resync("test (rail reset)", t->all_members(), 4 * group.timeout());
  rail.reset();
  group.transport()->barrier("test (after rail reset)");
}

// The code `body` raised, or kInternal with a note when it raised nothing.
ErrorCode code_of(const std::function<void()>& body, int rank, const char* what) {
  try {
    body();
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] %s: %s\n", rank, what, e.what());
    return e.code();
  }
  std::fprintf(stderr, "[rank %d] %s raised nothing\n", rank, what);
  return ErrorCode::kInternal;
}

int run_virtual_nodes(Topology t, int timeout_ms,
                      const std::function<int(const Group&, RailTransport&, RankChunks&)>& body) {
  const int R = t.num_nodes * t.ranks_per_node;
  return gpu_testing::run_cuda_ranks_one_gpu(
      R, 0,
      [&](const Group& group) {
        auto rail = detail::make_device_copy_rail(group, t, kMaxChunk);
        if (rail->max_chunk_bytes() != kMaxChunk || rail->bytes_allocated() == 0) return 1;
        RankChunks chunks(group, t);
        const int rc = body(group, *rail, chunks);
        CUDA_OK(cudaStreamSynchronize(rank_stream()));
        return rc;
      },
      with_timeout(timeout_ms));
}

const Topology kTopologies[] = {{2, 2}, {2, 4}, {4, 2}};

TEST(DeviceCopyRail, Exchange) {
  EPX_REQUIRE_GPUS(1);
  for (const Topology t : kTopologies) {
    EXPECT_EQ(0, run_virtual_nodes(t, 30000,
                                   [](const Group&, RailTransport& rail, RankChunks& c) {
                                     int failures = 0;
                                     for (int round = 0; round < 4; ++round)
                                       failures += exchange_round(rail, c, round);
                                     return failures;
                                   }))
        << t.num_nodes << " x " << t.ranks_per_node;
  }
}

TEST(DeviceCopyRail, GraphReplay) {
  EPX_REQUIRE_GPUS(1);
  for (const Topology t : {Topology{2, 2}, Topology{4, 2}}) {
    EXPECT_EQ(
        0, run_virtual_nodes(
               t, 30000,
               [](const Group&, RailTransport& rail, RankChunks& c) {
                 int failures = exchange_round(rail, c, 0);
                 // Captured with round 1's chunks; rounds 7 and 13 have the same sizes and offset
                 // (pair_bytes, refill), so the replays refill the captured addresses.
                 std::vector<RailChunk> sends, recvs;
                 c.refill(1, sends, recvs);
                 cudaGraph_t graph;
                 cudaGraphExec_t exec;
                 CUDA_OK(cudaStreamBeginCapture(rank_stream(), cudaStreamCaptureModeThreadLocal));
                 rail.exchange("test (rail, captured)", sends, recvs, rank_stream());
                 CUDA_OK(cudaStreamEndCapture(rank_stream(), &graph));
                 CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
                 for (int round : {1, 7, 13}) {
                   c.refill(round, sends, recvs);
                   CUDA_OK(cudaGraphLaunch(exec, rank_stream()));
                   CUDA_OK(cudaStreamSynchronize(rank_stream()));
                   rail.check();
                   failures += c.check(round);
                 }
                 cudaGraphExecDestroy(exec);
                 cudaGraphDestroy(graph);
                 failures += exchange_round(rail, c, 2);  // eager again: the next number
                 return failures;
               }))
        << t.num_nodes << " x " << t.ranks_per_node;
  }
}

// 2 x 2: rank 3 (node 1, local 1) skips the second exchange; its partner rank 1 times out.
TEST(DeviceCopyRail, Straggler) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(
      0,
      run_virtual_nodes({2, 2}, 2000, [](const Group& group, RailTransport& rail, RankChunks& c) {
        const int me = group.rank();
        int failures = exchange_round(rail, c, 0);
        const auto start = std::chrono::steady_clock::now();
        if (me == 1) {
          if (code_of([&] { exchange_round(rail, c, 1); }, me, "exchange without partner") !=
              ErrorCode::kTimeout)
            ++failures;
          if (std::chrono::steady_clock::now() - start > std::chrono::seconds(20)) ++failures;
          if (code_of([&] { exchange_round(rail, c, 2); }, me, "exchange after timeout") !=
              ErrorCode::kOutOfStep)
            ++failures;
        } else if (me != 3) {
          failures += exchange_round(rail, c, 1);  // ranks 0 and 2: their pair completes
        }
        reset_all(group, rail);
        for (int round = 3; round < 5; ++round) failures += exchange_round(rail, c, round);
        return failures;
      }));
}

// 2 x 2: at the second exchange rank 2 posts another leg than its partner rank 0.
TEST(DeviceCopyRail, OtherLeg) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(0, run_virtual_nodes(
                   {2, 2}, 5000, [](const Group& group, RailTransport& rail, RankChunks& c) {
                     const int me = group.rank();
                     int failures = exchange_round(rail, c, 0);
                     if (me == 0 || me == 2) {
                       const char* leg = me == 0 ? "test (dispatch leg)" : "test (combine leg)";
                       if (code_of([&] { exchange_round(rail, c, 1, leg); }, me, "other leg") !=
                           ErrorCode::kOutOfStep)
                         ++failures;
                     } else {
                       failures += exchange_round(rail, c, 1);
                     }
                     reset_all(group, rail);
                     failures += exchange_round(rail, c, 2);
                     return failures;
                   }));
}

TEST(DeviceCopyRail, GpusOfTheirOwn) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(0, gpu_testing::run_cuda_ranks(2, [](const Group& group) {
              const ErrorCode code = code_of(
                  [&] {
                    detail::make_device_copy_rail(group, Topology{2, 1}, 4096);
                  },
                  group.rank(), "device-copy rail across GPUs");
              return code == ErrorCode::kUnsupported ? 0 : 1;
            }));
}

}  // namespace
}  // namespace epx
