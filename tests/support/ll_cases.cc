#include "support/ll_cases.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/numeric.h"

namespace epx::testing {

std::string LlCase::describe() const {
  return p.describe() + " routing=" + routing_name(routing) + (topk_i32 ? " topk_i32" : "") +
         (hook ? " hook" : "") + (reverse_hooks ? " reverse_hooks" : "") +
         (zero_copy ? " zero_copy" : "") + (out_given ? " out" : "") + (stats ? " stats" : "") +
         (padded ? " padded" : "") + (padded && unaligned_y ? " unaligned_y" : "") +
         (padded && unaligned_x ? " unaligned_x" : "") +
         " batches=" + std::to_string(num_batches) + " iters=" + std::to_string(num_iters) +
         " seed=" + std::to_string(seed);
}

LlCase random_ll_case(int R, uint64_t seed, double two_iters) {
  std::mt19937_64 rng(seed * 7919 + 17);
  auto pick = [&](auto... v) {
    const std::vector<std::common_type_t<decltype(v)...>> all{v...};
    return all[std::uniform_int_distribution<size_t>(0, all.size() - 1)(rng)];
  };
  auto coin = [&](double prob) { return std::uniform_real_distribution<>(0, 1)(rng) < prob; };
  LlCase c;
  c.seed = seed;
  const auto routings = all_routings();
  while (true) {
    LlProblem& p = c.p;
    p.num_ranks = R > 0 ? R : pick(1, 2, 3, 4, 8);
    p.num_experts = p.num_ranks * pick(1, 2, 3, 4, 8, 9, 16, 36);
    p.top_k = pick(1, 8, 9, 16);
    p.max_tokens = pick(int64_t{1}, int64_t{7}, int64_t{64}, int64_t{512});
    p.hidden = coin(0.1) ? 7168 : pick(int64_t{128}, int64_t{384});
    c.num_batches = coin(0.3) ? 2 : 1;
    // Keep each case's memory (~16 bytes per [E, T_max, H] element per batch) and time modest.
    const double elems = double(p.num_experts) * p.max_tokens * p.hidden * c.num_batches;
    const double work = double(p.num_ranks) * p.max_tokens * p.top_k * p.hidden;
    if (p.num_experts <= 288 && elems <= 4e6 && work <= 2e7) break;
  }
  c.p.use_fp8 = coin(0.6);
  c.p.round_scale = c.p.use_fp8 && coin(0.5);
  c.p.use_ue8m0 = c.p.round_scale && coin(0.5);
  c.routing = routings[std::uniform_int_distribution<size_t>(0, routings.size() - 1)(rng)];
  c.topk_i32 = coin(0.25);
  c.hook = coin(0.5);
  c.reverse_hooks = c.hook && c.num_batches == 2 && coin(0.5);
  c.zero_copy = coin(0.5);
  c.out_given = coin(0.5);
  c.stats = coin(0.5);
  c.padded = coin(0.25);
  c.num_iters = coin(two_iters) ? 2 : 1;
  c.p.use_logfmt = coin(0.3);  // drawn last: the other fields of a seed stay what they were
  // Last, so the cases above keep their seeds' draws: some bf16 cases become NVFP4, with g an
  // engine's 448 * 6 / amax for rows up to 2^6 * 4, 1, or g saturating / flushing the scales.
  if (!c.p.use_fp8 && coin(0.5)) {
    c.p.use_nvfp4 = true;
    c.p.global_scale = pick(2688.0f / 256.0f, 1.0f, 5000.0f, 1e-3f);
  }
  return c;
}

std::vector<LlCase> nvfp4_ll_cases(int R, uint64_t seed) {
  std::vector<LlCase> cases;
  auto add = [&](LlProblem p, Routing routing, float g) {
    LlCase c;
    c.p = p;
    c.p.use_nvfp4 = true;
    c.p.global_scale = g;
    c.routing = routing;
    c.seed = seed++;
    cases.push_back(c);
    return &cases.back();
  };
  LlCase* c = add({R, 7, 7168, 8, 16 * R}, Routing::kUniform, 2688.0f / 256.0f);
  c->hook = true;
  c->num_batches = 2;
  c->fixed_tokens.assign(R, 7);
  c = add({R, 130, 384, 9, 3 * R}, Routing::kSkewed, 5000.0f);  // R * 130 rows: partial tile
  c->zero_copy = c->out_given = c->stats = true;
  c->num_iters = 2;
  c = add({R, 33, 128, 1, R}, Routing::kAllToOne, 1e-3f);
  c->topk_i32 = c->padded = c->hook = true;
  int i = 0;
  for (Routing routing : all_routings()) {
    c = add({R, 64, 256, 4, 4 * R}, routing, i % 2 ? 1.0f : 2688.0f / 64.0f);
    c->hook = i++ % 2 == 0;
  }
  // Rows wider than the cuda dispatch send's prefetch (kLlXPrefetch = 2 vectors of 8 per thread
  // of 512: H <= 8192): the rest of each row is loaded in the send's loop.
  c = add({R, 5, 16512, 8, 8 * R}, Routing::kUniform, 2688.0f / 256.0f);
  c->hook = true;
  return cases;
}

std::vector<uint16_t> make_logfmt_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  std::vector<uint16_t> v(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind_of(0, 15), scale_of(-12, -1), col_of(0, 127);
  auto bf16 = [](float f) { return detail::f32_to_bf16(f); };
  for (int64_t g0 = 0; g0 < rows * cols; g0 += 128) {
    uint16_t* grp = v.data() + g0;
    const int kind = kind_of(rng);
    const float m = std::ldexp(1.0f, scale_of(rng));
    for (int i = 0; i < 128; ++i) grp[i] = bf16(normal(rng) * m);  // kinds 0-8: cast
    if (kind >= 6 && kind <= 8) {  // zeros, +0 and -0, at a few places
      for (int z = 0; z < 1 + kind; ++z) grp[col_of(rng)] = z % 2 ? 0x8000 : 0;
    } else if (kind == 9) {  // one magnitude: raw
      const uint16_t mag = grp[0] & 0x7FFF;
      for (int i = 0; i < 128; ++i) grp[i] = static_cast<uint16_t>((grp[i] & 0x8000) | mag);
    } else if (kind == 10) {  // a value >= 1: raw
      grp[col_of(rng)] = bf16(1.0f + std::fabs(normal(rng)));
    } else if (kind == 11) {  // subnormal bf16 values among tiny normals: cast
      for (int i = 0; i < 128; i += 2)
        grp[i] = static_cast<uint16_t>((grp[i] & 0x8000) | (1 + rng() % 127));
      for (int i = 1; i < 128; i += 2) grp[i] = bf16(normal(rng) * 0x1p-120f);
    } else if (kind == 12) {  // magnitudes over 2^-45 .. 2^-1: lb clipped to la - 32
      for (int i = 0; i < 128; ++i)
        grp[i] = bf16(normal(rng) * std::ldexp(1.0f, -1 - static_cast<int>(rng() % 45)));
    } else if (kind == 13) {  // one non-zero value: cast, amin = 0
      for (int i = 0; i < 128; ++i) grp[i] = 0;
      grp[col_of(rng)] = bf16(normal(rng) * m);
    } else if (kind == 14) {  // all zeros: raw
      for (int i = 0; i < 128; ++i) grp[i] = i % 3 ? 0 : 0x8000;
    } else if (kind == 15) {  // NaN or Inf: raw
      grp[col_of(rng)] = rng() % 2 ? 0x7FC0 : 0xFF80;
    }
  }
  return v;
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
    in.x = make_x(in.num_tokens, H, rng, /*nan_groups=*/true);
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
      const int64_t n = b.want[r].recv_count[l];
      const std::vector<uint16_t> rows =
          p.use_logfmt ? make_logfmt_bf16(n, H, rng) : make_bf16(n, H, rng);
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
