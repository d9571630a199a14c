// The host logic of the rails (src/transport/rail.h, rail_plan.cc), run directly without a
// transport: the node / rail communicator split (ncclCommSplit's colors and keys) and the plan of
// one exchange (peer order, pairing of every send with its partner's receive, equal sizes, the
// checks). The NCCL rail posts exactly these operations (nccl_rail.cc; its GPU test is
// tests/gpu/nccl_rail_gpu_test.cc), the cpu rail copies along them (HtNodes, LlNodes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "epx/error.h"
#include "transport/rail.h"

namespace epx::detail {
namespace {

const std::vector<Topology> kTopologies = {{1, 4}, {2, 1}, {2, 2}, {2, 4}, {4, 2},
                                           {3, 1}, {3, 2}, {8, 1}, {4, 4}};

std::string name(Topology t) {
  return std::to_string(t.num_nodes) + "x" + std::to_string(t.ranks_per_node);
}

// color -> (key -> rank), as ncclCommSplit forms the communicators.
using Comms = std::map<int, std::map<int, int>>;

// `comms` must be `count` communicators of `size` ranks each, with keys 0 .. size - 1 and the
// rank of key k in the one of color c being rank_of(c, k).
void expect_comms(const Comms& comms, int count, int size,
                  const std::function<int(int color, int key)>& rank_of, const std::string& what) {
  ASSERT_EQ(static_cast<int>(comms.size()), count) << what;
  for (const auto& [color, ranks] : comms) {
    ASSERT_EQ(static_cast<int>(ranks.size()), size) << what;
    int i = 0;
    for (const auto& [key, r] : ranks) {
      EXPECT_EQ(key, i) << what << " color " << color;
      EXPECT_EQ(r, rank_of(color, i++)) << what << " color " << color;
    }
  }
}

TEST(RailSplit, NodeAndRailCommunicators) {
  for (const Topology t : kTopologies) {
    const int R = t.num_nodes * t.ranks_per_node;
    Comms node_comms, rail_comms;
    for (int r = 0; r < R; ++r) {
      const RailSplit s = rail_split(t, r);
      EXPECT_TRUE(node_comms[s.node_color].emplace(s.node_key, r).second) << name(t) << " " << r;
      EXPECT_TRUE(rail_comms[s.rail_color].emplace(s.rail_key, r).second) << name(t) << " " << r;
    }
    // Node communicators: node n's ranks n*G .. n*G + G - 1, ranked by local index.
    expect_comms(
        node_comms, t.num_nodes, t.ranks_per_node, [&](int n, int g) { return t.rank_of(n, g); },
        name(t) + " nodes");
    // Rail communicators: local index g on every node, ranked by node.
    expect_comms(
        rail_comms, t.ranks_per_node, t.num_nodes, [&](int g, int m) { return t.rank_of(m, g); },
        name(t) + " rails");
  }
}

// The chunks of one symmetric exchange on rank r: a send to and a receive from every other node,
// `bytes(n, m)` each (symmetric in n and m, as every leg's sizes come from the agreed shape);
// data pointers encode (rank, node, side) so the test can tell the chunks apart.
struct Chunks {
  std::vector<RailChunk> sends, recvs;
};
void* tag(int rank, int node, bool send) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(0x1000 + rank * 256 + node * 2 + send));
}
Chunks symmetric(Topology t, int r, size_t base) {
  Chunks c;
  const int n = t.node_of(r);
  for (int m = t.num_nodes - 1; m >= 0; --m) {  // any order in, the plan's order out
    if (m == n) continue;
    const size_t bytes = base + 64 * static_cast<size_t>(std::min(n, m) * 16 + std::max(n, m));
    c.sends.push_back({m, tag(r, m, true), bytes});
    c.recvs.push_back({m, tag(r, m, false), bytes});
  }
  return c;
}

TEST(RailPlan, PairwiseOrderOnOneRank) {
  // Node 1 of 4, local index 1 of 2: step s sends to node 1 + s, receives from node 1 - s.
  const Topology t{4, 2};
  const int r = t.rank_of(1, 1);
  const Chunks c = symmetric(t, r, 128);
  const std::vector<RailOp> ops = plan_rail_exchange("test", t, r, c.sends, c.recvs, 1 << 20);
  const std::vector<std::pair<bool, int>> want = {{true, 2},  {false, 0}, {true, 3},
                                                  {false, 3}, {true, 0},  {false, 2}};
  ASSERT_EQ(ops.size(), want.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(ops[i].send, want[i].first) << i;
    EXPECT_EQ(ops[i].node, want[i].second) << i;
    EXPECT_EQ(ops[i].peer, t.rank_of(want[i].second, 1)) << i;
    EXPECT_EQ(ops[i].data, tag(r, ops[i].node, ops[i].send)) << i;
  }
}

TEST(RailPlan, EverySendMeetsItsPartnersReceiveAtTheSameStep) {
  std::mt19937_64 rng(0x7a11);
  for (const Topology t : kTopologies) {
    const int R = t.num_nodes * t.ranks_per_node;
    const size_t base = 16 + rng() % 4096;
    std::vector<std::vector<RailOp>> plans(R);
    for (int r = 0; r < R; ++r) {
      const Chunks c = symmetric(t, r, base);
      plans[r] = plan_rail_exchange("test", t, r, c.sends, c.recvs, 1 << 20);
      ASSERT_EQ(static_cast<int>(plans[r].size()), 2 * (t.num_nodes - 1)) << name(t);
    }
    for (int r = 0; r < R; ++r) {
      for (size_t i = 0; i < plans[r].size(); ++i) {
        const RailOp& op = plans[r][i];
        EXPECT_NE(op.node, t.node_of(r)) << name(t);
        EXPECT_EQ(t.local_of(op.peer), t.local_of(r)) << name(t) << ": rail peers share g";
        EXPECT_EQ(t.node_of(op.peer), op.node) << name(t);
        EXPECT_EQ(op.data, tag(r, op.node, op.send)) << name(t);
        if (!op.send) continue;
        // The partner's op at the same step (i / 2) is its receive from this rank's node.
        const RailOp& theirs = plans[op.peer][i + 1];
        EXPECT_FALSE(theirs.send) << name(t) << " rank " << r << " op " << i;
        EXPECT_EQ(theirs.peer, r) << name(t) << " rank " << r << " op " << i;
        EXPECT_EQ(theirs.bytes, op.bytes) << name(t) << " rank " << r << " op " << i;
      }
    }
  }
}

TEST(RailPlan, OneNodeHasNothingToPost) {
  const Topology t{1, 4};
  EXPECT_TRUE(plan_rail_exchange("test", t, 2, {}, {}, 64).empty());
}

// `sends` / `recvs` of rank (1, 0) of 3 nodes must be refused with Internal naming `has`.
void expect_refused(const std::vector<RailChunk>& sends, const std::vector<RailChunk>& recvs,
                    const std::vector<std::string>& has) {
  const Topology t{3, 2};
  try {
    plan_rail_exchange("ht_dispatch (rail)", t, t.rank_of(1, 0), sends, recvs, 1024);
    ADD_FAILURE() << "expected Internal mentioning " << has[0];
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ht_dispatch (rail)"), std::string::npos) << msg;
    for (const std::string& s : has) EXPECT_NE(msg.find(s), std::string::npos) << msg;
  }
}

TEST(RailPlan, MalformedExchangesAreInternal) {
  char a[8], b[8];
  const RailChunk to0{0, a, 512}, from0{0, b, 512}, to2{2, a, 512}, from2{2, b, 512};
  expect_refused({{1, a, 8}}, {{1, b, 8}}, {"send with node 1", "another node of 3 than 1"});
  expect_refused({to0, {3, a, 8}}, {from0}, {"send with node 3"});
  expect_refused({to0}, {from0, {-1, b, 8}}, {"receive with node -1"});
  expect_refused({{0, a, 1025}}, {{0, b, 1025}}, {"1025 bytes", "at most 1024 bytes"});
  expect_refused({to0, to0}, {from0}, {"two rail sends with node 0"});
  expect_refused({to0, to2}, {from0}, {"node 2 sends 512 bytes and receives 0", "no receive"});
  expect_refused({to0}, {from0, from2}, {"node 2 sends 0 bytes", "no send"});
  expect_refused({to0, {2, a, 256}}, {from0, from2},
                 {"node 2 sends 256 bytes and receives 512", "equal counts"});
  // A node left out on both sides is fine: nothing to post for it.
  const Topology t{3, 2};
  EXPECT_EQ(plan_rail_exchange("x", t, t.rank_of(1, 0), {to2}, {from2}, 1024).size(), 2u);
}

}  // namespace
}  // namespace epx::detail
