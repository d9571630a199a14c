// Dispatcher: stage machine, auto mode switching, hooks, expert-load recording, ht UE8M0 scale
// layout (MN-major, TMA-aligned; values against a float64 reference), quantisation error bounds
// (against a float64 reference) — cpu backend.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>

#include "core/numeric.h"
#include "core/quant.h"
#include "epx/epx.h"
#include "support/harness.h"
#include "support/routing.h"

namespace epx {
namespace {

using detail::bf16_to_f32;

struct Inputs {
  std::vector<uint16_t> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  TensorView xv, iv, wv;
};

Inputs make_inputs(int64_t T, int64_t H, int K, int E, int R, uint64_t seed,
                   testing::Routing routing = testing::Routing::kUniform) {
  std::mt19937_64 rng(seed);
  Inputs in;
  in.x = testing::make_bf16(T, H, rng);
  in.idx = testing::make_topk_idx(routing, T, K, E, R, rng);
  in.w = testing::make_topk_weights(in.idx, rng);
  in.xv = TensorView::contiguous(in.x.data(), DType::kBF16, {T, H});
  in.iv = TensorView::contiguous(in.idx.data(), DType::kI64, {T, K});
  in.wv = TensorView::contiguous(in.w.data(), DType::kF32, {T, K});
  return in;
}

DispatcherConfig small_config(DispatchMode mode, DispatcherBackend backend = DispatcherBackend::kDeepEp) {
  DispatcherConfig c;
  c.num_experts = 8;
  c.hidden = 128;
  c.top_k = 3;
  c.max_tokens_per_rank = 32;
  c.mode = mode;
  c.backend = backend;
  return c;
}

void expect_stage_error(const std::function<void()>& f, const std::string& expected_stage) {
  try {
    f();
    FAIL() << "expected an out-of-order stage error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("expected stage " + expected_stage), std::string::npos)
        << e.what();
  }
}

TEST(Dispatcher, StageMachineRejectsOutOfOrderCalls) {
  testing::run_threads(1, [](const Group& g) {
    Dispatcher d(g, small_config(DispatchMode::kNormal));
    Inputs in = make_inputs(16, 128, 3, 8, 1, 1);
    expect_stage_error([&] { d.dispatch_b(); }, "after_dispatch_a");
    expect_stage_error([&] { d.combine_a({}); }, "after_dispatch_b");
    expect_stage_error([&] { d.combine_b(); }, "after_combine_a");
    d.dispatch_a(in.xv, in.iv, in.wv);
    EXPECT_STREQ(d.stage_name(), "after_dispatch_a");
    expect_stage_error([&] { d.dispatch_a(in.xv, in.iv, in.wv); }, "initial");
    expect_stage_error([&] { d.combine_b(); }, "after_combine_a");
    DispatchOutput out = d.dispatch_b();
    expect_stage_error([&] { d.dispatch_b(); }, "after_dispatch_a");
    CombineInput ci;
    ci.y = out.x;  // any [N, H] bf16
    d.combine_a(ci);
    expect_stage_error([&] { d.combine_a(ci); }, "after_dispatch_b");
    d.combine_b();
    EXPECT_STREQ(d.stage_name(), "initial");
  });
}

// Runs prefill and decode batches through an auto dispatcher and checks the chosen format, the
// hook order and the expert-load counts against the routing.
TEST(Dispatcher, AutoSwitchesBetweenHtAndLlAndRecordsLoad) {
  const int R = 2, E = 8, K = 3, L = E / R;
  std::mutex mu;
  std::vector<std::vector<int64_t>> all_idx(R * 6);
  testing::run_threads(R, [&](const Group& g) {
    Dispatcher d(g, small_config(DispatchMode::kAuto));
    int hook_calls = 0;
    d.register_hook([&] {
      EXPECT_STREQ(d.stage_name(), "after_dispatch_a");
      ++hook_calls;
    });
    std::vector<int64_t> expected(L, 0);
    const ForwardMode seq[] = {ForwardMode::kExtend, ForwardMode::kDecode, ForwardMode::kDecode,
                               ForwardMode::kExtend, ForwardMode::kDecode, ForwardMode::kExtend};
    for (int i = 0; i < 6; ++i) {
      const int64_t T = seq[i] == ForwardMode::kDecode ? 3 + g.rank() : 20 + 5 * g.rank();
      Inputs in = make_inputs(T, 128, K, E, R, 100 * i + g.rank(), testing::Routing::kDuplicates);
      {
        std::lock_guard<std::mutex> lock(mu);
        all_idx[i * R + g.rank()] = in.idx;
      }
      DispatchOutput out = d.dispatch(in.xv, in.iv, in.wv, seq[i]);
      EXPECT_EQ(out.format, seq[i] == ForwardMode::kDecode ? OutputFormat::kLl : OutputFormat::kHt);
      if (out.format == OutputFormat::kLl) {
        EXPECT_EQ(out.expected_m, (T * R * K + E) / E);
        CombineInput ci;
        Tensor y = default_allocator()(DType::kBF16, {L, out.x.shape[1], 128}, Device::cpu());
        std::memset(y.data, 0, y.nbytes());
        ci.y = y;
        d.combine(ci);
      } else {
        CombineInput ci;
        Tensor y = default_allocator()(DType::kBF16, {out.x.shape[0], 128}, Device::cpu());
        std::memset(y.data, 0, y.nbytes());
        ci.y = y;
        d.combine(ci);
      }
      g.barrier();
      // Expected load: tokens of every rank that selected each of my local experts (distinct).
      for (int src = 0; src < R; ++src) {
        std::vector<int64_t> idx;
        {
          std::lock_guard<std::mutex> lock(mu);
          idx = all_idx[i * R + src];
        }
        for (size_t t = 0; t < idx.size() / K; ++t)
          for (int l = 0; l < L; ++l) {
            bool sel = false;
            for (int k = 0; k < K; ++k) sel |= idx[t * K + k] == g.rank() * L + l;
            expected[l] += sel;
          }
      }
      g.barrier();
    }
    EXPECT_EQ(hook_calls, 6);
    EXPECT_EQ(d.expert_load(), expected);
    d.reset_expert_load();
    EXPECT_EQ(d.expert_load(), std::vector<int64_t>(L, 0));
  });
}

// ht_zero_copy: the same outputs, y written into moe_output_view (in place over x) and combined
// with y_in_output_view; without the option y_in_output_view is refused for ht.
TEST(Dispatcher, HtZeroCopyGivesTheSameResults) {
  const int R = 2, K = 3, E = 8;
  testing::run_threads(R, [&](const Group& g) {
    DispatcherConfig c = small_config(DispatchMode::kNormal);
    Dispatcher plain(g, c);
    c.ht_zero_copy = true;
    Dispatcher zc(g, c);
    Inputs in = make_inputs(20 + 3 * g.rank(), 128, K, E, R, 900 + g.rank());
    DispatchOutput want = plain.dispatch(in.xv, in.iv, in.wv, ForwardMode::kExtend);
    std::vector<uint16_t> want_x(static_cast<const uint16_t*>(want.x.data),
                                 static_cast<const uint16_t*>(want.x.data) + want.x.numel());
    CombineInput ci;
    ci.y = want.x;  // y = the received rows
    Tensor want_out = plain.combine(ci);
    DispatchOutput got = zc.dispatch(in.xv, in.iv, in.wv, ForwardMode::kExtend);
    ASSERT_EQ(got.x.shape, want.x.shape);
    EXPECT_EQ(std::memcmp(got.x.data, want_x.data(), want_x.size() * 2), 0);
    ASSERT_TRUE(got.moe_output_view.defined());
    ASSERT_EQ(got.moe_output_view.shape[0], want.x.shape[0]);
    if (got.x.numel() > 0) std::memcpy(got.moe_output_view.data, want_x.data(), want_x.size() * 2);
    CombineInput cz;
    cz.y_in_output_view = true;
    Tensor out = zc.combine(cz);
    ASSERT_EQ(out.nbytes(), want_out.nbytes());
    EXPECT_EQ(std::memcmp(out.data, want_out.data, out.nbytes()), 0);
    // Without ht_zero_copy there is no ht output view.
    plain.dispatch(in.xv, in.iv, in.wv, ForwardMode::kExtend);
    try {
      plain.combine_a(cz);
      ADD_FAILURE() << "y_in_output_view accepted without ht_zero_copy";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("ht_zero_copy"), std::string::npos) << e.what();
    }
  });
}

// Streams on the cpu backend: every stage accepts one and ignores it (the calls run on the calling
// thread, the results equal a run without streams); stage b, combine_a and expert_load default to
// the stream of the stage before (Dispatcher::stream()), a given one replaces it.
TEST(Dispatcher, CpuIgnoresStreamsAndStagesDefaultToThePreviousOne) {
  testing::run_threads(2, [](const Group& g) {
    const Stream s1 = reinterpret_cast<Stream>(uintptr_t{0x1000});
    const Stream s2 = reinterpret_cast<Stream>(uintptr_t{0x2000});
    Dispatcher with(g, small_config(DispatchMode::kAuto)), without(g, small_config(DispatchMode::kAuto));
    EXPECT_EQ(with.stream(), nullptr);
    for (ForwardMode fm : {ForwardMode::kDecode, ForwardMode::kExtend}) {
      Inputs in = make_inputs(5 + g.rank(), 128, 3, 8, 2, 40 + g.rank());
      with.dispatch_a(in.xv, in.iv, in.wv, fm, std::nullopt, s1);
      EXPECT_EQ(with.stream(), s1);
      DispatchOutput out = with.dispatch_b();  // stage b: dispatch_a's stream
      EXPECT_EQ(with.stream(), s1);
      DispatchOutput ref = without.dispatch(in.xv, in.iv, in.wv, fm);
      ASSERT_EQ(out.x.nbytes(), ref.x.nbytes());
      if (out.format == OutputFormat::kHt)  // ll rows past masked_m are unspecified
        EXPECT_EQ(std::memcmp(out.x.data, ref.x.data, out.x.nbytes()), 0);
      else
        EXPECT_EQ(std::memcmp(out.masked_m.data, ref.masked_m.data, out.masked_m.nbytes()), 0);
      const std::vector<int64_t> shape(out.x.shape.begin(), out.x.shape.begin() + out.x.ndim);
      Tensor y = default_allocator()(DType::kBF16, shape, Device::cpu());
      std::memcpy(y.data, out.x.data, y.nbytes());  // y = the received rows
      CombineInput ci;
      ci.y = y;
      if (fm == ForwardMode::kExtend) ci.stream = s2;  // else: the dispatch's
      with.combine_a(ci);
      EXPECT_EQ(with.stream(), fm == ForwardMode::kExtend ? s2 : s1);
      const Tensor got = with.combine_b(fm == ForwardMode::kDecode ? std::optional<Stream>(s2)
                                                                   : std::nullopt);
      EXPECT_EQ(with.stream(), s2);
      ci.stream.reset();
      const Tensor want = without.combine(ci);
      ASSERT_EQ(got.nbytes(), want.nbytes());
      EXPECT_EQ(std::memcmp(got.data, want.data, got.nbytes()), 0);
    }
    EXPECT_EQ(with.expert_load(s1), without.expert_load());
    with.reset_expert_load();
    EXPECT_EQ(with.expert_load(), std::vector<int64_t>(4, 0));
  });
}

TEST(Dispatcher, BadConfigurationsSayWhy) {
  testing::run_threads(2, [](const Group& g) {
    DispatcherConfig c = small_config(DispatchMode::kNormal);
    c.num_experts = 7;
    try {
      Dispatcher d(g, c);
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("'num_experts' is 7"), std::string::npos) << e.what();
    }
    c = small_config(DispatchMode::kNormal);
    c.quant = DispatchQuant::kNvfp4;
    try {
      Dispatcher d(g, c);
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    }
    c = small_config(DispatchMode::kLowLatency, DispatcherBackend::kA2a);
    EXPECT_THROW(Dispatcher(g, c), Error);
  });
}

// The a2a backend narrows expert ids to int32 on the host: they are validated first, so an int64
// id that would wrap to a valid expert (2^32 -> 0) or a topk_idx with too few rows is an error,
// not a silent re-route or an overread; nothing is sent and the stage stays initial.
TEST(Dispatcher, A2aValidatesTopkIdxBeforeNarrowingIt) {
  testing::run_threads(1, [](const Group& g) {
    Dispatcher d(g, small_config(DispatchMode::kNormal, DispatcherBackend::kA2a));
    Inputs in = make_inputs(4, 128, 3, 8, 1, 7);
    auto expect_invalid = [&](const TensorView& idx, const std::string& needle) {
      try {
        d.dispatch_a(in.xv, idx, in.wv);
        ADD_FAILURE() << "expected InvalidArgument naming " << needle;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      EXPECT_STREQ(d.stage_name(), "initial");
    };
    const int64_t saved = in.idx[5];
    in.idx[5] = int64_t{1} << 32;
    expect_invalid(in.iv, "has value 4294967296 at [1, 2]");
    in.idx[5] = saved;
    expect_invalid(TensorView::contiguous(in.idx.data(), DType::kI64, {3, 3}),
                   "argument 'topk_idx' has shape [3, 3], expected [4, 3]");
    // The same inputs, well formed, go through.
    DispatchOutput out = d.dispatch(in.xv, in.iv, in.wv);
    EXPECT_EQ(out.format, OutputFormat::kA2a);
  });
}

// ---- ht UE8M0 scales: the MN-major, TMA-aligned layout grouped GEMMs read --------------------

// The UE8M0 word (groups 4w .. 4w+3) of one bf16 row, from a float64 reference: scale =
// max(amax, 1e-4) / 448 rounded up to a power of two 2^e, byte = 127 + e; bytes of groups >= G
// are 0.
uint32_t reference_ue8m0_word(const uint16_t* row, int64_t H, int64_t w) {
  uint32_t word = 0;
  for (int64_t i = 0; i < 4 && 4 * w + i < H / 128; ++i) {
    double amax = 0;
    for (int j = 0; j < 128; ++j)
      amax =
          std::max(amax, std::fabs(static_cast<double>(bf16_to_f32(row[(4 * w + i) * 128 + j]))));
    int e2 = 0;
    const double f = std::frexp(std::max(amax, 1e-4) / 448.0, &e2);  // f in [0.5, 1)
    const int e = f == 0.5 ? e2 - 1 : e2;                            // 2^e >= scale, smallest
    word |= static_cast<uint32_t>(127 + e) << (8 * i);
  }
  return word;
}

// Every rank's x_scale, read through the returned strides, holds the packed exponents of the rows
// it received (source rank ascending, then token index) for every row and word; the padding rows
// up to align4(rows) and worst-case rows past N are 0; shape and strides are DeepGEMM's MN-major
// TMA-aligned ones. Exact and worst-case mode, R = 1 and 2, N not a multiple of 4, a partial last
// word (H = 640: 5 groups), rows of zeros (the amax floor). f32 scales stay row-major.
TEST(Dispatcher, HtUe8m0ScalesAreMnMajorTmaAligned) {
  const int E = 8, K = 3;
  const int64_t H = 640, G = H / 128, W = (G + 3) / 4;
  for (int R : {1, 2})
    for (int64_t worst : {int64_t{0}, int64_t{29}})
      for (DispatchQuant quant : {DispatchQuant::kFp8Ue8m0, DispatchQuant::kFp8}) {
        auto T_of = [](int s) -> int64_t { return 7 + 6 * s; };
        std::vector<Inputs> all;
        for (int s = 0; s < R; ++s) {
          all.push_back(make_inputs(T_of(s), H, K, E, R, 40 + s));
          std::fill_n(all[s].x.begin() + 2 * H, H, uint16_t{0});  // token 2: all groups floored
        }
        testing::run_threads(R, [&](const Group& g) {
          const int r = g.rank(), L = E / R;
          DispatcherConfig c = small_config(DispatchMode::kNormal);
          c.hidden = H;
          c.quant = quant;
          c.num_worst_tokens = worst;
          c.allocator = testing::poison_allocator(0xFF);
          Dispatcher d(g, c);
          const Inputs& in = all[r];
          DispatchOutput out = d.dispatch(in.xv, in.iv, in.wv);
          // The rows this rank receives, in order.
          std::vector<const uint16_t*> rows;
          for (int s = 0; s < R; ++s)
            for (int64_t t = 0; t < T_of(s); ++t) {
              bool to_me = false;
              for (int k = 0; k < K; ++k) to_me |= all[s].idx[t * K + k] / L == r;
              if (to_me) rows.push_back(all[s].x.data() + t * H);
            }
          const int64_t N = static_cast<int64_t>(rows.size());
          const int64_t num_rows = worst > 0 ? worst : N;
          ASSERT_EQ(out.x_scale.shape[0], num_rows);
          if (quant == DispatchQuant::kFp8) {
            ASSERT_EQ(out.x_scale.dtype, DType::kF32);
            ASSERT_EQ(out.x_scale.shape[1], G);
            ASSERT_TRUE(out.x_scale.is_contiguous());
            return;
          }
          const int64_t M = (num_rows + 3) / 4 * 4;
          ASSERT_EQ(out.x_scale.dtype, DType::kI32);
          ASSERT_EQ(out.x_scale.ndim, 2);
          ASSERT_EQ(out.x_scale.shape[1], W);
          ASSERT_EQ(out.x_scale.strides[0], 1);
          ASSERT_EQ(out.x_scale.strides[1], M);
          const auto* words = static_cast<const uint32_t*>(out.x_scale.data);
          for (int64_t m = 0; m < M; ++m)
            for (int64_t w = 0; w < W; ++w) {
              const uint32_t want = m < N ? reference_ue8m0_word(rows[m], H, w) : 0u;
              ASSERT_EQ(words[m * out.x_scale.strides[0] + w * out.x_scale.strides[1]], want)
                  << "R " << R << " worst " << worst << " rank " << r << " row " << m << " word "
                  << w << " (N " << N << ", M " << M << ")";
            }
          CombineInput ci;
          Tensor y = default_allocator()(DType::kBF16, {num_rows, H}, Device::cpu());
          std::memset(y.data, 0, y.nbytes());
          ci.y = y;
          d.combine(ci);
        });
      }
}

// ---- quantisation error bounds against float64 ----------------------------------------------

TEST(Quant, Fp8PerTokenBlockErrorBound) {
  std::mt19937_64 rng(5);
  const int64_t T = 37, H = 1024;
  for (bool ue8m0 : {false, true}) {
    std::vector<uint16_t> x = testing::make_bf16(T, H, rng);
    TensorView xv = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
    detail::QuantizedTensor q = detail::quantize_fp8(xv, ue8m0, default_allocator());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < H / 128; ++g) {
        double amax = 0;
        for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs((double)bf16_to_f32(x[t * H + g * 128 + i])));
        double scale;
        if (!ue8m0) {
          scale = q.scales.ptr<float>()[t * (H / 128) + g];
        } else {
          const uint8_t* w = reinterpret_cast<const uint8_t*>(
              q.scales.ptr<int32_t>() + t * q.scales.strides[0] + (g / 4) * q.scales.strides[1]);
          scale = std::ldexp(1.0, static_cast<int>(w[g % 4]) - 127);
        }
        // The scale covers amax (power-of-two rounding at most doubles it).
        EXPECT_GE(scale * 448.0, std::max(amax, 1e-4) * (1 - 1e-6));
        if (ue8m0) EXPECT_LE(scale * 448.0, 2 * std::max(amax, 1e-4) * (1 + 1e-6));
        for (int i = 0; i < 128; ++i) {
          const double v = bf16_to_f32(x[t * H + g * 128 + i]);
          const double d = detail::fp8_e4m3_to_f32(q.values.ptr<uint8_t>()[t * H + g * 128 + i]) * scale;
          // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step.
          EXPECT_LE(std::fabs(d - v), std::fabs(v) / 16 + scale * std::ldexp(1.0, -10) + 1e-12)
              << "t=" << t << " g=" << g << " i=" << i;
        }
      }
  }
}

TEST(Quant, Nvfp4ErrorBound) {
  std::mt19937_64 rng(6);
  const int64_t T = 19, H = 256;
  std::vector<uint16_t> x = testing::make_bf16(T, H, rng);
  double amax_all = 0;
  for (uint16_t v : x) amax_all = std::max(amax_all, std::fabs((double)bf16_to_f32(v)));
  const float gscale = static_cast<float>(448.0 * 6.0 / amax_all);
  TensorView xv = TensorView::contiguous(x.data(), DType::kBF16, {T, H});
  detail::QuantizedTensor q = detail::quantize_nvfp4(xv, gscale, default_allocator());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < H / 16; ++b) {
      const double sf = detail::fp8_e4m3_to_f32(q.scales.ptr<uint8_t>()[t * (H / 16) + b]);
      double amax = 0;
      for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs((double)bf16_to_f32(x[t * H + b * 16 + i])));
      for (int i = 0; i < 16; ++i) {
        const int64_t j = b * 16 + i;
        const uint8_t byte = q.values.ptr<uint8_t>()[t * (H / 2) + j / 2];
        const uint8_t code = (j & 1) ? byte >> 4 : byte & 0xF;
        const double d = detail::e2m1_to_f32(code) * sf / gscale;
        const double v = bf16_to_f32(x[t * H + j]);
        // e2m1 grid step is at most 2 (between 4 and 6) out of a max of 6: error <= amax/6 plus
        // the e4m3 rounding of the block scale (<= 1/16 relative).
        EXPECT_LE(std::fabs(d - v), amax / 6.0 * (1 + 1.0 / 16) + amax / 16 + 1e-6)
            << "t=" << t << " j=" << j;
      }
    }
}

TEST(Quant, E2m1RoundsToNearestEven) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(detail::f32_to_e2m1(detail::e2m1_to_f32(c)), c);  // code 8 is -0
  // Midpoints go to the even code; beyond 6 saturates.
  EXPECT_EQ(detail::f32_to_e2m1(0.25f), 0);
  EXPECT_EQ(detail::f32_to_e2m1(0.75f), 2);
  EXPECT_EQ(detail::f32_to_e2m1(1.25f), 2);
  EXPECT_EQ(detail::f32_to_e2m1(1.75f), 4);
  EXPECT_EQ(detail::f32_to_e2m1(2.5f), 4);
  EXPECT_EQ(detail::f32_to_e2m1(3.5f), 6);
  EXPECT_EQ(detail::f32_to_e2m1(5.0f), 6);
  EXPECT_EQ(detail::f32_to_e2m1(100.0f), 7);
  EXPECT_EQ(detail::f32_to_e2m1(-100.0f), 15);
  // Every value maps to a nearest grid point.
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(-7, 7);
  for (int i = 0; i < 10000; ++i) {
    const float v = u(rng);
    const float got = std::fabs(detail::e2m1_to_f32(detail::f32_to_e2m1(v)));
    float best = 1e9f;
    for (float m : mags) best = std::min(best, std::fabs(std::fabs(v) - m));
    EXPECT_LE(std::fabs(std::fabs(v) - got), best + 1e-7f) << v;
  }
}

}  // namespace
}  // namespace epx
