// ll combine with use_logfmt on the cpu backend (docs/semantics.md §2.3.1), driven as DeepEP's
// tests/test_low_latency.py --use-logfmt drives it: every rank's x is DeepEP's (a structured
// batch of values >= 1, which stay raw, then randn * 0.5 * u and randn * 0.1 batches), the
// expert is the identity (y = what the dispatch delivered, fp8 dequantised), and each result is
//   (a) equal, element for element, to the oracle (tests/support/oracle_ll.h with use_logfmt:
//       the independent LogFMT of tests/support/logfmt_ref.h), and
//   (b) within DeepEP's tolerance: calc_diff(x * sum_k w, out) < 1e-5 after a bf16 dispatch,
//       < 9e-4 after an fp8 one (its test's bounds), and every element within the format's
//       bound of the plain bf16 combine of the same rows.
// Hook or not, zero_copy or not, a poisoned `out` or an allocated one; threads and processes; one
// node, and across nodes at 2x2 and 3x1 (the oracle's per-node chains of decoded rows, the
// partials float32). Then use_logfmt differing across ranks, on one node and across nodes (the
// differing rank on another node than most): InvalidArgument on every rank, usable after
// ll_clean.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/numeric.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/oracle_ll.h"
#include "support/routing.h"

namespace epx {
namespace {

using testing::LlProblem;
using testing::LlRankInput;

constexpr int64_t kH = 512, kTMax = 24;
constexpr int kK = 6;

// DeepEP's x_list: batch 0 structured (rank - 128 everywhere, the token index in the last 128
// channels), then randn * 0.5 * u (u uniform per batch) and randn * 0.1.
std::vector<uint16_t> deepep_x(int batch, int rank, int64_t T, std::mt19937_64& rng) {
  std::vector<uint16_t> x(T * kH);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float scale = batch == 3 ? 0.1f : 0.5f * std::uniform_real_distribution<float>(0, 1)(rng);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < kH; ++c)
      x[t * kH + c] = detail::f32_to_bf16(batch == 0 ? (c >= kH - 128 ? float(t) : rank - 128.0f)
                                                     : normal(rng) * scale);
  return x;
}

// DeepEP's calc_diff: 1 - 2 sum(a b) / sum(a^2 + b^2) over a = x + 1, b = y + 1, in double.
double calc_diff(const std::vector<double>& x, const std::vector<double>& y) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double a = x[i] + 1, b = y[i] + 1;
    num += a * b;
    den += a * a + b * b;
  }
  return 1 - 2 * num / den;
}

struct Problem {
  LlProblem p;
  std::vector<LlRankInput> in;
  std::vector<std::vector<uint16_t>> y;  // [R] the identity expert's rows, [L, RT, H]
};

// per_node: GroupOptions::ranks_per_node of the run (0: one node).
Problem make_problem(int R, int batch, bool fp8, uint64_t seed, int per_node = 0) {
  Problem pr;
  pr.p = {R, kTMax, kH, kK, 4 * R, fp8, false, false, true, per_node};
  std::mt19937_64 rng(seed);
  for (int r = 0; r < R; ++r) {
    LlRankInput in;
    in.num_tokens = r == 1 ? 0 : kTMax - r;  // T = 0 on rank 1
    in.x = deepep_x(batch, r, in.num_tokens, rng);
    in.topk_idx = testing::make_topk_idx(testing::Routing::kUniform, in.num_tokens, kK,
                                         pr.p.num_experts, R, rng, 0);
    in.topk_weights = testing::make_topk_weights(in.topk_idx, rng);
    pr.in.push_back(std::move(in));
  }
  const int64_t G = pr.p.num_groups();
  for (int d = 0; d < R; ++d) {  // y = the dispatch's rows (fp8: e4m3 * scale, rounded to bf16)
    const testing::LlExpectedDispatch want = testing::oracle_ll_dispatch(pr.p, pr.in, d);
    std::vector<uint16_t> y(want.recv_x.size() / (fp8 ? 1 : 2), 0x7FC1);
    for (int64_t i = 0; i < static_cast<int64_t>(y.size()); ++i) {
      if (!fp8) {
        std::memcpy(&y[i], &want.recv_x[2 * i], 2);
        continue;
      }
      const float s = want.recv_scales[(i / kH) * G + (i % kH) / 128];
      y[i] = detail::f32_to_bf16(detail::fp8_e4m3_to_f32(want.recv_x[i]) * s);
    }
    pr.y.push_back(std::move(y));
  }
  return pr;
}

// One rank: dispatch, then a plain and a LogFMT combine of the same rows; checks (a) and (b).
std::string run_rank(const Problem& pr, const Group& g, bool hook, bool zero_copy, bool out_given,
                     bool fp8, int batch) {
  const LlProblem& p = pr.p;
  const int r = g.rank(), L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert();
  const LlRankInput& in = pr.in[r];
  const int64_t T = in.num_tokens;
  Buffer buf(g, MoeShape{kH, kK, p.num_experts, kTMax}, BufferConfig{false, true});
  const Allocator alloc = testing::poison_allocator(0xA5);
  LlDispatchArgs da;
  da.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16, {T, kH});
  da.topk_idx =
      TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64, {T, kK});
  da.use_fp8 = fp8;
  const LlDispatchResult d = buf.ll_dispatch(da, alloc);
  std::vector<uint16_t> y = pr.y[r], out_buf(std::max<int64_t>(T, 1) * kH, 0xFFFF);
  auto combine = [&](bool logfmt) {
    LlCombineArgs a;
    a.handle = &d.handle;
    a.topk_idx = da.topk_idx;
    a.topk_weights =
        TensorView::contiguous(const_cast<float*>(in.topk_weights.data()), DType::kF32, {T, kK});
    a.use_logfmt = logfmt;
    a.return_recv_hook = logfmt && hook;
    if (logfmt && zero_copy) {
      TensorView v = buf.ll_next_combine_buffer(d.handle);
      std::memcpy(v.data, y.data(), y.size() * 2);
      a.zero_copy = true;
    } else {
      a.y = TensorView::contiguous(y.data(), DType::kBF16, {L, RT, kH});
    }
    if (logfmt && out_given) a.out = TensorView::contiguous(out_buf.data(), DType::kBF16, {T, kH});
    LlCombineResult res = buf.ll_combine(a, alloc);
    if (res.hook) res.hook();
    return res;
  };
  const LlCombineResult plain = combine(false);
  const LlCombineResult lf = combine(true);
  if (out_given && lf.out.data != out_buf.data()) return "out given but not the result";
  // (a)
  const std::vector<uint16_t> want = testing::oracle_ll_combine(p, pr.in, pr.y, r);
  std::string err = testing::check_ll_combine(p, want, lf.out);
  if (!err.empty()) return "(a) " + err;
  // (b) DeepEP's check against x * sum of the selected weights, and the element bound.
  std::vector<double> ref, got;
  std::vector<uint8_t> q(kH);
  std::vector<float> scales(kH / 128);
  for (int64_t t = 0; t < T; ++t) {
    double wsum = 0;
    for (int k = 0; k < kK; ++k)
      if (in.topk_idx[t * kK + k] >= 0) wsum += in.topk_weights[t * kK + k];
    // Every selection of token t brings back the same row y(t): the identity expert's input.
    if (fp8) detail::quantize_row_fp8(in.x.data() + t * kH, kH, false, q.data(), scales.data());
    for (int64_t c = 0; c < kH; ++c) {
      const double lf_v = detail::bf16_to_f32(lf.out.ptr<uint16_t>()[t * kH + c]);
      const double plain_v = detail::bf16_to_f32(plain.out.ptr<uint16_t>()[t * kH + c]);
      const double x = detail::bf16_to_f32(in.x[t * kH + c]);
      const double y = fp8 ? detail::bf16_to_f32(detail::f32_to_bf16(detail::fp8_e4m3_to_f32(q[c]) *
                                                                     scales[c / 128]))
                           : x;
      ref.push_back(x * wsum);
      got.push_back(lf_v);
      // |decoded - y| <= 2.22 % of |y| (half a step, at most 32 / 510 in log2, of relative
      // error) per selection, plus the two outputs' bf16 roundings (half an ulp each).
      const double bound =
          0.0222 * wsum * std::fabs(y) + 0.0079 * (std::fabs(lf_v) + std::fabs(plain_v)) + 1e-30;
      if (!(std::fabs(lf_v - plain_v) <= bound))
        return detail::cat("(b) out[", t, "][", c, "] = ", lf_v, " vs the plain combine's ",
                           plain_v, ", more than ", bound, " apart");
    }
  }
  const double diff = T ? calc_diff(ref, got) : 0.0;
  const double limit = fp8 ? 9e-4 : 1e-5;
  if (!(diff < limit)) return detail::cat("(b) calc_diff = ", diff, ", DeepEP's bound ", limit);
  // The structured batch (values >= 1, all-equal and all-zero groups) stays raw: bit for bit.
  if (batch == 0 && testing::check_ll_combine(p, want, plain.out) != "")
    return "(b) a raw batch differs from the plain combine";
  return "";
}

void run(int R, bool processes, uint64_t seed, int per_node = 0) {
  GroupOptions options;
  options.ranks_per_node = per_node;
  for (int batch = 0; batch < 4; ++batch) {
    for (int variant = 0; variant < 8; ++variant) {
      const bool hook = variant & 1, zero_copy = variant & 2, out_given = variant & 4;
      const bool fp8 = (variant + batch) % 3 == 0;
      const Problem pr = make_problem(R, batch, fp8, seed + 97 * batch + variant, per_node);
      const std::string what =
          detail::cat(pr.p.describe(), " batch=", batch, " hook=", hook, " zero_copy=", zero_copy,
                      " out=", out_given, " fp8=", fp8, processes ? " processes" : " threads");
      if (processes) {
        const int rc = testing::run_processes(
            R,
            [&](const Group& g) {
              const std::string e = run_rank(pr, g, hook, zero_copy, out_given, fp8, batch);
              if (!e.empty())
                std::fprintf(stderr, "%s rank %d: %s\n", what.c_str(), g.rank(), e.c_str());
              return e.empty() ? 0 : 1;
            },
            options);
        EXPECT_EQ(rc, 0) << what;
        continue;
      }
      std::vector<std::string> errors(R);
      testing::run_threads(
          R,
          [&](const Group& g) {
            errors[g.rank()] = run_rank(pr, g, hook, zero_copy, out_given, fp8, batch);
          },
          options);
      for (int r = 0; r < R; ++r) EXPECT_EQ(errors[r], "") << what << " rank " << r;
    }
  }
}

TEST(LlLogfmt, DeepEpInputsExactAndWithinDeepEpToleranceThreads) {
  for (int R : {1, 2, 4}) run(R, false, 1000 * R);
}

TEST(LlLogfmt, DeepEpInputsExactAndWithinDeepEpToleranceProcesses) {
  run(3, true, 7000);
}

// Across nodes (docs/semantics.md §2.3): every row decoded by the rank that reduces it (the
// source for its node's experts, the forwarder for the others'), the partials float32.
TEST(LlLogfmt, DeepEpInputsExactAndWithinDeepEpToleranceAcrossNodes) {
  run(4, false, 9000, 2);  // 2x2
  run(3, false, 9500, 1);  // 3x1
  run(4, true, 9900, 2);   // 2x2, processes
}

// The last rank differs; across nodes (2x2, 3x1) the others see its header in the partials.
TEST(LlLogfmt, DifferingAcrossRanksIsInvalidArgumentOnEveryRank) {
  const testing::NodeTopology runs[] = {{1, 2}, {1, 3}, {2, 2}, {3, 1}};
  for (const testing::NodeTopology& topo : runs) {
    const int R = topo.num_ranks(), per_node = topo.per_node;
    const Problem pr = make_problem(R, 2, false, 55 + R + 10 * (topo.nodes - 1), per_node);
    std::vector<std::string> seen(R), after(R);
    auto body = [&](const Group& g) {
      const int r = g.rank(), L = pr.p.num_local_experts();
      const LlRankInput& in = pr.in[r];
      const int64_t T = in.num_tokens, RT = pr.p.rows_per_expert();
      Buffer buf(g, MoeShape{kH, kK, pr.p.num_experts, kTMax}, BufferConfig{false, true});
      LlDispatchArgs da;
      da.x = TensorView::contiguous(const_cast<uint16_t*>(in.x.data()), DType::kBF16, {T, kH});
      da.topk_idx =
          TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()), DType::kI64, {T, kK});
      da.use_fp8 = false;
      std::vector<uint16_t> y = pr.y[r];
      auto combine = [&](const LlDispatchResult& d, bool logfmt) {
        LlCombineArgs a;
        a.handle = &d.handle;
        a.topk_idx = da.topk_idx;
        a.topk_weights = TensorView::contiguous(const_cast<float*>(in.topk_weights.data()),
                                                DType::kF32, {T, kK});
        a.y = TensorView::contiguous(y.data(), DType::kBF16, {L, RT, kH});
        a.use_logfmt = logfmt;
        return buf.ll_combine(a);
      };
      LlDispatchResult d = buf.ll_dispatch(da);
      try {
        combine(d, r == R - 1);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kInvalidArgument) seen[r] = e.what();
      }
      buf.ll_clean();
      d = buf.ll_dispatch(da);
      after[r] = testing::check_ll_combine(pr.p, testing::oracle_ll_combine(pr.p, pr.in, pr.y, r),
                                           combine(d, true).out);
    };
    testing::run_threads(R, body, topo.options());
    const std::string others = R == 2   ? "rank 0 has false"
                               : R == 3 ? "ranks 0, 1 have false"
                                        : "ranks 0-2 have false";
    for (int r = 0; r < R; ++r) {
      for (const std::string& n : {std::string("ll_combine: argument 'use_logfmt' differs across "
                                               "ranks"),
                                   others, "rank " + std::to_string(R - 1) + " has true"})
        EXPECT_NE(seen[r].find(n), std::string::npos)
            << pr.p.describe() << " rank " << r << ": " << seen[r];
      EXPECT_EQ(after[r], "") << pr.p.describe() << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace epx
