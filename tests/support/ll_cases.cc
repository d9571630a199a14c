#include "support/ll_cases.h"

#include <algorithm>

namespace epx::testing {

std::string LlCase::describe() const {
  return p.describe() + " routing=" + routing_name(routing) + (topk_i32 ? " topk_i32" : "") +
         (hook ? " hook" : "") + (reverse_hooks ? " reverse_hooks" : "") +
         (zero_copy ? " zero_copy" : "") + (out_given ? " out" : "") + (stats ? " stats" : "") +
         (padded ? " padded" : "") + " batches=" + std::to_string(num_batches) +
         " iters=" + std::to_string(num_iters) + " seed=" + std::to_string(seed);
}

LlBatch make_ll_batch(const LlCase& c, std::mt19937_64& rng) {
  const LlProblem& p = c.p;
  const int R = p.num_ranks, L = p.num_local_experts();
  const int64_t H = p.hidden;
  LlBatch b;
  for (int r = 0; r < R; ++r) {
    LlRankInput in;
    const int pick = std::uniform_int_distribution<int>(0, 5)(rng);
    in.num_tokens = !c.fixed_tokens.empty() ? c.fixed_tokens[r]
                    : pick == 0             ? 0
                    : pick == 1             ? p.max_tokens
                                : std::uniform_int_distribution<int64_t>(0, p.max_tokens)(rng);
    in.x = make_bf16(in.num_tokens, H, rng);
    const int target = std::uniform_int_distribution<int>(0, p.num_experts - 1)(rng);
    in.topk_idx = make_topk_idx(c.routing, in.num_tokens, p.top_k, p.num_experts, R, rng, target);
    in.topk_weights = make_topk_weights(in.topk_idx, rng);
    b.in.push_back(std::move(in));
    std::vector<int32_t> s(L);
    for (auto& v : s) v = std::uniform_int_distribution<int32_t>(-1000, 1000)(rng);
    b.stats0.push_back(s);
  }
  finish_ll_batch(c, b, rng);
  return b;
}

void finish_ll_batch(const LlCase& c, LlBatch& b, std::mt19937_64& rng) {
  const LlProblem& p = c.p;
  const int R = p.num_ranks, L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  b.want.clear();
  b.y.clear();
  for (int r = 0; r < R; ++r) {
    b.want.push_back(oracle_ll_dispatch(p, b.in, r));
    std::vector<uint16_t> y(L * RT * H, kLlPoisonBf16);
    for (int l = 0; l < L; ++l) {
      const std::vector<uint16_t> rows = make_bf16(b.want[r].recv_count[l], H, rng);
      std::copy(rows.begin(), rows.end(), y.begin() + l * RT * H);
    }
    b.y.push_back(std::move(y));
  }
  b.want_out = oracle_ll_combine_all(p, b.in, b.y);
}

std::vector<LlBatch> make_ll_batches(const LlCase& c) {
  std::mt19937_64 rng(c.seed);
  std::vector<LlBatch> v;
  for (int i = 0; i < c.num_iters * c.num_batches; ++i) v.push_back(make_ll_batch(c, rng));
  return v;
}

}  // namespace epx::testing
