// src/transport/cpu_transport.cc — shared-memory transport of the cpu backend.
//
// Synchronisation: a control block (in process memory for threads, in a POSIX shared memory
// segment for processes) holds one arrival counter per rank. barrier() bumps this rank's counter
// to its next epoch (release) and waits until every counter reaches it (acquire), so a barrier
// names exactly the ranks that did not arrive when it times out. All-zero is the initial state,
// so every process can create-or-open the segment without an initialiser race.
// A barrier over a subset of the ranks (the a2a rank mask) waits only for those; resync() brings
// the members back to one epoch after a Timeout left them at different ones (two rounds over a
// separate per-rank join counter, see resync()).
//
// Symmetric memory: threads — each rank allocates its own block and publishes the pointer;
// processes — each rank creates "/<name>.<seq>.<rank>", maps every peer's, and once all ranks
// mapped them every rank unlinks every rank's name (so a rank killed right after still leaves
// nothing in /dev/shm).
// Failure paths leave nothing either: a rank whose allocate fails (a peer that never arrives or
// died, a peer's segment of another size, a mapping that fails) unmaps what it mapped and
// unlinks every rank's segment name of that allocation (a dead peer cannot unlink its own; a
// live straggler that arrives later finds the names gone and fails too), and a failed join
// unlinks the control segment. A failure only this rank can see (not a timeout or a peer's
// abort) also aborts the transport, so the peers stop at once instead of waiting for the timeout.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/check.h"
#include "core/host_wait.h"
#include "transport/transport.h"

namespace epx::detail {
namespace {

struct alignas(64) ArriveSlot {
  std::atomic<uint64_t> epoch;
};

struct ControlBlock {
  std::atomic<int32_t> abort_claimed;  // set by the first abort(): only it writes the message
  std::atomic<int32_t> aborted_by;     // rank + 1 of that rank, 0 = none; set after the message
  char abort_message[512];
  ArriveSlot arrive[kMaxRanks];
  ArriveSlot join[kMaxRanks];  // resync(): 2n - 1 / 2n = rank in round 1 / 2 of its n-th resync
  AllgatherBoard board[kMaxRanks];  // allgather(): rank p writes board[p]
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "needs address-free atomics");

std::string fmt_ranks(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// Barrier logic shared by both flavours.
class CpuTransportBase : public Transport {
 public:
  CpuTransportBase(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kCpu; }
  Device device() const override { return Device::cpu(); }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  void barrier(const char* what) override { barrier(what, all_members()); }

  void barrier(const char* what, uint64_t members) override {
    const uint64_t target = ++epoch_;
    // Pairs with the acquire loads of every peer waiting for this epoch.
    control_->arrive[rank_].epoch.store(target, std::memory_order_release);
    wait_all(what, control_->arrive, members, target, timeout_, "to arrive");
  }

  uint64_t barrier_or_missing(const char* what, uint64_t members,
                              std::chrono::milliseconds timeout) override {
    const uint64_t target = ++epoch_;
    control_->arrive[rank_].epoch.store(target, std::memory_order_release);  // as barrier()
    return wait_members(what, control_->arrive, members, target, timeout);
  }

  // Round 1: every member announces it left its earlier barriers (join = 2n - 1) and waits for
  // the others; then the arrive counters of all members are stable (nobody is inside a barrier)
  // and each member adopts the largest as its epoch. Round 2 (join = 2n): nobody starts the next
  // barrier (raising its arrive counter) before every member has read the counters of round 1.
  // A resync that times out does not count: the member puts its join slot back to 2(n - 1) and
  // its retry has the same n, so a late member's first resync meets its peers' retry — it neither
  // passes on their higher counters nor on the slots of their failed attempt.
  uint64_t resync(const char* what, uint64_t members, std::chrono::milliseconds timeout) override {
    const uint64_t n = ++resyncs_;
    try {
      control_->join[rank_].epoch.store(2 * n - 1, std::memory_order_release);
      wait_all(what, control_->join, members, 2 * n - 1, timeout, "to join the resynchronisation");
      uint64_t epoch = epoch_;
      for (int p = 0; p < size_; ++p)
        if (members >> p & 1)
          epoch = std::max(epoch, control_->arrive[p].epoch.load(std::memory_order_acquire));
      control_->join[rank_].epoch.store(2 * n, std::memory_order_release);
      wait_all(what, control_->join, members, 2 * n, timeout, "to join the resynchronisation");
      epoch_ = epoch;
      return epoch;
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) {
        control_->join[rank_].epoch.store(2 * (n - 1), std::memory_order_release);
        --resyncs_;
      }
      throw;
    }
  }

  // Publish into this rank's board, barrier, read every board, barrier (nobody rewrites a board
  // before every rank read it), then raise what the reads found.
  std::vector<std::vector<int64_t>> allgather(const char* what,
                                              const std::vector<int64_t>& mine) override {
    const uint64_t seq = ++allgathers_;
    fill_board(what, seq, mine, control_->board[rank_]);
    barrier(what);
    std::vector<AllgatherBoard> boards(control_->board, control_->board + size_);
    std::vector<std::vector<int64_t>> out;
    const std::string error = read_boards(what, rank_, seq, boards, out);
    barrier(what);
    if (!error.empty()) throw_error(ErrorCode::kInvalidArgument, error);
    return out;
  }

  void abort(const std::string& why) override {
    // Claim first, so two ranks aborting at once never write the message together, and publish
    // aborted_by only once the message is complete (release; pairs with the acquire load in
    // barrier(), which reads the message after seeing aborted_by != 0).
    int32_t expected = 0;
    if (!control_->abort_claimed.compare_exchange_strong(expected, 1, std::memory_order_relaxed))
      return;  // an earlier abort() (of any rank) already names the failure
    std::strncpy(control_->abort_message, why.c_str(), sizeof(control_->abort_message) - 1);
    control_->aborted_by.store(rank_ + 1, std::memory_order_release);
  }

 protected:
  // Waits until slots[p] >= target for every member p (acquire), bounded by `timeout`.
  void wait_all(const char* what, const ArriveSlot* slots, uint64_t members, uint64_t target,
                std::chrono::milliseconds timeout, const char* doing) {
    const uint64_t missing = wait_members(what, slots, members, target, timeout);
    if (missing == 0) return;
    std::vector<int> ranks;
    for (int p = 0; p < size_; ++p)
      if (missing >> p & 1) ranks.push_back(p);
    throw_error(
        ErrorCode::kTimeout,
        cat(what, ": rank ", rank_, " waited ", timeout.count(), " ms for ranks ", fmt_ranks(ranks),
            " ", doing, " (timeout; set GroupOptions::timeout or EPX_TIMEOUT_MS)"));
  }

  // wait_all's wait: returns the members p whose slots[p] had not reached `target` when
  // `timeout` expired (0: none). Throws Internal when a peer aborted before every member arrived.
  // An abort seen after the members' slots were read may be a later one: a peer that arrived,
  // left and aborted its next step. The slots are read again after the acquire of aborted_by
  // (which makes every arrival before that abort visible), so a wait that completed before the
  // abort returns as completed.
  uint64_t wait_members(const char* what, const ArriveSlot* slots, uint64_t members,
                        uint64_t target, std::chrono::milliseconds timeout) {
    ControlBlock* c = control_;
    auto behind = [&] {
      uint64_t m = 0;
      for (int p = 0; p < size_; ++p)
        if ((members >> p & 1) && slots[p].epoch.load(std::memory_order_acquire) < target)
          m |= uint64_t{1} << p;
      return m;
    };
    for (HostBackoff backoff(timeout);;) {
      const uint64_t missing = behind();
      if (missing == 0) return 0;
      int32_t aborted = c->aborted_by.load(std::memory_order_acquire);
      if (aborted != 0) {
        if (behind() == 0) return 0;
        throw_error(ErrorCode::kInternal,
                    cat(what, ": rank ", aborted - 1, " aborted the collective (",
                        std::string(c->abort_message, strnlen(c->abort_message, 511)), ")"));
      }
      if (!backoff.pause()) return behind();
    }
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  uint64_t epoch_ = 0;
  uint64_t resyncs_ = 0;
  uint64_t allgathers_ = 0;
  ControlBlock* control_ = nullptr;
};

// ---- threads ---------------------------------------------------------------------------------

struct ThreadWorld {
  explicit ThreadWorld(int size) : size(size), slots(size) {
    std::memset(static_cast<void*>(&control), 0, sizeof(control));
  }
  int size;
  ControlBlock control;
  std::vector<std::shared_ptr<void>> slots;  // allocation exchange, one per rank
};

class HostSymmetricMemory : public SymmetricMemory {
 public:
  HostSymmetricMemory(int rank, size_t bytes, std::vector<std::shared_ptr<void>> blocks)
      : blocks_(std::move(blocks)) {
    rank_ = rank;
    bytes_ = bytes;
    for (auto& b : blocks_) ptrs_.push_back(b.get());
  }

 private:
  std::vector<std::shared_ptr<void>> blocks_;  // keeps every rank's block alive
};

std::shared_ptr<void> host_block(size_t bytes) {
  size_t rounded = (bytes + 4095) / 4096 * 4096;
  void* p = std::calloc(1, rounded ? rounded : 4096);  // 16-byte aligned, zero-filled
  if (!p)
    throw_error(ErrorCode::kOutOfCapacity,
                cat("allocate: cannot allocate ", bytes, " bytes of host memory"));
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

class ThreadTransport : public CpuTransportBase {
 public:
  ThreadTransport(int rank, int size, std::shared_ptr<ThreadWorld> world,
                  std::chrono::milliseconds timeout, ThreadMemory memory)
      : CpuTransportBase(rank, size, timeout), world_(std::move(world)), memory_(std::move(memory)) {
    control_ = &world_->control;
    if (!memory_.allocate) memory_.allocate = host_block;
  }
  Backend backend() const override { return memory_.backend; }
  Device device() const override { return memory_.device; }
  bool ranks_share_device() const override { return memory_.backend == Backend::kCuda; }

  std::shared_ptr<SymmetricMemory> allocate(size_t bytes) override {
    check_symmetric_allocation(bytes);
    try {
      world_->slots[rank_] = memory_.allocate(bytes);
    } catch (const std::exception& e) {
      abort(cat("allocate failed on rank ", rank_, ": ", e.what()));
      throw;
    }
    // On a timeout the block stays in its slot (freed with the world or the next allocation): a
    // straggler may still copy the slots, and resetting it here would race with that copy.
    barrier("allocate");
    std::vector<std::shared_ptr<void>> blocks = world_->slots;
    barrier("allocate");  // every rank copied the slots before anyone reuses them
    return std::make_shared<HostSymmetricMemory>(rank_, bytes, std::move(blocks));
  }

 private:
  std::shared_ptr<ThreadWorld> world_;
  ThreadMemory memory_;
};

std::mutex g_worlds_mutex;
std::map<std::string, std::weak_ptr<ThreadWorld>> g_worlds;

// ---- processes -------------------------------------------------------------------------------

// Maps `bytes` of the segment `name`: created (or opened, if it exists) and sized when `create`,
// else opened, and then it must hold exactly `bytes` (a peer that sized its segment differently
// built another geometry: reading past its end would be SIGBUS). A segment this call created is
// unlinked again when the call fails.
void* map_shm(const std::string& name, size_t bytes, bool create, const char* what) {
  int fd = shm_open(name.c_str(), create ? (O_CREAT | O_RDWR) : O_RDWR, 0600);
  if (fd < 0)
    throw_error(ErrorCode::kInternal, cat(what, ": shm_open(", name, ") failed: ", std::strerror(errno)));
  auto fail = [&](ErrorCode code, const std::string& message) {
    close(fd);
    if (create) shm_unlink(name.c_str());
    throw_error(code, message);
  };
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    fail(ErrorCode::kOutOfCapacity, cat(what, ": cannot size shared memory ", name, " to ", bytes,
                                        " bytes: ", std::strerror(e)));
  }
  if (!create) {
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      fail(ErrorCode::kInternal, cat(what, ": fstat(", name, ") failed: ", std::strerror(e)));
    }
    if (static_cast<size_t>(st.st_size) != bytes)
      fail(ErrorCode::kInvalidArgument,
           cat(what, ": the peer's shared memory ", name, " has ", st.st_size,
               " bytes, this rank's ", bytes,
               "; expected every rank to allocate the same size (the same shape on every rank)"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    fail(e == ENOMEM ? ErrorCode::kOutOfCapacity : ErrorCode::kInternal,
         cat(what, ": mmap(", name, ", ", bytes, ") failed: ", std::strerror(e)));
  }
  close(fd);
  return p;
}

class ShmSymmetricMemory : public SymmetricMemory {
 public:
  ShmSymmetricMemory(int rank, size_t bytes, size_t mapped, std::vector<void*> ptrs)
      : mapped_(mapped) {
    rank_ = rank;
    bytes_ = bytes;
    ptrs_ = std::move(ptrs);
  }
  ~ShmSymmetricMemory() override {
    for (void* p : ptrs_)
      if (p) munmap(p, mapped_);
  }

 private:
  size_t mapped_;
};

class ProcessTransport : public CpuTransportBase {
 public:
  ProcessTransport(int rank, int size, const std::string& name, std::chrono::milliseconds timeout)
      : CpuTransportBase(rank, size, timeout), name_("/" + name) {
    // Create-or-open: the segment starts all-zero, which is the valid initial state.
    control_ = static_cast<ControlBlock*>(map_shm(name_ + ".ctl", sizeof(ControlBlock), true, "cpu_processes"));
  }
  ~ProcessTransport() override {
    munmap(control_, sizeof(ControlBlock));
    unlink_control();  // normally gone since the join; a no-op then
  }

  // Every rank, after the join barrier (everyone mapped the control block before arriving there;
  // each rank unlinks, so a rank killed right after the join leaves nothing behind), and after a
  // failed join (a peer that never arrived or died first).
  void unlink_control() { shm_unlink((name_ + ".ctl").c_str()); }

  std::shared_ptr<SymmetricMemory> allocate(size_t bytes) override {
    check_symmetric_allocation(bytes);
    const size_t mapped = (bytes + 4095) / 4096 * 4096 + 4096;
    const uint64_t seq = alloc_seq_++;
    auto seg = [&](int r) { return cat(name_, ".", seq, ".", r); };
    std::vector<void*> ptrs(size_, nullptr);
    auto unlink_all = [&] {
      for (int p = 0; p < size_; ++p) shm_unlink(seg(p).c_str());
    };
    try {
      shm_unlink(seg(rank_).c_str());  // a stale segment of a crashed run must not be reused
      try {
        ptrs[rank_] = map_shm(seg(rank_), mapped, true, "allocate");
      } catch (const std::exception& e) {
        abort(cat("allocate failed on rank ", rank_, ": ", e.what()));
        throw;
      }
      barrier("allocate");
      // A peer's segment of another size (another shape there) is an InvalidArgument on every
      // rank that sees it, raised after the second barrier so that every rank sees it (the peer
      // still maps this rank's segment) and none fails on a name already unlinked.
      std::exception_ptr mismatch;
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        try {
          ptrs[p] = map_shm(seg(p), mapped, false, "allocate");
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kInvalidArgument) throw;
          if (!mismatch) mismatch = std::current_exception();
        }
      }
      barrier("allocate");
      if (mismatch) std::rethrow_exception(mismatch);
    } catch (...) {
      for (void* p : ptrs)
        if (p) munmap(p, mapped);
      unlink_all();
      throw;
    }
    unlink_all();  // every rank mapped every segment: no name is needed any more
    return std::make_shared<ShmSymmetricMemory>(rank_, bytes, mapped, std::move(ptrs));
  }

 private:
  std::string name_;
  uint64_t alloc_seq_ = 0;
};

void check_rank_size(int rank, int size, const char* what) {
  EPX_CHECK_ARG(size >= 1 && size <= kMaxRanks, what, ": argument 'size' is ", size,
                ", expected 1..", kMaxRanks);
  EPX_CHECK_ARG(rank >= 0 && rank < size, what, ": argument 'rank' is ", rank, ", expected 0..",
                size - 1);
}

}  // namespace

std::shared_ptr<Transport> make_cpu_thread_transport(int rank, int size,
                                                     const std::string& world_name,
                                                     std::chrono::milliseconds timeout) {
  return make_thread_transport(rank, size, world_name, timeout, ThreadMemory{},
                               "Group::cpu_threads");
}

std::shared_ptr<Transport> make_thread_transport(int rank, int size, const std::string& world_name,
                                                 std::chrono::milliseconds timeout,
                                                 ThreadMemory memory, const char* what) {
  check_rank_size(rank, size, what);
  std::shared_ptr<ThreadWorld> world;
  {
    std::lock_guard<std::mutex> lock(g_worlds_mutex);
    auto& slot = g_worlds[world_name];
    world = slot.lock();
    if (!world) {
      world = std::make_shared<ThreadWorld>(size);
      slot = world;
    }
  }
  EPX_CHECK_ARG(world->size == size, what, ": argument 'size' is ", size, " but world '",
                world_name, "' was created with size ", world->size);
  auto t = std::make_shared<ThreadTransport>(rank, size, world, timeout, std::move(memory));
  t->barrier(cat(what, " (join)").c_str());
  return t;
}

std::shared_ptr<Transport> make_cpu_process_transport(int rank, int size, const std::string& name,
                                                      std::chrono::milliseconds timeout) {
  check_rank_size(rank, size, "Group::cpu_processes");
  EPX_CHECK_ARG(!name.empty() && name.size() < 200 && name.find('/') == std::string::npos,
                "Group::cpu_processes: argument 'name' is '", name,
                "', expected 1..199 characters without '/'");
  auto t = std::make_shared<ProcessTransport>(rank, size, name, timeout);
  try {
    t->barrier("Group::cpu_processes (join)");
  } catch (...) {
    t->unlink_control();
    throw;
  }
  t->unlink_control();
  return t;
}

void Transport::fill_board(const char* what, uint64_t seq, const std::vector<int64_t>& mine,
                           AllgatherBoard& board) {
  EPX_CHECK(mine.size() <= static_cast<size_t>(kMaxAllgatherWords), ErrorCode::kInternal, what,
            ": allgather of ", mine.size(), " words, at most ", kMaxAllgatherWords);
  board.num_words = static_cast<int64_t>(mine.size());
  std::copy(mine.begin(), mine.end(), board.words);
  std::fill(board.words + mine.size(), board.words + kMaxAllgatherWords, 0);
  board.seq = seq;
}

std::string Transport::read_boards(const char* what, int rank, uint64_t seq,
                                   const std::vector<AllgatherBoard>& boards,
                                   std::vector<std::vector<int64_t>>& out) {
  out.assign(boards.size(), {});
  for (size_t p = 0; p < boards.size(); ++p) {
    const AllgatherBoard& b = boards[p];
    if (b.seq != seq) {
      return cat(what, ": rank ", p, " is not in the same collective call as rank ", rank,
                 " (its last agreement exchange on this group is #", b.seq, ", this rank's #", seq,
                 "); every rank must create the same epx objects and call the same collective "
                 "operations in the same order");
    }
    const int64_t n = std::clamp<int64_t>(b.num_words, 0, kMaxAllgatherWords);
    out[p].assign(b.words, b.words + n);
  }
  return {};
}

void check_symmetric_allocation(size_t bytes) {
  EPX_CHECK(bytes <= kMaxSymmetricBytes, ErrorCode::kOutOfCapacity, "allocate: ", bytes,
            " bytes of symmetric memory per rank, more than the ", kMaxSymmetricBytes,
            " bytes (1 TiB) one allocation may take");
}

void Transport::throw_unsupported_subset(const char* what) {
  throw_error(ErrorCode::kUnsupported,
              cat(what, ": this transport synchronises all ranks of the group only (a barrier or "
                        "resynchronisation over a subset of the ranks is a cpu transport feature)"));
}

}  // namespace epx::detail
