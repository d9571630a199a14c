// CPU tier: the host logic around dispatch quantisation that the cuda path mirrors —
// narrow_topk_idx (int64/int32, out-of-int32 ids, strided views), the UE8M0 scale layouts
// (column-major TMA-aligned vs row-major: same words, every padding byte 0; the row-major ->
// column-major re-layout of ht's received words equals the quantiser's), ExpertLoad's host
// counter against a count written here (local ids, a2a global ids with counts, ll counts, reset),
// and the Dispatcher's a2a path on the cpu backend: every received row of every source equals the
// quantisation of the source's row, the routing payload is the narrowed ids, and the expert load
// equals the routing's count; nvfp4_block_scale_interleave on hand-made positions (FlashInfer's
// worked example) and on every element of batched, strided inputs of every dtype.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <vector>

#include "core/expert_load.h"
#include "core/quant.h"
#include "epx/epx.h"
#include "support/harness.h"
#include "support/routing.h"

namespace epx {
namespace {

TEST(NarrowTopk, NarrowsEveryLayoutAndMarksOutOfRangeIds) {
  std::mt19937_64 rng(3);
  const int64_t T = 37, K = 5;
  std::vector<int64_t> storage(T * (K + 3));
  for (auto& v : storage) {
    const int pick = static_cast<int>(rng() % 8);
    v = pick == 0   ? (int64_t{1} << 32) + 2  // would alias expert 2 if truncated
        : pick == 1 ? -(int64_t{1} << 35)
        : pick == 2 ? int64_t{std::numeric_limits<int32_t>::max()}
                    : static_cast<int64_t>(rng() % 40) - 1;
  }
  auto want_of = [](int64_t v) -> int32_t {
    return v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()
               ? std::numeric_limits<int32_t>::min()
               : static_cast<int32_t>(v);
  };
  // Strided rows (row stride K + 3), then transposed (view [T, K] of storage [K, T]).
  for (int variant = 0; variant < 2; ++variant) {
    TensorView v = TensorView::contiguous(storage.data(), DType::kI64, {T, K});
    v.strides = variant == 0 ? std::array<int64_t, kMaxDims>{K + 3, 1}
                             : std::array<int64_t, kMaxDims>{1, T};
    const Tensor got = detail::narrow_topk_idx(v, default_allocator());
    ASSERT_EQ(got.dtype, DType::kI32);
    ASSERT_TRUE(got.is_contiguous());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        ASSERT_EQ(got.ptr<int32_t>()[t * K + k],
                  want_of(storage[t * v.strides[0] + k * v.strides[1]]))
            << "variant " << variant << " t " << t << " k " << k;
  }
  std::vector<int32_t> s32(T * K);
  for (auto& v : s32) v = static_cast<int32_t>(rng());
  const Tensor got32 = detail::narrow_topk_idx(
      TensorView::contiguous(s32.data(), DType::kI32, {T, K}), default_allocator());
  EXPECT_EQ(std::memcmp(got32.data, s32.data(), s32.size() * 4), 0);
  try {
    std::vector<float> f(T * K);
    detail::narrow_topk_idx(TensorView::contiguous(f.data(), DType::kF32, {T, K}),
                            default_allocator());
    FAIL() << "float ids accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
  }
}

// Also: ue8m0_to_column_major (what the Dispatcher's ht path applies to the received row-major
// words) equals the quantiser's own column-major output, every storage byte (padding tokens 0
// although the allocator poisons), from contiguous, padded-row and transposed words.
TEST(QuantLayouts, Ue8m0RowMajorAndColumnMajorHoldTheSameWords) {
  std::mt19937_64 rng(5);
  for (int64_t T : {0, 1, 3, 4, 5, 6, 33})
    for (int64_t H : {128, 640, 1024}) {
      const int64_t G = H / 128, W = (G + 3) / 4, padded = (T + 3) / 4 * 4;
      std::vector<uint16_t> x = testing::make_bf16(T, H, rng);
      const TensorView xv = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
      const detail::QuantizedTensor col = detail::quantize_fp8(xv, true, default_allocator());
      const detail::QuantizedTensor row = detail::quantize_fp8(
          xv, true, default_allocator(), nullptr, detail::Ue8m0Layout::kRowMajor);
      ASSERT_EQ(col.scales.strides[0], 1);
      ASSERT_EQ(col.scales.strides[1], padded);
      ASSERT_EQ(row.scales.strides[0], W);
      ASSERT_EQ(row.scales.strides[1], 1);
      ASSERT_EQ(std::memcmp(col.values.data, row.values.data, col.values.nbytes()), 0);
      std::vector<float> scales(G);
      std::vector<uint8_t> q(H);
      for (int64_t t = 0; t < padded; ++t)
        for (int64_t w = 0; w < W; ++w) {
          uint8_t want[4] = {0, 0, 0, 0};  // padding tokens and groups >= G are 0
          if (t < T) {
            detail::quantize_row_fp8(x.data() + t * H, H, true, q.data(), scales.data());
            for (int i = 0; i < 4 && 4 * w + i < G; ++i)
              want[i] = detail::ue8m0_of_scale(scales[4 * w + i]);
          }
          uint8_t got_col[4];
          std::memcpy(got_col, col.scales.ptr<int32_t>() + t + w * padded, 4);
          ASSERT_EQ(std::memcmp(got_col, want, 4), 0) << "T " << T << " H " << H << " t " << t;
          if (t < T) {
            ASSERT_EQ(std::memcmp(row.scales.ptr<int32_t>() + t * W + w, want, 4), 0)
                << "T " << T << " H " << H << " t " << t;
          }
        }
      // The row-major words re-laid: contiguous, rows padded to W + 3, transposed.
      std::vector<int32_t> padded_rows(static_cast<size_t>(T * (W + 3)), -1);
      std::vector<int32_t> transposed(static_cast<size_t>(T * W), -1);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t w = 0; w < W; ++w) {
          padded_rows[t * (W + 3) + w] = row.scales.ptr<int32_t>()[t * W + w];
          transposed[w * T + t] = row.scales.ptr<int32_t>()[t * W + w];
        }
      TensorView pv = TensorView::contiguous(padded_rows.data(), DType::kI32, {T, W});
      pv.strides = {W + 3, 1};
      TensorView tv = TensorView::contiguous(transposed.data(), DType::kI32, {T, W});
      tv.strides = {1, T};
      for (const TensorView& in : {static_cast<const TensorView&>(row.scales), pv, tv}) {
        const Tensor got = detail::ue8m0_to_column_major(in, testing::poison_allocator(0xAB));
        ASSERT_EQ(got.dtype, DType::kI32);
        ASSERT_EQ(got.shape, col.scales.shape);
        ASSERT_EQ(got.strides, col.scales.strides);
        if (W * padded > 0)
          ASSERT_EQ(std::memcmp(got.data, col.scales.data, static_cast<size_t>(W * padded) * 4), 0)
              << "T " << T << " H " << H << " input strides " << in.strides[0] << ","
              << in.strides[1];
      }
    }
  try {
    std::vector<float> f(8);
    detail::ue8m0_to_column_major(TensorView::contiguous(f.data(), DType::kF32, {4, 2}),
                                  default_allocator());
    FAIL() << "float words accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("words"), std::string::npos) << e.what();
  }
}

// Per row, each distinct local id in [0, L) once.
void oracle_add(std::vector<int64_t>& load, const std::vector<int64_t>& row) {
  std::set<int64_t> seen;
  for (int64_t l : row)
    if (l >= 0 && l < static_cast<int64_t>(load.size()) && seen.insert(l).second) ++load[l];
}

TEST(ExpertLoadHost, CountsDistinctLocalExpertsPerRow) {
  std::mt19937_64 rng(9);
  const int L = 6;
  detail::ExpertLoad load(L);
  std::vector<int64_t> want(L, 0);
  for (int round = 0; round < 3; ++round) {
    // ht: local ids [rows, K] (int64 with padded rows, then int32), duplicates, -1, out of range.
    const int64_t rows = 50, K = 4, stride = K + 2;
    std::vector<int64_t> ids(rows * stride, 99);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int64_t> row;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t v =
            (k > 0 && rng() % 3 == 0) ? row.back() : static_cast<int64_t>(rng() % (L + 3)) - 2;
        row.push_back(v);
        ids[r * stride + k] = v;
      }
      oracle_add(want, row);
      oracle_add(want, row);  // counted again below as int32
    }
    TensorView v = TensorView::contiguous(ids.data(), DType::kI64, {rows, K});
    v.strides = {stride, 1};
    load.add_local_ids(v, nullptr);
    std::vector<int32_t> ids32;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) ids32.push_back(static_cast<int32_t>(ids[r * stride + k]));
    load.add_local_ids(TensorView::contiguous(ids32.data(), DType::kI32, {rows, K}), nullptr);
    EXPECT_EQ(load.read(nullptr), want) << "local ids, round " << round;

    // a2a: global ids [R, M, K] with counts; rows past the counts hold garbage, not -1.
    const int R = 3, rank = round % R;
    const int64_t M = 9;
    std::vector<int32_t> g(R * M * K);
    std::vector<int32_t> counts(R);
    for (int s = 0; s < R; ++s) {
      counts[s] = static_cast<int32_t>(rng() % (M + 1));
      for (int64_t j = 0; j < M; ++j) {
        std::vector<int64_t> local;
        for (int64_t k = 0; k < K; ++k) {
          const int32_t id = (k > 0 && rng() % 3 == 0)
                                 ? g[(s * M + j) * K + k - 1]
                                 : static_cast<int32_t>(rng() % (R * L + 1)) - 1;
          g[(s * M + j) * K + k] = id;
          local.push_back(id >= 0 && id / L == rank ? id % L : -1);
        }
        if (j < counts[s]) oracle_add(want, local);
      }
    }
    load.add_global_ids(TensorView::contiguous(g.data(), DType::kI32, {R, M, K}),
                        TensorView::contiguous(counts.data(), DType::kI32, {R}), rank, nullptr);
    EXPECT_EQ(load.read(nullptr), want) << "global ids, round " << round;

    // ll: recv_count [L].
    std::vector<int32_t> c(L);
    for (int l = 0; l < L; ++l) want[l] += c[l] = static_cast<int32_t>(rng() % 100);
    load.add_counts(TensorView::contiguous(c.data(), DType::kI32, {L}), nullptr);
    EXPECT_EQ(load.read(nullptr), want) << "counts, round " << round;
    if (round == 1) {
      load.reset(nullptr);
      std::fill(want.begin(), want.end(), 0);
      EXPECT_EQ(load.read(nullptr), want);
    }
  }
}

// The Dispatcher's a2a path on the cpu backend, for every quantisation.
TEST(DispatcherA2aCpu, ReceivedRowsAreTheSourcesQuantisedRows) {
  const int R = 2, E = 8, K = 3, L = E / R;
  const int64_t H = 640, M = 16;
  for (DispatchQuant quant : {DispatchQuant::kBf16, DispatchQuant::kFp8, DispatchQuant::kFp8Ue8m0,
                              DispatchQuant::kNvfp4}) {
    std::vector<std::vector<uint16_t>> xs(R);
    std::vector<std::vector<int64_t>> idx(R);
    std::vector<std::vector<float>> ws(R);
    std::vector<int64_t> Ts(R);
    for (int r = 0; r < R; ++r) {
      std::mt19937_64 rng(40 + r + 10 * static_cast<int>(quant));
      Ts[r] = r == 1 && quant == DispatchQuant::kFp8 ? 0 : 5 + 4 * r;
      xs[r] = testing::make_bf16(Ts[r], H, rng);
      idx[r] = testing::make_topk_idx(testing::Routing::kDuplicates, Ts[r], K, E, R, rng);
      ws[r] = testing::make_topk_weights(idx[r], rng);
    }
    const float gscale = 2.5f;
    testing::run_threads(R, [&](const Group& g) {
      const int me = g.rank();
      DispatcherConfig c;
      c.num_experts = E;
      c.hidden = H;
      c.top_k = K;
      c.max_tokens_per_rank = M;
      c.backend = DispatcherBackend::kA2a;
      c.mode = DispatchMode::kNormal;
      c.quant = quant;
      Dispatcher d(g, c);
      const TensorView xv = TensorView::contiguous(xs[me].data(), DType::kBF16, {Ts[me], H});
      const TensorView iv = TensorView::contiguous(idx[me].data(), DType::kI64, {Ts[me], K});
      const TensorView wv = TensorView::contiguous(ws[me].data(), DType::kF32, {Ts[me], K});
      const DispatchOutput out = d.dispatch(xv, iv, wv, ForwardMode::kExtend, gscale);
      ASSERT_EQ(out.format, OutputFormat::kA2a);
      std::vector<int64_t> want_load(L, 0);
      for (int s = 0; s < R; ++s) {
        // Source s's tokens that go to `me`, in order, quantised on the host directly.
        std::vector<int64_t> sent;
        for (int64_t t = 0; t < Ts[s]; ++t) {
          std::vector<int64_t> local;
          for (int k = 0; k < K; ++k) {
            const int64_t e = idx[s][t * K + k];
            local.push_back(e >= 0 && e / L == me ? e % L : -1);
          }
          if (*std::max_element(local.begin(), local.end()) >= 0) {
            sent.push_back(t);
            oracle_add(want_load, local);
          }
        }
        for (size_t j = 0; j < sent.size(); ++j) {
          const uint16_t* src = xs[s].data() + sent[j] * H;
          const int64_t row = s * M + static_cast<int64_t>(j);
          const std::string where = std::string(dispatch_quant_name(quant)) + " rank " +
                                    std::to_string(me) + " from " + std::to_string(s) + " row " +
                                    std::to_string(j);
          if (quant == DispatchQuant::kBf16) {
            ASSERT_EQ(std::memcmp(out.x.ptr<uint16_t>() + row * H, src, H * 2), 0) << where;
          } else if (quant == DispatchQuant::kNvfp4) {
            std::vector<uint8_t> q(H / 2), sf(H / 16);
            detail::quantize_row_nvfp4(src, H, gscale, q.data(), sf.data());
            ASSERT_EQ(std::memcmp(out.x.ptr<uint8_t>() + row * (H / 2), q.data(), H / 2), 0)
                << where;
            ASSERT_EQ(std::memcmp(out.x_scale.ptr<uint8_t>() + row * (H / 16), sf.data(), H / 16),
                      0)
                << where;
          } else {
            const bool ue8m0 = quant == DispatchQuant::kFp8Ue8m0;
            const int64_t G = H / 128, W = (G + 3) / 4;
            std::vector<uint8_t> q(H);
            std::vector<float> scales(G);
            detail::quantize_row_fp8(src, H, ue8m0, q.data(), scales.data());
            ASSERT_EQ(std::memcmp(out.x.ptr<uint8_t>() + row * H, q.data(), H), 0) << where;
            if (!ue8m0) {
              ASSERT_EQ(std::memcmp(out.x_scale.ptr<float>() + row * G, scales.data(), G * 4), 0)
                  << where;
            } else {
              std::vector<uint8_t> words(W * 4, 0);
              for (int64_t gi = 0; gi < G; ++gi) words[gi] = detail::ue8m0_of_scale(scales[gi]);
              ASSERT_EQ(std::memcmp(out.x_scale.ptr<int32_t>() + row * W, words.data(), W * 4), 0)
                  << where;
            }
          }
          for (int k = 0; k < K; ++k)
            ASSERT_EQ(out.topk_idx.ptr<int32_t>()[row * K + k], idx[s][sent[j] * K + k]) << where;
        }
        for (int64_t j = static_cast<int64_t>(sent.size()); j < M; ++j)
          for (int k = 0; k < K; ++k)
            ASSERT_EQ(out.topk_idx.ptr<int32_t>()[(s * M + j) * K + k], -1) << "padding row " << j;
      }
      EXPECT_EQ(d.expert_load(), want_load) << dispatch_quant_name(quant) << " rank " << me;
      Tensor y = default_allocator()(DType::kBF16, {R, M, H}, Device::cpu());
      std::memset(y.data, 0, y.nbytes());
      CombineInput ci;
      ci.y = y;
      d.combine(ci);
    });
  }
}

// ---- nvfp4_block_scale_interleave (epx/nvfp4.h) ---------------------------------------------

// The layout's offset written out here (docs/semantics.md §8), independent of core/quant.h.
int64_t interleaved_at(int64_t r, int64_t c, int64_t cols) {
  const int64_t cols4 = (cols + 3) / 4 * 4;
  return (r / 128) * 128 * cols4 + (c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4;
}

// FlashInfer's worked example: 130 x 5 -> 256 x 8 elements; hand-made positions.
TEST(Nvfp4Interleave, WorkedExample) {
  std::vector<uint8_t> sf(130 * 5);
  for (size_t i = 0; i < sf.size(); ++i) sf[i] = static_cast<uint8_t>(1 + i % 255);
  const Tensor out = nvfp4_block_scale_interleave(
      TensorView::contiguous(sf.data(), DType::kU8, {130, 5}), testing::poison_allocator(0xA5));
  ASSERT_EQ(out.ndim, 1);
  ASSERT_EQ(out.shape[0], 256 * 8);
  ASSERT_EQ(out.dtype, DType::kU8);
  const auto* o = out.ptr<uint8_t>();
  const std::vector<std::pair<std::pair<int, int>, int>> cases = {
      {{0, 0}, 0},   {{0, 3}, 3},   {{1, 0}, 16},        {{31, 2}, 31 * 16 + 2},
      {{32, 0}, 4},  {{64, 1}, 9},  {{96, 3}, 15},       {{127, 3}, 511},
      {{0, 4}, 512}, {{5, 4}, 592}, {{128, 0}, 128 * 8}, {{129, 4}, 1552}};
  for (const auto& [rc, pos] : cases) {
    const auto [r, c] = rc;
    EXPECT_EQ(pos, interleaved_at(r, c, 5));
    EXPECT_EQ(o[pos], sf[r * 5 + c]) << "(" << r << ", " << c << ") at " << pos;
  }
  int nonzero = 0;
  for (int64_t i = 0; i < out.shape[0]; ++i) nonzero += o[i] != 0;
  EXPECT_EQ(nonzero, 130 * 5);  // everything else is padding, written 0
}

// Every element of random batched, strided inputs of every dtype; the padding is 0.
TEST(Nvfp4Interleave, EveryElementOfEveryShape) {
  std::mt19937_64 rng(11);
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 1}, {128, 4}, {129, 3}, {300, 10}, {2, 127, 6}, {3, 33, 1}, {4, 0, 4}, {2, 256, 8}};
  for (const auto& shape : shapes) {
    for (DType dtype : {DType::kU8, DType::kF8E4M3, DType::kBF16}) {
      const bool batched = shape.size() == 3;
      const int64_t B = batched ? shape[0] : 1, rows = shape[shape.size() - 2], cols = shape.back();
      const size_t elem = dtype_size(dtype);
      // Strided: every other column of a [B, rows, 2 * cols] buffer.
      std::vector<uint8_t> buf(std::max<int64_t>(B * rows * 2 * cols, 1) * elem);
      for (auto& b : buf) b = static_cast<uint8_t>(rng() % 255 + 1);
      TensorView v = TensorView::contiguous(buf.data(), dtype, shape);
      v.strides[v.ndim - 1] = 2;
      v.strides[v.ndim - 2] = 2 * cols;
      if (batched) v.strides[0] = rows * 2 * cols;
      const Tensor out = nvfp4_block_scale_interleave(v);
      const int64_t per = (rows + 127) / 128 * 128 * ((cols + 3) / 4 * 4);
      ASSERT_EQ(out.shape[0], B * per) << v.describe();
      std::vector<bool> seen(static_cast<size_t>(B * per), false);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t at = b * per + interleaved_at(r, c, cols);
            seen[at] = true;
            ASSERT_EQ(
                std::memcmp(static_cast<const uint8_t*>(out.data) + at * elem,
                            buf.data() + (b * rows * 2 * cols + r * 2 * cols + 2 * c) * elem, elem),
                0)
                << v.describe() << " (" << b << ", " << r << ", " << c << ")";
          }
      for (int64_t i = 0; i < B * per; ++i)
        for (size_t k = 0; k < elem && !seen[i]; ++k)
          ASSERT_EQ(static_cast<const uint8_t*>(out.data)[i * elem + k], 0)
              << v.describe() << " padding " << i;
    }
  }
}

TEST(Nvfp4Interleave, CoordsInvertTheOffset) {
  for (int64_t cols : {4, 8, 448}) {
    const int64_t per = 256 * cols;
    for (int64_t o = 0; o < per; ++o) {
      int64_t r = 0, c = 0;
      detail::nvfp4_sf_coords(o, cols, &r, &c);
      ASSERT_EQ(detail::nvfp4_sf_offset(r, c, cols), o) << cols << " " << o;
      ASSERT_EQ(interleaved_at(r, c, cols), o);
    }
  }
}

TEST(Nvfp4Interleave, BadArguments) {
  std::vector<int32_t> words(16);
  auto expect_invalid = [](const TensorView& v, const char* needle) {
    try {
      nvfp4_block_scale_interleave(v);
      ADD_FAILURE() << "no error for " << v.describe();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid(TensorView::contiguous(words.data(), DType::kI32, {4, 4}), "'sf'");
  expect_invalid(TensorView::contiguous(words.data(), DType::kU8, {16}), "[rows, cols]");
  expect_invalid(TensorView::contiguous(words.data(), DType::kU8, {2, 2, 2, 2}), "[rows, cols]");
  expect_invalid(TensorView(), "'sf'");
}

#ifndef EPX_WITH_CUDA
// Without CUDA the cuda entry points are stubs: cuda tensors raise Unsupported, naming the op.
TEST(QuantNoCuda, CudaTensorsAreUnsupported) {
  const Allocator no_memory = [](DType dtype, const std::vector<int64_t>& shape, Device device) {
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    return t;
  };
  static uint64_t never_read[64];  // the stubs throw before any access
  const TensorView x = TensorView::contiguous(never_read, DType::kBF16, {2, 128}, Device::cuda(0));
  const TensorView ids = TensorView::contiguous(never_read, DType::kI64, {2, 4}, Device::cuda(0));
  const TensorView counts = TensorView::contiguous(never_read, DType::kI32, {3}, Device::cuda(0));
  const TensorView sf = TensorView::contiguous(never_read, DType::kU8, {2, 4}, Device::cuda(0));
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"quantize_fp8", [&] { detail::quantize_fp8(x, true, no_memory); }},
      {"quantize_nvfp4", [&] { detail::quantize_nvfp4(x, 1.0f, no_memory); }},
      {"narrow_topk_idx", [&] { detail::narrow_topk_idx(ids, no_memory); }},
      {"nvfp4_block_scale_interleave", [&] { nvfp4_block_scale_interleave(sf, no_memory); }},
      {"without CUDA", [&] { detail::ExpertLoad(3).add_counts(counts, nullptr); }},
  };
  for (const auto& [op, call] : calls) {
    try {
      call();
      ADD_FAILURE() << op << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find(op), std::string::npos) << e.what();
    }
  }
}
#endif

}  // namespace
}  // namespace epx
