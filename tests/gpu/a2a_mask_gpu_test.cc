// GPU tier: the a2a rank mask (A2a::set_active_ranks) on the cuda backend vs the mask-aware oracle
// (tests/support/oracle_a2a.h), R = 1, 2, 4, 8 forked ranks, one GPU each; skipped with the reason
// when the GPUs are missing. Mirrors tests/unit/a2a_mask_test.cc:
//   - a random mask with this rank active (R = 2: all, or each rank alone), outputs and the
//     device drop counters exact, reset_dropped_counts;
//   - a dead peer: rank 1 stops; rank 0 gets Timeout within the group timeout, is refused until
//     it masks rank 1 off, then continues alone bit-exactly;
//   - a captured CUDA graph (dispatch + combine) replayed across a mask change: the graph reads
//     the mask from device memory, no re-capture.
// Outputs are poisoned before each cycle (0xA5 receive views, 0xFF out) and compared element by
// element on the host.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/a2a.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/oracle_a2a.h"
#include "support/routing.h"

namespace epx {
namespace {

using gpu_testing::run_cuda_ranks;
using gpu_testing::to_host_bytes;
using testing::A2aPayloadSpec;
using testing::A2aProblem;

// A small engine-like configuration: hidden states, expert ids (sanitised), weights.
A2aProblem mask_config(int R) {
  A2aProblem p;
  p.num_ranks = R;
  p.top_k = 4;
  p.num_experts = 4 * R;
  p.payloads = {{DType::kBF16, {128}},
                {DType::kI32, {4}, A2aPayloadSpec::Fill::kExpertIds},
                {DType::kF32, {4}, A2aPayloadSpec::Fill::kWeights}};
  p.expert_id_payload_index = 1;
  p.invalid_expert_id = -1;
  p.hidden = 128;
  p.max_tokens_per_rank = 48;
  return p;
}

// Inputs of one cycle: T random per rank, M = max T.
A2aProblem next_problem(const A2aProblem& config, std::mt19937_64& rng,
                        const std::vector<bool>& active) {
  A2aProblem p = config;
  p.num_tokens.resize(p.num_ranks);
  for (auto& t : p.num_tokens) t = static_cast<int64_t>(rng() % (p.max_tokens_per_rank + 1));
  p.runtime_max = std::max<int64_t>(1, *std::max_element(p.num_tokens.begin(), p.num_tokens.end()));
  p.active = active;
  const std::vector<testing::Routing> all = testing::all_routings();
  std::vector<testing::Routing> routing;
  for (int r = 0; r < p.num_ranks; ++r) routing.push_back(all[rng() % all.size()]);
  testing::fill_a2a_inputs(p, routing, rng);
  return p;
}

// Device buffers of rank r's inputs and outputs, sized for the configuration's maximum so a
// captured graph can be fed new problems of the same T.
struct Io {
  Tensor topk, y, out;
  std::vector<Tensor> payloads;
};

Io make_io(const A2aProblem& p, int r, int device) {
  const int64_t T = p.num_tokens[r], M = p.runtime_max;
  Io io;
  auto alloc = gpu_testing::device_allocator();  // rank-stream ordered under one GPU
  io.topk = alloc(DType::kI32, {T, p.top_k}, Device::cuda(device));
  for (const A2aPayloadSpec& s : p.payloads) {
    std::vector<int64_t> dims = {T};
    dims.insert(dims.end(), s.row_shape.begin(), s.row_shape.end());
    io.payloads.push_back(alloc(s.dtype, dims, Device::cuda(device)));
  }
  io.y = alloc(DType::kBF16, {p.num_ranks, M, p.hidden}, Device::cuda(device));
  io.out = alloc(DType::kBF16, {T, p.hidden}, Device::cuda(device));
  return io;
}

// Copies problem p's inputs of rank r into io (stream-ordered) and poisons out.
void upload(const A2aProblem& p, int r, Io& io, cudaStream_t stream) {
  auto h2d = [&](void* dst, const void* src, size_t n) {
    if (gpu_testing::rank_stream()) {  // one GPU: never a pageable copy behind a spinning kernel
      gpu_testing::upload_on_rank_stream(dst, src, n, stream);
    } else if (n) {
      CUDA_OK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream));
    }
  };
  h2d(io.topk.data, p.topk_idx[r].data(), p.topk_idx[r].size() * 4);
  for (size_t i = 0; i < p.payloads.size(); ++i)
    h2d(io.payloads[i].data, p.payload[r][i].data(), p.payload[r][i].size());
  h2d(io.y.data, p.combine_y[r].data(), p.combine_y[r].size());
  if (io.out.nbytes()) CUDA_OK(cudaMemsetAsync(io.out.data, 0xFF, io.out.nbytes(), stream));
}

A2aDispatchArgs args_of(const A2aProblem& p, const Io& io, cudaStream_t stream) {
  A2aDispatchArgs a;
  a.topk_idx = io.topk;
  for (const Tensor& t : io.payloads) a.payloads.push_back(t);
  a.runtime_max_tokens_per_rank = p.runtime_max;
  a.invalid_expert_id = p.invalid_expert_id;
  a.expert_id_payload_index = p.expert_id_payload_index;
  a.stream = stream;
  return a;
}

// Compares what the device holds after a cycle (receive views `res`, io.out) with the oracle.
std::string compare(const A2aProblem& p, int r, const A2aDispatchResult& res, const Io& io) {
  const testing::A2aExpected ex = testing::a2a_oracle(p, r);
  std::vector<std::vector<uint8_t>> bytes;
  A2aDispatchResult host;
  bytes.reserve(res.recv.size() + 2);
  auto view = [&](const TensorView& v) {
    bytes.push_back(to_host_bytes(v));
    return TensorView::contiguous(bytes.back().data(), v.dtype,
                                  std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
  };
  for (const TensorView& v : res.recv) host.recv.push_back(view(v));
  host.recv_counts = view(res.recv_counts);
  std::string err = testing::a2a_compare_dispatch(p, r, ex, host, false);
  err += testing::a2a_compare_combine(p, r, ex, view(io.out));
  return err;
}

// One eager dispatch + combine; poisons the receive views first. "" or what went wrong.
std::string eager_cycle(A2a& a2a, const A2aProblem& p, int r, int device, cudaStream_t stream) {
  Io io = make_io(p, r, device);
  upload(p, r, io, stream);
  A2aDispatchResult res = a2a.dispatch(args_of(p, io, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  a2a.check();
  const Allocator fixed = [&](DType, const std::vector<int64_t>&, Device) { return io.out; };
  a2a.combine(io.y, p.runtime_max, false, stream, fixed);
  CUDA_OK(cudaStreamSynchronize(stream));
  a2a.check();
  std::string err = compare(p, r, res, io);
  for (const TensorView& v : res.recv)
    if (v.nbytes()) CUDA_OK(cudaMemsetAsync(v.data, 0xA5, v.nbytes(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  return err;
}

class A2aMaskGpu : public ::testing::TestWithParam<int> {};

TEST_P(A2aMaskGpu, RandomMaskMatchesOracleAndCounts) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::mt19937_64 rng(31 + R);
  const A2aProblem config = mask_config(R);
  // Per rank: cycles 0-1 all ranks, then its own mask (R = 2: alone) for cycles 2-4.
  std::vector<std::vector<A2aProblem>> problems(R);
  const std::vector<bool> all(R, true);
  for (int c = 0; c < 5; ++c) {
    const uint64_t seed = rng();  // the same inputs for every rank's view of the cycle
    for (int r = 0; r < R; ++r) {
      std::vector<bool> mask = all;
      if (c >= 2)
        for (int q = 0; q < R; ++q) mask[q] = q == r;
      std::mt19937_64 same(seed);
      problems[r].push_back(next_problem(config, same, mask));
    }
  }
  const int rc = run_cuda_ranks(R, [&](const Group& g) {
    const int r = g.rank();
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    A2a a2a(g, config.shape());
    int bad = 0;
    int64_t want_tokens = 0, want_selections = 0;
    for (int c = 0; c < 5; ++c) {
      const A2aProblem& p = problems[r][c];
      if (c == 2) a2a.set_active_ranks(p.active, stream);
      const std::string err = eager_cycle(a2a, p, r, r, stream);
      const testing::A2aExpected ex = testing::a2a_oracle(p, r);
      want_tokens += ex.dropped.tokens;
      want_selections += ex.dropped.selections;
      const A2aDropCounts got = a2a.dropped_counts();
      if (!err.empty() || got.tokens != want_tokens || got.selections != want_selections) {
        ++bad;
        std::fprintf(stderr, "rank %d cycle %d: drops %lld/%lld, expected %lld/%lld\n%s\n", r, c,
                     static_cast<long long>(got.tokens), static_cast<long long>(got.selections),
                     static_cast<long long>(want_tokens),
                     static_cast<long long>(want_selections), err.c_str());
      }
    }
    a2a.reset_dropped_counts(stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    if (a2a.dropped_tokens() != 0) ++bad;
    cudaStreamDestroy(stream);
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

// A graph of dispatch + combine captured once with every rank active, replayed; then every rank
// masks the others off (R = 2: each alone) on the graph's stream, and the same graph is replayed
// on new inputs: it must follow the mask.
TEST_P(A2aMaskGpu, GraphReplayAcrossMaskChange) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::mt19937_64 seed_rng(41);
  const A2aProblem config = mask_config(R);
  const uint64_t seed = seed_rng();
  const int rc = run_cuda_ranks(R, [&](const Group& g) {
    const int r = g.rank();
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    A2a a2a(g, config.shape());
    std::mt19937_64 rng(seed);
    A2aProblem shape_of_calls = next_problem(config, rng, {});
    Io io = make_io(shape_of_calls, r, r);
    upload(shape_of_calls, r, io, stream);
    const Allocator fixed = [&](DType, const std::vector<int64_t>&, Device) { return io.out; };
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    A2aDispatchResult res = a2a.dispatch(args_of(shape_of_calls, io, stream));
    a2a.combine(io.y, shape_of_calls.runtime_max, false, stream, fixed);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    int bad = 0;
    std::vector<bool> alone(R, false);
    alone[r] = true;
    for (int i = 0; i < 8; ++i) {
      if (i == 4) a2a.set_active_ranks(alone, stream);  // stream-ordered before replay 4
      A2aProblem p = next_problem(config, rng, i >= 4 ? alone : std::vector<bool>{});
      p.num_tokens = shape_of_calls.num_tokens;  // the captured T and M
      p.runtime_max = shape_of_calls.runtime_max;
      std::vector<testing::Routing> routing(R, testing::Routing::kUniform);
      testing::fill_a2a_inputs(p, routing, rng);
      upload(p, r, io, stream);
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      std::string err;
      try {
        a2a.check();
        err = compare(p, r, res, io);
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      if (!err.empty()) {
        ++bad;
        std::fprintf(stderr, "graph replay %d rank %d:\n%s\n", i, r, err.c_str());
      }
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, A2aMaskGpu, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

// Rank 1 stops after one cycle. Rank 0: Timeout (within a few group timeouts), Internal until it
// calls set_active_ranks({1, 0}), then it continues alone, bit-exact, with tokens routed to
// rank 1 counted and zero in combine.
TEST(A2aMaskGpuDeadPeer, SurvivorContinuesAlone) {
  EPX_REQUIRE_GPUS(2);
  std::mt19937_64 rng(51);
  const A2aProblem config = mask_config(2);
  std::vector<A2aProblem> problems;
  problems.push_back(next_problem(config, rng, {}));
  problems.push_back(next_problem(config, rng, {}));
  for (int c = 0; c < 3; ++c) problems.push_back(next_problem(config, rng, {true, false}));
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(500);
  const int rc = run_cuda_ranks(
      2,
      [&](const Group& g) {
        const int r = g.rank();
        cudaStream_t stream = nullptr;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        int bad = 0;
        {
          A2a a2a(g, config.shape());
          std::string err = eager_cycle(a2a, problems[0], r, r, stream);
          if (r == 1) {
            // Dead: never calls again. Sleeps long enough for rank 0 to finish, then tears down
            // (destruction is local: no barrier with rank 0).
            std::this_thread::sleep_for(std::chrono::seconds(4));
            return err.empty() ? 0 : 1;
          }
          if (!err.empty()) ++bad, std::fprintf(stderr, "cycle 0: %s\n", err.c_str());
          const auto start = std::chrono::steady_clock::now();
          try {
            eager_cycle(a2a, problems[1], r, r, stream);
            ++bad, std::fprintf(stderr, "expected Timeout\n");
          } catch (const Error& e) {
            if (e.code() != ErrorCode::kTimeout) ++bad, std::fprintf(stderr, "%s\n", e.what());
          }
          if (std::chrono::steady_clock::now() - start > std::chrono::seconds(4))
            ++bad, std::fprintf(stderr, "the Timeout took too long\n");
          try {
            eager_cycle(a2a, problems[1], r, r, stream);
            ++bad, std::fprintf(stderr, "expected Internal (unusable)\n");
          } catch (const Error& e) {
            if (e.code() != ErrorCode::kInternal) ++bad, std::fprintf(stderr, "%s\n", e.what());
          }
          a2a.set_active_ranks({true, false}, stream);
          for (int c = 2; c < 5; ++c) {
            try {
              err = eager_cycle(a2a, problems[c], r, r, stream);
            } catch (const std::exception& e) {
              err = std::string("exception: ") + e.what();
            }
            if (!err.empty()) ++bad, std::fprintf(stderr, "cycle %d: %s\n", c, err.c_str());
          }
        }
        cudaStreamDestroy(stream);
        return bad;
      },
      o);
  EXPECT_EQ(rc, 0);
}

// Three ranks sharing GPU 0: ranks 0 and 1 apply {1, 1, 0} and run a cycle; rank 2 applies
// {1, 1, 1} (it counts ranks that do not count it), at once or `late` (after the others' cycle).
// Rank 2's check() raises InvalidArgument naming the argument within a few seconds — its
// resynchronisation sees their published masks leave it out instead of waiting 2x the group
// timeout for them —; ranks 0 and 1 go on bit-exactly. (tests/unit/a2a_mask_test.cc's
// MasksDifferingAcrossActiveRanks on the cpu backend.)
TEST(A2aMaskOneGpu, MasksDifferingAcrossActiveRanks) {
  EPX_REQUIRE_GPUS(1);
  for (const bool late : {false, true}) {
    SCOPED_TRACE(late ? "rank 2 late" : "rank 2 at once");
    std::mt19937_64 rng(612);
    const A2aProblem config = mask_config(3);
    const A2aProblem p = next_problem(config, rng, {true, true, false});
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(10000);  // a Timeout would take 20 s: the test bounds 8
    const int rc = gpu_testing::run_cuda_ranks_one_gpu(
        3, 0,
        [&](const Group& g) {
          const int r = g.rank(), device = gpu_testing::device_of(g);
          cudaStream_t stream = gpu_testing::rank_stream();
          // The ranks' threads share this process: a flag in it orders rank 2 after the others.
          static std::atomic<int> cycles_done{0};
          if (r == 0) cycles_done = 0;
          A2a a2a(g, config.shape());  // collective: every rank passed the reset above
          int bad = 0;
          if (r == 2) {
            const auto start = std::chrono::steady_clock::now();
            while (late && cycles_done.load() < 2 &&
                   std::chrono::steady_clock::now() - start < std::chrono::seconds(20))
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            if (late && cycles_done.load() < 2)
              ++bad, std::fprintf(stderr, "rank 2: the others' cycles did not end in 20 s\n");
            const auto t0 = std::chrono::steady_clock::now();
            a2a.set_active_ranks({true, true, true}, stream);
            CUDA_OK(cudaStreamSynchronize(stream));
            try {
              a2a.check();
              ++bad, std::fprintf(stderr, "rank 2: expected InvalidArgument\n");
            } catch (const Error& e) {
              const std::string what = e.what();
              if (e.code() != ErrorCode::kInvalidArgument ||
                  what.find("argument 'active' differs across active ranks") == std::string::npos)
                ++bad, std::fprintf(stderr, "rank 2: %s\n", e.what());
            }
            if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(8))
              ++bad, std::fprintf(stderr, "rank 2: the error took too long\n");
            return bad;
          }
          a2a.set_active_ranks(p.active, stream);
          std::string err;
          try {
            err = eager_cycle(a2a, p, r, device, stream);
          } catch (const std::exception& e) {
            err = std::string("exception: ") + e.what();
          }
          if (!err.empty()) ++bad, std::fprintf(stderr, "rank %d: %s\n", r, err.c_str());
          ++cycles_done;
          return bad;
        },
        o);
    EXPECT_EQ(rc, 0);
  }
}

}  // namespace
}  // namespace epx
