// src/transport/nccl_transport.cc — the cuda backend's transport (docs/design.md §5): one NCCL
// communicator per group, symmetric memory from NCCL windows, LSA peer pointers, a bounded device
// barrier.
//
// Data flow of allocate(bytes), collective, same sizes in the same order on every rank:
//   ncclMemAlloc (cuMem, exportable) -> zero-fill + sync -> ncclCommWindowRegister (collective;
//   NCCL maps every peer's allocation into one flat LSA range) -> one tiny kernel reads
//   ncclGetLsaPointer(window, 0, p) for every p -> SymmetricMemory::peer(p) are plain device
//   pointers usable by any kernel -> a device barrier, so no peer writes before we zeroed.
// The devComm is created before any window: in NCCL 2.28 ncclCommWindowRegister "succeeds" with
// an unusable handle when symmetric memory is unsupported, ncclDevCommCreate fails loudly.
// Never asks for NVLS/multicast or GIN (NCCL_WIN_DEFAULT windows, no lsaMultimem, no GIN fields).
//
// Barrier: a window of BarrierSlots per transport; see nccl_device_ops.h. Bounded by timeout().
// allgather (the construction-time agreements, core/agree.h): each rank's AllgatherBoard after the
// released flags of the board window, copied in, a barrier, every peer's copied out, a barrier.
//
// Release is local, freeing is collective: dropping a SymmetricMemory (a Buffer / A2a destroyed,
// in Python whenever the garbage collector gets to it, at a different point on every rank) only
// marks its window released; no barrier, no NCCL call. The next allocate() (collective) frees the
// windows every rank has released: each rank writes its released flags into its own board (a
// small window), a bounded barrier, each reads every peer's board, and all deregister the agreed
// windows in the same order before registering the new one. So the collectives of the ranks never
// pair up differently because they destroyed objects at different times, and no window is freed
// while a peer may still use it. Every rank's list of windows is the same (allocation order; only
// agreed frees remove entries). What is never agreed is freed with the communicator.
#include "transport/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "transport/nccl_check.h"
#include "transport/nccl_device_ops.h"
#include "transport/rail.h"

namespace epx::detail {

namespace {

constexpr size_t kWindowGranularity = size_t(2) << 20;
// Released flags exchanged per allocate(): the first this many windows of the registry take part
// (more live windows than this: the later ones wait for the communicator's end).
constexpr size_t kReleaseBoardBytes = 4096;

// One registered window, as the communicator's registry keeps it.
struct NcclWindow {
  void* base = nullptr;
  ncclWindow_t window = nullptr;
  bool released = false;  // its SymmetricMemory was dropped on this rank
};

// The communicator, its device communicator and the registry of its windows; shared by the
// transport and every window so the comm outlives the last window.
struct NcclComm {
  ncclComm_t comm = nullptr;
  bool owned = false;
  int device = 0;
  ncclDevComm dev_comm{};
  bool dev_comm_created = false;
  bool failed = false;  // a barrier timed out or abort() was called: abort instead of finalize
  // barrier_or_missing found a member missing: still usable among the others, but torn down as
  // a failed one (collective NCCL teardown would wait for the missing rank).
  bool peer_missing = false;
  bool abort_teardown() const { return failed || peer_missing; }
  std::mutex mu;        // guards windows (a garbage collector may drop memory on any thread)
  std::vector<NcclWindow> windows;  // allocation order; the same list on every rank

  void free_window(const NcclWindow& w) {
    if (abort_teardown())
      return;  // NCCL may hang on a failed communicator: leave it to the
               // process exit
    if (w.window) ncclCommWindowDeregister(comm, w.window);
    if (w.base) ncclMemFree(w.base);
  }

  void mark_released(void* base) {
    std::lock_guard<std::mutex> lock(mu);
    for (NcclWindow& w : windows)
      if (w.base == base) w.released = true;
  }

  ~NcclComm() {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    for (auto it = windows.rbegin(); it != windows.rend(); ++it) free_window(*it);
    windows.clear();
    if (dev_comm_created && !abort_teardown()) ncclDevCommDestroy(comm, &dev_comm);
    if (owned && comm) {
      if (abort_teardown()) {
        ncclCommAbort(comm);
      } else {
        ncclCommFinalize(comm);
        ncclCommDestroy(comm);
      }
    }
    cudaSetDevice(previous);
  }
};

class NcclSymmetricMemory final : public SymmetricMemory {
 public:
  NcclSymmetricMemory(std::shared_ptr<NcclComm> comm, size_t bytes, int rank, int size,
                      cudaStream_t stream)
      : comm_(std::move(comm)) {
    DeviceGuard guard(comm_->device);
    const size_t alloc = (std::max<size_t>(bytes, 1) + kWindowGranularity - 1) /
                         kWindowGranularity * kWindowGranularity;
    NcclWindow w;
    EPX_NCCL_CHECK(ncclMemAlloc(&w.base, alloc), "symmetric allocation");
    try {
      EPX_CUDA_CHECK(cudaMemsetAsync(w.base, 0, alloc, stream), "symmetric allocation");
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream), "symmetric allocation");
      EPX_NCCL_CHECK(
          ncclCommWindowRegister(comm_->comm, w.base, alloc, &w.window, NCCL_WIN_DEFAULT),
          "symmetric allocation");
    } catch (...) {
      ncclMemFree(w.base);
      throw;
    }
    base_ = w.base;
    {
      std::lock_guard<std::mutex> lock(comm_->mu);
      comm_->windows.push_back(w);  // registered: the registry frees it from now on
    }
    try {
      std::vector<void*> lsa;
      nccl_lsa_pointers(w.window, size, stream, lsa);
      ptrs_.assign(size, nullptr);
      for (int p = 0; p < size; ++p) {
        EPX_CHECK(lsa[p] != nullptr, ErrorCode::kInternal,
                  "symmetric allocation: LSA pointer of rank ", p, " is null");
        ptrs_[p] = p == rank ? base_ : lsa[p];
      }
    } catch (...) {
      comm_->mark_released(base_);
      throw;
    }
    bytes_ = bytes;
    rank_ = rank;
  }

  // Local: the window stays registered and mapped (peers may still touch it) until every rank
  // released it and an allocate() agreed on that, or until the communicator goes.
  ~NcclSymmetricMemory() override { comm_->mark_released(base_); }

 private:
  std::shared_ptr<NcclComm> comm_;
  void* base_ = nullptr;
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(std::shared_ptr<NcclComm> comm, std::chrono::milliseconds timeout)
      : comm_(std::move(comm)), timeout_(timeout) {
    DeviceGuard guard(comm_->device);
    EPX_NCCL_CHECK(ncclCommUserRank(comm_->comm, &rank_), "Group::cuda");
    EPX_NCCL_CHECK(ncclCommCount(comm_->comm, &size_), "Group::cuda");
    EPX_CHECK(size_ <= kMaxRanks, ErrorCode::kUnsupported, "Group::cuda: ", size_,
              " ranks, expected at most ", kMaxRanks);
    int runtime = 0;
    EPX_NCCL_CHECK(ncclGetVersion(&runtime), "Group::cuda");
    EPX_CHECK(runtime == NCCL_VERSION_CODE, ErrorCode::kUnsupported,
              "Group::cuda: the loaded libnccl is version ", runtime, " but epx was built against ",
              "NCCL headers ", NCCL_VERSION_CODE,
              "; NCCL 2.28's device structs are unversioned, rebuild epx against the loaded NCCL "
              "(EPX_NCCL_ROOT)");
    const ncclTeam_t lsa = ncclTeamLsa(comm_->comm);
    EPX_CHECK(lsa.nRanks == size_ && lsa.rank == rank_, ErrorCode::kUnsupported,
              "Group::cuda: the ", size_,
              " ranks do not form one NVLink (LSA) domain (LSA team has ", lsa.nRanks,
              " ranks); the cuda backend needs every rank on one node with CUDA P2P");
    // Device communicator first: fails loudly where symmetric memory is unsupported.
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
    reqs.lsaBarrierCount = 1;
    ncclResult_t r = ncclDevCommCreate(comm_->comm, &reqs, &comm_->dev_comm);
    if (r != ncclSuccess) {
      const char* last = ncclGetLastError(nullptr);
      throw_error(ErrorCode::kUnsupported,
                  cat("Group::cuda: NCCL symmetric memory is unavailable (ncclDevCommCreate: ",
                      ncclGetErrorString(r), (last && last[0]) ? cat(": ", last) : std::string(),
                      "); it needs CUDA P2P between all GPUs, CUDA VMM, NCCL_CUMEM_ENABLE != 0 and "
                      "NCCL_WIN_ENABLE != 0"));
    }
    comm_->dev_comm_created = true;
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "Group::cuda");
    EPX_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_), sizeof(int32_t) * kMaxRanks,
                                 cudaHostAllocMapped | cudaHostAllocPortable),
                   "Group::cuda");
    EPX_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_dev_), status_, 0),
                   "Group::cuda");
    slots_ =
        std::make_shared<NcclSymmetricMemory>(comm_, sizeof(BarrierSlots), rank_, size_, stream_);
    // Zero-filled before it is registered, so no rank reads another's board before it is valid.
    board_ = std::make_shared<NcclSymmetricMemory>(
        comm_, kReleaseBoardBytes + sizeof(AllgatherBoard), rank_, size_, stream_);
  }

  ~NcclTransport() override {
    board_.reset();
    slots_.reset();
    if (stream_) cudaStreamDestroy(stream_);
    if (status_) cudaFreeHost(status_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kCuda; }
  Device device() const override { return Device::cuda(comm_->device); }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  ncclComm_t comm() const { return comm_->comm; }
  int64_t window_count() const {
    std::lock_guard<std::mutex> lock(comm_->mu);
    return static_cast<int64_t>(comm_->windows.size());
  }

  std::shared_ptr<SymmetricMemory> allocate(size_t bytes) override {
    check_usable("allocate");
    free_agreed_releases();
    auto mem = std::make_shared<NcclSymmetricMemory>(comm_, bytes, rank_, size_, stream_);
    barrier("symmetric allocation");
    return mem;
  }

  // Windows every rank has released: deregistered and freed here, in the same order everywhere
  // (see the file comment). Collective, part of allocate(). Returns how many were freed.
  size_t free_agreed_releases() {
    DeviceGuard guard(comm_->device);
    std::vector<uint8_t> mine;
    {
      std::lock_guard<std::mutex> lock(comm_->mu);
      mine.resize(std::min(comm_->windows.size(), kReleaseBoardBytes));
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = comm_->windows[i].released ? 1 : 0;
    }
    const size_t n = mine.size();  // the same on every rank (the lists are equal)
    EPX_CUDA_CHECK(
        cudaMemcpyAsync(board_->local(), mine.data(), n, cudaMemcpyHostToDevice, stream_),
        "symmetric allocation (releases)");
    barrier("symmetric allocation (releases)");  // every board written (and the copy done)
    std::vector<uint8_t> agreed = mine;
    std::vector<uint8_t> theirs(n);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      EPX_CUDA_CHECK(
          cudaMemcpyAsync(theirs.data(), board_->peer(p), n, cudaMemcpyDeviceToHost, stream_),
          "symmetric allocation (releases)");
      EPX_CUDA_CHECK(cudaStreamSynchronize(stream_), "symmetric allocation (releases)");
      for (size_t i = 0; i < n; ++i) agreed[i] &= theirs[i];
    }
    // Nobody rewrites its board before every rank read it: the next write comes after the
    // allocation barrier that follows, which every rank reaches only after these reads.
    std::lock_guard<std::mutex> lock(comm_->mu);
    size_t freed = 0;
    std::vector<NcclWindow> kept;
    kept.reserve(comm_->windows.size());
    for (size_t i = 0; i < comm_->windows.size(); ++i) {
      if (i < n && agreed[i]) {
        comm_->free_window(comm_->windows[i]);
        ++freed;
      } else {
        kept.push_back(comm_->windows[i]);
      }
    }
    comm_->windows = std::move(kept);
    return freed;
  }

  // The allgather board sits after the released flags in the board window: publish (a copy on
  // the transport's stream, which the barrier orders), barrier, read every peer's board (LSA
  // pointers, as free_agreed_releases), barrier (nobody rewrites a board before every rank read it).
  std::vector<std::vector<int64_t>> allgather(const char* what,
                                              const std::vector<int64_t>& mine) override {
    check_usable(what);
    DeviceGuard guard(comm_->device);
    AllgatherBoard board{};
    fill_board(what, ++allgathers_, mine, board);
    auto at = [&](int p) { return static_cast<char*>(board_->peer(p)) + kReleaseBoardBytes; };
    EPX_CUDA_CHECK(cudaMemcpyAsync(at(rank_), &board, sizeof(board), cudaMemcpyHostToDevice,
                                   stream_),
                   what);
    barrier(what);  // every board written (the copy ran before the barrier on stream_)
    std::vector<AllgatherBoard> boards(size_);
    for (int p = 0; p < size_; ++p)
      EPX_CUDA_CHECK(cudaMemcpyAsync(&boards[p], at(p), sizeof(AllgatherBoard),
                                     cudaMemcpyDeviceToHost, stream_),
                     what);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_), what);
    std::vector<std::vector<int64_t>> out;
    const std::string error = read_boards(what, rank_, allgathers_, boards, out);
    barrier(what);
    if (!error.empty()) throw_error(ErrorCode::kInvalidArgument, error);
    return out;
  }

  void barrier(const char* what) override {
    check_usable(what);
    DeviceGuard guard(comm_->device);
    DeviceBarrierArgs args = barrier_args();
    args.epoch = ++epoch_;
    launch_device_barrier(args, stream_);
    // Bounded: the kernel gives up after timeout_ns.
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_), what);
    std::string missing, aborted;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const int32_t s = reinterpret_cast<volatile int32_t*>(status_)[p];
      if (s == 1) missing += cat(missing.empty() ? "" : ", ", p);
      if (s == 2) aborted += cat(aborted.empty() ? "" : ", ", p);
    }
    if (!aborted.empty()) {
      comm_->failed = true;
      throw_error(ErrorCode::kInternal,
                  cat(what, ": rank ", rank_, ": peer rank(s) [", aborted, "] aborted the group"));
    }
    if (!missing.empty()) {
      comm_->failed = true;
      throw_error(ErrorCode::kTimeout,
                  cat(what, ": rank ", rank_, " waited ", timeout_.count(),
                      " ms at a barrier for rank(s) [", missing, "] that did not arrive"));
    }
  }

  uint64_t barrier_or_missing(const char* what, uint64_t members,
                              std::chrono::milliseconds timeout) override {
    check_usable(what);
    DeviceGuard guard(comm_->device);
    DeviceBarrierArgs args = barrier_args();
    args.epoch = ++epoch_;
    args.members = members;
    args.timeout_ns = static_cast<uint64_t>(timeout.count()) * 1000000ull;
    launch_device_barrier(args, stream_);
    EPX_CUDA_CHECK(cudaStreamSynchronize(stream_), what);  // bounded: the kernel gives up
    uint64_t missing = 0;
    std::string aborted;
    for (int p = 0; p < size_; ++p) {
      const int32_t s = reinterpret_cast<volatile int32_t*>(status_)[p];
      if (p != rank_ && s == 1) missing |= uint64_t{1} << p;
      if (p != rank_ && s == 2) aborted += cat(aborted.empty() ? "" : ", ", p);
    }
    if (!aborted.empty()) {
      comm_->failed = true;
      throw_error(ErrorCode::kInternal,
                  cat(what, ": rank ", rank_, ": peer rank(s) [", aborted, "] aborted the group"));
    }
    if (missing) comm_->peer_missing = true;
    return missing;
  }

  void abort(const std::string& why) override {
    if (comm_->failed) return;
    abort_reason_ = why;
    DeviceGuard guard(comm_->device);
    DeviceBarrierArgs args = barrier_args();
    args.abort = true;
    launch_device_barrier(args, stream_);
    cudaStreamSynchronize(stream_);
    comm_->failed = true;
  }

 private:
  void check_usable(const char* what) const {
    EPX_CHECK(!comm_->failed, ErrorCode::kInternal, what, ": the cuda group is unusable after an ",
              "earlier timeout or abort",
              abort_reason_.empty() ? "" : cat(" (", abort_reason_, ")"));
  }

  DeviceBarrierArgs barrier_args() const {
    DeviceBarrierArgs args;
    args.local = static_cast<BarrierSlots*>(slots_->local());
    for (int p = 0; p < size_; ++p) args.peers[p] = static_cast<BarrierSlots*>(slots_->peer(p));
    args.rank = rank_;
    args.size = size_;
    args.timeout_ns = static_cast<uint64_t>(timeout_.count()) * 1000000ull;
    args.status = status_dev_;
    return args;
  }

  std::shared_ptr<NcclComm> comm_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int size_ = 1;
  cudaStream_t stream_ = nullptr;
  int32_t* status_ = nullptr;      // mapped pinned host memory
  int32_t* status_dev_ = nullptr;  // its device address
  std::shared_ptr<SymmetricMemory> slots_;
  // kReleaseBoardBytes released flags (allocate()), then this rank's AllgatherBoard (allgather())
  std::shared_ptr<SymmetricMemory> board_;
  uint32_t epoch_ = 0;
  uint64_t allgathers_ = 0;
  std::string abort_reason_;
};

std::shared_ptr<NcclComm> bind_comm(ncclComm_t comm, bool owned, int device) {
  auto c = std::make_shared<NcclComm>();
  c->comm = comm;
  c->owned = owned;
  c->device = device;
  return c;
}

}  // namespace

UniqueId nccl_new_unique_id() {
  ncclUniqueId id;
  EPX_NCCL_CHECK(ncclGetUniqueId(&id), "new_unique_id");
  static_assert(sizeof(id.internal) == sizeof(UniqueId::bytes), "ncclUniqueId is 128 bytes");
  UniqueId out;
  std::memcpy(out.bytes.data(), id.internal, sizeof(id.internal));
  return out;
}

std::shared_ptr<Transport> make_nccl_transport(int rank, int size, const UniqueId& id,
                                               int cuda_device, std::chrono::milliseconds timeout) {
  EPX_CHECK_ARG(size >= 1 && size <= kMaxRanks, "Group::cuda: argument 'size' is ", size,
                ", expected 1..", kMaxRanks);
  EPX_CHECK_ARG(rank >= 0 && rank < size, "Group::cuda: argument 'rank' is ", rank,
                ", expected 0..", size - 1);
  int num_devices = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&num_devices), "Group::cuda");
  EPX_CHECK_ARG(cuda_device >= 0 && cuda_device < num_devices, "Group::cuda: argument ",
                "'cuda_device' is ", cuda_device, ", expected 0..", num_devices - 1, " (",
                num_devices, " GPUs visible)");
  EPX_CUDA_CHECK(cudaSetDevice(cuda_device), "Group::cuda");  // binds this thread's device
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.bytes.data(), sizeof(nid.internal));
  ncclComm_t comm = nullptr;
  EPX_NCCL_CHECK(ncclCommInitRank(&comm, size, nid, rank), "Group::cuda");
  return std::make_shared<NcclTransport>(bind_comm(comm, true, cuda_device), timeout);
}

std::shared_ptr<Transport> make_nccl_transport_from_comm(void* nccl_comm, int cuda_device,
                                                         std::chrono::milliseconds timeout) {
  auto comm = static_cast<ncclComm_t>(nccl_comm);
  int comm_device = -1;
  EPX_NCCL_CHECK(ncclCommCuDevice(comm, &comm_device), "Group::cuda_from_comm");
  EPX_CHECK_ARG(comm_device == cuda_device, "Group::cuda_from_comm: argument 'cuda_device' is ",
                cuda_device, " but the communicator is bound to cuda:", comm_device);
  EPX_CUDA_CHECK(cudaSetDevice(cuda_device), "Group::cuda_from_comm");
  return std::make_shared<NcclTransport>(bind_comm(comm, false, cuda_device), timeout);
}

void* nccl_split(void* parent_comm, Topology topology, bool node, int cuda_device, int* rank,
                 const char* what) {
  auto parent = static_cast<ncclComm_t>(parent_comm);
  int size = 0;
  EPX_NCCL_CHECK(ncclCommUserRank(parent, rank), what);
  EPX_NCCL_CHECK(ncclCommCount(parent, &size), what);
  EPX_CHECK(size == topology.num_nodes * topology.ranks_per_node, ErrorCode::kInternal, what,
            ": the parent communicator has ", size, " ranks, expected ", topology.num_nodes,
            " nodes x ", topology.ranks_per_node);
  EPX_CUDA_CHECK(cudaSetDevice(cuda_device), what);
  const RailSplit split = rail_split(topology, *rank);
  const int color = node ? split.node_color : split.rail_color;
  const int key = node ? split.node_key : split.rail_key;
  const int want_size = node ? topology.ranks_per_node : topology.num_nodes;
  ncclComm_t comm = nullptr;
  EPX_NCCL_CHECK(ncclCommSplit(parent, color, key, &comm, nullptr), what);
  int got_rank = -1, got_size = 0;
  if (ncclCommUserRank(comm, &got_rank) != ncclSuccess ||
      ncclCommCount(comm, &got_size) != ncclSuccess || got_rank != key || got_size != want_size) {
    ncclCommDestroy(comm);
    throw_error(ErrorCode::kInternal, cat(what, ": rank ", got_rank, " of ", got_size,
                                          " after the split, expected ", key, " of ", want_size));
  }
  return comm;
}

std::shared_ptr<Transport> make_nccl_node_transport(void* parent_comm, Topology topology,
                                                    int cuda_device,
                                                    std::chrono::milliseconds timeout) {
  int rank = 0;
  auto node = static_cast<ncclComm_t>(
      nccl_split(parent_comm, topology, true, cuda_device, &rank, "node communicator"));
  return std::make_shared<NcclTransport>(bind_comm(node, true, cuda_device), timeout);
}

void* nccl_comm_of(const Transport& transport) {
  auto* t = dynamic_cast<const NcclTransport*>(&transport);
  return t ? static_cast<void*>(t->comm()) : nullptr;
}

int64_t nccl_window_count(const Transport& transport) {
  auto* t = dynamic_cast<const NcclTransport*>(&transport);
  return t ? t->window_count() : -1;
}

}  // namespace epx::detail
