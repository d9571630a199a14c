// Topology on the cpu backend (GroupOptions::ranks_per_node, docs/design.md §13): the option's
// validation at group creation (typed errors naming the argument and the expected values), its
// agreement across ranks, buffer sizes across nodes, hand-worked combines whose result depends on
// the topology (the node-first order of docs/semantics.md §1.6 and §2.3, independent of the
// oracle), per-call values compared across nodes (headers that reach the other nodes over the
// rail), and a2a, which is the same on every topology. The random ht / ll cases at 2x2, 2x4, 4x2
// and 3x1 are HtNodes (ht_test.cc) and LlNodes (ll_test.cc).
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "epx/a2a.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "support/a2a_cycle.h"
#include "support/harness.h"
#include "support/ll_cases.h"
#include "support/routing.h"

namespace epx {
namespace {

// Runs `call`, which must throw `code` with every piece of `has` in its message.
template <typename Call>
void expect_error(Call call, ErrorCode code, const std::vector<std::string>& has,
                  const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << ": expected " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    for (const std::string& s : has)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << what << ": message '" << e.what() << "' does not mention '" << s << "'";
  }
}

GroupOptions nodes_of(int ranks_per_node) {
  GroupOptions o;
  o.ranks_per_node = ranks_per_node;
  return o;
}

// ---- the option ---------------------------------------------------------------------------------

TEST(NodesGroup, BadRanksPerNodeIsInvalidArgument) {
  const std::string name = testing::unique_group_name("bad");
  for (int bad : {-1, 3, 5, 8}) {
    const std::string value = "GroupOptions::ranks_per_node is " + std::to_string(bad);
    expect_error([&] { Group::cpu_threads(0, 4, name, nodes_of(bad)); },
                 ErrorCode::kInvalidArgument,
                 {"Group::cpu_threads", value, "divisor of the group size 4 (1, 2, 4)"},
                 "threads " + std::to_string(bad));
    expect_error([&] { Group::cpu_processes(0, 4, name, nodes_of(bad)); },
                 ErrorCode::kInvalidArgument, {"Group::cpu_processes", value, "(1, 2, 4)"},
                 "processes " + std::to_string(bad));
  }
  expect_error(
      [&] { Group::cpu_threads(0, 6, name, nodes_of(4)); }, ErrorCode::kInvalidArgument,
      {"ranks_per_node is 4",
       "expected 0 (every rank on one node) or a divisor of the group size 6 (1, 2, 3, 6)"},
      "size 6");
}

TEST(NodesGroup, TopologyIsResolved) {
  for (const auto& [per_node, nodes, resolved] :
       std::vector<std::tuple<int, int, int>>{{0, 1, 4}, {4, 1, 4}, {2, 2, 2}, {1, 4, 1}}) {
    testing::run_threads(
        4,
        [&](const Group& g) {
          EXPECT_EQ(g.num_nodes(), nodes) << per_node;
          EXPECT_EQ(g.ranks_per_node(), resolved) << per_node;
          EXPECT_EQ(g.options().ranks_per_node, resolved) << per_node;
        },
        nodes_of(per_node));
  }
}

TEST(NodesGroup, CudaAcrossNodesIsUnsupported) {
  // Refused before CUDA or NCCL is touched, in builds with and without CUDA.
  expect_error([] { Group::cuda(0, 4, UniqueId{}, 0, nodes_of(2)); }, ErrorCode::kUnsupported,
               {"Group::cuda", "2 nodes of 2 ranks", "no across-node path", "design.md §13"},
               "cuda");
  // (Group::cuda_shared_device accepts virtual nodes: tests/gpu/ht_nodes_gpu_test.cc.)
  expect_error([] { Group::cuda(0, 4, UniqueId{}, 0, nodes_of(1)); }, ErrorCode::kUnsupported,
               {"4 nodes of 1 ranks", "GPU per rank", "Group::cuda_shared_device"}, "cuda 4x1");
  expect_error([] { Group::cuda(0, 4, UniqueId{}, 0, nodes_of(3)); }, ErrorCode::kInvalidArgument,
               {"ranks_per_node is 3"}, "cuda, not a divisor");
}

TEST(NodesBuffer, RanksPerNodeMustAgree) {
  std::vector<GroupOptions> options(4, nodes_of(2));
  options[3] = nodes_of(4);
  testing::run_threads(
      4,
      [](const Group& g) {
        expect_error(
            [&] {
              Buffer buf(g, MoeShape{128, 2, 8, 4});
            },
            ErrorCode::kInvalidArgument,
            {"Buffer: GroupOptions::ranks_per_node differs across ranks: ranks 0-2 have "
             "2, rank 3 has 4"},
            "rank " + std::to_string(g.rank()));
      },
      options);
}

TEST(NodesBuffer, BytesNeededIsWhatIsAllocated) {
  const MoeShape shape{256, 4, 16, 24};
  for (int per_node : {2, 4}) {
    testing::run_threads(
        8,
        [&](const Group& g) {
          Buffer ht(g, shape), ll(g, shape, {false, true}), both(g, shape, {true, true});
          const size_t need_ht = Buffer::bytes_needed(Mode::kHt, shape, 8, Backend::kCpu, per_node);
          const size_t need_ll = Buffer::bytes_needed(Mode::kLl, shape, 8, Backend::kCpu, per_node);
          EXPECT_EQ(ht.bytes_allocated(), need_ht);
          EXPECT_EQ(ll.bytes_allocated(), need_ll);
          EXPECT_EQ(both.bytes_allocated(), need_ht + need_ll);
          // The rail's chunks come on top of one node's region.
          EXPECT_GT(need_ht, Buffer::bytes_needed(Mode::kHt, shape, 8, Backend::kCpu));
          EXPECT_GT(need_ll, Buffer::bytes_needed(Mode::kLl, shape, 8, Backend::kCpu));
        },
        nodes_of(per_node));
  }
  EXPECT_EQ(Buffer::bytes_needed(Mode::kHt, shape, 8, Backend::kCpu, 8),
            Buffer::bytes_needed(Mode::kHt, shape, 8, Backend::kCpu));
  expect_error([&] { (void)Buffer::bytes_needed(Mode::kHt, shape, 8, Backend::kCpu, 3); },
               ErrorCode::kInvalidArgument, {"'ranks_per_node' is 3", "divisor of num_ranks = 8"},
               "bytes_needed 3");
}

// ---- the combine order, by hand ----------------------------------------------------------------
// R = 4, E = 4 (expert e on rank e), K = 3, H = 128: every rank has one token with experts
// {1, 2, 3}; rank d's expert outputs are all v_d, v_1 = 1, v_2 = 2^24, v_3 = -2^24 (exact in bf16).
// float32 sums: 1 + 2^24 rounds to 2^24 (a tie, to even), so the grouping decides the result:
//   one node (1x4), every rank: ((0 + 1) + 2^24) - 2^24                       = 0
//   2x2, ranks 0, 1 (node 0): (0 + 1) + [(0 + 2^24) - 2^24]                    = 1
//        ranks 2, 3 (node 1): ((0 + 2^24) - 2^24) + [0 + 1]                    = 1
//   4x1, ranks 0-2: e.g. rank 2: 2^24 + 1 -> 2^24, then - 2^24                 = 0
//        rank 3: (0 - 2^24) + 1 = -(2^24 - 1) exactly, then + 2^24             = 1
// (own node's partial first, then the other nodes' ascending; docs/semantics.md §1.6, §2.3).
constexpr uint16_t kValueBits[4] = {0x0000, 0x3F80, 0x4B80, 0xCB80};  // 0, 1, 2^24, -2^24

float expected_by_hand(int nodes, int rank) {
  if (nodes == 2) return 1.0f;
  return nodes == 4 && rank == 3 ? 1.0f : 0.0f;
}

// Runs `dispatch_and_combine` (a rank's dispatch of the token above and its combine; returns its
// out, bf16 [1, 128]) at 1, 2 and 4 nodes and checks every element against expected_by_hand.
void check_by_hand(const std::function<Tensor(const Group&)>& dispatch_and_combine) {
  for (int nodes : {1, 2, 4}) {
    testing::run_threads(
        4,
        [&](const Group& g) {
          const Tensor out = dispatch_and_combine(g);
          const uint16_t want = detail::f32_to_bf16(expected_by_hand(nodes, g.rank()));
          for (int h = 0; h < 128; ++h)
            ASSERT_EQ(out.ptr<uint16_t>()[h], want)
                << nodes << " nodes, rank " << g.rank() << ", h " << h;
        },
        nodes_of(4 / nodes));
  }
}

TEST(NodesHt, CombineOrderByHand) {
  check_by_hand([](const Group& g) {
    const int r = g.rank();
    Buffer buf(g, MoeShape{128, 3, 4, 2});
    std::vector<int64_t> topk{1, 2, 3};
    std::vector<uint16_t> x(128, detail::f32_to_bf16(1.0f + r));
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {1, 128});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {1, 3});
    HtDispatchResult res = buf.ht_dispatch(a, testing::poison_allocator(0xAB));
    const int64_t N = res.recv_x.shape[0];
    EXPECT_EQ(N, r == 0 ? 0 : 4);
    for (int64_t i = 0; i < N; ++i)  // the rows arrive in source order, as on one node
      EXPECT_EQ(res.recv_x.ptr<uint16_t>()[i * 128], detail::f32_to_bf16(1.0f + i));
    std::vector<uint16_t> y(std::max<int64_t>(N, 1) * 128, kValueBits[r]);
    HtCombineArgs c;
    c.y = TensorView::contiguous(y.data(), DType::kBF16, {N, 128});
    c.handle = &res.handle;
    return buf.ht_combine(c, testing::poison_allocator(0xAB)).out;
  });
}

TEST(NodesLl, CombineOrderByHand) {
  check_by_hand([](const Group& g) {
    const int r = g.rank();
    constexpr int64_t kTmax = 2, kRT = 4 * kTmax;
    Buffer buf(g, MoeShape{128, 3, 4, kTmax}, {false, true});
    std::vector<int64_t> topk{1, 2, 3};
    std::vector<float> w{1.0f, 1.0f, 1.0f};  // fmaf(1, y, acc) is acc + y, rounded once
    std::vector<uint16_t> x(128, detail::f32_to_bf16(1.0f + r));
    LlDispatchArgs a;
    a.use_fp8 = false;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {1, 128});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {1, 3});
    LlDispatchResult res = buf.ll_dispatch(a, testing::poison_allocator(0xAB));
    EXPECT_EQ(res.recv_count.ptr<int32_t>()[0], r == 0 ? 0 : 4);
    for (int s = 0; s < 4 && r > 0; ++s)  // source order, as on one node
      EXPECT_EQ(res.recv_x.ptr<uint16_t>()[s * 128], detail::f32_to_bf16(1.0f + s));
    std::vector<uint16_t> y(kRT * 128, kValueBits[r]);
    LlCombineArgs c;
    c.y = TensorView::contiguous(y.data(), DType::kBF16, {1, kRT, 128});
    c.topk_idx = a.topk_idx;
    c.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {1, 3});
    c.handle = &res.handle;
    return buf.ll_combine(c, testing::poison_allocator(0xAB)).out;
  });
}

// ---- per-call values are compared across nodes --------------------------------------------------
// 2x2: a value that differs on a rank of the other node reaches every rank (in the rail's chunk
// headers), so every rank raises, naming it; the next call in step works.
TEST(NodesAgreement, PerCallValuesComparedAcrossNodes) {
  testing::run_threads(
      4,
      [](const Group& g) {
        const int r = g.rank();
        Buffer buf(g, MoeShape{128, 2, 8, 4}, {true, true});
        std::vector<int64_t> topk{0, 7, 3, 4, 5, -1, 2, 6};
        std::vector<float> w(8, 0.5f);
        std::vector<uint16_t> x(4 * 128, detail::f32_to_bf16(0.25f));
        HtDispatchArgs a;
        a.x = TensorView::contiguous(x.data(), DType::kBF16, {4, 128});
        a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {4, 2});
        if (r == 3) a.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {4, 2});
        expect_error([&] { buf.ht_dispatch(a); }, ErrorCode::kInvalidArgument,
                     {"ht_dispatch: argument 'topk_weights' (given or absent) differs across "
                      "ranks: ranks 0-2 have absent, rank 3 has given"},
                     "dispatch, rank " + std::to_string(r));
        a.topk_weights = TensorView();
        HtDispatchResult res = buf.ht_dispatch(a);
        HtCombineArgs c;
        c.y = res.recv_x;
        c.handle = &res.handle;
        std::vector<float> cw(std::max<int64_t>(res.recv_x.shape[0], 1) * 2, 1.0f);
        if (r == 0)
          c.topk_weights = TensorView::contiguous(cw.data(), DType::kF32, {res.recv_x.shape[0], 2});
        expect_error([&] { buf.ht_combine(c); }, ErrorCode::kInvalidArgument,
                     {"ht_combine: argument 'topk_weights' (given or absent) differs across "
                      "ranks: rank 0 has given, ranks 1-3 have absent"},
                     "combine, rank " + std::to_string(r));
        c.topk_weights = TensorView();
        HtCombineResult out = buf.ht_combine(c);
        // y = recv_x: each token comes back times the number of ranks it went to (2, 2, 1, 2).
        for (int64_t t = 0; t < 4; ++t)
          EXPECT_EQ(out.out.ptr<uint16_t>()[t * 128], detail::f32_to_bf16(t == 2 ? 0.25f : 0.5f))
              << "rank " << r << " token " << t;

        LlDispatchArgs l;
        l.x = a.x;
        l.topk_idx = a.topk_idx;
        l.use_fp8 = r == 2;
        expect_error([&] { buf.ll_dispatch(l); }, ErrorCode::kInvalidArgument,
                     {"ll_dispatch: argument 'use_fp8' differs across ranks: ranks 0, 1, 3 have "
                      "false, rank 2 has true"},
                     "ll dispatch, rank " + std::to_string(r));
        buf.ll_clean();
        l.use_fp8 = false;
        // NVFP4's g travels in the source's header through the rail chunk: node 1's rank 2
        // differs.
        l.use_nvfp4 = true;
        l.global_scale = r == 2 ? 0.5f : 2.0f;
        expect_error([&] { buf.ll_dispatch(l); }, ErrorCode::kInvalidArgument,
                     {"ll_dispatch: argument 'x_global_scale' differs across ranks: ranks 0, 1, 3 "
                      "have 2, rank 2 has 0.5"},
                     "ll nvfp4 dispatch, rank " + std::to_string(r));
        buf.ll_clean();
        l.use_nvfp4 = false;
        l.global_scale.reset();
        LlDispatchResult lr = buf.ll_dispatch(l);
        // Rank 0's experts 0, 1 get token 0 of every rank; the others two tokens of every rank.
        EXPECT_EQ(lr.recv_count.ptr<int32_t>()[0] + lr.recv_count.ptr<int32_t>()[1],
                  r == 0 ? 4 : 8);
      },
      nodes_of(2));
}

// ---- a mismatch only a forwarder sees -----------------------------------------------------------
// 2x2, ll: rank 3 combines with a topk_idx that is not its dispatch's (token 0: expert 1 of rank 0
// instead of expert 0). Its forwarder on node 0 (rank 1) finds the counts wrong and raises; rank 3,
// whose tokens it could not reduce, raises its message; ranks 0 and 2 are exact.
TEST(NodesForwarder, LlCombineTopkOfAnotherDispatch) {
  testing::LlCase c;
  c.p = {4, 4, 128, 2, 8};
  c.p.ranks_per_node = 2;
  std::mt19937_64 rng(99);
  testing::LlBatch b;
  const std::vector<std::vector<int64_t>> topk = {
      {0, 5, 2, 7, 4, 1}, {6, 3, 1, -1, 0, 2}, {5, 0, 7, 6, 3, 4}, {0, 6, 2, 5, 7, -1}};
  for (int r = 0; r < 4; ++r) {
    testing::LlRankInput in;
    in.num_tokens = 3;
    in.x = testing::make_bf16(3, 128, rng);
    in.topk_idx = topk[r];
    in.topk_weights = testing::make_topk_weights(in.topk_idx, rng);
    b.in.push_back(in);
  }
  testing::finish_ll_batch(c, b, rng);
  testing::run_threads(
      4,
      [&](const Group& g) {
        const int r = g.rank();
        Buffer buf(g, MoeShape{128, 2, 8, 4}, {false, true});
        const testing::LlRankInput& in = b.in[r];
        LlDispatchArgs a;
        a.use_fp8 = false;
        a.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16, {3, 128});
        a.topk_idx =
            TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64, {3, 2});
        LlDispatchResult d = buf.ll_dispatch(a);
        std::vector<int64_t> wrong = in.topk_idx;
        if (r == 3) wrong[0] = 1;
        LlCombineArgs ca;
        ca.y = TensorView::contiguous(const_cast<uint16_t*>(b.y[r].data()), DType::kBF16,
                                      {2, 16, 128});
        ca.topk_idx = TensorView::contiguous(wrong.data(), DType::kI64, {3, 2});
        ca.topk_weights =
            TensorView::contiguous(const_cast<float*>(in.topk_weights.data()), DType::kF32, {3, 2});
        ca.handle = &d.handle;
        const std::string found =
            "argument 'topk_idx' of rank 3 selects expert 0 with 0 tokens but rank 0 received 1 "
            "from it";
        if (r == 1 || r == 3) {
          std::vector<std::string> has{found};
          if (r == 3)
            has.push_back(
                "ll_combine: rank 1 (node 0), which forwards this rank's rows there, "
                "failed in this call");
          expect_error([&] { buf.ll_combine(ca); }, ErrorCode::kInvalidArgument, has,
                       "rank " + std::to_string(r));
          return;
        }
        LlCombineResult out = buf.ll_combine(ca, testing::poison_allocator(0xFF));
        EXPECT_EQ(testing::check_ll_combine(c.p, b.want_out[r], out.out), "") << "rank " << r;
      },
      nodes_of(2));
}

// 2x2, ht: rank 3 combines with the handle of an earlier dispatch of another routing. Every rank
// raises InvalidArgument: rank 2 (rank 3's node) and rank 3 see the rows of their node differ,
// ranks 0 and 1 hear it from their forwarders on node 1.
TEST(NodesForwarder, HtCombineHandleOfAnotherDispatch) {
  testing::run_threads(
      4,
      [](const Group& g) {
        const int r = g.rank();
        Buffer buf(g, MoeShape{128, 2, 8, 4});
        std::vector<uint16_t> x(4 * 128, detail::f32_to_bf16(1.0f));
        std::vector<int64_t> first{0, 1, 2, 3, 4, 5, 6, 7}, second{7, -1, 6, -1, 5, -1, 4, -1};
        HtDispatchArgs a;
        a.x = TensorView::contiguous(x.data(), DType::kBF16, {4, 128});
        a.topk_idx = TensorView::contiguous(first.data(), DType::kI64, {4, 2});
        HtDispatchResult old = buf.ht_dispatch(a);
        a.topk_idx = TensorView::contiguous(second.data(), DType::kI64, {4, 2});
        HtDispatchResult res = buf.ht_dispatch(a);
        const HtDispatchResult& mine = r == 3 ? old : res;
        HtCombineArgs c;
        c.y = mine.recv_x;
        c.handle = &mine.handle;
        std::vector<std::string> has{"argument 'handle'"};
        if (r < 2) has.push_back("(node 1), which forwards this rank's rows there, failed");
        expect_error([&] { buf.ht_combine(c); }, ErrorCode::kInvalidArgument, has,
                     "rank " + std::to_string(r));
      },
      nodes_of(2));
}

// ---- a2a is the same on every topology ----------------------------------------------------------
TEST(NodesA2a, SameOnEveryTopology) {
  std::mt19937_64 rng(4242);
  const testing::A2aProblem config = testing::random_config(rng, 4);
  std::vector<testing::A2aProblem> problems;
  for (int c = 0; c < 3; ++c) problems.push_back(testing::next_cycle(config, rng));
  for (int per_node : {2, 1}) {
    std::mutex mu;
    std::string errors;
    testing::run_threads(
        4,
        [&](const Group& g) {
          A2a a2a(g, config.shape());
          for (const testing::A2aProblem& p : problems) {
            const std::string e = testing::run_cycle(a2a, p, g.rank(), {});
            std::lock_guard<std::mutex> lock(mu);
            errors += e;
          }
        },
        nodes_of(per_node));
    EXPECT_TRUE(errors.empty()) << per_node << " ranks per node: " << errors;
  }
}

}  // namespace
}  // namespace epx
