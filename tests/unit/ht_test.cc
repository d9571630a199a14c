// ht mode of the cpu backend (docs/semantics.md §1, §4) against the naive oracle
// (tests/support/oracle_ht.h), bit for bit, every element of every output.
//
// Random cases: R in {1,2,3,4,8}, T in [0, 600] per rank (T = 0 ranks included), H in {128, 7168},
// K in {1, 8, 9}, E <= 288, bf16 / fp8 + f32 scales / fp8 + packed UE8M0 scales, strided rows,
// column-major scales, int64 / int32 topk (mixed across ranks), every routing generator,
// expert_alignment in {1, 4, 128}, worst-case mode (with overflow), cached dispatch, combine with
// 0/1/2 biases and with/without weights. Outputs come from an allocator that fills them with 0xAB
// first, so an element the backend forgets to write shows up. Seed: EPX_TEST_SEED (default fixed);
// EPX_HT_VERBOSE=1 lists the cases. Also: a hand-worked example, worst-case overflow on the right
// rank, buffer sizing, and the performance bound. Bad input: ht_errors_test.cc.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/buffer_impl.h"
#include "core/numeric.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/ht_inputs.h"
#include "support/oracle_ht.h"
#include "support/routing.h"

namespace epx {
namespace {

using testing::as_bytes;
using testing::fast_bf16;
using testing::HtCombineRankInput;
using testing::HtExpectedCombine;
using testing::HtExpectedDispatch;
using testing::HtExpectedLayout;
using testing::HtProblem;
using testing::HtRankInput;
using testing::make_strided;
using testing::random_bytes;
using testing::Routing;
using testing::Strided;
using testing::wide_bf16;

uint64_t base_seed() {
  const char* s = std::getenv("EPX_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 20240611ull;
}

enum class XKind { kBf16, kFp8F32, kFp8Ue8m0 };

struct Case {
  int index = 0;
  int R = 1, E = 1, K = 1;
  int64_t H = 128, max_tokens = 1;
  XKind xkind = XKind::kBf16;
  bool strided = false, col_major_scales = false;
  Routing routing = Routing::kUniform;
  int64_t worst = 0;
  bool cached = false, combine_weights = false;
  int num_biases = 0, expert_alignment = 1;
  int ranks_per_node = 0;      // 0: one node
  std::vector<int64_t> T;      // per rank
  std::vector<bool> topk_i32;  // per rank
  std::string describe() const {
    std::ostringstream os;
    os << "case " << index << ": R=" << R;
    if (ranks_per_node > 0) os << " (" << R / ranks_per_node << "x" << ranks_per_node << ")";
    os << " E=" << E << " K=" << K << " H=" << H << " T=[";
    for (int r = 0; r < R; ++r) os << (r ? "," : "") << T[r] << (topk_i32[r] ? "i32" : "i64");
    os << "] align=" << expert_alignment << " max_tokens=" << max_tokens
       << " x=" << static_cast<int>(xkind) << " strided=" << strided
       << " col_major_scales=" << col_major_scales << " routing=" << testing::routing_name(routing)
       << " worst=" << worst << " cached=" << cached << " biases=" << num_biases
       << " combine_weights=" << combine_weights;
    return os.str();
  }
};

// Everything every rank needs, built before the ranks start (so processes inherit it).
struct CaseData {
  Case c;
  HtProblem problem;
  std::vector<HtRankInput> inputs, inputs2;  // inputs2: the x of the cached dispatch
  std::vector<HtCombineRankInput> combine;
  std::vector<std::vector<int32_t>> topk32;
  std::vector<Strided> x, scales, x2, scales2, y, bias0, bias1;
  std::vector<HtExpectedLayout> layout;
  std::vector<HtExpectedDispatch> expected, expected2;
  std::vector<HtExpectedCombine> expected_combine;
  bool any_overflow = false;
};

// R > 0 replaces the random rank count (after its draw, so the other draws stay the same);
// ranks_per_node: the topology the case runs on (0: one node).
CaseData make_case(int index, uint64_t seed, int R = 0, int ranks_per_node = 0) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + rng() % v.size()); };
  CaseData d;
  Case& c = d.c;
  c.index = index;
  c.R = static_cast<int>(pick({1, 2, 3, 4, 8}));
  if (R > 0) c.R = R;
  c.ranks_per_node = ranks_per_node;
  c.H = rng() % 10 == 0 ? 7168 : 128;
  c.K = static_cast<int>(pick({1, 8, 9}));
  c.E = c.R * static_cast<int>(1 + rng() % (288 / c.R));
  c.xkind = static_cast<XKind>(index % 3);
  c.strided = rng() % 2;
  c.col_major_scales = rng() % 2;
  c.routing = testing::all_routings()[(index / 3) % 6];
  c.num_biases = static_cast<int>(rng() % 3);
  c.combine_weights = rng() % 2;
  const int64_t t_cap = c.H == 7168 ? 160 : 600;
  std::vector<int64_t>& T = c.T;
  T.resize(c.R);
  for (auto& t : T) {
    const int u = static_cast<int>(rng() % 20);
    t = u < 3 ? 0 : u == 3 ? t_cap : static_cast<int64_t>(1 + rng() % t_cap);
  }
  c.max_tokens = std::max<int64_t>(1, *std::max_element(T.begin(), T.end()) + rng() % 3);
  const bool weights = rng() % 5 != 0;
  const bool fp8 = c.xkind != XKind::kBf16;
  const int64_t scale_cols = c.xkind == XKind::kFp8F32 ? c.H / 128 : (c.H / 128 + 3) / 4;
  c.expert_alignment = static_cast<int>(pick({1, 4, 128}));
  const int target = static_cast<int>(rng() % c.E);

  HtProblem& p = d.problem;
  p.num_ranks = c.R;
  p.ranks_per_node = ranks_per_node;
  p.num_experts = c.E;
  p.top_k = c.K;
  p.hidden = c.H;
  p.x_row_bytes = static_cast<size_t>(c.H) * (fp8 ? 1 : 2);
  p.scale_row_bytes = fp8 ? static_cast<size_t>(scale_cols) * 4 : 0;
  p.expert_alignment = c.expert_alignment;
  const int64_t pad = c.strided ? 1 + static_cast<int64_t>(rng() % 40) : 0;
  const DType xdt = fp8 ? DType::kF8E4M3 : DType::kBF16;
  const DType sdt = c.xkind == XKind::kFp8F32 ? DType::kF32 : DType::kI32;
  auto make_x = [&](int64_t t) {
    return fp8 ? random_bytes(static_cast<size_t>(t * c.H), rng)
               : as_bytes(c.H == 128 ? testing::make_bf16(t, c.H, rng) : fast_bf16(t, c.H, rng));
  };
  for (int r = 0; r < c.R; ++r) {
    HtRankInput in;
    in.num_tokens = T[r];
    in.topk_idx = testing::make_topk_idx(c.routing, T[r], c.K, c.E, c.R, rng, target);
    in.has_topk_weights = weights;
    if (weights) in.topk_weights = testing::make_topk_weights(in.topk_idx, rng);
    in.x = make_x(T[r]);
    if (fp8) in.scales = random_bytes(static_cast<size_t>(T[r] * scale_cols) * 4, rng);
    HtRankInput in2 = in;
    in2.x = make_x(T[r]);
    if (fp8) in2.scales = random_bytes(in.scales.size(), rng);
    c.topk_i32.push_back(rng() % 2);
    d.topk32.emplace_back(in.topk_idx.begin(), in.topk_idx.end());
    d.x.push_back(make_strided(in.x, T[r], c.H, xdt, pad, false, rng));
    d.x2.push_back(make_strided(in2.x, T[r], c.H, xdt, pad, false, rng));
    if (fp8) {
      d.scales.push_back(
          make_strided(in.scales, T[r], scale_cols, sdt, 0, c.col_major_scales, rng));
      d.scales2.push_back(
          make_strided(in2.scales, T[r], scale_cols, sdt, 0, c.col_major_scales, rng));
    }
    d.inputs.push_back(std::move(in));
    d.inputs2.push_back(std::move(in2));
  }

  // Worst-case mode: 0-4 exact, 5-6 worst >= every N, 7 worst below the largest N (overflow).
  int64_t max_n = 0;
  for (int r = 0; r < c.R; ++r)
    max_n = std::max(max_n, testing::ht_oracle_num_recv_tokens(p, d.inputs, r));
  const int w = static_cast<int>(rng() % 8);
  if (w >= 5)
    c.worst = w == 7 && max_n > 1 ? max_n - 1 - static_cast<int64_t>(rng() % (max_n / 2))
                                  : max_n + static_cast<int64_t>(rng() % 5) + (max_n == 0);
  p.num_worst_tokens = c.worst;
  c.cached = rng() % 2;

  for (int r = 0; r < c.R; ++r) {
    d.layout.push_back(testing::ht_oracle_layout(p, d.inputs[r].topk_idx, T[r]));
    d.expected.push_back(testing::ht_oracle_dispatch(p, d.inputs, r));
    d.expected2.push_back(testing::ht_oracle_dispatch(p, d.inputs2, r));
    d.any_overflow |= d.expected.back().overflow;
  }
  if (d.any_overflow) return d;
  for (int r = 0; r < c.R; ++r) {
    const int64_t rows = d.expected[r].num_rows;
    HtCombineRankInput ci;
    ci.y = wide_bf16(rows, c.H, rng);
    ci.has_topk_weights = c.combine_weights;
    if (c.combine_weights) {
      std::uniform_real_distribution<float> u(-2.0f, 2.0f);
      for (int64_t i = 0; i < rows * c.K; ++i) ci.topk_weights.push_back(u(rng));
    }
    ci.has_bias0 = c.num_biases >= 1;
    ci.has_bias1 = c.num_biases >= 2;
    if (ci.has_bias0) ci.bias0 = wide_bf16(T[r], c.H, rng);
    if (ci.has_bias1) ci.bias1 = wide_bf16(T[r], c.H, rng);
    d.y.push_back(make_strided(as_bytes(ci.y), rows, c.H, DType::kBF16, pad, false, rng));
    d.bias0.push_back(make_strided(as_bytes(ci.bias0), ci.has_bias0 ? T[r] : 0, c.H, DType::kBF16,
                                   pad, false, rng));
    d.bias1.push_back(make_strided(as_bytes(ci.bias1), ci.has_bias1 ? T[r] : 0, c.H, DType::kBF16,
                                   pad, false, rng));
    d.combine.push_back(std::move(ci));
  }
  for (int r = 0; r < c.R; ++r)
    d.expected_combine.push_back(testing::ht_oracle_combine(p, d.inputs, d.combine, r));
  return d;
}

// Collects mismatches with their first index, for threads (thrown) and processes (printed).
struct Mismatches {
  std::vector<std::string> lines;
  void fail(const std::string& s) { lines.push_back(s); }
  void expect(bool ok, const std::string& s) {
    if (!ok) fail(s);
  }
  void tensor(const char* name, const TensorView& t, DType dtype, std::vector<int64_t> shape) {
    bool ok = t.dtype == dtype && t.ndim == static_cast<int>(shape.size()) && t.is_contiguous();
    for (size_t i = 0; ok && i < shape.size(); ++i) ok = t.shape[i] == shape[i];
    expect(ok, std::string(name) + ": got " + t.describe() + ", expected " + dtype_name(dtype) +
                   " of " + std::to_string(shape.size()) + " dims, contiguous");
  }
  // Compares element-wise on the bytes (floats by bits) with elements of `elem` bytes.
  void bytes(const char* name, const void* got, const void* want, size_t nbytes, size_t elem) {
    const auto* g = static_cast<const uint8_t*>(got);
    const auto* w = static_cast<const uint8_t*>(want);
    if (nbytes == 0 || std::memcmp(g, w, nbytes) == 0) return;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < nbytes; i += elem)
      if (std::memcmp(g + i, w + i, elem) != 0 && bad++ == 0) first = i / elem;
    fail(std::string(name) + ": " + std::to_string(bad) + " of " + std::to_string(nbytes / elem) +
         " elements differ, first at element " + std::to_string(first));
  }
  template <typename T>
  void values(const char* name, const TensorView& t, const std::vector<T>& want) {
    if (t.nbytes() != want.size() * sizeof(T)) {
      fail(std::string(name) + ": " + std::to_string(t.nbytes()) + " bytes, expected " +
           std::to_string(want.size() * sizeof(T)));
      return;
    }
    bytes(name, t.data, want.data(), t.nbytes(), sizeof(T));
  }
  std::string str(const std::string& head) const {
    std::string s;
    for (const auto& l : lines) s += head + ": " + l + "\n";
    return s;
  }
};

void check_error(Mismatches& m, const Error& e, ErrorCode code, const std::vector<std::string>& has,
                 const char* what) {
  m.expect(e.code() == code, std::string(what) + ": error code " + error_code_name(e.code()) +
                                 " (" + e.what() + "), expected " + error_code_name(code));
  for (const auto& s : has)
    m.expect(std::string(e.what()).find(s) != std::string::npos,
             std::string(what) + ": message '" + e.what() + "' does not mention '" + s + "'");
}

MoeShape shape_of(const Case& c) {
  MoeShape s;
  s.hidden = c.H;
  s.top_k = c.K;
  s.num_experts = c.E;
  s.max_tokens_per_rank = c.max_tokens;
  return s;
}

void check_dispatch(Mismatches& m, const CaseData& d, int r, const HtDispatchResult& res,
                    const Buffer& buf) {
  const HtExpectedDispatch& ex = d.expected[r];
  const Case& c = d.c;
  const int64_t rows = ex.num_rows, T = d.inputs[r].num_tokens;
  const bool fp8 = c.xkind != XKind::kBf16;
  m.tensor("recv_x", res.recv_x, fp8 ? DType::kF8E4M3 : DType::kBF16, {rows, c.H});
  m.values("recv_x", res.recv_x, ex.recv_x);
  if (fp8) {
    const int64_t cols = static_cast<int64_t>(d.problem.scale_row_bytes / 4);
    m.tensor("recv_x_scales", res.recv_x_scales,
             c.xkind == XKind::kFp8F32 ? DType::kF32 : DType::kI32, {rows, cols});
    m.values("recv_x_scales", res.recv_x_scales, ex.recv_scales);
  } else {
    m.expect(!res.recv_x_scales.defined(), "recv_x_scales given for bf16");
  }
  if (c.topk_i32[r]) {
    m.tensor("recv_topk_idx", res.recv_topk_idx, DType::kI32, {rows, c.K});
    m.values("recv_topk_idx", res.recv_topk_idx,
             std::vector<int32_t>(ex.recv_topk_idx.begin(), ex.recv_topk_idx.end()));
  } else {
    m.tensor("recv_topk_idx", res.recv_topk_idx, DType::kI64, {rows, c.K});
    m.values("recv_topk_idx", res.recv_topk_idx, ex.recv_topk_idx);
  }
  if (d.inputs[r].has_topk_weights) {
    m.tensor("recv_topk_weights", res.recv_topk_weights, DType::kF32, {rows, c.K});
    m.values("recv_topk_weights", res.recv_topk_weights, ex.recv_topk_weights);
  } else {
    m.expect(!res.recv_topk_weights.defined(), "recv_topk_weights given without topk_weights");
  }
  m.tensor("recv_src_idx", res.recv_src_idx, DType::kI32, {rows});
  m.values("recv_src_idx", res.recv_src_idx, ex.recv_src_idx);
  m.expect(res.num_recv_tokens_per_expert == ex.num_recv_tokens_per_expert,
           "num_recv_tokens_per_expert differs");
  const HtHandle& h = res.handle;
  m.expect(h.num_tokens == T && h.num_recv_tokens == ex.num_recv_tokens &&
               h.num_worst_tokens == c.worst && h.top_k == c.K && h.buffer_id == buf.id(),
           "handle scalars: T=" + std::to_string(h.num_tokens) +
               " N=" + std::to_string(h.num_recv_tokens) +
               " expected N=" + std::to_string(ex.num_recv_tokens));
  m.tensor("handle.rank_prefix_matrix", h.rank_prefix_matrix, DType::kI32, {c.R, c.R});
  m.values("handle.rank_prefix_matrix", h.rank_prefix_matrix, ex.rank_prefix_matrix);
  m.tensor("handle.send_pos", h.send_pos, DType::kI32, {T, c.R});
  m.values("handle.send_pos", h.send_pos, ex.send_pos);
  m.tensor("handle.is_token_in_rank", h.is_token_in_rank, DType::kBool, {T, c.R});
  m.values("handle.is_token_in_rank", h.is_token_in_rank, ex.is_token_in_rank);
  m.expect(h.recv_src_idx.data == res.recv_src_idx.data, "handle.recv_src_idx is not recv_src_idx");
}

// One rank of one case; returns "" or what mismatched.
std::string run_rank(const CaseData& d, const Group& g) {
  const Case& c = d.c;
  const int r = g.rank();
  const Allocator alloc = testing::poison_allocator(0xAB);
  Mismatches m;
  Buffer buf(g, shape_of(c));
  const HtRankInput& in = d.inputs[r];
  const TensorView topk = c.topk_i32[r]
                              ? TensorView::contiguous(const_cast<int32_t*>(d.topk32[r].data()),
                                                       DType::kI32, {in.num_tokens, c.K})
                              : TensorView::contiguous(const_cast<int64_t*>(in.topk_idx.data()),
                                                       DType::kI64, {in.num_tokens, c.K});

  HtLayout lay = buf.ht_layout(topk, nullptr, alloc);
  m.tensor("num_tokens_per_rank", lay.num_tokens_per_rank, DType::kI32, {c.R});
  m.values("num_tokens_per_rank", lay.num_tokens_per_rank, d.layout[r].num_tokens_per_rank);
  m.tensor("num_tokens_per_expert", lay.num_tokens_per_expert, DType::kI32, {c.E});
  m.values("num_tokens_per_expert", lay.num_tokens_per_expert, d.layout[r].num_tokens_per_expert);
  m.tensor("is_token_in_rank", lay.is_token_in_rank, DType::kBool, {in.num_tokens, c.R});
  m.values("is_token_in_rank", lay.is_token_in_rank, d.layout[r].is_token_in_rank);

  HtDispatchArgs args;
  args.x = d.x[r].view;
  if (c.xkind != XKind::kBf16) args.x_scales = d.scales[r].view;
  args.topk_idx = topk;
  if (in.has_topk_weights)
    args.topk_weights = TensorView::contiguous(const_cast<float*>(in.topk_weights.data()),
                                               DType::kF32, {in.num_tokens, c.K});
  args.expert_alignment = c.expert_alignment;
  args.num_worst_tokens = c.worst;
  const HtExpectedDispatch& ex = d.expected[r];
  if (ex.overflow) {
    try {
      buf.ht_dispatch(args, alloc);
      m.fail("dispatch: expected OutOfCapacity for N = " + std::to_string(ex.num_recv_tokens));
    } catch (const Error& e) {
      check_error(m, e, ErrorCode::kOutOfCapacity,
                  {"num_worst_tokens", std::to_string(ex.num_recv_tokens), std::to_string(c.worst)},
                  "dispatch overflow");
    }
    return m.str(c.describe() + " rank " + std::to_string(r));
  }
  HtDispatchResult res = buf.ht_dispatch(args, alloc);
  check_dispatch(m, d, r, res, buf);
  if (d.any_overflow) return m.str(c.describe() + " rank " + std::to_string(r));

  if (c.cached) {
    HtDispatchArgs a2;
    a2.x = d.x2[r].view;
    if (c.xkind != XKind::kBf16) a2.x_scales = d.scales2[r].view;
    a2.handle = &res.handle;
    HtDispatchResult res2 = buf.ht_dispatch(a2, alloc);
    m.tensor("cached recv_x", res2.recv_x, res.recv_x.dtype, {ex.num_rows, c.H});
    m.values("cached recv_x", res2.recv_x, d.expected2[r].recv_x);
    if (c.xkind != XKind::kBf16)
      m.values("cached recv_x_scales", res2.recv_x_scales, d.expected2[r].recv_scales);
    m.expect(res2.num_recv_tokens_per_expert.empty(), "cached: num_recv_tokens_per_expert given");
  }

  HtCombineArgs ca;
  ca.y = d.y[r].view;
  ca.handle = &res.handle;
  const HtCombineRankInput& ci = d.combine[r];
  if (ci.has_topk_weights)
    ca.topk_weights = TensorView::contiguous(const_cast<float*>(ci.topk_weights.data()),
                                             DType::kF32, {ex.num_rows, c.K});
  if (ci.has_bias0) ca.bias0 = d.bias0[r].view;
  if (ci.has_bias1) ca.bias1 = d.bias1[r].view;
  HtCombineResult cr = buf.ht_combine(ca, alloc);
  m.tensor("combine out", cr.out, DType::kBF16, {in.num_tokens, c.H});
  m.values("combine out", cr.out, d.expected_combine[r].out);
  if (ci.has_topk_weights) {
    m.tensor("combined_topk_weights", cr.combined_topk_weights, DType::kF32, {in.num_tokens, c.K});
    m.values("combined_topk_weights", cr.combined_topk_weights,
             d.expected_combine[r].combined_topk_weights);
  } else {
    m.expect(!cr.combined_topk_weights.defined(), "combined_topk_weights without topk_weights");
  }
  return m.str(c.describe() + " rank " + std::to_string(r));
}

constexpr int kNumChunks = 8;
constexpr int kCasesPerChunk = 27;  // 216 thread cases

class HtRandom : public ::testing::TestWithParam<int> {};

TEST_P(HtRandom, ThreadsMatchOracle) {
  int overflow_cases = 0, worst_cases = 0, cached_cases = 0;
  for (int i = 0; i < kCasesPerChunk; ++i) {
    const int index = GetParam() * kCasesPerChunk + i;
    const CaseData d = make_case(index, base_seed() * 1000003ull + index);
    if (std::getenv("EPX_HT_VERBOSE")) std::printf("%s\n", d.c.describe().c_str());
    overflow_cases += d.any_overflow;
    worst_cases += d.c.worst > 0;
    cached_cases += d.c.cached && !d.any_overflow;
    std::mutex mu;
    std::string report;
    testing::run_threads(d.c.R, [&](const Group& g) {
      std::string s = run_rank(d, g);
      std::lock_guard<std::mutex> lock(mu);
      report += s;
    });
    ASSERT_TRUE(report.empty()) << report;
  }
  std::printf("chunk %d: %d cases, %d worst-case (%d overflow), %d cached\n", GetParam(),
              kCasesPerChunk, worst_cases, overflow_cases, cached_cases);
}

INSTANTIATE_TEST_SUITE_P(Chunks, HtRandom, ::testing::Range(0, kNumChunks));

TEST(HtRandomProcesses, ProcessesMatchOracle) {
  for (int i = 0; i < 6; ++i) {
    const int index = 10000 + i;
    const CaseData d = make_case(index, base_seed() * 7919ull + index);
    const int rc = testing::run_processes(d.c.R, [&](const Group& g) {
      const std::string s = run_rank(d, g);
      if (!s.empty()) std::fprintf(stderr, "%s", s.c_str());
      return s.empty() ? 0 : 1;
    });
    ASSERT_EQ(rc, 0) << d.c.describe();
  }
}

// ---- across nodes: the hierarchical algorithm (docs/design.md §13) -----------------------------
// Random cases at nodes x ranks per node = 2x2, 2x4, 4x2, 3x1 (Group option ranks_per_node),
// every output checked against the oracle with that topology (its combine sums node-first,
// docs/semantics.md §1.6), cached dispatch on every other case. The node-first sums must differ
// from the flat ones somewhere, or the cases could not tell a flat combine from the right one.

// Whether some combine output of `d` differs from what one node (the flat order) would give.
bool differs_from_flat(const CaseData& d) {
  HtProblem flat = d.problem;
  flat.ranks_per_node = 0;
  for (int r = 0; r < d.c.R; ++r) {
    const HtExpectedCombine one = testing::ht_oracle_combine(flat, d.inputs, d.combine, r);
    if (one.out != d.expected_combine[r].out ||
        one.combined_topk_weights != d.expected_combine[r].combined_topk_weights)
      return true;
  }
  return false;
}

class HtNodes : public ::testing::TestWithParam<testing::NodeTopology> {};

TEST_P(HtNodes, ThreadsMatchOracle) {
  const testing::NodeTopology topo = GetParam();
  const int R = topo.num_ranks();
  const GroupOptions options = topo.options();
  int combined = 0, cached = 0, worst = 0, order_differs = 0;
  for (int i = 0; i < 12; ++i) {
    const int index = 20000 + 100 * topo.nodes + 10 * topo.per_node + i;
    CaseData d = make_case(index, base_seed() * 104729ull + index, R, topo.per_node);
    d.c.cached = i % 2 == 0;
    if (std::getenv("EPX_HT_VERBOSE")) std::printf("%s\n", d.c.describe().c_str());
    std::mutex mu;
    std::string report;
    testing::run_threads(
        R,
        [&](const Group& g) {
          EXPECT_EQ(g.num_nodes(), topo.nodes);
          std::string s = run_rank(d, g);
          std::lock_guard<std::mutex> lock(mu);
          report += s;
        },
        options);
    ASSERT_TRUE(report.empty()) << report;
    worst += d.c.worst > 0;
    if (d.any_overflow) continue;
    ++combined;
    cached += d.c.cached;
    order_differs += differs_from_flat(d);
  }
  std::printf(
      "%dx%d: %d cases combined (%d after a cached dispatch), %d worst-case, %d where "
      "the node-first order changes a result\n",
      topo.nodes, topo.per_node, combined, cached, worst, order_differs);
  EXPECT_GE(cached, 2);
  EXPECT_GE(combined - cached, 2);
  EXPECT_GT(order_differs, 0);
}

INSTANTIATE_TEST_SUITE_P(Topologies, HtNodes, ::testing::ValuesIn(testing::kCiTopologies),
                         [](const auto& info) { return testing::topology_name(info.param); });

TEST(HtNodesProcesses, TwoByTwoProcessesMatchOracle) {
  const GroupOptions options = testing::NodeTopology{2, 2}.options();
  for (int i = 0; i < 3; ++i) {
    const int index = 30000 + i;
    CaseData d = make_case(index, base_seed() * 7919ull + index, 4, 2);
    d.c.cached = i != 1;
    const int rc = testing::run_processes(
        4,
        [&](const Group& g) {
          const std::string s = run_rank(d, g);
          if (!s.empty()) std::fprintf(stderr, "%s", s.c_str());
          return s.empty() ? 0 : 1;
        },
        options);
    ASSERT_EQ(rc, 0) << d.c.describe();
  }
}

// ---- a hand-worked example, independent of the oracle ------------------------------------------
// R = 2, E = 4 (L = 2), K = 2, H = 128 bf16; x row t of rank s is filled with 10 s + t + 1.
//   rank 0: t0 {0, 3} -> ranks 0, 1   t1 {2, 2} -> rank 1 (duplicate)   t2 {-1, -1} -> nowhere
//   rank 1: t0 {1, -1} -> rank 0      t1 {3, 0} -> ranks 1, 0
// rank 0 receives (0,t0) (1,t0) (1,t1); rank 1 receives (0,t0) (0,t1) (1,t1).
// Combine with y = recv_x returns, per token, its value times the number of ranks it went to.
TEST(HtExample, TwoRanksByHand) {
  testing::run_threads(2, [](const Group& g) {
    const int r = g.rank();
    Buffer buf(g, MoeShape{128, 2, 4, 8});
    const int64_t T = r == 0 ? 3 : 2;
    std::vector<int64_t> topk =
        r == 0 ? std::vector<int64_t>{0, 3, 2, 2, -1, -1} : std::vector<int64_t>{1, -1, 3, 0};
    std::vector<uint16_t> x(static_cast<size_t>(T * 128));
    for (int64_t t = 0; t < T; ++t)
      std::fill_n(x.begin() + t * 128, 128, detail::f32_to_bf16(10.0f * r + t + 1));
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, 128});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, 2});
    HtDispatchResult res = buf.ht_dispatch(a, testing::poison_allocator(0xAB));
    ASSERT_EQ(res.recv_x.shape[0], 3);
    const std::vector<int64_t> idx = r == 0 ? std::vector<int64_t>{0, -1, 1, -1, -1, 0}
                                            : std::vector<int64_t>{-1, 1, 0, 0, 1, -1};
    const std::vector<int32_t> src =
        r == 0 ? std::vector<int32_t>{0, 0, 1} : std::vector<int32_t>{0, 1, 1};
    const std::vector<float> vals =
        r == 0 ? std::vector<float>{1, 11, 12} : std::vector<float>{1, 2, 12};
    for (int i = 0; i < 6; ++i) EXPECT_EQ(res.recv_topk_idx.ptr<int64_t>()[i], idx[i]) << i;
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(res.recv_src_idx.ptr<int32_t>()[i], src[i]);
      EXPECT_EQ(detail::bf16_to_f32(res.recv_x.ptr<uint16_t>()[i * 128 + 127]), vals[i]);
    }
    EXPECT_EQ(res.num_recv_tokens_per_expert,
              (r == 0 ? std::vector<int>{2, 1} : std::vector<int>{2, 2}));
    const std::vector<int32_t> prefix{1, 2, 3, 3};
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(res.handle.rank_prefix_matrix.ptr<int32_t>()[i], prefix[i]);
    const std::vector<int32_t> pos =
        r == 0 ? std::vector<int32_t>{0, 0, -1, 1, -1, -1} : std::vector<int32_t>{1, -1, 2, 2};
    for (size_t i = 0; i < pos.size(); ++i)
      EXPECT_EQ(res.handle.send_pos.ptr<int32_t>()[i], pos[i]);

    HtCombineArgs c;
    c.y = res.recv_x;
    c.handle = &res.handle;
    HtCombineResult out = buf.ht_combine(c, testing::poison_allocator(0xAB));
    const std::vector<float> want =
        r == 0 ? std::vector<float>{2, 2, 0} : std::vector<float>{11, 24};
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < 128; ++h)
        ASSERT_EQ(out.out.ptr<uint16_t>()[t * 128 + h], detail::f32_to_bf16(want[t])) << t;
  });
}

// ---- worst-case overflow: the right rank raises, the others are unaffected ---------------------
// R = 3, E = 6, K = 2, T = 8: slot 0 always expert 2 (rank 1), slot 1 expert 2 (t % 3) + 1.
// N = {9, 24, 6}; num_worst_tokens = 12 overflows rank 1 only.
TEST(HtWorstCase, OverflowRaisesOnTheRightRankOnly) {
  HtProblem p;
  p.num_ranks = 3, p.num_experts = 6, p.top_k = 2, p.hidden = 128, p.x_row_bytes = 256;
  std::mt19937_64 rng(base_seed() + 77);
  std::vector<HtRankInput> in(3);
  for (auto& i : in) {
    i.num_tokens = 8;
    for (int t = 0; t < 8; ++t) i.topk_idx.insert(i.topk_idx.end(), {2, 2 * (t % 3) + 1});
    i.has_topk_weights = true;
    i.topk_weights = testing::make_topk_weights(i.topk_idx, rng);
    i.x = as_bytes(testing::make_bf16(8, 128, rng));
  }
  testing::run_threads(3, [&](const Group& g) {
    const int r = g.rank();
    Buffer buf(g, MoeShape{128, 2, 6, 8});
    HtDispatchArgs a;
    a.x = TensorView::contiguous(in[r].x.data(), DType::kBF16, {8, 128});
    a.topk_idx = TensorView::contiguous(in[r].topk_idx.data(), DType::kI64, {8, 2});
    a.topk_weights = TensorView::contiguous(in[r].topk_weights.data(), DType::kF32, {8, 2});
    for (int64_t worst : {12, 24}) {
      a.num_worst_tokens = worst;
      HtProblem pw = p;
      pw.num_worst_tokens = worst;
      const HtExpectedDispatch ex = testing::ht_oracle_dispatch(pw, in, r);
      EXPECT_EQ(ex.overflow, worst == 12 && r == 1);
      if (ex.overflow) {
        Mismatches m;
        try {
          buf.ht_dispatch(a, testing::poison_allocator(0xAB));
          ADD_FAILURE() << "rank 1 expected OutOfCapacity";
        } catch (const Error& e) {
          check_error(m, e, ErrorCode::kOutOfCapacity, {"num_worst_tokens", "24", "12", "rank 1"},
                      "overflow");
        }
        EXPECT_TRUE(m.lines.empty()) << m.str("rank 1");
        continue;
      }
      HtDispatchResult res = buf.ht_dispatch(a, testing::poison_allocator(0xAB));
      EXPECT_EQ(res.recv_x.shape[0], worst);
      EXPECT_EQ(res.handle.num_recv_tokens, ex.num_recv_tokens);
      Mismatches m;
      m.values("recv_x", res.recv_x, ex.recv_x);
      m.values("recv_topk_idx", res.recv_topk_idx, ex.recv_topk_idx);
      m.values("recv_topk_weights", res.recv_topk_weights, ex.recv_topk_weights);
      m.values("recv_src_idx", res.recv_src_idx, ex.recv_src_idx);
      EXPECT_TRUE(res.num_recv_tokens_per_expert.empty());
      EXPECT_TRUE(m.lines.empty()) << m.str("rank " + std::to_string(r));
    }
  });
}

TEST(HtBuffer, BytesNeededIsWhatIsAllocated) {
  testing::run_threads(2, [](const Group& g) {
    const MoeShape shape{7168, 8, 256, 64};
    Buffer buf(g, shape);
    EXPECT_EQ(buf.bytes_allocated(), Buffer::bytes_needed(Mode::kHt, shape, 2, Backend::kCpu));
  });
  const MoeShape standard{7168, 8, 256, 4096};
  const size_t bytes = Buffer::bytes_needed(Mode::kHt, standard, 2, Backend::kCpu);
  // The combine view (R * T_max rows of y) dominates.
  EXPECT_GE(bytes, size_t{2} * 4096 * 7168 * 2);
  EXPECT_LT(bytes, size_t{2} * 4096 * 7168 * 2 + (size_t{8} << 20));
  std::printf("cpu ht bytes per rank, H=7168 K=8 E=256 T=4096 R=2: %zu\n", bytes);
}

// Reuses freed blocks of the same size, as PyTorch's caching allocator does for the Python layer:
// without it every call pays first-touch page faults on its outputs (on the CI VM ~20 us per 4 KiB
// page, more than the copies themselves).
Allocator caching_allocator() {
  constexpr size_t kHugePage = size_t{2} << 20;
  struct Cache {
    std::mutex mu;
    std::multimap<size_t, void*> free_blocks;
    ~Cache() {
      for (auto& [bytes, p] : free_blocks) std::free(p);
    }
  };
  auto cache = std::make_shared<Cache>();
  return [cache](DType dtype, const std::vector<int64_t>& shape, Device device) {
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    const size_t bytes = (t.nbytes() + 63) / 64 * 64 + 64;
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(cache->mu);
      auto it = cache->free_blocks.find(bytes);
      if (it != cache->free_blocks.end()) {
        p = it->second;
        cache->free_blocks.erase(it);
      }
    }
    if (!p) {
      p = std::aligned_alloc(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
      madvise(p, (bytes + kHugePage - 1) / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint
    }
    t.storage = std::shared_ptr<void>(p, [cache, bytes](void* q) {
      std::lock_guard<std::mutex> lock(cache->mu);
      cache->free_blocks.emplace(bytes, q);
    });
    t.data = p;
    return t;
  };
}

// Performance: R = 4 threads, T = 4096, H = 7168, K = 8, E = 256, uniform, bf16; dispatch then
// combine of y = recv_x must take < 2 s wall (2 cores). Checks every output element too:
// out[t] = bf16(n_t * x[t]), n_t the ranks token t went to.
TEST(HtPerf, DeepSeekShapeUnderTwoSeconds) {
  constexpr int R = 4;
  constexpr int64_t T = 4096, H = 7168;
  const MoeShape shape{H, 8, 256, T};
  std::vector<double> first(R), steady(R), disp(R);
  std::mutex mu;
  std::string errors;
  testing::run_threads(R, [&](const Group& g) {
    const int r = g.rank();
    std::mt19937_64 rng(base_seed() + 1000 + r);
    std::vector<int64_t> topk = testing::make_topk_idx(Routing::kUniform, T, 8, 256, R, rng);
    std::vector<uint16_t> x = fast_bf16(T, H, rng);
    Buffer buf(g, shape);
    const Allocator alloc = caching_allocator();
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, 8});
    for (int iter = 0; iter < 2; ++iter) {
      g.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      HtDispatchResult res = buf.ht_dispatch(a, alloc);
      const auto t1 = std::chrono::steady_clock::now();
      HtCombineArgs c;
      c.y = res.recv_x;
      c.handle = &res.handle;
      HtCombineResult out = buf.ht_combine(c, alloc);
      g.barrier();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (iter == 0 ? first : steady)[r] = s;
      disp[r] = std::chrono::duration<double>(t1 - t0).count();
      if (iter == 1) {
        int64_t bad = 0;
        const bool* in_rank = res.handle.is_token_in_rank.ptr<bool>();
        for (int64_t t = 0; t < T; ++t) {
          const float n = static_cast<float>(in_rank[t * R] + in_rank[t * R + 1] +
                                             in_rank[t * R + 2] + in_rank[t * R + 3]);
          for (int64_t h = 0; h < H; ++h)
            bad += out.out.ptr<uint16_t>()[t * H + h] !=
                   detail::f32_to_bf16(0.0f + n * detail::bf16_to_f32(x[t * H + h]));
        }
        std::lock_guard<std::mutex> lock(mu);
        if (bad) errors += "rank " + std::to_string(r) + ": " + std::to_string(bad) + " wrong\n";
      }
    }
  });
  EXPECT_TRUE(errors.empty()) << errors;
  const double cold = *std::max_element(first.begin(), first.end());
  const double warm = *std::max_element(steady.begin(), steady.end());
  std::printf(
      "ht R=4 T=4096 H=7168 K=8 E=256 bf16 dispatch+combine: first call %.3f s, "
      "second call %.3f s (dispatch %.3f s)\n",
      cold, warm, *std::max_element(disp.begin(), disp.end()));
  EXPECT_LT(warm, 2.0);
}

}  // namespace
}  // namespace epx
