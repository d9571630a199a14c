// tests/support/oracle_ht.cc — the naive ht oracle (see oracle_ht.h).
//
// Data flow: everything derives from one predicate, goes_to(s, t, d) = "some topk_idx[t][k] of
// rank s lives on rank d". Rank d's received rows are enumerated as the spec orders them: for
// s = 0..R-1, for t = 0..T_s-1, if goes_to(s, t, d). A token's position in d's rows is found by
// searching that enumeration. Quadratic in places, and meant to be: no cleverness to share bugs
// with the backends.
#include "support/oracle_ht.h"

#include <cstring>

#include "core/numeric.h"

namespace epx::testing {
namespace {

bool goes_to(const HtProblem& p, const HtRankInput& in, int64_t t, int d) {
  const int L = p.num_experts / p.num_ranks;
  for (int k = 0; k < p.top_k; ++k) {
    const int64_t e = in.topk_idx[t * p.top_k + k];
    if (e >= 0 && e / L == d) return true;
  }
  return false;
}

struct RecvRow {
  int src_rank;
  int64_t src_token;
};

// Rows of rank d, in the order of docs/semantics.md §1.2.
std::vector<RecvRow> rows_of(const HtProblem& p, const std::vector<HtRankInput>& inputs, int d) {
  std::vector<RecvRow> rows;
  for (int s = 0; s < p.num_ranks; ++s)
    for (int64_t t = 0; t < inputs[s].num_tokens; ++t)
      if (goes_to(p, inputs[s], t, d)) rows.push_back({s, t});
  return rows;
}

// pos[t][d]: row of token t of rank s in rank d's rows, or -1.
std::vector<std::vector<int32_t>> positions(const HtProblem& p,
                                            const std::vector<HtRankInput>& inputs, int s) {
  std::vector<std::vector<int32_t>> pos(inputs[s].num_tokens,
                                        std::vector<int32_t>(p.num_ranks, -1));
  for (int d = 0; d < p.num_ranks; ++d) {
    const std::vector<RecvRow> rows = rows_of(p, inputs, d);
    for (size_t i = 0; i < rows.size(); ++i)
      if (rows[i].src_rank == s) pos[rows[i].src_token][d] = static_cast<int32_t>(i);
  }
  return pos;
}

}  // namespace

HtExpectedLayout ht_oracle_layout(const HtProblem& p, const std::vector<int64_t>& topk_idx,
                                  int64_t num_tokens) {
  HtRankInput in;
  in.num_tokens = num_tokens;
  in.topk_idx = topk_idx;
  HtExpectedLayout out;
  out.num_tokens_per_rank.assign(p.num_ranks, 0);
  out.num_tokens_per_expert.assign(p.num_experts, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int d = 0; d < p.num_ranks; ++d) {
      const bool in_rank = goes_to(p, in, t, d);
      out.is_token_in_rank.push_back(in_rank ? 1 : 0);
      out.num_tokens_per_rank[d] += in_rank ? 1 : 0;
    }
    for (int k = 0; k < p.top_k; ++k) {
      const int64_t e = topk_idx[t * p.top_k + k];
      if (e >= 0) out.num_tokens_per_expert[e] += 1;
    }
  }
  return out;
}

int64_t ht_oracle_num_recv_tokens(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                  int rank) {
  return static_cast<int64_t>(rows_of(p, inputs, rank).size());
}

HtExpectedDispatch ht_oracle_dispatch(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                      int rank) {
  const int R = p.num_ranks, K = p.top_k, L = p.num_experts / R;
  HtExpectedDispatch ex;
  const std::vector<RecvRow> rows = rows_of(p, inputs, rank);
  ex.num_recv_tokens = static_cast<int64_t>(rows.size());
  if (p.num_worst_tokens > 0 && ex.num_recv_tokens > p.num_worst_tokens) {
    ex.overflow = true;
    return ex;
  }
  ex.num_rows = p.num_worst_tokens > 0 ? p.num_worst_tokens : ex.num_recv_tokens;
  const bool weights = inputs[rank].has_topk_weights;
  std::vector<int> count(L, 0);
  for (int64_t i = 0; i < ex.num_rows; ++i) {
    const bool real = i < ex.num_recv_tokens;
    const HtRankInput* src = real ? &inputs[rows[i].src_rank] : nullptr;
    const int64_t t = real ? rows[i].src_token : -1;
    if (real) {
      const auto x = src->x.begin() + static_cast<int64_t>(t * p.x_row_bytes);
      ex.recv_x.insert(ex.recv_x.end(), x, x + static_cast<int64_t>(p.x_row_bytes));
      const auto sc = src->scales.begin() + static_cast<int64_t>(t * p.scale_row_bytes);
      ex.recv_scales.insert(ex.recv_scales.end(), sc, sc + static_cast<int64_t>(p.scale_row_bytes));
    } else {
      ex.recv_x.resize(ex.recv_x.size() + p.x_row_bytes, 0);
      ex.recv_scales.resize(ex.recv_scales.size() + p.scale_row_bytes, 0);
    }
    for (int k = 0; k < K; ++k) {
      int64_t local = -1;
      float w = 0.0f;
      if (real) {
        const int64_t e = src->topk_idx[t * K + k];
        if (e >= 0 && e / L == rank) {
          local = e % L;
          if (src->has_topk_weights) w = src->topk_weights[t * K + k];
          count[local] += 1;
        }
      }
      ex.recv_topk_idx.push_back(local);
      if (weights) ex.recv_topk_weights.push_back(w);
    }
    ex.recv_src_idx.push_back(static_cast<int32_t>(t));
  }
  if (p.num_worst_tokens == 0) {
    for (int l = 0; l < L; ++l) {
      int aligned = 0;
      while (aligned < count[l]) aligned += p.expert_alignment;
      ex.num_recv_tokens_per_expert.push_back(aligned);
    }
  }
  // rank_prefix_matrix[s][d]: tokens d receives from ranks 0..s.
  for (int s = 0; s < R; ++s) {
    for (int d = 0; d < R; ++d) {
      int32_t n = 0;
      for (int q = 0; q <= s; ++q)
        for (int64_t t = 0; t < inputs[q].num_tokens; ++t) n += goes_to(p, inputs[q], t, d) ? 1 : 0;
      ex.rank_prefix_matrix.push_back(n);
    }
  }
  const auto pos = positions(p, inputs, rank);
  for (int64_t t = 0; t < inputs[rank].num_tokens; ++t) {
    for (int d = 0; d < R; ++d) {
      ex.send_pos.push_back(pos[t][d]);
      ex.is_token_in_rank.push_back(goes_to(p, inputs[rank], t, d) ? 1 : 0);
    }
  }
  return ex;
}

HtExpectedCombine ht_oracle_combine(const HtProblem& p, const std::vector<HtRankInput>& inputs,
                                    const std::vector<HtCombineRankInput>& combine, int rank) {
  const int R = p.num_ranks, K = p.top_k;
  const int per_node = p.ranks_per_node > 0 ? p.ranks_per_node : R, nodes = R / per_node;
  const int own = rank / per_node;
  const int64_t H = p.hidden, T = inputs[rank].num_tokens;
  const auto all_pos = positions(p, inputs, rank);
  const HtCombineRankInput& mine = combine[rank];
  const bool weights = mine.has_topk_weights;
  // Nodes in summation order: this rank's first, then the others ascending.
  std::vector<int> order{own};
  for (int m = 0; m < nodes; ++m)
    if (m != own) order.push_back(m);
  HtExpectedCombine ex;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<int32_t>& pos = all_pos[t];
    // acc = start + this node's value(d, pos[d]), then each other node's sum (from 0.0f) that
    // has a rank t went to, nodes in `order`.
    auto node_first = [&](float start, auto value) {
      float acc = start;
      for (int m : order) {
        float partial = m == own ? acc : 0.0f;
        bool reached = false;
        for (int d = m * per_node; d < (m + 1) * per_node; ++d) {
          if (pos[d] < 0) continue;
          reached = true;
          partial += value(d, pos[d]);
        }
        if (m == own)
          acc = partial;
        else if (reached)
          acc += partial;
      }
      return acc;
    };
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      if (mine.has_bias0) acc += detail::bf16_to_f32(mine.bias0[t * H + h]);
      if (mine.has_bias1) acc += detail::bf16_to_f32(mine.bias1[t * H + h]);
      acc = node_first(
          acc, [&](int d, int32_t row) { return detail::bf16_to_f32(combine[d].y[row * H + h]); });
      ex.out.push_back(detail::f32_to_bf16(acc));
    }
    if (!weights) continue;
    for (int k = 0; k < K; ++k)
      ex.combined_topk_weights.push_back(node_first(
          0.0f, [&](int d, int32_t row) { return combine[d].topk_weights[row * K + k]; }));
  }
  return ex;
}

}  // namespace epx::testing
