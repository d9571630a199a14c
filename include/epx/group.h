// epx/group.h — the EP group: who the ranks are and how they reach each other.
//
// A Group is a cheap, copyable handle on a shared transport (docs/design.md §2, §5). Every rank of
// the EP group creates its own Group with the same size and rendezvous name; creation is
// collective.
//
// Backends:
//   cpu, threads     — ranks are threads of one process (tests, single-process simulation).
//   cpu, processes   — ranks are processes on one host, exchanging through POSIX shared memory
//                      (what the Python layer uses under torch.distributed + gloo).
//   cuda             — one process per GPU, NCCL communicator + symmetric windows over NVLink.
//   cuda, one GPU    — test/development mode: ranks are threads of one process sharing one GPU
//                      (Group::cuda_shared_device), to run the GPU tier at more ranks than GPUs.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace epx {

enum class Backend { kCpu, kCuda };
const char* backend_name(Backend backend);

// The valid ranges of GroupOptions, the same for the environment variables that give their
// defaults (EPX_TIMEOUT_MS, EPX_NUM_SMS) and for the Python package's timeout / num_sms
// (docs/semantics.md §4.1). A value outside them, in the options or the environment, makes group
// creation throw InvalidArgument naming it.
inline constexpr int64_t kDefaultGroupTimeoutMs = 30000;
inline constexpr int64_t kMaxGroupTimeoutMs = 86'400'000;  // 24 h
inline constexpr int kMaxGroupNumSms = 1024;

struct GroupOptions {
  // Bound on every wait for a peer (host barriers on cpu, device spin-waits on cuda):
  // 1..kMaxGroupTimeoutMs ms, or 0 for the default: EPX_TIMEOUT_MS (same range) when set, else
  // 30 s.
  std::chrono::milliseconds timeout{0};
  // SMs the cuda kernels may use: 0..kMaxGroupNumSms; 0 = EPX_NUM_SMS when set, else auto
  // (resolved in one place per mode). More than the device has counts as all of them.
  int num_sms = 0;
  // Topology (docs/design.md §13): the group's R ranks are R / ranks_per_node nodes of
  // ranks_per_node ranks each, node-major (rank = node * ranks_per_node + local rank). 0 = every
  // rank on one node (the default). It must divide R (InvalidArgument otherwise, naming the
  // divisors) and be the same on every rank (a Buffer compares it). With more than one node the
  // cpu backend runs ht and ll hierarchically (tokens cross between nodes once per node, over the
  // "rail" between equal local ranks; combines reduce inside each node first, in the order of
  // docs/semantics.md §1.6 / §2.3); a2a is the same on every topology. The cuda backend runs ht
  // and ll across nodes only for Group::cuda_shared_device ("virtual nodes" on one GPU; ll without
  // hooks, NVFP4, zero-copy, LogFMT or overlap there, else Unsupported); cuda groups with a GPU
  // per rank refuse more than one node (Unsupported).
  int ranks_per_node = 0;
};

// The 128 opaque bytes of an ncclUniqueId.
struct UniqueId {
  std::array<char, 128> bytes{};
};

namespace detail {
class Transport;
}

// One value Group::agree compares across the ranks.
struct AgreeValue {
  std::string name;      // as the message names it, e.g. "argument 'hidden'"
  int64_t value = 0;
  bool boolean = false;  // shown as true / false
};

class Group {
 public:
  // Threads of one process. All `size` ranks (1..64) call this with the same `world_name`; it
  // returns once every rank has joined (or throws Timeout naming the missing ranks).
  static Group cpu_threads(int rank, int size, const std::string& world_name,
                           GroupOptions options = {});

  // Processes on one host over POSIX shared memory. `name` must be unique per live group (for
  // example a UUID chosen by rank 0 and broadcast); segments are unlinked once all ranks mapped
  // them, so nothing is left in /dev/shm after a crash-free run.
  static Group cpu_processes(int rank, int size, const std::string& name,
                             GroupOptions options = {});

  // One process per GPU from an ncclUniqueId created by rank 0 (new_unique_id) and shared by
  // the caller (launch_local does this for one host). Binds `cuda_device`.
  // Throws Unsupported in a build without CUDA/NCCL.
  static Group cuda(int rank, int size, const UniqueId& id, int cuda_device,
                    GroupOptions options = {});

  // Adopts an existing ncclComm_t (passed as void*), e.g. PyTorch's ProcessGroupNCCL comm.
  // epx does not destroy it.
  static Group cuda_from_comm(void* nccl_comm, int cuda_device, GroupOptions options = {});

  // Test/development mode of the cuda backend: `size` ranks as threads of this process, all on
  // GPU `cuda_device` (same kernels; symmetric memory is one cudaMalloc per rank, peers reach it
  // directly; barriers run on the host like cpu_threads'). All ranks call this with the same
  // `world_name`; it binds `cuda_device` on the calling thread. Limits:
  //   * every rank's kernels must be co-resident (device-side waits spin on peers' writes):
  //     options.num_sms = 0 resolves to SMs / size, and size * max(2, num_sms) > SMs throws
  //     InvalidArgument (e.g. 132-SM H200: num_sms <= 16 at 8 ranks, <= 33 at 4);
  //   * CUDA_DEVICE_MAX_CONNECTIONS >= min(32, 2 * size) and CUDA_MODULE_LOADING=EAGER
  //     (InvalidArgument otherwise), set before CUDA initialises: a lazily loaded kernel's first
  //     launch waits for the kernels already running, i.e. for peers spinning on this rank;
  //   * each rank enqueues on its own non-blocking stream, and no rank may make a device-wide
  //     synchronising call (cudaDeviceSynchronize, cudaFree, legacy-stream copies) while a peer
  //     may already have launched an op that waits for this rank: such a call waits for the
  //     peer's spinning kernel (bounded: it ends with the group timeout, as a Timeout error).
  //     Bracket such calls with Group::barrier(). Not for performance numbers;
  //   * Buffer / A2a destructors wait for every rank (elsewhere destruction is local);
  //   * one stream per rank: the ht kernels move every row here, not the copy engines (their
  //     side streams would share hardware queues with peers' kernels).
  // Throws Unsupported in a build without CUDA.
  static Group cuda_shared_device(int rank, int size, const std::string& world_name,
                                  int cuda_device, GroupOptions options = {});

  int rank() const;
  int size() const;
  Backend backend() const;
  std::chrono::milliseconds timeout() const;
  // options().ranks_per_node is resolved: the size for one node.
  const GroupOptions& options() const;
  int ranks_per_node() const { return options_.ranks_per_node; }
  int num_nodes() const { return size() / options_.ranks_per_node; }

  // Barrier over the group, bounded by the timeout (collective). On the host for cpu and
  // cuda_shared_device groups; a cuda group runs a device barrier on its own stream and waits for it.
  void barrier() const;

  // Collective agreement (the check Buffer, A2a and Dispatcher construction run; for layers above
  // epx that derive collective state from call arguments, e.g. the Python drop-ins' lazily created
  // buffers): one small exchange through the group, bounded by the timeout. Where a value differs
  // across ranks, every rank throws InvalidArgument naming each such value with every rank's:
  //   "<op>: <name> differs across ranks: rank 0 has 8, rank 1 has 16; expected the same on every
  //    rank"
  // `extra` values need not agree; returns every rank's, rank-major ([size()][extra.size()]).
  // At most 52 values and extra values together.
  std::vector<std::vector<int64_t>> agree(const std::string& op,
                                          const std::vector<AgreeValue>& values,
                                          const std::vector<int64_t>& extra = {}) const;

  // Internal: the transport shared by the buffers of this group.
  const std::shared_ptr<detail::Transport>& transport() const { return transport_; }

 private:
  explicit Group(std::shared_ptr<detail::Transport> t, GroupOptions options);
  std::shared_ptr<detail::Transport> transport_;
  GroupOptions options_;
};

// Creates an ncclUniqueId (rank 0 calls this). Throws Unsupported without NCCL.
UniqueId new_unique_id();

// File rendezvous for several hosts: rank 0 writes `id` to `path` atomically; other ranks read
// it, waiting up to `timeout`.
UniqueId exchange_unique_id_via_file(const std::string& path, int rank,
                                     std::chrono::milliseconds timeout);

// Forks one process per rank (`num_ranks` of them, one per local GPU when used with cuda),
// runs `body(rank)` in each and waits for all. Returns 0 if every child returned 0, else the first
// non-zero status (a child killed by a signal counts as 128 + signal). Children that outlive
// `timeout` are killed. The parent does nothing else, so `body` may create groups freely.
int launch_local(int num_ranks, const std::function<int(int rank)>& body,
                 std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace epx
