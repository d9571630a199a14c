#include "support/harness.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace epx::testing {

std::string unique_group_name(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "epx-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + "-" + tag;
}

void run_threads(int R, const std::function<void(const Group&)>& body, GroupOptions options) {
  run_threads(R, body, std::vector<GroupOptions>(R, options));
}

void run_threads(int R, const std::function<void(const Group&)>& body,
                 const std::vector<GroupOptions>& options) {
  const std::string name = unique_group_name("thr");
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        Group g = Group::cpu_threads(r, R, name, options[r]);
        body(g);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

Allocator poison_allocator(uint8_t byte) {
  return [byte, base = default_allocator()](DType dtype, const std::vector<int64_t>& shape,
                                            Device device) {
    Tensor t = base(dtype, shape, device);
    if (t.nbytes() > 0) std::memset(t.data, byte, t.nbytes());
    return t;
  };
}

GroupOptions NodeTopology::options() const {
  GroupOptions o;
  o.ranks_per_node = per_node;
  return o;
}

std::string topology_name(const NodeTopology& t) {
  return std::to_string(t.nodes) + "x" + std::to_string(t.per_node);
}

void PrintTo(const NodeTopology& t, std::ostream* os) {
  *os << topology_name(t);
}

int run_processes(int R, const std::function<int(const Group&)>& body, GroupOptions options) {
  const std::string name = unique_group_name("proc");
  return launch_local(R, [&](int r) {
    Group g = Group::cpu_processes(r, R, name, options);
    return body(g);
  });
}

}  // namespace epx::testing
