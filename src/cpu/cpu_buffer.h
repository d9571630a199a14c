// src/cpu/cpu_buffer.h — the cpu reference backend behind epx::Buffer.
//
// Every operation is "publish, barrier, pull, barrier" over host shared memory: a rank writes its
// inputs into its own region of the symmetric buffer, waits until every rank has, reads what it
// needs from its peers' regions into its outputs, and waits again so no rank overwrites a region a
// peer may still read. Written the obviously correct way (it is the oracle of the GPU tests), with
// rows moved by memcpy. Streams are ignored: every call is synchronous.
//
// Mode files: ht.cc (ht_layout, ht_dispatch, cpu_ht_bytes; the region in ht_region.h),
// ht_combine.cc, ll.cc (ll_* and cpu_ll_bytes), each owning the layout of its region.
//
// Across nodes (Group::num_nodes() > 1, docs/design.md §13) the same operations run
// hierarchically: a rank's pull reads the ranks of its own node as above, and every other rank's
// data from the chunk the rank of its node with that rank's local index (its "forwarder")
// received over the rail (transport/rail.h). With one node there is no rail and no chunk: the
// pull is the flat one.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "transport/rail.h"
#include "transport/transport.h"

namespace epx::detail {

// The "pull, barrier" half of an operation: runs `pull`, then the closing `barrier()` even when
// `pull` throws, so a rank that fails (a bad argument only the exchange reveals, an allocator
// error) never leaves its peers waiting; rethrows afterwards. Returns what `pull` returns.
template <typename Barrier, typename Pull>
auto pull_then(Barrier&& barrier, Pull&& pull) -> decltype(pull()) {
  using Result = decltype(pull());
  std::exception_ptr error;
  if constexpr (std::is_void_v<Result>) {
    try {
      pull();
    } catch (...) {
      error = std::current_exception();
    }
    barrier();
    if (error) std::rethrow_exception(error);
  } else {
    Result result{};
    try {
      result = pull();
    } catch (...) {
      error = std::current_exception();
    }
    barrier();
    if (error) std::rethrow_exception(error);
    return result;
  }
}
// pull_then with the transport's barrier over every rank, named `what`.
template <typename Pull>
auto pull_then_barrier(Transport& transport, const char* what, Pull&& pull) -> decltype(pull()) {
  return pull_then([&] { transport.barrier(what); }, std::forward<Pull>(pull));
}

// ---- keeping ranks in step (docs/semantics.md §4.3) -------------------------------------------
//
// Every header an operation publishes starts with a Stamp: which call of its mode it is (1, 2, ...
// since the last reset) and the generation (the transport epoch its last reset adopted, the same
// on every rank that took part). A reader pairs only headers whose stamp is its own: a peer at
// another call, or still writing (call 0), is OutOfStep on every rank that sees it, never rows of
// two steps. The stamp is a seqlock: the owner zeroes `call` before writing its payload and sets
// it last (release); a reader re-reads every peer's stamp after copying (acquire fence first), so
// a pull that overlapped a peer's next publication raises instead of returning mixed rows.
struct Stamp {
  std::atomic<uint64_t> call;
  std::atomic<uint64_t> generation;

  void begin_publish() {
    call.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // before any payload byte
  }
  void end_publish(uint64_t gen, uint64_t c) {
    generation.store(gen, std::memory_order_relaxed);
    call.store(c, std::memory_order_release);
  }
  bool is(uint64_t gen, uint64_t c) const {
    return call.load(std::memory_order_acquire) == c &&
           generation.load(std::memory_order_relaxed) == gen;
  }
  std::string describe() const;  // "call #c (generation g)", or "writing its next operation"
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "stamps live in shared memory");

// One mode's side of it on this rank: the generation and call count its stamps carry, and, after
// a Timeout escaped one of its operations, why it refuses every later one until its reset.
struct StepState {
  uint64_t generation = 0;
  uint64_t calls = 0;
  std::string refused;

  // Throws OutOfStep while refused (naming `reset`, the call that ends it); else counts the call.
  uint64_t begin(const char* op, const char* reset) {
    require_in_step(op, reset);
    return ++calls;
  }
  // The same check for the local calls that write memory peers read (zero-copy views).
  void require_in_step(const char* op, const char* reset) const;
  // Called with every error escaping an operation or hook of the mode: a Timeout refuses later
  // operations.
  void failed(const Error& e) {
    if (e.code() == ErrorCode::kTimeout && refused.empty()) refused = e.what();
  }
  // After a successful resync that adopted `epoch`: in step again.
  void reset(uint64_t epoch) {
    generation = epoch;
    calls = 0;
    refused.clear();
  }
};

// The peers' stamps of one operation: OutOfStep naming each peer not at (gen, call), before the
// pull; and after it, OutOfStep if any peer's stamp moved (it published again while this rank
// was reading). `stamp_of(p)` is rank p's published Stamp. Ranks in `skip` (bit p: the ll rank
// mask) are not read.
// The _range forms check ranks [first, last) only (a forwarder's own node).
void check_stamps_range(const char* op, int rank, int first, int last, uint64_t gen, uint64_t call,
                        const std::function<const Stamp&(int)>& stamp_of,
                        const std::function<std::string(int)>& peer_op, uint64_t skip = 0);
void recheck_stamps_range(const char* op, int rank, int first, int last, uint64_t gen,
                          uint64_t call, const std::function<const Stamp&(int)>& stamp_of,
                          uint64_t skip = 0);
inline void check_stamps(const char* op, int rank, int num_ranks, uint64_t gen, uint64_t call,
                         const std::function<const Stamp&(int)>& stamp_of,
                         const std::function<std::string(int)>& peer_op, uint64_t skip = 0) {
  check_stamps_range(op, rank, 0, num_ranks, gen, call, stamp_of, peer_op, skip);
}
inline void recheck_stamps(const char* op, int rank, int num_ranks, uint64_t gen, uint64_t call,
                           const std::function<const Stamp&(int)>& stamp_of, uint64_t skip = 0) {
  recheck_stamps_range(op, rank, 0, num_ranks, gen, call, stamp_of, skip);
}

// ---- across nodes ------------------------------------------------------------------------------
//
// What a chunk says about its sender's part of the operation: code 0, or the error that stopped
// it (a forwarder that could not reduce its node's rows), so every receiver raises it too instead
// of using the chunk's rows.
struct RailStatus {
  int32_t code;  // 0 = ok, else 1 + ErrorCode
  char message[380];

  void set_ok() { code = 0, message[0] = 0; }
  void set(const Error& e);
  // Throws the sender's error (its code; the message names `op`, the sender and its node).
  void raise_if_failed(const char* op, int sender, int node) const;
};

// Raises the failure of the first other node whose forwarder (of `rank`'s local index) failed;
// status_of(m): the status of the partials `rank` received from node m.
void raise_forwarder_errors(const char* op, Topology topology, int rank,
                            const std::function<const RailStatus&(int)>& status_of);

// The next row (`cursor`, then advanced) of the partials a rank received from node m: rows of
// `width` floats, one per token of the rank that went to m, in token order; Internal when node m
// returned fewer than `num_rows`.
const float* next_partial_row(const char* op, int m, int64_t& cursor, int64_t num_rows,
                              const float* rows, int64_t width);

// Runs `body`; an epx::Error escaping it is returned (and its status written into every header of
// `statuses`), so a rank that failed still takes part in the rest of the operation's exchanges.
std::exception_ptr run_noting_error(const std::function<void()>& body,
                                    const std::vector<RailStatus*>& statuses);

// Reusable host memory of a rank's rail chunks: sends packed before an exchange, receives that
// only this rank reads (combine partials). Grown on demand, never shrunk.
struct ChunkScratch {
  std::vector<std::vector<uint8_t>> chunks;  // [N - 1]
  uint8_t* chunk(int i, size_t bytes) {
    if (chunks.size() <= static_cast<size_t>(i)) chunks.resize(i + 1);
    if (chunks[i].size() < bytes) chunks[i].resize(bytes);
    return chunks[i].data();
  }
};

struct CpuLlState;  // defined in ll.cc

// ll.cc's sizes: the ll region (cpu_ll_bytes less the rail's staging) and the rail's chunk.
size_t cpu_ll_region_bytes(const MoeShape& shape, int num_ranks, Topology topology);
size_t cpu_ll_rail_chunk_bytes(const MoeShape& shape, int num_ranks, Topology topology);

class CpuBuffer final : public BufferImpl {
 public:
  CpuBuffer(const Group& group, const MoeShape& shape, const BufferConfig& config, uint64_t id);

  size_t bytes_allocated() const override;
  Device device() const override { return Device::cpu(); }
  void check() override {}

  HtLayout ht_layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) override;
  HtDispatchResult ht_dispatch(const HtDispatchArgs& args, const Allocator& alloc) override;
  HtCombineResult ht_combine(const HtCombineArgs& args, const Allocator& alloc) override;
  TensorView ht_combine_buffer(const HtHandle& handle) const override;

  LlDispatchResult ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) override;
  LlCombineResult ll_combine(const LlCombineArgs& args, const Allocator& alloc) override;
  TensorView ll_next_combine_buffer(const LlHandle& handle) override;
  void ll_clean() override;
  void ll_update_mask(int rank, bool mask, Stream stream) override;
  void ll_query_mask(const TensorView& mask_status, Stream stream) override;
  void ll_clean_mask(Stream stream) override;
  void reset() override;

 private:
  // The collective part of ll_clean and reset: every rank out of its earlier operations.
  uint64_t resync(const char* what);
  void reset_ll_state(uint64_t epoch);

  Transport& transport() const { return *group.transport(); }

  // Across nodes (ht.cc, ht_combine.cc): this rank's chunks for the other nodes over the rail.
  void send_ht_chunks(const HtDispatchArgs& a, uint64_t call);
  void send_ht_partials(const HtCombineArgs& a, uint64_t call, std::vector<uint8_t*>& partials);

  const Topology topology_;
  std::shared_ptr<SymmetricMemory> ht_mem_;  // cpu_ht_bytes(shape, R, N), when enable_ht
  std::shared_ptr<SymmetricMemory> ll_mem_;  // cpu_ll_bytes(shape, R, N), when enable_ll
  std::shared_ptr<CpuLlState> ll_state_;     // owned by ll.cc (created in ll.cc's helpers)
  StepState ht_step_;
  // N > 1: the rails of ht and ll (cpu_ht_rail_chunk_bytes / cpu_ll_rail_chunk_bytes) and the
  // host memory of ht's chunks (ll keeps its own in CpuLlState: hooks hold them).
  std::unique_ptr<RailTransport> ht_rail_;
  std::shared_ptr<RailTransport> ll_rail_;  // held by ll hooks too
  ChunkScratch ht_sends_, ht_recvs_;
};

}  // namespace epx::detail
