// src/cuda/device_copy_rail.cu — the device-copy rail (transport/device_copy_rail.h): the host
// side of kernels/rail/device_copy.cuh, where the protocol and the region are described.
//
// exchange(what, sends, recvs, stream) on rank (n, g):
//   check() (an earlier exchange's device error first) -> plan_rail_exchange (the checks shared
//   with the cpu and NCCL rails) -> params: per other node its send and receive chunk, the
//   partners' regions, the leg tag of `what` -> one rail_exchange_kernel launch on `stream`.
// The leg tag (FNV-1a of `what`) lets a receiver tell a partner at another leg of the same
// exchange number; the ranks are threads of one process, so the host keeps the tags' names for
// the message.
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/device_object.h"
#include "cuda/kernels/rail/device_copy.cuh"
#include "cuda/launch.h"
#include "transport/device_copy_rail.h"

namespace epx::detail {
namespace {

// The leg names seen in this process by tag (every rank of the rail is a thread of it).
std::mutex g_leg_mu;
std::map<uint32_t, std::string> g_legs;

uint32_t leg_tag(const char* what) {
  uint32_t h = 2166136261u;
  for (const char* c = what; *c != '\0'; ++c) h = (h ^ static_cast<uint8_t>(*c)) * 16777619u;
  std::lock_guard<std::mutex> lock(g_leg_mu);
  g_legs.emplace(h, what);
  return h;
}

std::string leg_name(uint32_t tag) {
  std::lock_guard<std::mutex> lock(g_leg_mu);
  const auto it = g_legs.find(tag);
  return it == g_legs.end() ? cat("a leg with tag ", tag) : cat("'", it->second, "'");
}

constexpr const char* kUnusable =
    "the rail is unusable until reset() on every rank (every rank must make the same exchanges "
    "in the same order)";

class DeviceCopyRail final : public RailTransport {
 public:
  DeviceCopyRail(const Group& group, Topology topology, size_t max_chunk_bytes)
      : group_(group),
        topology_(topology),
        max_chunk_bytes_(max_chunk_bytes),
        dev_(group, "rail (device copies)") {
    EPX_CHECK(group.transport()->ranks_share_device(), ErrorCode::kUnsupported,
              "rail (device copies): the ranks of this group have GPUs of their own; the "
              "device-copy rail serves ranks that share one GPU (Group::cuda_shared_device), "
              "expected the NCCL rail (make_nccl_rail) here");
    EPX_CHECK(topology.num_nodes * topology.ranks_per_node == group.size() &&
                  topology.num_nodes <= kMaxRailNodes,
              ErrorCode::kInternal, "rail (device copies): topology ", topology.num_nodes, " x ",
              topology.ranks_per_node, " does not split the group's ", group.size(), " ranks");
    dev_.allocate_region(sizeof(RailRegion), offsetof(RailRegion, state));  // collective
  }
  ~DeviceCopyRail() override { dev_.close(dev_.usable() ? "rail destruction" : nullptr); }

  size_t max_chunk_bytes() const override { return max_chunk_bytes_; }
  size_t bytes_allocated() const override { return dev_.bytes(); }

  void reset() override {
    DeviceGuard guard(dev_.device());
    // The per-thread stream, waited for: the caller's reset synchronised the device already.
    EPX_CUDA_CHECK(cudaMemsetAsync(dev_.local(), 0, sizeof(RailRegion), cudaStreamPerThread),
                   "reset (rail)");
    EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread), "reset (rail)");
    dev_.clear_record();
    dev_.set_usable();
  }

  void abort() override {
    dev_.set_unusable(ErrorCode::kInternal,
                      "the rail was aborted after an earlier timeout or failure; expected the "
                      "rail of a usable group (reset() on every rank makes it usable again)");
  }

  void check() override {
    dev_.require_usable("rail exchange");  // an error raised before: OutOfStep until reset()
    const std::optional<DeviceErrorRecord> rec = dev_.recorded();
    if (!rec) return;
    const DeviceErrorRecord& e = *rec;
    const char* why = e.code == kDevErrTimeout     ? "a device wait timed out"
                      : e.code == kDevErrRailBytes ? "a rail pair of unequal sizes"
                                                   : "ranks out of step";
    dev_.set_unusable(ErrorCode::kOutOfStep, cat("the rail is unusable after an earlier error (",
                                                 why, "); call reset() on every rank to reset it"));
    const auto a = static_cast<uint64_t>(e.a), b = static_cast<uint64_t>(e.b);
    switch (e.code) {
      case kDevErrTimeout:
        dev_.raise_timeout(
            e, {.awaited = device_wait_name(static_cast<uint32_t>(e.a)),
                .unusable = kUnusable,
                .seen = cat(", flag ", b >> 32, " wanted, ", b & 0xffffffffu, " seen")});
      case kDevErrRailStep:
        throw_error(
            ErrorCode::kOutOfStep,
            cat("rail exchange: rank ", e.peer, " (node ", topology_.node_of(e.peer),
                ") posted exchange #", a & 0xffffffffu, " of ", leg_name(a >> 32), " while rank ",
                e.rank, " is at #", b & 0xffffffffu, " of ", leg_name(b >> 32),
                " (ranks out of step); expected every rank at the same exchange; ", kUnusable));
      case kDevErrRailBytes:
        throw_error(ErrorCode::kInternal,
                    cat("rail exchange: rank ", e.peer, " posted ", e.a, " bytes for rank ", e.rank,
                        ", which receives ", e.b,
                        "; expected equal sizes on both sides of a rail pair; ", kUnusable));
      default:
        DeviceObject::raise_common(e, 0);
    }
  }

  void exchange(const char* what, const std::vector<RailChunk>& sends,
                const std::vector<RailChunk>& recvs, Stream stream) override {
    dev_.require_usable(what);
    check();
    const int me = group_.rank();
    const std::vector<RailOp> ops =
        plan_rail_exchange(what, topology_, me, sends, recvs, max_chunk_bytes_);
    if (ops.empty()) return;
    RailExchangeParams p{};
    p.local = reinterpret_cast<RailRegion*>(dev_.local());
    p.num_nodes = topology_.num_nodes;
    p.node = topology_.node_of(me);
    p.ranks_per_node = topology_.ranks_per_node;
    p.local_index = topology_.local_of(me);
    p.tag = leg_tag(what);
    p.wait = dev_.wait_context(kOpRailExchange);
    for (int m = 0; m < topology_.num_nodes; ++m)
      p.partner[m] = reinterpret_cast<RailRegion*>(dev_.peer(topology_.rank_of(m, p.local_index)));
    for (const RailOp& op : ops) {
      RailPair& pair = p.pairs[Topology::other_index(op.node, p.node)];
      pair.active = 1;
      pair.bytes = op.bytes;  // the plan checked: the send's and the receive's alike
      if (op.send) {
        pair.send = static_cast<const char*>(op.data);
      } else {
        pair.recv = static_cast<char*>(op.data);
      }
    }
    DeviceGuard guard(dev_.device());
    launch_kernel(rail_exchange_kernel, dim3(kRailCtas), dim3(kRailThreads), 0,
                  static_cast<cudaStream_t>(stream), false, what, p);
  }

 private:
  Group group_;
  Topology topology_;
  size_t max_chunk_bytes_;
  DeviceObject dev_;
};

}  // namespace

std::unique_ptr<RailTransport> make_device_copy_rail(const Group& group, Topology topology,
                                                     size_t max_chunk_bytes) {
  return std::make_unique<DeviceCopyRail>(group, topology, max_chunk_bytes);
}

size_t device_copy_rail_bytes() { return sizeof(RailRegion); }

}  // namespace epx::detail
