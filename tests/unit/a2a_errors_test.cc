// a2a mode: the errors of docs/semantics.md §4 (shape, state machine, dispatch and combine
// arguments, ranks that disagree, peers that never arrive) and the workspace size. Every case
// asserts the ErrorCode and that the message names the argument; after each rejected call the
// object must still work. The oracle comparisons live in a2a_test.cc.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "epx/a2a.h"
#include "epx/error.h"
#include "support/harness.h"

namespace epx {
namespace {
// ---- workspace size --------------------------------------------------------------------------

TEST(A2aWorkspace, BytesRelateToFlashInferFormula) {
  for (int R : {1, 2, 8}) {
    A2aShape s;
    s.max_tokens_per_rank = 4096;
    s.top_k = 8;
    s.num_experts = 256;
    s.payload_bytes_per_token = {7168 / 2, 7168 / 16, 8 * 4, 8 * 4};
    s.combine_bytes_per_token = 7168 * 2;
    size_t dispatch = 0;
    for (size_t b : s.payload_bytes_per_token) dispatch += b;
    const size_t flashinfer_like = R * 4096 * (dispatch + s.combine_bytes_per_token);
    const size_t publish = 4096 * (dispatch + 8);
    const size_t bytes = A2a::workspace_bytes(s, R, Backend::kCpu);
    EXPECT_GE(bytes, flashinfer_like + publish);
    EXPECT_LE(bytes, flashinfer_like + publish + 4096 + 256 * 16);
    testing::run_threads(R, [&](const Group& g) {
      A2aShape small = s;
      small.max_tokens_per_rank = 16;
      A2a a2a(g, small);
      EXPECT_EQ(a2a.bytes_allocated(), A2a::workspace_bytes(small, R, Backend::kCpu));
      EXPECT_EQ(a2a.shape().payload_bytes_per_token, small.payload_bytes_per_token);
    });
  }
}

// ---- errors ----------------------------------------------------------------------------------

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& needle, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": expected " << error_code_name(code) << " naming " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << what << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << what << ": message does not name " << needle << ": " << e.what();
  }
}

TEST(A2aErrors, ShapeIsValidated) {
  auto base = [] {
    A2aShape s;
    s.max_tokens_per_rank = 8;
    s.top_k = 2;
    s.num_experts = 4;
    s.payload_bytes_per_token = {32, 8};
    s.combine_bytes_per_token = 64;
    return s;
  };
  struct Bad {
    const char* needle;
    void (*edit)(A2aShape&);
  };
  const Bad bads[] = {
      {"max_tokens_per_rank", [](A2aShape& s) { s.max_tokens_per_rank = 0; }},
      {"top_k", [](A2aShape& s) { s.top_k = 0; }},
      {"top_k", [](A2aShape& s) { s.top_k = 33; }},
      {"num_experts", [](A2aShape& s) { s.num_experts = 0; }},
      {"num_experts", [](A2aShape& s) { s.num_experts = 5; }},  // not a multiple of R = 2
      {"payload_bytes_per_token", [](A2aShape& s) { s.payload_bytes_per_token.clear(); }},
      {"payload_bytes_per_token", [](A2aShape& s) { s.payload_bytes_per_token.assign(9, 4); }},
      {"payload_bytes_per_token[1]", [](A2aShape& s) { s.payload_bytes_per_token[1] = 6; }},
      {"payload_bytes_per_token[0]", [](A2aShape& s) { s.payload_bytes_per_token[0] = 0; }},
      {"combine_bytes_per_token", [](A2aShape& s) { s.combine_bytes_per_token = 0; }},
      {"combine_bytes_per_token", [](A2aShape& s) { s.combine_bytes_per_token = 66; }},
  };
  for (const Bad& b : bads) {
    A2aShape s = base();
    b.edit(s);
    expect_error([&] { A2a::workspace_bytes(s, 2, Backend::kCpu); }, ErrorCode::kInvalidArgument,
                 b.needle, "workspace_bytes");
  }
  Group g = Group::cpu_threads(0, 1, testing::unique_group_name("shape"));
  A2aShape s = base();
  s.top_k = 40;
  expect_error([&] { A2a a2a(g, s); }, ErrorCode::kInvalidArgument, "top_k", "constructor");
}

// A single-rank A2a and valid inputs that each error case then breaks in one place.
struct ErrorFixture {
  static constexpr int64_t kT = 4, kM = 6, kH = 32;
  ErrorFixture() : group(Group::cpu_threads(0, 1, testing::unique_group_name("err"))) {
    shape.max_tokens_per_rank = 8;
    shape.top_k = 2;
    shape.num_experts = 4;
    shape.payload_bytes_per_token = {32, 8};  // bf16 [16], i32 [2]
    shape.combine_bytes_per_token = kH * 2;
    a2a = std::make_unique<A2a>(group, shape);
    topk = {0, 1, 2, -1, 3, 3, -1, -1};
    x.assign(kT * 16, 0x3F80);
    ids.assign(topk.begin(), topk.end());
    y.assign(kM * kH, 0x3F80);
  }
  A2aDispatchArgs args() {
    A2aDispatchArgs a;
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {kT, 2});
    a.payloads = {TensorView::contiguous(x.data(), DType::kBF16, {kT, 16}),
                  TensorView::contiguous(ids.data(), DType::kI32, {kT, 2})};
    a.runtime_max_tokens_per_rank = kM;
    a.invalid_expert_id = -1;
    a.expert_id_payload_index = 1;
    return a;
  }
  TensorView y_view() { return TensorView::contiguous(y.data(), DType::kBF16, {1, kM, kH}); }

  Group group;
  A2aShape shape;
  std::unique_ptr<A2a> a2a;
  std::vector<int32_t> topk;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<uint16_t> y;
};

TEST(A2aErrors, StateMachine) {
  ErrorFixture f;
  expect_error([&] { f.a2a->combine(f.y_view(), f.kM); }, ErrorCode::kInvalidArgument,
               "without a preceding dispatch", "combine before dispatch");
  f.a2a->dispatch(f.args());
  expect_error([&] { f.a2a->dispatch(f.args()); }, ErrorCode::kInvalidArgument, "twice",
               "dispatch twice");
  f.a2a->combine(f.y_view(), f.kM);
  expect_error([&] { f.a2a->combine(f.y_view(), f.kM); }, ErrorCode::kInvalidArgument,
               "without a preceding dispatch", "combine twice");
  f.a2a->dispatch(f.args());  // the machine is back in its initial state
  Tensor out = f.a2a->combine(f.y_view(), f.kM);
  EXPECT_EQ(out.shape[0], f.kT);
}

TEST(A2aErrors, DispatchArguments) {
  ErrorFixture f;
  using Edit = std::function<void(A2aDispatchArgs&)>;
  std::vector<float> f32(64);
  std::vector<int64_t> i64(64);
  std::vector<uint16_t> big(16 * 40);
  struct Bad {
    const char* what;
    ErrorCode code;
    const char* needle;
    Edit edit;
  };
  const auto IA = ErrorCode::kInvalidArgument, OC = ErrorCode::kOutOfCapacity;
  std::vector<Bad> bads = {
      {"topk f32", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f32.data(), DType::kF32, {4, 2});
       }},
      {"topk wrong K", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f.topk.data(), DType::kI32, {2, 4});
       }},
      {"topk 1-d", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(f.topk.data(), DType::kI32, {8});
       }},
      {"topk value E", IA, "'topk_idx'", [&](A2aDispatchArgs&) { f.topk[3] = 4; }},
      {"topk value -2", IA, "'topk_idx'", [&](A2aDispatchArgs&) { f.topk[5] = -2; }},
      {"topk missing", IA, "'topk_idx'", [&](A2aDispatchArgs& a) { a.topk_idx = TensorView{}; }},
      {"topk on cuda", IA, "'topk_idx'",
       [&](A2aDispatchArgs& a) { a.topk_idx.device = Device::cuda(0); }},
      {"too few payloads", IA, "'payloads'", [&](A2aDispatchArgs& a) { a.payloads.pop_back(); }},
      {"too many payloads", IA, "'payloads'",
       [&](A2aDispatchArgs& a) { a.payloads.push_back(a.payloads[0]); }},
      {"payload T mismatch", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1].shape[0] = 3; }},
      {"payload row not x4", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 15});
       }},
      {"payload row too big", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 18});
       }},
      {"payload non-contiguous", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.payloads[0].strides[0] = 40; }},
      {"payload on cuda", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.payloads[0].device = Device::cuda(0); }},
      {"payload missing", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1] = TensorView{}; }},
      {"payload 6-d", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[0] = TensorView::contiguous(big.data(), DType::kBF16, {4, 1, 1, 1, 2, 2});
       }},
      {"runtime_max < T", OC, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = 3; }},
      {"runtime_max negative", IA, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = -1; }},
      {"runtime_max > max", OC, "'runtime_max_tokens_per_rank'",
       [&](A2aDispatchArgs& a) { a.runtime_max_tokens_per_rank = 9; }},
      {"T > max", OC, "'topk_idx'",
       [&](A2aDispatchArgs& a) {
         a.topk_idx = TensorView::contiguous(i64.data(), DType::kI64, {9, 2});
         a.runtime_max_tokens_per_rank = 9;
       }},
      {"expert id index missing", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = -1; }},
      {"expert id index too big", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = 2; }},
      {"expert id index out of range w/o invalid id", IA, "'expert_id_payload_index'",
       [&](A2aDispatchArgs& a) {
         a.invalid_expert_id.reset();
         a.expert_id_payload_index = 7;
       }},
      {"expert id payload not i32", IA, "'payloads[0]'",
       [&](A2aDispatchArgs& a) { a.expert_id_payload_index = 0; }},
      {"expert id payload f32", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) { a.payloads[1].dtype = DType::kF32; }},
      {"expert id payload [T, 1]", IA, "'payloads[1]'",
       [&](A2aDispatchArgs& a) {
         a.payloads[1] = TensorView::contiguous(f.ids.data(), DType::kI32, {4, 1});
       }},
  };
  const std::vector<int32_t> topk0 = f.topk;
  for (const Bad& b : bads) {
    f.topk = topk0;  // fresh inputs for every case
    A2aDispatchArgs a = f.args();
    b.edit(a);
    expect_error([&] { f.a2a->dispatch(a); }, b.code, b.needle, b.what);
  }
  // Nothing above changed the state: a valid cycle still works and matches by hand.
  f.topk = topk0;
  A2aDispatchResult res = f.a2a->dispatch(f.args());
  EXPECT_EQ(res.recv_counts.ptr<int32_t>()[0], 3);  // tokens 0, 1, 2 have an expert; 3 has none
  for (int k = 0; k < 2; ++k) EXPECT_EQ(res.recv[1].ptr<int32_t>()[3 * 2 + k], -1);
  Tensor out = f.a2a->combine(f.y_view(), f.kM);
  EXPECT_EQ(out.ptr<uint16_t>()[3 * f.kH], 0);  // token 3 went nowhere: +0
  EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);    // token 0: 1.0 from the one rank
}

TEST(A2aErrors, CombineArguments) {
  ErrorFixture f;
  f.a2a->dispatch(f.args());
  std::vector<uint8_t> other(8 * 8 * 64 * 4);
  const auto IA = ErrorCode::kInvalidArgument;
  auto yv = [&](DType dt, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(other.data(), dt, shape);
  };
  struct Bad {
    const char* what;
    const char* needle;
    std::function<Tensor()> call;
  };
  const int64_t M = f.kM, H = f.kH;
  std::vector<Bad> bads = {
      {"y i32", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kI32, {1, M, H}), M);
       }},
      {"y fp8", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kF8E4M3, {1, M, H}), M);
       }},
      {"y R mismatch", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {2, M, H}), M);
       }},
      {"y M mismatch", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M - 1, H}), M);
       }},
      {"y 2-d", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {M, H}), M);
       }},
      {"runtime_max differs from dispatch", "'runtime_max_tokens_per_rank'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M - 1, H}), M - 1);
       }},
      {"H too big bf16", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M, H + 2}), M);
       }},
      {"H too big f16", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kF16, {1, M, H + 2}), M);
       }},
      {"H too big f32", "'y'",
       [&] {
         return f.a2a->combine(yv(DType::kF32, {1, M, H / 2 + 1}), M);
       }},
      {"y on cuda", "'y'",
       [&] {
         TensorView v = yv(DType::kBF16, {1, M, H});
         v.device = Device::cuda(0);
         return f.a2a->combine(v, M);
       }},
      {"y inner stride 2", "'y'",
       [&] {
         TensorView v = yv(DType::kBF16, {1, M, H});
         v.strides = {M * H * 2, H * 2, 2};
         return f.a2a->combine(v, M);
       }},
      {"y missing", "'y'", [&] { return f.a2a->combine(TensorView{}, M); }},
      {"payload_in_workspace with a foreign pointer", "'payload_in_workspace'",
       [&] {
         return f.a2a->combine(yv(DType::kBF16, {1, M, H}), M, true);
       }},
      {"payload_in_workspace with a strided view", "'payload_in_workspace'",
       [&] {
         TensorView v = f.a2a->combine_payload_view(M, H / 2, DType::kBF16);
         v.shape[2] = H / 4;  // keeps the pointer, breaks contiguity
         return f.a2a->combine(v, M, true);
       }},
  };
  for (const Bad& b : bads) expect_error([&] { b.call(); }, IA, b.needle, b.what);
  // combine_payload_view's own checks.
  expect_error([&] { f.a2a->combine_payload_view(9, H, DType::kBF16); }, IA,
               "'runtime_max_tokens_per_rank'", "view M > max");
  for (DType bad : {DType::kI32, DType::kF8E4M3, DType::kU8})
    expect_error([&] { f.a2a->combine_payload_view(M, H, bad); }, IA, "'dtype'", "view dtype");
  expect_error([&] { f.a2a->combine_payload_view(M, H + 1, DType::kBF16); }, IA, "'hidden'",
               "view hidden");
  // Still in the after-dispatch state: a valid in-workspace combine works.
  TensorView ws = f.a2a->combine_payload_view(M, H, DType::kBF16);
  std::memcpy(ws.data, f.y.data(), f.y.size() * 2);
  Tensor out = f.a2a->combine(ws, M, true);
  EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);
}

// What only the group can see: every rank must pass the same geometry.
TEST(A2aErrors, RanksDisagree) {
  struct Case {
    const char* needle;
    int64_t m1;               // runtime_max of rank 1
    int64_t cols1;            // bf16 columns of payload 0 on rank 1
    int64_t h1;               // combine H of rank 1
    DType y1 = DType::kBF16;  // combine dtype of rank 1 (f16: the same row bytes as bf16)
  };
  const Case cases[] = {{"'runtime_max_tokens_per_rank'", 5, 16, 32},
                        {"'payloads[0]'", 6, 14, 32},
                        {"'y'", 6, 16, 30},
                        {"the dtype of argument 'y'", 6, 16, 32, DType::kF16}};
  for (const Case& c : cases) {
    testing::run_threads(2, [&](const Group& g) {
      A2aShape s;
      s.max_tokens_per_rank = 8;
      s.top_k = 1;
      s.num_experts = 2;
      s.payload_bytes_per_token = {32};
      s.combine_bytes_per_token = 64;
      A2a a2a(g, s);
      const bool odd = g.rank() == 1;
      std::vector<int32_t> topk = {0, 1, 1};
      std::vector<uint16_t> x(3 * 16, 0x3F80), y(2 * 8 * 32, 0x3F80);
      for (int attempt = 0; attempt < 2; ++attempt) {  // the second attempt is valid
        const bool bad = attempt == 0 && odd;
        A2aDispatchArgs a;
        a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {3, 1});
        a.payloads = {TensorView::contiguous(x.data(), DType::kBF16, {3, bad ? c.cols1 : 16})};
        a.runtime_max_tokens_per_rank = bad ? c.m1 : 6;
        const bool dispatch_fails = attempt == 0 && (c.m1 != 6 || c.cols1 != 16);
        if (dispatch_fails) {
          expect_error([&] { a2a.dispatch(a); }, ErrorCode::kInvalidArgument, c.needle,
                       "dispatch disagreement");
          continue;
        }
        A2aDispatchResult res = a2a.dispatch(a);
        EXPECT_EQ(res.recv_counts.ptr<int32_t>()[0], g.rank() == 0 ? 1 : 2);
        const int64_t H = bad ? c.h1 : 32;
        TensorView yv = TensorView::contiguous(y.data(), bad ? c.y1 : DType::kBF16, {2, 6, H});
        if (attempt == 0) {
          expect_error([&] { a2a.combine(yv, 6); }, ErrorCode::kInvalidArgument, c.needle,
                       "combine disagreement");
          // The failed combine left the object after dispatch; finish the cycle correctly.
          yv = TensorView::contiguous(y.data(), DType::kBF16, {2, 6, 32});
        }
        Tensor out = a2a.combine(yv, 6);
        EXPECT_EQ(out.ptr<uint16_t>()[0], 0x3F80);
      }
    });
  }
}

TEST(A2aErrors, RanksConstructDifferentShapes) {
  testing::run_threads(3, [](const Group& g) {
    A2aShape s;
    s.max_tokens_per_rank = 8;
    s.top_k = 2;
    s.num_experts = 6;
    s.payload_bytes_per_token = {32, 8};
    s.combine_bytes_per_token = 64;
    if (g.rank() == 2) s.payload_bytes_per_token[1] = 12;
    expect_error([&] { A2a a2a(g, s); }, ErrorCode::kInvalidArgument, "payload_bytes_per_token[1]",
                 "different shapes");
    // The group is still usable: the same shape everywhere works.
    s.payload_bytes_per_token[1] = 8;
    A2a ok(g, s);
    EXPECT_EQ(ok.bytes_allocated(), A2a::workspace_bytes(s, 3, Backend::kCpu));
  });
}

// ---- timeouts --------------------------------------------------------------------------------

A2aShape tiny_shape() {
  A2aShape s;
  s.max_tokens_per_rank = 4;
  s.top_k = 1;
  s.num_experts = 2;
  s.payload_bytes_per_token = {4};
  s.combine_bytes_per_token = 4;
  return s;
}

// Rank 1 stops taking part at `stage`; rank 0 must get Timeout naming the operation, quickly.
void expect_timeout(int stage, const char* needle) {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(300);
  std::atomic<bool> done{false};
  testing::run_threads(
      2,
      [&](const Group& g) {
        std::vector<int32_t> topk = {0, 1};
        std::vector<float> x = {1.0f, 2.0f}, y(2 * 2, 1.0f);
        A2aDispatchArgs a;
        a.topk_idx = TensorView::contiguous(topk.data(), DType::kI32, {2, 1});
        a.payloads = {TensorView::contiguous(x.data(), DType::kF32, {2, 1})};
        a.runtime_max_tokens_per_rank = 2;
        TensorView yv = TensorView::contiguous(y.data(), DType::kF32, {2, 2, 1});
        if (g.rank() == 1) {
          if (stage >= 1) {
            A2a a2a(g, tiny_shape());
            if (stage >= 2) a2a.dispatch(a);
            const auto start = std::chrono::steady_clock::now();
            while (!done && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
          } else {
            // Never constructs the A2a; waits so that its group stays alive.
            const auto start = std::chrono::steady_clock::now();
            while (!done && std::chrono::steady_clock::now() - start < std::chrono::seconds(10))
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          A2a a2a(g, tiny_shape());
          if (stage >= 1) a2a.dispatch(a);
          if (stage >= 2) a2a.combine(yv, 2);
          ADD_FAILURE() << "stage " << stage << ": expected Timeout";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("ranks [1]"), std::string::npos) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
        done = true;
      },
      o);
}

TEST(A2aTimeout, PeerNeverConstructs) {
  expect_timeout(0, "A2a (agreement across ranks)");  // the first exchange of construction
}
TEST(A2aTimeout, PeerNeverDispatches) {
  expect_timeout(1, "a2a dispatch");
}
TEST(A2aTimeout, PeerNeverCombines) {
  expect_timeout(2, "a2a combine");
}

}  // namespace
}  // namespace epx
