// Dispatcher: stage machine, auto mode switching, hooks, expert-load recording, quantisation
// error bounds (against a float64 reference) — cpu backend.
#include <gtest/gtest.h>

#include <cmath>
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
