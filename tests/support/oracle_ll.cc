// tests/support/oracle_ll.cc — the naive ll oracle. Data flow, for rank r:
//   dispatch: for each local expert l (global e = r * L + l), walk every source rank s ascending
//     and its tokens t ascending; a token whose topk row contains e (once or more) takes the next
//     row of l: its bf16 row, quantize_row_fp8 of it, or oracle_nvfp4_row of it (below, written
//     from the formula); src_info = t. layout_range[l][s] is the (begin << 32) | count of the
//     rows taken from s. The same on every topology (ranks_per_node is not read), NVFP4 included.
//   masks (p.masked_dispatch, p.masked_combine): a source masked at the dispatch takes no rows
//     (its layout_range count is 0); at the combine an expert on a masked rank is skipped like -1.
//   combine: the row of (source rank, token) in every expert is found again by the same walk,
//     then out[t] = bf16(fmaf-chain over k of w[t][k] * y_d[l][row]) in k order — across nodes
//     one chain per node (its experts' k in order, from 0.0f), this rank's node's first, then
//     the others that the token reached, ascending, added (use_logfmt: y_d[l][row] replaced by
//     its LogFMT decoding, support/logfmt_ref.h, in every chain; the sums stay float32).
#include "support/oracle_ll.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/numeric.h"
#include "support/logfmt_ref.h"

namespace epx::testing {

std::string LlProblem::describe() const {
  const std::string nodes =
      ranks_per_node > 0 && ranks_per_node < num_ranks
          ? detail::cat(" (", num_ranks / ranks_per_node, "x", ranks_per_node, ")")
          : "";
  const char* format = use_fp8 ? " fp8" : use_nvfp4 ? " nvfp4" : " bf16";
  return detail::cat("R=", num_ranks, nodes, " T_max=", max_tokens, " H=", hidden, " K=", top_k,
                     " E=", num_experts, format, round_scale ? " round_scale" : "",
                     use_ue8m0 ? " ue8m0" : "", use_logfmt ? " logfmt" : "",
                     use_nvfp4 ? detail::cat(" g=", global_scale) : "",
                     masked_dispatch || masked_combine
                         ? detail::cat(" masked=", masked_dispatch, "/", masked_combine)
                         : "");
}

namespace {

bool selects(const LlProblem& p, const LlRankInput& in, int64_t t, int expert) {
  for (int k = 0; k < p.top_k; ++k)
    if (in.topk_idx[t * p.top_k + k] == expert) return true;
  return false;
}

bool masked_in(uint64_t mask, int64_t rank) {
  return (mask >> rank & 1) != 0;
}

// row_of[e][s * T_max + t]: the row of source s's token t in expert e, or -1.
std::vector<std::vector<int64_t>> rows_of_all_experts(const LlProblem& p,
                                                      const std::vector<LlRankInput>& inputs) {
  std::vector<std::vector<int64_t>> row_of(p.num_experts,
                                           std::vector<int64_t>(p.rows_per_expert(), -1));
  for (int e = 0; e < p.num_experts; ++e) {
    int64_t row = 0;
    for (int s = 0; s < p.num_ranks; ++s)
      for (int64_t t = 0; t < inputs[s].num_tokens && !masked_in(p.masked_dispatch, s); ++t)
        if (selects(p, inputs[s], t, e)) row_of[e][s * p.max_tokens + t] = row++;
  }
  return row_of;
}

// The e2m1 code of v: the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to the even code,
// saturating), sign in bit 3 (negative zero included); NaN -> 0.
uint8_t e2m1_code(float v) {
  static const float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  if (std::isnan(v)) return 0;
  const float a = std::fabs(v);
  // Saturating: past 6 the nearest is 6 (the distances below tie for +-inf, and for huge values,
  // whose float differences with 4 and with 6 round to the same number).
  if (a > 6.0f) return static_cast<uint8_t>(7 | (std::signbit(v) ? 8 : 0));
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const float d = std::fabs(a - kMag[c]), db = std::fabs(a - kMag[best]);
    if (d < db || (d == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 8 : 0));
}

uint8_t exponent_byte(float pow2) {
  uint32_t bits;
  std::memcpy(&bits, &pow2, 4);
  return static_cast<uint8_t>(bits >> 23);
}

}  // namespace

void oracle_nvfp4_row(const uint16_t* x, int64_t hidden, float global_scale, uint8_t* q,
                      uint8_t* sf) {
  for (int64_t b = 0; b < hidden / 16; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 16; ++i) {
      const float v = std::fabs(detail::bf16_to_f32(x[16 * b + i]));
      if (v > amax) amax = v;  // NaN is skipped
    }
    sf[b] = detail::f32_to_fp8_e4m3((amax / 6.0f) * global_scale);
    const float s = detail::fp8_e4m3_to_f32(sf[b]);
    const float inv = s == 0.0f ? 0.0f : global_scale / s;
    for (int i = 0; i < 16; i += 2) {
      const uint8_t lo = e2m1_code(detail::bf16_to_f32(x[16 * b + i]) * inv);
      const uint8_t hi = e2m1_code(detail::bf16_to_f32(x[16 * b + i + 1]) * inv);
      q[(16 * b + i) / 2] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}

LlExpectedDispatch oracle_ll_dispatch(const LlProblem& p, const std::vector<LlRankInput>& inputs,
                                      int rank) {
  const int L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden, G = p.num_groups();
  const int64_t packed = (G + 3) / 4;
  const int64_t row_bytes = p.use_nvfp4 ? H / 2 : p.use_fp8 ? H : 2 * H;
  LlExpectedDispatch out;
  out.recv_count.assign(L, 0);
  out.recv_x.assign(L * RT * row_bytes, 0);
  if (p.use_nvfp4) out.recv_sf.assign(L * RT * (H / 16), 0);
  if (p.use_fp8 && !p.use_ue8m0) out.recv_scales.assign(L * RT * G, 0.0f);
  if (p.use_fp8 && p.use_ue8m0) out.recv_packed.assign(L * RT * packed, 0);
  out.src_info.assign(L * RT, 0);
  out.layout_range.assign(L * p.num_ranks, 0);

  std::vector<uint8_t> q(H);
  std::vector<float> scales(G);
  for (int l = 0; l < L; ++l) {
    const int e = rank * L + l;
    int64_t row = 0;
    for (int s = 0; s < p.num_ranks; ++s) {
      const int64_t begin = row;
      const LlRankInput& in = inputs[s];
      for (int64_t t = 0; t < in.num_tokens && !masked_in(p.masked_dispatch, s); ++t) {
        if (!selects(p, in, t, e)) continue;
        const uint16_t* x = in.x.data() + t * H;
        uint8_t* dst = out.recv_x.data() + (l * RT + row) * row_bytes;
        if (p.use_nvfp4) {
          uint8_t* sf = out.recv_sf.data() + (l * RT + row) * (H / 16);
          oracle_nvfp4_row(x, H, p.global_scale, dst, sf);
        } else if (!p.use_fp8) {
          std::memcpy(dst, x, H * 2);
        } else {
          detail::quantize_row_fp8(x, H, p.round_scale, q.data(), scales.data());
          std::memcpy(dst, q.data(), H);
          for (int64_t g = 0; g < G; ++g) {
            if (!p.use_ue8m0) {
              out.recv_scales[(l * RT + row) * G + g] = scales[g];
            } else {
              int32_t& word = out.recv_packed[(l * RT + row) * packed + g / 4];
              word = static_cast<int32_t>(static_cast<uint32_t>(word) |
                                          (uint32_t{exponent_byte(scales[g])} << (8 * (g % 4))));
            }
          }
        }
        out.src_info[l * RT + row] = static_cast<int32_t>(t);
        ++row;
      }
      out.layout_range[l * p.num_ranks + s] = (begin << 32) | (row - begin);
    }
    out.recv_count[l] = static_cast<int32_t>(row);
  }
  return out;
}

namespace {

std::vector<uint16_t> combine_rank(const LlProblem& p, const std::vector<LlRankInput>& inputs,
                                   const std::vector<std::vector<uint16_t>>& y,
                                   const std::vector<std::vector<int64_t>>& row_of, int rank) {
  const int L = p.num_local_experts(), K = p.top_k;
  const int per_node = p.ranks_per_node > 0 ? p.ranks_per_node : p.num_ranks;
  const int nodes = p.num_ranks / per_node, own = rank / per_node;
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  const LlRankInput& in = inputs[rank];
  // A rank the others mask at the dispatch sent them nothing: its combine is not defined here.
  if (masked_in(p.masked_dispatch, rank)) return std::vector<uint16_t>(in.num_tokens * p.hidden, 0);
  std::vector<int> order{own};  // nodes in summation order
  for (int m = 0; m < nodes; ++m)
    if (m != own) order.push_back(m);
  std::vector<uint16_t> out(in.num_tokens * H);
  std::vector<float> acc(H), chain(H), values(H);
  for (int64_t t = 0; t < in.num_tokens; ++t) {
    for (int m : order) {
      std::fill(chain.begin(), chain.end(), 0.0f);
      bool reached = false;
      for (int k = 0; k < K; ++k) {
        const int64_t e = in.topk_idx[t * K + k];
        if (e == -1 || e / L / per_node != m || masked_in(p.masked_combine, e / L)) continue;
        reached = true;
        const int64_t row = row_of[e][rank * p.max_tokens + t];
        const uint16_t* y_row = y[e / L].data() + ((e % L) * RT + row) * H;
        if (p.use_logfmt) {
          logfmt_ref_row(y_row, H, values.data());
        } else {
          for (int64_t c = 0; c < H; ++c) values[c] = detail::bf16_to_f32(y_row[c]);
        }
        for (int64_t c = 0; c < H; ++c)
          chain[c] = std::fmaf(in.topk_weights[t * K + k], values[c], chain[c]);
      }
      if (m == own)
        acc = chain;
      else if (reached)
        for (int64_t c = 0; c < H; ++c) acc[c] += chain[c];
    }
    for (int64_t c = 0; c < H; ++c) out[t * H + c] = detail::f32_to_bf16(acc[c]);
  }
  return out;
}

}  // namespace

std::vector<uint16_t> oracle_ll_combine(const LlProblem& p, const std::vector<LlRankInput>& inputs,
                                        const std::vector<std::vector<uint16_t>>& y, int rank) {
  return combine_rank(p, inputs, y, rows_of_all_experts(p, inputs), rank);
}

std::vector<std::vector<uint16_t>> oracle_ll_combine_all(
    const LlProblem& p, const std::vector<LlRankInput>& inputs,
    const std::vector<std::vector<uint16_t>>& y) {
  const auto row_of = rows_of_all_experts(p, inputs);
  std::vector<std::vector<uint16_t>> outs;
  for (int r = 0; r < p.num_ranks; ++r) outs.push_back(combine_rank(p, inputs, y, row_of, r));
  return outs;
}

// ---- comparison ----------------------------------------------------------------------------

namespace {

// Counts mismatches, remembers the first.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  template <typename... Args>
  void add(const Args&... args) {
    if (count++ == 0) first = detail::cat(args...);
  }
  std::string report() const {
    return count == 0 ? "" : detail::cat(first, " (", count, " mismatches in all)");
  }
};

bool shape_is(const TensorView& t, std::initializer_list<int64_t> s) {
  if (t.ndim != static_cast<int>(s.size())) return false;
  int i = 0;
  for (int64_t v : s)
    if (t.shape[i++] != v) return false;
  return true;
}

template <typename T>
T at(const TensorView& t, std::initializer_list<int64_t> idx) {
  int64_t off = 0, i = 0;
  for (int64_t v : idx) off += v * t.strides[i++];
  return static_cast<const T*>(t.data)[off];
}

// The NVFP4 views' dtypes, shapes and strides (epx/ll.h: the storages [L, RT, H/2] and
// [L, ceil(RT/128), H/64, 32, 4, 4] as DeepEP's forks return them).
std::string check_nvfp4_views(const LlProblem& p, const LlDispatchResult& got) {
  const int64_t L = p.num_local_experts(), RT = p.rows_per_expert(), H = p.hidden;
  const TensorView& x = got.recv_x;
  if (x.dtype != DType::kU8 || !shape_is(x, {RT, H / 2, L}) || x.strides[0] != H / 2 ||
      x.strides[1] != 1 || x.strides[2] != RT * H / 2)
    return "recv_x is " + x.describe() +
           detail::cat(", expected u8[", RT, ", ", H / 2, ", ", L, "] strides [", H / 2, ", 1, ",
                       RT * H / 2, "]");
  const TensorView& s = got.recv_scales;
  const int64_t rm = (RT + 127) / 128, rk = H / 64;
  const std::array<int64_t, 6> strides{16, 4, rk * 512, 1, 512, rm * rk * 512};
  bool ok = s.dtype == DType::kF8E4M3 && shape_is(s, {32, 4, rm, 4, rk, L});
  for (int i = 0; ok && i < 6; ++i) ok = s.strides[i] == strides[i];
  if (!ok)
    return "recv_scales is " + s.describe() +
           detail::cat(", expected fp8_e4m3[32, 4, ", rm, ", 4, ", rk, ", ", L,
                       "] strides [16, 4, ", rk * 512, ", 1, 512, ", rm * rk * 512, "]");
  return "";
}

// Every value byte and scale of row `row` of expert l, through the views.
template <typename M>
void check_nvfp4_row(const LlProblem& p, const LlExpectedDispatch& want,
                     const LlDispatchResult& got, int l, int64_t row, M& m) {
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  for (int64_t c = 0; c < H / 2; ++c) {
    const uint8_t v = at<uint8_t>(got.recv_x, {row, c, l});
    const uint8_t w = want.recv_x[(l * RT + row) * (H / 2) + c];
    if (v != w)
      m.add("recv_x[row ", row, "][", c, "][expert ", l, "] = 0x", std::hex, int{v},
            ", expected 0x", int{w}, std::dec);
  }
  for (int64_t j = 0; j < H / 16; ++j) {
    const uint8_t v =
        at<uint8_t>(got.recv_scales, {row % 32, row % 128 / 32, row / 128, j % 4, j / 4, l});
    const uint8_t w = want.recv_sf[(l * RT + row) * (H / 16) + j];
    if (v != w)
      m.add("recv_scales of expert ", l, " row ", row, " block ", j, " = 0x", std::hex, int{v},
            ", expected 0x", int{w}, std::dec);
  }
}

}  // namespace

std::string check_ll_dispatch(const LlProblem& p, const LlExpectedDispatch& want,
                              const LlDispatchResult& got) {
  const int L = p.num_local_experts(), R = p.num_ranks;
  const int64_t RT = p.rows_per_expert(), H = p.hidden, G = p.num_groups();
  const int64_t packed = (G + 3) / 4;
  const DType x_dtype = p.use_fp8 ? DType::kF8E4M3 : DType::kBF16;
  if (p.use_nvfp4) {
    const std::string e = check_nvfp4_views(p, got);
    if (!e.empty()) return e;
  } else if (got.recv_x.dtype != x_dtype || !shape_is(got.recv_x, {L, RT, H})) {
    return "recv_x is " + got.recv_x.describe() + ", expected " + dtype_name(x_dtype) +
           detail::cat("[", L, ", ", RT, ", ", H, "]");
  }
  if (got.recv_count.dtype != DType::kI32 || !shape_is(got.recv_count, {L}))
    return "recv_count is " + got.recv_count.describe();
  if (got.handle.src_info.dtype != DType::kI32 || !shape_is(got.handle.src_info, {L, RT}))
    return "handle.src_info is " + got.handle.src_info.describe();
  if (got.handle.layout_range.dtype != DType::kI64 || !shape_is(got.handle.layout_range, {L, R}))
    return "handle.layout_range is " + got.handle.layout_range.describe();
  if (p.use_fp8) {
    const TensorView& s = got.recv_scales;
    const DType sd = p.use_ue8m0 ? DType::kI32 : DType::kF32;
    const int64_t cols = p.use_ue8m0 ? packed : G;
    if (s.dtype != sd || !shape_is(s, {L, RT, cols})) return "recv_scales is " + s.describe();
    if (s.strides[0] != cols * RT || s.strides[1] != 1 || s.strides[2] != RT)
      return "recv_scales is " + s.describe() + ", expected column-major in the last two dims";
  }

  Mismatches m;
  for (int l = 0; l < L; ++l) {
    const int32_t count = at<int32_t>(got.recv_count, {l});
    if (count != want.recv_count[l])
      m.add("recv_count[", l, "] = ", count, ", expected ", want.recv_count[l]);
    for (int s = 0; s < R; ++s) {
      const int64_t v = at<int64_t>(got.handle.layout_range, {l, s});
      const int64_t w = want.layout_range[l * R + s];
      if (v != w)
        m.add("layout_range[", l, "][", s, "] = (", v >> 32, ", ", v & 0xFFFFFFFF, "), expected (",
              w >> 32, ", ", w & 0xFFFFFFFF, ")");
    }
    for (int64_t row = 0; row < want.recv_count[l]; ++row) {
      const int32_t src = at<int32_t>(got.handle.src_info, {l, row});
      if (src != want.src_info[l * RT + row])
        m.add("src_info[", l, "][", row, "] = ", src, ", expected ", want.src_info[l * RT + row]);
      if (p.use_nvfp4) {
        check_nvfp4_row(p, want, got, l, row, m);
        continue;
      }
      for (int64_t c = 0; c < H; ++c) {
        if (p.use_fp8) {
          const uint8_t v = at<uint8_t>(got.recv_x, {l, row, c});
          const uint8_t w = want.recv_x[(l * RT + row) * H + c];
          if (v != w)
            m.add("recv_x[", l, "][", row, "][", c, "] = 0x", std::hex, int{v}, ", expected 0x",
                  int{w}, std::dec);
        } else {
          const uint16_t v = at<uint16_t>(got.recv_x, {l, row, c});
          uint16_t w;
          std::memcpy(&w, &want.recv_x[((l * RT + row) * H + c) * 2], 2);
          if (v != w)
            m.add("recv_x[", l, "][", row, "][", c, "] = 0x", std::hex, v, ", expected 0x", w,
                  std::dec);
        }
      }
      if (p.use_fp8 && !p.use_ue8m0) {
        for (int64_t g = 0; g < G; ++g) {
          const float v = at<float>(got.recv_scales, {l, row, g});
          const float w = want.recv_scales[(l * RT + row) * G + g];
          if (std::memcmp(&v, &w, 4) != 0)
            m.add("recv_scales[", l, "][", row, "][", g, "] = ", v, ", expected ", w);
        }
      } else if (p.use_fp8) {
        for (int64_t g = 0; g < packed; ++g) {
          const int32_t v = at<int32_t>(got.recv_scales, {l, row, g});
          const int32_t w = want.recv_packed[(l * RT + row) * packed + g];
          if (v != w)
            m.add("recv_scales[", l, "][", row, "][", g, "] = 0x", std::hex, v, ", expected 0x", w,
                  std::dec);
        }
      }
    }
  }
  return m.report();
}

std::string check_ll_combine(const LlProblem& p, const std::vector<uint16_t>& want,
                             const TensorView& out) {
  const int64_t H = p.hidden, T = static_cast<int64_t>(want.size()) / H;
  if (out.dtype != DType::kBF16 || !shape_is(out, {T, H}))
    return "out is " + out.describe() + detail::cat(", expected bf16[", T, ", ", H, "]");
  Mismatches m;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < H; ++c) {
      const uint16_t v = at<uint16_t>(out, {t, c});
      if (v != want[t * H + c])
        m.add("out[", t, "][", c, "] = ", detail::bf16_to_f32(v), " (0x", std::hex, v,
              "), expected ", detail::bf16_to_f32(want[t * H + c]), " (0x", want[t * H + c], ")",
              std::dec);
    }
  }
  return m.report();
}

}  // namespace epx::testing
