// src/cpu/ll_region.h — the ll region of the cpu backend and what ll.cc (state, dispatch,
// clean) and ll_combine.cc share. The data flow and the exact semantics are in the comment of
// ll.cc.
//
// Region of one rank (cpu_ll_region_bytes; every offset a multiple of 64 bytes; N nodes of G
// ranks, T_max = max_tokens_per_rank):
//   dispatch slot 0, dispatch slot 1:
//     DispatchHeader                 {stamp, num_tokens, use_fp8, round_scale, use_nvfp4,
//                                     global_scale_bits, published_ns}
//     topk   int32 [T_max, K]
//     msgs   [T_max, msg_bytes]      msg_bytes = max(2 H, H + 4 G) rounded up to 16 (>= the
//                                    NVFP4 message's 9 H / 16)
//     rail   N > 1: N - 1 dispatch chunks received over the rail (slot other_index(m, n)), laid
//            out as the slot above (LlChunkHeader in place of the header, so a source's topk and
//            messages sit at the same offsets in both) followed by src_idx int32 [T_max]
//   combine slot 0, combine slot 1:
//     CombineHeader                  {stamp, published_ns, use_logfmt, overlap}
//     layout int64 [L, R]            the expert rank's handle.layout_range
//     meta   uint32 [L, RT, G]       use_logfmt: the rows' LogFMT meta words
//     y      bf16  [L, RT, H]        the view ll_next_combine_buffer returns (use_logfmt: the
//                                    encoded rows, each in its own 2H-byte slot)
// Host memory of the combine's rail legs (CpuLlState; nobody else reads it), capacity T_max rows:
//   forward chunk (source (m, g) -> forwarder (n, g)): LlForwardHeader {num_rows} | topk int32
//     [T_max, K] | weights f32 [T_max, K]: the source's tokens that select an expert of node n,
//     ascending (their order gives each token's row j in an expert's block of that source)
//   partial chunk (forwarder -> source): LlPartialHeader {RailStatus, num_rows} | headers
//     CombineHeader [G] (node n's) | partial f32 [T_max, H]
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/numeric.h"
#include "cpu/cpu_buffer.h"

namespace epx::detail {

inline constexpr size_t kLlAlign = 64;  // every section offset
inline constexpr const char* kLlReset = "ll_clean() or reset()";

struct DispatchHeader {
  Stamp stamp;  // call = the dispatch's sequence number, 1, 2, ... since the last reset
  int64_t num_tokens;
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_nvfp4;
  uint32_t global_scale_bits;  // use_nvfp4: the bits of the float32 global scale g, else 0
  int64_t published_ns;        // steady_ns() when the publication ended (wait-cost statistics)
  // enable_shrink: the ranks the publisher masks (bit p); atomic: read before the stamp is
  // checked (mask_maskers), also while the publisher rewrites the header.
  std::atomic<uint64_t> masked;
};

struct CombineHeader {
  Stamp stamp;  // call = the combine's sequence number
  int64_t published_ns;
  int32_t use_logfmt;  // compared by every receive (across nodes: in the partials' headers)
  int32_t overlap;     // LlCombineArgs::overlap given; compared the same way
  std::atomic<uint64_t> masked;  // as DispatchHeader::masked
};

struct LlChunkHeader {
  DispatchHeader source;  // the source's header (its stamp set to the dispatch)
  int64_t num_rows;
};

struct LlForwardHeader {
  int64_t num_rows;
};

struct LlPartialHeader {
  RailStatus status;
  int64_t num_rows;
};

// Per-buffer ll state, local to each rank (equal on all ranks that follow the same sequence).
struct CpuLlState {
  uint64_t num_dispatches = 0;                  // sequence number of the last dispatch
  uint64_t num_combines = 0;                    // sequence number of the last combine
  uint64_t generation = 0;                      // bumped by ll_clean; older hooks refuse to run
  bool dispatch_in_flight[2] = {false, false};  // published, hook not called yet
  bool combine_in_flight[2] = {false, false};
  StepState step;  // stamps' generation; refusal after a Timeout (its call count is unused)
  // BufferConfig::enable_shrink and this rank's mask (bit p = rank p; docs/semantics.md §2.6):
  // set by ll_update_mask / ll_clean_mask, and by the ll barriers (ll_barrier) and the headers
  // of ranks that mask this one (mask_maskers).
  bool shrink = false;
  uint64_t masked = 0;
  // N > 1: the host memory of the rail's chunks, used inside a receive half only (the cpu rail is
  // collective and synchronous, so the receive half, not the send half, packs and exchanges; one
  // receive half runs at a time).
  ChunkScratch rail_sends, rail_recvs;
};

// The steady clock in nanoseconds (CLOCK_MONOTONIC on Linux: comparable across the threads and
// processes of one host, which is where the cpu backend's ranks are).
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Adds max(0, published_ns(s) - recv_start) to stats[s] for every source s (stats: int64 [R],
// contiguous, validated).
void add_wait_costs(const TensorView& stats, const std::vector<int64_t>& published_ns,
                    int64_t recv_start);

// The ll region of one rank and the rail's chunks: used for sizing and for every pointer.
struct LlLayout {
  int num_ranks, num_local_experts, top_k;
  Topology topology;
  int64_t max_tokens, hidden, num_groups, rows_per_expert;
  size_t msg_bytes, topk_off, msgs_off, own_bytes, dispatch_slot_bytes;
  size_t chunk_src_off, chunk_bytes;                            // a dispatch chunk
  size_t forward_topk_off, forward_weights_off, forward_bytes;  // a forward chunk
  size_t partial_headers_off, partial_off, partial_bytes;       // a partial chunk
  size_t layout_off, meta_off, y_off, combine_slot_bytes;

  LlLayout(const MoeShape& s, int R, Topology topology);
  size_t dispatch_off(int slot) const { return slot * dispatch_slot_bytes; }
  size_t chunk_off(int slot, int other_index) const {
    return dispatch_off(slot) + own_bytes + other_index * chunk_bytes;
  }
  size_t combine_off(int slot) const { return 2 * dispatch_slot_bytes + slot * combine_slot_bytes; }
  size_t total_bytes() const { return 2 * dispatch_slot_bytes + 2 * combine_slot_bytes; }
  size_t rail_chunk_bytes() const { return std::max({chunk_bytes, forward_bytes, partial_bytes}); }
};

CpuLlState& state_of(std::shared_ptr<CpuLlState>& p);

// The barriers of the ll receive halves and of ll_clean (docs/semantics.md §2.6): over every
// rank; with enable_shrink over the ranks `st` does not mask, and a rank that does not arrive
// within `timeout_multiple` times the group's timeout is masked instead of raising Timeout.
// Returns the ranks it masked.
uint64_t ll_barrier(Transport& transport, CpuLlState& st, const char* what,
                    int timeout_multiple = 1);
// With enable_shrink, before the stamps are checked: masks every unmasked rank p != `rank` whose
// header says it masks `rank` (masked_of(p), its published mask), as the cuda backend's waits for
// such a rank would after a timeout. Such a rank does not wait for this one, so it may already
// be rewriting its header: its stamp is not checked, its rows not read. Returns st.masked.
uint64_t mask_maskers(CpuLlState& st, int rank, int num_ranks,
                      const std::function<uint64_t(int)>& masked_of);

// What the receive half of a dispatch or a combine needs of the buffer (copied into its hook).
struct LlReceive {
  std::shared_ptr<Transport> transport;
  std::shared_ptr<SymmetricMemory> mem;
  std::shared_ptr<RailTransport> rail;  // N > 1
  std::shared_ptr<CpuLlState> st;
  LlLayout lay;
  int slot;
  uint64_t generation, seq;
};

// Runs the receive half now (returns no hook), or marks its slot in flight and returns it wrapped
// as the caller's hook: callable once only, not after ll_clean, and freeing the slot whatever
// happens.
LlHook receive_or_hook(const std::shared_ptr<CpuLlState>& st, bool is_dispatch, int slot,
                       bool return_recv_hook, std::function<void()> receive);

}  // namespace epx::detail
