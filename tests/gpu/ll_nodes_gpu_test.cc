// tests/gpu/ll_nodes_gpu_test.cc — the cuda ll across nodes on one GPU ("virtual nodes":
// Group::cuda_shared_device with GroupOptions::ranks_per_node, docs/design.md §13.1), every
// output compared bit for bit with the oracle of that topology (tests/support/oracle_ll.h, whose
// combine takes the node-first order of src/cpu/ll_combine.cc), which the cpu backend of the same
// topology must equal too (so cuda equals the cpu backend).
//
// Cases are ll_cases.h's random ones with what this version builds: no zero-copy, no LogFMT, no
// NVFP4, the hook on the dispatch only (fp8, round_scale, UE8M0, stats, a given out, padded rows,
// two batches in flight and two rounds on one buffer stay drawn). With the hook, every input the
// dispatch read is overwritten on the stream right after the call (its hook must read only epx's
// memory), and the hooks run after every batch's send, in reverse order where the case says; every
// other case has the hook, every fourth two batches in flight. Outputs come from the
// poisoning allocator (rows left unwritten show); y rows past the counts are NaN. Half the
// batches take y of values from 2^-24 to 2^24 (either sign) and weights 1, whose float32 sums
// depend on their order: each topology must have a result that the node-first order changes.
// LlNodesOneGpuGraph: {dispatch, combine} captured in a CUDA graph and replayed on new inputs
// (new routing included), fp8 and bf16, checked as above at every replay and eagerly after.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/harness.h"
#include "support/ht_inputs.h"
#include "support/ll_cases.h"
#include "support/oracle_ll.h"
#include "support/routing.h"

namespace epx {
namespace {

using gpu_testing::host_copy;
using gpu_testing::host_ll_dispatch;
using testing::LlBatch;
using testing::LlCase;
using testing::LlProblem;
using testing::LlRankInput;

BufferConfig ll_only() {
  BufferConfig c;
  c.enable_ht = false;
  c.enable_ll = true;
  return c;
}

// The run's seed (fresh unless EPX_TEST_SEED is set), printed with the suite and the topology.
uint64_t topology_seed(const char* suite, int N, int G) {
  const char* v = std::getenv("EPX_TEST_SEED");
  const uint64_t seed =
      v != nullptr
          ? std::strtoull(v, nullptr, 10)
          : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::fprintf(stderr, "%s %dx%d seed %llu\n", suite, N, G, static_cast<unsigned long long>(seed));
  return seed;
}

// body on the N x G ranks on one GPU; 0 when every rank's body returned 0.
int run_ranks_one_gpu(int N, int G, const std::function<int(const Group&)>& body) {
  GroupOptions o;
  o.ranks_per_node = G;
  // Every rank's ll CTAs and rail CTAs co-resident with room to spare (the H200 has 132 SMs).
  o.num_sms = std::max(1, 96 / (N * G));
  return gpu_testing::run_cuda_ranks_one_gpu(N * G, 0, body, o);
}

// A random case of ll_cases.h at N x G, the options this version builds.
LlCase nodes_case(int N, int G, uint64_t seed) {
  LlCase c = testing::random_ll_case(N * G, seed, 0.3);
  c.p.ranks_per_node = G;
  c.zero_copy = false;
  c.p.use_logfmt = false;
  c.p.use_nvfp4 = false;
  c.p.global_scale = 1.0f;
  return c;
}

// y of order-sensitive values (rows below the counts; NaN past them stays) and weights 1, the
// expected out recomputed. True when the node-first order changes some element of some rank's out.
bool widen(const LlCase& c, LlBatch& b, std::mt19937_64& rng) {
  const LlProblem& p = c.p;
  const int L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  for (int r = 0; r < p.num_ranks; ++r)
    for (int l = 0; l < L; ++l) {
      const int64_t n = b.want[r].recv_count[l];
      const std::vector<uint16_t> rows = testing::wide_bf16(n, H, rng);
      std::copy(rows.begin(), rows.end(), b.y[r].begin() + l * RT * H);
    }
  // Weights 1 (or 0 where the id is -1): terms of opposite sign cancel exactly, so the
  // grouping decides whether the small ones survive.
  for (LlRankInput& in : b.in)
    for (size_t i = 0; i < in.topk_idx.size(); ++i) in.topk_weights[i] = in.topk_idx[i] < 0 ? 0 : 1;
  b.want_out = testing::oracle_ll_combine_all(p, b.in, b.y);
  LlProblem flat = p;
  flat.ranks_per_node = 0;
  return testing::oracle_ll_combine_all(flat, b.in, b.y) != b.want_out;
}

// One case on this rank (its own Buffer): every batch's dispatch, then every combine; "" or the
// first failure.
std::string run_rank(const LlCase& c, const std::vector<LlBatch>& batches, const Group& g,
                     cudaStream_t stream) {
  const LlProblem& p = c.p;
  const int r = g.rank(), L = p.num_local_experts(), dev = gpu_testing::device_of(g);
  const int64_t H = p.hidden;
  Buffer buf(g, p.moe_shape(), ll_only());
  std::string err;
  auto fail = [&](const std::string& where, const std::string& what) {
    if (err.empty() && !what.empty()) err = "rank " + std::to_string(r) + " " + where + ": " + what;
  };
  if (buf.bytes_allocated() !=
      Buffer::bytes_needed(Mode::kLl, p.moe_shape(), p.num_ranks, Backend::kCuda, p.ranks_per_node))
    fail("memory", "bytes_allocated differs from bytes_needed");
  const Allocator alloc = gpu_testing::poison_allocator();
  const int nb = c.num_batches;
  for (int iter = 0; iter < c.num_iters && err.empty(); ++iter) {
    std::vector<Tensor> keep;
    std::vector<Tensor> stats(nb);
    std::vector<LlDispatchResult> d(nb);
    for (int b = 0; b < nb; ++b) {
      const LlBatch& bt = batches[iter * nb + b];
      const size_t inputs = keep.size();
      LlDispatchArgs a = gpu_testing::ll_dispatch_inputs(c, bt.in[r], dev, keep);
      a.return_recv_hook = c.hook;
      if (c.stats) {
        stats[b] = gpu_testing::to_device(bt.stats0[r], DType::kI32, {L}, dev);
        a.cumulative_local_expert_recv_stats = stats[b];
      }
      a.stream = stream;
      d[b] = buf.ll_dispatch(a, alloc);
      if (static_cast<bool>(d[b].hook) != c.hook) fail("dispatch", "hook presence is wrong");
      if (c.hook)  // the inputs the call read (x, topk_idx), overwritten before the hook runs
        for (size_t i = inputs; i < keep.size(); ++i)
          CUDA_OK(cudaMemsetAsync(keep[i].data, 0xFF, keep[i].nbytes(), stream));
    }
    if (c.hook)
      for (int i = 0; i < nb; ++i) d[c.reverse_hooks ? nb - 1 - i : i].hook();
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    for (int b = 0; b < nb; ++b) {
      const LlBatch& bt = batches[iter * nb + b];
      const std::string where = "iter " + std::to_string(iter) + " batch " + std::to_string(b);
      std::vector<std::vector<uint8_t>> hk;
      fail(where + " dispatch",
           testing::check_ll_dispatch(p, bt.want[r], host_ll_dispatch(d[b], hk)));
      if (!c.stats) continue;
      const std::vector<int32_t> got = gpu_testing::to_host<int32_t>(stats[b]);
      for (int l = 0; l < L; ++l)
        if (got[l] != bt.stats0[r][l] + bt.want[r].recv_count[l])
          fail(where + " stats", "cumulative_local_expert_recv_stats[" + std::to_string(l) +
                                     "] = " + std::to_string(got[l]));
    }
    std::vector<LlCombineResult> cr(nb);
    for (int b = 0; b < nb; ++b) {
      const LlBatch& bt = batches[iter * nb + b];
      const int64_t T = bt.in[r].num_tokens;
      LlCombineArgs a = gpu_testing::ll_combine_inputs(c, bt.in[r], &bt.y[r], dev, keep);
      a.handle = &d[b].handle;
      if (c.out_given) {
        keep.push_back(gpu_testing::device_allocator()(DType::kBF16, {std::max<int64_t>(T, 1), H},
                                                       Device::cuda(dev)));
        CUDA_OK(cudaMemsetAsync(keep.back().data, 0xFF, keep.back().nbytes(), stream));
        a.out = TensorView::contiguous(keep.back().data, DType::kBF16, {T, H}, Device::cuda(dev));
      }
      a.stream = stream;
      cr[b] = buf.ll_combine(a, alloc);
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    for (int b = 0; b < nb; ++b) {
      std::vector<std::vector<uint8_t>> hk;
      fail("iter " + std::to_string(iter) + " batch " + std::to_string(b) + " combine",
           testing::check_ll_combine(p, batches[iter * nb + b].want_out[r],
                                     host_copy(cr[b].out, hk)));
    }
  }
  return err;
}

// The cpu backend of the same topology, every rank a thread, against the oracle (so cuda, equal
// to the oracle, equals the cpu backend): 0, or 1 with the first failure printed after `label`.
int cpu_backend_fails(const std::string& label, const LlCase& c,
                      const std::vector<LlBatch>& batches) {
  const LlProblem& p = c.p;
  std::vector<std::string> errs(p.num_ranks);
  GroupOptions o;
  o.ranks_per_node = p.ranks_per_node;
  testing::run_threads(
      p.num_ranks,
      [&](const Group& g) {
        const int r = g.rank(), K = p.top_k, L = p.num_local_experts();
        const int64_t H = p.hidden, RT = p.rows_per_expert();
        Buffer buf(g, p.moe_shape(), ll_only());
        for (size_t i = 0; i < batches.size() && errs[r].empty(); ++i) {
          LlRankInput in = batches[i].in[r];
          const int64_t T = in.num_tokens;
          LlDispatchArgs a;
          a.x = TensorView::contiguous(in.x.data(), DType::kBF16, {T, H});
          a.topk_idx = TensorView::contiguous(in.topk_idx.data(), DType::kI64, {T, K});
          a.use_fp8 = p.use_fp8;
          a.round_scale = p.round_scale;
          a.use_ue8m0 = p.use_ue8m0;
          LlDispatchResult d = buf.ll_dispatch(a, testing::poison_allocator(0xAB));
          errs[r] = testing::check_ll_dispatch(p, batches[i].want[r], d);
          std::vector<uint16_t> y = batches[i].y[r];
          LlCombineArgs ca;
          ca.handle = &d.handle;
          ca.topk_idx = a.topk_idx;
          ca.topk_weights = TensorView::contiguous(in.topk_weights.data(), DType::kF32, {T, K});
          ca.y = TensorView::contiguous(y.data(), DType::kBF16, {L, RT, H});
          LlCombineResult cr = buf.ll_combine(ca, testing::poison_allocator(0xAB));
          if (errs[r].empty())
            errs[r] = testing::check_ll_combine(p, batches[i].want_out[r], cr.out);
        }
      },
      o);
  for (int r = 0; r < p.num_ranks; ++r) {
    if (errs[r].empty()) continue;
    std::fprintf(stderr, "%s (%s): cpu backend rank %d: %s\n", label.c_str(), c.describe().c_str(),
                 r, errs[r].c_str());
    return 1;
  }
  return 0;
}

// `count` random cases at N x G on one GPU; the odd cases with uniform routing and K >= 8, every
// batch of odd index (a case's only batch in the odd cases) with order-sensitive y.
int run_topology(int N, int G, int count) {
  const uint64_t seed = topology_seed("LlNodesOneGpu", N, G);
  std::vector<LlCase> cases;
  std::vector<std::vector<LlBatch>> data;
  bool order_changed = false;
  int bad = 0;
  for (int i = 0; i < count; ++i) {
    cases.push_back(nodes_case(N, G, seed + i));
    if (i % 2 == 0) cases.back().hook = true;
    if (i % 4 == 0) {  // two dispatches waiting for their hooks
      cases.back().num_batches = 2;
      cases.back().reverse_hooks = i % 8 == 0;
    }
    if (i % 2 == 1) {  // tokens whose selections span nodes (for the order-sensitive y)
      cases.back().routing = testing::Routing::kUniform;
      cases.back().p.top_k = std::max(cases.back().p.top_k, 8);
    }
    data.push_back(testing::make_ll_batches(cases.back()));
    std::mt19937_64 rng(seed * 31 + i);
    for (size_t b = 1; b < data.back().size(); b += 2)
      order_changed |= widen(cases.back(), data.back()[b], rng);
    if (data.back().size() == 1 && i % 2 == 1)
      order_changed |= widen(cases.back(), data.back()[0], rng);
    bad += cpu_backend_fails("case " + std::to_string(i), cases.back(), data.back());
  }
  if (!order_changed) {
    std::fprintf(stderr, "%dx%d: no case where the node-first order changes a result\n", N, G);
    ++bad;
  }
  return bad + run_ranks_one_gpu(N, G, [&](const Group& g) {
           const gpu_testing::RankStream rs(cudaStreamNonBlocking);
           int failed = 0;
           for (size_t i = 0; i < cases.size() && failed < 3; ++i) {
             std::string err;
             try {
               err = run_rank(cases[i], data[i], g, rs.get());
             } catch (const std::exception& e) {
               err = std::string("exception: ") + e.what();
             }
             if (!err.empty()) {
               std::fprintf(stderr, "case %zu (%s): %s\n", i, cases[i].describe().c_str(),
                            err.c_str());
               ++failed;  // three diagnoses are enough; the peers time out
             }
           }
           return failed;
         });
}

class LlNodesOneGpu : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(LlNodesOneGpu, MatchesOracleAndCpuBackend) {
  EPX_REQUIRE_GPUS(1);
  const auto [N, G] = GetParam();
  EXPECT_EQ(run_topology(N, G, 8), 0);
}

// 2 x 1: node-local ll of one rank; the others: node-local groups of 2 and 4.
INSTANTIATE_TEST_SUITE_P(Topologies, LlNodesOneGpu,
                         ::testing::Values(std::pair{2, 1}, std::pair{2, 2}, std::pair{2, 4},
                                           std::pair{4, 2}),
                         gpu_testing::TopologyParamName{});

// ---- CUDA graphs ------------------------------------------------------------------------------

constexpr int kGraphReplays = 8;

// A graph case at N x G: K = 8 of E = 3R experts, T_max 48, H 512, T per rank fixed (a graph
// bakes x's shape): rank seed % R none, rank (seed + 1) % R T_max. fp8 (round_scale and UE8M0
// drawn) with stats, int32 ids and padded rows; bf16 with int64 ids and a given out.
LlCase graph_case_of(int N, int G, bool fp8, uint64_t seed) {
  const int R = N * G;
  std::mt19937_64 rng(seed * 131 + 7);
  LlCase c;
  c.seed = seed;
  c.p.num_ranks = R;
  c.p.ranks_per_node = G;
  c.p.max_tokens = 48;
  c.p.hidden = 512;
  c.p.top_k = 8;
  c.p.num_experts = 3 * R;
  const uint64_t scales = rng() % 3;  // fp8: plain scales, round_scale, round_scale and UE8M0
  c.p.use_fp8 = fp8;
  c.p.round_scale = fp8 && scales >= 1;
  c.p.use_ue8m0 = fp8 && scales == 2;
  c.stats = c.topk_i32 = c.padded = fp8;
  c.out_given = !fp8;
  for (int r = 0; r < R; ++r)
    c.fixed_tokens.push_back(std::uniform_int_distribution<int64_t>(1, c.p.max_tokens)(rng));
  c.fixed_tokens[seed % R] = 0;
  c.fixed_tokens[(seed + 1) % R] = c.p.max_tokens;
  return c;
}

// Batch 0 for the eager run the graph's outputs are recorded on, 1 .. kGraphReplays for the
// replays, the last for the eager run after them. Routing: uniform on odd batches (whose y is
// order-sensitive: widen), the kinds of all_routings() in turn on even ones; batches 2, 5, 8
// keep the previous batch's topk_idx (new weights, x and y). Sets `order_changed` as widen.
std::vector<LlBatch> graph_batches(LlCase& c, bool& order_changed) {
  const std::vector<testing::Routing> kinds = testing::all_routings();
  std::mt19937_64 rng(c.seed);
  std::vector<LlBatch> v;
  for (int i = 0; i < kGraphReplays + 2; ++i) {
    c.routing = i % 2 == 1 ? testing::Routing::kUniform : kinds[(i / 2) % kinds.size()];
    LlBatch b = testing::make_ll_batch(c, rng);
    if (i % 3 == 2) {
      for (size_t r = 0; r < b.in.size(); ++r) {
        b.in[r].topk_idx = v.back().in[r].topk_idx;
        b.in[r].topk_weights = testing::make_topk_weights(b.in[r].topk_idx, rng);
      }
      testing::finish_ll_batch(c, b, rng);
    }
    if (i % 2 == 1) order_changed |= widen(c, b, rng);
    v.push_back(std::move(b));
  }
  return v;
}

// Case c on this rank's buffer: {dispatch, combine} run eagerly on batch 0 (the arena records the
// outputs), captured on the rank stream, replayed on batches 1 .. kGraphReplays written into the
// captured input buffers (x, topk_idx of both calls, weights, y, stats), every output poisoned
// before each replay, then run eagerly on the last batch (outputs from the poisoning allocator):
// every run's recv_x, scales, recv_count, src_info, layout_range, stats and out checked.
// Failures (printed).
int graph_case(const Group& g, Buffer& buf, const LlCase& c, const std::vector<LlBatch>& batches) {
  const LlProblem& p = c.p;
  const int r = g.rank(), dev = gpu_testing::device_of(g), L = p.num_local_experts();
  const int64_t T = c.fixed_tokens[r], H = p.hidden, RT = p.rows_per_expert();
  const std::string ctx = c.describe();
  const cudaStream_t stream = gpu_testing::rank_stream();
  std::vector<Tensor> keep;
  LlDispatchArgs da = gpu_testing::ll_dispatch_inputs(c, batches[0].in[r], dev, keep);
  da.stream = stream;
  Tensor stats;
  if (c.stats) {
    stats = gpu_testing::to_device(batches[0].stats0[r], DType::kI32, {L}, dev);
    da.cumulative_local_expert_recv_stats = stats;
  }
  LlCombineArgs ca =
      gpu_testing::ll_combine_inputs(c, batches[0].in[r], &batches[0].y[r], dev, keep);
  ca.stream = stream;
  Tensor out;
  if (c.out_given) {
    out = gpu_testing::device_allocator()(DType::kBF16, {std::max<int64_t>(T, 1), H},
                                          Device::cuda(dev));
    ca.out = TensorView::contiguous(out.data, DType::kBF16, {T, H}, Device::cuda(dev));
  }
  // New inputs into the captured buffers (the layouts ll_dispatch_inputs / ll_combine_inputs
  // made).
  auto upload = [&](const LlBatch& b) {
    const LlRankInput& in = b.in[r];
    int64_t stride = 0;
    const std::vector<uint16_t> x = gpu_testing::rows_image(in.x, T, H, c.padded, &stride);
    gpu_testing::upload_on_rank_stream(da.x.data, x.data(), x.size() * 2, stream);
    const std::vector<int32_t> ids32(in.topk_idx.begin(), in.topk_idx.end());
    for (void* ids : {da.topk_idx.data, ca.topk_idx.data}) {
      if (c.topk_i32) {
        gpu_testing::upload_on_rank_stream(ids, ids32.data(), ids32.size() * 4, stream);
      } else {
        gpu_testing::upload_on_rank_stream(ids, in.topk_idx.data(), in.topk_idx.size() * 8, stream);
      }
    }
    gpu_testing::upload_on_rank_stream(ca.topk_weights.data, in.topk_weights.data(),
                                       in.topk_weights.size() * 4, stream);
    const std::vector<uint16_t> y = gpu_testing::rows_image(b.y[r], L * RT, H, c.padded, &stride);
    gpu_testing::upload_on_rank_stream(ca.y.data, y.data(), y.size() * 2, stream);
    if (c.stats) gpu_testing::upload_on_rank_stream(stats.data, b.stats0[r].data(), L * 4, stream);
  };
  LlDispatchResult d;
  LlCombineResult cr;
  auto round = [&](const Allocator& alloc) {
    d = buf.ll_dispatch(da, alloc);
    LlCombineArgs a = ca;
    a.handle = &d.handle;
    cr = buf.ll_combine(a, alloc);
  };
  int bad = 0;
  auto verify = [&](const LlBatch& b, const std::string& when) {
    std::string err;
    try {
      CUDA_OK(cudaStreamSynchronize(stream));
      buf.check();
      std::vector<std::vector<uint8_t>> hk;
      err = testing::check_ll_dispatch(p, b.want[r], gpu_testing::host_ll_dispatch(d, hk));
      if (c.stats) {
        const std::vector<int32_t> got = gpu_testing::to_host<int32_t>(stats);
        for (int l = 0; l < L && err.empty(); ++l)
          if (got[l] != b.stats0[r][l] + b.want[r].recv_count[l])
            err = "cumulative_local_expert_recv_stats[" + std::to_string(l) +
                  "] = " + std::to_string(got[l]);
      }
      if (err.empty())
        err = testing::check_ll_combine(p, b.want_out[r], gpu_testing::host_copy(cr.out, hk));
    } catch (const std::exception& e) {
      err = std::string("exception: ") + e.what();
    }
    if (err.empty()) return;
    std::fprintf(stderr, "[rank %d] %s, %s: %s\n", r, ctx.c_str(), when.c_str(), err.c_str());
    ++bad;
  };

  gpu_testing::Arena arena(gpu_testing::poison_allocator(0xAB));
  upload(batches[0]);
  round(arena.allocator());
  verify(batches[0], "eager");
  arena.replay();
  cudaGraph_t graph = gpu_testing::capture_graph(stream, [&] { round(arena.allocator()); });
  if (graph == nullptr) {
    std::fprintf(stderr, "[rank %d] %s: the capture was invalidated\n", r, ctx.c_str());
    return bad + 1;
  }
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 1; rep <= kGraphReplays; ++rep) {  // all of them: the peers replay too
    upload(batches[rep]);
    for (const Tensor& t : arena.tensors)  // a replay that writes nothing shows
      if (t.nbytes() > 0) CUDA_OK(cudaMemsetAsync(t.data, 0xA0 + rep, t.nbytes(), stream));
    if (c.out_given) CUDA_OK(cudaMemsetAsync(out.data, 0xA0 + rep, out.nbytes(), stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    verify(batches[rep], "graph replay " + std::to_string(rep));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // Eagerly after the replays: the node-local ll and the rail still in step.
  upload(batches.back());
  if (c.out_given) CUDA_OK(cudaMemsetAsync(out.data, 0xFF, out.nbytes(), stream));
  round(gpu_testing::poison_allocator());
  verify(batches.back(), "eager after the replays");
  return bad;
}

// The fp8 and the bf16 graph case at N x G on one buffer per rank, every batch also through the
// cpu backend of the topology (which the oracle must match); across nodes some replay must change
// a result by the node-first order.
int run_graph_topology(int N, int G) {
  const uint64_t seed = topology_seed("LlNodesOneGpuGraph", N, G);
  std::vector<LlCase> cases;
  std::vector<std::vector<LlBatch>> data;
  bool order_changed = false;
  int bad = 0;
  for (bool fp8 : {true, false}) {
    cases.push_back(graph_case_of(N, G, fp8, seed + (fp8 ? 0 : 1)));
    data.push_back(graph_batches(cases.back(), order_changed));
    bad += cpu_backend_fails(fp8 ? "fp8 graph case" : "bf16 graph case", cases.back(), data.back());
  }
  if (N > 1 && !order_changed) {
    std::fprintf(stderr, "%dx%d: no replay where the node-first order changes a result\n", N, G);
    ++bad;
  }
  return bad + run_ranks_one_gpu(N, G, [&](const Group& g) {
           Buffer buf(g, cases[0].p.moe_shape(), ll_only());
           int failed = 0;  // every case on every rank: the peers wait for it
           for (size_t i = 0; i < cases.size(); ++i)
             failed += graph_case(g, buf, cases[i], data[i]);
           return failed;
         });
}

class LlNodesOneGpuGraph : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(LlNodesOneGpuGraph, DispatchAndCombineReplay) {
  EPX_REQUIRE_GPUS(1);
  const auto [N, G] = GetParam();
  EXPECT_EQ(run_graph_topology(N, G), 0);
}

// 1 x 4: the one-node CudaLl on the shared GPU, the same checks.
INSTANTIATE_TEST_SUITE_P(Topologies, LlNodesOneGpuGraph,
                         ::testing::Values(std::pair{1, 4}, std::pair{2, 2}, std::pair{2, 4}),
                         gpu_testing::TopologyParamName{});

// ---- limits and misuse, at 2 x 1 ----------------------------------------------------------------

// A tiny problem (E = 4 of R = 2, K = 2, H = 128, T = 4 of T_max 8; x and y all 1.0, weights
// 0.5) on rank g's buffer, and a check that `f` raises `code` with every needle in its message.
struct Tiny {
  static constexpr int64_t T = 4, H = 128, K = 2, L = 2, RT = 16;
  Tensor x, topk, w, y, wait;

  explicit Tiny(int dev)
      : x(gpu_testing::to_device(std::vector<uint16_t>(T * H, 0x3F80), DType::kBF16, {T, H}, dev)),
        topk(gpu_testing::to_device(std::vector<int64_t>{0, 3, 1, 2, 2, -1, 3, 0}, DType::kI64,
                                    {T, K}, dev)),
        w(gpu_testing::to_device(std::vector<float>(T * K, 0.5f), DType::kF32, {T, K}, dev)),
        y(gpu_testing::to_device(std::vector<uint16_t>(L * RT * H, 0x3F80), DType::kBF16,
                                 {L, RT, H}, dev)),
        wait(gpu_testing::to_device(std::vector<int64_t>(2, 0), DType::kI64, {2}, dev)) {}
  static MoeShape shape() { return MoeShape{128, 2, 4, 8}; }
  LlDispatchArgs dispatch(bool hook) const {
    LlDispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.use_fp8 = false;
    a.return_recv_hook = hook;
    a.stream = gpu_testing::rank_stream();
    return a;
  }
  LlCombineArgs combine(const LlDispatchResult& d) const {
    LlCombineArgs ca;
    ca.y = y;
    ca.topk_idx = topk;
    ca.topk_weights = w;
    ca.handle = &d.handle;
    ca.stream = gpu_testing::rank_stream();
    return ca;
  }
  // 0 when `out` is 0.5 y + 0.5 y = 1.0 but token 2's (one selection) 0.5, else 1 (printed).
  static int check_out(const Group& g, const LlCombineResult& cr, const char* what) {
    CUDA_OK(cudaStreamSynchronize(gpu_testing::rank_stream()));
    const std::vector<uint16_t> out = gpu_testing::to_host<uint16_t>(cr.out);
    for (int64_t i = 0; i < T * H; ++i) {
      if (out[i] == (i / H == 2 ? 0x3F00 : 0x3F80)) continue;
      std::fprintf(stderr, "[rank %d] %s: combine out[%lld] = 0x%04x\n", g.rank(), what,
                   static_cast<long long>(i), out[i]);
      return 1;
    }
    return 0;
  }
};

// Every option this version does not build raises Unsupported naming it and "across nodes on
// cuda", before any communication (so no rank waits for a peer).
TEST(LlNodesOneGpuLimits, UnbuiltOptionsAreUnsupported) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_ranks_one_gpu(2, 1, [&](const Group& g) {
    const Tiny t(gpu_testing::device_of(g));
    Buffer buf(g, Tiny::shape(), ll_only());
    const Allocator alloc = gpu_testing::poison_allocator();
    auto unsupported = [&](const char* what, const std::function<void()>& f, const char* name) {
      return gpu_testing::expect_unsupported(g.rank(), what, f, {name, "across nodes on cuda"});
    };
    int bad = 0;
    LlDispatchArgs fp4 = t.dispatch(false);
    fp4.use_nvfp4 = true;
    fp4.global_scale = 1.0f;
    bad += unsupported("nvfp4", [&] { buf.ll_dispatch(fp4, alloc); }, "use_nvfp4");
    LlDispatchArgs ws = t.dispatch(false);
    ws.dispatch_wait_recv_cost_stats = t.wait;
    bad += unsupported("dispatch wait stats", [&] { buf.ll_dispatch(ws, alloc); },
                       "dispatch_wait_recv_cost_stats");
    LlDispatchResult d = buf.ll_dispatch(t.dispatch(false), alloc);
    bad += unsupported("next combine buffer", [&] { buf.ll_next_combine_buffer(d.handle); },
                       "ll_next_combine_buffer");
    const LlCombineArgs ca = t.combine(d);
    LlCombineArgs ch = ca;
    ch.return_recv_hook = true;
    bad += unsupported("combine hook", [&] { buf.ll_combine(ch, alloc); }, "return_recv_hook");
    LlCombineArgs lf = ca;
    lf.use_logfmt = true;
    bad += unsupported("logfmt", [&] { buf.ll_combine(lf, alloc); }, "use_logfmt");
    LlCombineArgs cw = ca;
    cw.combine_wait_recv_cost_stats = t.wait;
    bad += unsupported("combine wait stats", [&] { buf.ll_combine(cw, alloc); },
                       "combine_wait_recv_cost_stats");
    const Tensor signals = gpu_testing::to_device(std::vector<int32_t>(Tiny::L, 1), DType::kI32,
                                                  {Tiny::L}, gpu_testing::device_of(g));
    LlCombineArgs ov = ca;
    ov.overlap = LlCombineOverlap{};
    ov.overlap->signals = signals;
    bad += unsupported("overlap", [&] { buf.ll_combine(ov, alloc); }, "overlap");
    // The plain combine still runs after them.
    const LlCombineResult cr = buf.ll_combine(ca, alloc);
    buf.check();
    return bad + Tiny::check_out(g, cr, "after the refusals");
  });
  EXPECT_EQ(rc, 0);
}

// The dispatch hook's misuse, each InvalidArgument before any communication: a third dispatch
// while two wait for their hooks, a combine through a handle whose hook was not called, a hook
// called twice, a hook after ll_clean; the buffer keeps working after each (outputs checked).
TEST(LlNodesOneGpuLimits, DispatchHookMisuse) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_ranks_one_gpu(2, 1, [&](const Group& g) {
    const Tiny t(gpu_testing::device_of(g));
    Buffer buf(g, Tiny::shape(), ll_only());
    const Allocator alloc = gpu_testing::poison_allocator();
    auto invalid = [&](const char* what, const std::function<void()>& f,
                       std::initializer_list<const char*> needles) {
      return gpu_testing::expect_error(g.rank(), what, f, ErrorCode::kInvalidArgument, needles);
    };
    int bad = 0;
    LlDispatchResult d1 = buf.ll_dispatch(t.dispatch(true), alloc);
    LlDispatchResult d2 = buf.ll_dispatch(t.dispatch(true), alloc);
    bad += invalid("third dispatch", [&] { buf.ll_dispatch(t.dispatch(false), alloc); },
                   {"ll_dispatch", "hook was not called", "at most two"});
    bad += invalid("combine before the hook", [&] { buf.ll_combine(t.combine(d1), alloc); },
                   {"ll_combine", "'handle'", "hook was not called"});
    d1.hook();
    bad += invalid("second hook call", [&] { d1.hook(); }, {"ll_dispatch hook", "second time"});
    d2.hook();
    bad += Tiny::check_out(g, buf.ll_combine(t.combine(d2), alloc), "batch 2");
    bad += Tiny::check_out(g, buf.ll_combine(t.combine(d1), alloc), "batch 1");
    LlDispatchResult d3 = buf.ll_dispatch(t.dispatch(true), alloc);
    CUDA_OK(cudaStreamSynchronize(gpu_testing::rank_stream()));
    buf.ll_clean();
    bad += invalid("hook after ll_clean", [&] { d3.hook(); }, {"ll_dispatch hook", "ll_clean"});
    LlDispatchResult d4 = buf.ll_dispatch(t.dispatch(true), alloc);
    d4.hook();
    bad += Tiny::check_out(g, buf.ll_combine(t.combine(d4), alloc), "after ll_clean");
    buf.check();
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace epx
