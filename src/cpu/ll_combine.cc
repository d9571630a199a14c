// src/cpu/ll_combine.cc — ll_combine of the cpu reference backend (docs/semantics.md §2.3); the
// region is in ll_region.h, the state, hooks and double buffering in ll.cc.
//
// Data flow on rank r = (n, g), N nodes (N = 1: no forward stage, every expert rank is on r's
// node):
//   send (publish): copy y's valid rows into combine slot handle.slot of this rank's region
//     (skipped with zero_copy: the caller wrote them through ll_next_combine_buffer), and publish
//     handle.layout_range next to them. use_logfmt: every valid row is encoded instead
//     (core/logfmt.h logfmt_encode_row: from y, or in place with zero_copy) into its slot there,
//     its meta words beside it. overlap (epx/ll.h LlCombineOverlap): expert by expert, block by
//     block (the cuda send's item order), first wait until the block's signal is reached (atomic
//     acquire loads, bounded by the group's timeout: Timeout naming the expert, the block, the
//     value wanted and the value seen), then copy its rows; the rest is unchanged, so the result
//     is the plain combine's.
//   receive (inline, or in the hook): barrier; then, across nodes, the forward stage over the
//     rail: (1) r sends every other node m its tokens that select an expert of m (topk row and
//     weights, ascending) to (m, g) and receives those of every (m, g) for node n;
//     (2) as their forwarder it reduces each such token over the experts of node n (below) into
//     a float32 partial and (3) sends the partials back, receiving its own tokens' partials from
//     every other node. Then r reduces each of its tokens: the experts of its node read
//     directly, then the other nodes' partials; barrier.
//   y(t, k) is row  begin + j  of local expert l = e % L on rank d = e / L (e = topk_idx[t][k]),
//   where begin comes from rank d's published layout_range[l][s] (s = the token's source rank)
//   and j counts the source's tokens before t that select e (duplicates of e in one row read the
//   same row). The forwarder finds j in its chunk: it holds every token of s that selects an
//   expert of its node, in token order.
//
// Exact semantics (the cuda kernel uses __fmaf_rn for std::fmaf): with n = the node of this rank
// and "k on node m" meaning topk_idx[t][k] != -1 and expert topk_idx[t][k] on a rank of node m:
//     acc = 0.0f;
//     for k = 0 .. K-1 on node n:  acc = std::fmaf(w[t][k], f32(y(t, k)), acc);
//     for m = 0 .. N-1, m != n, with some k on node m:
//       p = 0.0f;  for k = 0 .. K-1 on node m:  p = std::fmaf(w[t][k], f32(y(t, k)), p);
//       acc += p;
//     out[t] = bf16_rne(acc)            (tokens with no expert get +0)
// With one node: acc = fma chain over every k in order (docs/semantics.md §2.3).
// enable_shrink (§2.6): a k whose expert lives on a rank this rank masks is left out of the
// chain, as if topk_idx[t][k] were -1 (one node only).
// use_logfmt: f32(y(t, k)) is logfmt_decode_row of the encoded row, wherever a row is read (this
// node's rows here, the other nodes' rows by their forwarders; the partials stay float32). Every
// rank's header must agree on use_logfmt, else InvalidArgument on every rank (each rank sees
// every header: its node's in their regions, the others' in the partials).
// combine_wait_recv_cost_stats[d] += max(0, published_ns(d) - recv_start) when T > 0 (a rank
// without tokens waits for no expert outputs, as on cuda).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/host_wait.h"
#include "core/logfmt.h"
#include "core/numeric.h"
#include "core/validate.h"
#include "cpu/ll_region.h"

namespace epx::detail {
namespace {

struct CombineRecv : LlReceive {
  int64_t num_tokens;
  int num_experts;
  bool use_logfmt;
  std::vector<int32_t> topk;   // [T, K], copied at send time
  std::vector<float> weights;  // [T, K]
  Tensor out;                  // [T, H] bf16 (allocated, or the caller's without storage)
  TensorView wait_stats;       // optional, caller-owned: combine_wait_recv_cost_stats

  void operator()() const;
  std::exception_ptr forward(std::vector<const char*>& partials) const;
  void reduce_forwarded(const std::vector<const char*>& chunks,
                        const std::vector<char*>& partials) const;
  const CombineHeader* header(int d) const {
    return reinterpret_cast<const CombineHeader*>(static_cast<const char*>(mem->peer(d)) +
                                                  lay.combine_off(slot));
  }
  // acc[c] = std::fmaf(w, f32(y(t, k))[c], acc[c]) for c < H, y(t, k) the row of expert e on
  // rank e / L (on this rank's node) for source s, from its published layout_range; j = the
  // source's tokens before t that select e. use_logfmt: the row decoded into `decoded` [H] first.
  void add_row(int e, int s, int64_t j, float w, float* acc, float* decoded) const {
    const int L = lay.num_local_experts, R = lay.num_ranks;
    const int64_t H = lay.hidden;
    const char* region = static_cast<const char*>(mem->peer(e / L)) + lay.combine_off(slot);
    int64_t range;
    std::memcpy(&range, region + lay.layout_off + sizeof(int64_t) * ((e % L) * R + s),
                sizeof(range));
    const int64_t row = (e % L) * lay.rows_per_expert + (range >> 32) + j;
    const auto* y = reinterpret_cast<const uint16_t*>(region + lay.y_off) + row * H;
    if (use_logfmt) {
      const auto* meta = reinterpret_cast<const uint32_t*>(region + lay.meta_off);
      logfmt_decode_row(reinterpret_cast<const uint8_t*>(y), meta + row * lay.num_groups, H,
                        decoded);
      for (int64_t c = 0; c < H; ++c) acc[c] = std::fmaf(w, decoded[c], acc[c]);
      return;
    }
    for (int64_t c = 0; c < H; ++c) acc[c] = std::fmaf(w, bf16_to_f32(y[c]), acc[c]);
  }
  // Source s's rows per expert must be what expert e's rank received from it (with `ranges` of
  // the experts of this node; experts of ranks in `skip`, the mask, are not read):
  // InvalidArgument naming the source's topk_idx otherwise.
  void check_counts(int s, const std::vector<int64_t>& num_selected, int first_expert,
                    int last_expert, const char* whose, uint64_t skip = 0) const;
};

// The selections of `rows` tokens ([rows, K] topk): row_in_block[i * K + k] = j of y(t, k) (the
// row's tokens before it that select the same expert; a duplicate in one row reuses its first
// occurrence's), num_selected[e] = the tokens that select e.
void number_rows(const int32_t* topk, int64_t rows, int K, int E,
                 std::vector<int64_t>& row_in_block, std::vector<int64_t>& num_selected) {
  row_in_block.assign(rows * K, -1);
  num_selected.assign(E, 0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int k = 0; k < K; ++k) {
      const int32_t e = topk[i * K + k];
      if (e < 0) continue;
      int k0 = 0;
      while (topk[i * K + k0] != e) ++k0;
      row_in_block[i * K + k] = k0 < k ? row_in_block[i * K + k0] : num_selected[e]++;
    }
  }
}

void CombineRecv::check_counts(int s, const std::vector<int64_t>& num_selected, int first_expert,
                               int last_expert, const char* whose, uint64_t skip) const {
  const int L = lay.num_local_experts, R = lay.num_ranks;
  for (int e = first_expert; e < last_expert; ++e) {
    if (skip >> (e / L) & 1) continue;
    const char* region = static_cast<const char*>(mem->peer(e / L)) + lay.combine_off(slot);
    int64_t range;
    std::memcpy(&range, region + lay.layout_off + sizeof(int64_t) * ((e % L) * R + s),
                sizeof(range));
    const int64_t count = range & 0xFFFFFFFF;
    EPX_CHECK_ARG(count == num_selected[e] && (range >> 32) + count <= lay.rows_per_expert,
                  "ll_combine: argument 'topk_idx'", whose, " selects expert ", e, " with ",
                  num_selected[e], " tokens but rank ", e / L, " received ", count, " from ",
                  whose[0] ? "it" : "this rank",
                  "; expected the topk_idx of the dispatch that made 'handle'");
  }
}

// As the forwarder of the other nodes' ranks of this local index: their tokens that select an
// expert of this node (`chunks`, forward chunks from the rail), reduced over those experts into
// `partials` (partial chunks, sent back).
void CombineRecv::reduce_forwarded(const std::vector<const char*>& chunks,
                                   const std::vector<char*>& partials) const {
  const Topology& topo = lay.topology;
  const int K = lay.top_k, L = lay.num_local_experts, per_node = topo.ranks_per_node;
  const int r = mem->rank(), n = topo.node_of(r);
  const int first = topo.rank_of(n, 0), last = first + per_node;
  const int64_t H = lay.hidden;
  std::vector<float> decoded(use_logfmt ? H : 0);
  check_stamps_range(
      "ll_combine", r, first, last, generation, seq,
      [&](int d) -> const Stamp& { return header(d)->stamp; },
      [&](int) { return cat("combine slot ", slot, " at"); });
  std::vector<int64_t> row_in_block, num_selected;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int m = static_cast<int>(c) < n ? static_cast<int>(c) : static_cast<int>(c) + 1;
    const int s = topo.rank_of(m, topo.local_of(r));
    const int64_t rows = reinterpret_cast<const LlForwardHeader*>(chunks[c])->num_rows;
    const auto* topk = reinterpret_cast<const int32_t*>(chunks[c] + lay.forward_topk_off);
    const auto* w = reinterpret_cast<const float*>(chunks[c] + lay.forward_weights_off);
    number_rows(topk, rows, K, num_experts, row_in_block, num_selected);
    check_counts(s, num_selected, first * L, last * L, cat(" of rank ", s).c_str());
    auto* partial = reinterpret_cast<float*>(partials[c] + lay.partial_off);
    reinterpret_cast<LlPartialHeader*>(partials[c])->num_rows = rows;
    for (int p = first; p < last; ++p)
      std::memcpy(partials[c] + lay.partial_headers_off + (p - first) * sizeof(CombineHeader),
                  static_cast<const void*>(header(p)), sizeof(CombineHeader));
    for (int64_t i = 0; i < rows; ++i) {
      float* acc = partial + i * H;
      std::fill(acc, acc + H, 0.0f);
      for (int k = 0; k < K; ++k) {
        const int32_t e = topk[i * K + k];
        if (e < 0 || e / L < first || e / L >= last) continue;
        add_row(e, s, row_in_block[i * K + k], w[i * K + k], acc, decoded.data());
      }
    }
  }
}

// The forward stage across nodes: returns the error that stopped it on this rank (the partials
// it sent say so too); `partials` receives the other nodes' partial chunks of this rank's tokens.
std::exception_ptr CombineRecv::forward(std::vector<const char*>& partials) const {
  const Topology& topo = lay.topology;
  const int K = lay.top_k, L = lay.num_local_experts, per_node = topo.ranks_per_node;
  const int n = topo.node_of(mem->rank());
  std::vector<RailChunk> sends, recvs;
  for (int m = 0; m < topo.num_nodes; ++m) {
    if (m == n) continue;
    const int i = Topology::other_index(m, n);
    char* chunk = reinterpret_cast<char*>(st->rail_sends.chunk(i, lay.rail_chunk_bytes()));
    auto* topk_out = reinterpret_cast<int32_t*>(chunk + lay.forward_topk_off);
    auto* w_out = reinterpret_cast<float*>(chunk + lay.forward_weights_off);
    int64_t rows = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      bool goes = false;
      for (int k = 0; k < K; ++k)
        goes |= topk[t * K + k] >= 0 && topk[t * K + k] / L / per_node == m;
      if (!goes) continue;
      std::copy_n(topk.begin() + t * K, K, topk_out + rows * K);
      std::copy_n(weights.begin() + t * K, K, w_out + rows * K);
      ++rows;
    }
    reinterpret_cast<LlForwardHeader*>(chunk)->num_rows = rows;
    sends.push_back({m, chunk, lay.forward_bytes});
    recvs.push_back({m, st->rail_recvs.chunk(i, lay.rail_chunk_bytes()), lay.forward_bytes});
  }
  std::exception_ptr error = run_noting_error(
      [&] { rail->exchange("ll_combine (rail, forward)", sends, recvs, nullptr); }, {});
  // The partials go out in the send chunks (the forward chunks are sent) and come back in host
  // chunks of their own (the forward chunks received are read while the partials are reduced).
  // A failed exchange or reduction goes into every partial's status.
  std::vector<const char*> chunks;
  std::vector<char*> outgoing, incoming;
  std::vector<RailStatus*> statuses;
  const int others = static_cast<int>(sends.size());
  for (int i = 0; i < others; ++i) {
    chunks.push_back(static_cast<const char*>(recvs[i].data));
    outgoing.push_back(reinterpret_cast<char*>(st->rail_sends.chunk(i, lay.rail_chunk_bytes())));
    incoming.push_back(
        reinterpret_cast<char*>(st->rail_recvs.chunk(others + i, lay.partial_bytes)));
    statuses.push_back(&reinterpret_cast<LlPartialHeader*>(outgoing.back())->status);
    statuses.back()->set_ok();
  }
  error = run_noting_error(
      [&] {
        if (error) std::rethrow_exception(error);
        reduce_forwarded(chunks, outgoing);
      },
      statuses);
  for (size_t i = 0; i < sends.size(); ++i) {
    sends[i] = {sends[i].node, outgoing[i], lay.partial_bytes};
    recvs[i] = {recvs[i].node, incoming[i], lay.partial_bytes};
  }
  const std::exception_ptr back = run_noting_error(
      [&] { rail->exchange("ll_combine (rail, partials)", sends, recvs, nullptr); }, {});
  for (char* p : incoming) partials.push_back(p);
  return error ? error : back;
}

void CombineRecv::operator()() const {
  const int64_t recv_start = steady_ns();
  const uint64_t masked_before = st->masked;
  const uint64_t missed = ll_barrier(*transport, *st, "ll_combine (receive)");
  const int64_t barrier_end = steady_ns();
  std::vector<const char*> partials;  // [N - 1], slot other_index(m, n)
  const std::exception_ptr forward_error = rail ? forward(partials) : nullptr;
  // A mismatch is raised after the release barrier, so peers are not left waiting.
  auto release = [&] { ll_barrier(*transport, *st, "ll_combine (release)"); };
  pull_then(release, [&] {
    if (forward_error) std::rethrow_exception(forward_error);
    const Topology& topo = lay.topology;
    const int R = lay.num_ranks, L = lay.num_local_experts, K = lay.top_k, E = num_experts;
    const int r = mem->rank(), n = topo.node_of(r), per_node = topo.ranks_per_node;
    const int first = topo.rank_of(n, 0), last = first + per_node;  // this node's ranks
    const int64_t H = lay.hidden, T = num_tokens;
    auto partial_of = [&](int m) { return partials[Topology::other_index(m, n)]; };
    raise_forwarder_errors("ll_combine", topo, r, [&](int m) -> const RailStatus& {
      return reinterpret_cast<const LlPartialHeader*>(partial_of(m))->status;
    });
    // Every expert rank's header: this node's in their regions, the others' in the partials.
    auto header_of = [&](int d) {
      const int m = topo.node_of(d);
      if (m == n) return header(d);
      return reinterpret_cast<const CombineHeader*>(partial_of(m) + lay.partial_headers_off) +
             topo.local_of(d);
    };
    auto stamp = [&](int d) -> const Stamp& { return header_of(d)->stamp; };
    // Masked expert ranks (enable_shrink) are not read: their terms are left out.
    const uint64_t masked = mask_maskers(
        *st, r, R, [&](int d) { return header_of(d)->masked.load(std::memory_order_relaxed); });
    check_stamps(
        "ll_combine", r, R, generation, seq, stamp,
        [&](int) { return cat("combine slot ", slot, " at"); }, masked);
    auto is_masked = [&](int d) { return (masked >> d & 1) != 0; };
    std::vector<int64_t> published_ns(R), logfmt_of(R), overlap_of(R);
    for (int d = 0; d < R; ++d) {
      // A rank masked during this call counts the time until it was masked.
      published_ns[d] = (masked_before >> d & 1) ? recv_start
                        : (missed >> d & 1)      ? barrier_end
                                                 : header_of(d)->published_ns;
      logfmt_of[d] = header_of(is_masked(d) ? r : d)->use_logfmt;
      overlap_of[d] = header_of(is_masked(d) ? r : d)->overlap;
    }
    // Every rank reads every header, so all raise together.
    EPX_CHECK_ARG(all_equal(logfmt_of),
                  differs_message("ll_combine", "argument 'use_logfmt'", logfmt_of, show_bool));
    EPX_CHECK_ARG(all_equal(overlap_of),
                  differs_message("ll_combine", "whether argument 'overlap' is given", overlap_of,
                                  show_bool));
    // row_in_block[t * K + k]: j of y(t, k); num_selected[e]: this rank's tokens on e. Checked
    // here for this node's experts, by the forwarders for the others'.
    std::vector<int64_t> row_in_block, num_selected;
    number_rows(topk.data(), T, K, E, row_in_block, num_selected);
    check_counts(r, num_selected, first * L, last * L, "", masked);
    std::vector<float> acc(H), decoded(use_logfmt ? H : 0);
    std::vector<int64_t> partial_row(topo.num_nodes, 0);  // next row of each node's partials
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < K; ++k) {
        const int32_t e = topk[t * K + k];
        if (e == -1 || e / L < first || e / L >= last || is_masked(e / L)) continue;
        add_row(e, r, row_in_block[t * K + k], weights[t * K + k], acc.data(), decoded.data());
      }
      for (int m = 0; m < topo.num_nodes; ++m) {
        bool went = false;
        for (int k = 0; k < K && m != n; ++k)
          went |= topk[t * K + k] >= 0 && topk[t * K + k] / L / per_node == m;
        if (!went) continue;
        const char* chunk = partial_of(m);
        const float* p =
            next_partial_row("ll_combine", m, partial_row[m],
                             reinterpret_cast<const LlPartialHeader*>(chunk)->num_rows,
                             reinterpret_cast<const float*>(chunk + lay.partial_off), H);
        for (int64_t c = 0; c < H; ++c) acc[c] += p[c];
      }
      uint16_t* o = out.ptr<uint16_t>() + t * out.strides[0];
      for (int64_t c = 0; c < H; ++c) o[c] = f32_to_bf16(acc[c]);
    }
    recheck_stamps("ll_combine", r, R, generation, seq, stamp, masked);
    if (T > 0) add_wait_costs(wait_stats, published_ns, recv_start);  // T = 0: nothing awaited
  });
}

// Overlap: rows [b * block, ...) of local expert l may be read once signal l * blocks + b is
// reached; spins, then yields, then sleeps 50 us (as the transport's barrier), bounded by the
// group's timeout.
void wait_overlap_signal(const LlCombineOverlap& o, int64_t blocks, int l, int64_t b, int rank,
                         std::chrono::milliseconds timeout) {
  const int64_t idx = l * blocks + b;
  int32_t* signal = o.signals.ptr<int32_t>() + idx;
  const auto want = static_cast<uint32_t>(o.expected);
  auto reached = [&](int32_t v) {
    return static_cast<int32_t>(static_cast<uint32_t>(v) - want) >= 0;
  };
  for (HostBackoff backoff(timeout);;) {
    const int32_t v = __atomic_load_n(signal, __ATOMIC_ACQUIRE);  // pairs with the GEMM's release
    if (reached(v)) return;
    if (!backoff.pause()) {
      throw_error(
          ErrorCode::kTimeout,
          cat("ll_combine: rank ", rank, " waited ", timeout.count(),
              " ms for the GEMM's signal of local expert ", l, ", block ", b, " (overlap.signals[",
              idx, "] wanted >= ", want, ", seen ", static_cast<uint32_t>(v),
              "); the ll state of this buffer is unusable until "
              "ll_clean() (the caller raises every signal of its GEMM, after zeroing them)"));
    }
  }
}

// Overlap: recv_count, when given, is the handle's (host-visible on the cpu backend: raised
// before this rank publishes, as a bad argument).
void check_overlap_recv_count(const LlCombineOverlap& o, const std::vector<int64_t>& num_rows) {
  if (!o.recv_count.defined()) return;
  for (size_t l = 0; l < num_rows.size(); ++l) {
    const int32_t v =
        o.recv_count.ptr<int32_t>()[static_cast<int64_t>(l) * o.recv_count.strides[0]];
    EPX_CHECK_ARG(v == num_rows[l], "ll_combine: argument 'overlap.recv_count' has [", l, "] = ", v,
                  ", expected ", num_rows[l],
                  " (the recv_count of the dispatch that made 'handle')");
  }
}

}  // namespace

LlCombineResult CpuBuffer::ll_combine(const LlCombineArgs& args, const Allocator& alloc) {
  CpuLlState& st = state_of(ll_state_);
  const LlHandle& h = *args.handle;
  const int R = group.size();
  const LlLayout lay(shape, R, topology_);
  const int L = lay.num_local_experts, K = lay.top_k;
  const int64_t H = lay.hidden, RT = lay.rows_per_expert, T = h.num_tokens;
  const int slot = h.slot;
  st.step.require_in_step("ll_combine", kLlReset);
  EPX_CHECK_ARG(!st.combine_in_flight[slot], "ll_combine: combine slot ", slot,
                " still holds a combine whose hook was not called; expected its hook to be called "
                "before another combine through a handle of slot ",
                slot);
  // Expert l's rows [0, num_rows[l]) hold data (every source's block, packed).
  const TensorView& range = h.layout_range;
  std::vector<int64_t> num_rows(L, 0);
  for (int l = 0; l < L; ++l) {
    for (int s = 0; s < R; ++s) {
      const int64_t v = element<int64_t>(range, l, s);
      num_rows[l] = std::max(num_rows[l], std::min((v >> 32) + (v & 0xFFFFFFFF), RT));
    }
  }
  const LlCombineOverlap* overlap = args.overlap ? &*args.overlap : nullptr;
  if (overlap) check_overlap_recv_count(*overlap, num_rows);

  const uint64_t seq = ++st.num_combines;

  // Publish: header, this rank's layout_range, y's valid rows (unless already there), encoded
  // with use_logfmt; with overlap, block by block as their signals are reached.
  char* region = static_cast<char*>(ll_mem_->local()) + lay.combine_off(slot);
  auto* header = reinterpret_cast<CombineHeader*>(region);
  header->stamp.begin_publish();
  header->use_logfmt = args.use_logfmt;
  header->overlap = overlap != nullptr;
  auto* layout = reinterpret_cast<int64_t*>(region + lay.layout_off);
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < R; ++s) layout[l * R + s] = element<int64_t>(range, l, s);
  auto* y = reinterpret_cast<uint16_t*>(region + lay.y_off);
  auto* meta = reinterpret_cast<uint32_t*>(region + lay.meta_off);
  const bool copy_rows = !args.zero_copy || args.use_logfmt;
  const int64_t blocks = overlap ? ll_overlap_blocks(shape, R, overlap->block_rows) : 1;
  for (int l = 0; l < L; ++l) {
    const int64_t block = overlap && overlap->block_rows > 0 ? overlap->block_rows : num_rows[l];
    for (int64_t b = 0; b * block < num_rows[l]; ++b) {
      if (overlap) {
        try {
          wait_overlap_signal(*overlap, blocks, l, b, group.rank(), group.timeout());
        } catch (const Error& e) {
          st.step.failed(e);
          throw;
        }
      }
      for (int64_t row = b * block; copy_rows && row < std::min((b + 1) * block, num_rows[l]);
           ++row) {
        uint16_t* dst = y + (l * RT + row) * H;
        const uint16_t* src = args.zero_copy ? dst
                                             : args.y.ptr<uint16_t>() + l * args.y.strides[0] +
                                                   row * args.y.strides[1];
        if (args.use_logfmt) {
          logfmt_encode_row(src, H, reinterpret_cast<uint8_t*>(dst),
                            meta + (l * RT + row) * lay.num_groups);
        } else {
          std::memcpy(dst, src, sizeof(uint16_t) * H);
        }
      }
    }
  }
  header->published_ns = steady_ns();
  header->masked.store(st.masked, std::memory_order_relaxed);
  header->stamp.end_publish(st.step.generation, seq);

  LlCombineResult res;
  if (args.out.defined()) {
    static_cast<TensorView&>(res.out) = args.out;
  } else {
    res.out = alloc(DType::kBF16, {T, H}, Device::cpu());
  }
  CombineRecv recv{
      {group.transport(), ll_mem_, ll_rail_, ll_state_, lay, slot, st.step.generation, seq},
      T,
      shape.num_experts,
      args.use_logfmt,
      {},
      {},
      res.out,
      args.combine_wait_recv_cost_stats};
  recv.topk.resize(T * K);
  recv.weights.resize(T * K);
  const TensorView& w = args.topk_weights;
  for (int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      recv.topk[t * K + k] = static_cast<int32_t>(topk_at(args.topk_idx, t, k));
      recv.weights[t * K + k] = element<float>(w, t, k);
    }
  }
  res.hook = receive_or_hook(ll_state_, false, slot, args.return_recv_hook, std::move(recv));
  return res;
}

TensorView CpuBuffer::ll_next_combine_buffer(const LlHandle& handle) {
  CpuLlState& st = state_of(ll_state_);
  const LlLayout lay(shape, group.size(), topology_);
  st.step.require_in_step("ll_next_combine_buffer", kLlReset);
  EPX_CHECK_ARG(!st.combine_in_flight[handle.slot], "ll_next_combine_buffer: combine slot ",
                handle.slot,
                " still holds a combine whose hook was not called; expected its "
                "hook to be called before writing the next expert outputs there");
  char* y = static_cast<char*>(ll_mem_->local()) + lay.combine_off(handle.slot) + lay.y_off;
  return TensorView::contiguous(y, DType::kBF16,
                                {lay.num_local_experts, lay.rows_per_expert, lay.hidden});
}

}  // namespace epx::detail
