// The overlapped ll combine (LlCombineArgs::overlap, docs/semantics.md §2.7) on the cpu backend.
// Per rank a host thread plays the expert GEMM (tests/support/ll_overlap.h): it stores y part by
// part in a seeded random order with random delays and raises each part's signal with a release
// add, while the rank's combine waits for the signals. y (or the zero-copy buffer) is poisoned
// with NaN before, so a block read before its signal shows in out. Every out row is compared bit
// for bit with the oracle and with the plain combine of the same y: both signal forms, hooks,
// copy and zero_copy, empty experts, T = 0, two rounds on one buffer, threads and processes.
// Then the errors: a signal never raised (Timeout naming it on this rank, the peer's barrier
// times out, ll_clean, the next overlapped combine exact), the argument checks, a recv_count
// that is not the handle's, and ranks that disagree on passing overlap.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/ll_cases.h"
#include "support/ll_overlap.h"
#include "support/oracle_ll.h"

namespace epx {
namespace {

using testing::LlBatch;
using testing::LlCase;
using testing::LlProblem;
using testing::OverlapCase;
using testing::OverlapForm;
using testing::OverlapGemmPart;

OverlapCase random_case(uint64_t seed, int R) {
  std::mt19937_64 rng(seed * 104729 + 3);
  auto pick = [&](std::vector<int64_t> v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  auto coin = [&] { return rng() % 2 == 0; };
  OverlapCase oc;
  LlCase& c = oc.c;
  c.seed = seed;
  LlProblem& p = c.p;
  p.num_ranks = R;
  p.num_experts = static_cast<int>(R * pick({1, 2, 4, 9}));
  p.top_k = static_cast<int>(pick({1, 4, 8, 9}));
  p.max_tokens = pick({1, 7, 33, 64});
  p.hidden = pick({128, 384});
  const auto routings = testing::all_routings();
  c.routing = routings[seed % routings.size()];
  c.hook = coin();
  c.zero_copy = coin();
  c.out_given = coin();
  c.num_iters = seed % 3 == 0 ? 2 : 1;
  if (coin()) {
    oc.form.block_rows = pick({1, 7, 64, p.rows_per_expert()});
    oc.form.parts = static_cast<int>(pick({1, 3}));
  } else {
    oc.form.parts = static_cast<int>(pick({1, 2, 4}));
  }
  oc.num_sms = static_cast<int>(pick({0, 1, 3}));
  oc.check_count = coin();
  return oc;
}

// A contiguous bf16 [L, RT, H] view of `v`.
TensorView y_view(std::vector<uint16_t>& v, int64_t L, int64_t RT, int64_t H) {
  return TensorView::contiguous(v.data(), DType::kBF16, {L, RT, H});
}

// Plays rank r's GEMM on a thread: each part's rows of `src` (the batch's y) into `dst`, then
// signals[part.signal] += 1 with release, in the parts' order after their delays.
std::thread start_gemm(const std::vector<OverlapGemmPart>& parts, const std::vector<uint16_t>& src,
                       const TensorView& dst, std::vector<int32_t>& signals, int64_t RT,
                       int64_t H) {
  return std::thread([&parts, &src, dst, &signals, RT, H] {
    for (const OverlapGemmPart& p : parts) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(p.delay_ns));
      for (int64_t row = p.row_begin; row < p.row_end; ++row)
        std::memcpy(dst.ptr<uint16_t>() + p.l * dst.strides[0] + row * dst.strides[1] + p.col_begin,
                    src.data() + (p.l * RT + row) * H + p.col_begin,
                    sizeof(uint16_t) * (p.col_end - p.col_begin));
      __atomic_fetch_add(&signals[p.signal], 1, __ATOMIC_RELEASE);
    }
  });
}

LlDispatchResult dispatch(Buffer& buf, const LlCase& c, const LlBatch& b, int r) {
  const testing::LlRankInput& in = b.in[r];
  LlDispatchArgs a;
  a.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16,
                               {in.num_tokens, c.p.hidden});
  a.topk_idx = TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64,
                                      {in.num_tokens, c.p.top_k});
  a.use_fp8 = false;
  return buf.ll_dispatch(a);
}

LlCombineArgs combine_args(const LlCase& c, const LlBatch& b, int r, const LlHandle& h) {
  const testing::LlRankInput& in = b.in[r];
  LlCombineArgs a;
  a.handle = &h;
  a.topk_idx = TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64,
                                      {in.num_tokens, c.p.top_k});
  a.topk_weights = TensorView::contiguous(const_cast<float*>(in.topk_weights.data()), DType::kF32,
                                          {in.num_tokens, c.p.top_k});
  return a;
}

// Byte comparison of two [T, H] bf16 outputs: "" or the first difference.
std::string same_out(const TensorView& a, const TensorView& b, int64_t T, int64_t H) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const uint16_t x = a.ptr<uint16_t>()[t * a.strides[0] + c];
      const uint16_t y = b.ptr<uint16_t>()[t * b.strides[0] + c];
      if (x != y)
        return "out[" + std::to_string(t) + "][" + std::to_string(c) + "] = " + std::to_string(x) +
               ", the plain combine's " + std::to_string(y);
    }
  return "";
}

// One overlapped combine of batch b on rank r (the GEMM thread of `form` raising its signals;
// `skip_signal`: one it never raises); returns its result after the hook ran. Throws what the
// combine threw (after the GEMM thread finished).
LlCombineResult overlapped_combine(Buffer& buf, const OverlapCase& oc, const LlBatch& b, int r,
                                   const LlHandle& h, std::vector<uint16_t>& out_storage,
                                   int skip_signal = -1) {
  const LlCase& c = oc.c;
  const LlProblem& p = c.p;
  const int L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden, T = b.in[r].num_tokens;
  std::mt19937_64 rng(c.seed * 31 + r);
  const std::vector<OverlapGemmPart> parts =
      testing::overlap_gemm_parts(b.want[r].recv_count, RT, H, oc.form, rng, 100000, skip_signal);
  std::vector<int32_t> signals(L * testing::overlap_blocks(RT, oc.form.block_rows), 0);
  std::vector<uint16_t> y(c.zero_copy ? 0 : L * RT * H, testing::kLlPoisonBf16);
  LlCombineArgs a = combine_args(c, b, r, h);
  TensorView dst;
  if (c.zero_copy) {
    dst = buf.ll_next_combine_buffer(h);
    for (int l = 0; l < L; ++l)
      for (int64_t row = 0; row < RT; ++row)
        std::fill_n(dst.ptr<uint16_t>() + l * dst.strides[0] + row * dst.strides[1], H,
                    testing::kLlPoisonBf16);
    a.zero_copy = true;
  } else {
    dst = a.y = y_view(y, L, RT, H);
  }
  if (c.out_given) {
    out_storage.assign(std::max<int64_t>(T, 1) * H, 0xFFFF);
    a.out = TensorView::contiguous(out_storage.data(), DType::kBF16, {T, H});
  }
  a.return_recv_hook = c.hook;
  LlCombineOverlap o;
  o.signals =
      TensorView::contiguous(signals.data(), DType::kI32, {static_cast<int64_t>(signals.size())});
  o.block_rows = oc.form.block_rows;
  o.expected = oc.form.parts;
  o.num_sms = oc.num_sms;
  std::vector<int32_t> recv_count = b.want[r].recv_count;
  if (oc.check_count) o.recv_count = TensorView::contiguous(recv_count.data(), DType::kI32, {L});
  a.overlap = o;
  std::thread gemm = start_gemm(parts, b.y[r], dst, signals, RT, H);
  LlCombineResult res;
  try {
    res = buf.ll_combine(a);
    if (res.hook) res.hook();
  } catch (...) {
    gemm.join();
    throw;
  }
  gemm.join();
  return res;
}

std::string run_rank(const OverlapCase& oc, const std::vector<LlBatch>& batches, const Group& g) {
  const LlCase& c = oc.c;
  const LlProblem& p = c.p;
  const int r = g.rank(), L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  BufferConfig config;
  config.enable_ht = false;
  config.enable_ll = true;
  Buffer buf(g, MoeShape{H, p.top_k, p.num_experts, p.max_tokens}, config);
  for (size_t i = 0; i < batches.size(); ++i) {
    const LlBatch& b = batches[i];
    const std::string where = "rank " + std::to_string(r) + " batch " + std::to_string(i) + ": ";
    const LlDispatchResult d = dispatch(buf, c, b, r);
    // The plain combine of the same y.
    LlCombineArgs a = combine_args(c, b, r, d.handle);
    std::vector<uint16_t> y = b.y[r];
    a.y = y_view(y, L, RT, H);
    const LlCombineResult plain = buf.ll_combine(a);
    std::vector<uint16_t> out_storage;
    const LlCombineResult ov = overlapped_combine(buf, oc, b, r, d.handle, out_storage);
    std::string e = testing::check_ll_combine(p, b.want_out[r], ov.out);
    if (e.empty()) e = same_out(ov.out, plain.out, b.in[r].num_tokens, H);
    if (!e.empty()) return where + e;
  }
  return "";
}

void run_case(const OverlapCase& oc, bool processes) {
  SCOPED_TRACE(oc.describe());
  const std::vector<LlBatch> batches = testing::make_ll_batches(oc.c);
  if (processes) {
    EXPECT_EQ(testing::run_processes(oc.c.p.num_ranks,
                                     [&](const Group& g) {
                                       const std::string e = run_rank(oc, batches, g);
                                       if (!e.empty()) std::fprintf(stderr, "%s\n", e.c_str());
                                       return e.empty() ? 0 : 1;
                                     }),
              0);
    return;
  }
  std::vector<std::string> errors(oc.c.p.num_ranks);
  testing::run_threads(oc.c.p.num_ranks,
                       [&](const Group& g) { errors[g.rank()] = run_rank(oc, batches, g); });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

TEST(LlOverlap, MatchesPlainCombineAndOracleOnThreads) {
  for (uint64_t seed = 0; seed < 32; ++seed) run_case(random_case(seed, 1 + seed % 4), false);
}

TEST(LlOverlap, MatchesPlainCombineAndOracleOnProcesses) {
  for (uint64_t seed = 1000; seed < 1003; ++seed) run_case(random_case(seed, 2 + seed % 2), true);
}

// Every expert of the second rank empty (all tokens to one expert of rank 0), both forms: the
// combine must not wait for signals of experts without rows (they are never raised).
TEST(LlOverlap, EmptyExpertsAreNotWaitedFor) {
  for (int64_t block_rows : {int64_t{0}, int64_t{4}}) {
    OverlapCase oc;
    oc.c.p = LlProblem{2, 16, 128, 4, 8};
    oc.c.routing = testing::Routing::kAllToOne;
    oc.c.seed = 77 + block_rows;
    oc.form = {block_rows, 2};
    run_case(oc, false);
  }
}

// Rank 0's GEMM never raises one signal: rank 0's combine raises Timeout naming the expert, the
// block, the value wanted and the value seen; rank 1's waits for rank 0 in its barrier and times
// out too. After ll_clean on both, a new dispatch and overlapped combine are exact.
TEST(LlOverlap, SignalNeverRaisedTimesOutThenCleanRecovers) {
  const OverlapCase oc = testing::two_round_case(LlProblem{2, 8, 128, 2, 4}, 5, {3, 2});
  const std::vector<LlBatch> batches = testing::make_ll_batches(oc.c);
  const LlProblem& p = oc.c.p;
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(400);
  std::vector<std::string> errors(2);
  testing::run_threads(
      2,
      [&](const Group& g) {
        const int r = g.rank();
        std::string& err = errors[r];
        BufferConfig config;
        config.enable_ht = false;
        config.enable_ll = true;
        Buffer buf(g, p.moe_shape(), config);
        const LlDispatchResult d = dispatch(buf, oc.c, batches[0], r);
        const int skip =
            testing::first_signal_with_rows(batches[0].want[0].recv_count, p.rows_per_expert(), 3);
        const int64_t blocks = testing::overlap_blocks(p.rows_per_expert(), 3);
        std::vector<uint16_t> out;
        try {
          overlapped_combine(buf, oc, batches[0], r, d.handle, out, r == 0 ? skip : -1);
          err = "no Timeout";
        } catch (const Error& e) {
          const std::string what = e.what();
          const std::string want = "local expert " + std::to_string(skip / blocks) +
                                   ", block 0 "
                                   "(overlap.signals[" +
                                   std::to_string(skip) + "] wanted >= 2, seen 0)";
          if (e.code() != ErrorCode::kTimeout) err = "code " + std::to_string(int(e.code()));
          if (r == 0 && what.find(want) == std::string::npos) err = "message: " + what;
        }
        // Refused until ll_clean, then exact.
        try {
          dispatch(buf, oc.c, batches[1], r);
          if (err.empty()) err = "ll_dispatch after the Timeout was not refused";
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kOutOfStep && err.empty())
            err = std::string("refusal: ") + e.what();
        }
        buf.ll_clean();
        const LlDispatchResult d2 = dispatch(buf, oc.c, batches[1], r);
        const LlCombineResult res = overlapped_combine(buf, oc, batches[1], r, d2.handle, out);
        const std::string e = testing::check_ll_combine(p, batches[1].want_out[r], res.out);
        if (err.empty()) err = e;
      },
      options);
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// The argument checks (R = 1: a rank that raises before publishing would leave peers waiting).
TEST(LlOverlap, ArgumentErrors) {
  testing::run_threads(1, [&](const Group& g) {
    const LlProblem p{1, 4, 128, 2, 4};
    LlCase c;
    c.p = p;
    c.fixed_tokens = {4};
    c.seed = 9;
    std::mt19937_64 rng(9);
    const LlBatch b = testing::make_ll_batch(c, rng);
    BufferConfig config;
    config.enable_ht = false;
    config.enable_ll = true;
    Buffer buf(g, p.moe_shape(), config);
    const LlDispatchResult d = dispatch(buf, c, b, 0);
    std::vector<uint16_t> y = b.y[0];
    std::vector<int32_t> signals(64, 1);
    std::vector<int64_t> signals64(64, 1);
    std::vector<int32_t> count = b.want[0].recv_count;
    auto expect = [&](ErrorCode code, const std::string& needle,
                      const std::function<void(LlCombineArgs&, LlCombineOverlap&)>& edit) {
      LlCombineArgs a = combine_args(c, b, 0, d.handle);
      a.y = y_view(y, p.num_local_experts(), p.rows_per_expert(), p.hidden);
      LlCombineOverlap o;
      o.signals = TensorView::contiguous(signals.data(), DType::kI32, {64});
      edit(a, o);
      a.overlap = o;
      try {
        buf.ll_combine(a);
        ADD_FAILURE() << "no error, expected one naming " << needle;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), code) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    // L = 4 experts x ceil(4 / 3) = 2 blocks = 8 signals needed.
    expect(ErrorCode::kInvalidArgument, "'overlap.signals' has 7 elements, expected at least 8",
           [&](LlCombineArgs&, LlCombineOverlap& o) {
             o.block_rows = 3;
             o.signals.shape[0] = 7;
           });
    expect(ErrorCode::kInvalidArgument, "'overlap.signals'",
           [&](LlCombineArgs&, LlCombineOverlap& o) {
             o.signals = TensorView::contiguous(signals64.data(), DType::kI64, {64});
           });
    expect(ErrorCode::kInvalidArgument, "'overlap.signals'",
           [&](LlCombineArgs&, LlCombineOverlap& o) { o.signals = TensorView(); });
    expect(ErrorCode::kInvalidArgument, "'overlap.block_rows' is -1",
           [&](LlCombineArgs&, LlCombineOverlap& o) { o.block_rows = -1; });
    expect(ErrorCode::kInvalidArgument, "'overlap.expected' is 0",
           [&](LlCombineArgs&, LlCombineOverlap& o) { o.expected = 0; });
    expect(ErrorCode::kInvalidArgument, "'overlap.num_sms' is -2",
           [&](LlCombineArgs&, LlCombineOverlap& o) { o.num_sms = -2; });
    expect(ErrorCode::kUnsupported, "'use_logfmt'",
           [&](LlCombineArgs& a, LlCombineOverlap&) { a.use_logfmt = true; });
    expect(ErrorCode::kInvalidArgument, "'overlap.recv_count'",
           [&](LlCombineArgs&, LlCombineOverlap& o) {
             o.recv_count = TensorView::contiguous(count.data(), DType::kI32, {3});
           });
    count[1] += 1;
    expect(ErrorCode::kInvalidArgument,
           "'overlap.recv_count' has [1] = " + std::to_string(count[1]) + ", expected " +
               std::to_string(count[1] - 1),
           [&](LlCombineArgs&, LlCombineOverlap& o) {
             o.recv_count = TensorView::contiguous(count.data(), DType::kI32, {4});
           });
  });
}

// Rank 0 passes overlap, rank 1 does not: both complete the call and raise InvalidArgument
// naming it with each rank's value.
TEST(LlOverlap, RanksDisagreeOnOverlap) {
  OverlapCase oc;
  oc.c.p = LlProblem{2, 4, 128, 2, 4};
  oc.c.seed = 11;
  const std::vector<LlBatch> batches = testing::make_ll_batches(oc.c);
  const LlProblem& p = oc.c.p;
  std::vector<std::string> errors(2);
  testing::run_threads(2, [&](const Group& g) {
    const int r = g.rank();
    BufferConfig config;
    config.enable_ht = false;
    config.enable_ll = true;
    Buffer buf(g, p.moe_shape(), config);
    const LlDispatchResult d = dispatch(buf, oc.c, batches[0], r);
    std::string& err = errors[r];
    try {
      if (r == 0) {
        std::vector<uint16_t> out;
        overlapped_combine(buf, oc, batches[0], r, d.handle, out);
      } else {
        LlCombineArgs a = combine_args(oc.c, batches[0], r, d.handle);
        std::vector<uint16_t> y = batches[0].y[r];
        a.y = y_view(y, p.num_local_experts(), p.rows_per_expert(), p.hidden);
        buf.ll_combine(a);
      }
      err = "no error";
    } catch (const Error& e) {
      const std::string what = e.what();
      if (e.code() != ErrorCode::kInvalidArgument ||
          what.find("whether argument 'overlap' is given differs across ranks: rank 0 has true, "
                    "rank 1 has false") == std::string::npos)
        err = what;
    }
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace epx
