// src/cpu/ll.cc — the ll mode of the cpu reference backend (docs/semantics.md §2): state,
// dispatch, clean; the combine is in ll_combine.cc, the region layout in ll_region.h.
//
// Data flow on rank r (R ranks, L = E / R local experts, T_max = shape.max_tokens_per_rank,
// G = H / 128 quantisation groups, RT = R * T_max rows per local expert):
//
//   ll_dispatch, send (publish): write this rank's T, topk_idx (as int32) and one message per
//     token into dispatch slot s of its own region. A message is the token's bf16 row, or with
//     use_fp8 its e4m3 row followed by its G float32 scales (quantize_row_fp8 of core/numeric.h),
//     or with use_nvfp4 its e2m1 pairs [H/2] followed by its e4m3 scales [H/16]
//     (quantize_row_nvfp4 of core/quant.h), quantised once per token on the sender, as the cuda
//     kernel does. Across nodes the rail carries the messages (any format) byte for byte.
//   ll_dispatch, receive (inline, or in the hook): across nodes (N nodes > 1) first the rail:
//     rank (n, g) packs, for every other node m, the messages of its tokens that select an expert
//     of m (each once, ascending, with their topk rows and token indices) and exchanges them with
//     (m, g), receiving into slot s's rail section (the cpu rail is collective and synchronous, so
//     the receive half, not the send half, packs and exchanges). Then barrier; for each source
//     rank src ascending — read from its region when it is on r's node, else from the chunk r's
//     forwarder for it (the rank of r's node with src's local index) received — for each source
//     token t ascending, for each local expert l the token selects (a token that lists the same
//     expert several times in its row counts ONCE for that expert and gets one row): copy message
//     t to recv_x[l][row_l++], src_info[l][row] = t; then layout_range[l][src] = (begin << 32) |
//     count of that source's block; recv_count[l] = row_l; dispatch_wait_recv_cost_stats[src] +=
//     max(0, published_ns(src) - recv_start) (below); barrier (no rank reuses slot s before every
//     peer finished reading it). The same rows on every topology.
//       recv_x      [L, RT, H]  fp8 e4m3 or bf16, rows >= recv_count[l] are not written
//       recv_scales f32 [L, RT, G], or UE8M0 int32 [L, RT, ceil(G / 4)] (group g in byte g % 4 of
//                   int g / 4, unused bytes 0); storage [L, G', RT], so the view has strides
//                   {G' * RT, 1, RT} (column-major in the last two dims)
//       NVFP4: recv_x u8 storage [L, RT, H/2]; recv_scales e4m3 storage [L, ceil(RT/128), H/64,
//                   32, 4, 4] = per expert the interleaved layout (core/quant.h nvfp4_sf_offset);
//                   both returned as the views of core/quant.h set_ll_nvfp4_views
//   ll_combine: ll_combine.cc.
//
// Rank masks (enable_shrink, docs/semantics.md §2.6): the receive's barriers run over the ranks
// this rank does not mask and mask those that miss them (ll_barrier: Timeout becomes a mask);
// then a source this rank masks, or whose header says it masks this rank (mask_maskers), is not
// read: none of its tokens, layout_range[l][src] = (rows before it) << 32 | 0. One node only.
//
// Wait-cost statistics (docs/semantics.md §2.5). A receive waits for its sources in one barrier,
// so it cannot see when each of them arrived; the publisher says so instead: every header carries
// published_ns, the steady clock (CLOCK_MONOTONIC: one clock for all threads and processes of
// the host) when its publication ended, and the receive notes recv_start, the steady clock when
// it began waiting (entry of the receive half: right after the publish, or when the hook was
// called). Source s's wait is max(0, published_ns(s) - recv_start): the nanoseconds this rank
// waited for s's data, 0 for data that was already there (this rank's own, and a hook called
// late). Added after the pull succeeded (with cumulative_local_expert_recv_stats), never on an
// error. Across nodes a source's header reaches the other nodes in its chunk (dispatch) or in
// its node's partials (combine), published_ns included.
//
// Double buffering. Each ll_dispatch takes dispatch slot (number of dispatches so far) % 2; its
// handle records it (handle.slot) and ll_combine(handle) publishes into combine slot handle.slot.
// Headers carry a per-kind sequence number, so ranks that called ll operations in different
// orders get an error, not wrong data. Legal interleavings (every rank calls the same operations
// and hooks in the same order):
//   - any sequence of calls without hooks, e.g. dispatch; combine; dispatch; combine;
//   - at most two dispatches waiting for their hooks, e.g. dispatch(A, hook); dispatch(B, hook);
//     hookA(); hookB() (or hookB(); hookA()), with any other calls in between (combines, a
//     non-hook dispatch when only one hook is pending), e.g. the two-batch overlap
//     dispatch(A); hookA; dispatch(B); combine(A); hookB; combine(B); hook_cA; hook_cB;
//   - at most one combine per combine slot waiting for its hook;
//   - zero_copy: ll_next_combine_buffer(h) is the same memory for every handle of slot h.slot
//     (dispatches 2 apart): write it for one handle at a time, and only once the previous combine
//     through that slot has finished (its hook ran);
//   - caller-owned views a hook writes (cumulative_local_expert_recv_stats, the wait-cost stats,
//     out) must stay alive until the hook ran (the outputs the library allocated are kept alive
//     by the hook).
// Misuse is reported, never silently wrong: a third dispatch while two wait for their hooks, a
// combine or ll_next_combine_buffer on a combine slot whose combine still waits, a second call of
// a hook and a hook called after ll_clean throw InvalidArgument.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/numeric.h"
#include "core/quant.h"
#include "core/validate.h"
#include "cpu/ll_region.h"

namespace epx::detail {

void add_wait_costs(const TensorView& stats, const std::vector<int64_t>& published_ns,
                    int64_t recv_start) {
  if (!stats.defined()) return;
  auto* out = stats.ptr<int64_t>();
  for (size_t s = 0; s < published_ns.size(); ++s)
    out[s] += std::max<int64_t>(0, published_ns[s] - recv_start);
}

LlLayout::LlLayout(const MoeShape& s, int R, Topology topo)
    : num_ranks(R),
      num_local_experts(s.num_local_experts(R)),
      top_k(s.top_k),
      topology(topo),
      max_tokens(s.max_tokens_per_rank),
      hidden(s.hidden),
      num_groups((s.hidden + kQuantGroup - 1) / kQuantGroup),
      rows_per_expert(R * s.max_tokens_per_rank) {
  const size_t H = static_cast<size_t>(hidden), G = static_cast<size_t>(num_groups);
  const size_t Tm = static_cast<size_t>(max_tokens), K = static_cast<size_t>(top_k);
  msg_bytes = align_up(std::max(2 * H, H + 4 * G), 16);  // >= the NVFP4 message's 9 H / 16
  topk_off = align_up(std::max(sizeof(DispatchHeader), sizeof(LlChunkHeader)), kLlAlign);
  msgs_off = topk_off + align_up(sizeof(int32_t) * Tm * K, kLlAlign);
  own_bytes = msgs_off + align_up(msg_bytes * Tm, kLlAlign);
  chunk_src_off = own_bytes;
  chunk_bytes = chunk_src_off + align_up(sizeof(int32_t) * Tm, kLlAlign);
  dispatch_slot_bytes = own_bytes + static_cast<size_t>(topology.num_nodes - 1) * chunk_bytes;
  forward_topk_off = align_up(sizeof(LlForwardHeader), kLlAlign);
  forward_weights_off = forward_topk_off + align_up(sizeof(int32_t) * Tm * K, kLlAlign);
  forward_bytes = forward_weights_off + align_up(sizeof(float) * Tm * K, kLlAlign);
  partial_headers_off = align_up(sizeof(LlPartialHeader), kLlAlign);
  partial_off =
      partial_headers_off + align_up(sizeof(CombineHeader) * topology.ranks_per_node, kLlAlign);
  partial_bytes = partial_off + align_up(sizeof(float) * Tm * H, kLlAlign);
  layout_off = align_up(sizeof(CombineHeader), kLlAlign);
  meta_off = layout_off + align_up(sizeof(int64_t) * num_local_experts * R, kLlAlign);
  y_off = meta_off + align_up(sizeof(uint32_t) * num_local_experts * rows_per_expert * G, kLlAlign);
  combine_slot_bytes =
      y_off + align_up(sizeof(uint16_t) * num_local_experts * rows_per_expert * H, kLlAlign);
}

CpuLlState& state_of(std::shared_ptr<CpuLlState>& p) {
  if (!p) p = std::make_shared<CpuLlState>();
  return *p;
}

uint64_t ll_barrier(Transport& transport, CpuLlState& st, const char* what, int timeout_multiple) {
  if (!st.shrink) {
    transport.barrier(what);
    return 0;
  }
  const uint64_t missing = transport.barrier_or_missing(what, transport.all_members() & ~st.masked,
                                                        timeout_multiple * transport.timeout());
  st.masked |= missing;
  return missing;
}

uint64_t mask_maskers(CpuLlState& st, int rank, int num_ranks,
                      const std::function<uint64_t(int)>& masked_of) {
  for (int p = 0; st.shrink && p < num_ranks; ++p)
    if (p != rank && !(st.masked >> p & 1) && (masked_of(p) >> rank & 1))
      st.masked |= uint64_t{1} << p;
  return st.masked;
}

LlHook receive_or_hook(const std::shared_ptr<CpuLlState>& st, bool is_dispatch, int slot,
                       bool return_recv_hook, std::function<void()> receive) {
  // A Timeout in the receive refuses later ll operations until ll_clean / reset.
  auto receive_noting_timeouts = [st, receive = std::move(receive)] {
    try {
      receive();
    } catch (const Error& e) {
      st->step.failed(e);
      throw;
    }
  };
  if (!return_recv_hook) {
    receive_noting_timeouts();
    return {};
  }
  (is_dispatch ? st->dispatch_in_flight : st->combine_in_flight)[slot] = true;
  const uint64_t generation = st->generation;
  auto called = std::make_shared<bool>(false);
  return [st, is_dispatch, slot, receive = std::move(receive_noting_timeouts), called,
          generation]() {
    const char* op = is_dispatch ? "ll_dispatch hook" : "ll_combine hook";
    EPX_CHECK_ARG(!*called, op, ": called a second time, expected exactly one call per operation");
    EPX_CHECK_ARG(st->generation == generation, op,
                  ": its operation was discarded by ll_clean, expected the hook to be called "
                  "before ll_clean");
    st->step.require_in_step(op, kLlReset);
    *called = true;
    bool& in_flight = is_dispatch ? st->dispatch_in_flight[slot] : st->combine_in_flight[slot];
    struct Release {
      bool& flag;
      ~Release() { flag = false; }
    } release{in_flight};
    receive();
  };
}

// ---- dispatch ------------------------------------------------------------------------------

namespace {

// Where rank r's receive finds source s's dispatch (slot `slot`): s's region when s is on r's
// node, else the chunk r's forwarder for s received from it. Both have s's topk rows at
// lay.topk_off and its messages at lay.msgs_off.
struct LlSource {
  const char* base;
  const DispatchHeader* header;
  const int32_t* src_idx;  // source token of each row; null: row i is token i
  int64_t num_rows;

  int64_t token(int64_t row) const { return src_idx ? src_idx[row] : row; }
};

LlSource ll_source(const SymmetricMemory& mem, const LlLayout& lay, int slot, int s) {
  const Topology& topo = lay.topology;
  const int n = topo.node_of(mem.rank());
  if (topo.node_of(s) == n) {
    const char* base = static_cast<const char*>(mem.peer(s)) + lay.dispatch_off(slot);
    const auto* header = reinterpret_cast<const DispatchHeader*>(base);
    return {base, header, nullptr, header->num_tokens};
  }
  const int forwarder = topo.rank_of(n, topo.local_of(s));
  const char* base = static_cast<const char*>(mem.peer(forwarder)) +
                     lay.chunk_off(slot, Topology::other_index(topo.node_of(s), n));
  const auto* chunk = reinterpret_cast<const LlChunkHeader*>(base);
  return {base, &chunk->source, reinterpret_cast<const int32_t*>(base + lay.chunk_src_off),
          chunk->num_rows};
}

// Everything the receive half of a dispatch needs; copied into the hook.
struct DispatchRecv : LlReceive {
  bool use_fp8, round_scale, use_ue8m0, use_nvfp4;
  Tensor recv_x, recv_scales, recv_count, src_info, layout_range;
  TensorView stats;       // optional, caller-owned
  TensorView wait_stats;  // optional, caller-owned: dispatch_wait_recv_cost_stats

  void operator()() const;
  void exchange_chunks() const;
};

// Across nodes: this rank's messages for every other node m (its tokens that select an expert
// there), packed from its published slot into chunk m and exchanged over the rail; the chunks
// of the other nodes' ranks of this local index land in this rank's rail section of the slot.
void DispatchRecv::exchange_chunks() const {
  const Topology& topo = lay.topology;
  const int K = lay.top_k, L = lay.num_local_experts, per_node = topo.ranks_per_node;
  const int n = topo.node_of(mem->rank());
  char* own = static_cast<char*>(mem->local()) + lay.dispatch_off(slot);
  const auto* header = reinterpret_cast<const DispatchHeader*>(own);
  const auto* topk = reinterpret_cast<const int32_t*>(own + lay.topk_off);
  std::vector<RailChunk> sends, recvs;
  for (int m = 0; m < topo.num_nodes; ++m) {
    if (m == n) continue;
    const int i = Topology::other_index(m, n);
    char* chunk = reinterpret_cast<char*>(st->rail_sends.chunk(i, lay.chunk_bytes));
    auto* ch = reinterpret_cast<LlChunkHeader*>(chunk);
    std::memcpy(static_cast<void*>(&ch->source), header, sizeof(DispatchHeader));
    ch->source.stamp.end_publish(generation, seq);
    auto* src_idx = reinterpret_cast<int32_t*>(chunk + lay.chunk_src_off);
    int64_t rows = 0;
    for (int64_t t = 0; t < header->num_tokens; ++t) {
      bool goes = false;
      for (int k = 0; k < K; ++k)
        goes |= topk[t * K + k] >= 0 && topk[t * K + k] / L / per_node == m;
      if (!goes) continue;
      std::memcpy(chunk + lay.topk_off + rows * K * sizeof(int32_t), topk + t * K,
                  K * sizeof(int32_t));
      std::memcpy(chunk + lay.msgs_off + rows * lay.msg_bytes,
                  own + lay.msgs_off + t * lay.msg_bytes, lay.msg_bytes);
      src_idx[rows++] = static_cast<int32_t>(t);
    }
    ch->num_rows = rows;
    sends.push_back({m, chunk, lay.chunk_bytes});
    recvs.push_back(
        {m, static_cast<char*>(mem->local()) + lay.chunk_off(slot, i), lay.chunk_bytes});
  }
  rail->exchange("ll_dispatch (rail)", sends, recvs, nullptr);
}

void DispatchRecv::operator()() const {
  const int64_t recv_start = steady_ns();
  std::exception_ptr rail_error;
  if (rail) rail_error = run_noting_error([&] { exchange_chunks(); }, {});
  const uint64_t masked_before = st->masked;
  const uint64_t missed = ll_barrier(*transport, *st, "ll_dispatch (receive)");
  const int64_t barrier_end = steady_ns();
  // A mismatch is raised after the release barrier, so peers are not left waiting.
  auto release = [&] { ll_barrier(*transport, *st, "ll_dispatch (release)"); };
  pull_then(release, [&] {
    if (rail_error) std::rethrow_exception(rail_error);
    const int R = lay.num_ranks, L = lay.num_local_experts, K = lay.top_k;
    const int r = mem->rank();
    const int64_t H = lay.hidden, G = lay.num_groups, RT = lay.rows_per_expert;
    const int64_t packed_groups = (G + 3) / 4;
    const size_t row_bytes = use_nvfp4 ? H / 2 : use_fp8 ? H : 2 * H;
    const int64_t num_sf = H / kNvfp4Block;  // NVFP4 scales per row
    const int64_t sf_expert_bytes = ll_nvfp4_scale_expert_bytes(RT, H);

    auto* out_x = static_cast<uint8_t*>(recv_x.data);
    auto* out_src = src_info.ptr<int32_t>();
    auto* out_range = layout_range.ptr<int64_t>();
    std::vector<int64_t> num_rows(L, 0);
    std::vector<std::vector<int32_t>> rows_of(L);  // this source's rows per local expert
    std::vector<float> scales(G);                  // one message's scales

    // Every source in this dispatch, with the same quantisation options (every rank reads every
    // header, so all raise together, naming each differing option with each rank's value).
    // Masked sources (enable_shrink) are not read: no tokens from them, as if they had none.
    std::vector<LlSource> sources;
    for (int s = 0; s < R; ++s) sources.push_back(ll_source(*mem, lay, slot, s));
    auto stamp = [&](int src) -> const Stamp& { return sources[src].header->stamp; };
    const uint64_t masked = mask_maskers(*st, r, R, [&](int src) {
      return sources[src].header->masked.load(std::memory_order_relaxed);
    });
    check_stamps(
        "ll_dispatch", r, R, generation, seq, stamp,
        [&](int) { return cat("dispatch slot ", slot, " at"); }, masked);
    auto is_masked = [&](int src) { return (masked >> src & 1) != 0; };
    std::vector<int64_t> fp8_of(R), round_of(R), nvfp4_of(R), scale_of(R), published_ns(R);
    for (int src = 0; src < R; ++src) {
      const DispatchHeader& h = *sources[is_masked(src) ? r : src].header;
      fp8_of[src] = h.use_fp8;
      round_of[src] = h.round_scale;
      nvfp4_of[src] = h.use_nvfp4;
      scale_of[src] = h.global_scale_bits;
      // A source masked during this call counts the time until it was masked.
      published_ns[src] = (masked_before >> src & 1) ? recv_start
                          : (missed >> src & 1)      ? barrier_end
                                                     : sources[src].header->published_ns;
    }
    std::string differ;
    auto note = [&](const char* name, const std::vector<int64_t>& v, ShowValue show) {
      if (!all_equal(v))
        differ += cat(differ.empty() ? "" : "; ", "argument '", name,
                      "' differs across ranks: ", per_rank_values(v, show));
    };
    note("use_fp8", fp8_of, show_bool);
    note("round_scale", round_of, show_bool);
    note("use_nvfp4", nvfp4_of, show_bool);
    if (all_equal(nvfp4_of) && nvfp4_of[0]) note("x_global_scale", scale_of, show_f32_bits);
    EPX_CHECK_ARG(differ.empty(), "ll_dispatch: ", differ, "; expected the same on every rank");

    for (int src = 0; src < R; ++src) {
      if (is_masked(src)) {
        for (int l = 0; l < L; ++l) out_range[l * R + src] = num_rows[l] << 32;
        continue;
      }
      const LlSource& source = sources[src];
      const DispatchHeader& h = *source.header;
      EPX_CHECK_ARG(
          h.num_tokens >= 0 && h.num_tokens <= lay.max_tokens && source.num_rows <= h.num_tokens,
          "ll_dispatch: rank ", src, " published T = ", h.num_tokens, ", expected 0..",
          lay.max_tokens);
      for (auto& v : rows_of) v.clear();
      const auto* topk = reinterpret_cast<const int32_t*>(source.base + lay.topk_off);
      for (int64_t i = 0; i < source.num_rows; ++i) {
        const int32_t* row = topk + i * K;
        for (int k = 0; k < K; ++k) {
          const int32_t e = row[k];
          if (e < 0 || e / L != r) continue;
          if (std::find(row, row + k, e) != row + k) continue;  // duplicate: one row
          rows_of[e % L].push_back(static_cast<int32_t>(i));
        }
      }
      for (int l = 0; l < L; ++l) {
        const int64_t begin = num_rows[l];
        for (int32_t i : rows_of[l]) {
          const int64_t row = num_rows[l]++;
          const char* msg = source.base + lay.msgs_off + static_cast<size_t>(i) * lay.msg_bytes;
          std::memcpy(out_x + (l * RT + row) * row_bytes, msg, row_bytes);
          out_src[l * RT + row] = static_cast<int32_t>(source.token(i));
          if (use_nvfp4) {
            auto* sf = static_cast<uint8_t*>(recv_scales.data) + l * sf_expert_bytes;
            for (int64_t j = 0; j < num_sf; ++j)
              sf[nvfp4_sf_offset(row, j, num_sf)] = static_cast<uint8_t>(msg[H / 2 + j]);
          }
          if (!use_fp8) continue;
          std::memcpy(scales.data(), msg + H, sizeof(float) * G);
          if (!use_ue8m0) {
            for (int64_t g = 0; g < G; ++g)
              recv_scales.ptr<float>()[(l * G + g) * RT + row] = scales[g];
          } else {
            for (int64_t p = 0; p < packed_groups; ++p) {
              uint32_t word = 0;
              for (int64_t g = 4 * p; g < std::min(G, 4 * p + 4); ++g)
                word |= static_cast<uint32_t>(ue8m0_of_scale(scales[g])) << (8 * (g % 4));
              recv_scales.ptr<int32_t>()[(l * packed_groups + p) * RT + row] =
                  static_cast<int32_t>(word);
            }
          }
        }
        out_range[l * R + src] = (begin << 32) | static_cast<int64_t>(rows_of[l].size());
      }
    }
    recheck_stamps("ll_dispatch", r, R, generation, seq, stamp, masked);
    for (int l = 0; l < L; ++l) {
      recv_count.ptr<int32_t>()[l] = static_cast<int32_t>(num_rows[l]);
      if (stats.defined())
        stats.ptr<int32_t>()[l * stats.strides[0]] += static_cast<int32_t>(num_rows[l]);
    }
    add_wait_costs(wait_stats, published_ns, recv_start);
  });
}

}  // namespace

size_t cpu_ll_region_bytes(const MoeShape& shape, int num_ranks, Topology topology) {
  return LlLayout(shape, num_ranks, topology).total_bytes();
}

size_t cpu_ll_rail_chunk_bytes(const MoeShape& shape, int num_ranks, Topology topology) {
  return LlLayout(shape, num_ranks, topology).rail_chunk_bytes();
}

size_t cpu_ll_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  const Topology topology{num_nodes, num_ranks / num_nodes};
  const LlLayout lay(shape, num_ranks, topology);
  return lay.total_bytes() +
         (topology.hierarchical() ? cpu_rail_bytes(topology, lay.rail_chunk_bytes()) : 0);
}

LlDispatchResult CpuBuffer::ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  CpuLlState& st = state_of(ll_state_);
  const int R = group.size();
  const LlLayout lay(shape, R, topology_);
  const int L = lay.num_local_experts, K = lay.top_k;
  const int64_t H = lay.hidden, RT = lay.rows_per_expert;
  const int64_t T = args.x.shape[0];
  st.step.require_in_step("ll_dispatch", kLlReset);
  const int slot = static_cast<int>(st.num_dispatches % 2);
  EPX_CHECK_ARG(!st.dispatch_in_flight[slot], "ll_dispatch: dispatch slot ", slot,
                " still holds a dispatch whose hook was not called; expected at most two "
                "dispatches waiting for their hooks (call the older hook first)");
  const uint64_t seq = ++st.num_dispatches;

  // Publish: header, topk as int32, one message per token.
  char* region = static_cast<char*>(ll_mem_->local()) + lay.dispatch_off(slot);
  auto* header = reinterpret_cast<DispatchHeader*>(region);
  header->stamp.begin_publish();
  header->num_tokens = T;
  header->use_fp8 = args.use_fp8;
  header->round_scale = args.round_scale;
  header->use_nvfp4 = args.use_nvfp4;
  const float global_scale = args.use_nvfp4 ? ll_host_global_scale(args) : 0.0f;
  header->global_scale_bits = args.use_nvfp4 ? f32_bits(global_scale) : 0;
  auto* topk = reinterpret_cast<int32_t*>(region + lay.topk_off);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k)
      topk[t * K + k] = static_cast<int32_t>(topk_at(args.topk_idx, t, k));
  for (int64_t t = 0; t < T; ++t) {
    const auto* x = args.x.ptr<uint16_t>() + t * args.x.strides[0];
    char* msg = region + lay.msgs_off + static_cast<size_t>(t) * lay.msg_bytes;
    if (args.use_fp8) {
      quantize_row_fp8(x, H, args.round_scale, reinterpret_cast<uint8_t*>(msg),
                       reinterpret_cast<float*>(msg + H));
    } else if (args.use_nvfp4) {
      quantize_row_nvfp4(x, H, global_scale, reinterpret_cast<uint8_t*>(msg),
                         reinterpret_cast<uint8_t*>(msg + H / 2));
    } else {
      std::memcpy(msg, x, sizeof(uint16_t) * H);
    }
  }
  header->published_ns = steady_ns();
  header->masked.store(st.masked, std::memory_order_relaxed);
  header->stamp.end_publish(st.step.generation, seq);

  // Outputs, allocated now, filled by the receive half.
  LlDispatchResult res;
  allocate_ll_dispatch_outputs(
      res,
      [&](DType dt, const std::vector<int64_t>& s) { return alloc(dt, s, Device::cpu()); }, args,
      L, R, RT, H);
  res.handle.max_tokens = lay.max_tokens;
  res.handle.hidden = H;
  res.handle.num_experts = shape.num_experts;
  res.handle.num_tokens = T;
  res.handle.slot = slot;
  res.handle.buffer_id = id;

  DispatchRecv recv{
      {group.transport(), ll_mem_, ll_rail_, ll_state_, lay, slot, st.step.generation, seq},
      args.use_fp8,
      args.round_scale,
      args.use_ue8m0,
      args.use_nvfp4,
      res.recv_x,
      res.recv_scales,
      res.recv_count,
      res.handle.src_info,
      res.handle.layout_range,
      args.cumulative_local_expert_recv_stats,
      args.dispatch_wait_recv_cost_stats};
  res.hook = receive_or_hook(ll_state_, true, slot, args.return_recv_hook, std::move(recv));
  return res;
}

void CpuBuffer::ll_clean() {
  CpuLlState& st = state_of(ll_state_);
  if (!st.shrink) return reset_ll_state(resync("ll_clean"));
  // With nobody masked (a rejoin: every rank called ll_clean_mask) the ranks may have passed
  // different numbers of ll barriers: one that stopped calling while its peers masked it missed
  // the barriers of their calls. A resync over every rank brings them to one barrier epoch, the
  // new generation. If a rank does not come (it died), the resync times out on every live rank
  // alike (none passes it, so their barrier epochs stay as they were) and the clean goes on as
  // below, masking it.
  if (st.masked == 0) {
    try {
      return reset_ll_state(resync("ll_clean"));
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
    }
  }
  // Over the unmasked ranks, masking those that do not come within twice the timeout (a rank
  // may still be in an operation waiting for a rank only it does not mask yet): then none of
  // them runs an ll operation. The live ranks passed the same barriers (the ll barriers mask, they
  // never fail), so no resync is needed; a new generation keeps a late rank's headers from pairing.
  // (The cuda backend also needs a barrier after its reset: peers signal into its flags; here a
  // rank's headers are read only after its next operation's barrier.)
  ll_barrier(transport(), st, "ll_clean", 2);
  reset_ll_state(st.step.generation + 1);
}

void CpuBuffer::ll_update_mask(int rank, bool mask, Stream) {
  CpuLlState& st = state_of(ll_state_);
  const uint64_t bit = uint64_t{1} << rank;
  st.masked = mask ? st.masked | bit : st.masked & ~bit;
}

void CpuBuffer::ll_query_mask(const TensorView& mask_status, Stream) {
  const uint64_t masked = state_of(ll_state_).masked;
  for (int p = 0; p < group.size(); ++p)
    mask_status.ptr<int32_t>()[p * mask_status.strides[0]] = static_cast<int32_t>(masked >> p & 1);
}

void CpuBuffer::ll_clean_mask(Stream) {
  state_of(ll_state_).masked = 0;
}

// After a resync that adopted `epoch`: no ll operation runs on any rank.
void CpuBuffer::reset_ll_state(uint64_t epoch) {
  CpuLlState& st = state_of(ll_state_);
  const LlLayout lay(shape, group.size(), topology_);
  char* base = static_cast<char*>(ll_mem_->local());
  for (int slot = 0; slot < 2; ++slot) {
    reinterpret_cast<DispatchHeader*>(base + lay.dispatch_off(slot))->stamp.begin_publish();
    reinterpret_cast<CombineHeader*>(base + lay.combine_off(slot))->stamp.begin_publish();
  }
  st.num_dispatches = 0;
  st.num_combines = 0;
  ++st.generation;
  st.step.reset(epoch);
  if (ll_rail_) ll_rail_->reset();
  for (int slot = 0; slot < 2; ++slot)
    st.dispatch_in_flight[slot] = st.combine_in_flight[slot] = false;
  // Peers read these headers only after the barrier of their next operation, which this rank
  // reaches after clearing them and publishing anew.
}

}  // namespace epx::detail
