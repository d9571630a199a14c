// a2a mode on the cpu backend vs the naive oracle (tests/support/oracle_a2a.h). The errors of
// SPEC 5 and the workspace size are tested in a2a_errors_test.cc.
//
// Every check compares every element: all valid rows of every payload, recv_counts, the
// sanitised padding of the expert-id payload, the zeroed padding of the other payloads (a cpu
// backend property) and combine's out bit for bit. Outputs are poisoned before the library writes
// them: out comes from an allocator that fills with 0xFF (NaN), the previous dispatch's receive
// views are overwritten with 0xA5 before the next dispatch, and the combine region is filled
// with 0xFF before a copying combine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

#include "epx/a2a.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/oracle_a2a.h"
#include "support/routing.h"

namespace epx {
namespace {

using testing::A2aExpected;
using testing::A2aPayloadSpec;
using testing::A2aProblem;
using testing::Routing;
using Fill = A2aPayloadSpec::Fill;

// ---- helpers ---------------------------------------------------------------------------------

// How one dispatch/combine cycle feeds the library.
struct CycleOptions {
  bool payload_in_workspace = false;
  bool topk_int64 = false;
  bool strided_y = false;  // copy path with a padded row stride
};

std::string describe(const A2aProblem& p, const CycleOptions& o) {
  std::ostringstream os;
  os << "R=" << p.num_ranks << " K=" << p.top_k << " E=" << p.num_experts
     << " max=" << p.max_tokens_per_rank << " M=" << p.runtime_max << " T=[";
  for (int r = 0; r < p.num_ranks; ++r) os << (r ? "," : "") << p.num_tokens[r];
  os << "] payloads=[";
  for (size_t i = 0; i < p.payloads.size(); ++i) {
    os << (i ? ", " : "") << dtype_name(p.payloads[i].dtype) << "[T";
    for (int64_t d : p.payloads[i].row_shape) os << "," << d;
    os << "]";
  }
  os << "]";
  if (p.invalid_expert_id) os << " invalid=" << *p.invalid_expert_id;
  os << " ids@" << p.expert_id_payload_index << " H=" << p.hidden << " "
     << dtype_name(p.combine_dtype) << (o.payload_in_workspace ? " in_ws" : " copy")
     << (o.topk_int64 ? " topk64" : "") << (o.strided_y ? " strided_y" : "");
  return os.str();
}

void poison(const TensorView& v, uint8_t byte) {
  if (v.data) std::memset(v.data, byte, v.nbytes());
}

// One dispatch + combine of problem p on rank r. Returns "" or what went wrong.
std::string run_cycle(A2a& a2a, const A2aProblem& p, int r, const CycleOptions& o) {
  const int R = p.num_ranks, K = p.top_k;
  const int64_t T = p.num_tokens[r], M = p.runtime_max, H = p.hidden;
  std::vector<int64_t> topk64(p.topk_idx[r].begin(), p.topk_idx[r].end());
  A2aDispatchArgs args;
  args.topk_idx = o.topk_int64 ? TensorView::contiguous(topk64.data(), DType::kI64, {T, K})
                               : TensorView::contiguous(const_cast<int32_t*>(p.topk_idx[r].data()),
                                                        DType::kI32, {T, K});
  for (size_t i = 0; i < p.payloads.size(); ++i) {
    std::vector<int64_t> dims = {T};
    dims.insert(dims.end(), p.payloads[i].row_shape.begin(), p.payloads[i].row_shape.end());
    args.payloads.push_back(TensorView::contiguous(const_cast<uint8_t*>(p.payload[r][i].data()),
                                                   p.payloads[i].dtype, dims));
  }
  args.runtime_max_tokens_per_rank = M;
  args.invalid_expert_id = p.invalid_expert_id;
  args.expert_id_payload_index = p.expert_id_payload_index;

  A2aDispatchResult res = a2a.dispatch(args);
  const A2aExpected ex = testing::a2a_oracle(p, r);
  std::string err = testing::a2a_compare_dispatch(p, r, ex, res, /*check_unspecified_zero=*/true);

  // Combine: y of this rank into the workspace (directly or by the library's copy).
  const size_t elem = dtype_size(p.combine_dtype);
  const size_t y_bytes = static_cast<size_t>(R * M * H) * elem;
  TensorView ws = a2a.combine_payload_view(M, H, p.combine_dtype);
  Tensor out;
  const bool ws_ok = ws.ndim == 3 && ws.shape[0] == R && ws.shape[1] == M && ws.shape[2] == H &&
                     (ws.numel() == 0 || ws.is_contiguous()) && ws.dtype == p.combine_dtype;
  if (!ws_ok) err += "\n  combine_payload_view returned " + ws.describe();
  if (o.payload_in_workspace && ws_ok) {
    if (y_bytes) std::memcpy(ws.data, p.combine_y[r].data(), y_bytes);
    out = a2a.combine(ws, M, true, nullptr, testing::poison_allocator(0xFF));
  } else {  // (also when the view is wrong: the collective must go on on every rank)
    if (ws_ok) poison(ws, 0xFF);
    const int64_t row_stride = o.strided_y ? H + 3 : H;
    std::vector<uint8_t> y(static_cast<size_t>(R * M * row_stride) * elem + 1, 0xEE);
    for (int64_t row = 0; row < R * M; ++row)
      std::memcpy(y.data() + row * row_stride * elem, p.combine_y[r].data() + row * H * elem,
                  H * elem);
    TensorView yv = TensorView::contiguous(y.data(), p.combine_dtype, {R, M, H});
    yv.strides = {M * row_stride, row_stride, 1};
    out = a2a.combine(yv, M, false, nullptr, testing::poison_allocator(0xFF));
  }
  std::string cerr = testing::a2a_compare_combine(p, r, ex, out);
  if (!cerr.empty()) err += (err.empty() ? "" : "\n") + cerr;

  // Poison the receive views: the next dispatch must rewrite every row and count.
  for (const TensorView& v : res.recv) poison(v, 0xA5);
  poison(res.recv_counts, 0xA5);
  return err;
}

// Runs `problems` (same configuration, one per cycle) on one A2a object per rank, as threads.
void run_on_threads(const std::vector<A2aProblem>& problems,
                    const std::vector<CycleOptions>& options, const std::string& label) {
  const A2aProblem& first = problems.front();
  std::mutex mu;
  std::string failures;
  testing::run_threads(first.num_ranks, [&](const Group& g) {
    A2a a2a(g, first.shape());
    for (size_t c = 0; c < problems.size(); ++c) {
      std::string err = run_cycle(a2a, problems[c], g.rank(), options[c]);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        failures += label + " cycle " + std::to_string(c) + " (" +
                    describe(problems[c], options[c]) + "):\n" + err + "\n";
      }
    }
  });
  EXPECT_TRUE(failures.empty()) << failures;
}

// ---- random problems -------------------------------------------------------------------------

constexpr size_t kMemoryBudget = size_t{24} << 20;  // receive bytes over all ranks per case

// New token counts, M, routing and inputs for a problem's configuration.
A2aProblem next_cycle(const A2aProblem& config, std::mt19937_64& rng,
                      std::optional<Routing> routing = std::nullopt) {
  A2aProblem p = config;
  const int R = p.num_ranks;
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  p.num_tokens.assign(R, 0);
  const int64_t cap = p.max_tokens_per_rank;
  const int64_t hi = pick(0, 3) == 0 ? cap : pick(0, cap);  // sometimes small batches only
  for (int r = 0; r < R; ++r) {
    const int64_t k = pick(0, 9);
    p.num_tokens[r] = k == 0 ? 0 : k == 1 ? hi : pick(0, hi);
  }
  const int64_t max_t = *std::max_element(p.num_tokens.begin(), p.num_tokens.end());
  p.runtime_max = pick(0, 3) == 0 ? pick(max_t, cap) : max_t;
  std::vector<Routing> routings;
  const std::vector<Routing> all = testing::all_routings();
  for (int r = 0; r < R; ++r)
    routings.push_back(routing ? *routing : all[pick(0, static_cast<int64_t>(all.size()) - 1)]);
  testing::fill_a2a_inputs(p, routings, rng);
  return p;
}

A2aPayloadSpec random_payload(std::mt19937_64& rng, int K, bool allow_big) {
  const int n = allow_big ? 14 : 11;
  switch (std::uniform_int_distribution<int>(0, n - 1)(rng)) {
    case 0:
      return {DType::kBF16, {128}};
    case 1:
      return {DType::kI32, {K}, Fill::kExpertIds};
    case 2:
      return {DType::kF32, {K}, Fill::kWeights};
    case 3:
      return {DType::kU8, {128}};  // NVFP4 values of H = 256
    case 4:
      return {DType::kU8, {16}};  // NVFP4 scales of H = 256
    case 5:
      return {DType::kF8E4M3, {512}};
    case 6:
      return {DType::kF32, {4}};  // fp8 scales of H = 512
    case 7:
      return {DType::kF32, {2, 3}};
    case 8:
      return {DType::kBF16, {2, 4, 2}};
    case 9:
      return {DType::kI64, {3}};
    case 10:
      return {DType::kBool, {8}};
    case 11:
      return {DType::kBF16, {7168}};
    case 12:
      return {DType::kU8, {3584}};  // NVFP4 values of H = 7168
    default:
      return {DType::kU8, {448}};  // NVFP4 scales of H = 7168
  }
}

// A random configuration (no inputs yet) for R ranks.
A2aProblem random_config(std::mt19937_64& rng, int R) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  A2aProblem p;
  p.num_ranks = R;
  const int ks[] = {1, 8, 9};
  p.top_k = ks[pick(0, 2)];
  const int local = pick(0, 3) == 0 ? pick(1, 2) : pick(1, 288 / R);
  p.num_experts = local * R;
  const int num_payloads = pick(1, 8);
  int num_big = 0;
  for (int i = 0; i < num_payloads; ++i) {
    A2aPayloadSpec s = random_payload(rng, p.top_k, num_big < 2);
    num_big += s.row_bytes() >= 448;
    p.payloads.push_back(s);
  }
  p.expert_id_payload_index = -1;
  for (size_t i = 0; i < p.payloads.size(); ++i)
    if (p.payloads[i].fill == Fill::kExpertIds) p.expert_id_payload_index = static_cast<int>(i);
  if (p.expert_id_payload_index >= 0 && pick(0, 9) < 7) {
    const int32_t ids[] = {-1, p.num_experts, 1 << 20};
    p.invalid_expert_id = ids[pick(0, 2)];
  } else if (pick(0, 1) == 0) {
    p.expert_id_payload_index = -1;  // ids travel as an ordinary payload
  }
  // Configured sizes: sometimes larger than this call's rows.
  size_t dispatch_bytes = 0;
  for (const auto& s : p.payloads) {
    p.payload_bytes_per_token.push_back(s.row_bytes() + (pick(0, 3) == 0 ? 4 * pick(1, 8) : 0));
    dispatch_bytes += p.payload_bytes_per_token.back();
  }
  const int64_t hs[] = {1, 2, 33, 128, 256, 7168};
  p.hidden = hs[pick(0, 5)];
  p.combine_dtype = pick(0, 1) ? DType::kBF16 : DType::kF32;
  const size_t hb = static_cast<size_t>(p.hidden) * dtype_size(p.combine_dtype);
  p.combine_bytes_per_token = (hb + 3) / 4 * 4 + (pick(0, 3) == 0 ? 4 * pick(1, 16) : 0);
  const size_t row_total = dispatch_bytes + p.combine_bytes_per_token;
  const int64_t budget_max = std::max<int64_t>(
      1, static_cast<int64_t>(kMemoryBudget / (static_cast<size_t>(R * R) * row_total)));
  const int64_t want = pick(0, 4) == 0 ? pick(1, 256) : pick(1, 40);
  p.max_tokens_per_rank = std::min(want, budget_max);
  return p;
}

CycleOptions random_options(std::mt19937_64& rng) {
  CycleOptions o;
  o.payload_in_workspace = rng() % 2;
  o.topk_int64 = rng() % 4 == 0;
  o.strided_y = !o.payload_in_workspace && rng() % 3 == 0;
  return o;
}

// ---- exhaustive random cases -----------------------------------------------------------------

// What the random cases covered; every axis must have been hit, so the generator cannot
// silently stop exercising one.
struct Coverage {
  std::map<std::string, int> hits;
  void add(const A2aProblem& p, const CycleOptions& o) {
    ++hits["R=" + std::to_string(p.num_ranks)];
    ++hits["K=" + std::to_string(p.top_k)];
    ++hits["payloads=" + std::to_string(p.payloads.size())];
    ++hits[std::string("combine ") + dtype_name(p.combine_dtype)];
    ++hits[o.payload_in_workspace ? "in_ws" : "copy"];
    if (o.strided_y) ++hits["strided y"];
    if (o.topk_int64) ++hits["topk int64"];
    if (p.invalid_expert_id) ++hits["sanitised"];
    if (!p.invalid_expert_id && p.expert_id_payload_index >= 0) ++hits["index w/o invalid id"];
    const int64_t max_t = *std::max_element(p.num_tokens.begin(), p.num_tokens.end());
    if (p.runtime_max > max_t) ++hits["M > max T"];
    if (p.runtime_max == p.max_tokens_per_rank) ++hits["M == max_tokens"];
    if (std::count(p.num_tokens.begin(), p.num_tokens.end(), 0) > 0) ++hits["a rank with T=0"];
    if (p.num_experts > 256) ++hits["E > 256"];
    if (p.hidden == 7168) ++hits["H=7168"];
    for (size_t i = 0; i < p.payloads.size(); ++i) {
      if (p.payload_bytes_per_token[i] > p.payloads[i].row_bytes()) ++hits["row < configured"];
      if (p.payloads[i].row_bytes() >= 3584) ++hits["big payload row"];
    }
  }
  std::string str() const {
    std::string s;
    for (const auto& [k, v] : hits) s += k + ": " + std::to_string(v) + "\n";
    return s;
  }
};

TEST(A2aRandom, ThreadsMatchOracle) {
  std::mt19937_64 rng(20240611);
  const int ranks[] = {1, 2, 3, 4, 8};
  const int kCases = 220;
  Coverage cov;
  for (int c = 0; c < kCases; ++c) {
    const int R = ranks[c % 5];
    const A2aProblem config = random_config(rng, R);
    // Two cycles per object: the second dispatch must overwrite the poisoned first one.
    std::vector<A2aProblem> problems = {next_cycle(config, rng), next_cycle(config, rng)};
    std::vector<CycleOptions> options = {random_options(rng), random_options(rng)};
    for (int i = 0; i < 2; ++i) cov.add(problems[i], options[i]);
    run_on_threads(problems, options, "case " + std::to_string(c));
    if (HasFailure()) return;  // one diagnosis is enough
  }
  std::printf("coverage of %d cases x 2 cycles:\n%s", kCases, cov.str().c_str());
  for (const char* key : {"R=1",
                          "R=2",
                          "R=3",
                          "R=4",
                          "R=8",
                          "K=1",
                          "K=8",
                          "K=9",
                          "payloads=1",
                          "payloads=2",
                          "payloads=3",
                          "payloads=4",
                          "payloads=5",
                          "payloads=6",
                          "payloads=7",
                          "payloads=8",
                          "combine bf16",
                          "combine f32",
                          "in_ws",
                          "copy",
                          "strided y",
                          "topk int64",
                          "sanitised",
                          "index w/o invalid id",
                          "M > max T",
                          "M == max_tokens",
                          "a rank with T=0",
                          "E > 256",
                          "H=7168",
                          "row < configured",
                          "big payload row"})
    EXPECT_GT(cov.hits[key], 0) << "no random case covered " << key;
}

// Engines' payloads [x, x_scale, topk_ids, topk_weights] with sanitised padding, every routing.
TEST(A2aRandom, EnginePayloadsEveryRouting) {
  std::mt19937_64 rng(7);
  const int ranks[] = {1, 2, 3, 4, 8};
  int c = 0;
  for (Routing routing : testing::all_routings()) {
    for (int R : ranks) {
      const int kind = c++ % 3;  // bf16, fp8 block-128, nvfp4
      A2aProblem p;
      p.num_ranks = R;
      p.top_k = 8;
      p.num_experts = 288 / R / 8 * 8 * R;  // 288, 144*2, 96*3, 72*4, 32*8 (divisible by R)
      const int64_t H = 7168;
      if (kind == 0) {
        p.payloads = {{DType::kBF16, {H}}};
      } else if (kind == 1) {
        p.payloads = {{DType::kF8E4M3, {H}}, {DType::kF32, {H / 128}}};
      } else {
        p.payloads = {{DType::kU8, {H / 2}}, {DType::kU8, {H / 16}}};
      }
      p.expert_id_payload_index = static_cast<int>(p.payloads.size());
      p.payloads.push_back({DType::kI32, {p.top_k}, Fill::kExpertIds});
      p.payloads.push_back({DType::kF32, {p.top_k}, Fill::kWeights});
      p.invalid_expert_id = p.num_experts;
      p.hidden = H;
      p.combine_dtype = DType::kBF16;
      p.max_tokens_per_rank = R == 8 ? 16 : 32;
      std::vector<A2aProblem> problems = {next_cycle(p, rng, routing), next_cycle(p, rng, routing)};
      CycleOptions in_ws{true, false, false}, copy{false, true, false};
      run_on_threads(problems, {in_ws, copy}, std::string("engine ") + routing_name(routing));
      if (HasFailure()) return;
    }
  }
}

// One object, many cycles: T, M, routing, combine dtype and the copy/in-workspace path change
// every time.
// Large batches: T from 0 to 640 per rank (the random cases above stay smaller to bound memory),
// every routing, small payload rows so the receive region stays modest.
TEST(A2aRandom, LargeBatchesUpTo640Tokens) {
  std::mt19937_64 rng(515);
  int c = 0;
  for (int R : {1, 2, 4}) {
    for (Routing routing : testing::all_routings()) {
      A2aProblem config;
      config.num_ranks = R;
      config.top_k = 8;
      config.num_experts = 32 * R;
      config.payloads = {{DType::kBF16, {128}},
                         {DType::kI32, {8}, Fill::kExpertIds},
                         {DType::kF32, {8}, Fill::kWeights}};
      for (const auto& ps : config.payloads) config.payload_bytes_per_token.push_back(ps.row_bytes());
      config.expert_id_payload_index = 1;
      config.invalid_expert_id = -1;
      config.hidden = 128;
      config.combine_dtype = DType::kBF16;
      config.combine_bytes_per_token = 256;
      config.max_tokens_per_rank = 640;
      A2aProblem p = next_cycle(config, rng, routing);
      p.num_tokens.assign(R, 0);
      for (int r = 0; r < R; ++r) p.num_tokens[r] = r == 0 ? 640 : (r == 1 ? 0 : 512 + 31 * r);
      p.runtime_max = 640;
      testing::fill_a2a_inputs(p, std::vector<Routing>(R, routing), rng);
      run_on_threads({p}, {random_options(rng)}, "large case " + std::to_string(c++));
      if (HasFailure()) return;
    }
  }
}

TEST(A2aRepeated, ManyCyclesOnTheSameObject) {
  std::mt19937_64 rng(99);
  for (int R : {3, 4}) {
    A2aProblem config;
    config.num_ranks = R;
    config.top_k = 9;
    config.num_experts = 36 * R;
    config.payloads = {{DType::kBF16, {128}},
                       {DType::kU8, {64}},
                       {DType::kI32, {9}, Fill::kExpertIds},
                       {DType::kF32, {9}, Fill::kWeights}};
    config.expert_id_payload_index = 2;
    config.invalid_expert_id = -1;
    config.max_tokens_per_rank = 48;
    config.hidden = 128;
    config.combine_bytes_per_token = 128 * 4;  // room for bf16 and f32
    std::vector<A2aProblem> problems;
    std::vector<CycleOptions> options;
    for (int c = 0; c < 12; ++c) {
      config.combine_dtype = c % 3 == 2 ? DType::kF32 : DType::kBF16;
      problems.push_back(next_cycle(config, rng));
      options.push_back({c % 2 == 0, c % 4 == 1, c % 4 == 3});
    }
    run_on_threads(problems, options, "repeated R=" + std::to_string(R));
  }
}

TEST(A2aRandom, ZeroTokensEverywhereAndZeroRuntimeMax) {
  std::mt19937_64 rng(3);
  for (int R : {1, 2, 4}) {
    A2aProblem p = random_config(rng, R);
    p.num_tokens.assign(R, 0);
    p.runtime_max = 0;
    testing::fill_a2a_inputs(p, std::vector<Routing>(R, Routing::kUniform), rng);
    A2aProblem q = p;
    q.runtime_max = std::min<int64_t>(3, p.max_tokens_per_rank);  // all rows are padding
    testing::fill_a2a_inputs(q, std::vector<Routing>(R, Routing::kUniform), rng);
    run_on_threads({p, q}, {{true}, {false}}, "zero tokens");
  }
}

TEST(A2aProcesses, MatchOracle) {
  std::mt19937_64 rng(1234);
  for (int R : {2, 4}) {
    const A2aProblem config = random_config(rng, R);
    std::vector<A2aProblem> problems;
    std::vector<CycleOptions> options;
    for (int c = 0; c < 4; ++c) {
      problems.push_back(next_cycle(config, rng));
      options.push_back(random_options(rng));
    }
    // The children inherit `problems` through fork.
    int rc = testing::run_processes(R, [&](const Group& g) {
      A2a a2a(g, config.shape());
      int bad = 0;
      for (size_t c = 0; c < problems.size(); ++c) {
        std::string err = run_cycle(a2a, problems[c], g.rank(), options[c]);
        if (!err.empty()) {
          std::fprintf(stderr, "process cycle %zu (%s):\n%s\n", c,
                       describe(problems[c], options[c]).c_str(), err.c_str());
          ++bad;
        }
      }
      return bad;
    });
    EXPECT_EQ(rc, 0) << "R=" << R;
  }
}

}  // namespace
}  // namespace epx
