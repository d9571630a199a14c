// src/transport/transport.h — the one small interface every backend's communication sits on
// (docs/design.md §5): allocate symmetric memory, reach a peer's copy, synchronise. Kernels and the
// cpu reference see only this; NCCL LSA windows, shared memory (threads or processes) and future
// CUDA-IPC / GIN transports implement it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::detail {

inline constexpr int kMaxRanks = 64;

// One rank's contribution to Transport::allgather (a small board per rank: in the control block
// of a cpu transport, in a small symmetric window of the NCCL transport).
inline constexpr int kMaxAllgatherWords = 60;
struct AllgatherBoard {
  uint64_t seq;       // allgathers this rank started on the transport: 1, 2, ...
  int64_t num_words;  // words used
  int64_t words[kMaxAllgatherWords];
};

// The most bytes one symmetric allocation may take per rank: 1 TiB. Every rank maps every rank's
// (cpu processes: kMaxRanks x 1 TiB = 64 TiB, half of x86-64's 128 TiB user address space), and
// no GPU has that much memory. Buffer and A2a check their shape against it before allocating
// (OutOfCapacity naming the shape fields and the bytes, core/capacity.cc); allocate() checks again.
inline constexpr size_t kMaxSymmetricBytes = size_t{1} << 40;
// Throws OutOfCapacity when bytes > kMaxSymmetricBytes.
void check_symmetric_allocation(size_t bytes);

// Memory of the same size on every rank; peer(p) is rank p's copy as addressable from here
// (a host pointer on cpu, an LSA device pointer on cuda). Zero-filled at allocation.
class SymmetricMemory {
 public:
  virtual ~SymmetricMemory() = default;
  void* local() const { return ptrs_[rank_]; }
  void* peer(int rank) const { return ptrs_[rank]; }
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }

 protected:
  std::vector<void*> ptrs_;
  size_t bytes_ = 0;
  int rank_ = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  virtual Device device() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  // Collective: every rank asks for the same number of bytes, in the same order.
  virtual std::shared_ptr<SymmetricMemory> allocate(size_t bytes) = 0;

  // Collective and small (construction-time agreements, core/agree.h): every rank publishes
  // `mine` (at most kMaxAllgatherWords words) and gets every rank's words, in rank order, as that
  // rank published them. Two barriers, no allocation; bounded by timeout(). A peer whose board
  // carries another allgather number is not in this call (ranks out of step): InvalidArgument
  // naming `what` and that rank, raised on the ranks that see it after the closing barrier.
  virtual std::vector<std::vector<int64_t>> allgather(const char* what,
                                                      const std::vector<int64_t>& mine) = 0;

  // Collective host barrier, bounded by timeout(). Throws Timeout naming `what` and the ranks that
  // did not arrive, or Internal if a peer called abort().
  virtual void barrier(const char* what) = 0;

  // Fault tolerance (the a2a rank mask): `members` has bit p set for each rank p taking part,
  // this rank included. barrier(what, members) is barrier() over the members only (never reads a
  // non-member's state). resync() re-establishes the barrier generations among the members after
  // a Timeout left them at different points (each may have passed a different number of
  // barriers): collective over the members, who must all be out of every earlier barrier (a
  // member still inside one is waited for, up to `timeout`). Throws Timeout naming the members
  // that did not arrive; a member whose resync timed out calls it again, and its retry meets the
  // others' (a timed-out resync does not count). Transports that synchronise on the device raise
  // Unsupported for a proper subset.
  virtual void barrier(const char* what, uint64_t members) {
    if (members == all_members()) return barrier(what);
    throw_unsupported_subset(what);
  }
  // (Default: a plain barrier over all ranks, for transports whose barriers do not recover from
  // a timeout anyway; a subset is Unsupported.)
  // Returns the barrier epoch the members adopted (equal on every member; 0 for the default).
  virtual uint64_t resync(const char* what, uint64_t members, std::chrono::milliseconds timeout) {
    (void)timeout;
    if (members != all_members()) throw_unsupported_subset(what);
    barrier(what);
    return 0;
  }
  // A barrier over `members` (this rank included) that does not fail on a timeout: returns the
  // members that did not arrive within `timeout` (bit p = rank p; 0: every member arrived) and
  // stays usable among those that did, who all passed the same barriers. The ll rank masks
  // (BufferConfig::enable_shrink) mask the missing ones instead of raising Timeout. A peer's
  // abort() still throws.
  virtual uint64_t barrier_or_missing(const char* what, uint64_t members,
                                      std::chrono::milliseconds timeout) = 0;
  uint64_t all_members() const {
    return size() >= 64 ? ~uint64_t{0} : (uint64_t{1} << size()) - 1;
  }

  // True when the ranks' kernels share one GPU (the cuda backend's one-GPU test mode): backends
  // keep to one stream per rank there (side streams would exceed the hardware queues, and a
  // side stream's copy queued behind a peer's spinning kernel would stall this rank's op).
  virtual bool ranks_share_device() const { return false; }

  // Called by cuda Buffer / A2a destructors, after their device synchronisation. Destruction is
  // local (docs/semantics.md §5) except where ranks share one GPU: there every rank still waits
  // here for the others, as all destructors did before (without it HtOneGpu R = 8 failed 3 times
  // in 19 runs, always in the combine of a Buffer's last case). The likely cause was found on
  // 2026-11-30 — the test harness's pageable uploads queued behind a spinning kernel, fixed in
  // tests/gpu/gpu_support.cc (3b00b5c; docs/design.md §10) — but the mode was not re-run
  // without this barrier, so it stays. A failed barrier is ignored (the group already failed).
  void destruction_barrier(const char* what) noexcept {
    if (!ranks_share_device()) return;
    try {
      barrier(what);
    } catch (...) {
    }
  }

  // Marks this rank failed: peers blocked in barrier() stop with an error that quotes `why`
  // instead of waiting for the timeout. The first abort() of the group wins (later ones, of any
  // rank, change nothing). The group is unusable afterwards.
  virtual void abort(const std::string& why) = 0;

 private:
  [[noreturn]] static void throw_unsupported_subset(const char* what);

 protected:
  // The allgather's words of every rank from their boards (boards[p] = rank p's, read after the
  // first barrier of the call whose number is `seq`) into `out`. Returns "" or, for a board of
  // another call, the message of the InvalidArgument to raise after the closing barrier.
  static std::string read_boards(const char* what, int rank, uint64_t seq,
                                 const std::vector<AllgatherBoard>& boards,
                                 std::vector<std::vector<int64_t>>& out);
  // Fills `board` for this rank's call number `seq` (checks the size of `mine`).
  static void fill_board(const char* what, uint64_t seq, const std::vector<int64_t>& mine,
                         AllgatherBoard& board);
};

// cpu backend, ranks are threads of this process sharing `world_name`.
std::shared_ptr<Transport> make_cpu_thread_transport(int rank, int size,
                                                     const std::string& world_name,
                                                     std::chrono::milliseconds timeout);
// Where a thread transport's symmetric blocks live. The cpu backend's: host memory (the defaults).
// The cuda backend's one-GPU test mode (make_cuda_shared_device_transport): device memory of one
// GPU, every rank's block a plain device pointer usable by every rank's kernels.
struct ThreadMemory {
  Backend backend = Backend::kCpu;
  Device device = Device::cpu();
  // A zero-filled block of at least `bytes` (16-byte aligned), freed by its deleter once the last
  // rank dropped it; null = host calloc.
  std::function<std::shared_ptr<void>(size_t bytes)> allocate;
};

// Ranks are threads of this process sharing `world_name`: host barrier (bounded by `timeout`,
// naming missing ranks), abort, subsets and resync exactly as the cpu backend's; blocks from
// `memory`, exchanged through the shared world. `what` names the caller in errors.
std::shared_ptr<Transport> make_thread_transport(int rank, int size, const std::string& world_name,
                                                 std::chrono::milliseconds timeout,
                                                 ThreadMemory memory, const char* what);

// cuda backend, test/development mode: `size` ranks as threads of this process on one GPU
// (Group::cuda_shared_device). Resolves options->num_sms (auto: SMs / size) and checks that the
// ranks' CTAs can be co-resident. Throws Unsupported in a build without CUDA.
std::shared_ptr<Transport> make_cuda_shared_device_transport(int rank, int size,
                                                             const std::string& world_name,
                                                             int cuda_device,
                                                             GroupOptions* options);

// cpu backend, ranks are processes on this host; POSIX shared memory named after `name`.
std::shared_ptr<Transport> make_cpu_process_transport(int rank, int size, const std::string& name,
                                                      std::chrono::milliseconds timeout);

}  // namespace epx::detail
