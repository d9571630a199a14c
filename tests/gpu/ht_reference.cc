// tests/gpu/ht_reference.cc — see ht_reference.h: cases, inputs and the cpu backend's run; the
// expected results are the oracle's (tests/support/oracle_ht.cc).
#include "gpu/ht_reference.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <sstream>

#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"

namespace epx::gpu_testing {
namespace {

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <typename T>
std::vector<T> host_vec(const TensorView& t) {
  std::vector<T> v(t.nbytes() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * sizeof(T));
  return v;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

}  // namespace

std::string HtCase::describe() const {
  std::ostringstream os;
  os << "R=" << num_ranks << " H=" << hidden << " K=" << top_k << " E=" << num_experts << " T=[";
  for (size_t i = 0; i < num_tokens.size(); ++i) os << (i ? "," : "") << num_tokens[i];
  os << "] routing=" << testing::routing_name(routing)
     << (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8") : " bf16") << (topk_i32 ? " topk=i32" : " topk=i64")
     << " align=" << alignment << (x_padded ? " x=strided" : "") << " seed=" << seed;
  return os.str();
}

testing::HtProblem HtCase::problem(int64_t num_worst_tokens) const {
  testing::HtProblem p;
  p.num_ranks = num_ranks;
  p.num_experts = num_experts;
  p.top_k = top_k;
  p.hidden = hidden;
  p.x_row_bytes = static_cast<size_t>(row_bytes());
  p.scale_row_bytes = static_cast<size_t>(num_scales()) * 4;
  p.expert_alignment = alignment;
  p.num_worst_tokens = num_worst_tokens;
  p.ranks_per_node = ranks_per_node;
  return p;
}

std::vector<testing::HtRankInput> make_ht_inputs(const HtCase& c, uint64_t salt) {
  std::vector<testing::HtRankInput> in(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    testing::HtRankInput& x = in[r];
    x.num_tokens = c.num_tokens[r];
    std::mt19937_64 route(c.seed * 1000003ull + r);
    x.topk_idx =
        testing::make_topk_idx(c.routing, x.num_tokens, c.top_k, c.num_experts, c.num_ranks, route,
                               static_cast<int>(c.seed % c.num_experts));
    x.has_topk_weights = c.weights;
    x.topk_weights = testing::make_topk_weights(x.topk_idx, route);
    std::mt19937_64 data(c.seed * 7919ull + r * 104729ull + salt * 15485863ull + 17);
    if (c.fp8) {
      x.x = testing::make_bytes(static_cast<size_t>(x.num_tokens * c.row_bytes()), data);
      std::vector<uint32_t> scales(static_cast<size_t>(x.num_tokens * c.num_scales()));
      for (auto& s : scales) s = static_cast<uint32_t>(data());
      x.scales = as_bytes(scales);
    } else {
      x.x = as_bytes(testing::make_bf16(x.num_tokens, c.hidden, data));
    }
  }
  return in;
}

std::vector<testing::HtCombineRankInput> make_combine_inputs(
    const HtCase& c, const std::vector<testing::HtRankInput>& in, bool weights, bool bias0,
    bool bias1, uint64_t salt) {
  const testing::HtProblem p = c.problem();
  std::vector<testing::HtCombineRankInput> y(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    const int64_t num_recv = testing::ht_oracle_num_recv_tokens(p, in, r);
    std::mt19937_64 rng(c.seed * 31337ull + r * 7ull + salt * 104729ull + 3);
    y[r].y = testing::make_bf16(num_recv, c.hidden, rng);
    y[r].has_topk_weights = weights;
    if (weights) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      y[r].topk_weights.resize(static_cast<size_t>(num_recv * c.top_k));
      for (float& w : y[r].topk_weights) w = u(rng);
    }
    y[r].has_bias0 = bias0;
    y[r].has_bias1 = bias1;
    if (bias0) y[r].bias0 = testing::make_bf16(c.num_tokens[r], c.hidden, rng);
    if (bias1) y[r].bias1 = testing::make_bf16(c.num_tokens[r], c.hidden, rng);
  }
  return y;
}

// ---- the cpu backend on the same case ---------------------------------------------------------

std::optional<CpuHtResult> cpu_backend_ht(const HtCase& c,
                                          const std::vector<testing::HtRankInput>& in,
                                          const std::vector<testing::HtCombineRankInput>& y,
                                          std::string* why) {
  const int R = c.num_ranks, K = c.top_k;
  CpuHtResult res;
  res.dispatch.resize(R);
  res.combine.resize(R);
  MoeShape shape;
  shape.hidden = c.hidden;
  shape.top_k = K;
  shape.num_experts = c.num_experts;
  shape.max_tokens_per_rank =
      std::max<int64_t>(1, *std::max_element(c.num_tokens.begin(), c.num_tokens.end()));
  try {
    testing::run_threads(R, [&](const Group& g) {
      const int r = g.rank();
      const testing::HtRankInput& x = in[r];
      Buffer buf(g, shape);
      std::vector<int32_t> idx32(x.topk_idx.begin(), x.topk_idx.end());
      HtDispatchArgs a;
      a.x = TensorView::contiguous(const_cast<uint8_t*>(x.x.data()),
                                   c.fp8 ? DType::kF8E4M3 : DType::kBF16, {x.num_tokens, c.hidden});
      if (c.fp8)
        a.x_scales = TensorView::contiguous(const_cast<uint8_t*>(x.scales.data()),
                                            c.ue8m0 ? DType::kI32 : DType::kF32,
                                            {x.num_tokens, c.num_scales()});
      a.topk_idx = c.topk_i32 ? TensorView::contiguous(idx32.data(), DType::kI32, {x.num_tokens, K})
                              : TensorView::contiguous(const_cast<int64_t*>(x.topk_idx.data()),
                                                       DType::kI64, {x.num_tokens, K});
      if (x.has_topk_weights)
        a.topk_weights = TensorView::contiguous(const_cast<float*>(x.topk_weights.data()),
                                                DType::kF32, {x.num_tokens, K});
      a.expert_alignment = c.alignment;
      HtDispatchResult d = buf.ht_dispatch(a);
      testing::HtExpectedDispatch& o = res.dispatch[r];
      o.num_recv_tokens = o.num_rows = d.recv_x.shape[0];
      o.recv_x = host_vec<uint8_t>(d.recv_x);
      if (c.fp8) o.recv_scales = host_vec<uint8_t>(d.recv_x_scales);
      if (c.topk_i32) {
        std::vector<int32_t> v = host_vec<int32_t>(d.recv_topk_idx);
        o.recv_topk_idx.assign(v.begin(), v.end());
      } else {
        o.recv_topk_idx = host_vec<int64_t>(d.recv_topk_idx);
      }
      if (x.has_topk_weights) o.recv_topk_weights = host_vec<float>(d.recv_topk_weights);
      o.recv_src_idx = host_vec<int32_t>(d.recv_src_idx);
      o.num_recv_tokens_per_expert = d.num_recv_tokens_per_expert;
      o.rank_prefix_matrix = host_vec<int32_t>(d.handle.rank_prefix_matrix);
      o.send_pos = host_vec<int32_t>(d.handle.send_pos);
      o.is_token_in_rank = host_vec<uint8_t>(d.handle.is_token_in_rank);
      const testing::HtCombineRankInput& yr = y[r];
      HtCombineArgs ca;
      ca.y = TensorView::contiguous(const_cast<uint16_t*>(yr.y.data()), DType::kBF16,
                                    {o.num_rows, c.hidden});
      ca.handle = &d.handle;
      if (yr.has_topk_weights)
        ca.topk_weights = TensorView::contiguous(const_cast<float*>(yr.topk_weights.data()),
                                                 DType::kF32, {o.num_rows, K});
      if (yr.has_bias0)
        ca.bias0 = TensorView::contiguous(const_cast<uint16_t*>(yr.bias0.data()), DType::kBF16,
                                          {x.num_tokens, c.hidden});
      if (yr.has_bias1)
        ca.bias1 = TensorView::contiguous(const_cast<uint16_t*>(yr.bias1.data()), DType::kBF16,
                                          {x.num_tokens, c.hidden});
      HtCombineResult cr = buf.ht_combine(ca);
      res.combine[r].out = host_vec<uint16_t>(cr.out);
      if (yr.has_topk_weights)
        res.combine[r].combined_topk_weights = host_vec<float>(cr.combined_topk_weights);
    }, GroupOptions{.ranks_per_node = c.ranks_per_node});
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnsupported &&
        std::string(e.what()).find("not implemented") != std::string::npos) {
      if (why) *why = e.what();
      return std::nullopt;
    }
    throw;
  }
  return res;
}

std::vector<std::string> cpu_backend_differences(const HtCase& c, const CpuHtResult& cpu, int r,
                                                 const testing::HtExpectedDispatch& want,
                                                 const testing::HtExpectedCombine& want_c) {
  const testing::HtExpectedDispatch& got = cpu.dispatch[r];
  const testing::HtExpectedCombine& got_c = cpu.combine[r];
  std::vector<std::string> bad;
  auto check = [&](bool same, const char* what) {
    if (!same) bad.emplace_back(what);
  };
  check(got.num_recv_tokens == want.num_recv_tokens, "N");
  check(same_bits(got.recv_x, want.recv_x), "recv_x");
  check(same_bits(got.recv_scales, want.recv_scales), "recv_x_scales");
  check(same_bits(got.recv_topk_idx, want.recv_topk_idx), "recv_topk_idx");
  if (c.weights)
    check(same_bits(got.recv_topk_weights, want.recv_topk_weights), "recv_topk_weights");
  check(same_bits(got.recv_src_idx, want.recv_src_idx), "recv_src_idx");
  check(got.num_recv_tokens_per_expert == want.num_recv_tokens_per_expert,
        "num_recv_tokens_per_expert");
  check(same_bits(got.rank_prefix_matrix, want.rank_prefix_matrix), "rank_prefix_matrix");
  check(same_bits(got.send_pos, want.send_pos), "send_pos");
  check(same_bits(got.is_token_in_rank, want.is_token_in_rank), "is_token_in_rank");
  check(same_bits(got_c.out, want_c.out), "combine out");
  check(same_bits(got_c.combined_topk_weights, want_c.combined_topk_weights),
        "combined_topk_weights");
  return bad;
}

}  // namespace epx::gpu_testing
