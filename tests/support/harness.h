// tests/support/harness.h — run a body on R ranks of the cpu backend, as threads or processes.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::testing {

// A process-unique name for a group ("epx-test-<pid>-<counter>-<tag>").
std::string unique_group_name(const std::string& tag);

// Runs body(group) on R threads, each with its own rank of a fresh cpu_threads group. Rethrows
// the first exception a rank threw (after all threads finished).
void run_threads(int num_ranks, const std::function<void(const Group&)>& body,
                 GroupOptions options = {});
// The same with options[r] on rank r (options of one rank that differ from its peers').
void run_threads(int num_ranks, const std::function<void(const Group&)>& body,
                 const std::vector<GroupOptions>& options);

// Nodes x ranks per node (GroupOptions::ranks_per_node) of the across-node tests (docs/design.md
// §13): the topologies CI runs the hierarchical ht and ll at.
struct NodeTopology {
  int nodes, per_node;
  int num_ranks() const { return nodes * per_node; }
  GroupOptions options() const;
};
inline constexpr NodeTopology kCiTopologies[] = {{2, 2}, {2, 4}, {4, 2}, {3, 1}};
std::string topology_name(const NodeTopology& t);  // "2x4"
void PrintTo(const NodeTopology& t, std::ostream* os);

// default_allocator() with every byte of each new tensor set to `byte`, so an output element the
// library forgets to write shows up.
Allocator poison_allocator(uint8_t byte);

// Runs body(group) in R forked processes over a fresh cpu_processes group. Returns 0 when every
// rank's body returned 0 (exceptions print and count as failure).
int run_processes(int num_ranks, const std::function<int(const Group&)>& body,
                  GroupOptions options = {});

}  // namespace epx::testing
