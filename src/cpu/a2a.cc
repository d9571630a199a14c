// src/cpu/a2a.cc — the cpu reference backend of the a2a mode (docs/semantics.md §3): CpuA2a,
// make_cpu_a2a, cpu_a2a_bytes. Written the obviously correct way; it is the oracle of the cuda
// backend.
//
// Notation: R ranks, this rank r, T tokens here, K = top_k, E experts, L = E / R local experts,
// M = runtime_max_tokens_per_rank of the call (equal on every rank), P payloads,
// row_bytes_i = bytes per token of payload i in this call (<= payload_bytes_per_token[i]),
// max = max_tokens_per_rank, hb = H * element size of the combine payload.
//
// Workspace (one symmetric allocation of cpu_a2a_bytes per rank; every region starts on a
// kRegionAlign boundary; "publish" regions are written by their owner and read by peers):
//   header            CpuA2aHeader                   publish: the A2aShape (checked equal on all
//                                                    ranks at construction), T, M, row_bytes_i,
//                                                    combine H/dtype
//   send_mask         uint64 [max]                   publish: bit d of token t = t goes to rank d
//   send_payload_i    [max, payload_bytes_per_token_i]  publish: this rank's payload i, rows
//                                                    packed at row_bytes_i (i = 0..P-1)
//   recv_counts       int32 [R]                      recv_counts[s] = tokens rank s sent here
//   recv_payload_i    [R, M, row_bytes_i] contiguous for the M of the call (capacity
//                                                    R * max * payload_bytes_per_token_i)
//   combine           [R, M, hb] contiguous (capacity R * max * combine_bytes_per_token):
//                                                    y of this rank; combine_payload_view
// Bytes per rank = R * max * (D + C) + max * (D + 8) + R * 4 + header + alignment, with
// D = sum_i payload_bytes_per_token_i and C = combine_bytes_per_token. FlashInfer's
// moe_a2a_get_workspace_size_per_rank(R, max, D, C) is about R * max * (D + C) plus small
// auxiliary state; this layout adds the publish copy of the inputs, max * (D + 8) bytes (a
// fraction 1/R of the dispatch part), because the pull design reads the inputs from peers'
// memory. A push design (the cuda backend: each sender writes straight into the receiver's
// recv_payload rows) does not need it.
//
// dispatch (publish / barrier / pull / barrier):
//   1. publish: header {T, M, row_bytes}, send_mask[t] = OR over k with topk_idx[t][k] >= 0 of
//      bit (topk_idx[t][k] / L) — a token goes to each distinct rank once, however many of its
//      experts live there; send_payload_i = payload_i (one memcpy of T * row_bytes_i).
//      slot_d(t) = number of tokens t' < t with bit d set (kept on the host for combine).
//   2. barrier; every rank checks that M and every row_bytes_i equal rank 0's (InvalidArgument on
//      every rank, after one more barrier, otherwise).
//   3. pull, for s = 0..R-1: j = 0; for t = 0..T_s-1 in ascending order with bit r of
//      peer s's send_mask[t]: row [s][j] of recv_payload_i = peer s's send_payload_i row t
//      (memcpy), j++. recv_counts[s] = j. Padding rows j in [recv_counts[s], M): the expert-id
//      payload gets invalid_expert_id in all K entries when invalid_expert_id is given; every
//      other padding row (and the expert-id payload's without invalid_expert_id) is ZEROED by
//      this backend (docs/semantics.md §3.2 leaves them unspecified; the cuda backend need not
//      zero them).
//   4. barrier (no peer reads our publish regions any more; next dispatch may overwrite them).
//   Views: recv_i = [R, M, payload_i.shape[1:]...] (payload_i's dtype) at recv_payload_i;
//   recv_counts = int32 [R]. Valid until the next dispatch.
//
// combine (publish / barrier / pull / barrier), y [R, M, H] bf16, f16 or f32, out [T, H] its dtype:
//   1. unless payload_in_workspace (y already is the combine region), copy y into the combine
//      region [R, M, hb]; header {H, dtype}.
//   2. barrier; every rank checks H and dtype equal rank 0's (as in dispatch).
//   3. pull, EXACT ORDER (the cuda backend must reproduce it bit for bit):
//        for each token t, each h:
//          float acc = 0.0f;
//          for d = 0, 1, ..., R-1 (ascending), only where t went to d:
//            acc += float(y_d[r][slot_d(t)][h]);   // y_d = rank d's combine region
//          out[t][h] = round(acc) to dtype(y): f32_to_bf16, f32_to_f16 or acc;  // one rounding
//      Tokens that went nowhere get +0.0. out comes from the caller's allocator.
//   4. barrier (peers no longer read our combine region; the MoE kernel may write it again).
//
// Rank mask (set_active_ranks; A = the active ranks, this rank included): step 1 keeps only the
// bits of active ranks in send_mask[t] (selections of inactive ranks count as dropped:
// dropped_selections += each, dropped_tokens += 1 when a token had valid selections but keeps no
// bit); every barrier and every agreement runs over A only (the reference value is the lowest
// active rank's); step 3 pulls from active s only: recv_counts[s] = 0 and every row is padding
// for an inactive s. Combine reads only active ranks' regions (slots exist only for them).
// set_active_ranks: publish the mask in the header -> transport resync over A (the barrier
// generations of the members may differ after a Timeout) -> every member compares the masks
// the members published (InvalidArgument on a difference) -> barrier over A.
//
// T = 0 works (empty publish, all rows padding, out [0, H]). Streams are ignored: synchronous.
// An unexpected local failure inside a collective aborts the transport so peers stop with an
// error instead of waiting for the timeout.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/numeric.h"
#include "transport/transport.h"

namespace epx::detail {
namespace {

constexpr size_t kRegionAlign = 256;

// Published by each rank; read by peers between the two barriers of an operation.
struct CpuA2aHeader {
  int64_t shape[4 + kMaxA2aPayloads];  // construction: the A2aShape (see shape_fields)
  int64_t num_tokens;                  // dispatch: T
  int64_t runtime_max;                 // dispatch: M
  int64_t row_bytes[kMaxA2aPayloads];  // dispatch: bytes per token of each payload
  int64_t combine_hidden;              // combine: H
  int64_t combine_dtype;               // combine: DType of y
  uint64_t active_mask;                // set_active_ranks: the mask this rank applies
};

constexpr const char* kShapeFieldNames[] = {"max_tokens_per_rank", "top_k", "num_experts",
                                            "combine_bytes_per_token", "payload_bytes_per_token"};

// The A2aShape as the numbers every rank must agree on (unused payload entries are 0).
std::vector<int64_t> shape_fields(const A2aShape& s) {
  std::vector<int64_t> f = {s.max_tokens_per_rank, s.top_k, s.num_experts,
                            static_cast<int64_t>(s.combine_bytes_per_token)};
  for (int i = 0; i < kMaxA2aPayloads; ++i)
    f.push_back(i < static_cast<int>(s.payload_bytes_per_token.size())
                    ? static_cast<int64_t>(s.payload_bytes_per_token[i])
                    : 0);
  return f;
}

// Offsets of every region; used both to size the workspace and to address it.
struct CpuA2aLayout {
  CpuA2aLayout(const A2aShape& s, int num_ranks) {
    const size_t R = static_cast<size_t>(num_ranks);
    const size_t max = static_cast<size_t>(s.max_tokens_per_rank);
    size_t off = 0;
    header = off;
    off += align_up(sizeof(CpuA2aHeader), kRegionAlign);
    send_mask = off;
    off += align_up(max * sizeof(uint64_t), kRegionAlign);
    for (size_t i = 0; i < s.payload_bytes_per_token.size(); ++i) {
      send_payload[i] = off;
      off += align_up(max * s.payload_bytes_per_token[i], kRegionAlign);
    }
    recv_counts = off;
    off += align_up(R * sizeof(int32_t), kRegionAlign);
    for (size_t i = 0; i < s.payload_bytes_per_token.size(); ++i) {
      recv_payload[i] = off;
      off += align_up(R * max * s.payload_bytes_per_token[i], kRegionAlign);
    }
    combine = off;
    off += align_up(R * max * s.combine_bytes_per_token, kRegionAlign);
    total_bytes = off;
  }
  size_t header = 0, send_mask = 0, recv_counts = 0, combine = 0, total_bytes = 0;
  size_t send_payload[kMaxA2aPayloads] = {}, recv_payload[kMaxA2aPayloads] = {};
};

class CpuA2a final : public A2aImpl {
 public:
  CpuA2a(const Group& group, const A2aShape& shape)
      : A2aImpl(group, shape), layout_(shape, group.size()) {
    mem_ = transport().allocate(layout_.total_bytes);
    // Every rank must have built the same layout: publish the shape and compare (the header sits
    // at offset 0, inside every peer's allocation whatever its size).
    std::vector<int64_t> fields = shape_fields(shape);
    std::copy(fields.begin(), fields.end(), header(group.rank())->shape);
    transport().barrier("A2a (publish shape)");
    for (size_t f = 0; f < fields.size(); ++f)
      agree("A2a",
            cat("A2aShape field ", kShapeFieldNames[f < 4 ? f : 4],
                f < 4 ? std::string() : cat("[", f - 4, "]")),
            [f](const CpuA2aHeader& h) { return h.shape[f]; });
    transport().barrier("A2a (check shape)");
  }

  size_t bytes_allocated() const override { return mem_->bytes(); }
  void check() override {}
  void set_active_ranks(uint64_t active_mask, Stream stream) override;
  A2aDropCounts dropped_counts() override { return dropped_; }
  void reset_dropped_counts(Stream /*stream*/) override { dropped_ = {}; }

  A2aDispatchResult dispatch(const A2aDispatchArgs& args) override;
  TensorView combine_payload_view(int64_t runtime_max, int64_t hidden, DType dtype) override {
    return TensorView::contiguous(local(layout_.combine), dtype,
                                  {group.size(), runtime_max, hidden});
  }
  Tensor combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace, Stream stream,
                 const Allocator& alloc) override;

 private:
  Transport& transport() const { return *group.transport(); }
  bool is_active(int p) const { return (active_mask >> p) & 1; }
  void barrier(const char* what) const { transport().barrier(what, active_mask); }
  uint8_t* local(size_t offset) const { return static_cast<uint8_t*>(mem_->local()) + offset; }
  uint8_t* peer(int rank, size_t offset) const {
    return static_cast<uint8_t*>(mem_->peer(rank)) + offset;
  }
  CpuA2aHeader* header(int rank) const {
    return reinterpret_cast<CpuA2aHeader*>(peer(rank, layout_.header));
  }
  // Every rank compares rank 0's published value with every peer's, so all ranks reach the same
  // verdict; on a mismatch they meet once more (nobody may rewrite a header another rank still
  // reads) and all throw InvalidArgument.
  template <typename Get, typename Show>
  void agree(const char* op, const std::string& what, Get get, Show show);
  template <typename Get>
  void agree(const char* op, const std::string& what, Get get) {
    agree(op, what, get, [](int64_t v) { return std::to_string(v); });
  }
  // Runs `f`; on an exception that peers cannot see, aborts the group first so they stop.
  template <typename F>
  void collective_local(const char* op, F&& f);

  CpuA2aLayout layout_;
  std::shared_ptr<SymmetricMemory> mem_;
  // Routing of the last dispatch: T, and slot_d(t) = slots_[t * R + d] (-1: t did not go to d).
  int64_t num_tokens_ = 0;
  std::vector<int32_t> slots_;
  A2aDropCounts dropped_;
};

template <typename F>
void CpuA2a::collective_local(const char* op, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    transport().abort(cat(op, " failed on rank ", group.rank(), ": ", e.what()));
    throw;
  }
}

template <typename Get, typename Show>
void CpuA2a::agree(const char* op, const std::string& what, Get get, Show show) {
  int ref = 0;  // the lowest active rank
  while (!is_active(ref)) ++ref;
  const int64_t want = get(*header(ref));
  for (int p = ref + 1; p < group.size(); ++p) {
    if (!is_active(p)) continue;
    const int64_t got = get(*header(p));
    if (got == want) continue;
    barrier(op);
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": ", what, " differs across ranks: rank ", ref, " has ", show(want),
                    ", rank ", p, " has ", show(got), "; expected the same value on every ",
                    active_mask != all_ranks_mask(group.size()) ? "active rank" : "rank"));
  }
}

void CpuA2a::set_active_ranks(uint64_t mask, Stream /*stream*/) {
  const char* op = "a2a set_active_ranks";
  // Atomic: a member whose mask differs may rewrite its own at its next call while this one
  // still reads it (ordered by nothing else; the transport's counters order the other fields).
  std::atomic_ref<uint64_t>(header(group.rank())->active_mask)
      .store(mask, std::memory_order_release);
  transport().resync(op, mask, 2 * group.timeout());
  active_mask = mask;  // (epx::A2a stores it again once this returned)
  auto show = [this](uint64_t v) {
    std::string s = "[";
    for (int p = 0; p < group.size(); ++p) s += (v >> p & 1) ? "1" : "0";
    return s + "] (rank 0 first)";
  };
  // Masks that differ are memberships that differ: ranks that agree among themselves may not
  // count this one and go on without it, so a barrier over this rank's members could wait for
  // them in vain. The members that published this rank's mask (itself included) finish together
  // — nobody rewrites its header while one of them still reads it — and each raises. They finish
  // with a second resync over that set, not a barrier: a differing member does not wait for them,
  // so its arrive counter may move while they read it in the first resync, and they may have
  // adopted different epochs. Every set_active_ranks runs both resyncs, so the ranks' resync
  // counts stay equal.
  uint64_t same = 0, other_mask = 0;
  int other = -1;
  for (int p = 0; p < group.size(); ++p) {
    if (!is_active(p)) continue;
    const uint64_t theirs =
        std::atomic_ref<uint64_t>(header(p)->active_mask).load(std::memory_order_acquire);
    if (theirs == mask) {
      same |= uint64_t{1} << p;
    } else if (other < 0) {
      other = p;
      other_mask = theirs;
    }
  }
  transport().resync(op, same, 2 * group.timeout());
  if (other >= 0) {
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": argument 'active' differs across ranks: rank ", group.rank(), " has ",
                    show(mask), ", rank ", other, " has ", show(other_mask),
                    "; expected the same value on every active rank"));
  }
}

A2aDispatchResult CpuA2a::dispatch(const A2aDispatchArgs& args) {
  const char* op = "a2a dispatch";
  const int R = group.size();
  const int r = group.rank();
  const int K = shape.top_k;
  const int L = shape.num_experts / R;
  const int64_t T = args.topk_idx.shape[0];
  const int64_t M = args.runtime_max_tokens_per_rank;
  const size_t P = args.payloads.size();

  // 1. Publish routing, header and payload rows.
  CpuA2aHeader* mine = header(r);
  auto* send_mask = reinterpret_cast<uint64_t*>(local(layout_.send_mask));
  num_tokens_ = T;
  slots_.assign(static_cast<size_t>(T) * R, -1);
  std::vector<int32_t> num_sent(R, 0);
  for (int64_t t = 0; t < T; ++t) {
    uint64_t mask = 0;
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk_at(args.topk_idx, t, k);
      if (e < 0) continue;
      mask |= uint64_t{1} << (e / L);
      if (!is_active(static_cast<int>(e / L))) ++dropped_.selections;
    }
    if (mask != 0 && (mask & active_mask) == 0) ++dropped_.tokens;
    mask &= active_mask;
    send_mask[t] = mask;
    for (int d = 0; d < R; ++d)
      if (mask >> d & 1) slots_[t * R + d] = num_sent[d]++;
  }
  mine->num_tokens = T;
  mine->runtime_max = M;
  std::vector<size_t> row_bytes(P);
  for (size_t i = 0; i < P; ++i) {
    const TensorView& p = args.payloads[i];
    row_bytes[i] = dtype_size(p.dtype);  // dims 1.. times the element size (works for T = 0)
    for (int d = 1; d < p.ndim; ++d) row_bytes[i] *= static_cast<size_t>(p.shape[d]);
    mine->row_bytes[i] = static_cast<int64_t>(row_bytes[i]);
    if (T > 0) std::memcpy(local(layout_.send_payload[i]), p.data, T * row_bytes[i]);
  }
  barrier("a2a dispatch (publish)");

  // 2. Everyone agrees on the geometry.
  agree(op, "argument 'runtime_max_tokens_per_rank'",
        [](const CpuA2aHeader& h) { return h.runtime_max; });
  for (size_t i = 0; i < P; ++i)
    agree(op, cat("the bytes per token of argument 'payloads[", i, "]'"),
          [i](const CpuA2aHeader& h) { return h.row_bytes[i]; });

  // 3. Pull the rows sent here, in source-rank then source-token order; fill padding.
  auto* recv_counts = reinterpret_cast<int32_t*>(local(layout_.recv_counts));
  const int sanitise_idx = args.invalid_expert_id.has_value() ? args.expert_id_payload_index : -1;
  for (int s = 0; s < R; ++s) {
    const int64_t T_s = is_active(s) ? header(s)->num_tokens : 0;  // inactive: all padding
    const auto* peer_mask = reinterpret_cast<const uint64_t*>(peer(s, layout_.send_mask));
    int64_t j = 0;
    for (int64_t t = 0; t < T_s; ++t) {
      if (!(peer_mask[t] >> r & 1)) continue;
      for (size_t i = 0; i < P; ++i) {
        uint8_t* dst = local(layout_.recv_payload[i]) + (s * M + j) * row_bytes[i];
        std::memcpy(dst, peer(s, layout_.send_payload[i]) + t * row_bytes[i], row_bytes[i]);
      }
      ++j;
    }
    recv_counts[s] = static_cast<int32_t>(j);
    for (size_t i = 0; i < P; ++i) {
      uint8_t* pad = local(layout_.recv_payload[i]) + (s * M + j) * row_bytes[i];
      const size_t pad_rows = static_cast<size_t>(M - j);
      if (static_cast<int>(i) == sanitise_idx) {
        std::fill_n(reinterpret_cast<int32_t*>(pad), pad_rows * K, *args.invalid_expert_id);
      } else {
        std::memset(pad, 0, pad_rows * row_bytes[i]);
      }
    }
  }
  barrier("a2a dispatch (pull)");

  // Views of the receive regions.
  A2aDispatchResult result;
  for (size_t i = 0; i < P; ++i) {
    const TensorView& p = args.payloads[i];
    std::vector<int64_t> dims = {R, M};
    for (int d = 1; d < p.ndim; ++d) dims.push_back(p.shape[d]);
    result.recv.push_back(TensorView::contiguous(local(layout_.recv_payload[i]), p.dtype, dims));
  }
  result.recv_counts = TensorView::contiguous(recv_counts, DType::kI32, {R});
  return result;
}

Tensor CpuA2a::combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace,
                       Stream /*stream*/, const Allocator& alloc) {
  const char* op = "a2a combine";
  const int R = group.size();
  const int r = group.rank();
  const int64_t M = runtime_max;
  const int64_t H = y.shape[2];
  const DType dtype = y.dtype;
  const size_t elem = dtype_size(dtype);
  const size_t hidden_bytes = static_cast<size_t>(H) * elem;
  const int64_t T = num_tokens_;

  // 1. Output first (a failing allocator must not leave peers waiting), then publish y.
  Tensor out;
  collective_local(op, [&] { out = alloc(dtype, {T, H}, Device::cpu()); });
  uint8_t* region = local(layout_.combine);
  if (!payload_in_workspace) {
    for (int64_t s = 0; s < R; ++s)
      for (int64_t j = 0; j < M; ++j)
        std::memcpy(region + (s * M + j) * hidden_bytes,
                    static_cast<const uint8_t*>(y.data) +
                        (s * y.strides[0] + j * y.strides[1]) * static_cast<int64_t>(elem),
                    hidden_bytes);
  }
  header(r)->combine_hidden = H;
  header(r)->combine_dtype = static_cast<int64_t>(dtype);
  barrier("a2a combine (publish)");

  // 2. Everyone agrees on H and the dtype.
  agree(op, "the hidden size (dim 2) of argument 'y'",
        [](const CpuA2aHeader& h) { return h.combine_hidden; });
  agree(
      op, "the dtype of argument 'y'", [](const CpuA2aHeader& h) { return h.combine_dtype; },
      [](int64_t v) { return std::string(dtype_name(static_cast<DType>(v))); });

  // 3. Reduce over destination ranks in ascending order, float32, one rounding.
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < R; ++d) {
      const int32_t slot = slots_[t * R + d];
      if (slot < 0) continue;
      const uint8_t* src = peer(d, layout_.combine) + (r * M + slot) * hidden_bytes;
      if (dtype == DType::kBF16) {
        const auto* v = reinterpret_cast<const uint16_t*>(src);
        for (int64_t h = 0; h < H; ++h) acc[h] += bf16_to_f32(v[h]);
      } else if (dtype == DType::kF16) {
        const auto* v = reinterpret_cast<const uint16_t*>(src);
        for (int64_t h = 0; h < H; ++h) acc[h] += f16_to_f32(v[h]);
      } else {
        const auto* v = reinterpret_cast<const float*>(src);
        for (int64_t h = 0; h < H; ++h) acc[h] += v[h];
      }
    }
    if (dtype == DType::kBF16) {
      auto* o = out.ptr<uint16_t>() + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = f32_to_bf16(acc[h]);
    } else if (dtype == DType::kF16) {
      auto* o = out.ptr<uint16_t>() + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = f32_to_f16(acc[h]);
    } else {
      std::memcpy(out.ptr<float>() + t * H, acc.data(), hidden_bytes);
    }
  }
  barrier("a2a combine (pull)");
  return out;
}

}  // namespace

size_t cpu_a2a_bytes(const A2aShape& shape, int num_ranks) {
  return CpuA2aLayout(shape, num_ranks).total_bytes;
}

std::unique_ptr<A2aImpl> make_cpu_a2a(const Group& group, const A2aShape& shape) {
  return std::make_unique<CpuA2a>(group, shape);
}

}  // namespace epx::detail
