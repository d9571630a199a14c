// tests/support/a2a_cycle.cc — one a2a dispatch + combine cycle checked against the oracle, and
// the random problem generator, shared by the a2a unit tests (a2a_test.cc, a2a_mask_test.cc).
#include "support/a2a_cycle.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "support/harness.h"

namespace epx::testing {

using Fill = A2aPayloadSpec::Fill;

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

  const A2aDropCounts before = a2a.dropped_counts();
  A2aDispatchResult res = a2a.dispatch(args);
  const A2aExpected ex = a2a_oracle(p, r);
  std::string err = a2a_compare_dispatch(p, r, ex, res, /*check_unspecified_zero=*/true);
  const A2aDropCounts after = a2a.dropped_counts();
  if (after.tokens - before.tokens != ex.dropped.tokens ||
      after.selections - before.selections != ex.dropped.selections) {
    std::ostringstream os;
    os << "\n  rank " << r << ": this dispatch dropped " << after.tokens - before.tokens
       << " tokens / " << after.selections - before.selections << " selections, expected "
       << ex.dropped.tokens << " / " << ex.dropped.selections;
    err += os.str();
  }

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
    out = a2a.combine(ws, M, true, nullptr, poison_allocator(0xFF));
  } else {  // (also when the view is wrong: the collective must go on on every rank)
    if (ws_ok) poison(ws, 0xFF);
    const int64_t row_stride = o.strided_y ? H + 3 : H;
    std::vector<uint8_t> y(static_cast<size_t>(R * M * row_stride) * elem + 1, 0xEE);
    for (int64_t row = 0; row < R * M; ++row)
      std::memcpy(y.data() + row * row_stride * elem, p.combine_y[r].data() + row * H * elem,
                  H * elem);
    TensorView yv = TensorView::contiguous(y.data(), p.combine_dtype, {R, M, H});
    yv.strides = {M * row_stride, row_stride, 1};
    out = a2a.combine(yv, M, false, nullptr, poison_allocator(0xFF));
  }
  std::string cerr = a2a_compare_combine(p, r, ex, out);
  if (!cerr.empty()) err += (err.empty() ? "" : "\n") + cerr;

  // Poison the receive views: the next dispatch must rewrite every row and count.
  for (const TensorView& v : res.recv) poison(v, 0xA5);
  poison(res.recv_counts, 0xA5);
  return err;
}

// Runs `problems` (same configuration, one per cycle) on one A2a object per rank, as threads.

// New token counts, M, routing and inputs for a problem's configuration.
A2aProblem next_cycle(const A2aProblem& config, std::mt19937_64& rng,
                      std::optional<Routing> routing) {
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
  const std::vector<Routing> all = all_routings();
  for (int r = 0; r < R; ++r)
    routings.push_back(routing ? *routing : all[pick(0, static_cast<int64_t>(all.size()) - 1)]);
  fill_a2a_inputs(p, routings, rng);
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
  const DType combine_dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  p.combine_dtype = combine_dtypes[pick(0, 2)];
  const size_t hb = static_cast<size_t>(p.hidden) * dtype_size(p.combine_dtype);
  p.combine_bytes_per_token = (hb + 3) / 4 * 4 + (pick(0, 3) == 0 ? 4 * pick(1, 16) : 0);
  const size_t row_total = dispatch_bytes + p.combine_bytes_per_token;
  const int64_t budget_max = std::max<int64_t>(
      1, static_cast<int64_t>(kMemoryBudget / (static_cast<size_t>(R * R) * row_total)));
  const int64_t want = pick(0, 4) == 0 ? pick(1, 256) : pick(1, 40);
  p.max_tokens_per_rank = std::min(want, budget_max);
  return p;
}

const std::vector<F16SumCase>& f16_sum_cases() {
  // Bits: 0x7BFF 65504, 0x7800 32768, 0x78E2 40000, 0x6800 2048, 0x6801 2050, 0x4C00 16,
  // 0x4B80 15, 0x4800 8, 0x3C00 1, 0x1000 2^-11, 0x0200 2^-15, 0x0001 2^-24 (subnormals are
  // multiples of it), 0x7C00 inf, 0x7E00 the NaN f32_to_f16 writes, 0x7D00 a signalling NaN.
  static const std::vector<F16SumCase> cases = {
      {"65504 + 16 = 65520, the tie of 65504 and 2^16: inf", {0x7BFF, 0x4C00, 0}, 0x7C00},
      {"65504 + 15 = 65519: 65504", {0x7BFF, 0x4B80, 0}, 0x7BFF},
      {"65504 + 8 = 65512: 65504", {0x7BFF, 0x4800, 0}, 0x7BFF},
      {"32768 + 32768: inf", {0x7800, 0x7800, 0}, 0x7C00},
      {"-40000 - 40000: -inf", {0xF8E2, 0xF8E2, 0}, 0xFC00},
      {"-65504 - 16: -inf", {0xFBFF, 0xCC00, 0}, 0xFC00},
      {"1 + 3 * 2^-24 (f32: 1 + 2^-22) - 1: 2^-22, subnormal", {0x3C00, 0x0003, 0xBC00}, 0x0004},
      {"1 + 2^-11 + 2^-11, rounded once: 1 + 2^-10", {0x3C00, 0x1000, 0x1000}, 0x3C01},
      {"5 + 7 subnormal quanta: 12 * 2^-24", {0x0005, 0x0007, 0}, 0x000C},
      {"2^-15 + 2^-15: 2^-14, the smallest normal", {0x0200, 0x0200, 0}, 0x0400},
      {"-(2^-24): subnormal", {0x8001, 0, 0}, 0x8001},
      {"2048 + 1 = 2049, a tie: 2048 (even)", {0x6800, 0x3C00, 0}, 0x6800},
      {"2050 + 1 = 2051, a tie: 2052 (even)", {0x6801, 0x3C00, 0}, 0x6802},
      {"-0 - 0 - 0 from acc = +0: +0", {0x8000, 0x8000, 0x8000}, 0x0000},
      {"a signalling NaN + 1: NaN", {0x7D00, 0x3C00, 0}, 0x7E00},
      {"inf - inf: NaN", {0x7C00, 0xFC00, 0}, 0x7E00},
      {"inf + 65504: inf", {0x7C00, 0x7BFF, 0}, 0x7C00},
  };
  return cases;
}

A2aProblem f16_sum_problem(int R, int64_t hidden) {
  const std::vector<F16SumCase>& cases = f16_sum_cases();
  A2aProblem p;
  p.num_ranks = R;
  p.top_k = R;
  p.num_experts = R;  // expert d on rank d; every token selects all: it goes to every rank
  p.max_tokens_per_rank = 2;
  p.runtime_max = 2;  // one token per rank, one padding row
  p.payloads = {{DType::kI32, {R}, Fill::kExpertIds}};
  p.hidden = hidden;
  p.combine_dtype = DType::kF16;
  p.combine_bytes_per_token = static_cast<size_t>(hidden * 2 + 3) / 4 * 4;
  p.num_tokens.assign(R, 1);
  std::vector<int32_t> ids(R);
  for (int d = 0; d < R; ++d) ids[d] = d;
  std::vector<uint8_t> id_bytes(R * 4);
  std::memcpy(id_bytes.data(), ids.data(), id_bytes.size());
  const int64_t M = p.runtime_max;
  for (int d = 0; d < R; ++d) {
    p.topk_idx.push_back(ids);
    p.payload.push_back({id_bytes});
    // y_d [R, M, H]: row [r][0] (rank r's one token) holds column h's value for rank d (0 beyond
    // the case's ranks; the columns after the cases cycle through them), padding rows 0x5555.
    std::vector<uint16_t> y(static_cast<size_t>(R * M * hidden), 0x5555);
    for (int r = 0; r < R; ++r)
      for (int64_t h = 0; h < hidden; ++h) {
        const F16SumCase& c = cases[h % static_cast<int64_t>(cases.size())];
        y[(r * M) * hidden + h] = d < 3 ? c.y[d] : 0;
      }
    p.combine_y.emplace_back(y.size() * 2);
    std::memcpy(p.combine_y.back().data(), y.data(), y.size() * 2);
  }
  return p;
}

CycleOptions random_options(std::mt19937_64& rng) {
  CycleOptions o;
  o.payload_in_workspace = rng() % 2;
  o.topk_int64 = rng() % 4 == 0;
  o.strided_y = !o.payload_in_workspace && rng() % 3 == 0;
  return o;
}

}  // namespace epx::testing
