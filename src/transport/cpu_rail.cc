// src/transport/cpu_rail.cc — the cpu rail (rail.h): the network leg of the hierarchical
// algorithms over the cpu transport's shared memory.
//
// Staging, one symmetric allocation per rail (cpu_rail_bytes), on rank (n, g):
//   slot i, i = Topology::other_index(m, n) for every other node m (N - 1 slots):
//     SlotHeader {seq (seqlock), bytes}   then max_chunk_bytes of data: what (n, g) sends to (m, g)
// exchange #s on (n, g), in the order of plan_rail_exchange (which checks the chunks): for each
// send to m: seq = 0, copy, bytes, seq = s (release); barrier; for each receive from m: the
// partner (m, g)'s slot other_index(n, m) must carry seq = s and the receive's size; copy;
// re-read seq (a partner that moved on while this rank copied is OutOfStep); barrier (no slot
// is rewritten before every partner copied it). Errors found after
// the first barrier are raised after the second, so partners never wait for a rank that failed.
#include <atomic>
#include <cstring>
#include <exception>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "transport/rail.h"
#include "transport/transport.h"

namespace epx::detail {
namespace {

struct SlotHeader {
  std::atomic<uint64_t> seq;  // the exchange that wrote the slot; 0 while it is written
  uint64_t bytes;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "slots live in shared memory");

constexpr size_t kSlotData = 64;  // data offset inside a slot

size_t slot_bytes(size_t max_chunk_bytes) {
  return kSlotData + align_up(max_chunk_bytes, 64);
}

class CpuRail final : public RailTransport {
 public:
  CpuRail(std::shared_ptr<Transport> transport, Topology topology, size_t max_chunk_bytes)
      : transport_(std::move(transport)),
        topology_(topology),
        max_chunk_bytes_(max_chunk_bytes),
        mem_(transport_->allocate(cpu_rail_bytes(topology, max_chunk_bytes))) {}

  size_t max_chunk_bytes() const override { return max_chunk_bytes_; }
  size_t bytes_allocated() const override { return mem_->bytes(); }
  void reset() override {
    exchanges_ = 0;
    for (int i = 0; i + 1 < topology_.num_nodes; ++i)
      slot(transport_->rank(), i)->seq.store(0, std::memory_order_release);
  }

  void abort() override {}  // see RailTransport::abort

  void exchange(const char* what, const std::vector<RailChunk>& sends,
                const std::vector<RailChunk>& recvs, Stream) override {
    const int me = transport_->rank(), node = topology_.node_of(me);
    const std::vector<RailOp> ops =
        plan_rail_exchange(what, topology_, me, sends, recvs, max_chunk_bytes_);
    const uint64_t seq = ++exchanges_;
    for (const RailOp& op : ops) {
      if (!op.send) continue;
      SlotHeader* h = slot(me, Topology::other_index(op.node, node));
      h->seq.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // before any data byte
      std::memcpy(reinterpret_cast<char*>(h) + kSlotData, op.data, op.bytes);
      h->bytes = op.bytes;
      h->seq.store(seq, std::memory_order_release);
    }
    transport_->barrier(what);
    std::exception_ptr error;
    try {
      for (const RailOp& op : ops) {
        if (op.send) continue;
        const SlotHeader* h = slot(op.peer, Topology::other_index(node, op.node));
        check_slot(what, *h, seq, op);
        std::memcpy(op.data, reinterpret_cast<const char*>(h) + kSlotData, op.bytes);
        std::atomic_thread_fence(std::memory_order_acquire);  // the copy before the re-read
        check_slot(what, *h, seq, op);
      }
    } catch (...) {
      error = std::current_exception();
    }
    transport_->barrier(what);
    if (error) std::rethrow_exception(error);
  }

 private:
  SlotHeader* slot(int rank, int index) const {
    return reinterpret_cast<SlotHeader*>(static_cast<char*>(mem_->peer(rank)) +
                                         static_cast<size_t>(index) * slot_bytes(max_chunk_bytes_));
  }

  static void check_slot(const char* what, const SlotHeader& h, uint64_t seq, const RailOp& op) {
    const uint64_t got = h.seq.load(std::memory_order_acquire);
    EPX_CHECK(got == seq, ErrorCode::kOutOfStep, what, ": rank ", op.peer, " (node ", op.node,
              ") is at rail exchange #", got, " while this rank is at #", seq,
              " (ranks out of step); expected every rank at the same exchange");
    EPX_CHECK(h.bytes == op.bytes, ErrorCode::kInternal, what, ": rank ", op.peer, " sent ",
              h.bytes, " bytes over the rail, this rank expected ", op.bytes);
  }

  std::shared_ptr<Transport> transport_;
  Topology topology_;
  size_t max_chunk_bytes_;
  std::shared_ptr<SymmetricMemory> mem_;
  uint64_t exchanges_ = 0;
};

}  // namespace

size_t cpu_rail_bytes(Topology topology, size_t max_chunk_bytes) {
  return static_cast<size_t>(topology.num_nodes - 1) * slot_bytes(max_chunk_bytes);
}

std::unique_ptr<RailTransport> make_cpu_rail(std::shared_ptr<Transport> transport,
                                             Topology topology, size_t max_chunk_bytes) {
  return std::make_unique<CpuRail>(std::move(transport), topology, max_chunk_bytes);
}

}  // namespace epx::detail
