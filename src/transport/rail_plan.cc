// src/transport/rail_plan.cc — the host logic every rail shares (rail.h): how the group's
// communicator splits into node and rail communicators, and the checked, ordered operations of
// one exchange. No transport here: tests/unit/rail_plan_test.cc runs it directly.
#include <optional>

#include "core/check.h"
#include "transport/rail.h"

namespace epx::detail {

RailSplit rail_split(Topology topology, int rank) {
  RailSplit s;
  s.node_color = topology.node_of(rank);
  s.node_key = topology.local_of(rank);
  s.rail_color = topology.local_of(rank);
  s.rail_key = topology.node_of(rank);
  return s;
}

namespace {

// The one chunk per other node of a side (sends or receives), indexed by node; checked.
std::vector<std::optional<RailChunk>> by_node(const char* what, Topology topology, int node,
                                              const std::vector<RailChunk>& chunks,
                                              size_t max_chunk_bytes, const char* side) {
  std::vector<std::optional<RailChunk>> out(topology.num_nodes);
  for (const RailChunk& c : chunks) {
    EPX_CHECK(
        c.node >= 0 && c.node < topology.num_nodes && c.node != node && c.bytes <= max_chunk_bytes,
        ErrorCode::kInternal, what, ": rail ", side, " with node ", c.node, " of ", c.bytes,
        " bytes, expected another node of ", topology.num_nodes, " than ", node, " and at most ",
        max_chunk_bytes, " bytes");
    EPX_CHECK(!out[c.node], ErrorCode::kInternal, what, ": two rail ", side, "s with node ", c.node,
              ", expected at most one per node");
    out[c.node] = c;
  }
  return out;
}

}  // namespace

std::vector<RailOp> plan_rail_exchange(const char* what, Topology topology, int rank,
                                       const std::vector<RailChunk>& sends,
                                       const std::vector<RailChunk>& recvs,
                                       size_t max_chunk_bytes) {
  const int N = topology.num_nodes, n = topology.node_of(rank);
  const int local = topology.local_of(rank);
  const auto to = by_node(what, topology, n, sends, max_chunk_bytes, "send");
  const auto from = by_node(what, topology, n, recvs, max_chunk_bytes, "receive");
  for (int m = 0; m < N; ++m) {
    if (!to[m] && !from[m]) continue;
    EPX_CHECK(to[m] && from[m] && to[m]->bytes == from[m]->bytes, ErrorCode::kInternal, what,
              ": rail leg with node ", m, " sends ", to[m] ? to[m]->bytes : 0, " bytes and ",
              "receives ", from[m] ? from[m]->bytes : 0, " (", to[m] ? "" : "no send, ",
              from[m] ? "" : "no receive, ",
              "expected a send and a receive of equal size: a NCCL send and its receive must ",
              "have equal counts)");
  }
  std::vector<RailOp> ops;
  for (int s = 1; s < N; ++s) {
    const int up = (n + s) % N, down = (n - s + N) % N;
    if (to[up]) ops.push_back({true, up, topology.rank_of(up, local), to[up]->data, to[up]->bytes});
    if (from[down])
      ops.push_back(
          {false, down, topology.rank_of(down, local), from[down]->data, from[down]->bytes});
  }
  return ops;
}

}  // namespace epx::detail
