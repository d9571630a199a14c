// a2a mode on the cpu backend vs the naive oracle (tests/support/oracle_a2a.h), and every error
// of SPEC 5 that applies to a2a.
//
// Every check compares every element: all valid rows of every payload, recv_counts, the
// sanitised padding of the expert-id payload, the zeroed padding of the other payloads (a cpu
// backend property) and combine's out bit for bit. Outputs are poisoned before the library writes
// them: out comes from an allocator that fills with 0xFF (NaN), the previous dispatch's receive
// views are overwritten with 0xA5 before the next dispatch, and the combine region is filled
// with 0xFF before a copying combine.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

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

Allocator poison_allocator() {
  return [](DType dtype, const std::vector<int64_t>& shape, Device device) {
    size_t n = dtype_size(dtype);
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    const size_t alloc_bytes = (std::max<size_t>(n, 1) + 63) / 64 * 64;
    std::shared_ptr<void> storage(std::aligned_alloc(64, alloc_bytes), std::free);
    std::memset(storage.get(), 0xFF, alloc_bytes);
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(storage.get(), dtype, shape, device);
    t.storage = storage;
    return t;
  };
}

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
    out = a2a.combine(ws, M, true, nullptr, poison_allocator());
  } else {  // (also when the view is wrong: the collective must go on on every rank)
    if (ws_ok) poison(ws, 0xFF);
    const int64_t row_stride = o.strided_y ? H + 3 : H;
    std::vector<uint8_t> y(static_cast<size_t>(R * M * row_stride) * elem + 1, 0xEE);
    for (int64_t row = 0; row < R * M; ++row)
      std::memcpy(y.data() + row * row_stride * elem, p.combine_y[r].data() + row * H * elem,
                  H * elem);
    TensorView yv = TensorView::contiguous(y.data(), p.combine_dtype, {R, M, H});
    yv.strides = {M * row_stride, row_stride, 1};
    out = a2a.combine(yv, M, false, nullptr, poison_allocator());
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

constexpr size_t kMemoryBudget = size_t{12} << 20;  // receive bytes over all ranks per case

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

// ---- workspace size --------------------------------------------------------------------------

TEST(A2aWorkspace, BytesRelateToFlashInferFormula) {
  for (int R : {1, 2, 8}) {
    A2aShape s;
    s.max_tokens_per_rank = 4096;
    s.top_k = 8;
    s.num_experts = 256;
    s.payload_bytes_per_token = {7168 / 2, 7168 / 16, 8 * 4, 8 * 4};
    s.combine_bytes_per_token = 7168 * 2;
    size_t dispatch = 0;
    for (size_t b : s.payload_bytes_per_token) dispatch += b;
    const size_t flashinfer_like = R * 4096 * (dispatch + s.combine_bytes_per_token);
    const size_t publish = 4096 * (dispatch + 8);
    const size_t bytes = A2a::workspace_bytes(s, R, Backend::kCpu);
    EXPECT_GE(bytes, flashinfer_like + publish);
    EXPECT_LE(bytes, flashinfer_like + publish + 4096 + 256 * 16);
    testing::run_threads(R, [&](const Group& g) {
      A2aShape small = s;
      small.max_tokens_per_rank = 16;
      A2a a2a(g, small);
      EXPECT_EQ(a2a.bytes_allocated(), A2a::workspace_bytes(small, R, Backend::kCpu));
      EXPECT_EQ(a2a.shape().payload_bytes_per_token, small.payload_bytes_per_token);
    });
  }
}

// ---- errors ----------------------------------------------------------------------------------

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": expected " << error_code_name(code) << " naming " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": message does not name " << needle << ": " << e.what();
  }
}

TEST(A2aErrors, ShapeIsValidated) {
  auto base = [] {
    A2aShape s;
    s.max_tokens_per_rank = 8;
    s.top_k = 2;
    s.num_experts = 4;
    s.payload_bytes_per_token = {32, 8};
    s.combine_bytes_per_token = 64;
    return s;
  };
  struct Bad {
    const char* needle;
    void (*edit)(A2aShape&);
  };
  const Bad bads[] = {
      {"max_tokens_per_rank", [](A2aShape& s) { s.max_tokens_per_rank = 0; }},
      {"top_k", [](A2aShape& s) { s.top_k = 0; }},
      {"top_k", [](A2aShape& s) { s.top_k = 33; }},
      {"num_experts", [](A2aShape& s) { s.num_experts = 0; }},
      {"num_experts", [](A2aShape& s) { s.num_experts = 5; }},  // not a multiple of R = 2
      {"payload_bytes_per_token", [](A2aShape& s) { s.payload_bytes_per_token.clear(); }},
      {"payload_bytes_per_token", [](A2aShape& s) { s.payload_bytes_per_token.assign(9, 4); }},
      {"payload_bytes_per_token[1]", [](A2aShape& s) { s.payload_bytes_per_token[1] = 6; }},
      {"payload_bytes_per_token[0]", [](A2aShape& s) { s.payload_bytes_per_token[0] = 0; }},
      {"combine_bytes_per_token", [](A2aShape& s) { s.combine_bytes_per_token = 0; }},
      {"combine_bytes_per_token", [](A2aShape& s) { s.combine_bytes_per_token = 66; }},
  };
  for (const Bad& b : bads) {
    A2aShape s = base();
    b.edit(s);
    expect_error([&] { A2a::workspace_bytes(s, 2, Backend::kCpu); }, ErrorCode::kInvalidArgument,
                 b.needle, "workspace_bytes");
  }
  Group g = Group::cpu_threads(0, 1, testing::unique_group_name("shape"));
  A2aShape s = base();
  s.top_k = 40;
  expect_error([&] { A2a a2a(g, s); }, ErrorCode::kInvalidArgument, "top_k", "constructor");
}

// A single-rank A2a and valid inputs that each error case then breaks in one place.
struct ErrorFixture {
  static constexpr int64_t kT = 4, kM = 6, kH = 32;
  ErrorFixture() : group(Group::cpu_threads(0, 1, testing::unique_group_name("err"))) {
    shape.max_tokens_per_rank = 8;
    shape.top_k = 2;
    shape.num_experts = 4;
    shape.payload_bytes_per_token = {32, 8};  // bf16 [16], i32 [2]
    shape.combine_bytes_per_token = kH * 2;
    a2a = std::make_unique<A2a>(group, shape);
    topk = {0, 1, 2, -1, 3, 3, -1, -1};
    x.assign(kT * 16, 0x3F80);
    ids.assign(topk.begin(), topk.end());
    y.assign(kM * kH, 0x3F80);
  }
  A2aDispatchArgs args() {
    A2aDispatchArgs a;
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {kT, 2});
    a.payloads = {TensorView::contiguous(x.data(), DType::kBF16, {kT, 16}),
                  TensorView::contiguous(ids.data(), DType::kI32, {kT, 2})};
    a.runtime_max_tokens_per_rank = kM;
    a.invalid_expert_id = -1;
    a.expert_id_payload_index = 1;
    return a;
  }
  TensorView y_view() { return TensorView::contiguous(y.data(), DType::kBF16, {1, kM, kH}); }

  Group group;
  A2aShape shape;
  std::unique_ptr<A2a> a2a;
  std::vector<int32_t> topk;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<uint16_t> y;
};

TEST(A2aErrors, StateMachine) {
  ErrorFixture f;
  expect_error([&] { f.a2a->combine(f.y_view(), f.kM); }, ErrorCode::kInvalidArgument,
               "without a preceding dispatch", "combine before dispatch");
  f.a2a->dispatch(f.args());
  expect_error([&] { f.a2a->dispatch(f.args()); }, ErrorCode::kInvalidArgument, "twice",
               "dispatch twice");
  f.a2a->combine(f.y_view(), f.kM);
  expect_error([&] { f.a2a->combine(f.y_view(), f.kM); }, ErrorCode::kInvalidArgument,
               "without a preceding dispatch", "combine twice");
  f.a2a->dispatch(f.args());  // the machine is back in its initial state
  Tensor out = f.a2a->combine(f.y_view(), f.kM);
  EXPECT_EQ(out.shape[0], f.kT);
}

TEST(A2aErrors, DispatchArguments) {
  ErrorFixture f;
  using Edit = std::function<void(A2aDispatchArgs&)>;
  std::vector<float> f32(64);
  std::vector<int64_t> i64(64);
  std::vector<uint16_t> big(16 * 40);
  struct Bad {
    const char* what;
    ErrorCode code;
    const char* needle;
    Edit edit;
  };
  const auto IA = ErrorCode::kInvalidArgument, OC = ErrorCode::kOutOfCapacity;
  std::vector<Bad> bads = {
      {"topk f32", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f32.data(), DType::kF32, {4, 2});
       }},
      {"topk wrong K", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f.topk.data(), DType::kI32, {2, 4});
       }},
      {"topk 1-d", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f.topk.data(), DType::kI32, {8});
       }},
      {"topk value E", IA, "'topk_idx'", [&](A2aDispatchArgs&) { f.topk[3] = 4; }},
      {"topk value -2", IA, "'topk_idx'", [&](A2aDispatchArgs&) { f.topk[5] = -2; }},
      {"topk missing", IA, "'topk_idx'", [&](A2aDispatchArgs& a) { a.topk_idx = TensorView{}; }},
      {"topk on cuda", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) { a.topk_idx.device = Device::cuda(0); }},
      {"too few payloads", IA, "'payloads'", [&](A2aDispatchArgs& a) { a.payloads.pop_back(); }},
      {"too many payloads", IA, "'payloads'",
       [&](A2aDispatchArgs& a) { a.payloads.push_back(a.payloads[0]); }},
      {"payload T mismatch", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1].shape[0] = 3; }},
      {"payload row not x4", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 15});
       }},
      {"payload row too big", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 18});
       }},
      {"payload non-contiguous", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.payloads[0].strides[0] = 40; }},
      {"payload on cuda", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.payloads[0].device = Device::cuda(0); }},
      {"payload missing", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1] = TensorView{}; }},
      {"payload 6-d", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 1, 1, 1, 2, 2});
       }},
      {"runtime_max < T", OC, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = 3; }},
      {"runtime_max negative", OC, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = -1; }},
      {"runtime_max > max", OC, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = 9; }},
      {"T > max", OC, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(i64.data(), DType::kI64, {9, 2});
         a.runtime_max_tokens_per_rank = 9;
       }},
      {"expert id index missing", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = -1; }},
      {"expert id index too big", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = 2; }},
      {"expert id index out of range w/o invalid id", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) {
         a.invalid_expert_id.reset();
         a.expert_id_payload_index = 7;
       }},
      {"expert id payload not i32", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = 0; }},
      {"expert id payload f32", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1].dtype = DType::kF32; }},
      {"expert id payload [T, 1]", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[1] = TensorView::contiguous(f.ids.data(), DType::kI32, {4, 1});
       }},
  };
  const std::vector<int32_t> topk0 = f.topk;
  for (const Bad& b : bads) {
    f.topk = topk0;  // fresh inputs for every case
    A2aDispatchArgs a = f.args();
    b.edit(a);
    expect_error([&] { f.a2a->dispatch(a); }, b.code, b.needle, b.what);
  }
  // Nothing above changed the state: a valid cycle still works and matches by hand.
  f.topk = topk0;
  A2aDispatchResult res = f.a2a->dispatch(f.args());
  EXPECT_EQ(res.recv_counts.ptr<int32_t>()[0], 3);  // tokens 0, 1, 2 have an expert; 3 has none
  for (int k = 0; k < 2; ++k) EXPECT_EQ(res.recv[1].ptr<int32_t>()[3 * 2 + k], -1);
  Tensor out = f.a2a->combine(f.y_view(), f.kM);
  EXPECT_EQ(out.ptr<uint16_t>()[3 * f.kH], 0);  // token 3 went nowhere: +0
  EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);    // token 0: 1.0 from the one rank
}

TEST(A2aErrors, CombineArguments) {
  ErrorFixture f;
  f.a2a->dispatch(f.args());
  std::vector<uint8_t> other(8 * 8 * 64 * 4);
  const auto IA = ErrorCode::kInvalidArgument;
  auto yv = [&](DType dt, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(other.data(), dt, shape);
  };
  struct Bad {
    const char* what;
    const char* needle;
    std::function<Tensor()> call;
  };
  const int64_t M = f.kM, H = f.kH;
  std::vector<Bad> bads = {
      {"y i32", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kI32, {1, M, H}), M);
       }},
      {"y f16", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kF16, {1, M, H}), M);
       }},
      {"y R mismatch", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {2, M, H}), M);
       }},
      {"y M mismatch", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M - 1, H}), M);
       }},
      {"y 2-d", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {M, H}), M);
       }},
      {"runtime_max differs from dispatch", "'runtime_max_tokens_per_rank'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M - 1, H}), M - 1);
       }},
      {"H too big bf16", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M, H + 2}), M);
       }},
      {"H too big f32", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kF32, {1, M, H / 2 + 1}), M);
       }},
      {"y on cuda", "'y'",
       [&] {
         TensorView v = yv(DType::kBF16, {1, M, H});
         v.device = Device::cuda(0);
         return f.a2a->combine(v, M);
       }},
      {"y inner stride 2", "'y'",
       [&] {
         TensorView v = yv(DType::kBF16, {1, M, H});
         v.strides = {M * H * 2, H * 2, 2};
         return f.a2a->combine(v, M);
       }},
      {"y missing", "'y'", [&] { return f.a2a->combine(TensorView{}, M); }},
      {"payload_in_workspace with a foreign pointer", "'payload_in_workspace'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M, H}), M, true);
       }},
      {"payload_in_workspace with a strided view", "'payload_in_workspace'",
       [&] {
         TensorView v = f.a2a->combine_payload_view(M, H / 2, DType::kBF16);
         v.shape[2] = H / 4;  // keeps the pointer, breaks contiguity
         return f.a2a->combine(v, M, true);
       }},
  };
  for (const Bad& b : bads) expect_error([&] { b.call(); }, IA, b.needle, b.what);
  // combine_payload_view's own checks.
  expect_error([&] { f.a2a->combine_payload_view(9, H, DType::kBF16); }, IA,
               "'runtime_max_tokens_per_rank'", "view M > max");
  expect_error([&] { f.a2a->combine_payload_view(M, H, DType::kI32); }, IA, "'dtype'",
               "view dtype");
  expect_error([&] { f.a2a->combine_payload_view(M, H + 1, DType::kBF16); }, IA, "'hidden'",
               "view hidden");
  // Still in the after-dispatch state: a valid in-workspace combine works.
  TensorView ws = f.a2a->combine_payload_view(M, H, DType::kBF16);
  std::memcpy(ws.data, f.y.data(), f.y.size() * 2);
  Tensor out = f.a2a->combine(ws, M, true);
  EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);
}

// What only the group can see: every rank must pass the same geometry.
TEST(A2aErrors, RanksDisagree) {
  struct Case {
    const char* needle;
    int64_t m1;     // runtime_max of rank 1
    int64_t cols1;  // bf16 columns of payload 0 on rank 1
    int64_t h1;     // combine H of rank 1
  };
  const Case cases[] = {{"'runtime_max_tokens_per_rank'", 5, 16, 32},
                        {"'payloads[0]'", 6, 14, 32},
                        {"'y'", 6, 16, 30}};
  for (const Case& c : cases) {
    testing::run_threads(2, [&](const Group& g) {
      A2aShape s;
      s.max_tokens_per_rank = 8;
      s.top_k = 1;
      s.num_experts = 2;
      s.payload_bytes_per_token = {32};
      s.combine_bytes_per_token = 64;
      A2a a2a(g, s);
      const bool odd = g.rank() == 1;
      std::vector<int32_t> topk = {0, 1, 1};
      std::vector<uint16_t> x(3 * 16, 0x3F80), y(2 * 8 * 32, 0x3F80);
      for (int attempt = 0; attempt < 2; ++attempt) {  // the second attempt is valid
        const bool bad = attempt == 0 && odd;
        A2aDispatchArgs a;
        a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {3, 1});
        a.payloads = {TensorView::contiguous(x.data(), DType::kBF16, {3, bad ? c.cols1 : 16})};
        a.runtime_max_tokens_per_rank = bad ? c.m1 : 6;
        const bool dispatch_fails = attempt == 0 && c.h1 == 32;
        if (dispatch_fails) {
          expect_error([&] { a2a.dispatch(a); }, ErrorCode::kInvalidArgument, c.needle,
                       "dispatch disagreement");
          continue;
        }
        A2aDispatchResult res = a2a.dispatch(a);
        EXPECT_EQ(res.recv_counts.ptr<int32_t>()[0], g.rank() == 0 ? 1 : 2);
        const int64_t H = bad ? c.h1 : 32;
        TensorView yv = TensorView::contiguous(y.data(), DType::kBF16, {2, 6, H});
        if (attempt == 0) {
          expect_error([&] { a2a.combine(yv, 6); }, ErrorCode::kInvalidArgument, c.needle,
                       "combine disagreement");
          // The failed combine left the object after dispatch; finish the cycle correctly.
          yv = TensorView::contiguous(y.data(), DType::kBF16, {2, 6, 32});
        }
        Tensor out = a2a.combine(yv, 6);
        EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);
      }
    });
  }
}

// ---- timeouts --------------------------------------------------------------------------------

A2aShape tiny_shape() {
  A2aShape s;
  s.max_tokens_per_rank = 4;
  s.top_k = 1;
  s.num_experts = 2;
  s.payload_bytes_per_token = {4};
  s.combine_bytes_per_token = 4;
  return s;
}

// Rank 1 stops taking part at `stage`; rank 0 must get Timeout naming the operation, quickly.
void expect_timeout(int stage, const char* needle) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(300);
  std::atomic<bool> done{false};
  testing::run_threads(
      2,
      [&](const Group& g) {
        std::vector<int32_t> topk = {0, 1};
        std::vector<float> x = {1.0f, 2.0f}, y(2 * 2, 1.0f);
        A2aDispatchArgs a;
        a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {2, 1});
        a.payloads = {TensorView::contiguous(x.data(), DType::kF32, {2, 1})};
        a.runtime_max_tokens_per_rank = 2;
        TensorView yv = TensorView::contiguous(y.data(), DType::kF32, {2, 2, 1});
        if (g.rank() == 1) {
          if (stage >= 1) {
            A2a a2a(g, tiny_shape());
            if (stage >= 2) a2a.dispatch(a);
            const auto start = std::chrono::steady_clock::now();
            while (!done && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
          } else {
            // Never constructs the A2a; waits so that its group stays alive.
            const auto start = std::chrono::steady_clock::now();
            while (!done && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          A2a a2a(g, tiny_shape());
          if (stage >= 1) a2a.dispatch(a);
          if (stage >= 2) a2a.combine(yv, 2);
          ADD_FAILURE() << "stage " << stage << ": expected Timeout";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("ranks [1]"), std::string::npos) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        done = true;
      },
      o);
}

TEST(A2aTimeout, PeerNeverConstructs) {
  expect_timeout(0, "allocate");
}
TEST(A2aTimeout, PeerNeverDispatches) {
  expect_timeout(1, "a2a dispatch");
}
TEST(A2aTimeout, PeerNeverCombines) {
  expect_timeout(2, "a2a combine");
}

}  // namespace
}  // namespace epx
