// bench/ll_onegpu_bench.cc — the ll kernels at R = 2, 4, 8 where only one GPU is lent: R ranks as
// threads sharing GPU 0 (Group::cuda_shared_device, as the one-GPU GPU tests), each rank's
// kernels on SMs / R of their own (co-resident), every "peer" store and load going to the same
// GPU's memory instead of over NVLink. Not a measure of EP speed (no link; the ranks share the
// GPU's memory bandwidth and SMs): a same-run view of what grows with R on the kernels' side
// (per-source waits and scans, per-rank flags, the layout exchange). Correctness in this mode is
// the GPU tier's (gpu_ll_gpu_test LlOneGpu.*): this program checks nothing.
//
//   epx_ll_onegpu_bench [--ranks 2,4,8] [--tokens 1,32,128,256] [--experts 256] [--pairs 20]
//                       [--rounds 5]
//
// Workload: DeepEP's low-latency test (H = 7168, K = 8, uniform routing, fp8 dispatch, bf16
// zero-copy combine), T tokens per rank, T_max = T. Per row: after a group barrier, `pairs`
// dispatch + combine pairs back to back on the rank's stream with a CUDA event between every two
// calls (the host enqueues ahead: the differences are the device time of each call, as a
// profiler's kernel row); the median over pairs x rounds of each call, and of the pair; rank 0's
// and the slowest rank's pair.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/group.h"
#include "gpu/gpu_support.h"
#include "support/routing.h"
#include "transport/transport.h"

using namespace epx;

namespace {

constexpr int64_t kHidden = 7168;
constexpr int kTopK = 8;

struct Options {
  std::vector<int> ranks = {2, 4, 8};
  std::vector<int64_t> tokens = {1, 32, 128, 256};
  int experts = 256, pairs = 20, rounds = 5;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Times {
  double dispatch = 0, combine = 0, pair = 0;
};

// One T on one rank: the medians (µs) of its calls.
Times run_tokens(const Group& g, const Options& o, int64_t T) {
  const int R = g.size(), r = g.rank(), dev = gpu_testing::device_of(g);
  cudaStream_t stream = gpu_testing::rank_stream();
  const Allocator alloc = gpu_testing::device_allocator();
  std::mt19937_64 rng(977 + 31 * r + T);
  const auto idx =
      epx::testing::make_topk_idx(epx::testing::Routing::kUniform, T, kTopK, o.experts, R, rng);
  Tensor x = gpu_testing::to_device(epx::testing::make_bf16(T, kHidden, rng), DType::kBF16,
                                    {T, kHidden}, dev);
  Tensor topk = gpu_testing::to_device(idx, DType::kI64, {T, kTopK}, dev);
  Tensor w = gpu_testing::to_device(epx::testing::make_topk_weights(idx, rng), DType::kF32,
                                    {T, kTopK}, dev);
  Tensor out = alloc(DType::kBF16, {T, kHidden}, Device::cuda(dev));
  MoeShape shape;
  shape.hidden = kHidden;
  shape.top_k = kTopK;
  shape.num_experts = o.experts;
  shape.max_tokens_per_rank = T;
  BufferConfig ll_only;
  ll_only.enable_ht = false;
  ll_only.enable_ll = true;
  Buffer buf(g, shape, ll_only);
  LlDispatchArgs da;
  da.x = x;
  da.topk_idx = topk;
  da.use_fp8 = true;
  da.stream = stream;
  LlCombineArgs ca;
  ca.topk_idx = topk;
  ca.topk_weights = w;
  ca.out = out;
  ca.zero_copy = true;  // y = what ll_next_combine_buffer holds (the timings need no values)
  ca.stream = stream;
  auto pair = [&] {
    LlDispatchResult d = buf.ll_dispatch(da, alloc);
    ca.handle = &d.handle;
    (void)buf.ll_combine(ca, alloc);
  };
  for (int i = 0; i < 3; ++i) pair();  // warm-up
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(2 * o.pairs + 1);
  for (cudaEvent_t& e : ev) CUDA_OK(cudaEventCreate(&e));
  Times t;
  std::vector<double> disp, comb, both;
  for (int round = 0; round < o.rounds; ++round) {
    g.transport()->barrier("ll onegpu bench round");
    CUDA_OK(cudaEventRecord(ev[0], stream));
    for (int i = 0; i < o.pairs; ++i) {
      LlDispatchResult d = buf.ll_dispatch(da, alloc);
      CUDA_OK(cudaEventRecord(ev[2 * i + 1], stream));
      ca.handle = &d.handle;
      (void)buf.ll_combine(ca, alloc);
      CUDA_OK(cudaEventRecord(ev[2 * i + 2], stream));
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int i = 0; i < o.pairs; ++i) {
      float a = 0, b = 0;
      CUDA_OK(cudaEventElapsedTime(&a, ev[2 * i], ev[2 * i + 1]));
      CUDA_OK(cudaEventElapsedTime(&b, ev[2 * i + 1], ev[2 * i + 2]));
      disp.push_back(1e3 * a);
      comb.push_back(1e3 * b);
      both.push_back(1e3 * (a + b));
    }
  }
  buf.check();
  for (cudaEvent_t e : ev) CUDA_OK(cudaEventDestroy(e));
  t.dispatch = median(disp);
  t.combine = median(comb);
  t.pair = median(both);
  return t;
}

// Every rank's times land in `all` (the ranks are threads of one process); rank 0 prints.
int run_rank(const Group& g, const Options& o, std::vector<std::vector<Times>>& all) {
  for (size_t i = 0; i < o.tokens.size(); ++i) all[i][g.rank()] = run_tokens(g, o, o.tokens[i]);
  g.transport()->barrier("ll onegpu bench end");
  if (g.rank() != 0) return 0;
  for (size_t i = 0; i < o.tokens.size(); ++i) {
    double slowest = 0;
    for (const Times& t : all[i]) slowest = std::max(slowest, t.pair);
    const Times& t0 = all[i][0];
    std::printf("| %d | %lld | %.1f | %.1f | %.1f | %.1f |\n", g.size(),
                static_cast<long long>(o.tokens[i]), t0.dispatch, t0.combine, t0.pair, slowest);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--ranks 2,4,8] [--tokens 1,32,128,256] [--experts E] [--pairs N] "
                   "[--rounds N]\n",
                   argv[0]);
      return a == "--help" ? 0 : 2;
    }
    const char* v = argv[++i];
    if (a == "--ranks") {
      o.ranks.clear();
      for (int64_t r : gpu_testing::parse_int_list(v)) o.ranks.push_back(static_cast<int>(r));
    } else if (a == "--tokens") {
      o.tokens = gpu_testing::parse_int_list(v);
    } else if (a == "--experts")
      o.experts = std::atoi(v);
    else if (a == "--pairs")
      o.pairs = std::atoi(v);
    else if (a == "--rounds")
      o.rounds = std::atoi(v);
    else {
      std::fprintf(stderr, "unknown option %s (--help)\n", a.c_str());
      return 2;
    }
  }
  for (int R : o.ranks) {
    if (R < 1 || o.experts % R != 0) {
      std::fprintf(stderr, "--experts %d must be a positive multiple of every --ranks value\n",
                   o.experts);
      return 2;
    }
  }
  if (o.pairs < 1 || o.rounds < 1) {
    std::fprintf(stderr, "--pairs and --rounds must be >= 1\n");
    return 2;
  }
  if (gpu_testing::visible_gpus() == 0) {
    std::printf("epx_ll_onegpu_bench: no GPU visible, nothing to measure\n");
    return 0;
  }
  std::printf(
      "| R (one GPU) | T | dispatch us | combine us | pair us | slowest rank's pair us |\n"
      "|---|---|---|---|---|---|\n");
  std::fflush(stdout);  // before the fork: the child would print the buffer again
  int rc = 0;
  for (int R : o.ranks) {
    std::vector<std::vector<Times>> all(o.tokens.size(), std::vector<Times>(R));
    rc |= gpu_testing::run_cuda_ranks_one_gpu(R, 0,
                                              [&](const Group& g) { return run_rank(g, o, all); });
    if (rc) break;
  }
  return rc;
}
