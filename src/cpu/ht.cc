// src/cpu/ht.cc — the ht mode of the cpu reference backend (docs/semantics.md §1): layout and
// dispatch; the combine is in ht_combine.cc, the region layout in ht_region.h.
//
// Data flow. Every collective op is "publish, barrier, pull, barrier" (cpu_buffer.h). A rank that
// fails after the first barrier (worst-case overflow, a handle that does not match its peers, an
// allocator error) still takes part in the closing barrier, then throws: its peers never hang.
//   ht_layout    local, no communication: counts from topk_idx.
//   ht_dispatch  rank s publishes T_s, send_counts[d] (its tokens that go to d), topk_idx (as
//                int64), topk_weights, x rows and scale rows; across nodes (N > 1) it then packs,
//                for every other node m, the tokens that go to some rank of m (each once,
//                ascending) into chunk m and exchanges chunks over the rail: (n, g) sends chunk m
//                to (m, g) and receives every (m, g)'s chunk for node n into its region; barrier.
//                Rank r reads source s through ht_source (s's region when s is on r's node, else
//                the chunk of r's forwarder for s: the same rows, once per node). It builds
//                rank_prefix_matrix from every source's send_counts ([s][d] = sum of
//                send_counts_q[d] over q <= s), N = rank_prefix_matrix[R-1][r], then for
//                s = 0..R-1, t = 0..T_s-1 copies (memcpy) the row of every token that goes to r:
//                recv row of (s, t) = rank_prefix_matrix[s-1][r] + #{t' < t of s that go to r};
//                barrier. send_pos[t][d] on rank s is the same number seen from the sender. A
//                forwarder also keeps, in its handle, where each row it received over the rail
//                landed on its node's ranks (HtForwardRoute, for the combine).
//   cached       x and scales only are published (and sent over the rail for the tokens the
//                handle routes to each other node); the receiver takes the row order from the
//                handle (rows [prefix[s-1][r], prefix[s][r]) come from s, token recv_src_idx[row]).
//
// Exact semantics (the cuda backend reproduces them bit for bit):
//   layout      num_tokens_per_rank[d] = #{t: some topk_idx[t][k] lives on d};
//               num_tokens_per_expert[e] = #{(t, k): topk_idx[t][k] == e} (duplicates count twice)
//   dispatch    recv_topk_idx[row][k] = e - r*L if expert e = topk_idx[t][k] lives on r, else -1;
//               recv_topk_weights[row][k] = the weight where local, else 0.0f;
//               num_recv_tokens_per_expert[l] = round_up(#{(row, k): recv_topk_idx == l},
//               expert_alignment) (exact mode only). Worst-case rows [N, num_worst_tokens):
//               recv_x and scales 0, recv_topk_idx -1, weights 0, recv_src_idx -1.
//               The same on every topology: the rail moves rows, it never reorders them.
//   combine     ht_combine.cc.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/validate.h"
#include "cpu/ht_region.h"

namespace epx::detail {
namespace {

// Offsets of a rows block of capacity Tm starting at `off`; returns its end.
size_t rows_block(const MoeShape& s, size_t off, HtRows& rows) {
  const size_t Tm = static_cast<size_t>(s.max_tokens_per_rank);
  const size_t K = static_cast<size_t>(s.top_k), H = static_cast<size_t>(s.hidden);
  const size_t begin = off;
  rows.topk_idx = off - begin;
  off += align_up(Tm * K * 8, 64);
  rows.topk_weights = off - begin;
  off += align_up(Tm * K * 4, 64);
  rows.x = off - begin;
  off += align_up(Tm * H * 2, 64);
  rows.scales = off - begin;
  off += align_up(Tm * 4 * ((H + 127) / 128), 64);
  rows.bytes = off - begin;
  return off;
}

// Copies a [rows, cols] view of 4-byte elements with any strides into packed rows.
void pack_words(const TensorView& v, int64_t rows, uint32_t* dst) {
  const int64_t cols = v.shape[1];
  const auto* src = static_cast<const uint32_t*>(v.data);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) dst[t * cols + c] = src[t * v.strides[0] + c * v.strides[1]];
}

Tensor alloc_tensor(const Allocator& alloc, DType dtype, std::vector<int64_t> shape) {
  return alloc(dtype, shape, Device::cpu());
}

std::string show_given(int64_t v) {
  return v ? "given" : "absent";
}

}  // namespace

const char* ht_op_name(int32_t op) {
  switch (op) {
    case kOpDispatch:
      return "ht_dispatch";
    case kOpCachedDispatch:
      return "ht_dispatch (cached)";
    case kOpCombine:
      return "ht_combine";
  }
  return "another operation";
}

HtRegion ht_region(const MoeShape& s, int R, Topology topology) {
  const size_t Tm = static_cast<size_t>(s.max_tokens_per_rank);
  const size_t K = static_cast<size_t>(s.top_k), H = static_cast<size_t>(s.hidden);
  const size_t G = static_cast<size_t>(topology.ranks_per_node);
  HtRegion g{};
  size_t off = align_up(sizeof(RegionHeader), 64);
  g.send_counts = off;
  off += align_up(4 * static_cast<size_t>(R), 64);
  g.payload = off;
  const size_t dispatch_end = rows_block(s, off, g.rows);
  off = g.payload;
  g.y = off;
  off += align_up(static_cast<size_t>(R) * Tm * H * 2, 64);
  g.y_weights = off;
  off += align_up(static_cast<size_t>(R) * Tm * K * 4, 64);
  g.rail = align_up(std::max(dispatch_end, off), 64);
  // A dispatch chunk, and a partial chunk (host memory only; sized for the rail's slots).
  HtRows chunk_rows{};
  g.chunk_counts = align_up(sizeof(HtChunkHeader), 64);
  g.chunk_rows = g.chunk_counts + align_up(4 * static_cast<size_t>(R), 64);
  g.chunk_src_idx = rows_block(s, g.chunk_rows, chunk_rows);
  g.chunk_bytes = g.chunk_src_idx + align_up(Tm * 4, 64);
  g.partial_headers = align_up(sizeof(HtPartialHeader), 64);
  g.partial = g.partial_headers + align_up(G * sizeof(RegionHeader), 64);
  g.partial_weights = g.partial + align_up(Tm * H * 4, 64);
  g.partial_bytes = g.partial_weights + align_up(Tm * K * 4, 64);
  g.bytes = g.rail + static_cast<size_t>(topology.num_nodes - 1) * g.chunk_bytes;
  return g;
}

HtSource ht_source(const SymmetricMemory& mem, const HtRegion& reg, Topology topology, int s) {
  const int r = mem.rank(), n = topology.node_of(r);
  if (topology.node_of(s) == n) {
    const auto* region = static_cast<const uint8_t*>(mem.peer(s));
    const auto* header = reinterpret_cast<const RegionHeader*>(region);
    return {header, reinterpret_cast<const int32_t*>(region + reg.send_counts),
            region + reg.payload, nullptr, header->num_tokens};
  }
  const int forwarder = topology.rank_of(n, topology.local_of(s));
  const uint8_t* chunk = static_cast<const uint8_t*>(mem.peer(forwarder)) +
                         reg.chunk(Topology::other_index(topology.node_of(s), n));
  const auto* header = reinterpret_cast<const HtChunkHeader*>(chunk);
  return {&header->source, reinterpret_cast<const int32_t*>(chunk + reg.chunk_counts),
          chunk + reg.chunk_rows, reinterpret_cast<const int32_t*>(chunk + reg.chunk_src_idx),
          header->num_rows};
}

void recheck_ht_stamps(int rank, int num_ranks, int32_t op, const StepState& step,
                       const std::function<const RegionHeader*(int)>& header_of) {
  recheck_stamps(ht_op_name(op), rank, num_ranks, step.generation, step.calls,
                 [&](int p) -> const Stamp& { return header_of(p)->stamp; });
}

void check_ht_headers(int rank, int R, int32_t op, const StepState& step,
                      const std::function<const RegionHeader*(int)>& header_of) {
  check_stamps(
      ht_op_name(op), rank, R, step.generation, step.calls,
      [&](int p) -> const Stamp& { return header_of(p)->stamp; },
      [&](int p) { return std::string(ht_op_name(header_of(p)->op)); });
  for (int p = 0; p < R; ++p) {
    EPX_CHECK(header_of(p)->op == op, ErrorCode::kOutOfStep, ht_op_name(op), ": rank ", p,
              " called ", ht_op_name(header_of(p)->op), " at the same call #", step.calls,
              " instead; every rank must call the same operations in the same order");
  }
  struct Field {
    const char* what;
    int64_t (*get)(const RegionHeader&);
    ShowValue show;
  };
  std::vector<Field> fields;
  if (op != kOpCombine) {
    fields.push_back({"the dtype of argument 'x'",
                      [](const RegionHeader& h) -> int64_t { return h.x_dtype; }, show_dtype});
    fields.push_back({"the dtype of argument 'x_scales'",
                      [](const RegionHeader& h) -> int64_t { return h.scale_dtype; }, show_dtype});
    fields.push_back({op == kOpCachedDispatch ? "num_worst_tokens (of argument 'handle')"
                                              : "argument 'num_worst_tokens'",
                      [](const RegionHeader& h) { return h.num_worst_tokens; }, show_int});
  }
  if (op == kOpDispatch) {
    fields.push_back({"argument 'expert_alignment'",
                      [](const RegionHeader& h) -> int64_t { return h.expert_alignment; },
                      show_int});
  }
  if (op != kOpCachedDispatch) {
    fields.push_back({"argument 'topk_weights' (given or absent)",
                      [](const RegionHeader& h) -> int64_t { return h.has_weights; }, show_given});
  }
  fields.push_back({"argument 'zero_copy'",
                    [](const RegionHeader& h) -> int64_t { return h.zero_copy; }, show_bool});
  std::string message;
  std::vector<int64_t> values(R);
  for (const Field& f : fields) {
    for (int p = 0; p < R; ++p) values[p] = f.get(*header_of(p));
    if (all_equal(values)) continue;
    message += cat(message.empty() ? "" : "; ", f.what, " differs across ranks: ",
                   per_rank_values(values, f.show));
  }
  EPX_CHECK_ARG(message.empty(), ht_op_name(op), ": ", message,
                "; expected the same on every rank");
}

void pack_rows(const TensorView& v, int64_t rows, uint8_t* dst) {
  const size_t row_bytes = static_cast<size_t>(v.shape[1]) * dtype_size(v.dtype);
  const size_t pitch_bytes = static_cast<size_t>(v.strides[0]) * dtype_size(v.dtype);
  if (rows <= 0 || row_bytes == 0) return;
  if (pitch_bytes == row_bytes) {
    std::memcpy(dst, v.data, row_bytes * static_cast<size_t>(rows));
    return;
  }
  const auto* src = static_cast<const uint8_t*>(v.data);
  for (int64_t t = 0; t < rows; ++t)
    std::memcpy(dst + t * row_bytes, src + t * pitch_bytes, row_bytes);
}

// First touches of 4 KiB pages are what the cpu ht ops spend most time on otherwise: the region is
// large (R * Tm * H * 2 bytes for combine) and written by its owner only.
void advise_huge_pages(const SymmetricMemory& mem) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(mem.local()) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(mem.local()) + mem.bytes()) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

size_t cpu_ht_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  const Topology topology{num_nodes, num_ranks / num_nodes};
  const HtRegion reg = ht_region(shape, num_ranks, topology);
  return reg.bytes +
         (topology.hierarchical() ? cpu_rail_bytes(topology, reg.rail_chunk_bytes()) : 0);
}

HtLayout CpuBuffer::ht_layout(const TensorView& topk_idx, Stream, const Allocator& alloc) {
  const int R = group.size(), E = shape.num_experts, K = shape.top_k, L = E / R;
  const int64_t T = topk_idx.shape[0];
  HtLayout out;
  out.num_tokens_per_rank = alloc_tensor(alloc, DType::kI32, {R});
  out.num_tokens_per_expert = alloc_tensor(alloc, DType::kI32, {E});
  out.is_token_in_rank = alloc_tensor(alloc, DType::kBool, {T, R});
  auto* per_rank = out.num_tokens_per_rank.ptr<int32_t>();
  auto* per_expert = out.num_tokens_per_expert.ptr<int32_t>();
  auto* in_rank = out.is_token_in_rank.ptr<bool>();
  std::fill(per_rank, per_rank + R, 0);
  std::fill(per_expert, per_expert + E, 0);
  for (int64_t t = 0; t < T; ++t) {
    bool* row = in_rank + t * R;
    std::fill(row, row + R, false);
    for (int k = 0; k < K; ++k) {
      const int64_t e = topk_at(topk_idx, t, k);
      if (e < 0) continue;
      ++per_expert[e];
      row[e / L] = true;
    }
    for (int d = 0; d < R; ++d) per_rank[d] += row[d] ? 1 : 0;
  }
  return out;
}

// Across nodes: for every other node m, the rows of this rank's tokens that go to some rank of m
// (cached: that the handle routes there), from its published rows block into chunk m, exchanged
// over the rail; the chunks of the other nodes' ranks of this local index land in this rank's
// rail section, where its node's ranks pull them.
void CpuBuffer::send_ht_chunks(const HtDispatchArgs& a, uint64_t call) {
  const int R = group.size(), r = group.rank(), K = shape.top_k, L = shape.num_experts / R;
  const int n = topology_.node_of(r), G = topology_.ranks_per_node;
  const HtRegion reg = ht_region(shape, R, topology_);
  uint8_t* mine = static_cast<uint8_t*>(ht_mem_->local());
  const auto* header = reinterpret_cast<const RegionHeader*>(mine);
  const bool cached = a.handle != nullptr;
  const int64_t T = header->num_tokens;
  const size_t x_row_bytes = static_cast<size_t>(shape.hidden) * dtype_size(a.x.dtype);
  const size_t scale_row_bytes = a.x.dtype == DType::kF8E4M3 ? 4 * a.x_scales.shape[1] : 0;
  const uint8_t* own = mine + reg.payload;
  const auto* own_idx = reinterpret_cast<const int64_t*>(own + reg.rows.topk_idx);
  const bool* in_rank = cached ? a.handle->is_token_in_rank.ptr<bool>() : nullptr;
  std::vector<RailChunk> sends, recvs;
  for (int m = 0; m < topology_.num_nodes; ++m) {
    if (m == n) continue;
    const int slot = Topology::other_index(m, n);
    uint8_t* chunk = ht_sends_.chunk(slot, reg.chunk_bytes);
    auto* ch = reinterpret_cast<HtChunkHeader*>(chunk);
    std::memcpy(static_cast<void*>(&ch->source), header, sizeof(RegionHeader));
    ch->source.stamp.end_publish(ht_step_.generation, call);
    if (!cached) std::memcpy(chunk + reg.chunk_counts, mine + reg.send_counts, 4 * R);
    uint8_t* rows = chunk + reg.chunk_rows;
    auto* src_idx = reinterpret_cast<int32_t*>(chunk + reg.chunk_src_idx);
    int64_t num_rows = 0;
    for (int64_t t = 0; t < T; ++t) {
      bool goes = false;
      for (int d = m * G; d < (m + 1) * G && cached; ++d) goes |= in_rank[t * R + d];
      for (int k = 0; k < K && !cached; ++k)
        goes |= own_idx[t * K + k] >= 0 && own_idx[t * K + k] / L / G == m;
      if (!goes) continue;
      auto copy = [&](size_t offset, size_t row_bytes) {
        std::memcpy(rows + offset + num_rows * row_bytes, own + offset + t * row_bytes, row_bytes);
      };
      copy(reg.rows.x, x_row_bytes);
      copy(reg.rows.scales, scale_row_bytes);
      if (!cached) copy(reg.rows.topk_idx, 8 * K);
      if (!cached && header->has_weights) copy(reg.rows.topk_weights, 4 * K);
      src_idx[num_rows++] = static_cast<int32_t>(t);
    }
    ch->num_rows = num_rows;
    sends.push_back({m, chunk, reg.chunk_bytes});
    recvs.push_back({m, mine + reg.chunk(slot), reg.chunk_bytes});
  }
  ht_rail_->exchange(cached ? "ht_dispatch (cached, rail)" : "ht_dispatch (rail)", sends, recvs,
                     a.stream);
}

namespace {

// Cached mode: the rows of source s for rank r, in the handle's order. `src` is s's rows: its
// region (row t = token t) or its chunk (ascending tokens, found by walking along).
void pull_cached_rows(const HtSource& src, const HtRegion& reg, int s, const int32_t* recv_src_idx,
                      int64_t begin, int64_t end, size_t x_row_bytes, size_t scale_row_bytes,
                      uint8_t* recv_x, uint8_t* recv_scales) {
  int64_t i = 0;  // chunk row
  for (int64_t row = begin; row < end; ++row) {
    const int64_t t = recv_src_idx[row];
    if (src.src_idx) {
      while (i < src.num_rows && src.src_idx[i] < t) ++i;
    } else {
      i = t;
    }
    EPX_CHECK_ARG(t >= 0 && i < src.num_rows && src.token(i) == t,
                  "ht_dispatch: argument 'handle' has recv_src_idx[", row, "] = ", t, " but rank ",
                  s, src.src_idx ? " did not send that token to this node" : " dispatched ",
                  src.src_idx ? "" : cat(src.num_rows, " tokens"),
                  ", expected the handle of a dispatch with the same routing");
    std::memcpy(recv_x + row * x_row_bytes, src.rows + reg.rows.x + i * x_row_bytes, x_row_bytes);
    if (recv_scales)
      std::memcpy(recv_scales + row * scale_row_bytes,
                  src.rows + reg.rows.scales + i * scale_row_bytes, scale_row_bytes);
  }
}

// The forwarder's routing (HtForwardRoute) of the chunks rank r received, from the dispatch's
// rank_prefix_matrix: a source's rows on rank d are in its token order from prefix[s-1][d].
std::shared_ptr<const void> forward_route(const SymmetricMemory& mem, const HtRegion& reg,
                                          Topology topology, int R, int L, int K,
                                          const std::vector<int32_t>& prefix) {
  auto route = std::make_shared<HtForwardRoute>();
  const int r = mem.rank(), n = topology.node_of(r), G = topology.ranks_per_node;
  for (int m = 0; m < topology.num_nodes; ++m) {
    if (m == n) continue;
    const int s = topology.rank_of(m, topology.local_of(r));
    const uint8_t* chunk =
        static_cast<const uint8_t*>(mem.local()) + reg.chunk(Topology::other_index(m, n));
    const auto* header = reinterpret_cast<const HtChunkHeader*>(chunk);
    const auto* idx = reinterpret_cast<const int64_t*>(chunk + reg.chunk_rows + reg.rows.topk_idx);
    std::vector<int32_t> next(G);
    for (int g = 0; g < G; ++g) next[g] = s == 0 ? 0 : prefix[(s - 1) * R + topology.rank_of(n, g)];
    std::vector<int32_t> pos(static_cast<size_t>(header->num_rows) * G);
    for (int64_t i = 0; i < header->num_rows; ++i) {
      for (int g = 0; g < G; ++g) {
        const int64_t lo = static_cast<int64_t>(topology.rank_of(n, g)) * L, hi = lo + L;
        bool goes = false;
        for (int k = 0; k < K; ++k) goes |= idx[i * K + k] >= lo && idx[i * K + k] < hi;
        pos[i * G + g] = goes ? next[g]++ : -1;
      }
    }
    route->pos.push_back(std::move(pos));
  }
  return route;
}

}  // namespace

HtDispatchResult CpuBuffer::ht_dispatch(const HtDispatchArgs& a, const Allocator& alloc) try {
  const uint64_t call =
      ht_step_.begin(a.handle ? "ht_dispatch (cached)" : "ht_dispatch", "reset()");
  const int R = group.size(), r = group.rank(), K = shape.top_k;
  const int L = shape.num_experts / R;
  const int64_t H = shape.hidden, T = a.x.shape[0];
  const HtRegion reg = ht_region(shape, R, topology_);
  SymmetricMemory& mem = *ht_mem_;
  const bool cached = a.handle != nullptr;
  const bool fp8 = a.x.dtype == DType::kF8E4M3;
  const DType scale_dtype = fp8 ? a.x_scales.dtype : DType::kF32;
  const int64_t scale_cols = fp8 ? a.x_scales.shape[1] : 0;
  const size_t x_row_bytes = static_cast<size_t>(H) * dtype_size(a.x.dtype);
  const size_t scale_row_bytes = static_cast<size_t>(scale_cols) * 4;

  // ---- publish (and, across nodes, the rail) ---------------------------------------------------
  advise_huge_pages(mem);
  uint8_t* mine = static_cast<uint8_t*>(mem.local());
  uint8_t* own = mine + reg.payload;  // this rank's rows block
  auto* header = reinterpret_cast<RegionHeader*>(mine);
  header->stamp.begin_publish();
  header->op = cached ? kOpCachedDispatch : kOpDispatch;
  header->x_dtype = static_cast<int32_t>(a.x.dtype);
  header->scale_dtype = fp8 ? static_cast<int32_t>(scale_dtype) : -1;
  header->has_weights = a.topk_weights.defined() ? 1 : 0;
  header->num_tokens = T;
  header->num_rows = 0;
  header->num_worst_tokens = cached ? a.handle->num_worst_tokens : a.num_worst_tokens;
  header->expert_alignment = cached ? 0 : a.expert_alignment;
  header->zero_copy = a.zero_copy ? 1 : 0;
  pack_rows(a.x, T, own + reg.rows.x);
  if (fp8) pack_words(a.x_scales, T, reinterpret_cast<uint32_t*>(own + reg.rows.scales));
  if (!cached) {
    auto* counts = reinterpret_cast<int32_t*>(mine + reg.send_counts);
    auto* idx = reinterpret_cast<int64_t*>(own + reg.rows.topk_idx);
    auto* w = reinterpret_cast<float*>(own + reg.rows.topk_weights);
    std::fill(counts, counts + R, 0);
    std::vector<char> goes(R);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(goes.begin(), goes.end(), 0);
      for (int k = 0; k < K; ++k) {
        const int64_t e = topk_at(a.topk_idx, t, k);
        idx[t * K + k] = e;
        if (e >= 0) goes[e / L] = 1;
        if (header->has_weights) w[t * K + k] = element<float>(a.topk_weights, t, k);
      }
      for (int d = 0; d < R; ++d) counts[d] += goes[d];
    }
  }
  // A rank whose rail failed leaves its stamp unset: its node's ranks raise OutOfStep naming it.
  std::exception_ptr rail_error;
  if (topology_.hierarchical()) rail_error = run_noting_error([&] { send_ht_chunks(a, call); }, {});
  if (!rail_error) header->stamp.end_publish(ht_step_.generation, call);
  transport().barrier(cached ? "ht_dispatch (cached, publish)" : "ht_dispatch (publish)");

  // ---- pull ------------------------------------------------------------------------------------
  return pull_then_barrier(transport(), "ht_dispatch (pull)", [&] {
    if (rail_error) std::rethrow_exception(rail_error);
    std::vector<HtSource> sources;
    for (int s = 0; s < R; ++s) sources.push_back(ht_source(mem, reg, topology_, s));
    auto header_of = [&](int p) { return sources[p].header; };
    check_ht_headers(r, R, header->op, ht_step_, header_of);
    HtDispatchResult res;
    // Receive rows per source, from the exchanged counts or from the handle.
    std::vector<int32_t> prefix(static_cast<size_t>(R) * R);
    if (cached) {
      std::copy_n(a.handle->rank_prefix_matrix.ptr<int32_t>(), R * R, prefix.begin());
    } else {
      for (int d = 0; d < R; ++d) {
        int32_t run = 0;
        for (int s = 0; s < R; ++s) {
          run += sources[s].send_counts[d];
          prefix[s * R + d] = run;
        }
      }
    }
    auto begin_of = [&](int s, int d) { return s == 0 ? 0 : prefix[(s - 1) * R + d]; };
    const int64_t N = prefix[(R - 1) * R + r];
    const int64_t worst = cached ? a.handle->num_worst_tokens : a.num_worst_tokens;
    if (cached) {
      EPX_CHECK_ARG(N == a.handle->num_recv_tokens, "ht_dispatch: argument 'handle' receives ",
                    a.handle->num_recv_tokens, " tokens but its rank_prefix_matrix says ", N,
                    ", expected a handle returned by ht_dispatch");
    }
    EPX_CHECK(worst == 0 || N <= worst, ErrorCode::kOutOfCapacity, "ht_dispatch: rank ", r,
              " receives N = ", N, " tokens, more than argument 'num_worst_tokens' = ", worst,
              "; raise num_worst_tokens to at least ", N, " (rows are never dropped)");
    const int64_t rows = worst > 0 ? worst : N;

    res.recv_x = alloc_tensor(alloc, a.x.dtype, {rows, H});
    auto* recv_x = res.recv_x.ptr<uint8_t>();
    uint8_t* recv_scales = nullptr;
    if (fp8) {
      res.recv_x_scales = alloc_tensor(alloc, scale_dtype, {rows, scale_cols});
      recv_scales = res.recv_x_scales.ptr<uint8_t>();
    }

    if (cached) {
      for (int s = 0; s < R; ++s)
        pull_cached_rows(sources[s], reg, s, a.handle->recv_src_idx.ptr<int32_t>(), begin_of(s, r),
                         prefix[s * R + r], x_row_bytes, scale_row_bytes, recv_x, recv_scales);
      std::memset(recv_x + N * x_row_bytes, 0, (rows - N) * x_row_bytes);
      if (fp8) std::memset(recv_scales + N * scale_row_bytes, 0, (rows - N) * scale_row_bytes);
      res.handle = *a.handle;
      recheck_ht_stamps(r, R, header->op, ht_step_, header_of);
      return res;
    }

    const bool has_weights = header->has_weights != 0;
    const bool idx64 = a.topk_idx.dtype == DType::kI64;
    res.recv_topk_idx = alloc_tensor(alloc, a.topk_idx.dtype, {rows, K});
    if (has_weights) res.recv_topk_weights = alloc_tensor(alloc, DType::kF32, {rows, K});
    res.recv_src_idx = alloc_tensor(alloc, DType::kI32, {rows});
    auto* recv_w = has_weights ? res.recv_topk_weights.ptr<float>() : nullptr;
    auto* src_idx = res.recv_src_idx.ptr<int32_t>();
    std::vector<int64_t> per_expert(L, 0);
    const int64_t lo = static_cast<int64_t>(r) * L, hi = lo + L;
    int64_t row = 0;
    for (int s = 0; s < R; ++s) {
      const HtSource& src = sources[s];
      const auto* idx = reinterpret_cast<const int64_t*>(src.rows + reg.rows.topk_idx);
      const auto* w = reinterpret_cast<const float*>(src.rows + reg.rows.topk_weights);
      const uint8_t* xs = src.rows + reg.rows.x;
      const uint8_t* scales = src.rows + reg.rows.scales;
      for (int64_t i = 0; i < src.num_rows; ++i) {
        const int64_t* sel = idx + i * K;
        bool goes = false;
        for (int k = 0; k < K; ++k) goes |= sel[k] >= lo && sel[k] < hi;
        if (!goes) continue;
        std::memcpy(recv_x + row * x_row_bytes, xs + i * x_row_bytes, x_row_bytes);
        if (fp8)
          std::memcpy(recv_scales + row * scale_row_bytes, scales + i * scale_row_bytes,
                      scale_row_bytes);
        for (int k = 0; k < K; ++k) {
          const bool local = sel[k] >= lo && sel[k] < hi;
          const int64_t l = local ? sel[k] - lo : -1;
          if (idx64)
            res.recv_topk_idx.ptr<int64_t>()[row * K + k] = l;
          else
            res.recv_topk_idx.ptr<int32_t>()[row * K + k] = static_cast<int32_t>(l);
          if (recv_w) recv_w[row * K + k] = local ? w[i * K + k] : 0.0f;
          if (local) ++per_expert[l];
        }
        src_idx[row] = static_cast<int32_t>(src.token(i));
        ++row;
      }
      EPX_CHECK(row == prefix[s * R + r], ErrorCode::kInternal, "ht_dispatch: rank ", r, " pulled ",
                row, " rows up to rank ", s, ", its counts say ", prefix[s * R + r]);
    }
    // Worst-case padding rows.
    std::memset(recv_x + N * x_row_bytes, 0, (rows - N) * x_row_bytes);
    if (fp8) std::memset(recv_scales + N * scale_row_bytes, 0, (rows - N) * scale_row_bytes);
    for (int64_t i = N * K; i < rows * K; ++i) {
      if (idx64)
        res.recv_topk_idx.ptr<int64_t>()[i] = -1;
      else
        res.recv_topk_idx.ptr<int32_t>()[i] = -1;
      if (recv_w) recv_w[i] = 0.0f;
    }
    std::fill(src_idx + N, src_idx + rows, -1);
    if (worst == 0) {
      const int64_t align = a.expert_alignment;
      for (int l = 0; l < L; ++l)
        res.num_recv_tokens_per_expert.push_back(
            static_cast<int>((per_expert[l] + align - 1) / align * align));
    }

    // The handle: this rank's side of the routing.
    HtHandle& h = res.handle;
    h.rank_prefix_matrix = alloc_tensor(alloc, DType::kI32, {R, R});
    std::copy(prefix.begin(), prefix.end(), h.rank_prefix_matrix.ptr<int32_t>());
    h.recv_src_idx = res.recv_src_idx;
    h.is_token_in_rank = alloc_tensor(alloc, DType::kBool, {T, R});
    h.send_pos = alloc_tensor(alloc, DType::kI32, {T, R});
    auto* in_rank = h.is_token_in_rank.ptr<bool>();
    auto* send_pos = h.send_pos.ptr<int32_t>();
    const auto* my_idx = reinterpret_cast<const int64_t*>(own + reg.rows.topk_idx);
    std::vector<int32_t> next(R);
    for (int d = 0; d < R; ++d) next[d] = begin_of(r, d);
    std::vector<char> goes(R);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(goes.begin(), goes.end(), 0);
      for (int k = 0; k < K; ++k)
        if (my_idx[t * K + k] >= 0) goes[my_idx[t * K + k] / L] = 1;
      for (int d = 0; d < R; ++d) {
        in_rank[t * R + d] = goes[d] != 0;
        send_pos[t * R + d] = goes[d] ? next[d]++ : -1;
      }
    }
    h.num_tokens = T;
    h.num_recv_tokens = N;
    h.num_worst_tokens = worst;
    h.top_k = K;
    h.buffer_id = id;
    if (topology_.hierarchical())
      h.backend_state = forward_route(mem, reg, topology_, R, L, K, prefix);
    recheck_ht_stamps(r, R, header->op, ht_step_, header_of);
    return res;
  });
} catch (const Error& e) {
  ht_step_.failed(e);
  throw;
}

}  // namespace epx::detail
