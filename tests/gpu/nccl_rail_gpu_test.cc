// GPU tier: the NCCL rail (src/transport/nccl_rail.h) and the node communicator's transport
// (make_nccl_node_transport) on two GPUs of one host, each GPU a "node" of one rank, NCCL forced
// onto its socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo, set in
// each forked rank before NCCL starts), as docs/design.md §13 plans the rail's test without a
// cluster. Each rank: a parent communicator (ncclCommInitRank), the rail split from it, then
//   * Exchange: random chunks of fixed sizes both ways, poisoned receives, every byte checked;
//   * GraphReplay: the exchange captured in a CUDA graph, replayed with new data three times;
//   * PartnerNeverPosts: rank 1 skips an exchange; rank 0's host call or its bounded stream wait
//     times out, RailTransport::abort() ends NCCL's kernels, later exchanges raise Internal;
//   * NodeTransport: the node communicator of 2 x 1 (one rank each) and of 1 x 2 (both GPUs,
//     P2P on): its size and rank, a symmetric allocation and a barrier.
// The host logic (split colors, plan, checks) is tests/unit/rail_plan_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/error.h"
#include "epx/group.h"
#include "gpu/gpu_support.h"
#include "transport/nccl_rail.h"
#include "transport/nccl_transport.h"

namespace epx {
namespace {

using detail::RailChunk;
using detail::RailTransport;
using detail::Topology;
using std::chrono::milliseconds;

constexpr int kRanks = 2;

// Runs body(rank, parent communicator) on two forked ranks, GPU r each; `sockets`: NCCL's socket
// transport only (each GPU a node). Returns 0 when both bodies returned 0.
int run_two_ranks(bool sockets, const std::function<int(int, ncclComm_t)>& body) {
  static int counter = 0;
  const std::string path =
      "/tmp/epx-rail-test-uid-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::remove(path.c_str());
  const int rc = launch_local(
      kRanks,
      [&](int rank) {
        if (sockets) {  // before NCCL reads its environment in this process
          setenv("NCCL_P2P_DISABLE", "1", 1);
          setenv("NCCL_SHM_DISABLE", "1", 1);
          setenv("NCCL_SOCKET_IFNAME", "lo", 1);
        }
        CUDA_OK(cudaSetDevice(rank));
        const UniqueId id = exchange_unique_id_via_file(path, rank, milliseconds(60000));
        ncclUniqueId nid;
        std::memcpy(nid.internal, id.bytes.data(), sizeof(nid.internal));
        ncclComm_t parent = nullptr;
        if (ncclCommInitRank(&parent, kRanks, nid, rank) != ncclSuccess) {
          std::fprintf(stderr, "[rank %d] ncclCommInitRank failed\n", rank);
          return 1;
        }
        const int out = body(rank, parent);
        ncclCommDestroy(parent);
        return out;
      },
      std::chrono::minutes(3));
  std::remove(path.c_str());
  return rc;
}

// Waits for `stream` up to `limit`; false when it has not completed by then.
bool wait_for(cudaStream_t stream, milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (cudaStreamQuery(stream) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

// Device chunks of one rank: what it sends to the other node and where it receives from it.
struct Chunks {
  size_t bytes;
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  explicit Chunks(size_t b) : bytes(b) {
    CUDA_OK(cudaMalloc(&send, bytes));
    CUDA_OK(cudaMalloc(&recv, bytes));
  }
  ~Chunks() {
    cudaFree(send);
    cudaFree(recv);
  }
  // Fresh random bytes of `rank` at round `round` into send (host copy returned), recv poisoned.
  std::vector<uint8_t> refill(int rank, int round, cudaStream_t stream) {
    std::vector<uint8_t> host(bytes);
    std::mt19937_64 rng(0x5eed + 977 * rank + 131 * round);
    for (auto& b : host) b = static_cast<uint8_t>(rng());
    CUDA_OK(cudaMemcpyAsync(send, host.data(), bytes, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaMemsetAsync(recv, 0xA5, bytes, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    return host;
  }
  std::vector<RailChunk> sends(int node) const { return {{node, send, bytes}}; }
  std::vector<RailChunk> recvs(int node) const { return {{node, recv, bytes}}; }
  // Rank `from`'s bytes of `round` (what this rank must have received): 0 when equal.
  int check(int rank, int from, int round) const {
    std::vector<uint8_t> got(bytes), want(bytes);
    CUDA_OK(cudaMemcpy(got.data(), recv, bytes, cudaMemcpyDeviceToHost));
    std::mt19937_64 rng(0x5eed + 977 * from + 131 * round);
    for (auto& b : want) b = static_cast<uint8_t>(rng());
    for (size_t i = 0; i < bytes; ++i) {
      if (got[i] != want[i]) {
        std::fprintf(stderr, "[rank %d] round %d: byte %zu is %d, expected %d (from rank %d)\n",
                     rank, round, i, got[i], want[i], from);
        return 1;
      }
    }
    return 0;
  }
};

constexpr Topology kTwoNodes{2, 1};
constexpr size_t kMaxChunk = size_t(3) << 20;

TEST(NcclRail, Exchange) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(0, run_two_ranks(true, [](int rank, ncclComm_t parent) {
              auto rail =
                  detail::make_nccl_rail(parent, kTwoNodes, kMaxChunk, rank, milliseconds(30000));
              if (rail->bytes_allocated() != 0 || rail->max_chunk_bytes() != kMaxChunk) return 1;
              cudaStream_t stream;
              CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
              int failures = 0;
              // Sizes as the algorithms' legs: the same on both ranks, odd ones included.
              for (size_t bytes : {size_t(1), size_t(4099), size_t(1) << 20, kMaxChunk}) {
                Chunks c(bytes);
                for (int round = 0; round < 2; ++round) {
                  c.refill(rank, round, stream);
                  rail->exchange("test (rail)", c.sends(1 - rank), c.recvs(1 - rank), stream);
                  if (!wait_for(stream, milliseconds(30000))) return 1;
                  failures += c.check(rank, 1 - rank, round);
                }
              }
              cudaStreamDestroy(stream);
              return failures;
            }));
}

TEST(NcclRail, GraphReplay) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(0, run_two_ranks(true, [](int rank, ncclComm_t parent) {
              auto rail =
                  detail::make_nccl_rail(parent, kTwoNodes, kMaxChunk, rank, milliseconds(30000));
              cudaStream_t stream;
              CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
              Chunks c(size_t(1) << 18);
              // One eager exchange first (NCCL connects the peers outside the capture).
              c.refill(rank, 0, stream);
              rail->exchange("test (rail)", c.sends(1 - rank), c.recvs(1 - rank), stream);
              if (!wait_for(stream, milliseconds(30000))) return 1;
              int failures = c.check(rank, 1 - rank, 0);
              cudaGraph_t graph;
              cudaGraphExec_t exec;
              CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
              rail->exchange("test (rail, captured)", c.sends(1 - rank), c.recvs(1 - rank), stream);
              CUDA_OK(cudaStreamEndCapture(stream, &graph));
              CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
              for (int round = 1; round <= 3; ++round) {
                c.refill(rank, round, stream);
                CUDA_OK(cudaGraphLaunch(exec, stream));
                if (!wait_for(stream, milliseconds(30000))) return 1;
                failures += c.check(rank, 1 - rank, round);
              }
              cudaGraphExecDestroy(exec);
              cudaGraphDestroy(graph);
              cudaStreamDestroy(stream);
              return failures;
            }));
}

TEST(NcclRail, PartnerNeverPosts) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(0, run_two_ranks(true, [](int rank, ncclComm_t parent) {
              const milliseconds timeout(2000);
              auto rail = detail::make_nccl_rail(parent, kTwoNodes, kMaxChunk, rank, timeout);
              cudaStream_t stream;
              CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
              Chunks c(size_t(1) << 16);
              c.refill(rank, 0, stream);
              rail->exchange("test (rail)", c.sends(1 - rank), c.recvs(1 - rank), stream);
              if (!wait_for(stream, milliseconds(30000)) || c.check(rank, 1 - rank, 0)) return 1;
              if (rank == 1) {  // never posts the second exchange; stays until rank 0 is done
                std::this_thread::sleep_for(milliseconds(8000));
                rail->abort();
                return 0;
              }
              bool timed_out = false;
              try {
                rail->exchange("test (rail, alone)", c.sends(1), c.recvs(1), stream);
                // Posted: the kernels wait for rank 1 on the device; the caller bounds that.
                timed_out = !wait_for(stream, 2 * timeout);
                if (!timed_out) {
                  std::fprintf(stderr, "[rank 0] the exchange completed without its partner\n");
                  return 1;
                }
                rail->abort();
              } catch (const Error& e) {
                timed_out = e.code() == ErrorCode::kTimeout;  // the host call itself waited
                std::fprintf(stderr, "[rank 0] exchange: %s\n", e.what());
              }
              if (!timed_out) return 1;
              cudaStreamSynchronize(stream);  // returns: the abort ended NCCL's kernels
              try {
                rail->exchange("test (rail, after abort)", c.sends(1), c.recvs(1), stream);
                std::fprintf(stderr, "[rank 0] an exchange on an aborted rail ran\n");
                return 1;
              } catch (const Error& e) {
                if (e.code() != ErrorCode::kInternal) return 1;
              }
              return 0;
            }));
}

TEST(NcclRail, NodeTransport) {
  EPX_REQUIRE_GPUS(2);
  // 2 nodes of 1 (sockets between them) and 1 node of 2 (the GPUs' P2P inside the node).
  for (const Topology t : {Topology{2, 1}, Topology{1, 2}}) {
    EXPECT_EQ(
        0, run_two_ranks(
               t.num_nodes == 2,
               [t](int rank, ncclComm_t parent) {
                 auto node = detail::make_nccl_node_transport(parent, t, rank, milliseconds(30000));
                 if (node->size() != t.ranks_per_node || node->rank() != t.local_of(rank)) {
                   std::fprintf(stderr, "[rank %d] node transport is rank %d of %d\n", rank,
                                node->rank(), node->size());
                   return 1;
                 }
                 auto mem = node->allocate(4096);
                 node->barrier("test (node transport)");
                 // The rail of the same topology: with one node it has nothing to exchange.
                 auto rail = detail::make_nccl_rail(parent, t, 4096, rank, milliseconds(30000));
                 if (t.num_nodes == 1) rail->exchange("test (one node)", {}, {}, nullptr);
                 return mem->bytes() == 4096 ? 0 : 1;
               }))
        << t.num_nodes << " x " << t.ranks_per_node;
  }
}

}  // namespace
}  // namespace epx
