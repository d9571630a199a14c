// src/transport/rail.h — the across-node seam (docs/design.md §13): the group's topology and the
// "rail", the network leg between the ranks of equal local rank on every node.
//
// R = N nodes x G ranks per node, node-major: rank = node * G + local. Inside a node ranks reach
// each other through the group's Transport (symmetric memory: LSA windows on cuda, shared memory
// on cpu). Between nodes only the rail moves data: rank (n, g) exchanges chunks with (m, g) for
// every other node m, in one collective call whose sends and receives pair up as grouped
// ncclSend / ncclRecv do (equal byte counts on both sides of a pair). The backends' hierarchical
// algorithms (cpu: src/cpu/ht*.cc, src/cpu/ll*.cc) call only this interface for the network
// leg: the cpu rail (cpu_rail.cc), the NCCL send/recv rail (nccl_rail.cc: grouped ncclSend /
// ncclRecv on the rail communicator, capturable in a graph) and, where ranks share one GPU
// ("virtual nodes" of the one-GPU test mode), the device-copy rail (device_copy_rail.h: one
// kernel per exchange copying from the partner's memory) fill it; a GIN rail (device-initiated
// RDMA) can fill it later. Every rail posts what plan_rail_exchange() plans, so the checks and the
// peer order are one piece of host code, unit-tested without any transport
// (tests/unit/rail_plan_test.cc).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::detail {

class Transport;

// Nodes x ranks per node of a group (GroupOptions::ranks_per_node, resolved by group creation).
struct Topology {
  int num_nodes = 1;
  int ranks_per_node = 1;

  static Topology of(const Group& group) { return {group.num_nodes(), group.ranks_per_node()}; }
  bool hierarchical() const { return num_nodes > 1; }
  int node_of(int rank) const { return rank / ranks_per_node; }
  int local_of(int rank) const { return rank % ranks_per_node; }
  int rank_of(int node, int local) const { return node * ranks_per_node + local; }
  // Index of node m among the nodes other than n (0 .. N - 2): the slot of n's chunk for or from m.
  static int other_index(int m, int n) { return m < n ? m : m - 1; }
};

// One side of a rail pair: `bytes` bytes of this rank's memory, sent to or received from the rank
// of this rank's local index on node `node` (never this rank's node).
struct RailChunk {
  int node = 0;
  void* data = nullptr;
  size_t bytes = 0;
};

// How a group's communicator splits for the hierarchical path (ncclCommSplit's color and key):
// the node communicator holds the ranks of this rank's node, ranked by local index (it carries
// the LSA windows of the node-local kernels: NCCL 2.28.9's ncclDevCommCreate turns GIN on for a
// communicator spanning nodes); the rail communicator holds the ranks of this rank's local index,
// one per node, ranked by node (so a rail peer's rank there is its node).
struct RailSplit {
  int node_color = 0, node_key = 0;
  int rail_color = 0, rail_key = 0;
};
RailSplit rail_split(Topology topology, int rank);

// One point-to-point operation of a rail exchange, as the NCCL rail posts it.
struct RailOp {
  bool send = false;
  int node = 0;  // the partner's node: its rank in the rail communicator
  int peer = 0;  // the partner's rank in the group: (node, this rank's local index)
  void* data = nullptr;
  size_t bytes = 0;
};

// The operations of one exchange (RailTransport::exchange) in posting order, after checking it:
// every chunk names another node of the topology and holds at most max_chunk_bytes; per other
// node at most one send and one receive, and a send only with the receive from the same node, of
// the same size (every leg of the hierarchical algorithms is symmetric like this, and it is what
// this rank can check of NCCL's rule that a send and its receive have equal counts: its partner
// computes the same sizes from the same agreed shape). Violations are Internal naming `what`.
// Order: for s = 1 .. N - 1, the send to node (n + s) mod N, then the receive from node
// (n - s) mod N, so at every step each rank's send meets its partner's receive (pairwise
// exchange; inside a NCCL group any order completes, this one is the same on every rank).
std::vector<RailOp> plan_rail_exchange(const char* what, Topology topology, int rank,
                                       const std::vector<RailChunk>& sends,
                                       const std::vector<RailChunk>& recvs, size_t max_chunk_bytes);

class RailTransport {
 public:
  virtual ~RailTransport() = default;

  // Collective over the group: every rank calls it at the same point of the same operation, and
  // every send has the equal-sized receive of its partner (a size that differs is Internal). When
  // it returns, this rank's receives have arrived and its send memory may be reused (cpu:
  // synchronous; a stream-ordered rail completes in `stream` order). A partner at another
  // exchange (ranks out of step) is OutOfStep, raised after the exchange's synchronisation so no
  // rank is left waiting. At most max_chunk_bytes() per chunk.
  virtual void exchange(const char* what, const std::vector<RailChunk>& sends,
                        const std::vector<RailChunk>& recvs, Stream stream) = 0;
  virtual size_t max_chunk_bytes() const = 0;
  // Symmetric bytes per rank the rail took (its staging), counted in Buffer::bytes_allocated.
  virtual size_t bytes_allocated() const = 0;
  // After the group's resync (Buffer::reset, ll_clean): exchanges are numbered from 1 again on
  // every rank. Local.
  virtual void reset() = 0;
  // Ends what still waits for a partner (the caller's bounded wait for the exchange's results
  // timed out, or the group failed): the NCCL rail aborts its communicator, so NCCL's kernels
  // stop waiting, and refuses later exchanges (Internal). The cpu rail waits only in the
  // transport's bounded barriers, which Transport::abort ends: nothing to do. Local, idempotent.
  virtual void abort() = 0;
  // Raises what a stream-ordered exchange found on the device since the last call (the
  // device-copy rail: Timeout, OutOfStep, Internal; each exchange() also calls it first, so an
  // error surfaces at the next exchange at the latest). The cpu and NCCL rails raise from
  // exchange() itself: nothing here. Local, no synchronisation.
  virtual void check() {}
};

// The cpu rail: each rank stages its sends in its slot (one per other node) of a symmetric
// allocation of cpu_rail_bytes(topology, max_chunk_bytes) per rank, made here (collective); a
// group barrier; each rank copies its partners' slots for it into its receives; a second barrier
// before any slot is written again. Each slot carries the exchange's number (a seqlock), so a
// partner at another exchange is OutOfStep, never mixed bytes.
std::unique_ptr<RailTransport> make_cpu_rail(std::shared_ptr<Transport> transport,
                                             Topology topology, size_t max_chunk_bytes);
size_t cpu_rail_bytes(Topology topology, size_t max_chunk_bytes);

}  // namespace epx::detail
