// GPU tier: the ll rank masks of the cuda backend (BufferConfig::enable_shrink, docs/semantics.md
// §2.6) against the oracle with masks (tests/support/oracle_ll.h), bit for bit, as the cpu tests
// (tests/unit/ll_mask_test.cc) check the cpu backend:
//   - DeepEP's --shrink-test scenario (tests/support/ll_masks.h): ranks stop calling at a dispatch,
//     a combine and an ll_clean; every live rank's call that waits for a dead rank finishes after
//     about one group timeout (ll_clean: two) with that rank masked, later calls wait for nobody,
//     and every output (recv_x, scales, recv_count, src_info, layout_range, out; poisoned
//     outputs, NaN past the counts of y) matches the oracle with the masks of its step; the mask
//     read back with ll_query_mask (a device tensor) after every step; the dispatch wait-cost
//     statistics count the dead rank's wait;
//   - masks set with ll_update_mask on one side only: the masked rank times out on its maskers
//     and masks them; then ll_clean_mask + ll_clean everywhere and an exact round;
//   - a CUDA graph captured with masks set reads the mask at every replay: replayed masked, then
//     after ll_clean_mask + ll_clean unmasked, each checked.
// One GPU with R = 2, 4, 8 ranks as threads (Group::cuda_shared_device), and R forked ranks with
// a GPU each where that many are visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/ll_cases.h"
#include "support/ll_masks.h"
#include "support/oracle_ll.h"

namespace epx {
namespace {

using gpu_testing::RankStream;
using testing::LlBatch;
using testing::LlCase;
using testing::LlProblem;
using testing::LlRankInput;
using testing::Clock;
using testing::seconds_since;

BufferConfig shrink_config() {
  return testing::ll_mask_config();
}

GroupOptions mask_options() {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(1500);
  return o;
}

int run_ranks(int R, bool one_gpu, const std::function<int(const Group&)>& body) {
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body, mask_options())
                 : gpu_testing::run_cuda_ranks(R, body, mask_options());
}

std::string check_dispatch(const LlProblem& p, const testing::LlExpectedDispatch& want,
                           const LlDispatchResult& d) {
  std::vector<std::vector<uint8_t>> keep;
  return testing::check_ll_dispatch(p, want, gpu_testing::host_ll_dispatch(d, keep));
}

std::string check_out(const LlProblem& p, const std::vector<uint16_t>& want,
                      const TensorView& out) {
  std::vector<std::vector<uint8_t>> keep;
  return testing::check_ll_combine(p, want, gpu_testing::host_copy(out, keep));
}

// This rank's inputs of one batch on the device, kept for the calls (and graph replays).
struct DeviceBatch {
  Tensor x, topk, weights, y;
  DeviceBatch(const LlCase& c, const LlBatch& b, int r, int dev) {
    const LlProblem& p = c.p;
    const LlRankInput& in = b.in[r];
    const int64_t T = in.num_tokens;
    x = gpu_testing::to_device(in.x, DType::kBF16, {T, p.hidden}, dev);
    topk = gpu_testing::to_device(in.topk_idx, DType::kI64, {T, p.top_k}, dev);
    weights = gpu_testing::to_device(in.topk_weights, DType::kF32, {T, p.top_k}, dev);
    y = gpu_testing::to_device(b.y[r], DType::kBF16,
                               {p.num_local_experts(), p.rows_per_expert(), p.hidden}, dev);
  }
};

// The mask ll_query_mask writes into a device int32 [R] tensor, read back.
std::vector<int32_t> query(const Buffer& buf, cudaStream_t stream) {
  const int R = buf.group().size();
  Tensor t = gpu_testing::to_device(std::vector<int32_t>(R, -7), DType::kI32, {R},
                                    gpu_testing::device_of(buf.group()));
  buf.ll_query_mask(t, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  return gpu_testing::to_host<int32_t>(t);
}

LlDispatchArgs dispatch_args(const LlCase& c, const DeviceBatch& in, bool hook,
                             cudaStream_t stream) {
  LlDispatchArgs a;
  a.x = in.x;
  a.topk_idx = in.topk;
  a.use_fp8 = c.p.use_fp8;
  a.return_recv_hook = hook;
  a.stream = stream;
  return a;
}

LlCombineArgs combine_args(const DeviceBatch& in, const LlDispatchResult& d, bool hook,
                           cudaStream_t stream) {
  LlCombineArgs a;
  a.y = in.y;
  a.topk_idx = in.topk;
  a.topk_weights = in.weights;
  a.handle = &d.handle;
  a.return_recv_hook = hook;
  a.stream = stream;
  return a;
}

// Marks the end of a test's live work (a file: ranks are forked processes or threads), and waits
// for it (bounded): a rank that stopped calling keeps its Buffer untouched until the live ranks
// are done, as a dead process would (its destructor would arrive at barriers), and then every
// rank destroys its Buffer (one GPU: destructors wait for every rank).
struct DoneFlag {
  std::string path;
  explicit DoneFlag(const std::string& tag)
      : path("/tmp/epx-ll-mask-" + std::to_string(getpid()) + "-" + tag) {
    std::remove(path.c_str());
  }
  ~DoneFlag() { std::remove(path.c_str()); }
  void set() const { std::fclose(std::fopen(path.c_str(), "w")); }
  void wait() const {
    for (int i = 0; i < 24000 && access(path.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
};

// A rank's first failure, "rank r where: e" (later ones are dropped; "" while none).
struct FirstFailure {
  int rank;
  std::string err;
  void operator()(const std::string& where, const std::string& e) {
    if (err.empty() && !e.empty()) err = "rank " + std::to_string(rank) + " " + where + ": " + e;
  }
};

// Runs body(g, stream) on every rank, printing a failure (and an exception as one); 0 or 1.
int guarded(const Group& g, const std::function<std::string(const Group&, cudaStream_t)>& body) {
  const RankStream rs(cudaStreamNonBlocking);
  std::string err;
  try {
    err = body(g, rs.get());
  } catch (const std::exception& e) {
    err = "rank " + std::to_string(g.rank()) + " exception: " + e.what();
  }
  if (!err.empty()) std::fprintf(stderr, "%s\n", err.c_str());
  return err.empty() ? 0 : 1;
}

// ---- DeepEP's --shrink-test: ranks that stop calling ------------------------------------------

// One rank of the dead-peer scenario (the cpu test's run_dead_peers_rank, on the device); "" or
// its first failure. A rank that stops waits for `done` (rank 0, never dead, sets it).
std::string run_dead_peers_rank(const testing::LlMaskScenario& s, const Group& g,
                                cudaStream_t stream, const DoneFlag& done) {
  const int r = g.rank(), R = g.size(), dev = gpu_testing::device_of(g);
  const LlProblem& p = s.c.p;
  Buffer buf(g, p.moe_shape(), shrink_config());
  const Allocator alloc = gpu_testing::poison_allocator();
  const double timeout = std::chrono::duration<double>(g.timeout()).count();
  FirstFailure fail{r, ""};
  int round = 0, step = 0;
  // After `step` of `round`, which took `took` seconds: the waits it should have had, the mask
  // read back; nothing raised.
  auto check_step = [&](double took) {
    const std::string where = "round " + std::to_string(round) + " step " + std::to_string(step);
    fail(where, s.plan.check_time(round, step, took, timeout, 5));
    fail(where, testing::check_mask_status(query(buf, stream), s.plan.masked(round, step)));
    buf.check();  // nothing to raise: with enable_shrink a timeout masks
  };
  for (; round < testing::kLlMaskRounds && fail.err.empty(); ++round) {
    const std::string where = "round " + std::to_string(round);
    const LlBatch& b = s.rounds[round];
    const bool hook = s.hook(round);
    if (s.plan.stopped(r, round, step = 0)) break;
    const DeviceBatch in(s.c, b, r, dev);
    Tensor stats = gpu_testing::to_device(std::vector<int64_t>(R, 0), DType::kI64, {R}, dev);
    LlDispatchArgs da = dispatch_args(s.c, in, hook, stream);
    da.dispatch_wait_recv_cost_stats = stats;
    auto t0 = Clock::now();
    LlDispatchResult d = buf.ll_dispatch(da, alloc);
    if (hook) d.hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    check_step(seconds_since(t0));
    fail(where + " dispatch", check_dispatch(p, b.want[r], d));
    if (round == 1 && s.plan.at_dispatch >= 0) {
      // The dead rank's wait counts until it was masked (about the timeout), the others' less.
      const std::vector<int64_t> waited = gpu_testing::to_host<int64_t>(stats);
      for (int q = 0; q < R; ++q) {
        const double w = 1e-9 * static_cast<double>(waited[q]);
        if (q == s.plan.at_dispatch ? w < 0.9 * timeout : w >= 0.9 * timeout)
          fail(where, "dispatch_wait_recv_cost_stats[" + std::to_string(q) +
                          "] = " + std::to_string(w) + " s");
      }
    }
    if (s.plan.stopped(r, round, step = 1)) break;
    LlCombineArgs ca = combine_args(in, d, hook, stream);
    if (round == 3) {  // zero_copy
      TensorView v = buf.ll_next_combine_buffer(d.handle);
      gpu_testing::upload_on_rank_stream(v.data, b.y[r].data(), b.y[r].size() * 2, stream);
      ca.zero_copy = true;
    }
    t0 = Clock::now();
    LlCombineResult cr = buf.ll_combine(ca, alloc);
    if (hook) cr.hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    check_step(seconds_since(t0));
    fail(where + " combine", check_out(p, b.want_out[r], cr.out));
    if (s.plan.stopped(r, round, step = 2)) break;
    t0 = Clock::now();
    buf.ll_clean();
    check_step(seconds_since(t0));
  }
  if (r == 0)
    done.set();
  else
    done.wait();
  return fail.err;
}

// Forked ranks (one GPU each) skip the death at ll_clean: the live ranks' ll_clean barrier then
// misses a rank of the NCCL transport, which makes them tear their communicator down by abort,
// while the "dead" rank of a test, still alive, would tear it down collectively (the ranks
// sharing one GPU have a host transport, and run it).
int dead_peers_case(int R, bool one_gpu) {
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 200 + R, one_gpu);
  const DoneFlag done(std::to_string(R) + (one_gpu ? "-dead-1gpu" : "-dead"));
  return run_ranks(R, one_gpu, [&](const Group& g) {
    return guarded(g, [&](const Group& g, cudaStream_t stream) {
      const std::string e = run_dead_peers_rank(s, g, stream, done);
      return e.empty() ? e : e + " (" + s.c.p.describe() + ")";
    });
  });
}

class LlMaskOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlMaskOneGpu, DeadPeersAreMaskedAndLiveRanksMatchOracle) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(dead_peers_case(GetParam(), true), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlMaskOneGpu, ::testing::Values(2, 4, 8),
                         ::testing::PrintToStringParamName());

class LlMaskGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlMaskGpu, DeadPeersAreMaskedAndLiveRanksMatchOracle) {
  EPX_REQUIRE_GPUS(GetParam());
  EXPECT_EQ(dead_peers_case(GetParam(), false), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlMaskGpu, ::testing::Values(2, 4, 8),
                         ::testing::PrintToStringParamName());

// ---- masks set by the caller -------------------------------------------------------------------

// The batch of `c` in which rank r's view masks masked_of(r) (at the dispatch and the combine):
// inputs from `rng`, each rank's expectations from the oracle with its own view, y rows past its
// view's counts NaN.
LlBatch batch_with_views(const LlCase& c, const std::function<uint64_t(int)>& masked_of,
                         std::mt19937_64& rng) {
  LlBatch b = testing::make_ll_masked_batch(c, 0, 0, rng);
  const int R = c.p.num_ranks, L = c.p.num_local_experts();
  const int64_t RT = c.p.rows_per_expert(), H = c.p.hidden;
  auto view = [&](int r) {
    LlProblem p = c.p;
    p.masked_dispatch = p.masked_combine = masked_of(r);
    return p;
  };
  for (int r = 0; r < R; ++r) {
    b.want[r] = testing::oracle_ll_dispatch(view(r), b.in, r);
    for (int l = 0; l < L; ++l)
      std::fill(b.y[r].begin() + (l * RT + b.want[r].recv_count[l]) * H,
                b.y[r].begin() + (l + 1) * RT * H, testing::kLlPoisonBf16);
  }
  for (int r = 0; r < R; ++r) b.want_out[r] = testing::oracle_ll_combine(view(r), b.in, b.y, r);
  return b;
}

// One round of `b` on this rank (a dispatch and a combine, each hook called when `hook`),
// synchronised and checked against b's expectations through fail(where, error); its seconds.
double masked_round(Buffer& buf, const LlCase& c, const LlBatch& b, bool hook, cudaStream_t stream,
                    const Allocator& alloc, const char* what, FirstFailure& fail) {
  const int r = buf.group().rank();
  const DeviceBatch in(c, b, r, gpu_testing::device_of(buf.group()));
  const auto t0 = Clock::now();
  LlDispatchResult d = buf.ll_dispatch(dispatch_args(c, in, hook, stream), alloc);
  if (hook) d.hook();
  LlCombineResult cr = buf.ll_combine(combine_args(in, d, hook, stream), alloc);
  if (hook) cr.hook();
  CUDA_OK(cudaStreamSynchronize(stream));
  buf.check();
  fail(std::string(what) + " dispatch", check_dispatch(c.p, b.want[r], d));
  fail(std::string(what) + " combine", check_out(c.p, b.want_out[r], cr.out));
  return seconds_since(t0);
}

// Every rank but m masks m with ll_update_mask; m masks nobody. The others never wait for m and
// get the outputs without it; m's waits for its maskers time out (they send it nothing) and
// mask them, so it gets its own tokens and experts only. Then every rank unmasks everything and
// calls ll_clean: an exact round.
int one_sided_case(int R, bool one_gpu) {
  const int m = R - 1;
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 300 + R);
  const uint64_t all = (uint64_t{1} << R) - 1, bit = uint64_t{1} << m;
  auto masked_of = [&](int r) { return r == m ? all & ~bit : bit; };
  std::mt19937_64 rng(301);
  const LlBatch one_sided = batch_with_views(s.c, masked_of, rng);
  const LlBatch full = testing::make_ll_masked_batch(s.c, 0, 0, rng);
  return run_ranks(R, one_gpu, [&](const Group& g) {
    return guarded(g, [&](const Group& g, cudaStream_t stream) {
      const int r = g.rank();
      const double timeout = std::chrono::duration<double>(g.timeout()).count();
      Buffer buf(g, s.c.p.moe_shape(), shrink_config());
      const Allocator alloc = gpu_testing::poison_allocator();
      FirstFailure fail{r, ""};
      if (r != m) buf.ll_update_mask(m, true, stream);
      auto round = [&](const LlBatch& b, bool hook, const char* what) {
        return masked_round(buf, s.c, b, hook, stream, alloc, what, fail);
      };
      const double took = round(one_sided, false, "one-sided");
      // m waited one timeout for its maskers (in the dispatch; the combine waits for nobody).
      const bool ok =
          r == m ? took >= 0.9 * timeout && took < 2 * timeout + 5 : took < 0.9 * timeout;
      if (!ok) fail("one-sided", "took " + std::to_string(took) + " s");
      fail("one-sided", testing::check_mask_status(query(buf, stream), masked_of(r)));
      buf.ll_clean_mask(stream);
      fail("cleaned", testing::check_mask_status(query(buf, stream), 0));
      buf.ll_clean();
      round(full, true, "after ll_clean");
      return fail.err;
    });
  });
}

TEST(LlMaskOneGpuUpdate, MaskedByItsPeersThenRejoins) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(one_sided_case(4, true), 0);
}

TEST(LlMaskGpuUpdate, MaskedByItsPeersThenRejoins) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(one_sided_case(2, false), 0);
}

// Rank m stops calling for a round (a stall, not a death): the others' dispatch waits one
// timeout for it and masks it (their round is the one without m); m does not launch. Then every
// rank unmasks everything and calls ll_clean, m having run fewer ll operations than its peers:
// an exact round (vLLM's fault-tolerance retry through the DeepEP drop-in's
// low_latency_clean_mask_buffer; the cpu tier's LlMask.StalledRankRejoinsAfterCleanMask).
int stalled_case(int R, bool one_gpu) {
  const int m = R - 1;
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 500 + R);
  const uint64_t bit = uint64_t{1} << m;
  std::mt19937_64 rng(501);
  const LlBatch without_m = testing::make_ll_masked_batch(s.c, bit, bit, rng);
  const LlBatch full = testing::make_ll_masked_batch(s.c, 0, 0, rng);
  return run_ranks(R, one_gpu, [&](const Group& g) {
    return guarded(g, [&](const Group& g, cudaStream_t stream) {
      const int r = g.rank();
      const double timeout = std::chrono::duration<double>(g.timeout()).count();
      Buffer buf(g, s.c.p.moe_shape(), shrink_config());
      const Allocator alloc = gpu_testing::poison_allocator();
      FirstFailure fail{r, ""};
      auto round = [&](const LlBatch& b, bool hook, const char* what) {
        return masked_round(buf, s.c, b, hook, stream, alloc, what, fail);
      };
      round(full, false, "before the stall");
      if (r != m) {
        const double took = round(without_m, false, "without m");
        if (took < 0.9 * timeout || took >= 2 * timeout + 5)
          fail("without m", "took " + std::to_string(took) + " s, expected about one timeout");
        fail("without m", testing::check_mask_status(query(buf, stream), bit));
      }
      buf.ll_clean_mask(stream);
      buf.ll_clean();
      fail("cleaned", testing::check_mask_status(query(buf, stream), 0));
      round(full, true, "after ll_clean");
      fail("after ll_clean", testing::check_mask_status(query(buf, stream), 0));
      return fail.err;
    });
  });
}

TEST(LlMaskOneGpuUpdate, StalledRankRejoinsAfterCleanMask) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(stalled_case(4, true), 0);
}

TEST(LlMaskGpuUpdate, StalledRankRejoinsAfterCleanMask) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(stalled_case(2, false), 0);
}

// Rank r masks every other rank (each its own view; no one waits), a round is captured in a
// CUDA graph and replayed: masked results. Then ll_clean_mask + ll_clean on every rank and the
// same graph replayed: the full results. The kernels read the mask at replay.
int graph_case(int R, bool one_gpu) {
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 400 + R);
  const uint64_t all = (uint64_t{1} << R) - 1;
  std::mt19937_64 rng(401);
  LlBatch masked = batch_with_views(
      s.c, [&](int r) { return all & ~(uint64_t{1} << r); }, rng);
  // The same inputs, no masks.
  LlBatch full = masked;
  LlCase c = s.c;
  testing::finish_ll_batch(c, full, rng);
  return run_ranks(R, one_gpu, [&](const Group& g) {
    return guarded(g, [&](const Group& g, cudaStream_t stream) {
      const int r = g.rank(), dev = gpu_testing::device_of(g);
      const LlProblem& p = s.c.p;
      Buffer buf(g, p.moe_shape(), shrink_config());
      FirstFailure fail{r, ""};
      for (int q = 0; q < R; ++q)
        if (q != r) buf.ll_update_mask(q, true, stream);
      // Inputs and outputs at fixed addresses: y is rewritten per expectation (the counts, hence
      // the rows, differ); the outputs are the eager call's, reused by the capture.
      const DeviceBatch in(s.c, masked, r, dev);
      gpu_testing::Arena arena(gpu_testing::device_allocator());
      LlDispatchResult d;
      LlCombineResult cr;
      auto round = [&] {
        d = buf.ll_dispatch(dispatch_args(s.c, in, false, stream), arena.allocator());
        cr = buf.ll_combine(combine_args(in, d, false, stream), arena.allocator());
      };
      auto poison = [&] {  // before every replay: outputs it does not write show up
        for (const Tensor& t : arena.tensors)
          CUDA_OK(cudaMemsetAsync(t.data, 0xFF, t.nbytes(), stream));
      };
      auto check = [&](const LlBatch& b, const std::string& what) {
        CUDA_OK(cudaStreamSynchronize(stream));
        buf.check();
        fail(what + " dispatch", check_dispatch(p, b.want[r], d));
        fail(what + " combine", check_out(p, b.want_out[r], cr.out));
      };
      round();  // eager: allocates the outputs the capture reuses
      check(masked, "eager");
      arena.replay();
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      round();
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      poison();
      CUDA_OK(cudaGraphLaunch(exec, stream));
      check(masked, "masked replay");
      buf.ll_clean_mask(stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      buf.ll_clean();
      gpu_testing::upload_on_rank_stream(in.y.data, full.y[r].data(), full.y[r].size() * 2, stream);
      poison();
      CUDA_OK(cudaGraphLaunch(exec, stream));
      check(full, "unmasked replay");
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return fail.err;
    });
  });
}

TEST(LlMaskOneGpuGraph, CapturedGraphReadsTheMaskAtReplay) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(graph_case(2, true), 0);
}

TEST(LlMaskGpuGraph, CapturedGraphReadsTheMaskAtReplay) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(graph_case(2, false), 0);
}

}  // namespace
}  // namespace epx
