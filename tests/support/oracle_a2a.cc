// tests/support/oracle_a2a.cc — the naive a2a oracle: docs/semantics.md §3 as plain loops.
//
// Dispatch, for receiving rank r: for every source rank s ascending, walk s's tokens in index
// order; a token is "sent to r" when any of its K expert ids e >= 0 has e / (E / R) == r; the j-th
// such token fills row [s][j] of every payload. Padding rows j >= count are defined only for the
// expert-id payload with invalid_expert_id (all K entries = invalid_expert_id).
// Combine, for source rank r and its token t: acc = 0.0f, then for every rank d ascending that t
// was sent to, acc += y_d[r][slot][h] where slot = how many of r's tokens before t were sent to d;
// the result is rounded once to the combine dtype (bf16, f16: nearest, ties to even; numeric.h's
// roundings, which tests/unit/numeric_test.cc checks against references of its own).
// Rank mask (p.active): a token of s reaches r only when both are active and some valid id of the
// token is on r; so inactive sources send nothing (recv_counts 0, all padding) and combine sums
// active destinations only. Drops, for the caller's tokens: every valid id on an inactive rank is a
// dropped selection; a token with valid ids, none on an active rank, is a dropped token.
#include "support/oracle_a2a.h"

#include <cstring>
#include <sstream>
#include <utility>

#include "core/numeric.h"

namespace epx::testing {

int64_t A2aPayloadSpec::row_elems() const {
  int64_t n = 1;
  for (int64_t d : row_shape) n *= d;
  return n;
}

size_t A2aPayloadSpec::row_bytes() const {
  return static_cast<size_t>(row_elems()) * dtype_size(dtype);
}

size_t A2aProblem::combine_elem_bytes() const {
  return dtype_size(combine_dtype);
}

A2aShape A2aProblem::shape() const {
  A2aShape s;
  s.max_tokens_per_rank = max_tokens_per_rank;
  s.top_k = top_k;
  s.num_experts = num_experts;
  s.payload_bytes_per_token = payload_bytes_per_token;
  if (s.payload_bytes_per_token.empty())
    for (const auto& spec : payloads) s.payload_bytes_per_token.push_back(spec.row_bytes());
  s.combine_bytes_per_token = combine_bytes_per_token != 0
                                  ? combine_bytes_per_token
                                  : static_cast<size_t>(hidden) * combine_elem_bytes();
  return s;
}

void fill_a2a_inputs(A2aProblem& p, const std::vector<Routing>& routing, std::mt19937_64& rng) {
  const int R = p.num_ranks, K = p.top_k;
  const int64_t M = p.runtime_max, H = p.hidden;
  p.topk_idx.assign(R, {});
  p.payload.assign(R, {});
  p.combine_y.assign(R, {});
  for (int rank = 0; rank < R; ++rank) {
    const int64_t T = p.num_tokens[rank];
    const int target = std::uniform_int_distribution<int>(0, p.num_experts - 1)(rng);
    std::vector<int64_t> idx64 = make_topk_idx(routing[rank], T, K, p.num_experts, R, rng, target);
    std::vector<float> weights = make_topk_weights(idx64, rng);
    p.topk_idx[rank].assign(idx64.begin(), idx64.end());
    for (const A2aPayloadSpec& spec : p.payloads) {
      std::vector<uint8_t> bytes(T * spec.row_bytes());
      if (spec.fill == A2aPayloadSpec::Fill::kExpertIds) {
        for (int64_t i = 0; i < T * K; ++i) {
          int32_t v = static_cast<int32_t>(idx64[i]);
          std::memcpy(bytes.data() + i * 4, &v, 4);
        }
      } else if (spec.fill == A2aPayloadSpec::Fill::kWeights) {
        // T = 0 gives empty vectors whose data() may be null: memcpy must not see them.
        if (!bytes.empty()) std::memcpy(bytes.data(), weights.data(), bytes.size());
      } else {
        bytes = make_bytes(bytes.size(), rng);
      }
      p.payload[rank].push_back(std::move(bytes));
    }
    // y of this rank: [R, M, H], values in every row. bf16, f32: finite; f16: the whole format
    // (make_f16: sums that overflow, subnormals, rarely inf and NaN).
    std::vector<uint8_t> y(static_cast<size_t>(R * M * H) * p.combine_elem_bytes());
    const std::vector<uint16_t> b =
        p.combine_dtype == DType::kF16 ? make_f16(R * M, H, rng) : make_bf16(R * M, H, rng);
    if (p.combine_dtype != DType::kF32) {
      if (!y.empty()) std::memcpy(y.data(), b.data(), y.size());  // M = 0: no rows
    } else {
      std::uniform_int_distribution<int> low(0, 0xFFFF);
      for (size_t i = 0; i < b.size(); ++i) {
        // A bf16 value with random low mantissa bits: an ordinary f32.
        uint32_t bits = (static_cast<uint32_t>(b[i]) << 16) | static_cast<uint32_t>(low(rng));
        std::memcpy(y.data() + i * 4, &bits, 4);
      }
    }
    p.combine_y[rank] = std::move(y);
  }
}

namespace {

// Does token t of rank `src` go to rank `dst`?
bool goes_to(const A2aProblem& p, int src, int64_t t, int dst) {
  const int local_experts = p.num_experts / p.num_ranks;
  for (int k = 0; k < p.top_k; ++k) {
    const int32_t e = p.topk_idx[src][t * p.top_k + k];
    if (e >= 0 && e / local_experts == dst) return true;
  }
  return false;
}

bool is_active(const A2aProblem& p, int rank) {
  return p.active.empty() || p.active[rank];
}

// Does token t of `src` reach `dst` under the mask?
bool delivered(const A2aProblem& p, int src, int64_t t, int dst) {
  return is_active(p, src) && is_active(p, dst) && goes_to(p, src, t, dst);
}

float load(const uint8_t* base, int64_t index, DType dtype) {
  if (dtype != DType::kF32) {
    uint16_t v;
    std::memcpy(&v, base + index * 2, 2);
    return dtype == DType::kBF16 ? detail::bf16_to_f32(v) : detail::f16_to_f32(v);
  }
  float v;
  std::memcpy(&v, base + index * 4, 4);
  return v;
}

}  // namespace

A2aExpected a2a_oracle(const A2aProblem& p, int r) {
  const int R = p.num_ranks;
  const int64_t M = p.runtime_max, H = p.hidden;
  const size_t P = p.payloads.size();
  A2aExpected ex;
  ex.recv_counts.assign(R, 0);
  for (size_t i = 0; i < P; ++i) {
    ex.recv.emplace_back(static_cast<size_t>(R * M) * p.payloads[i].row_bytes(), 0);
    ex.row_specified.emplace_back(static_cast<size_t>(R * M), 0);
  }

  // Dispatch: what r receives.
  for (int s = 0; s < R; ++s) {
    int64_t j = 0;
    for (int64_t t = 0; t < p.num_tokens[s]; ++t) {
      if (!delivered(p, s, t, r)) continue;
      for (size_t i = 0; i < P; ++i) {
        const size_t rb = p.payloads[i].row_bytes();
        for (size_t b = 0; b < rb; ++b)
          ex.recv[i][(s * M + j) * rb + b] = p.payload[s][i][t * rb + b];
        ex.row_specified[i][s * M + j] = 1;
      }
      ++j;
    }
    ex.recv_counts[s] = static_cast<int32_t>(j);
    if (p.invalid_expert_id.has_value()) {
      const int i = p.expert_id_payload_index;
      for (int64_t pad = j; pad < M; ++pad) {
        for (int k = 0; k < p.top_k; ++k) {
          const int32_t v = *p.invalid_expert_id;
          std::memcpy(ex.recv[i].data() + ((s * M + pad) * p.top_k + k) * 4, &v, 4);
        }
        ex.row_specified[i][s * M + pad] = 1;
      }
    }
  }

  // Combine: what r gets back for each of its tokens.
  const size_t elem = p.combine_elem_bytes();
  const int64_t T = p.num_tokens[r];
  ex.combine_out.assign(static_cast<size_t>(T * H) * elem, 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<int, int64_t>> sent;  // (d, slot_d(t)), d ascending
    for (int d = 0; d < R; ++d) {
      if (!delivered(p, r, t, d)) continue;
      int64_t slot = 0;
      for (int64_t u = 0; u < t; ++u) slot += delivered(p, r, u, d) ? 1 : 0;
      sent.emplace_back(d, slot);
    }
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (const auto& [d, slot] : sent)
        acc += load(p.combine_y[d].data(), (r * M + slot) * H + h, p.combine_dtype);
      if (p.combine_dtype != DType::kF32) {
        const uint16_t v =
            p.combine_dtype == DType::kBF16 ? detail::f32_to_bf16(acc) : detail::f32_to_f16(acc);
        std::memcpy(ex.combine_out.data() + (t * H + h) * 2, &v, 2);
      } else {
        std::memcpy(ex.combine_out.data() + (t * H + h) * 4, &acc, 4);
      }
    }
  }
  // Drops of r's tokens.
  const int local_experts = p.num_experts / R;
  for (int64_t t = 0; t < T; ++t) {
    bool any_valid = false, any_active = false;
    for (int k = 0; k < p.top_k; ++k) {
      const int32_t e = p.topk_idx[r][t * p.top_k + k];
      if (e < 0) continue;
      any_valid = true;
      if (is_active(p, e / local_experts)) {
        any_active = true;
      } else {
        ++ex.dropped.selections;
      }
    }
    if (any_valid && !any_active) ++ex.dropped.tokens;
  }
  return ex;
}

std::vector<bool> random_active_mask(int num_ranks, int rank, std::mt19937_64& rng) {
  std::vector<bool> active(num_ranks);
  for (int p = 0; p < num_ranks; ++p) active[p] = p == rank || rng() % 2 == 0;
  return active;
}

namespace {

std::string shape_of(const TensorView& v) {
  std::string s = std::string(dtype_name(v.dtype)) + "[";
  for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.shape[i]);
  return s + "]";
}

std::string expect_view(const TensorView& v, DType dtype, const std::vector<int64_t>& dims) {
  // An empty view counts as contiguous whatever its strides (as in PyTorch).
  const bool contiguous = v.numel() == 0 || v.is_contiguous();
  bool ok = v.dtype == dtype && v.ndim == static_cast<int>(dims.size()) && contiguous &&
            v.device == Device::cpu();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = v.shape[i] == dims[i];
  if (ok) return "";
  TensorView want;
  want.dtype = dtype;
  want.ndim = static_cast<int>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) want.shape[i] = dims[i];
  return "got " + shape_of(v) + (contiguous ? "" : " (not contiguous)") + ", expected " +
         shape_of(want) + " contiguous on cpu";
}

std::string hex_row(const uint8_t* p, size_t n) {
  std::ostringstream os;
  os << std::hex;
  for (size_t i = 0; i < n && i < 16; ++i) os << (i ? " " : "") << static_cast<int>(p[i]);
  if (n > 16) os << " ...";
  return os.str();
}

size_t first_diff(const uint8_t* a, const uint8_t* b, size_t n) {
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

std::string a2a_compare_dispatch(const A2aProblem& p, int r, const A2aExpected& ex,
                                 const A2aDispatchResult& actual, bool check_unspecified_zero,
                                 int max_reports) {
  const int R = p.num_ranks;
  const int64_t M = p.runtime_max;
  std::ostringstream os;
  int64_t bad = 0;
  auto report = [&](const std::string& what) {
    if (bad++ < max_reports) os << "  rank " << r << ": " << what << "\n";
  };  // one call per mismatching count or row
  if (std::string e = expect_view(actual.recv_counts, DType::kI32, {R}); !e.empty()) {
    report("recv_counts " + e);
  } else {
    for (int s = 0; s < R; ++s)
      if (actual.recv_counts.ptr<int32_t>()[s] != ex.recv_counts[s])
        report("recv_counts[" + std::to_string(s) +
               "] = " + std::to_string(actual.recv_counts.ptr<int32_t>()[s]) + ", expected " +
               std::to_string(ex.recv_counts[s]));
  }
  if (actual.recv.size() != p.payloads.size()) {
    report("recv has " + std::to_string(actual.recv.size()) + " views, expected " +
           std::to_string(p.payloads.size()));
  } else {
    for (size_t i = 0; i < p.payloads.size(); ++i) {
      const A2aPayloadSpec& spec = p.payloads[i];
      std::vector<int64_t> dims = {R, M};
      dims.insert(dims.end(), spec.row_shape.begin(), spec.row_shape.end());
      if (std::string e = expect_view(actual.recv[i], spec.dtype, dims); !e.empty()) {
        report("recv[" + std::to_string(i) + "] " + e);
        continue;
      }
      const size_t rb = spec.row_bytes();
      const auto* got = static_cast<const uint8_t*>(actual.recv[i].data);
      for (int s = 0; s < R; ++s) {
        for (int64_t j = 0; j < M; ++j) {
          const size_t row = static_cast<size_t>(s * M + j);
          if (!ex.row_specified[i][row] && !check_unspecified_zero) continue;
          const uint8_t* g = got + row * rb;
          const uint8_t* w = ex.recv[i].data() + row * rb;
          if (std::memcmp(g, w, rb) == 0) continue;
          report("recv[" + std::to_string(i) + "][" + std::to_string(s) + "][" + std::to_string(j) +
                 "] (" +
                 (j < ex.recv_counts[s]      ? "valid row"
                  : ex.row_specified[i][row] ? "sanitised padding"
                                             : "padding, cpu zeroes") +
                 "): first difference at byte " + std::to_string(first_diff(g, w, rb)) +
                 ", row = " + hex_row(g, rb) + ", expected " + hex_row(w, rb));
        }
      }
    }
  }
  if (bad == 0) return "";
  os << "  rank " << r << ": " << bad << " mismatching recv_counts entries or rows in dispatch";
  return os.str();
}

std::string a2a_compare_combine(const A2aProblem& p, int r, const A2aExpected& ex,
                                const TensorView& out, int max_reports) {
  const int64_t T = p.num_tokens[r], H = p.hidden;
  if (std::string e = expect_view(out, p.combine_dtype, {T, H}); !e.empty())
    return "  rank " + std::to_string(r) + ": combine out " + e;
  std::ostringstream os;
  int64_t bad = 0;
  const size_t elem = p.combine_elem_bytes();
  const auto* got = static_cast<const uint8_t*>(out.data);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const size_t at = static_cast<size_t>(t * H + h) * elem;
      if (std::memcmp(got + at, ex.combine_out.data() + at, elem) == 0) continue;
      if (bad++ < max_reports)
        os << "  rank " << r << ": out[" << t << "][" << h
           << "] = " << load(got, t * H + h, p.combine_dtype) << " (" << hex_row(got + at, elem)
           << "), expected " << load(ex.combine_out.data(), t * H + h, p.combine_dtype) << " ("
           << hex_row(ex.combine_out.data() + at, elem) << ")\n";
    }
  }
  if (bad == 0) return "";
  os << "  rank " << r << ": " << bad << " of " << T * H << " combine outputs differ";
  return os.str();
}

}  // namespace epx::testing
