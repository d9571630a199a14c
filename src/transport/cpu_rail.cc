// src/transport/cpu_rail.cc — the cpu rail (rail.h): the network leg of the hierarchical
// algorithms over the cpu transport's shared memory.
//
// Staging, one symmetric allocation per rail (cpu_rail_bytes), on rank (n, g):
//   slot i, i = Topology::other_index(m, n) for every other node m (N - 1 slots):
//     SlotHeader {seq (seqlock), bytes}   then max_chunk_bytes of data: what (n, g) sends to (m, g)
// exchange #s on (n, g): for each send to m: seq = 0, copy, bytes, seq = s (release); barrier;
// for each receive from m: the partner (m, g)'s slot other_index(n, m) must carry seq = s and the
// receive's size; copy; re-read seq (a partner that moved on while this rank copied is
// OutOfStep); barrier (no slot is rewritten before every partner copied it). Errors found after
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

  void exchange(const char* what, const std::vector<RailChunk>& sends,
                const std::vector<RailChunk>& recvs, Stream) override {
    const uint64_t seq = ++exchanges_;
    const int me = transport_->rank(), node = topology_.node_of(me);
    const int local = topology_.local_of(me);
    for (const RailChunk& c : sends) {
      check_chunk(what, c, "send");
      SlotHeader* h = slot(me, Topology::other_index(c.node, node));
      h->seq.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // before any data byte
      std::memcpy(reinterpret_cast<char*>(h) + kSlotData, c.data, c.bytes);
      h->bytes = c.bytes;
      h->seq.store(seq, std::memory_order_release);
    }
    transport_->barrier(what);
    std::exception_ptr error;
    try {
      for (const RailChunk& c : recvs) {
        check_chunk(what, c, "receive");
        const int partner = topology_.rank_of(c.node, local);
        const SlotHeader* h = slot(partner, Topology::other_index(node, c.node));
        check_slot(what, *h, seq, partner, c);
        std::memcpy(c.data, reinterpret_cast<const char*>(h) + kSlotData, c.bytes);
        std::atomic_thread_fence(std::memory_order_acquire);  // the copy before the re-read
        check_slot(what, *h, seq, partner, c);
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

  void check_chunk(const char* what, const RailChunk& c, const char* side) const {
    const int node = topology_.node_of(transport_->rank());
    EPX_CHECK(c.node >= 0 && c.node < topology_.num_nodes && c.node != node &&
                  c.bytes <= max_chunk_bytes_,
              ErrorCode::kInternal, what, ": rail ", side, " with node ", c.node, " of ", c.bytes,
              " bytes, expected another node of ", topology_.num_nodes, " and at most ",
              max_chunk_bytes_, " bytes");
  }

  static void check_slot(const char* what, const SlotHeader& h, uint64_t seq, int partner,
                         const RailChunk& c) {
    const uint64_t got = h.seq.load(std::memory_order_acquire);
    EPX_CHECK(got == seq, ErrorCode::kOutOfStep, what, ": rank ", partner, " (node ", c.node,
              ") is at rail exchange #", got, " while this rank is at #", seq,
              " (ranks out of step); expected every rank at the same exchange");
    EPX_CHECK(h.bytes == c.bytes, ErrorCode::kInternal, what, ": rank ", partner, " sent ", h.bytes,
              " bytes over the rail, this rank expected ", c.bytes);
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
