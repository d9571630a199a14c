// src/cpu/ll.cc — the ll mode of the cpu reference backend (docs/semantics.md §2).
//
// Data flow on rank r (R ranks, L = E / R local experts, T_max = shape.max_tokens_per_rank,
// G = H / 128 quantisation groups, RT = R * T_max rows per local expert):
//
//   ll_dispatch, send (publish): write this rank's T, topk_idx (as int32) and one message per
//     token into dispatch slot s of its own region. A message is the token's bf16 row, or with
//     use_fp8 its e4m3 row followed by its G float32 scales (quantize_row_fp8 of core/numeric.h),
//     or with use_nvfp4 its e2m1 pairs [H/2] followed by its e4m3 scales [H/16]
//     (quantize_row_nvfp4 of core/quant.h), quantised once per token on the sender, as the cuda
//     kernel does.
//   ll_dispatch, receive (inline, or in the hook): barrier; for each source rank src ascending,
//     for each source token t ascending, for each local expert l the token selects (a token that
//     lists the same expert several times in its row counts ONCE for that expert and gets one
//     row): copy message t to recv_x[l][row_l++], src_info[l][row] = t; then
//     layout_range[l][src] = (begin << 32) | count of that source's block; recv_count[l] = row_l;
//     dispatch_wait_recv_cost_stats[src] += max(0, published_ns(src) - recv_start) (below);
//     barrier (no rank reuses slot s before every peer finished reading it).
//       recv_x      [L, RT, H]  fp8 e4m3 or bf16, rows >= recv_count[l] are not written
//       recv_scales f32 [L, RT, G], or UE8M0 int32 [L, RT, ceil(G / 4)] (group g in byte g % 4 of
//                   int g / 4, unused bytes 0); storage [L, G', RT], so the view has strides
//                   {G' * RT, 1, RT} (column-major in the last two dims)
//       NVFP4: recv_x u8 storage [L, RT, H/2]; recv_scales e4m3 storage [L, ceil(RT/128), H/64,
//                   32, 4, 4] = per expert the interleaved layout (core/quant.h nvfp4_sf_offset);
//                   both returned as the views of core/quant.h set_ll_nvfp4_views
//   ll_combine, send (publish): copy y's valid rows into combine slot handle.slot of this rank's
//     region (skipped with zero_copy: the caller wrote them through ll_next_combine_buffer), and
//     publish handle.layout_range next to them.
//   ll_combine, receive (inline, or in the hook): barrier; for each token t and each k,
//     y(t, k) is row  begin + j  of local expert l = e % L on rank d = e / L (e = topk_idx[t][k]),
//     where begin comes from rank d's published layout_range[l][r] and j counts this rank's
//     tokens before t that select e (duplicates of e in one row read the same row). Then, in this
//     exact order (the cuda kernel uses __fmaf_rn for std::fmaf):
//         acc = 0.0f;
//         for k = 0 .. K-1:  if topk_idx[t][k] != -1:  acc = std::fmaf(w[t][k], f32(y(t, k)), acc);
//         out[t] = bf16_rne(acc)            (tokens with no expert get +0)
//     combine_wait_recv_cost_stats[d] += max(0, published_ns(d) - recv_start) (below) when T > 0
//     (a rank without tokens waits for no expert outputs, as on cuda); barrier.
//
// Wait-cost statistics (docs/semantics.md §2.5). A receive waits for its sources in one barrier,
// so it cannot see when each of them arrived; the publisher says so instead: every header carries
// published_ns, the steady clock (CLOCK_MONOTONIC: one clock for all threads and processes of
// the host) when its publication ended, and the receive notes recv_start, the steady clock when
// it began waiting (entry of the receive half: right after the publish, or when the hook was
// called). Source s's wait is max(0, published_ns(s) - recv_start): the nanoseconds this rank
// waited for s's data, 0 for data that was already there (this rank's own, and a hook called
// late). Added after the pull succeeded (with cumulative_local_expert_recv_stats), never on an
// error.
//
// Region of one rank (cpu_ll_bytes; every offset a multiple of 64 bytes):
//   dispatch slot 0, dispatch slot 1:
//     DispatchHeader                 {stamp, num_tokens, use_fp8, round_scale, use_nvfp4,
//                                     global_scale_bits, published_ns}
//     topk   int32 [T_max, K]
//     msgs   [T_max, msg_bytes]      msg_bytes = max(2 H, H + 4 G) rounded up to 16 (>= the
//                                    NVFP4 message's 9 H / 16)
//   combine slot 0, combine slot 1:
//     CombineHeader                  {stamp, published_ns}
//     layout int64 [L, R]            the expert rank's handle.layout_range
//     y      bf16  [L, RT, H]        the view ll_next_combine_buffer returns
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
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/host_view.h"
#include "core/numeric.h"
#include "core/quant.h"
#include "core/validate.h"
#include "cpu/cpu_buffer.h"

namespace epx::detail {

// Per-buffer ll state, local to each rank (equal on all ranks that follow the same sequence).
struct CpuLlState {
  uint64_t num_dispatches = 0;                  // sequence number of the last dispatch
  uint64_t num_combines = 0;                    // sequence number of the last combine
  uint64_t generation = 0;                      // bumped by ll_clean; older hooks refuse to run
  bool dispatch_in_flight[2] = {false, false};  // published, hook not called yet
  bool combine_in_flight[2] = {false, false};
  StepState step;  // stamps' generation; refusal after a Timeout (its call count is unused)
};

namespace {

constexpr size_t kAlign = 64;  // every section offset
constexpr const char* kLlReset = "ll_clean() or reset()";

struct DispatchHeader {
  Stamp stamp;  // call = the dispatch's sequence number, 1, 2, ... since the last reset
  int64_t num_tokens;
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_nvfp4;
  uint32_t global_scale_bits;  // use_nvfp4: the bits of the float32 global scale g, else 0
  int64_t published_ns;        // steady_ns() when the publication ended (wait-cost statistics)
};

struct CombineHeader {
  Stamp stamp;  // call = the combine's sequence number
  int64_t published_ns;
};

// The steady clock in nanoseconds (CLOCK_MONOTONIC on Linux: comparable across the threads and
// processes of one host, which is where the cpu backend's ranks are).
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Adds max(0, published_ns(s) - recv_start) to stats[s] for every source s (stats: int64 [R],
// contiguous, validated).
void add_wait_costs(const TensorView& stats, const std::vector<int64_t>& published_ns,
                    int64_t recv_start) {
  if (!stats.defined()) return;
  auto* out = stats.ptr<int64_t>();
  for (size_t s = 0; s < published_ns.size(); ++s)
    out[s] += std::max<int64_t>(0, published_ns[s] - recv_start);
}

// The ll region of one rank: used for sizing and for every pointer.
struct LlLayout {
  int num_ranks, num_local_experts, top_k;
  int64_t max_tokens, hidden, num_groups, rows_per_expert;
  size_t msg_bytes, topk_off, msgs_off, dispatch_slot_bytes;
  size_t layout_off, y_off, combine_slot_bytes;

  LlLayout(const MoeShape& s, int R)
      : num_ranks(R),
        num_local_experts(s.num_local_experts(R)),
        top_k(s.top_k),
        max_tokens(s.max_tokens_per_rank),
        hidden(s.hidden),
        num_groups((s.hidden + kQuantGroup - 1) / kQuantGroup),
        rows_per_expert(R * s.max_tokens_per_rank) {
    const size_t H = static_cast<size_t>(hidden), G = static_cast<size_t>(num_groups);
    msg_bytes = align_up(std::max(2 * H, H + 4 * G), 16);
    topk_off = align_up(sizeof(DispatchHeader), kAlign);
    msgs_off = topk_off + align_up(sizeof(int32_t) * max_tokens * top_k, kAlign);
    dispatch_slot_bytes = msgs_off + align_up(msg_bytes * max_tokens, kAlign);
    layout_off = align_up(sizeof(CombineHeader), kAlign);
    y_off = layout_off + align_up(sizeof(int64_t) * num_local_experts * R, kAlign);
    combine_slot_bytes =
        y_off + align_up(sizeof(uint16_t) * num_local_experts * rows_per_expert * H, kAlign);
  }
  size_t dispatch_off(int slot) const { return slot * dispatch_slot_bytes; }
  size_t combine_off(int slot) const { return 2 * dispatch_slot_bytes + slot * combine_slot_bytes; }
  size_t total_bytes() const { return 2 * dispatch_slot_bytes + 2 * combine_slot_bytes; }
};

CpuLlState& state_of(std::shared_ptr<CpuLlState>& p) {
  if (!p) p = std::make_shared<CpuLlState>();
  return *p;
}

// Runs the receive half now (returns no hook), or marks its slot in flight and returns it wrapped
// as the caller's hook: callable once only, not after ll_clean, and freeing the slot whatever
// happens.
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

// Everything the receive half of a dispatch needs; copied into the hook.
struct DispatchRecv {
  std::shared_ptr<Transport> transport;
  std::shared_ptr<SymmetricMemory> mem;
  LlLayout lay;
  int slot;
  uint64_t generation, seq;
  bool use_fp8, round_scale, use_ue8m0, use_nvfp4;
  Tensor recv_x, recv_scales, recv_count, src_info, layout_range;
  TensorView stats;       // optional, caller-owned
  TensorView wait_stats;  // optional, caller-owned: dispatch_wait_recv_cost_stats

  void operator()() const;
};

void DispatchRecv::operator()() const {
  const int64_t recv_start = steady_ns();
  transport->barrier("ll_dispatch (receive)");
  // A mismatch is raised after the release barrier, so peers are not left waiting.
  pull_then_barrier(*transport, "ll_dispatch (release)", [&] {
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
    std::vector<std::vector<int32_t>> tokens_of(L);  // this source's tokens per local expert
    std::vector<float> scales(G);                    // one message's scales

    // Every source in this dispatch, with the same quantisation options (every rank reads every
    // header, so all raise together, naming each differing option with each rank's value).
    auto header = [&](int src) {
      return reinterpret_cast<const DispatchHeader*>(static_cast<const char*>(mem->peer(src)) +
                                                     lay.dispatch_off(slot));
    };
    auto stamp = [&](int src) -> const Stamp& { return header(src)->stamp; };
    check_stamps("ll_dispatch", r, R, generation, seq, stamp,
                 [&](int) { return cat("dispatch slot ", slot, " at"); });
    std::vector<int64_t> fp8_of(R), round_of(R), nvfp4_of(R), scale_of(R), published_ns(R);
    for (int src = 0; src < R; ++src) {
      fp8_of[src] = header(src)->use_fp8;
      round_of[src] = header(src)->round_scale;
      nvfp4_of[src] = header(src)->use_nvfp4;
      scale_of[src] = header(src)->global_scale_bits;
      published_ns[src] = header(src)->published_ns;
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
      const char* region = static_cast<const char*>(mem->peer(src)) + lay.dispatch_off(slot);
      const DispatchHeader& h = *header(src);
      EPX_CHECK_ARG(h.num_tokens >= 0 && h.num_tokens <= lay.max_tokens, "ll_dispatch: rank ", src,
                    " published T = ", h.num_tokens, ", expected 0..", lay.max_tokens);
      for (auto& v : tokens_of) v.clear();
      const auto* topk = reinterpret_cast<const int32_t*>(region + lay.topk_off);
      for (int64_t t = 0; t < h.num_tokens; ++t) {
        const int32_t* row = topk + t * K;
        for (int k = 0; k < K; ++k) {
          const int32_t e = row[k];
          if (e < 0 || e / L != r) continue;
          if (std::find(row, row + k, e) != row + k) continue;  // duplicate: one row
          tokens_of[e % L].push_back(static_cast<int32_t>(t));
        }
      }
      for (int l = 0; l < L; ++l) {
        const int64_t begin = num_rows[l];
        for (int32_t t : tokens_of[l]) {
          const int64_t row = num_rows[l]++;
          const char* msg = region + lay.msgs_off + static_cast<size_t>(t) * lay.msg_bytes;
          std::memcpy(out_x + (l * RT + row) * row_bytes, msg, row_bytes);
          out_src[l * RT + row] = t;
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
        out_range[l * R + src] = (begin << 32) | static_cast<int64_t>(tokens_of[l].size());
      }
    }
    recheck_stamps("ll_dispatch", r, R, generation, seq, stamp);
    for (int l = 0; l < L; ++l) {
      recv_count.ptr<int32_t>()[l] = static_cast<int32_t>(num_rows[l]);
      if (stats.defined())
        stats.ptr<int32_t>()[l * stats.strides[0]] += static_cast<int32_t>(num_rows[l]);
    }
    add_wait_costs(wait_stats, published_ns, recv_start);
  });
}

// ---- combine -------------------------------------------------------------------------------

struct CombineRecv {
  std::shared_ptr<Transport> transport;
  std::shared_ptr<SymmetricMemory> mem;
  LlLayout lay;
  int slot;
  uint64_t generation, seq;
  int64_t num_tokens;
  int num_experts;
  std::vector<int32_t> topk;   // [T, K], copied at send time
  std::vector<float> weights;  // [T, K]
  Tensor out;                  // [T, H] bf16 (allocated, or the caller's without storage)
  TensorView wait_stats;       // optional, caller-owned: combine_wait_recv_cost_stats

  void operator()() const;
};

void CombineRecv::operator()() const {
  const int64_t recv_start = steady_ns();
  transport->barrier("ll_combine (receive)");
  // A mismatch is raised after the release barrier, so peers are not left waiting.
  pull_then_barrier(*transport, "ll_combine (release)", [&] {
    const int R = lay.num_ranks, L = lay.num_local_experts, K = lay.top_k, E = num_experts;
    const int r = mem->rank();
    const int64_t H = lay.hidden, RT = lay.rows_per_expert, T = num_tokens;

    auto header = [&](int d) {
      return reinterpret_cast<const CombineHeader*>(static_cast<const char*>(mem->peer(d)) +
                                                    lay.combine_off(slot));
    };
    auto stamp = [&](int d) -> const Stamp& { return header(d)->stamp; };
    check_stamps("ll_combine", r, R, generation, seq, stamp,
                 [&](int) { return cat("combine slot ", slot, " at"); });
    std::vector<int64_t> published_ns(R);
    for (int d = 0; d < R; ++d) published_ns[d] = header(d)->published_ns;
    // row_in_block[t * K + k]: j of the formula above; num_selected[e]: this rank's tokens on e.
    std::vector<int64_t> row_in_block(T * K, -1);
    std::vector<int64_t> num_selected(E, 0);
    for (int64_t t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        const int32_t e = topk[t * K + k];
        if (e < 0) continue;
        int k0 = 0;
        while (topk[t * K + k0] != e) ++k0;
        row_in_block[t * K + k] = k0 < k ? row_in_block[t * K + k0] : num_selected[e]++;
      }
    }
    // begin of this rank's block in every expert, checked against what the expert rank received.
    std::vector<int64_t> begin(E, 0);
    for (int e = 0; e < E; ++e) {
      const char* region = static_cast<const char*>(mem->peer(e / L)) + lay.combine_off(slot);
      int64_t range;
      std::memcpy(&range, region + lay.layout_off + sizeof(int64_t) * ((e % L) * R + r),
                  sizeof(range));
      begin[e] = range >> 32;
      const int64_t count = range & 0xFFFFFFFF;
      EPX_CHECK_ARG(count == num_selected[e] && begin[e] + count <= RT,
                    "ll_combine: argument 'topk_idx' selects expert ", e, " with ", num_selected[e],
                    " tokens but rank ", e / L, " received ", count,
                    " from this rank; expected the topk_idx of the dispatch that made 'handle'");
    }
    std::vector<float> acc(H);
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < K; ++k) {
        const int32_t e = topk[t * K + k];
        if (e == -1) continue;
        const int64_t row = begin[e] + row_in_block[t * K + k];
        const auto* y =
            reinterpret_cast<const uint16_t*>(static_cast<const char*>(mem->peer(e / L)) +
                                              lay.combine_off(slot) + lay.y_off) +
            ((e % L) * RT + row) * H;
        const float w = weights[t * K + k];
        for (int64_t c = 0; c < H; ++c) acc[c] = std::fmaf(w, bf16_to_f32(y[c]), acc[c]);
      }
      uint16_t* o = out.ptr<uint16_t>() + t * out.strides[0];
      for (int64_t c = 0; c < H; ++c) o[c] = f32_to_bf16(acc[c]);
    }
    recheck_stamps("ll_combine", r, R, generation, seq, stamp);
    if (T > 0) add_wait_costs(wait_stats, published_ns, recv_start);  // T = 0: nothing awaited
  });
}

}  // namespace

size_t cpu_ll_bytes(const MoeShape& shape, int num_ranks) {
  return LlLayout(shape, num_ranks).total_bytes();
}

LlDispatchResult CpuBuffer::ll_dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  CpuLlState& st = state_of(ll_state_);
  const int R = group.size();
  const LlLayout lay(shape, R);
  const int L = lay.num_local_experts, K = lay.top_k;
  const int64_t H = lay.hidden, G = lay.num_groups, RT = lay.rows_per_expert;
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
  header->stamp.end_publish(st.step.generation, seq);

  // Outputs, allocated now, filled by the receive half.
  LlDispatchResult res;
  if (args.use_nvfp4) {
    res.recv_x = alloc(DType::kU8, ll_nvfp4_x_storage(L, RT, H), Device::cpu());
    res.recv_scales = alloc(DType::kF8E4M3, ll_nvfp4_scale_storage(L, RT, H), Device::cpu());
    set_ll_nvfp4_views(res.recv_x, res.recv_scales);
  } else {
    res.recv_x = alloc(args.use_fp8 ? DType::kF8E4M3 : DType::kBF16, {L, RT, H}, Device::cpu());
  }
  if (args.use_fp8) {
    const int64_t cols = args.use_ue8m0 ? (G + 3) / 4 : G;
    res.recv_scales =
        alloc(args.use_ue8m0 ? DType::kI32 : DType::kF32, {L, cols, RT}, Device::cpu());
    res.recv_scales.shape = {L, RT, cols};
    res.recv_scales.strides = {cols * RT, 1, RT};
  }
  res.recv_count = alloc(DType::kI32, {L}, Device::cpu());
  res.handle.src_info = alloc(DType::kI32, {L, RT}, Device::cpu());
  res.handle.layout_range = alloc(DType::kI64, {L, R}, Device::cpu());
  res.handle.max_tokens = lay.max_tokens;
  res.handle.hidden = H;
  res.handle.num_experts = shape.num_experts;
  res.handle.num_tokens = T;
  res.handle.slot = slot;
  res.handle.buffer_id = id;

  DispatchRecv recv{group.transport(),
                    ll_mem_,
                    lay,
                    slot,
                    st.step.generation,
                    seq,
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

LlCombineResult CpuBuffer::ll_combine(const LlCombineArgs& args, const Allocator& alloc) {
  CpuLlState& st = state_of(ll_state_);
  const LlHandle& h = *args.handle;
  const int R = group.size();
  const LlLayout lay(shape, R);
  const int L = lay.num_local_experts, K = lay.top_k;
  const int64_t H = lay.hidden, RT = lay.rows_per_expert, T = h.num_tokens;
  const int slot = h.slot;
  st.step.require_in_step("ll_combine", kLlReset);
  EPX_CHECK_ARG(!st.combine_in_flight[slot], "ll_combine: combine slot ", slot,
                " still holds a combine whose hook was not called; expected its hook to be called "
                "before another combine through a handle of slot ",
                slot);
  const uint64_t seq = ++st.num_combines;

  // Publish: header, this rank's layout_range, y's valid rows (unless already there).
  char* region = static_cast<char*>(ll_mem_->local()) + lay.combine_off(slot);
  auto* header = reinterpret_cast<CombineHeader*>(region);
  header->stamp.begin_publish();
  auto* layout = reinterpret_cast<int64_t*>(region + lay.layout_off);
  const TensorView& range = h.layout_range;
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < R; ++s) layout[l * R + s] = element<int64_t>(range, l, s);
  if (!args.zero_copy) {
    auto* y = reinterpret_cast<uint16_t*>(region + lay.y_off);
    for (int l = 0; l < L; ++l) {
      int64_t num_rows = 0;
      for (int s = 0; s < R; ++s) {
        const int64_t v = layout[l * R + s];
        num_rows = std::max(num_rows, std::min((v >> 32) + (v & 0xFFFFFFFF), RT));
      }
      for (int64_t row = 0; row < num_rows; ++row)
        std::memcpy(y + (l * RT + row) * H,
                    args.y.ptr<uint16_t>() + l * args.y.strides[0] + row * args.y.strides[1],
                    sizeof(uint16_t) * H);
    }
  }
  header->published_ns = steady_ns();
  header->stamp.end_publish(st.step.generation, seq);

  LlCombineResult res;
  if (args.out.defined()) {
    static_cast<TensorView&>(res.out) = args.out;
  } else {
    res.out = alloc(DType::kBF16, {T, H}, Device::cpu());
  }
  CombineRecv recv{group.transport(),
                   ll_mem_,
                   lay,
                   slot,
                   st.step.generation,
                   seq,
                   T,
                   shape.num_experts,
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
  const LlLayout lay(shape, group.size());
  st.step.require_in_step("ll_next_combine_buffer", kLlReset);
  EPX_CHECK_ARG(!st.combine_in_flight[handle.slot], "ll_next_combine_buffer: combine slot ",
                handle.slot,
                " still holds a combine whose hook was not called; expected its "
                "hook to be called before writing the next expert outputs there");
  char* y = static_cast<char*>(ll_mem_->local()) + lay.combine_off(handle.slot) + lay.y_off;
  return TensorView::contiguous(y, DType::kBF16,
                                {lay.num_local_experts, lay.rows_per_expert, lay.hidden});
}

void CpuBuffer::ll_clean() { reset_ll_state(resync("ll_clean")); }

// After a resync that adopted `epoch`: no ll operation runs on any rank.
void CpuBuffer::reset_ll_state(uint64_t epoch) {
  CpuLlState& st = state_of(ll_state_);
  const LlLayout lay(shape, group.size());
  char* base = static_cast<char*>(ll_mem_->local());
  for (int slot = 0; slot < 2; ++slot) {
    reinterpret_cast<DispatchHeader*>(base + lay.dispatch_off(slot))->stamp.begin_publish();
    reinterpret_cast<CombineHeader*>(base + lay.combine_off(slot))->stamp.begin_publish();
  }
  st.num_dispatches = 0;
  st.num_combines = 0;
  ++st.generation;
  st.step.reset(epoch);
  for (int slot = 0; slot < 2; ++slot)
    st.dispatch_in_flight[slot] = st.combine_in_flight[slot] = false;
  // Peers read these headers only after the barrier of their next operation, which this rank
  // reaches after clearing them and publishing anew.
}

}  // namespace epx::detail
