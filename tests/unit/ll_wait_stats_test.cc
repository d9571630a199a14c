// Wait-cost statistics of the ll mode on the cpu backend (docs/semantics.md §2.5):
// dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats, int64 [R], nanoseconds,
// accumulated per source rank. What is checked is what §2.5 documents for the cpu backend:
//   - a straggler (a rank that makes its call a known time D late) costs every other rank at
//     least D / 2 in its column, on dispatch and on combine, with and without hooks, on threads
//     and on processes (the steady clock is one clock for the whole host);
//   - data that was there before the receive began costs exactly 0: a rank's own column, the
//     straggler's whole row, a hook called late;
//   - the values are added to what the tensor held (never overwritten), over several calls, and
//     only its R elements are written (guards around the view stay);
//   - a combine on a rank with T = 0 adds nothing; a receive that raises adds nothing;
//   - validation: dtype int64, shape [R], contiguous, the buffer's device, each an
//     InvalidArgument naming the argument.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/wait_stats.h"

namespace epx {
namespace {

using testing::kWaitDelayMs;
using testing::kWaitDelayNs;
using testing::show_values;

constexpr int64_t kH = testing::kWaitHidden, kTMax = testing::kWaitMaxTokens;
constexpr int kK = testing::kWaitTopK;
constexpr int64_t kGuard = testing::kWaitGuard;
const BufferConfig kLlOnly{/*enable_ht=*/false, /*enable_ll=*/true};

// One rank's inputs: T tokens of 1.0, token t selecting experts (t + k) % E (distinct, K <= E),
// weights 0.5; y of 1.0 everywhere.
struct Inputs {
  int R, E;
  int64_t T;
  std::vector<uint16_t> x;
  std::vector<int64_t> topk;
  std::vector<float> w;
  std::vector<uint16_t> y;

  Inputs(int num_ranks, int num_experts, int64_t num_tokens)
      : R(num_ranks),
        E(num_experts),
        T(num_tokens),
        x(std::max<int64_t>(num_tokens, 1) * kH, 0x3F80),
        topk(std::max<int64_t>(num_tokens, 1) * kK),
        w(std::max<int64_t>(num_tokens, 1) * kK, 0.5f),
        y(static_cast<size_t>(num_experts / num_ranks) * num_ranks * kTMax * kH, 0x3F80) {
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < kK; ++k) topk[t * kK + k] = (t + k) % E;
  }
  MoeShape shape() const { return MoeShape{kH, kK, E, kTMax}; }
  LlDispatchArgs dispatch_args() {
    LlDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, kK});
    return a;
  }
  LlCombineArgs combine_args(const LlHandle& h) {
    LlCombineArgs a;
    a.y = TensorView::contiguous(y.data(), DType::kBF16, {E / R, R * kTMax, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, kK});
    a.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {T, kK});
    a.handle = &h;
    return a;
  }
};

// An int64 [R] view with a guard element on each side: values() are the R elements.
struct Stats {
  std::vector<int64_t> storage;
  explicit Stats(int R, int64_t first = 0) : storage(R + 2, kGuard) {
    for (int s = 0; s < R; ++s) storage[1 + s] = first + 1000 * s;
  }
  TensorView view() {
    return TensorView::contiguous(storage.data() + 1, DType::kI64,
                                  {static_cast<int64_t>(storage.size()) - 2});
  }
  std::vector<int64_t> values() const { return {storage.begin() + 1, storage.end() - 1}; }
  bool guards_intact() const { return storage.front() == kGuard && storage.back() == kGuard; }
};

// Failures of one rank, as one string ("" when none).
struct Failures {
  int rank;
  std::string text;
  void add(const std::string& what) { text += "rank " + std::to_string(rank) + ": " + what + "\n"; }
};

// What one call added (after - before), checked against §2.5 for a call in which rank
// `straggler` (-1: none) came kWaitDelayMs late: on cpu, data that was there before the receive
// began costs exactly 0 (the own element, the straggler's whole vector).
void check_added(Failures& f, const std::string& what, int straggler,
                 const std::vector<int64_t>& before, const std::vector<int64_t>& after) {
  testing::WaitExpectation want;
  want.rank = f.rank;
  want.straggler = straggler;
  want.combine = what.find("combine") != std::string::npos;
  want.exact_zero = true;
  f.text += testing::check_wait_added("rank " + std::to_string(f.rank) + ": " + what, want, before,
                                      after);
}

void sleep_if(bool late) {
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
}

// Two rounds of dispatch + combine on R ranks where the last rank makes each call kWaitDelayMs
// late, the same two stats tensors accumulating over both rounds (started at non-zero values).
// `hook`: through return_recv_hook, the hook called right after the call.
std::string straggler_rounds(const Group& g, bool hook) {
  const int R = g.size(), r = g.rank(), straggler = R - 1;
  Failures f{r, ""};
  Inputs in(R, 4 * R, 5);
  Buffer buf(g, in.shape(), kLlOnly);
  Stats ds(R, 7), cs(R, 11);
  const std::vector<int64_t> ds0 = ds.values(), cs0 = cs.values();
  for (int round = 0; round < 2; ++round) {
    const std::string tag = "round " + std::to_string(round) + (hook ? " (hook)" : "");
    g.barrier();
    std::vector<int64_t> before = ds.values();
    sleep_if(r == straggler);
    LlDispatchArgs da = in.dispatch_args();
    da.dispatch_wait_recv_cost_stats = ds.view();
    da.return_recv_hook = hook;
    const LlDispatchResult d = buf.ll_dispatch(da);
    if (d.hook) d.hook();
    check_added(f, tag + " dispatch", straggler, before, ds.values());

    g.barrier();
    before = cs.values();
    sleep_if(r == straggler);
    LlCombineArgs ca = in.combine_args(d.handle);
    ca.combine_wait_recv_cost_stats = cs.view();
    ca.return_recv_hook = hook;
    const LlCombineResult c = buf.ll_combine(ca);
    if (c.hook) c.hook();
    check_added(f, tag + " combine", straggler, before, cs.values());
    if (c.out.ptr<uint16_t>()[0] != 0x4000)  // 4 * 0.5 * 1.0: the call itself still works
      f.add(tag + " combine out[0] = " + std::to_string(c.out.ptr<uint16_t>()[0]));
  }
  // Accumulated over both rounds: the straggler's column holds at least two delays' worth on top
  // of the starting values.
  if (r != straggler) {
    if (ds.values()[straggler] - ds0[straggler] < kWaitDelayNs)
      f.add("dispatch stats did not accumulate over two rounds: " + show_values(ds0) + " -> " +
            show_values(ds.values()));
    if (cs.values()[straggler] - cs0[straggler] < kWaitDelayNs)
      f.add("combine stats did not accumulate over two rounds: " + show_values(cs0) + " -> " +
            show_values(cs.values()));
  }
  if (!ds.guards_intact() || !cs.guards_intact())
    f.add("an element outside the [R] view was written");
  return f.text;
}

TEST(LlWaitStats, StragglerOnThreads) {
  for (int R : {2, 3}) {
    for (bool hook : {false, true}) {
      SCOPED_TRACE("R = " + std::to_string(R) + (hook ? ", hook" : ""));
      std::vector<std::string> errors(R);
      testing::run_threads(R,
                           [&](const Group& g) { errors[g.rank()] = straggler_rounds(g, hook); });
      for (const auto& e : errors) EXPECT_EQ(e, "");
    }
  }
}

// The same on processes: published and start times come from the steady clock of different
// processes (CLOCK_MONOTONIC, one clock for the host).
TEST(LlWaitStats, StragglerOnProcesses) {
  const int rc = testing::run_processes(3, [](const Group& g) {
    const std::string e = straggler_rounds(g, false);
    if (!e.empty()) std::fprintf(stderr, "%s", e.c_str());
    return e.empty() ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
}

// R = 1: the only source is this rank, whose data is always there first: 0 added, every call.
TEST(LlWaitStats, OneRankAddsZero) {
  testing::run_threads(1, [](const Group& g) {
    Inputs in(1, 4, 5);
    Buffer buf(g, in.shape(), kLlOnly);
    Stats ds(1, 42), cs(1, 43);
    for (bool hook : {false, true}) {
      LlDispatchArgs da = in.dispatch_args();
      da.dispatch_wait_recv_cost_stats = ds.view();
      da.return_recv_hook = hook;
      const LlDispatchResult d = buf.ll_dispatch(da);
      if (d.hook) d.hook();
      LlCombineArgs ca = in.combine_args(d.handle);
      ca.combine_wait_recv_cost_stats = cs.view();
      ca.return_recv_hook = hook;
      const LlCombineResult c = buf.ll_combine(ca);
      if (c.hook) c.hook();
    }
    EXPECT_EQ(ds.values(), std::vector<int64_t>{42});
    EXPECT_EQ(cs.values(), std::vector<int64_t>{43});
    EXPECT_TRUE(ds.guards_intact() && cs.guards_intact());
  });
}

// The receive half is the hook: a source that sent long before the hook was called costs 0,
// however late the peers' hooks are (rank 1 calls its hooks kWaitDelayMs late; rank 0 blocks in the
// cpu backend's barrier meanwhile, but waits for no data). A source that sends late is counted
// in the hook that waited for it (rank 1 makes its dispatch call late: rank 0's hook waits).
TEST(LlWaitStats, HookCountsTheReceiveOnly) {
  std::vector<std::string> errors(2);
  testing::run_threads(2, [&](const Group& g) {
    const int r = g.rank();
    Failures f{r, ""};
    Inputs in(2, 8, 5);
    Buffer buf(g, in.shape(), kLlOnly);
    Stats ds(2), cs(2);
    // Late hooks on rank 1.
    g.barrier();
    LlDispatchArgs da = in.dispatch_args();
    da.dispatch_wait_recv_cost_stats = ds.view();
    da.return_recv_hook = true;
    LlDispatchResult d = buf.ll_dispatch(da);
    sleep_if(r == 1);
    d.hook();
    LlCombineArgs ca = in.combine_args(d.handle);
    ca.combine_wait_recv_cost_stats = cs.view();
    ca.return_recv_hook = true;
    LlCombineResult c = buf.ll_combine(ca);
    sleep_if(r == 1);
    c.hook();
    // No straggler as far as data goes: the own column 0, the peer's wait far below the sleep.
    check_added(f, "late hooks, dispatch", -1, Stats(2).values(), ds.values());
    check_added(f, "late hooks, combine", -1, Stats(2).values(), cs.values());
    // A late send on rank 1: rank 0's hook waits for it.
    g.barrier();
    std::vector<int64_t> before = ds.values();
    sleep_if(r == 1);
    d = buf.ll_dispatch(da);
    d.hook();
    check_added(f, "late send, dispatch hook", 1, before, ds.values());
    g.barrier();
    before = cs.values();
    sleep_if(r == 1);
    ca.handle = &d.handle;
    c = buf.ll_combine(ca);
    c.hook();
    check_added(f, "late send, combine hook", 1, before, cs.values());
    errors[r] = f.text;
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A combine on a rank with no tokens waits for nothing: it adds nothing, even for a straggler
// (rank 0 has T = 0; rank 2 is late).
TEST(LlWaitStats, CombineWithoutTokensAddsNothing) {
  std::vector<std::string> errors(3);
  testing::run_threads(3, [&](const Group& g) {
    const int r = g.rank();
    Failures f{r, ""};
    Inputs in(3, 12, r == 0 ? 0 : 5);
    Buffer buf(g, in.shape(), kLlOnly);
    Stats cs(3, 5);
    const LlDispatchResult d = buf.ll_dispatch(in.dispatch_args());
    g.barrier();
    const std::vector<int64_t> before = cs.values();
    sleep_if(r == 2);
    LlCombineArgs ca = in.combine_args(d.handle);
    ca.combine_wait_recv_cost_stats = cs.view();
    buf.ll_combine(ca);
    if (r == 0) {
      if (cs.values() != before)
        f.add("T = 0 combine added " + show_values(before) + " -> " + show_values(cs.values()));
    } else {
      check_added(f, "combine", 2, before, cs.values());
    }
    errors[r] = f.text;
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// A receive that raises (the ranks disagree on use_fp8) adds nothing; after ll_clean the same
// tensor accumulates again.
TEST(LlWaitStats, FailedReceiveAddsNothing) {
  testing::run_threads(2, [](const Group& g) {
    Inputs in(2, 8, 5);
    Buffer buf(g, in.shape(), kLlOnly);
    Stats ds(2, 9);
    LlDispatchArgs a = in.dispatch_args();
    a.dispatch_wait_recv_cost_stats = ds.view();
    a.use_fp8 = g.rank() == 0;
    if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_THROW(buf.ll_dispatch(a), Error);
    EXPECT_EQ(ds.values(), Stats(2, 9).values());
    buf.ll_clean();
    a.use_fp8 = true;
    g.barrier();
    if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(kWaitDelayMs));
    buf.ll_dispatch(a);
    if (g.rank() == 0) {
      EXPECT_EQ(ds.values()[0], 9);
      EXPECT_GE(ds.values()[1], 1009 + kWaitDelayNs / 2);
    } else {
      EXPECT_EQ(ds.values(), Stats(2, 9).values());
    }
  });
}

// ---- validation --------------------------------------------------------------------------

void expect_invalid(const std::function<void()>& f, const std::vector<const char*>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    for (const char* n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message lacks '" << n << "': " << e.what();
  }
}

TEST(LlWaitStats, ValidationNamesTheArgument) {
  testing::run_threads(2, [](const Group& g) {
    Inputs in(2, 8, 5);
    Buffer buf(g, in.shape(), kLlOnly);
    std::vector<int64_t> i64(8, 0);
    std::vector<int32_t> i32(8, 0);
    // Each bad view, with the words its message must contain.
    struct Bad {
      TensorView view;
      std::vector<const char*> needles;
    };
    std::vector<Bad> bad;
    bad.push_back({TensorView::contiguous(i32.data(), DType::kI32, {2}), {"i32", "i64"}});
    bad.push_back({TensorView::contiguous(i64.data(), DType::kI64, {3}), {"[3]", "[2]"}});
    bad.push_back(
        {TensorView::contiguous(i64.data(), DType::kI64, {2, 2}), {"[2]"}});  // DeepEP's doc
    bad.push_back({TensorView::contiguous(i64.data(), DType::kI64, {1}), {"[1]", "[2]"}});
    TensorView strided = TensorView::contiguous(i64.data(), DType::kI64, {2});
    strided.strides[0] = 2;
    bad.push_back({strided, {"stride"}});
    TensorView on_gpu = TensorView::contiguous(i64.data(), DType::kI64, {2});
    on_gpu.device = Device::cuda(0);
    bad.push_back({on_gpu, {"cuda:0", "cpu"}});
    for (const Bad& b : bad) {
      SCOPED_TRACE(b.view.describe());
      std::vector<const char*> needles = b.needles;
      needles.push_back("ll_dispatch");
      needles.push_back("'dispatch_wait_recv_cost_stats'");
      expect_invalid(
          [&] {
            LlDispatchArgs a = in.dispatch_args();
            a.dispatch_wait_recv_cost_stats = b.view;
            buf.ll_dispatch(a);
          },
          needles);
    }
    // Errors are local and leave nothing behind: a valid dispatch, then the combine's checks.
    const LlDispatchResult d = buf.ll_dispatch(in.dispatch_args());
    for (const Bad& b : bad) {
      SCOPED_TRACE(b.view.describe());
      std::vector<const char*> needles = b.needles;
      needles.push_back("ll_combine");
      needles.push_back("'combine_wait_recv_cost_stats'");
      expect_invalid(
          [&] {
            LlCombineArgs a = in.combine_args(d.handle);
            a.combine_wait_recv_cost_stats = b.view;
            buf.ll_combine(a);
          },
          needles);
    }
    // Nothing was written by the refused calls; a valid combine still works.
    for (int64_t v : i64) EXPECT_EQ(v, 0);
    for (int32_t v : i32) EXPECT_EQ(v, 0);
    Stats cs(2);
    LlCombineArgs a = in.combine_args(d.handle);
    a.combine_wait_recv_cost_stats = cs.view();
    EXPECT_EQ(buf.ll_combine(a).out.ptr<uint16_t>()[0], 0x4000);
    EXPECT_TRUE(cs.guards_intact());
  });
}

}  // namespace
}  // namespace epx
