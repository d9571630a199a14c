// ll mode of the cpu backend against the naive oracle (tests/support/oracle_ll.h), bit for bit on
// every defined element: recv_x bytes, recv_scales (f32 or packed UE8M0, column-major), recv_count,
// src_info, layout_range, cumulative stats, combine out. Random cases cover R, T per rank
// (0..T_max), H, K, E, every routing, bf16/fp8/round_scale/ue8m0/NVFP4 (g as a tensor or a host
// value; recv_x and the interleaved scales read through DeepEP's views), hooks (two dispatches in
// flight, reversed hook order), zero_copy, caller-provided out, padded strides, int32 topk, threads
// and processes. Every output the library allocates comes from a poisoning allocator; every
// caller-provided output is poisoned. Then every ll error case of docs/semantics.md §4, and
// timeouts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "core/numeric.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/ll_cases.h"
#include "support/oracle_ll.h"
#include "support/routing.h"

namespace epx {
namespace {

using testing::LlExpectedDispatch;
using testing::LlProblem;
using testing::LlRankInput;
using testing::Routing;

using Case = testing::LlCase;
using Batch = testing::LlBatch;
using testing::make_ll_batch;

// A copy of rows [n, H] with row stride H + pad (pad 0 when !padded).
struct Rows {
  std::vector<uint16_t> data;
  int64_t stride;
};
Rows padded_copy(const std::vector<uint16_t>& src, int64_t n, int64_t H, bool padded) {
  Rows r{std::vector<uint16_t>(), padded ? H + 64 : H};
  r.data.assign(std::max<int64_t>(n, 1) * r.stride, 0xDEAD);
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(src.begin() + i * H, H, r.data.begin() + i * r.stride);
  return r;
}

// Runs the case on this rank; returns "" or the first failure.
std::string run_rank(const Case& c, const std::vector<Batch>& batches, const Group& g) {
  const LlProblem& p = c.p;
  const int r = g.rank(), K = p.top_k, L = p.num_local_experts();
  const int64_t H = p.hidden, RT = p.rows_per_expert();
  MoeShape shape{H, K, p.num_experts, p.max_tokens};
  BufferConfig config;
  config.enable_ht = false;
  config.enable_ll = true;
  Buffer buf(g, shape, config);
  const Allocator alloc = testing::poison_allocator(0xA5);
  std::string err;
  auto fail = [&](const std::string& where, const std::string& what) {
    if (err.empty() && !what.empty()) err = "rank " + std::to_string(r) + " " + where + ": " + what;
  };
  const int nb = c.num_batches;
  for (int iter = 0; iter < c.num_iters; ++iter) {
    std::vector<const Batch*> bs;
    for (int b = 0; b < nb; ++b) bs.push_back(&batches[iter * nb + b]);
    // Dispatch every batch, then run the hooks.
    std::vector<Rows> xs;
    std::vector<std::vector<int32_t>> topk32(nb), stats(nb);
    std::vector<std::vector<float>> gscale(nb);
    std::vector<LlDispatchResult> d(nb);
    for (int b = 0; b < nb; ++b) {
      const LlRankInput& in = bs[b]->in[r];
      const int64_t T = in.num_tokens;
      xs.push_back(padded_copy(in.x, T, H, c.padded));
      LlDispatchArgs a;
      a.x = TensorView::contiguous(xs[b].data.data(), DType::kBF16, {T, H});
      a.x.strides[0] = xs[b].stride;
      if (c.topk_i32) {
        topk32[b].assign(in.topk_idx.begin(), in.topk_idx.end());
        a.topk_idx = TensorView::contiguous(topk32[b].data(), DType::kI32, {T, K});
      } else {
        a.topk_idx =
            TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64, {T, K});
      }
      a.use_fp8 = p.use_fp8;
      a.round_scale = p.round_scale;
      a.use_ue8m0 = p.use_ue8m0;
      a.use_nvfp4 = p.use_nvfp4;
      if (p.use_nvfp4 && c.seed % 2) {  // g as a tensor (element 0 read; the rest poison)
        gscale[b] = {p.global_scale, -1.0f, 0.0f};
        a.x_global_scale = TensorView::contiguous(gscale[b].data(), DType::kF32, {3});
      } else if (p.use_nvfp4) {
        a.global_scale = p.global_scale;
      }
      a.return_recv_hook = c.hook;
      if (c.stats) {
        stats[b] = bs[b]->stats0[r];
        a.cumulative_local_expert_recv_stats =
            TensorView::contiguous(stats[b].data(), DType::kI32, {L});
      }
      d[b] = buf.ll_dispatch(a, alloc);
      if (static_cast<bool>(d[b].hook) != c.hook) fail("dispatch", "hook presence is wrong");
    }
    if (c.hook)
      for (int i = 0; i < nb; ++i) d[c.reverse_hooks ? nb - 1 - i : i].hook();
    for (int b = 0; b < nb; ++b) {
      const std::string where = "iter " + std::to_string(iter) + " batch " + std::to_string(b);
      fail(where + " dispatch", testing::check_ll_dispatch(p, bs[b]->want[r], d[b]));
      for (int l = 0; l < L && c.stats; ++l)
        if (stats[b][l] != bs[b]->stats0[r][l] + bs[b]->want[r].recv_count[l])
          fail(where + " stats", "cumulative_local_expert_recv_stats[" + std::to_string(l) +
                                     "] = " + std::to_string(stats[b][l]));
    }
    // Combine every batch, then run the hooks.
    std::vector<Rows> ys(nb);
    std::vector<std::vector<uint16_t>> outs(nb);
    std::vector<LlCombineResult> cr(nb);
    for (int b = 0; b < nb; ++b) {
      const LlRankInput& in = bs[b]->in[r];
      const int64_t T = in.num_tokens;
      LlCombineArgs a;
      a.handle = &d[b].handle;
      a.topk_idx =
          TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64, {T, K});
      a.topk_weights =
          TensorView::contiguous(const_cast<float*>(in.topk_weights.data()), DType::kF32, {T, K});
      if (c.zero_copy) {
        TensorView v = buf.ll_next_combine_buffer(d[b].handle);
        if (v.dtype != DType::kBF16 || v.ndim != 3 || v.shape[0] != L || v.shape[1] != RT ||
            v.shape[2] != H)
          fail("next_combine_buffer", "view is " + v.describe());
        for (int l = 0; l < L; ++l)
          for (int64_t row = 0; row < RT; ++row)
            std::memcpy(v.ptr<uint16_t>() + l * v.strides[0] + row * v.strides[1],
                        bs[b]->y[r].data() + (l * RT + row) * H, 2 * H);
        a.zero_copy = true;
      } else {
        ys[b] = padded_copy(bs[b]->y[r], L * RT, H, c.padded);
        a.y = TensorView::contiguous(ys[b].data.data(), DType::kBF16, {L, RT, H});
        a.y.strides = {RT * ys[b].stride, ys[b].stride, 1};
      }
      if (c.out_given) {
        outs[b].assign(std::max<int64_t>(T, 1) * H, 0xFFFF);
        a.out = TensorView::contiguous(outs[b].data(), DType::kBF16, {T, H});
      }
      a.return_recv_hook = c.hook;
      a.use_logfmt = p.use_logfmt;
      cr[b] = buf.ll_combine(a, alloc);
      if (static_cast<bool>(cr[b].hook) != c.hook) fail("combine", "hook presence is wrong");
      if (c.out_given && cr[b].out.data != outs[b].data())
        fail("combine", "out given but the result does not alias it");
    }
    if (c.hook)
      for (int i = 0; i < nb; ++i) cr[c.reverse_hooks ? nb - 1 - i : i].hook();
    for (int b = 0; b < nb; ++b)
      fail("iter " + std::to_string(iter) + " batch " + std::to_string(b) + " combine",
           testing::check_ll_combine(p, bs[b]->want_out[r], cr[b].out));
  }
  return err;
}

// Runs the case on threads (or processes) and reports the failures of every rank.
// EPX_LL_TEST_TIMES=1 prints each case's wall time (for keeping the suite fast).
void run_case(const Case& c, bool processes) {
  SCOPED_TRACE(c.describe());
  const auto t0 = std::chrono::steady_clock::now();
  struct Timer {
    const Case& c;
    std::chrono::steady_clock::time_point t0;
    ~Timer() {
      if (getenv("EPX_LL_TEST_TIMES"))
        std::fprintf(
            stderr, "%8.1f ms  %s\n",
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count(),
            c.describe().c_str());
    }
  } timer{c, t0};
  const std::vector<Batch> batches = testing::make_ll_batches(c);
  GroupOptions options;
  options.ranks_per_node = c.p.ranks_per_node;
  if (processes) {
    int rc = testing::run_processes(
        c.p.num_ranks,
        [&](const Group& g) {
          std::string e = run_rank(c, batches, g);
          if (!e.empty()) std::fprintf(stderr, "%s\n", e.c_str());
          return e.empty() ? 0 : 1;
        },
        options);
    EXPECT_EQ(rc, 0);
    return;
  }
  std::vector<std::string> errors(c.p.num_ranks);
  testing::run_threads(
      c.p.num_ranks, [&](const Group& g) { errors[g.rank()] = run_rank(c, batches, g); }, options);
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

Case random_case(uint64_t seed) { return testing::random_ll_case(0, seed, 0.3); }

constexpr int kNumRandomCases = 240;
constexpr int kNumShards = 4;

class LlRandom : public ::testing::TestWithParam<int> {};

TEST_P(LlRandom, MatchesOracleOnThreads) {
  for (int i = GetParam(); i < kNumRandomCases; i += kNumShards) run_case(random_case(i), false);
}
INSTANTIATE_TEST_SUITE_P(Shards, LlRandom, ::testing::Range(0, kNumShards));

TEST(Ll, MatchesOracleOnProcesses) {
  for (int i = 0; i < 8; ++i) {
    Case c = random_case(100000 + i);
    if (c.p.num_ranks == 1) c.p.num_ranks = 2, c.p.num_experts *= 2;
    run_case(c, true);
  }
}

// Across nodes (docs/design.md §13): random cases at nodes x ranks per node = 2x2, 2x4, 4x2, 3x1,
// against the oracle with that topology (its combine adds per-node fma chains, own node first,
// docs/semantics.md §2.3); hooks, two batches in flight, zero_copy and the rest drawn as above;
// use_logfmt on every third case and on a last, fixed one (§2.3.1: each node's chain over decoded
// rows, float32 partials). At least one case per topology, and one LogFMT case, must see the
// node-first order change a result. At 2x2 and 3x1 half the cases (i % 4 = 2, 3: with and
// without hooks) are NVFP4, whose 9 H / 16-byte messages cross the rail as they are: topology
// and NVFP4 together, every element against the oracle.
class LlNodes : public ::testing::TestWithParam<testing::NodeTopology> {};

void make_nvfp4(LlProblem& p, int i) {
  p.use_fp8 = p.round_scale = p.use_ue8m0 = false;
  p.use_nvfp4 = true;
  p.global_scale = i % 8 == 2 ? 2688.0f / 256.0f : 5000.0f;
}

TEST_P(LlNodes, MatchesOracleOnThreads) {
  const testing::NodeTopology topo = GetParam();
  const int R = topo.num_ranks();
  const bool nvfp4_topology = (topo.nodes == 2 && topo.per_node == 2) || topo.per_node == 1;
  int hooks = 0, logfmt = 0, nvfp4 = 0, order_differs = 0, logfmt_order_differs = 0;
  for (int i = 0; i < 17; ++i) {
    Case c = testing::random_ll_case(R, 200000 + 1000 * R + 10 * topo.per_node + i, 0.3);
    if (i == 16) {  // LogFMT with tokens that reach several nodes
      c.p = {R, 64, 1024, 8, 4 * R, false, false, false, true};
      c.routing = Routing::kUniform;
      c.num_iters = 2;
    }
    c.p.ranks_per_node = topo.per_node;
    c.p.use_logfmt = i % 3 == 0 || i == 16;
    c.hook = i % 2 == 1;
    c.reverse_hooks = c.hook && c.num_batches == 2 && i % 4 == 3;
    if (nvfp4_topology && i % 4 >= 2) make_nvfp4(c.p, i);
    hooks += c.hook;
    logfmt += c.p.use_logfmt;
    nvfp4 += c.p.use_nvfp4;
    run_case(c, false);
    // The same inputs summed in the flat order must differ somewhere in some case.
    LlProblem flat = c.p;
    flat.ranks_per_node = 0;
    for (const Batch& b : testing::make_ll_batches(c)) {
      const bool differs = testing::oracle_ll_combine_all(flat, b.in, b.y) != b.want_out;
      order_differs += differs;
      logfmt_order_differs += differs && c.p.use_logfmt;
    }
  }
  EXPECT_EQ(hooks, 8);
  EXPECT_EQ(logfmt, 7);
  EXPECT_GT(order_differs, 0);
  EXPECT_GT(logfmt_order_differs, 0);
  if (nvfp4_topology) EXPECT_GE(nvfp4, 8);
}

INSTANTIATE_TEST_SUITE_P(Topologies, LlNodes, ::testing::ValuesIn(testing::kCiTopologies),
                         [](const auto& info) { return testing::topology_name(info.param); });

TEST(LlNodesProcesses, TwoByTwoMatchesOracle) {
  for (int i = 0; i < 3; ++i) {
    Case c = testing::random_ll_case(4, 300000 + i, 0.5);
    c.p.ranks_per_node = 2;
    c.p.use_logfmt = i == 2;
    c.hook = i != 0;
    if (i == 2) make_nvfp4(c.p, i);
    run_case(c, true);
  }
}

// Edge shapes every run: DeepSeek-like H, T = T_max on all ranks, K > E, all routings.
TEST(Ll, FixedCases) {
  int seed = 500000;
  for (Routing routing : testing::all_routings()) {
    Case c;
    c.p = {4, 7, 7168, 8, 16, true, true, true};
    c.routing = routing;
    c.hook = true;
    c.num_batches = 2;
    c.seed = seed++;
    run_case(c, false);
    c.p = {2, 64, 128, 16, 4, false, false, false};  // K > E: rows end in -1
    c.zero_copy = true;
    c.out_given = true;
    c.seed = seed++;
    run_case(c, false);
  }
}

// use_logfmt (docs/semantics.md §2.3.1) against the oracle, whose LogFMT is the independent
// tests/support/logfmt_ref.h: every hook / zero_copy / out combination, DeepSeek-like H, K above
// the cuda kernel's load batch, duplicates, T = 0 on a rank, two rounds per buffer; the random
// cases above draw use_logfmt too.
TEST(Ll, LogfmtFixedCases) {
  int seed = 600000;
  for (int v = 0; v < 8; ++v) {
    Case c;
    c.p = {3, 9, v % 2 ? 7168 : 384, v < 4 ? 8 : 16, 12, v % 3 == 0, false, false, true};
    c.routing = v == 5 ? Routing::kDuplicates : Routing::kUniform;
    c.hook = v & 1;
    c.zero_copy = v & 2;
    c.out_given = v & 4;
    c.fixed_tokens = {9, 0, 5};
    c.num_iters = 2;
    c.seed = seed++;
    run_case(c, v == 7);
  }
}

// NVFP4 edge cases (tests/support/ll_cases.h) on 1, 2 and 4 threads, and on 2 processes.
TEST(Ll, Nvfp4CasesMatchOracle) {
  for (int R : {1, 2, 4})
    for (const Case& c : testing::nvfp4_ll_cases(R, 600000 + 100 * R)) run_case(c, false);
  run_case(testing::nvfp4_ll_cases(2, 610000)[1], true);
}

// The worked example of docs/semantics.md §2.2 through the dispatch, bytes and scale positions
// computed by hand: R = 1, E = 1, H = 128, 130 tokens; token t has x = 3 and 1.2 in the first two
// elements of block j = t % 8 (zeros elsewhere); g = 896 -> sf = e4m3((3 / 6) * 896) = 448 =
// 0x7E, inv = 2; 3 * 2 = 6 -> code 7, bf16(1.2) * 2 = 2.40625 -> code 4 (2.0): byte 8j = 0x47.
TEST(Ll, Nvfp4WorkedExample) {
  testing::run_threads(1, [](const Group& g) {
    const int64_t T = 130, H = 128;
    Buffer buf(g, MoeShape{H, 1, 1, T}, {false, true});
    std::vector<uint16_t> x(T * H, 0);
    for (int64_t t = 0; t < T; ++t) {
      x[t * H + 16 * (t % 8)] = detail::f32_to_bf16(3.0f);
      x[t * H + 16 * (t % 8) + 1] = detail::f32_to_bf16(1.2f);
    }
    std::vector<int64_t> topk(T, 0);
    LlDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, 1});
    a.use_fp8 = false;
    a.use_nvfp4 = true;
    a.global_scale = 896.0f;
    const LlDispatchResult d = buf.ll_dispatch(a, testing::poison_allocator(0xA5));
    ASSERT_EQ(d.recv_count.ptr<int32_t>()[0], T);
    const auto* q = d.recv_x.ptr<uint8_t>();        // storage [1, 130, 64]
    const auto* sf = d.recv_scales.ptr<uint8_t>();  // storage [1, 2, 2, 32, 4, 4]: 2048 bytes
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < H / 2; ++c)
        ASSERT_EQ(q[t * H / 2 + c], c == 8 * (t % 8) ? 0x47 : 0) << "row " << t << " byte " << c;
    // Scale (row, j) at (row / 128) * 1024 + (j / 4) * 512 + (row % 32) * 16 + (row % 128 / 32)
    // * 4 + j % 4: row 0 (j 0) at 0, row 37 (j 5) at 597, row 129 (j 1) at 1041.
    EXPECT_EQ(sf[0], 0x7E);
    EXPECT_EQ(sf[597], 0x7E);
    EXPECT_EQ(sf[1041], 0x7E);
    EXPECT_EQ(sf[1], 0);     // row 0, j 1: an all-zero block
    EXPECT_EQ(sf[596], 0);   // row 37, j 4
    EXPECT_EQ(sf[1040], 0);  // row 129, j 0
    // The views: recv_x (130, 64, 1), recv_scales (32, 4, 2, 4, 2, 1).
    EXPECT_EQ(d.recv_x.ndim, 3);
    EXPECT_EQ(d.recv_x.shape[0], T);
    EXPECT_EQ(d.recv_scales.ndim, 6);
    EXPECT_EQ(d.recv_scales.shape[2], 2);
  });
}

// Two-batch overlap: dispatch(A); hookA; dispatch(B); combine(A); hookB; combine(B); hooks.
TEST(Ll, TwoBatchOverlapSequence) {
  Case c;
  c.p = {3, 33, 256, 8, 12, true, false, false};
  c.seed = 777;
  std::mt19937_64 rng(c.seed);
  const Batch A = make_ll_batch(c, rng), B = make_ll_batch(c, rng);
  std::vector<std::string> errors(3);
  testing::run_threads(3, [&](const Group& g) {
    const int r = g.rank();
    const LlProblem& p = c.p;
    Buffer buf(g, p.moe_shape(), {false, true});
    auto dispatch = [&](const Batch& b) {
      LlDispatchArgs a;
      const LlRankInput& in = b.in[r];
      a.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16,
                                   {in.num_tokens, p.hidden});
      a.topk_idx = TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64,
                                          {in.num_tokens, p.top_k});
      a.use_fp8 = p.use_fp8;
      a.return_recv_hook = true;
      return buf.ll_dispatch(a);
    };
    auto combine = [&](const Batch& b, const LlDispatchResult& d) {
      LlCombineArgs a;
      const LlRankInput& in = b.in[r];
      a.y = TensorView::contiguous(const_cast<uint16_t*>(b.y[r].data()), DType::kBF16,
                                   {p.num_local_experts(), p.rows_per_expert(), p.hidden});
      a.topk_idx = TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64,
                                          {in.num_tokens, p.top_k});
      a.topk_weights = TensorView::contiguous(const_cast<float*>(in.topk_weights.data()),
                                              DType::kF32, {in.num_tokens, p.top_k});
      a.handle = &d.handle;
      a.return_recv_hook = true;
      return buf.ll_combine(a);
    };
    for (int layer = 0; layer < 3; ++layer) {
      auto da = dispatch(A);
      da.hook();
      auto db = dispatch(B);
      auto ca = combine(A, da);
      db.hook();
      auto cb = combine(B, db);
      ca.hook();
      cb.hook();
      std::string e = testing::check_ll_dispatch(p, A.want[r], da) +
                      testing::check_ll_dispatch(p, B.want[r], db) +
                      testing::check_ll_combine(p, A.want_out[r], ca.out) +
                      testing::check_ll_combine(p, B.want_out[r], cb.out);
      if (errors[r].empty()) errors[r] = e;
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// ---- errors (docs/semantics.md §4) -------------------------------------------------------

void expect_error(const std::function<void()>& f, ErrorCode code,
                  std::initializer_list<const char*> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an epx::Error " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message lacks '" << n << "': " << e.what();
  }
}

// Small valid inputs of one rank for MoeShape{256, 4, 8, 16}.
struct Small {
  static constexpr int64_t kH = 256, kTMax = 16;
  static constexpr int kK = 4, kE = 8;
  MoeShape shape{kH, kK, kE, kTMax};
  int64_t T = 5;
  std::vector<uint16_t> x = std::vector<uint16_t>(kTMax * 2 * kH, 0x3F80);
  std::vector<int64_t> topk = std::vector<int64_t>(kTMax * 2 * kK, 1);
  std::vector<float> w = std::vector<float>(kTMax * 2 * kK, 0.5f);
  std::vector<int32_t> stats = std::vector<int32_t>(kE, 0);

  LlDispatchArgs dispatch_args() {
    LlDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, kK});
    return a;
  }
  LlCombineArgs combine_args(const LlHandle& h, std::vector<uint16_t>& y, int R) {
    LlCombineArgs a;
    a.y = TensorView::contiguous(y.data(), DType::kBF16, {kE / R, R * kTMax, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, kK});
    a.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {T, kK});
    a.handle = &h;
    return a;
  }
};

BufferConfig ll_only() {
  BufferConfig c;
  c.enable_ht = false;
  c.enable_ll = true;
  return c;
}

TEST(LlErrors, DispatchArguments) {
  testing::run_threads(2, [](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    const auto IA = ErrorCode::kInvalidArgument;
    auto dispatch_with = [&](const std::function<void(LlDispatchArgs&)>& edit) {
      return [&, edit] {
        LlDispatchArgs a = s.dispatch_args();
        edit(a);
        buf.ll_dispatch(a);
      };
    };
    expect_error(dispatch_with([](auto& a) { a.x.dtype = DType::kF32; }), IA, {"'x'", "bf16"});
    expect_error(dispatch_with([](auto& a) { a.x.shape[1] = 128; }), IA, {"'x'", "[5, 128]"});
    expect_error(dispatch_with([&](auto& a) {
                   a.x = TensorView::contiguous(s.x.data(), DType::kBF16, {5 * 256});
                 }),
                 IA, {"'x'"});
    expect_error(dispatch_with([](auto& a) { a.x.strides = {512, 2}; }), IA, {"'x'", "stride"});
    expect_error(dispatch_with([](auto& a) { a.x.device = Device::cuda(0); }), IA,
                 {"'x'", "cuda:0"});
    expect_error(dispatch_with([](auto& a) { a.x = TensorView(); }), IA, {"'x'"});
    expect_error(dispatch_with([&](auto& a) {
                   a.x = TensorView::contiguous(s.x.data(), DType::kBF16, {17, 256});
                   a.topk_idx = TensorView::contiguous(s.topk.data(), DType::kI64, {17, 4});
                 }),
                 ErrorCode::kOutOfCapacity, {"'x'", "T = 17", "T_max = 16", "max_tokens_per_rank"});
    expect_error(dispatch_with([](auto& a) { a.topk_idx.dtype = DType::kF32; }), IA,
                 {"'topk_idx'", "i64"});
    expect_error(dispatch_with([](auto& a) { a.topk_idx.shape[1] = 3; }), IA, {"'topk_idx'"});
    expect_error(dispatch_with([](auto& a) { a.topk_idx.shape[0] = 4; }), IA,
                 {"'topk_idx'", "T = 5"});
    expect_error(dispatch_with([](auto& a) { a.topk_idx = TensorView(); }), IA, {"'topk_idx'"});
    s.topk[2 * 4 + 3] = 8;  // == E
    expect_error(dispatch_with([](auto&) {}), IA, {"'topk_idx'", "value 8", "[2, 3]"});
    s.topk[2 * 4 + 3] = -2;
    expect_error(dispatch_with([](auto&) {}), IA, {"'topk_idx'", "value -2"});
    s.topk[2 * 4 + 3] = 1;
    expect_error(dispatch_with([](auto& a) { a.use_fp8 = true, a.use_ue8m0 = true; }), IA,
                 {"'use_ue8m0'", "round_scale"});
    expect_error(
        dispatch_with([](auto& a) { a.use_fp8 = false, a.round_scale = true, a.use_ue8m0 = true; }),
        IA, {"'use_ue8m0'", "use_fp8"});
    expect_error(dispatch_with([&](auto& a) {
                   a.cumulative_local_expert_recv_stats =
                       TensorView::contiguous(s.stats.data(), DType::kI64, {4});
                 }),
                 IA, {"'cumulative_local_expert_recv_stats'", "i32"});
    expect_error(dispatch_with([&](auto& a) {
                   a.cumulative_local_expert_recv_stats =
                       TensorView::contiguous(s.stats.data(), DType::kI32, {5});
                 }),
                 IA, {"'cumulative_local_expert_recv_stats'", "[4]"});
    // Errors are local and leave no state behind: a valid round trip still works.
    LlDispatchResult d = buf.ll_dispatch(s.dispatch_args());
    EXPECT_EQ(d.recv_count.ptr<int32_t>()[1],
              g.rank() == 0 ? 10 : 0);              // both ranks' 5 tokens on expert 1
    std::vector<uint16_t> y(4 * 32 * 256, 0x3F80);  // 1.0
    LlCombineResult c = buf.ll_combine(s.combine_args(d.handle, y, 2));
    for (int64_t i = 0; i < 5 * 256; ++i) ASSERT_EQ(c.out.ptr<uint16_t>()[i], 0x4000);  // 4*.5*1
  });
}

TEST(LlErrors, Nvfp4Arguments) {
  testing::run_threads(2, [](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    const auto IA = ErrorCode::kInvalidArgument;
    std::vector<float> gs{448.0f * 6.0f};
    std::vector<int32_t> gi{1};
    auto nvfp4_with = [&](const std::function<void(LlDispatchArgs&)>& edit) {
      return [&, edit] {
        LlDispatchArgs a = s.dispatch_args();
        a.use_fp8 = false;
        a.use_nvfp4 = true;
        a.x_global_scale = TensorView::contiguous(gs.data(), DType::kF32, {1});
        edit(a);
        buf.ll_dispatch(a);
      };
    };
    expect_error(nvfp4_with([](auto& a) { a.use_fp8 = true; }), IA,
                 {"ll_dispatch", "'use_fp8'", "'use_nvfp4'", "at most one"});
    expect_error(nvfp4_with([](auto& a) { a.round_scale = a.use_ue8m0 = true; }),
                 ErrorCode::kUnsupported, {"'use_ue8m0'", "use_nvfp4"});
    expect_error(nvfp4_with([](auto& a) { a.x_global_scale = TensorView(); }), IA,
                 {"'x_global_scale'", "required"});
    expect_error(nvfp4_with([](auto& a) { a.global_scale = 1.0f; }), IA,
                 {"'x_global_scale'", "'global_scale'", "exactly one"});
    expect_error(nvfp4_with([&](auto& a) {
                   a.x_global_scale = TensorView::contiguous(gi.data(), DType::kI32, {1});
                 }),
                 IA, {"'x_global_scale'", "f32"});
    expect_error(nvfp4_with([&](auto& a) {
                   a.x_global_scale = TensorView::contiguous(gs.data(), DType::kF32, {0});
                 }),
                 IA, {"'x_global_scale'", "at least one element"});
    expect_error(nvfp4_with([](auto& a) { a.x_global_scale.device = Device::cuda(0); }), IA,
                 {"'x_global_scale'", "cuda:0"});
    for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity()})
      expect_error(nvfp4_with([bad](auto& a) {
                     a.x_global_scale = TensorView();
                     a.global_scale = bad;
                   }),
                   IA, {"'global_scale'", "finite value > 0"});
    // Without use_nvfp4 a global scale is not read (DeepEP's forks pass it on every call).
    LlDispatchArgs a = s.dispatch_args();
    a.x_global_scale = TensorView::contiguous(gi.data(), DType::kI32, {1});
    EXPECT_EQ(buf.ll_dispatch(a).recv_count.ptr<int32_t>()[1], g.rank() == 0 ? 10 : 0);
    // A 0-dim tensor (DeepEP's x_global_scale) is one element.
    a = s.dispatch_args();
    a.use_fp8 = false;
    a.use_nvfp4 = true;
    a.x_global_scale =
        TensorView::contiguous(gs.data(), DType::kF32, std::initializer_list<int64_t>{});
    const LlDispatchResult d = buf.ll_dispatch(a);
    EXPECT_EQ(d.recv_count.ptr<int32_t>()[1], g.rank() == 0 ? 10 : 0);
    EXPECT_EQ(d.recv_x.dtype, DType::kU8);
    EXPECT_EQ(d.recv_scales.dtype, DType::kF8E4M3);
  });
}

TEST(LlErrors, BufferWithoutLlOrBadHidden) {
  testing::run_threads(1, [](const Group& g) {
    Small s;
    BufferConfig ht_only;
    ht_only.enable_ht = true;
    ht_only.enable_ll = false;
    Buffer buf(g, s.shape, ht_only);
    const auto IA = ErrorCode::kInvalidArgument;
    expect_error([&] { buf.ll_dispatch(s.dispatch_args()); }, IA, {"ll_dispatch", "enable_ll"});
    LlHandle h;
    h.buffer_id = buf.id();
    std::vector<uint16_t> y;
    expect_error([&] { buf.ll_combine(s.combine_args(h, y, 1)); }, IA, {"ll_combine", "enable_ll"});
    expect_error([&] { buf.ll_next_combine_buffer(h); }, IA, {"enable_ll"});
    expect_error([&] { buf.ll_clean(); }, IA, {"enable_ll"});
    MoeShape odd = s.shape;
    odd.hidden = 200;
    // Rejected when the buffer is made, before any allocation or collective call.
    expect_error([&] { Buffer buf2(g, odd, ll_only()); }, IA,
                 {"Buffer", "shape.hidden", "200", "multiple of 128"});
  });
}

TEST(LlErrors, CombineArguments) {
  testing::run_threads(2, [](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    Buffer other(g, s.shape, ll_only());
    const LlDispatchResult d = buf.ll_dispatch(s.dispatch_args());
    std::vector<uint16_t> y(4 * 32 * 256, 0x3F80), out(5 * 256);
    const auto IA = ErrorCode::kInvalidArgument;
    auto combine_with = [&](const std::function<void(LlCombineArgs&, LlHandle&)>& edit) {
      return [&, edit] {
        LlHandle h = d.handle;
        LlCombineArgs a = s.combine_args(h, y, 2);
        edit(a, h);
        buf.ll_combine(a);
      };
    };
    expect_error(combine_with([](auto& a, auto&) { a.handle = nullptr; }), IA, {"'handle'"});
    expect_error(combine_with([&](auto&, auto& h) { h.buffer_id = other.id(); }), IA,
                 {"'handle'", "buffer"});
    expect_error(combine_with([](auto&, auto& h) { h.hidden = 512; }), IA, {"'handle'", "H"});
    expect_error(combine_with([](auto&, auto& h) { h.num_experts = 16; }), IA, {"'handle'", "E"});
    expect_error(combine_with([](auto&, auto& h) { h.max_tokens = 8; }), IA, {"'handle'", "T_max"});
    expect_error(combine_with([](auto&, auto& h) { h.slot = 2; }), IA, {"'handle'", "slot"});
    expect_error(combine_with([](auto&, auto& h) { h.src_info = Tensor(); }), IA,
                 {"'handle.src_info'"});
    expect_error(combine_with([](auto& a, auto&) { a.y.dtype = DType::kF32; }), IA, {"'y'"});
    expect_error(combine_with([](auto& a, auto&) { a.y.shape[1] = 16; }), IA, {"'y'"});
    expect_error(combine_with([](auto& a, auto&) { a.y = TensorView(); }), IA, {"'y'"});
    expect_error(combine_with([](auto& a, auto&) { a.topk_idx.shape[0] = 4; }), IA,
                 {"'topk_idx'", "T = 5"});
    expect_error(combine_with([](auto& a, auto&) { a.topk_idx.dtype = DType::kF32; }), IA,
                 {"'topk_idx'"});
    expect_error(combine_with([](auto& a, auto&) { a.topk_weights.dtype = DType::kBF16; }), IA,
                 {"'topk_weights'", "f32"});
    expect_error(combine_with([](auto& a, auto&) { a.topk_weights.shape[1] = 3; }), IA,
                 {"'topk_weights'"});
    expect_error(combine_with([](auto& a, auto&) { a.topk_weights = TensorView(); }), IA,
                 {"'topk_weights'"});
    expect_error(combine_with([&](auto& a, auto&) {
                   a.out = TensorView::contiguous(out.data(), DType::kBF16, {4, 256});
                 }),
                 IA, {"'out'"});
    expect_error(combine_with([&](auto& a, auto&) {
                   a.out = TensorView::contiguous(out.data(), DType::kF32, {5, 256});
                 }),
                 IA, {"'out'", "bf16"});
    expect_error([&] { buf.ll_next_combine_buffer(other.ll_dispatch(s.dispatch_args()).handle); },
                 IA, {"ll_next_combine_buffer", "'handle'"});
    // Still usable: a valid combine.
    LlCombineResult c = buf.ll_combine(s.combine_args(d.handle, y, 2));
    EXPECT_EQ(c.out.ptr<uint16_t>()[0], 0x4000);  // 4 * 0.5 * 1.0
  });
}

TEST(LlErrors, CallOrder) {
  testing::run_threads(2, [](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    const auto IA = ErrorCode::kInvalidArgument;
    LlDispatchArgs a = s.dispatch_args();
    a.return_recv_hook = true;
    // Hook twice.
    LlDispatchResult d1 = buf.ll_dispatch(a);
    d1.hook();
    expect_error([&] { d1.hook(); }, IA, {"hook", "second time"});
    // Three dispatches in flight; after the hooks the third goes through.
    LlDispatchResult d2 = buf.ll_dispatch(a), d3 = buf.ll_dispatch(a);
    expect_error([&] { buf.ll_dispatch(a); }, IA, {"ll_dispatch", "at most two"});
    d2.hook();
    d3.hook();
    LlDispatchResult d4 = buf.ll_dispatch(a);
    d4.hook();
    EXPECT_EQ(d4.recv_count.ptr<int32_t>()[1], g.rank() == 0 ? 10 : 0);
    // A combine waiting for its hook blocks its slot.
    std::vector<uint16_t> y(4 * 32 * 256, 0x3F80);
    LlCombineArgs ca = s.combine_args(d4.handle, y, 2);
    ca.return_recv_hook = true;
    LlCombineResult c = buf.ll_combine(ca);
    expect_error([&] { buf.ll_next_combine_buffer(d4.handle); }, IA,
                 {"ll_next_combine_buffer", "hook"});
    expect_error([&] { buf.ll_combine(ca); }, IA, {"ll_combine", "hook"});
    c.hook();
    EXPECT_EQ(c.out.ptr<uint16_t>()[0], 0x4000);
    // ll_clean discards operations waiting for their hooks.
    LlDispatchResult d5 = buf.ll_dispatch(a);
    buf.ll_clean();
    expect_error([&] { d5.hook(); }, IA, {"ll_clean"});
    LlDispatchResult d6 = buf.ll_dispatch(s.dispatch_args());
    EXPECT_EQ(d6.handle.slot, 0);
    EXPECT_EQ(d6.recv_count.ptr<int32_t>()[1], g.rank() == 0 ? 10 : 0);
  });
}

TEST(LlErrors, RanksDisagreeOnFp8) {
  std::vector<std::string> msgs(2);
  testing::run_threads(2, [&](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    LlDispatchArgs a = s.dispatch_args();
    a.use_fp8 = g.rank() == 0;
    expect_error([&] { buf.ll_dispatch(a); }, ErrorCode::kInvalidArgument,
                 {"ll_dispatch", "use_fp8", "same on every rank"});
    buf.ll_clean();
    EXPECT_EQ(buf.ll_dispatch(s.dispatch_args()).recv_count.ptr<int32_t>()[1],
              g.rank() == 0 ? 10 : 0);
  });
}

// use_nvfp4 on one rank only, then NVFP4 everywhere with different global scales: every rank
// raises InvalidArgument naming the option and each rank's value; ll_clean recovers.
TEST(LlErrors, RanksDisagreeOnNvfp4) {
  testing::run_threads(2, [&](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    LlDispatchArgs a = s.dispatch_args();
    a.use_fp8 = false;
    a.use_nvfp4 = g.rank() == 0;
    if (a.use_nvfp4) a.global_scale = 2.0f;
    expect_error([&] { buf.ll_dispatch(a); }, ErrorCode::kInvalidArgument,
                 {"ll_dispatch", "'use_nvfp4'", "rank 0 has true", "rank 1 has false"});
    buf.ll_clean();
    a.use_nvfp4 = true;
    a.global_scale = g.rank() == 0 ? 2.0f : 0.5f;
    expect_error([&] { buf.ll_dispatch(a); }, ErrorCode::kInvalidArgument,
                 {"'x_global_scale'", "rank 0 has 2", "rank 1 has 0.5", "same on every rank"});
    buf.ll_clean();
    a.global_scale = 2.0f;
    EXPECT_EQ(buf.ll_dispatch(a).recv_count.ptr<int32_t>()[1], g.rank() == 0 ? 10 : 0);
  });
}

// A dispatch whose receive raises adds nothing to cumulative_local_expert_recv_stats (rank 0
// reads its own block before it meets rank 1's mismatching header: no partial counts either).
TEST(LlErrors, FailedReceiveLeavesStatsUntouched) {
  testing::run_threads(2, [&](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    const int64_t L = Small::kE / 2;
    std::fill(s.stats.begin(), s.stats.end(), 7);
    LlDispatchArgs a = s.dispatch_args();
    a.cumulative_local_expert_recv_stats = TensorView::contiguous(s.stats.data(), DType::kI32, {L});
    a.use_fp8 = g.rank() == 0;
    expect_error([&] { buf.ll_dispatch(a); }, ErrorCode::kInvalidArgument, {"use_fp8"});
    for (int64_t l = 0; l < L; ++l) EXPECT_EQ(s.stats[l], 7) << "stats[" << l << "]";
    buf.ll_clean();
    a.use_fp8 = true;
    buf.ll_dispatch(a);  // the same stats, now accumulated: expert 1 of rank 0 gets 2 * T rows
    for (int64_t l = 0; l < L; ++l)
      EXPECT_EQ(s.stats[l], 7 + (g.rank() == 0 && l == 1 ? 2 * s.T : 0)) << "stats[" << l << "]";
  });
}

TEST(LlErrors, CombineTopkDiffersFromDispatch) {
  testing::run_threads(2, [&](const Group& g) {
    Small s;
    Buffer buf(g, s.shape, ll_only());
    std::fill(s.topk.begin(), s.topk.end(), -1);
    const LlDispatchResult d = buf.ll_dispatch(s.dispatch_args());
    std::vector<uint16_t> y(4 * 32 * 256, 0x3F80);
    if (g.rank() == 0) s.topk[0] = 0;  // a selection the dispatch did not send
    auto combine = [&] { buf.ll_combine(s.combine_args(d.handle, y, 2)); };
    if (g.rank() == 0)
      expect_error(combine, ErrorCode::kInvalidArgument, {"ll_combine", "'topk_idx'", "expert 0"});
    else
      combine();
  });
}

// A rank that never makes the call: the others get Timeout naming the operation, quickly.
TEST(LlErrors, RankThatNeverCallsTimesOut) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(300);
  for (int variant = 0; variant < 3; ++variant) {
    const auto start = std::chrono::steady_clock::now();
    testing::run_threads(
        2,
        [&](const Group& g) {
          Small s;
          Buffer buf(g, s.shape, ll_only());
          LlDispatchArgs a = s.dispatch_args();
          if (variant == 2) {
            const LlDispatchResult d = buf.ll_dispatch(a);  // both ranks
            if (g.rank() == 1) return;
            std::vector<uint16_t> y(4 * 32 * 256, 0x3F80);
            expect_error([&] { buf.ll_combine(s.combine_args(d.handle, y, 2)); },
                         ErrorCode::kTimeout, {"ll_combine", "[1]"});
            return;
          }
          if (g.rank() == 1) return;
          a.return_recv_hook = variant == 1;
          expect_error(
              [&] {
                LlDispatchResult d = buf.ll_dispatch(a);
                if (d.hook) d.hook();
              },
              ErrorCode::kTimeout, {"ll_dispatch", "[1]"});
        },
        o);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  }
}

}  // namespace
}  // namespace epx
