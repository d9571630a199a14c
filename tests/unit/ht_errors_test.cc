// ht mode, bad input (docs/semantics.md §4): every invalid argument raises epx::Error with the
// right code and a message naming the argument; arguments that must agree across ranks are checked
// after the first exchange and raise on every rank; a rank that never joins makes its peers raise
// Timeout. The valid paths are tested against the oracle in ht_test.cc.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/routing.h"

namespace epx {
namespace {

using testing::Routing;

// ---- validation (docs/semantics.md §4): every bad argument names itself -------------------------
void expect_error(const std::function<void()>& fn, ErrorCode code,
                  std::initializer_list<const char*> has, const char* label) {
  try {
    fn();
    ADD_FAILURE() << label << ": expected " << error_code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << label << ": " << e.what();
    for (const char* s : has)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << label << ": message '" << e.what() << "' does not mention " << s;
  }
}

TEST(HtErrors, EveryBadArgumentIsNamed) {
  testing::run_threads(1, [](const Group& g) {
    const MoeShape shape{256, 4, 8, 16};
    Buffer buf(g, shape);
    Buffer other(g, shape);
    std::mt19937_64 rng(5);
    std::vector<uint16_t> x = testing::make_bf16(16, 512, rng);  // room for strided/wide views
    std::vector<int64_t> topk = testing::make_topk_idx(Routing::kUniform, 16, 4, 8, 1, rng);
    std::vector<float> w = testing::make_topk_weights(topk, rng), scales(64, 1.0f);
    std::vector<int32_t> packed(16, 0x7f7f7f7f);
    std::vector<uint8_t> x8(16 * 256, 0x38);
    const int64_t T = 8;
    HtDispatchArgs good;
    good.x = TensorView::contiguous(x.data(), DType::kBF16, {T, 256});
    good.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {T, 4});
    good.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {T, 4});
    HtDispatchArgs fp8 = good;
    fp8.x = TensorView::contiguous(x8.data(), DType::kF8E4M3, {T, 256});
    fp8.x_scales = TensorView::contiguous(scales.data(), DType::kF32, {T, 2});
    auto dispatch = [&](HtDispatchArgs a) { return [&buf, a] { buf.ht_dispatch(a); }; };
    auto with = [&](HtDispatchArgs a, auto change) {
      change(a);
      return dispatch(a);
    };
    const auto bad = ErrorCode::kInvalidArgument;
    const TensorView cuda_view = [&] {
      TensorView v = good.x;
      v.device = Device::cuda(0);
      return v;
    }();

    // ht_layout
    TensorView tk = good.topk_idx;
    auto layout = [&](TensorView v) { return [&buf, v] { buf.ht_layout(v); }; };
    expect_error(layout(TensorView::contiguous(w.data(), DType::kF32, {T, 4})), bad,
                 {"ht_layout", "'topk_idx'", "f32"}, "layout dtype");
    expect_error(layout(TensorView::contiguous(topk.data(), DType::kI64, {T, 3})), bad,
                 {"'topk_idx'", "[8, 3]"}, "layout shape");
    topk[5] = 8;
    expect_error(layout(tk), bad, {"'topk_idx'", "value 8", "[1, 1]"}, "layout value E");
    topk[5] = -2;
    expect_error(layout(tk), bad, {"'topk_idx'", "value -2"}, "layout value -2");
    expect_error(dispatch(good), bad, {"ht_dispatch", "'topk_idx'", "value -2"}, "dispatch value");
    topk[5] = 1;
    tk.device = Device::cuda(0);
    expect_error(layout(tk), bad, {"'topk_idx'", "cuda:0"}, "layout device");

    // ht_dispatch: x
    expect_error(with(good, [](auto& a) { a.x = TensorView{}; }), bad, {"'x'", "required"},
                 "x missing");
    expect_error(with(good,
                      [&](auto& a) {
                        a.x = TensorView::contiguous(scales.data(), DType::kF32, {T, 256});
                      }),
                 bad, {"'x'", "f32", "bf16 or fp8_e4m3"}, "x dtype");
    expect_error(with(good,
                      [&](auto& a) {
                        a.x = TensorView::contiguous(x.data(), DType::kBF16, {T, 128});
                      }),
                 bad, {"'x'", "[8, 128]", "256"}, "x hidden");
    expect_error(with(good,
                      [&](auto& a) {
                        a.x = TensorView::contiguous(x.data(), DType::kBF16, {2, T, 256});
                      }),
                 bad, {"'x'", "shape"}, "x ndim");
    expect_error(with(good,
                      [&](auto& a) {
                        a.x.strides = {512, 2};
                      }),
                 bad, {"'x'", "innermost stride"}, "x stride");
    expect_error(with(good, [&](auto& a) { a.x = cuda_view; }), bad, {"'x'", "cuda:0", "cpu"},
                 "x device");
    expect_error(with(good,
                      [&](auto& a) {
                        a.x = TensorView::contiguous(x.data(), DType::kBF16, {17, 256});
                        a.topk_idx.shape[0] = 17;
                      }),
                 ErrorCode::kOutOfCapacity, {"'x'", "17", "max_tokens_per_rank 16"}, "x capacity");
    // scales
    expect_error(with(fp8, [](auto& a) { a.x_scales = TensorView{}; }), bad,
                 {"'x_scales'", "required"}, "scales missing");
    expect_error(with(good, [&](auto& a) { a.x_scales = fp8.x_scales; }), bad,
                 {"'x_scales'", "bf16"}, "scales with bf16");
    expect_error(with(fp8, [&](auto& a) { a.x_scales.dtype = DType::kBF16; }), bad,
                 {"'x_scales'", "f32 or i32"}, "scales dtype");
    expect_error(with(fp8, [&](auto& a) { a.x_scales.shape[1] = 1; }), bad,
                 {"'x_scales'", "[8, 1]", "[8, 2]"}, "scales f32 cols");
    expect_error(with(fp8,
                      [&](auto& a) {
                        a.x_scales = TensorView::contiguous(packed.data(), DType::kI32, {T, 2});
                      }),
                 bad, {"'x_scales'", "[8, 1]"}, "scales i32 cols");
    expect_error(with(fp8, [&](auto& a) { a.x_scales.shape[0] = 7; }), bad,
                 {"'x_scales'", "[7, 2]"}, "scales rows");
    expect_error(with(fp8, [&](auto& a) { a.x_scales.device = Device::cuda(0); }), bad,
                 {"'x_scales'", "cuda:0"}, "scales device");
    // topk / weights / scalars
    expect_error(with(good, [](auto& a) { a.topk_idx = TensorView{}; }), bad,
                 {"'topk_idx'", "required"}, "topk missing");
    expect_error(with(good, [&](auto& a) { a.topk_idx.shape[0] = 7; }), bad,
                 {"'topk_idx'", "7 rows", "expected 8"}, "topk rows");
    expect_error(with(good, [&](auto& a) { a.topk_idx.dtype = DType::kF16; }), bad,
                 {"'topk_idx'", "f16"}, "topk dtype");
    expect_error(with(good, [&](auto& a) { a.topk_weights.dtype = DType::kBF16; }), bad,
                 {"'topk_weights'", "bf16"}, "weights dtype");
    expect_error(with(good, [&](auto& a) { a.topk_weights.shape[1] = 3; }), bad,
                 {"'topk_weights'", "[8, 3]"}, "weights shape");
    expect_error(with(good, [&](auto& a) { a.topk_weights.device = Device::cuda(0); }), bad,
                 {"'topk_weights'", "cuda:0"}, "weights device");
    expect_error(with(good, [](auto& a) { a.expert_alignment = 0; }), bad,
                 {"'expert_alignment'", "0", ">= 1"}, "alignment");
    expect_error(with(good, [](auto& a) { a.num_worst_tokens = -1; }), bad,
                 {"'num_worst_tokens'", "-1"}, "worst");
    // Zero-copy: the view holds at most R * max_tokens_per_rank = 16 rows here.
    expect_error(with(good,
                      [](auto& a) {
                        a.zero_copy = true;
                        a.num_worst_tokens = 17;
                      }),
                 bad, {"'zero_copy'", "17", "16"}, "zero-copy worst");

    // cached mode and the handle
    HtDispatchResult res = buf.ht_dispatch(good);
    HtDispatchResult res_other = other.ht_dispatch(good);
    HtDispatchArgs cached;
    cached.x = good.x;
    cached.handle = &res.handle;
    EXPECT_NO_THROW(buf.ht_dispatch(cached));
    expect_error(with(cached, [&](auto& a) { a.handle = &res_other.handle; }), bad,
                 {"'handle'", "buffer"}, "cached foreign handle");
    expect_error(with(cached, [&](auto& a) { a.x.shape[0] = 7; }), bad,
                 {"'x'", "7 tokens", "'handle'", "8 tokens"}, "cached T");
    expect_error(with(cached, [](auto& a) { a.num_worst_tokens = 5; }), bad,
                 {"'num_worst_tokens'", "5"}, "cached worst");
    HtHandle broken = res.handle;
    broken.send_pos = Tensor{};
    expect_error(with(cached, [&](auto& a) { a.handle = &broken; }), bad, {"'handle.send_pos'"},
                 "handle tensor");

    // ht_combine
    HtCombineArgs cg;
    cg.y = res.recv_x;
    cg.handle = &res.handle;
    std::vector<float> cw(static_cast<size_t>(res.recv_x.shape[0]) * 4, 0.5f);
    cg.topk_weights = TensorView::contiguous(cw.data(), DType::kF32, {res.recv_x.shape[0], 4});
    cg.bias0 = good.x;
    EXPECT_NO_THROW(buf.ht_combine(cg));
    auto combine = [&](auto change) {
      HtCombineArgs c = cg;
      change(c);
      return [&buf, c] { buf.ht_combine(c); };
    };
    const int64_t N = res.recv_x.shape[0];
    expect_error(combine([](auto& c) { c.handle = nullptr; }), bad,
                 {"ht_combine", "'handle'", "required"}, "combine no handle");
    expect_error(combine([&](auto& c) { c.handle = &res_other.handle; }), bad,
                 {"'handle'", "buffer"}, "combine foreign handle");
    expect_error(combine([](auto& c) { c.y = TensorView{}; }), bad, {"'y'", "required"},
                 "y missing");
    expect_error(combine([&](auto& c) { c.y.dtype = DType::kF32; }), bad, {"'y'", "f32"},
                 "y dtype");
    expect_error(combine([&](auto& c) { c.y.shape[0] = N + 1; }), bad,
                 {"'y'", std::to_string(N + 1).c_str()}, "y rows");
    expect_error(combine([&](auto& c) { c.y.shape[1] = 128; }), bad, {"'y'", "128"}, "y hidden");
    expect_error(combine([&](auto& c) { c.y.strides[1] = 2; }), bad, {"'y'", "innermost stride"},
                 "y stride");
    expect_error(combine([&](auto& c) { c.y.device = Device::cuda(0); }), bad, {"'y'", "cuda:0"},
                 "y device");
    expect_error(combine([&](auto& c) { c.topk_weights.dtype = DType::kI32; }), bad,
                 {"'topk_weights'", "i32"}, "combine weights dtype");
    expect_error(combine([&](auto& c) { c.topk_weights.shape[1] = 5; }), bad,
                 {"'topk_weights'", "5]"}, "combine weights shape");
    expect_error(combine([&](auto& c) { c.topk_weights.strides[1] = 2; }), bad,
                 {"'topk_weights'", "innermost stride"}, "combine weights inner stride");
    expect_error(combine([&](auto& c) { c.bias0.shape[0] = 7; }), bad, {"'bias0'", "[7, 256]"},
                 "bias0 shape");
    expect_error(combine([&](auto& c) {
                   c.bias1 = TensorView::contiguous(w.data(), DType::kF32, {T, 256});
                 }),
                 bad, {"'bias1'", "f32"}, "bias1 dtype");
    expect_error(combine([&](auto& c) { c.bias1 = cuda_view; }), bad, {"'bias1'", "cuda:0"},
                 "bias1 device");

    // a buffer without ht memory; fp8 with H % 128 != 0
    Buffer ll_only(g, MoeShape{128, 1, 1, 1}, BufferConfig{false, true});
    HtDispatchArgs one;
    one.x = TensorView::contiguous(x.data(), DType::kBF16, {1, 128});
    one.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {1, 1});
    expect_error([&] { ll_only.ht_dispatch(one); }, bad, {"ht_dispatch", "'enable_ht'"},
                 "ht disabled");
    expect_error([&] { ll_only.ht_combine(cg); }, bad, {"ht_combine", "'enable_ht'"},
                 "ht disabled (combine)");
    Buffer narrow(g, MoeShape{192, 4, 8, 16});
    HtDispatchArgs n8 = fp8;
    n8.x = TensorView::contiguous(x8.data(), DType::kF8E4M3, {T, 192});
    n8.x_scales = TensorView::contiguous(scales.data(), DType::kF32, {T, 1});
    expect_error([&] { narrow.ht_dispatch(n8); }, bad, {"'x'", "192", "multiple of 128"},
                 "fp8 H % 128");
  });
}

// Arguments that only make sense together are checked after the first exchange: every rank
// raises, and the group stays usable.
TEST(HtErrors, InconsistentRanksAllRaise) {
  testing::run_threads(2, [](const Group& g) {
    const int r = g.rank();
    Buffer buf(g, MoeShape{128, 2, 4, 8});
    std::mt19937_64 rng(11 + r);
    std::vector<uint16_t> x = testing::make_bf16(8, 128, rng);
    std::vector<uint8_t> x8(8 * 128, 0x38);
    std::vector<float> scales(8, 1.0f);
    std::vector<int64_t> topk = testing::make_topk_idx(Routing::kUniform, 8, 2, 4, 2, rng);
    std::vector<float> w = testing::make_topk_weights(topk, rng);
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {8, 128});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {8, 2});
    a.topk_weights = TensorView::contiguous(w.data(), DType::kF32, {8, 2});
    HtDispatchArgs mixed = a;  // rank 1 sends fp8
    if (r == 1) {
      mixed.x = TensorView::contiguous(x8.data(), DType::kF8E4M3, {8, 128});
      mixed.x_scales = TensorView::contiguous(scales.data(), DType::kF32, {8, 1});
    }
    const auto bad = ErrorCode::kInvalidArgument;
    expect_error([&] { buf.ht_dispatch(mixed); }, bad, {"'x'", "fp8_e4m3", "rank 1"}, "x dtypes");
    HtDispatchArgs half = a;  // weights on rank 0 only
    if (r == 1) half.topk_weights = TensorView{};
    expect_error([&] { buf.ht_dispatch(half); }, bad, {"'topk_weights'", "rank 1"}, "weights");
    HtDispatchResult res = buf.ht_dispatch(a);
    // Rank 0 dispatches again while rank 1 combines: both learn it.
    HtCombineArgs c;
    c.y = res.recv_x;
    c.handle = &res.handle;
    expect_error([&] { r == 0 ? (void)buf.ht_dispatch(a) : (void)buf.ht_combine(c); },
                 ErrorCode::kOutOfStep, {"same operations"}, "op mismatch");
    // Still usable: the round trip returns x times the number of ranks each token went to.
    HtCombineResult out = buf.ht_combine(c);
    for (int64_t t = 0; t < 8; ++t) {
      const float n = res.handle.is_token_in_rank.ptr<bool>()[t * 2] +
                      res.handle.is_token_in_rank.ptr<bool>()[t * 2 + 1];
      for (int h = 0; h < 128; ++h)
        ASSERT_EQ(out.out.ptr<uint16_t>()[t * 128 + h],
                  detail::f32_to_bf16(0.0f + n * detail::bf16_to_f32(x[t * 128 + h])));
    }
  });
}

// Zero-copy dispatch on the cpu backend: accepted in every mode, the same rows as without it (an
// ordinary tensor there), and the combine takes them back as y.
TEST(HtZeroCopy, CpuBackendReturnsTheSameRows) {
  testing::run_threads(2, [](const Group& g) {
    const int r = g.rank();
    Buffer buf(g, MoeShape{128, 2, 4, 8});
    std::mt19937_64 rng(31 + r);
    std::vector<uint16_t> x = testing::make_bf16(8, 128, rng);
    std::vector<int64_t> topk = testing::make_topk_idx(Routing::kSkewed, 8, 2, 4, 2, rng);
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {8, 128});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {8, 2});
    HtDispatchArgs z = a;
    z.zero_copy = true;
    const HtDispatchResult want = buf.ht_dispatch(a);
    const HtDispatchResult got = buf.ht_dispatch(z);
    auto same = [](const Tensor& p, const Tensor& q) {
      return p.shape == q.shape && p.nbytes() == q.nbytes() &&
             std::memcmp(p.data, q.data, p.nbytes()) == 0;
    };
    EXPECT_TRUE(same(got.recv_x, want.recv_x));
    EXPECT_TRUE(same(got.recv_src_idx, want.recv_src_idx));
    HtDispatchArgs zc;  // cached
    zc.x = a.x;
    zc.handle = &got.handle;
    zc.zero_copy = true;
    EXPECT_TRUE(same(buf.ht_dispatch(zc).recv_x, want.recv_x));
    HtDispatchArgs zw = z;  // worst-case, at the view's capacity R * max_tokens_per_rank
    zw.num_worst_tokens = 16;
    const HtDispatchResult worst = buf.ht_dispatch(zw);
    EXPECT_EQ(worst.recv_x.shape[0], 16);
    EXPECT_EQ(std::memcmp(worst.recv_x.data, want.recv_x.data, want.recv_x.nbytes()), 0);
    HtCombineArgs c;
    c.y = got.recv_x;
    c.handle = &got.handle;
    const HtCombineResult out = buf.ht_combine(c);
    HtCombineArgs c2 = c;
    c2.y = want.recv_x;
    c2.handle = &want.handle;
    EXPECT_TRUE(same(out.out, buf.ht_combine(c2).out));
    // Zero-copy combine: y written into ht_combine_buffer, the same outputs.
    std::vector<float> yw(static_cast<size_t>(want.recv_x.shape[0]) * 2);
    for (size_t i = 0; i < yw.size(); ++i) yw[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    c2.topk_weights =
        TensorView::contiguous(yw.data(), DType::kF32, {want.recv_x.shape[0], int64_t{2}});
    const HtCombineResult plain = buf.ht_combine(c2);
    const TensorView view = buf.ht_combine_buffer(want.handle);
    ASSERT_EQ(view.shape[0], want.recv_x.shape[0]);
    ASSERT_EQ(view.shape[1], 128);
    std::memcpy(view.data, want.recv_x.data, want.recv_x.nbytes());
    HtCombineArgs cz = c2;
    cz.y = view;
    cz.zero_copy = true;
    const HtCombineResult zc_out = buf.ht_combine(cz);
    EXPECT_TRUE(same(zc_out.out, plain.out));
    EXPECT_TRUE(same(zc_out.combined_topk_weights, plain.combined_topk_weights));
    // Not the view: refused before communicating (every rank has rows in this case; an empty y
    // would be accepted, so a rank without rows would enter the collective alone).
    const int32_t* rpm = want.handle.rank_prefix_matrix.ptr<int32_t>();
    ASSERT_GT(rpm[2], 0);  // rows rank 0 receives (rpm[R-1][0])
    ASSERT_GT(rpm[3], 0);  // rows rank 1 receives
    cz.y = want.recv_x;
    expect_error([&] { buf.ht_combine(cz); }, ErrorCode::kInvalidArgument,
                 {"'y'", "ht_combine_buffer"}, "zero-copy combine y");
  });
}

// A rank that never joins raises Timeout on its peers within the group's timeout, naming it.
TEST(HtErrors, MissingRankTimesOut) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(300);
  for (const bool in_combine : {false, true}) {
    testing::run_threads(
        2,
        [&](const Group& g) {
          Buffer buf(g, MoeShape{128, 1, 2, 4});
          std::vector<uint16_t> x(4 * 128, 0x3f80);
          std::vector<int64_t> topk{0, 1, 0, 1};
          HtDispatchArgs a;
          a.x = TensorView::contiguous(x.data(), DType::kBF16, {4, 128});
          a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {4, 1});
          HtDispatchResult res;
          if (in_combine) res = buf.ht_dispatch(a);
          if (g.rank() == 1) return;  // never joins the next op
          const auto start = std::chrono::steady_clock::now();
          HtCombineArgs c;
          c.y = res.recv_x;
          c.handle = &res.handle;
          expect_error([&] { in_combine ? (void)buf.ht_combine(c) : (void)buf.ht_dispatch(a); },
                       ErrorCode::kTimeout,
                       {in_combine ? "ht_combine" : "ht_dispatch", "ranks [1]"}, "timeout");
          EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        },
        o);
  }
}

}  // namespace
}  // namespace epx
