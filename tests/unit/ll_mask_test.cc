// The ll rank masks of the cpu backend (BufferConfig::enable_shrink, docs/semantics.md §2.6):
// argument errors and agreement; ll_update_mask / ll_query_mask / ll_clean_mask; DeepEP's
// --shrink-test scenario (tests/support/ll_masks.h: ranks that stop calling at a dispatch, a
// combine and an ll_clean while the others go on; threads at R = 2, 3, 4, 8 and processes at
// R = 4): every live rank finishes every call within the bounds of its timeouts, its mask grows
// by exactly the dead ranks, and every output matches the oracle with those masks bit for bit
// (poisoned outputs, NaN past the counts of y); masks set by ll_update_mask on one side only
// (the masked rank masks its maskers from their headers, no wait) and the rejoin through
// ll_clean_mask + ll_clean.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/ll_cases.h"
#include "support/ll_masks.h"
#include "support/oracle_ll.h"

namespace epx {
namespace {

using testing::LlBatch;
using testing::LlCase;
using testing::LlProblem;
using testing::LlRankInput;
using testing::Clock;
using testing::seconds_since;

BufferConfig shrink_config(bool shrink = true) {
  BufferConfig c = testing::ll_mask_config();
  c.enable_shrink = shrink;
  return c;
}

TensorView view_of(const std::vector<int64_t>& v, std::vector<int64_t> shape) {
  return TensorView::contiguous(const_cast<int64_t*>(v.data()), DType::kI64, shape);
}

// The error `f` throws must have `code` and mention `needle`; "" or what went wrong.
std::string expect_error(const std::function<void()>& f, ErrorCode code, const std::string& needle,
                         const std::string& what) {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() == code && std::string(e.what()).find(needle) != std::string::npos) return "";
    return what + ": unexpected error " + e.what();
  }
  return what + ": no error";
}

std::vector<int32_t> query(const Buffer& buf) {
  std::vector<int32_t> m(buf.group().size(), -7);
  buf.ll_query_mask(TensorView::contiguous(m.data(), DType::kI32, {buf.group().size()}));
  return m;
}

// Keeps the first failure: err = prefix + e when err is still empty and e is not.
void keep_first(std::string& err, const std::string& prefix, const std::string& e) {
  if (err.empty() && !e.empty()) err = prefix + e;
}

// A dispatch of `b` on this rank (hook: the call, then the hook), its outputs checked against
// b's expectations into `err`. `stats` (optional, [R]) gets its wait costs.
LlDispatchResult dispatch_step(Buffer& buf, const LlCase& c, const LlBatch& b, bool hook,
                               std::vector<int64_t>* stats, std::string& err) {
  const LlProblem& p = c.p;
  const int r = buf.group().rank();
  const LlRankInput& in = b.in[r];
  LlDispatchArgs a;
  a.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16,
                               {in.num_tokens, p.hidden});
  a.topk_idx = view_of(in.topk_idx, {in.num_tokens, p.top_k});
  a.use_fp8 = p.use_fp8;
  a.return_recv_hook = hook;
  if (stats)
    a.dispatch_wait_recv_cost_stats =
        TensorView::contiguous(stats->data(), DType::kI64, {p.num_ranks});
  LlDispatchResult d = buf.ll_dispatch(a, testing::poison_allocator(0xA5));
  if (hook) d.hook();
  const std::string e = testing::check_ll_dispatch(p, b.want[r], d);
  keep_first(err, "dispatch: ", e);
  return d;
}

// The combine of dispatch `d` of `b` on this rank (y written through ll_next_combine_buffer with
// zero_copy), its out checked into `err`.
void combine_step(Buffer& buf, const LlCase& c, const LlBatch& b, const LlDispatchResult& d,
                  bool hook, bool zero_copy, std::string& err) {
  const LlProblem& p = c.p;
  const int r = buf.group().rank(), L = p.num_local_experts();
  const int64_t H = p.hidden, RT = p.rows_per_expert(), T = b.in[r].num_tokens;
  LlCombineArgs a;
  a.handle = &d.handle;
  a.topk_idx = view_of(b.in[r].topk_idx, {T, p.top_k});
  a.topk_weights = TensorView::contiguous(const_cast<float*>(b.in[r].topk_weights.data()),
                                          DType::kF32, {T, p.top_k});
  if (zero_copy) {
    TensorView v = buf.ll_next_combine_buffer(d.handle);
    std::memcpy(v.data, b.y[r].data(), sizeof(uint16_t) * L * RT * H);
    a.zero_copy = true;
  } else {
    a.y = TensorView::contiguous(const_cast<uint16_t*>(b.y[r].data()), DType::kBF16, {L, RT, H});
  }
  a.return_recv_hook = hook;
  LlCombineResult cr = buf.ll_combine(a, testing::poison_allocator(0xA5));
  if (hook) cr.hook();
  const std::string e = testing::check_ll_combine(p, b.want_out[r], cr.out);
  keep_first(err, "combine: ", e);
}

// ---- arguments ---------------------------------------------------------------------------------

TEST(LlMaskErrors, NeedShrinkAndValidArguments) {
  const LlProblem p = testing::make_ll_mask_scenario(2, 1).c.p;
  std::vector<std::string> errors(2);
  testing::run_threads(2, [&](const Group& g) {
    const int r = g.rank();
    std::string& err = errors[r];
    auto note = [&](const std::string& e) {
      if (err.empty()) err = e;
    };
    std::vector<int32_t> m(2);
    const TensorView status = TensorView::contiguous(m.data(), DType::kI32, {2});
    {
      Buffer plain(g, p.moe_shape(), shrink_config(false));
      for (auto& [what, f] : std::vector<std::pair<std::string, std::function<void()>>>{
               {"update", [&] { plain.ll_update_mask(1 - r, true); }},
               {"query", [&] { plain.ll_query_mask(status); }},
               {"clean", [&] { plain.ll_clean_mask(); }}})
        note(expect_error(f, ErrorCode::kInvalidArgument, "enable_shrink = false", what));
    }
    Buffer buf(g, p.moe_shape(), shrink_config());
    note(expect_error([&] { buf.ll_update_mask(2, true); }, ErrorCode::kInvalidArgument,
                      "argument 'rank' is 2, expected 0..1", "rank 2"));
    note(expect_error([&] { buf.ll_update_mask(-1, false); }, ErrorCode::kInvalidArgument,
                      "argument 'rank' is -1", "rank -1"));
    note(expect_error([&] { buf.ll_update_mask(r, true); }, ErrorCode::kInvalidArgument,
                      "cannot mask itself", "self"));
    buf.ll_update_mask(r, false);  // unmasking itself: nothing to do
    std::vector<int64_t> wide(2);
    note(expect_error([&] { buf.ll_query_mask(view_of(wide, {2})); }, ErrorCode::kInvalidArgument,
                      "'mask_status' has dtype", "int64 status"));
    std::vector<int32_t> three(3);
    note(expect_error(
        [&] { buf.ll_query_mask(TensorView::contiguous(three.data(), DType::kI32, {3})); },
        ErrorCode::kInvalidArgument, "'mask_status' has shape [3], expected [2]", "3 entries"));
    note(testing::check_mask_status(query(buf), 0));
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  // enable_shrink needs enable_ll, one node, and the same value on every rank.
  BufferConfig ht_only;
  ht_only.enable_shrink = true;
  testing::run_threads(1, [&](const Group& g) {
    EXPECT_EQ(expect_error([&] { Buffer b(g, p.moe_shape(), ht_only); },
                           ErrorCode::kInvalidArgument, "enable_ll is false", "ht only"),
              "");
  });
  GroupOptions nodes;
  nodes.ranks_per_node = 1;
  testing::run_threads(
      2,
      [&](const Group& g) {
        EXPECT_EQ(expect_error([&] { Buffer b(g, p.moe_shape(), shrink_config()); },
                               ErrorCode::kUnsupported, "nodes", "two nodes"),
                  "");
      },
      nodes);
  testing::run_threads(2, [&](const Group& g) {
    EXPECT_EQ(expect_error([&] { Buffer b(g, p.moe_shape(), shrink_config(g.rank() == 0)); },
                           ErrorCode::kInvalidArgument,
                           "config.enable_shrink differs across ranks: rank 0 has true, rank 1 "
                           "has false",
                           "differs"),
              "");
  });
}

// Local: update / query (into a strided view) / clean, no communication.
TEST(LlMask, UpdateQueryClean) {
  const LlProblem p = testing::make_ll_mask_scenario(3, 2).c.p;
  std::vector<std::string> errors(3);
  testing::run_threads(3, [&](const Group& g) {
    const int r = g.rank(), other = (r + 1) % 3, third = (r + 2) % 3;
    Buffer buf(g, p.moe_shape(), shrink_config());
    std::string& err = errors[r];
    auto note = [&](const std::string& e) { keep_first(err, "", e); };
    buf.ll_update_mask(other, true);
    note(testing::check_mask_status(query(buf), uint64_t{1} << other));
    // Every other element of a [6] tensor: stride 2; the elements between stay untouched.
    std::vector<int32_t> wide(6, -9);
    TensorView strided = TensorView::contiguous(wide.data(), DType::kI32, {3});
    strided.strides[0] = 2;
    buf.ll_update_mask(third, true);
    buf.ll_query_mask(strided);
    note(testing::check_mask_status({wide[0], wide[2], wide[4]},
                                    (uint64_t{1} << other) | (uint64_t{1} << third)));
    if (wide[1] != -9 || wide[3] != -9 || wide[5] != -9) note("strided query wrote between");
    buf.ll_update_mask(other, false);
    note(testing::check_mask_status(query(buf), uint64_t{1} << third));
    buf.ll_update_mask(other, true);
    buf.ll_clean_mask();
    note(testing::check_mask_status(query(buf), 0));
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// ---- DeepEP's --shrink-test: ranks that stop calling ------------------------------------------

// One rank of the dead-peer scenario; "" or its first failure. Live ranks check every output and
// their mask after every step, and how long each step took: about one timeout where a rank died
// before it (ll_clean: two, its barrier waits twice the timeout), less than one otherwise.
std::string run_dead_peers_rank(const testing::LlMaskScenario& s, const Group& g) {
  const int r = g.rank(), R = g.size();
  Buffer buf(g, s.c.p.moe_shape(), shrink_config());
  const double timeout = std::chrono::duration<double>(g.timeout()).count();
  std::string err;
  for (int round = 0; round < testing::kLlMaskRounds && err.empty(); ++round) {
    const std::string where = "rank " + std::to_string(r) + " round " + std::to_string(round);
    // Step `step` took `took` seconds (the waits it should have) and left the mask it should.
    auto check_step = [&](int step, double took) {
      keep_first(err, where + " ", s.plan.check_time(round, step, took, timeout, 2));
      keep_first(err, where + " step " + std::to_string(step) + ": ",
                 testing::check_mask_status(query(buf), s.plan.masked(round, step)));
    };
    const testing::LlBatch& b = s.rounds[round];
    if (s.plan.stopped(r, round, 0)) break;
    std::vector<int64_t> stats(R, 0);
    auto t0 = Clock::now();
    LlDispatchResult d = dispatch_step(buf, s.c, b, s.hook(round), &stats, err);
    check_step(0, seconds_since(t0));
    if (round == 1 && s.plan.at_dispatch >= 0) {
      // The dead rank's wait counts until it was masked (about the timeout), the others' little.
      for (int q = 0; q < R && err.empty(); ++q) {
        const double waited = 1e-9 * static_cast<double>(stats[q]);
        const bool ok = q == s.plan.at_dispatch ? waited >= 0.9 * timeout : waited < 0.9 * timeout;
        if (!ok)
          err = where + " dispatch_wait_recv_cost_stats[" + std::to_string(q) +
                "] = " + std::to_string(waited) + " s";
      }
    }
    if (s.plan.stopped(r, round, 1)) break;
    t0 = Clock::now();
    combine_step(buf, s.c, b, d, s.hook(round), round == 3, err);
    check_step(1, seconds_since(t0));
    if (s.plan.stopped(r, round, 2)) break;
    t0 = Clock::now();
    buf.ll_clean();
    check_step(2, seconds_since(t0));
    if (!err.empty() && err.rfind("rank", 0) != 0) err = where + " " + err;
  }
  return err;
}

GroupOptions mask_options() {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(1000);
  return o;
}

class LlMaskDeadPeers : public ::testing::TestWithParam<int> {};

TEST_P(LlMaskDeadPeers, LiveRanksFinishAndMaskThem) {
  const int R = GetParam();
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 100 + R);
  SCOPED_TRACE(s.c.p.describe());
  std::vector<std::string> errors(R);
  testing::run_threads(
      R, [&](const Group& g) { errors[g.rank()] = run_dead_peers_rank(s, g); }, mask_options());
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlMaskDeadPeers, ::testing::Values(2, 3, 4, 8),
                         ::testing::PrintToStringParamName());

TEST(LlMaskDeadPeersProcesses, LiveRanksFinishAndMaskThem) {
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(4, 7);
  SCOPED_TRACE(s.c.p.describe());
  const int rc = testing::run_processes(
      4,
      [&](const Group& g) {
        const std::string e = run_dead_peers_rank(s, g);
        if (!e.empty()) std::fprintf(stderr, "%s\n", e.c_str());
        return e.empty() ? 0 : 1;
      },
      mask_options());
  EXPECT_EQ(rc, 0);
}

// ---- masks set by the caller -------------------------------------------------------------------

// Every rank but m masks m with ll_update_mask; m masks nobody. The others never wait for m and
// get the outputs without it; m finds in their headers that they mask it and masks them all (no
// wait on the cpu backend; the cuda one times out on them), so it gets its own tokens and
// experts only. Then every rank unmasks everything and calls ll_clean: exact again.
TEST(LlMask, MaskedByItsPeersThenRejoins) {
  constexpr int R = 3, m = 1;
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 11);
  const LlCase& c = s.c;
  std::mt19937_64 rng(12);
  // One-sided: rank r's view masks m (r != m) or every other rank (r == m).
  const uint64_t all = (uint64_t{1} << R) - 1, bit = uint64_t{1} << m;
  LlBatch one_sided = testing::make_ll_masked_batch(c, 0, 0, rng);
  auto view = [&](int r) {
    LlProblem p = c.p;
    p.masked_dispatch = p.masked_combine = r == m ? all & ~bit : bit;
    return p;
  };
  const int L = c.p.num_local_experts();
  const int64_t RT = c.p.rows_per_expert(), H = c.p.hidden;
  for (int r = 0; r < R; ++r) {
    one_sided.want[r] = testing::oracle_ll_dispatch(view(r), one_sided.in, r);
    for (int l = 0; l < L; ++l)  // y rows past this view's counts are NaN again
      std::fill(one_sided.y[r].begin() + (l * RT + one_sided.want[r].recv_count[l]) * H,
                one_sided.y[r].begin() + (l + 1) * RT * H, testing::kLlPoisonBf16);
  }
  for (int r = 0; r < R; ++r)
    one_sided.want_out[r] = testing::oracle_ll_combine(view(r), one_sided.in, one_sided.y, r);
  const LlBatch full = testing::make_ll_masked_batch(c, 0, 0, rng);
  std::vector<std::string> errors(R);
  testing::run_threads(
      R,
      [&](const Group& g) {
        const int r = g.rank();
        Buffer buf(g, c.p.moe_shape(), shrink_config());
        std::string err;
        if (r != m) buf.ll_update_mask(m, true);
        const auto t0 = Clock::now();
        LlDispatchResult d = dispatch_step(buf, c, one_sided, false, nullptr, err);
        combine_step(buf, c, one_sided, d, true, false, err);
        if (seconds_since(t0) > 0.9) err += " (one-sided round waited a timeout)";
        keep_first(err, "", testing::check_mask_status(query(buf), view(r).masked_dispatch));
        buf.ll_clean_mask();
        buf.ll_clean();
        LlDispatchResult d2 = dispatch_step(buf, c, full, true, nullptr, err);
        combine_step(buf, c, full, d2, false, true, err);
        errors[r] = err.empty() ? "" : "rank " + std::to_string(r) + ": " + err;
      },
      mask_options());
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

// Rank m stops calling for a round (a stall, not a death): the others' dispatch waits one
// timeout for it and masks it, and their round is the one without m. Then every rank unmasks
// everything and calls ll_clean, m having run fewer ll operations than its peers (on the cpu
// backend: passed fewer barriers): the next round, hooks and zero-copy, is exact on every rank.
// vLLM's fault-tolerance retry comes here through the DeepEP drop-in's
// low_latency_clean_mask_buffer (docs/semantics.md §9).
TEST(LlMask, StalledRankRejoinsAfterCleanMask) {
  constexpr int R = 3, m = 1;
  const testing::LlMaskScenario s = testing::make_ll_mask_scenario(R, 13);
  const LlCase& c = s.c;
  std::mt19937_64 rng(14);
  const uint64_t bit = uint64_t{1} << m;
  const LlBatch before = testing::make_ll_masked_batch(c, 0, 0, rng);
  const LlBatch without_m = testing::make_ll_masked_batch(c, bit, bit, rng);
  const LlBatch after = testing::make_ll_masked_batch(c, 0, 0, rng);
  const double timeout_s = 1.0;  // mask_options()
  std::vector<std::string> errors(R);
  testing::run_threads(
      R,
      [&](const Group& g) {
        const int r = g.rank();
        Buffer buf(g, c.p.moe_shape(), shrink_config());
        std::string err;
        LlDispatchResult d0 = dispatch_step(buf, c, before, false, nullptr, err);
        combine_step(buf, c, before, d0, false, false, err);
        if (r != m) {
          const auto t0 = Clock::now();
          LlDispatchResult d1 = dispatch_step(buf, c, without_m, false, nullptr, err);
          combine_step(buf, c, without_m, d1, false, false, err);
          const double took = seconds_since(t0);
          if (err.empty() && (took < 0.9 * timeout_s || took > 3 * timeout_s))
            err = "the round without m took " + std::to_string(took) + " s, expected about one "
                  "timeout";
          keep_first(err, "after the stall: ", testing::check_mask_status(query(buf), bit));
        }
        buf.ll_clean_mask();
        buf.ll_clean();
        keep_first(err, "after the clean: ", testing::check_mask_status(query(buf), 0));
        LlDispatchResult d2 = dispatch_step(buf, c, after, true, nullptr, err);
        combine_step(buf, c, after, d2, true, true, err);
        keep_first(err, "after the rejoined round: ", testing::check_mask_status(query(buf), 0));
        errors[r] = err.empty() ? "" : "rank " + std::to_string(r) + ": " + err;
      },
      mask_options());
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace epx
