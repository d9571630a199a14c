// tests/gpu/ht_reference.cc — see ht_reference.h. Straight loops over docs/semantics.md §1.
#include "gpu/ht_reference.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>

#include "core/numeric.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"

namespace epx::gpu_testing {

std::string HtCase::describe() const {
  std::ostringstream os;
  os << "R=" << num_ranks << " H=" << hidden << " K=" << top_k << " E=" << num_experts << " T=[";
  for (size_t i = 0; i < num_tokens.size(); ++i) os << (i ? "," : "") << num_tokens[i];
  os << "] routing=" << testing::routing_name(routing)
     << (fp8 ? (ue8m0 ? " fp8/ue8m0" : " fp8") : " bf16") << (topk_i32 ? " topk=i32" : " topk=i64")
     << " align=" << alignment << (x_padded ? " x=strided" : "") << " seed=" << seed;
  return os.str();
}

std::vector<HtRankInput> make_ht_inputs(const HtCase& c, uint64_t salt) {
  std::vector<HtRankInput> in(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    HtRankInput& x = in[r];
    x.num_tokens = c.num_tokens[r];
    std::mt19937_64 route(c.seed * 1000003ull + r);
    x.topk_idx =
        testing::make_topk_idx(c.routing, x.num_tokens, c.top_k, c.num_experts, c.num_ranks, route,
                               static_cast<int>(c.seed % c.num_experts));
    x.topk_weights = testing::make_topk_weights(x.topk_idx, route);
    std::mt19937_64 data(c.seed * 7919ull + r * 104729ull + salt * 15485863ull + 17);
    if (c.fp8) {
      x.x = testing::make_bytes(static_cast<size_t>(x.num_tokens * c.row_bytes()), data);
      x.scales.resize(static_cast<size_t>(x.num_tokens * c.num_scales()));
      for (auto& s : x.scales) s = static_cast<uint32_t>(data());
    } else {
      std::vector<uint16_t> v = testing::make_bf16(x.num_tokens, c.hidden, data);
      x.x.resize(v.size() * 2);
      if (!v.empty()) std::memcpy(x.x.data(), v.data(), x.x.size());
    }
  }
  return in;
}

std::vector<HtExpectedDispatch> expected_ht_dispatch(const HtCase& c,
                                                     const std::vector<HtRankInput>& in) {
  const int R = c.num_ranks, K = c.top_k, E = c.num_experts, L = E / R, S = c.num_scales();
  const int64_t rb = c.row_bytes();
  std::vector<HtExpectedDispatch> out(R);
  auto goes_to = [&](const HtRankInput& x, int64_t t, int d) {
    for (int k = 0; k < K; ++k) {
      const int64_t e = x.topk_idx[t * K + k];
      if (e >= 0 && e / L == d) return true;
    }
    return false;
  };
  // Layout, counts and send positions of each source rank.
  std::vector<std::vector<int32_t>> cnt(R, std::vector<int32_t>(R, 0));
  for (int s = 0; s < R; ++s) {
    HtExpectedDispatch& o = out[s];
    const HtRankInput& x = in[s];
    o.num_tokens_per_rank.assign(R, 0);
    o.num_tokens_per_expert.assign(E, 0);
    o.is_token_in_rank.assign(static_cast<size_t>(x.num_tokens * R), 0);
    for (int64_t t = 0; t < x.num_tokens; ++t) {
      for (int k = 0; k < K; ++k)
        if (x.topk_idx[t * K + k] >= 0) ++o.num_tokens_per_expert[x.topk_idx[t * K + k]];
      for (int d = 0; d < R; ++d) {
        if (goes_to(x, t, d)) {
          o.is_token_in_rank[t * R + d] = 1;
          ++o.num_tokens_per_rank[d];
        }
      }
    }
    cnt[s] = o.num_tokens_per_rank;
  }
  std::vector<int32_t> rpm(R * R);
  for (int d = 0; d < R; ++d) {
    int acc = 0;
    for (int s = 0; s < R; ++s) rpm[s * R + d] = acc += cnt[s][d];
  }
  for (int s = 0; s < R; ++s) {
    HtExpectedDispatch& o = out[s];
    o.rank_prefix_matrix = rpm;
    o.send_pos.assign(static_cast<size_t>(in[s].num_tokens * R), -1);
    for (int d = 0; d < R; ++d) {
      int32_t row = s > 0 ? rpm[(s - 1) * R + d] : 0;
      for (int64_t t = 0; t < in[s].num_tokens; ++t)
        if (o.is_token_in_rank[t * R + d]) o.send_pos[t * R + d] = row++;
    }
  }
  // What each receiver gets: sources ascending, then source tokens ascending.
  for (int d = 0; d < R; ++d) {
    HtExpectedDispatch& o = out[d];
    o.num_recv_per_expert.assign(L, 0);
    for (int s = 0; s < R; ++s) {
      const HtRankInput& x = in[s];
      for (int64_t t = 0; t < x.num_tokens; ++t) {
        if (!goes_to(x, t, d)) continue;
        o.recv_x.insert(o.recv_x.end(), x.x.begin() + t * rb, x.x.begin() + (t + 1) * rb);
        o.recv_scales.insert(o.recv_scales.end(), x.scales.begin() + t * S,
                             x.scales.begin() + (t + 1) * S);
        for (int k = 0; k < K; ++k) {
          const int64_t e = x.topk_idx[t * K + k];
          const bool local = e >= 0 && e / L == d;
          o.recv_topk_idx.push_back(local ? e - static_cast<int64_t>(d) * L : -1);
          o.recv_topk_weights.push_back(local && c.weights ? x.topk_weights[t * K + k] : 0.0f);
          if (local) ++o.num_recv_per_expert[e - static_cast<int64_t>(d) * L];
        }
        o.recv_src_idx.push_back(static_cast<int32_t>(t));
        ++o.num_recv;
      }
    }
    for (int& v : o.num_recv_per_expert) v = (v + c.alignment - 1) / c.alignment * c.alignment;
  }
  return out;
}

std::vector<HtCombineInput> make_combine_inputs(const HtCase& c,
                                                const std::vector<HtExpectedDispatch>& d,
                                                bool weights, bool bias0, bool bias1,
                                                uint64_t salt) {
  std::vector<HtCombineInput> y(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    std::mt19937_64 rng(c.seed * 31337ull + r * 7ull + salt * 104729ull + 3);
    y[r].y = testing::make_bf16(d[r].num_recv, c.hidden, rng);
    y[r].has_weights = weights;
    if (weights) {
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      y[r].weights.resize(static_cast<size_t>(d[r].num_recv * c.top_k));
      for (float& w : y[r].weights) w = u(rng);
    }
    if (bias0) y[r].bias0 = testing::make_bf16(c.num_tokens[r], c.hidden, rng);
    if (bias1) y[r].bias1 = testing::make_bf16(c.num_tokens[r], c.hidden, rng);
  }
  return y;
}

std::vector<HtExpectedCombine> expected_ht_combine(const HtCase& c,
                                                   const std::vector<HtRankInput>& in,
                                                   const std::vector<HtExpectedDispatch>& d,
                                                   const std::vector<HtCombineInput>& y) {
  const int R = c.num_ranks, K = c.top_k;
  const int64_t H = c.hidden;
  std::vector<HtExpectedCombine> out(R);
  for (int s = 0; s < R; ++s) {
    const int64_t T = in[s].num_tokens;
    out[s].out.resize(static_cast<size_t>(T * H));
    if (y[s].has_weights) out[s].combined.resize(static_cast<size_t>(T * K));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        if (!y[s].bias0.empty()) acc += detail::bf16_to_f32(y[s].bias0[t * H + h]);
        if (!y[s].bias1.empty()) acc += detail::bf16_to_f32(y[s].bias1[t * H + h]);
        for (int dd = 0; dd < R; ++dd) {
          const int32_t pos = d[s].send_pos[t * R + dd];
          if (pos >= 0) acc += detail::bf16_to_f32(y[dd].y[pos * H + h]);
        }
        out[s].out[t * H + h] = detail::f32_to_bf16(acc);
      }
      if (y[s].has_weights) {
        for (int k = 0; k < K; ++k) {
          float acc = 0.0f;
          for (int dd = 0; dd < R; ++dd) {
            const int32_t pos = d[s].send_pos[t * R + dd];
            if (pos >= 0) acc += y[dd].has_weights ? y[dd].weights[pos * K + k] : 0.0f;
          }
          out[s].combined[t * K + k] = acc;
        }
      }
    }
  }
  return out;
}

// ---- the cpu backend on the same case ---------------------------------------------------------

template <typename T>
static std::vector<T> host_vec(const TensorView& t) {
  std::vector<T> v(t.nbytes() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data, v.size() * sizeof(T));
  return v;
}

std::optional<CpuHtResult> cpu_backend_ht(const HtCase& c, const std::vector<HtRankInput>& in,
                                          const std::vector<HtCombineInput>& y, std::string* why) {
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
      const HtRankInput& x = in[r];
      Buffer buf(g, shape);
      std::vector<int32_t> idx32(x.topk_idx.begin(), x.topk_idx.end());
      HtDispatchArgs a;
      a.x = TensorView::contiguous(const_cast<uint8_t*>(x.x.data()),
                                   c.fp8 ? DType::kF8E4M3 : DType::kBF16, {x.num_tokens, c.hidden});
      if (c.fp8)
        a.x_scales = TensorView::contiguous(const_cast<uint32_t*>(x.scales.data()),
                                            c.ue8m0 ? DType::kI32 : DType::kF32,
                                            {x.num_tokens, c.num_scales()});
      a.topk_idx = c.topk_i32 ? TensorView::contiguous(idx32.data(), DType::kI32, {x.num_tokens, K})
                              : TensorView::contiguous(const_cast<int64_t*>(x.topk_idx.data()),
                                                       DType::kI64, {x.num_tokens, K});
      if (c.weights)
        a.topk_weights = TensorView::contiguous(const_cast<float*>(x.topk_weights.data()),
                                                DType::kF32, {x.num_tokens, K});
      a.expert_alignment = c.alignment;
      HtDispatchResult d = buf.ht_dispatch(a);
      HtExpectedDispatch& o = res.dispatch[r];
      o.num_recv = d.recv_x.shape[0];
      o.recv_x = host_vec<uint8_t>(d.recv_x);
      if (c.fp8) o.recv_scales = host_vec<uint32_t>(d.recv_x_scales);
      if (c.topk_i32) {
        std::vector<int32_t> v = host_vec<int32_t>(d.recv_topk_idx);
        o.recv_topk_idx.assign(v.begin(), v.end());
      } else {
        o.recv_topk_idx = host_vec<int64_t>(d.recv_topk_idx);
      }
      if (c.weights) o.recv_topk_weights = host_vec<float>(d.recv_topk_weights);
      o.recv_src_idx = host_vec<int32_t>(d.recv_src_idx);
      o.num_recv_per_expert = d.num_recv_tokens_per_expert;
      HtCombineArgs ca;
      ca.y = TensorView::contiguous(const_cast<uint16_t*>(y[r].y.data()), DType::kBF16,
                                    {o.num_recv, c.hidden});
      ca.handle = &d.handle;
      if (y[r].has_weights)
        ca.topk_weights = TensorView::contiguous(const_cast<float*>(y[r].weights.data()),
                                                 DType::kF32, {o.num_recv, K});
      if (!y[r].bias0.empty())
        ca.bias0 = TensorView::contiguous(const_cast<uint16_t*>(y[r].bias0.data()), DType::kBF16,
                                          {x.num_tokens, c.hidden});
      if (!y[r].bias1.empty())
        ca.bias1 = TensorView::contiguous(const_cast<uint16_t*>(y[r].bias1.data()), DType::kBF16,
                                          {x.num_tokens, c.hidden});
      HtCombineResult cr = buf.ht_combine(ca);
      res.combine[r].out = host_vec<uint16_t>(cr.out);
      if (y[r].has_weights) res.combine[r].combined = host_vec<float>(cr.combined_topk_weights);
    });
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

}  // namespace epx::gpu_testing
