// tests/gpu/ht_nodes_gpu_test.cc — the cuda ht across nodes on one GPU ("virtual nodes":
// Group::cuda_shared_device with GroupOptions::ranks_per_node, docs/design.md §13.1), every
// output compared bit for bit with the oracle of that topology (tests/support/oracle_ht.h, whose
// combine takes the node-first order of docs/semantics.md §1.6), which the cpu backend of the same
// topology must equal too (so cuda equals the cpu backend).
//
// Every rank generates the inputs of all ranks from the case seed (ht_reference.h); outputs come
// from the poisoning stream-ordered allocator (rows left unwritten show; a cudaFree would
// synchronise the device that the ranks share).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>

#include "cuda/tuning.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu_support.h"
#include "ht_reference.h"
#include "support/ht_inputs.h"

namespace epx {
namespace {

#ifdef EPX_DIAGNOSTICS
// EPX_TEST_STEP_SYNC=1 in a diagnostics build: the ht across nodes synchronises after each of its
// steps, so a device fault raises naming the step that made it (set_ht_nodes_step_sync).
const bool kStepSync = [] {
  if (std::getenv("EPX_TEST_STEP_SYNC") != nullptr) detail::set_ht_nodes_step_sync(true);
  return true;
}();
#endif

using gpu_testing::HtCase;
using gpu_testing::to_device;
using testing::HtExpectedCombine;
using testing::HtExpectedDispatch;

// Elements of `got` (device) that differ from `want` bit for bit; prints the first.
template <typename T>
int64_t mismatches(const char* what, const std::string& ctx, int rank, const TensorView& got,
                   const std::vector<T>& want) {
  const std::vector<T> g = gpu_testing::to_host<T>(got);
  if (g.size() != want.size()) {
    std::fprintf(stderr, "[rank %d] %s: %s has %zu elements, expected %zu\n", rank, ctx.c_str(),
                 what, g.size(), want.size());
    return 1;
  }
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::memcmp(&g[i], &want[i], sizeof(T)) == 0) continue;
    if (bad++ == 0)
      std::fprintf(stderr, "[rank %d] %s: %s differs first at element %zu\n", rank, ctx.c_str(),
                   what, i);
  }
  return bad;
}

struct Inputs {
  Tensor x, scales, topk, weights;
};

Inputs upload(const HtCase& c, const testing::HtRankInput& in, int dev) {
  Inputs d;
  const int64_t T = in.num_tokens;
  d.x = to_device(in.x, c.fp8 ? DType::kF8E4M3 : DType::kBF16, {T, c.hidden}, dev);
  if (c.fp8) d.scales = to_device(in.scales, c.ue8m0 ? DType::kI32 : DType::kF32,
                                  {T, c.num_scales()}, dev);
  if (c.topk_i32)
    d.topk = to_device(std::vector<int32_t>(in.topk_idx.begin(), in.topk_idx.end()), DType::kI32,
                       {T, c.top_k}, dev);
  else
    d.topk = to_device(in.topk_idx, DType::kI64, {T, c.top_k}, dev);
  d.weights = to_device(in.topk_weights, DType::kF32, {T, c.top_k}, dev);
  return d;
}

int64_t check_topk(const HtCase& c, const std::string& ctx, int r, const TensorView& got,
                   const std::vector<int64_t>& want) {
  if (!c.topk_i32) return mismatches("recv_topk_idx", ctx, r, got, want);
  return mismatches("recv_topk_idx", ctx, r, got, std::vector<int32_t>(want.begin(), want.end()));
}

// Replaces the combine's y rows by values whose float32 sums depend on their order (about 1 and
// about 2^24, either sign): the node-first order then changes some bits.
void widen(std::vector<testing::HtCombineRankInput>& y, const HtCase& c, uint64_t seed) {
  for (size_t r = 0; r < y.size(); ++r) {
    std::mt19937_64 rng(seed * 131 + r);
    y[r].y = testing::wide_bf16(static_cast<int64_t>(y[r].y.size()) / c.hidden, c.hidden, rng);
  }
}

// The combine of the dispatch that made `handle` (N rows of y, T tokens), with the weights and
// biases `y` has, against the oracle's.
int64_t check_combine(const Group& g, Buffer& buf, const HtCase& c, const HtHandle& handle,
                      int64_t N, int64_t T, const testing::HtCombineRankInput& y,
                      const HtExpectedCombine& want, const Allocator& alloc,
                      const std::string& ctx) {
  const int r = g.rank(), dev = buf.device().index;
  gpu_testing::trace_step(g, "combine");
  HtCombineArgs ca;
  const Tensor yd = to_device(y.y, DType::kBF16, {N, c.hidden}, dev);
  Tensor yw, b0, b1;
  ca.y = yd;
  ca.handle = &handle;
  if (c.weights) ca.topk_weights = yw = to_device(y.topk_weights, DType::kF32, {N, c.top_k}, dev);
  ca.stream = gpu_testing::rank_stream();
  if (y.has_bias0) ca.bias0 = b0 = to_device(y.bias0, DType::kBF16, {T, c.hidden}, dev);
  if (y.has_bias1) ca.bias1 = b1 = to_device(y.bias1, DType::kBF16, {T, c.hidden}, dev);
  HtCombineResult cr = buf.ht_combine(ca, alloc);
  gpu_testing::trace_step(g, "combine returned");
  int64_t bad = mismatches("combine out", ctx, r, cr.out, want.out);
  // (Without weights both are empty: a combined_topk_weights returned anyway differs.)
  return bad + mismatches("combined_topk_weights", ctx, r, cr.combined_topk_weights,
                          want.combined_topk_weights);
}

// The cpu backend of the same topology against the oracle, every rank (so cuda equals it).
int64_t check_cpu_backend(const HtCase& c, const testing::HtProblem& p,
                          const std::vector<testing::HtRankInput>& in,
                          const std::vector<testing::HtCombineRankInput>& yin,
                          const std::string& ctx) {
  std::string why;
  auto cpu = gpu_testing::cpu_backend_ht(c, in, yin, &why);
  if (!cpu) {
    std::fprintf(stderr, "%s: the cpu backend did not run: %s\n", ctx.c_str(), why.c_str());
    return 1;
  }
  int64_t bad = 0;
  for (int q = 0; q < c.num_ranks; ++q)
    for (const std::string& what :
         gpu_testing::cpu_backend_differences(c, *cpu, q, testing::ht_oracle_dispatch(p, in, q),
                                              testing::ht_oracle_combine(p, in, yin, q))) {
      std::fprintf(stderr, "%s: cpu backend's %s of rank %d differs\n", ctx.c_str(),
                   what.c_str(), q);
      ++bad;
    }
  return bad;
}

// How far run_case goes: the exact dispatch (with the layout), then the cached dispatch, then the
// combine. The stage tests below run each prefix in a process of its own, so a failure that
// poisons the device (a sticky CUDA error) names the first stage that has it.
enum class Stage { kDispatch, kCached, kCombine };

// One case on `buf`: exact dispatch, cached dispatch of new x, combine (weights, biases), up to
// `last`. `order_changed` is set when the node-first combine differs from the one-node one
// somewhere.
int64_t run_case(const Group& g, Buffer& buf, const HtCase& c, bool wide, bool& order_changed,
                 Stage last = Stage::kCombine) {
  const int r = g.rank(), dev = buf.device().index;
  const std::string ctx = c.describe() + " nodes of " + std::to_string(c.ranks_per_node);
  const testing::HtProblem p = c.problem();
  const auto in = gpu_testing::make_ht_inputs(c);
  const HtExpectedDispatch w = testing::ht_oracle_dispatch(p, in, r);
  // The combine takes weights where the dispatch did (a case without exercises both paths). With
  // wide y every rank has a bias: at one rank per node a sum of two rows alone is the same in
  // either order, the bias first makes it three terms.
  auto yin = gpu_testing::make_combine_inputs(c, in, /*weights=*/c.weights, /*bias0=*/r % 2 == 0,
                                              /*bias1=*/wide || c.seed % 2 == 0, /*salt=*/5);
  if (wide) widen(yin, c, c.seed);
  const HtExpectedCombine want_c = testing::ht_oracle_combine(p, in, yin, r);
  testing::HtProblem flat = p;
  flat.ranks_per_node = 0;
  if (testing::ht_oracle_combine(flat, in, yin, r).out != want_c.out) order_changed = true;
  const Allocator alloc = gpu_testing::poison_allocator(0xAB);
  const Inputs d = upload(c, in[r], dev);
  const Stream stream = gpu_testing::rank_stream();
  int64_t bad = 0;

  gpu_testing::trace_step(g, "layout");
  HtLayout lay = buf.ht_layout(d.topk, stream, alloc);
  const testing::HtExpectedLayout lw =
      testing::ht_oracle_layout(p, in[r].topk_idx, in[r].num_tokens);
  bad += mismatches("num_tokens_per_rank", ctx, r, lay.num_tokens_per_rank, lw.num_tokens_per_rank);
  bad += mismatches("num_tokens_per_expert", ctx, r, lay.num_tokens_per_expert,
                    lw.num_tokens_per_expert);
  bad += mismatches("is_token_in_rank", ctx, r, lay.is_token_in_rank, lw.is_token_in_rank);

  HtDispatchArgs a;
  a.x = d.x;
  if (c.fp8) a.x_scales = d.scales;
  a.topk_idx = d.topk;
  if (c.weights) a.topk_weights = d.weights;
  a.expert_alignment = c.alignment;
  a.stream = stream;
  gpu_testing::trace_step(g, "exact dispatch");
  HtDispatchResult res = buf.ht_dispatch(a, alloc);
  if (res.recv_x.shape[0] != w.num_recv_tokens) {
    std::fprintf(stderr, "[rank %d] %s: N = %lld, expected %lld\n", r, ctx.c_str(),
                 static_cast<long long>(res.recv_x.shape[0]),
                 static_cast<long long>(w.num_recv_tokens));
    return 1;
  }
  bad += mismatches("recv_x", ctx, r, res.recv_x, w.recv_x);
  if (c.fp8) bad += mismatches("recv_x_scales", ctx, r, res.recv_x_scales, w.recv_scales);
  bad += check_topk(c, ctx, r, res.recv_topk_idx, w.recv_topk_idx);
  if (c.weights)
    bad += mismatches("recv_topk_weights", ctx, r, res.recv_topk_weights, w.recv_topk_weights);
  bad += mismatches("recv_src_idx", ctx, r, res.recv_src_idx, w.recv_src_idx);
  if (res.num_recv_tokens_per_expert != w.num_recv_tokens_per_expert) {
    std::fprintf(stderr, "[rank %d] %s: num_recv_tokens_per_expert differs\n", r, ctx.c_str());
    ++bad;
  }
  bad += mismatches("rank_prefix_matrix", ctx, r, res.handle.rank_prefix_matrix,
                    w.rank_prefix_matrix);
  bad += mismatches("send_pos", ctx, r, res.handle.send_pos, w.send_pos);
  bad += mismatches("handle.is_token_in_rank", ctx, r, res.handle.is_token_in_rank,
                    w.is_token_in_rank);
  if (res.handle.num_recv_tokens != w.num_recv_tokens) ++bad;

  if (last != Stage::kDispatch) {  // Cached dispatch of new x, the same routing.
    gpu_testing::trace_step(g, "cached dispatch");
    const auto in2 = gpu_testing::make_ht_inputs(c, /*salt=*/1);
    const HtExpectedDispatch w2 = testing::ht_oracle_dispatch(p, in2, r);
    const Inputs d2 = upload(c, in2[r], dev);
    HtDispatchArgs ac;
    ac.x = d2.x;
    if (c.fp8) ac.x_scales = d2.scales;
    ac.handle = &res.handle;
    ac.stream = stream;
    HtDispatchResult cr = buf.ht_dispatch(ac, alloc);
    bad += mismatches("cached recv_x", ctx, r, cr.recv_x, w2.recv_x);
    if (c.fp8) bad += mismatches("cached recv_x_scales", ctx, r, cr.recv_x_scales, w2.recv_scales);
  }
  if (last == Stage::kCombine)
    bad += check_combine(g, buf, c, res.handle, w.num_recv_tokens, in[r].num_tokens, yin[r],
                         want_c, alloc, ctx);
  buf.check();
  // The cpu backend of the same topology equals the oracle (so cuda equals it); rank 0 runs it.
  if (last == Stage::kCombine && r == 0) bad += check_cpu_backend(c, p, in, yin, ctx);
  if (bad) std::fprintf(stderr, "[rank %d] FAIL %s: %lld mismatches\n", r, ctx.c_str(),
                        static_cast<long long>(bad));
  return bad;
}

MoeShape shape_of(const HtCase& c, int64_t max_tokens) {
  MoeShape s;
  s.hidden = c.hidden;
  s.top_k = c.top_k;
  s.num_experts = c.num_experts;
  s.max_tokens_per_rank = max_tokens;
  return s;
}

// Random cases of one topology (N nodes of G): dtypes, id widths, weights, alignment, routing
// and token counts drawn (fresh each run unless EPX_TEST_SEED is set), one rank with no tokens.
// Whatever the draw: case 0 routes every token to one rank (the other nodes' chunks of most
// ranks are empty), case 2 has no weights (dispatch and combine).
std::vector<HtCase> random_cases(int N, int G, int64_t hidden, uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::vector<HtCase> cases;
  const testing::Routing routings[] = {testing::Routing::kUniform, testing::Routing::kSkewed,
                                       testing::Routing::kAllToOne, testing::Routing::kEmptyRank,
                                       testing::Routing::kDuplicates};
  for (int i = 0; i < count; ++i) {
    HtCase c;
    c.num_ranks = N * G;
    c.ranks_per_node = G;
    c.hidden = hidden;
    c.top_k = 1 + static_cast<int>(rng() % 8);
    c.num_experts = c.num_ranks * (1 + static_cast<int>(rng() % 4));
    const testing::Routing drawn = routings[rng() % 5];
    c.routing = i == 0 ? testing::Routing::kAllToOne : drawn;
    c.fp8 = rng() % 2 == 0;
    c.ue8m0 = c.fp8 && hidden % 512 == 0 && rng() % 2 == 0;
    c.topk_i32 = rng() % 2 == 0;
    c.weights = rng() % 4 != 0 && i != 2;
    c.alignment = rng() % 2 == 0 ? 1 : 4;
    c.seed = rng();
    for (int q = 0; q < c.num_ranks; ++q)
      c.num_tokens.push_back(q == i % c.num_ranks ? 0 : static_cast<int64_t>(rng() % 200));
    cases.push_back(c);
  }
  return cases;
}

// Routing under which the node-first order can change a combine: a token reaches at least 4
// experts, spread over every rank (at top_k 1, all to one rank, or a rank left empty — all of
// them at R = 2 — no token's sum may have the terms from two nodes that the order needs).
void order_sensitive(HtCase& c) {
  c.top_k = std::max(c.top_k, 4);
  c.num_experts = std::max(c.num_experts, c.num_ranks * 2);
  if (c.routing == testing::Routing::kAllToOne || c.routing == testing::Routing::kEmptyRank)
    c.routing = testing::Routing::kUniform;
}

uint64_t test_seed() {
  if (const char* v = std::getenv("EPX_TEST_SEED")) return std::strtoull(v, nullptr, 10);
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
}

// The N x G ranks on one GPU, each running `body` with the run's seed (fresh unless
// EPX_TEST_SEED is set; printed): its mismatches, and `order_changed` set where the node-first
// order changed a result it checked. With `need_order_change` some rank must have seen one (a
// rank may see none: case i gives rank i % R no tokens), so that a flat combine would fail.
int run_ranks(const char* suite, int N, int G, bool need_order_change,
              const std::function<int64_t(const Group&, uint64_t, bool&)>& body) {
  const uint64_t seed = test_seed();
  std::fprintf(stderr, "%s %dx%d seed %llu\n", suite, N, G,
               static_cast<unsigned long long>(seed));
  GroupOptions o;
  o.ranks_per_node = G;
  // The ranks run as threads of a child process (run_cuda_ranks_one_gpu forks): their count of
  // order changes lives in a page shared with it, not in this process's memory.
  void* page = mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* ranks_order_changed = new (page) std::atomic<int>(0);
  const int rc = gpu_testing::run_cuda_ranks_one_gpu(N * G, 0, [&](const Group& g) {
    bool order_changed = false;
    const int64_t bad = body(g, seed, order_changed);
    if (order_changed) ranks_order_changed->fetch_add(1);
    return bad == 0 ? 0 : 1;
  }, o);
  const int changed = ranks_order_changed->load();
  munmap(page, sizeof(std::atomic<int>));
  if (need_order_change && changed == 0) {
    std::fprintf(stderr, "%s %dx%d: no result changed by the node-first order\n", suite, N, G);
    return 1;
  }
  return rc;
}

// Random cases at N x G (two hidden sizes, three cases each on one buffer, all with case 1's top_k
// and experts; cases 1 and 2 routed by order_sensitive, with order-sensitive y) through
// run_case up to `last`; with the combine, some case must change a result by the node-first
// order.
int run_topology(int N, int G, Stage last) {
  return run_ranks("HtNodesOneGpu", N, G, last == Stage::kCombine,
                   [&](const Group& g, uint64_t seed, bool& order_changed) {
    int64_t bad = 0;
    for (int64_t hidden : {int64_t{512}, int64_t{1024}}) {
      std::vector<HtCase> cases = random_cases(N, G, hidden, seed + hidden, 3);
      order_sensitive(cases[1]);  // (at 2 x 1 only rank 1's order differs: case 2 gives it tokens)
      order_sensitive(cases[2]);
      cases[0].top_k = cases[1].top_k;  // the buffer's shape, which every case takes
      cases[0].num_experts = cases[1].num_experts;
      Buffer buf(g, shape_of(cases[0], 200));
      if (buf.bytes_allocated() !=
          Buffer::bytes_needed(Mode::kHt, shape_of(cases[0], 200), N * G, Backend::kCuda, G)) {
        std::fprintf(stderr, "[rank %d] bytes_allocated differs from bytes_needed\n", g.rank());
        ++bad;
      }
      for (size_t i = 0; i < cases.size(); ++i) {
        HtCase c = cases[i];
        c.top_k = cases[0].top_k;  // the buffer's shape
        c.num_experts = cases[0].num_experts;
        bad += run_case(g, buf, c, /*wide=*/i >= 1, order_changed, last);
      }
    }
    return bad;
  });
}

class HtNodesOneGpu : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(HtNodesOneGpu, MatchesOracleAndCpuBackend) {
  EPX_REQUIRE_GPUS(1);
  const auto [N, G] = GetParam();
  EXPECT_EQ(run_topology(N, G, Stage::kCombine), 0);
}

// 2 x 1: every node-local ht of one rank (no node-local count exchange, no peer in a node-local
// kernel); the others: node-local groups of 2 and 4.
INSTANTIATE_TEST_SUITE_P(Topologies, HtNodesOneGpu,
                         ::testing::Values(std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 4},
                                           std::pair{4, 2}),
                         gpu_testing::TopologyParamName{});

// The first stages of run_case alone at 2 x 2, each in a process of its own: a sticky device
// error (a faulting kernel fails every later CUDA call of every rank) cannot come from a stage
// that did not run, so the first failing stage of Dispatch, Cached, Topologies/2x2 names it.
class HtNodesOneGpuStages : public ::testing::TestWithParam<Stage> {};

TEST_P(HtNodesOneGpuStages, MatchOracle) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_topology(2, 2, GetParam()), 0);
}

INSTANTIATE_TEST_SUITE_P(Stages, HtNodesOneGpuStages,
                         ::testing::Values(Stage::kDispatch, Stage::kCached),
                         [](const auto& info) {
                           return std::string(info.param == Stage::kDispatch ? "Dispatch"
                                                                            : "Cached");
                         });

// ---- CUDA graphs ------------------------------------------------------------------------------

// An exact dispatch on a capturing stream: Unsupported naming the capture, raised before it
// allocates or enqueues anything (the capture stays valid and its graph empty). Mismatches.
int64_t exact_under_capture(const Group& g, Buffer& buf, const HtDispatchArgs& a) {
  const int r = g.rank();
  int64_t allocations = 0, bad = 0;
  const Allocator counting = [&](DType, const std::vector<int64_t>&, Device) -> Tensor {
    ++allocations;
    throw Error(ErrorCode::kInternal, "an output allocated under capture");
  };
  const auto stream = static_cast<cudaStream_t>(a.stream);
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  bad += gpu_testing::expect_unsupported(
      r, "exact dispatch under capture", [&] { (void)buf.ht_dispatch(a, counting); },
      {"captured into a CUDA graph"});
  cudaGraph_t graph = nullptr;
  size_t nodes = 0;
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "[rank %d] the refused exact dispatch invalidated the capture\n", r);
    ++bad;
  }
  if (graph != nullptr) {
    CUDA_OK(cudaGraphGetNodes(graph, nullptr, &nodes));
    cudaGraphDestroy(graph);
  }
  if (allocations != 0 || nodes != 0) {
    std::fprintf(stderr, "[rank %d] the refused exact dispatch allocated %lld, enqueued %zu\n",
                 r, static_cast<long long>(allocations), nodes);
    ++bad;
  }
  return bad;
}

// Case c at its topology: the exact dispatch eagerly (the handle), an exact dispatch under capture
// refused, then {cached dispatch of x, combine of y (weights, bias0)} run once eagerly (the
// arena records the outputs) and captured on the rank stream; each replay gets new x, scales, y,
// weights and bias in the captured input buffers (odd replays order-sensitive y), poisoned
// outputs (and intermediates), and every element of the cached recv_x (scales), the combine's
// out and combined_topk_weights against the oracle of the new inputs with the handle's routing.
// Then the whole case eagerly again (the rail and the node-local ht still in step).
int64_t graph_case(const Group& g, const HtCase& c, int num_replays, bool& order_changed) {
  const int r = g.rank();
  const int64_t H = c.hidden, K = c.top_k;
  const std::string ctx = c.describe() + " nodes of " + std::to_string(c.ranks_per_node);
  Buffer buf(g, shape_of(c, 200));
  const int dev = buf.device().index;
  const testing::HtProblem p = c.problem();
  const auto in = gpu_testing::make_ht_inputs(c);
  const Allocator alloc = gpu_testing::poison_allocator(0xAB);
  const Inputs d = upload(c, in[r], dev);
  const auto stream = gpu_testing::rank_stream();
  HtDispatchArgs a;
  a.x = d.x;
  if (c.fp8) a.x_scales = d.scales;
  a.topk_idx = d.topk;
  a.topk_weights = d.weights;
  a.stream = stream;
  const HtDispatchResult res = buf.ht_dispatch(a, alloc);
  const int64_t T = in[r].num_tokens, N = res.handle.num_recv_tokens;
  int64_t bad = 0;
  if (N != testing::ht_oracle_num_recv_tokens(p, in, r)) {
    std::fprintf(stderr, "[rank %d] %s: N = %lld differs from the oracle's\n", r, ctx.c_str(),
                 static_cast<long long>(N));
    return 1;
  }
  bad += exact_under_capture(g, buf, a);
  buf.check();

  // The captured input buffers, then the sequence: eagerly (arena recording), then captured.
  auto in_x = gpu_testing::make_ht_inputs(c, /*salt=*/1);
  auto yin = gpu_testing::make_combine_inputs(c, in, /*weights=*/true, /*bias0=*/true,
                                              /*bias1=*/false, /*salt=*/1);
  const Inputs dx = upload(c, in_x[r], dev);
  const Tensor y = to_device(yin[r].y, DType::kBF16, {N, H}, dev);
  const Tensor yw = to_device(yin[r].topk_weights, DType::kF32, {N, K}, dev);
  const Tensor bias = to_device(yin[r].bias0, DType::kBF16, {T, H}, dev);
  gpu_testing::Arena arena(alloc);
  HtDispatchResult cached;
  HtCombineResult combined;
  auto enqueue = [&] {
    HtDispatchArgs ac;
    ac.x = dx.x;
    if (c.fp8) ac.x_scales = dx.scales;
    ac.handle = &res.handle;
    ac.stream = stream;
    cached = buf.ht_dispatch(ac, arena.allocator());
    HtCombineArgs ca;
    ca.y = y;
    ca.topk_weights = yw;
    ca.bias0 = bias;
    ca.handle = &res.handle;
    ca.stream = stream;
    combined = buf.ht_combine(ca, arena.allocator());
  };
  auto check_outputs = [&](const std::string& when) {
    const HtExpectedDispatch w = testing::ht_oracle_dispatch(p, in_x, r);
    const HtExpectedCombine wc = testing::ht_oracle_combine(p, in, yin, r);
    testing::HtProblem flat = p;
    flat.ranks_per_node = 0;
    if (testing::ht_oracle_combine(flat, in, yin, r).out != wc.out) order_changed = true;
    const std::string cx = ctx + ", " + when;
    int64_t n = mismatches("cached recv_x", cx, r, cached.recv_x, w.recv_x);
    if (c.fp8) n += mismatches("cached recv_x_scales", cx, r, cached.recv_x_scales, w.recv_scales);
    n += mismatches("combine out", cx, r, combined.out, wc.out);
    return n + mismatches("combined_topk_weights", cx, r, combined.combined_topk_weights,
                          wc.combined_topk_weights);
  };
  enqueue();
  CUDA_OK(cudaStreamSynchronize(stream));
  buf.check();
  bad += check_outputs("eager");
  arena.replay();
  cudaGraph_t graph = gpu_testing::capture_graph(stream, enqueue);
  if (graph == nullptr) {
    std::fprintf(stderr, "[rank %d] %s: the capture was invalidated\n", r, ctx.c_str());
    return bad + 1;
  }
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < num_replays; ++rep) {
    const uint64_t salt = 2 + rep;
    in_x = gpu_testing::make_ht_inputs(c, salt);
    yin = gpu_testing::make_combine_inputs(c, in, true, true, false, salt);
    if (rep % 2 == 1) widen(yin, c, c.seed + salt);
    const testing::HtRankInput& xr = in_x[r];
    gpu_testing::upload_on_rank_stream(dx.x.data, xr.x.data(), xr.x.size(), stream);
    if (c.fp8)
      gpu_testing::upload_on_rank_stream(dx.scales.data, xr.scales.data(), xr.scales.size(),
                                         stream);
    gpu_testing::upload_on_rank_stream(y.data, yin[r].y.data(), yin[r].y.size() * 2, stream);
    gpu_testing::upload_on_rank_stream(yw.data, yin[r].topk_weights.data(),
                                       yin[r].topk_weights.size() * 4, stream);
    gpu_testing::upload_on_rank_stream(bias.data, yin[r].bias0.data(), yin[r].bias0.size() * 2,
                                       stream);
    for (const Tensor& t : arena.tensors)  // a replay that writes nothing shows
      if (t.nbytes() > 0) CUDA_OK(cudaMemsetAsync(t.data, 0xA0 + rep, t.nbytes(), stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    bad += check_outputs("graph replay " + std::to_string(rep));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  bool eager_order_changed = false;
  bad += run_case(g, buf, c, /*wide=*/true, eager_order_changed);
  if (bad) std::fprintf(stderr, "[rank %d] FAIL graph %s: %lld mismatches\n", r, ctx.c_str(),
                        static_cast<long long>(bad));
  return bad;
}

// Two random cases of N x G (hidden 512 and 1024, weights given, a rank without tokens), 6
// replays each; across nodes some replay must change a result by the node-first order on some
// rank. N = 1: the one-node CudaHt (its cached dispatch and combine captured, its exact dispatch
// refused under capture), the same checks.
int run_graph_topology(int N, int G) {
  return run_ranks("HtNodesOneGpuGraph", N, G, /*need_order_change=*/N > 1,
                   [&](const Group& g, uint64_t seed, bool& order_changed) {
    int64_t bad = 0;
    for (int64_t hidden : {int64_t{512}, int64_t{1024}}) {
      const int i = hidden == 512 ? 1 : 2;  // case i: rank i % R has no tokens
      HtCase c = random_cases(N, G, hidden, seed + hidden, 3)[i];
      c.weights = true;
      order_sensitive(c);
      bad += graph_case(g, c, /*num_replays=*/6, order_changed);
    }
    return bad;
  });
}

class HtNodesOneGpuGraph : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(HtNodesOneGpuGraph, CachedDispatchAndCombineReplay) {
  EPX_REQUIRE_GPUS(1);
  const auto [N, G] = GetParam();
  EXPECT_EQ(run_graph_topology(N, G), 0);
}

INSTANTIATE_TEST_SUITE_P(Topologies, HtNodesOneGpuGraph,
                         ::testing::Values(std::pair{1, 4}, std::pair{2, 2}, std::pair{2, 4}),
                         gpu_testing::TopologyParamName{});

// What is not built across nodes on cuda raises Unsupported naming the mode, never a flat run.
TEST(HtNodesOneGpuLimits, UnbuiltPathsAreUnsupported) {
  EPX_REQUIRE_GPUS(1);
  GroupOptions o;
  o.ranks_per_node = 1;
  const int rc = gpu_testing::run_cuda_ranks_one_gpu(2, 0, [&](const Group& g) {
    int bad = 0;
    auto expect_unsupported = [&](const char* what, const std::function<void()>& f,
                                  const char* words) {
      bad += gpu_testing::expect_unsupported(g.rank(), what, f, {words});
    };
    HtCase c;
    c.num_ranks = 2;
    c.ranks_per_node = 1;
    c.top_k = 2;
    c.num_experts = 4;
    c.num_tokens = {8, 8};
    MoeShape shape = shape_of(c, 8);
    Buffer buf(g, shape);
    const auto in = gpu_testing::make_ht_inputs(c);
    const Inputs d = upload(c, in[g.rank()], buf.device().index);
    HtDispatchArgs a;
    a.x = d.x;
    a.topk_idx = d.topk;
    a.stream = gpu_testing::rank_stream();
    const Allocator alloc = gpu_testing::poison_allocator(0xAB);
    HtDispatchArgs wc = a;
    wc.num_worst_tokens = 16;
    expect_unsupported("worst-case", [&] { buf.ht_dispatch(wc, alloc); }, "across nodes on cuda");
    HtDispatchArgs zc = a;
    zc.zero_copy = true;
    expect_unsupported("zero-copy", [&] { buf.ht_dispatch(zc, alloc); }, "across nodes on cuda");
    HtDispatchResult res = buf.ht_dispatch(a, alloc);
    expect_unsupported("combine buffer", [&] { buf.ht_combine_buffer(res.handle); },
                       "across nodes on cuda");
    return bad;
  }, o);
  EXPECT_EQ(rc, 0);
}

// A straggler: rank R - 1 skips a dispatch. Every other rank raises Timeout or OutOfStep within
// a few timeouts (no hang), then every rank resets and the next case is exact.
TEST(HtNodesOneGpuErrors, StragglerRaisesTypedErrors) {
  EPX_REQUIRE_GPUS(1);
  const int N = 2, G = 2, R = N * G;
  GroupOptions o;
  o.ranks_per_node = G;
  o.timeout = std::chrono::milliseconds(1500);
  std::atomic<int> raised{0};
  const int rc = gpu_testing::run_cuda_ranks_one_gpu(R, 0, [&](const Group& g) {
    int bad = 0;
    const int r = g.rank();
    HtCase c = random_cases(N, G, 512, 77, 1)[0];
    c.fp8 = false;
    Buffer buf(g, shape_of(c, 200));
    const auto in = gpu_testing::make_ht_inputs(c);
    const Inputs d = upload(c, in[r], buf.device().index);
    const Allocator alloc = gpu_testing::poison_allocator(0xAB);
    if (r == R - 1) {
      const auto start = std::chrono::steady_clock::now();
      while (raised.load() < R - 1) {
        if (std::chrono::steady_clock::now() - start > std::chrono::seconds(30)) {
          std::fprintf(stderr, "[rank %d] the peers did not raise within 30 s\n", r);
          return 1;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else {
      HtDispatchArgs a;
      a.x = d.x;
      a.topk_idx = d.topk;
      if (c.weights) a.topk_weights = d.weights;
      a.expert_alignment = c.alignment;
      a.stream = gpu_testing::rank_stream();
      try {
        for (int i = 0; i < 3; ++i) {  // the error shows within the call or the next ones
          (void)buf.ht_dispatch(a, alloc);
          buf.check();
        }
        std::fprintf(stderr, "[rank %d] no error without the straggler\n", r);
        ++bad;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout && e.code() != ErrorCode::kOutOfStep) {
          std::fprintf(stderr, "[rank %d] unexpected error: %s\n", r, e.what());
          ++bad;
        }
      }
      raised.fetch_add(1);
    }
    // Every rank resets once every peer raised (reset waits 2 x the timeout for the others).
    while (raised.load() < R - 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    buf.reset();
    bool order_changed = false;
    c.ranks_per_node = G;
    return bad + static_cast<int>(run_case(g, buf, c, false, order_changed) != 0);
  }, o);
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace epx
