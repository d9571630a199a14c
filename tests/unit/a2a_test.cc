// a2a mode on the cpu backend vs the naive oracle (tests/support/oracle_a2a.h). The errors of
// Errors (docs/semantics.md §4) and the workspace size are tested in a2a_errors_test.cc.
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
#include "support/a2a_cycle.h"
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
using testing::CycleOptions;
using testing::describe;
using testing::kMemoryBudget;
using testing::next_cycle;
using testing::poison;
using testing::random_config;
using testing::random_options;
using testing::run_cycle;

// ---- helpers ---------------------------------------------------------------------------------

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
    if (p.combine_dtype == DType::kF16) add_f16_outputs(p);
  }
  // The kinds of f16 results the oracle expects on rank 0: overflow, subnormal, NaN.
  void add_f16_outputs(const A2aProblem& p) {
    const A2aExpected ex = testing::a2a_oracle(p, 0);
    hits["f16 outputs"] += static_cast<int>(ex.combine_out.size() / 2);
    for (size_t i = 0; i + 1 < ex.combine_out.size(); i += 2) {
      const uint16_t v = static_cast<uint16_t>(ex.combine_out[i] | ex.combine_out[i + 1] << 8);
      const uint16_t exp = v & 0x7C00, mant = v & 0x3FF;
      if (exp == 0x7C00) ++hits[mant ? "f16 out NaN" : "f16 out +-inf"];
      if (exp == 0 && mant) ++hits["f16 out subnormal"];
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
                          "combine f16",
                          "combine f32",
                          "f16 out +-inf",
                          "f16 out subnormal",
                          "f16 out NaN",
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
    config.combine_bytes_per_token = 128 * 4;  // room for bf16, f16 and f32
    std::vector<A2aProblem> problems;
    std::vector<CycleOptions> options;
    for (int c = 0; c < 12; ++c) {
      const DType combine_dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
      config.combine_dtype = combine_dtypes[c % 3];
      problems.push_back(next_cycle(config, rng));
      options.push_back({c % 2 == 0, c % 4 == 1, c % 4 == 3});
    }
    run_on_threads(problems, options, "repeated R=" + std::to_string(R));
  }
}

// f16 combine: the hand-worked sums of f16_sum_cases (overflow to +-inf, subnormal results, ties,
// one rounding in rank order, NaN) on R ranks, every input path; H covers every case (the GPU
// tier runs the same problems, whose H select each vector width of the cuda kernel). The oracle
// must give the hand values (R >= 3: every case's ranks take part), the library the oracle's bits.
TEST(A2aF16, HandWorkedSumsRoundOnce) {
  const std::vector<testing::F16SumCase>& cases = testing::f16_sum_cases();
  for (int R : {1, 2, 3, 4, 8}) {
    for (int64_t H : {17, 18, 20, 24}) {
      ASSERT_GE(H, static_cast<int64_t>(cases.size()));
      const A2aProblem p = testing::f16_sum_problem(R, H);
      for (int r = 0; R >= 3 && r < R; ++r) {
        const A2aExpected ex = testing::a2a_oracle(p, r);
        for (int64_t h = 0; h < H; ++h) {
          const testing::F16SumCase& c = cases[h % static_cast<int64_t>(cases.size())];
          uint16_t got;
          std::memcpy(&got, ex.combine_out.data() + h * 2, 2);
          EXPECT_EQ(got, c.out) << "oracle, R=" << R << " rank " << r << ": " << c.what;
        }
      }
      run_on_threads({p, p, p}, {{false}, {true}, {false, true, true}},
                     "f16 sums R=" + std::to_string(R) + " H=" + std::to_string(H));
      if (HasFailure()) return;
    }
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
