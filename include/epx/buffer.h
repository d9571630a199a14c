// epx/buffer.h — communication buffer for the ht and ll modes (DeepEP-style).
//
// A Buffer is created collectively by every rank of a Group with the same MoeShape. It allocates
// symmetric memory sized from the shape (never from a user guess): Buffer::bytes_needed() says how
// much each mode takes. All operations are collective unless marked local: every rank must call
// the same operations in the same order. Operations run on the given stream (cuda) and never
// synchronise the device behind the caller's back, except where a method says it waits on the
// host. On the cpu backend every operation runs synchronously on the calling thread.
//
// Errors (epx::Error): a rank's bad arguments are rejected before it communicates
// (InvalidArgument, or OutOfCapacity for T > max_tokens_per_rank); its peers, left waiting, raise
// Timeout naming it once the group's timeout expires. Arguments that only the exchange shows to
// disagree across ranks (dtypes, weights given on some ranks only, num_worst_tokens,
// expert_alignment, zero_copy, use_fp8 / round_scale, handles of different dispatches, ranks
// calling different operations) make every rank raise InvalidArgument naming them with each
// rank's value (docs/semantics.md §4.2); a rank that fails after the exchange still takes part
// in the operation's last synchronisation, so its peers complete.
//
// Thread-safety: a Buffer is used by one host thread at a time.
#pragma once

#include <cstddef>
#include <memory>

#include "epx/group.h"
#include "epx/ht.h"
#include "epx/ll.h"
#include "epx/shape.h"
#include "epx/tensor.h"

namespace epx {

namespace detail {
class BufferImpl;
}

struct BufferConfig {
  bool enable_ht = true;
  bool enable_ll = false;
  // ll rank masks (DeepEP's enable_shrink; docs/semantics.md §2.6): every rank keeps a mask of
  // the ranks its ll operations skip, and an ll wait for a peer that does not arrive within the
  // group's timeout masks that peer and completes without it instead of raising Timeout. Needs
  // enable_ll and one node (else InvalidArgument / Unsupported); compared across the ranks.
  bool enable_shrink = false;
};

class Buffer {
 public:
  // Collective. First compares the shape and config across the ranks (one small exchange; a
  // difference is InvalidArgument on every rank naming each field and every rank's value, before
  // anything is allocated), then validates them against the group (E % R == 0, ...) and allocates.
  Buffer(const Group& group, const MoeShape& shape, const BufferConfig& config = {});
  ~Buffer();
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;

  // Symmetric bytes per rank that `mode` (kHt or kLl) needs for `shape` on `num_ranks` ranks of
  // `backend`, in nodes of `ranks_per_node` ranks (GroupOptions::ranks_per_node; 0 = one node;
  // more than one node adds the cpu backend's rail chunks and is Unsupported on cuda).
  static size_t bytes_needed(Mode mode, const MoeShape& shape, int num_ranks, Backend backend,
                             int ranks_per_node = 0);
  // Symmetric bytes per rank this buffer allocated, all modes together.
  size_t bytes_allocated() const;

  const Group& group() const;
  const MoeShape& shape() const;
  Device device() const;  // cpu, or the group's GPU
  uint64_t id() const;    // unique per buffer within a process

  // Raises a pending asynchronous error (device timeout, out-of-range expert id, worst-case
  // overflow) recorded by an earlier operation. Local; cuda waits for nothing. The cpu backend
  // raises every error from the call that hit it, so there check() does nothing.
  void check() const;

  // ---- ht ----------------------------------------------------------------------------------
  // Local (no communication). topk_idx [T, K] int64/int32.
  HtLayout ht_layout(const TensorView& topk_idx, Stream stream = nullptr,
                     const Allocator& allocator = default_allocator()) const;
  // Collective. Exact mode waits on the host once to learn N (the count exchange); worst-case
  // and cached modes do not.
  HtDispatchResult ht_dispatch(const HtDispatchArgs& args,
                               const Allocator& allocator = default_allocator());
  // Collective.
  HtCombineResult ht_combine(const HtCombineArgs& args,
                             const Allocator& allocator = default_allocator());
  // Local. The bf16 [rows, H] view (rows of `handle`'s dispatch, contiguous) to write the expert
  // outputs into before ht_combine(zero_copy = true) with this handle. It is buffer memory that
  // the ht operations also use: write it after the last read of the dispatch's outputs that are
  // views (a zero-copy recv_x shares it: an in-place y is fine, e.g. y = recv_x for bf16), and
  // only between a dispatch and its combine. Lives as long as the buffer.
  TensorView ht_combine_buffer(const HtHandle& handle);

  // ---- ll ----------------------------------------------------------------------------------
  // Double buffering: dispatches alternate between two slots (LlHandle::slot) and a combine uses
  // its handle's slot. With hooks, at most two dispatches may wait for their hooks (a third
  // raises InvalidArgument) and at most one combine per slot; every rank calls the same
  // operations and hooks in the same order (else every rank raises InvalidArgument).
  //
  // Collective; needs BufferConfig::enable_ll.
  LlDispatchResult ll_dispatch(const LlDispatchArgs& args,
                               const Allocator& allocator = default_allocator());
  // Collective. A combine through a slot whose previous combine still waits for its hook raises
  // InvalidArgument.
  LlCombineResult ll_combine(const LlCombineArgs& args,
                             const Allocator& allocator = default_allocator());
  // Local. The bf16 [L, R*T_max, H] view to write expert outputs into before
  // ll_combine(zero_copy = true) with this handle. It is the combine memory of handle.slot, the
  // same for every handle of that slot (dispatches two apart): write it for one handle at a
  // time, once the previous combine through the slot has finished (InvalidArgument while that
  // combine still waits for its hook). It lives as long as the buffer.
  TensorView ll_next_combine_buffer(const LlHandle& handle);
  // Collective. Resets ll state (after ht used the memory, or after an error). Operations still
  // waiting for their hooks are discarded: calling such a hook afterwards raises InvalidArgument.
  // After a Timeout in ll, ll operations raise OutOfStep until every rank called this (or
  // reset()). Each rank waits up to twice the group's timeout for the others (docs/semantics.md
  // §4.3). With enable_shrink: collective over the ranks this rank does not mask; a rank that
  // does not arrive within the group's timeout is masked instead (no Timeout); it is also where
  // ranks that were unmasked take part again (docs/semantics.md §2.6).
  void ll_clean();

  // ---- ll rank masks (BufferConfig::enable_shrink, else InvalidArgument; DeepEP's
  // low_latency_{update,query,clean}_mask_buffer; docs/semantics.md §2.6) ----------------------
  // Each rank has its own mask: its ll operations neither send to nor wait for a rank it masks;
  // that rank's tokens are absent from its dispatches (recv_count, layout_range, src_info as if
  // the rank had no tokens for this rank's experts) and its experts' terms are left out of its
  // combines (as if those topk_idx entries were -1). Its waits mask the peers they time out on.
  // All three are local and stream-ordered on `stream` (cuda: one small kernel, capturable; a
  // captured ll operation reads the mask at replay); the cpu backend applies them at once.
  //
  // [IN] rank in [0, R), mask: true masks it, false unmasks it. This rank cannot mask itself
  // (InvalidArgument). An unmasked rank takes part again once every rank that takes part called
  // ll_clean() after unmasking it (it resets every flag the ranks count; without it the next wait
  // for that rank may time out and mask it again).
  void ll_update_mask(int rank, bool mask, Stream stream = nullptr);
  // [OUT] mask_status: int32 [R] (any stride) on the buffer's device; element p = 1 when this rank
  // masks rank p (by ll_update_mask or after a wait for it timed out), else 0.
  void ll_query_mask(const TensorView& mask_status, Stream stream = nullptr) const;
  // Unmasks every rank (see ll_update_mask for taking part again).
  void ll_clean_mask(Stream stream = nullptr);
  // Collective. After a Timeout in ht or ll, that mode's operations raise OutOfStep until every
  // rank called this: it waits (up to twice the group's timeout) until every rank is out of its
  // earlier operations and here, then resets both modes as ll_clean() resets ll. A Timeout from
  // reset() itself leaves the buffer refusing: call it again on every rank.
  void reset();

  // Internal.
  detail::BufferImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<detail::BufferImpl> impl_;
};

}  // namespace epx
