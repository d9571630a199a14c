// GPU tier: agreement across ranks on the cuda backend (docs/semantics.md §4), in one-GPU
// multi-rank mode (R = 2 and 3 rank threads sharing GPU 0) and, where 2 GPUs are visible, on
// forked ranks with a GPU each. Every rank must raise InvalidArgument naming the field and the
// values:
//   - construction: Buffer (ht, ll: hidden, top_k, E, T_max, enable flags), A2a, Dispatcher
//     (the exchange through the transport, before anything is mapped);
//   - ll dispatch: use_fp8 / round_scale differing (the kernel's format compare, raised by
//     check()); ll combine: use_logfmt differing (the receive's compare, raised by check());
//   - ht dispatch, exact mode: fp8 vs bf16, expert_alignment, zero_copy, weights given on some
//     ranks (the count exchange's compare, raised by ht_dispatch before any dispatch kernel);
//     worst-case mode: num_worst_tokens differing (raised by the next check()).
// After each error the objects (or the group) stay usable: a consistent call completes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "epx/epx.h"
#include "gpu/gpu_support.h"

namespace epx {
namespace {

using gpu_testing::rank_stream;

GroupOptions quick() {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(10000);
  return o;
}

// One rank's failure count; prints what went wrong.
struct Failures {
  int rank;
  int n = 0;
  void fail(const std::string& what) {
    std::fprintf(stderr, "[rank %d] %s\n", rank, what.c_str());
    ++n;
  }
  // `f` must raise InvalidArgument with every needle in its message.
  void expect_invalid(const std::function<void()>& f, const std::vector<std::string>& needles,
                      const std::string& label) {
    try {
      f();
      fail(label + ": no error");
    } catch (const Error& e) {
      const std::string m = e.what();
      if (e.code() != ErrorCode::kInvalidArgument) fail(label + ": wrong code: " + m);
      for (const std::string& n : needles)
        if (m.find(n) == std::string::npos) fail(label + ": '" + m + "' lacks '" + n + "'");
    }
  }
};

int run_ranks(int R, bool one_gpu, const std::function<int(const Group&)>& body) {
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body, quick())
                 : gpu_testing::run_cuda_ranks(R, body, quick());
}

cudaStream_t stream_of_rank(cudaStream_t& own) {
  if (rank_stream()) return rank_stream();
  if (!own) CUDA_OK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  return own;
}

// ---- construction ----------------------------------------------------------------------------

int construction_body(const Group& g) {
  const int R = g.size(), last = R - 1, me = g.rank();
  Failures f{me};
  const MoeShape s{256, 2, 2 * R, 8};
  // The value the other ranks share: "rank 0 has v" at R = 2, "ranks 0, 1 have v" beyond.
  auto shared = [R](const char* v) { return std::string(R == 2 ? "has " : "have ") + v; };
  struct Case {
    const char* label;
    MoeShape shape;
    BufferConfig config;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"ht hidden", MoeShape{512, 2, 2 * R, 8}, BufferConfig{true, false},
       {"Buffer: shape.hidden differs across ranks", shared("256"), "has 512"}},
      {"ll hidden", MoeShape{65536, 2, 2 * R, 8}, BufferConfig{false, true},
       {"shape.hidden differs", "has 65536"}},
      {"ll T_max", MoeShape{256, 2, 2 * R, 16}, BufferConfig{false, true},
       {"shape.max_tokens_per_rank differs", shared("8"), "has 16"}},
      {"ht top_k", MoeShape{256, 3, 2 * R, 8}, BufferConfig{true, false},
       {"shape.top_k differs"}},
      {"ll experts", MoeShape{256, 2, 4 * R, 8}, BufferConfig{false, true},
       {"shape.num_experts differs"}},
      {"enable_ll", s, BufferConfig{true, true}, {"config.enable_ll differs"}},
  };
  for (const Case& c : cases) {
    const bool odd = me == last;
    BufferConfig base = c.config;
    if (std::string(c.label) == "enable_ll") base = BufferConfig{true, false};
    f.expect_invalid([&] { Buffer b(g, odd ? c.shape : s, odd ? c.config : base); }, c.needles,
                     c.label);
  }
  // A2a and Dispatcher.
  A2aShape a;
  a.max_tokens_per_rank = 8;
  a.top_k = 2;
  a.num_experts = 2 * R;
  a.payload_bytes_per_token = {512, 8};
  a.combine_bytes_per_token = 512;
  A2aShape a_odd = a;
  if (me == last) a_odd.payload_bytes_per_token[0] = 1024;
  f.expect_invalid([&] { A2a x(g, a_odd); },
                   {"A2a: shape.payload_bytes_per_token[0] differs", shared("512"), "has 1024"},
                   "a2a");
  DispatcherConfig dc;
  dc.num_experts = 2 * R;
  dc.hidden = 256;
  dc.top_k = 2;
  dc.max_tokens_per_rank = 8;
  DispatcherConfig dc_odd = dc;
  if (me == last) dc_odd.num_experts = 4 * R;
  f.expect_invalid([&] { Dispatcher d(g, dc_odd); }, {"Dispatcher: config.num_experts differs"},
                   "dispatcher");
  // Still usable: the same shapes everywhere construct.
  Buffer ok(g, s, BufferConfig{true, true});
  A2a ok_a2a(g, a);
  if (ok.shape().hidden != 256) f.fail("usable afterwards");
  return f.n;
}

TEST(AgreementGpu, ConstructionOneGpu) {
  EPX_REQUIRE_GPUS(1);
  for (int R : {2, 3}) EXPECT_EQ(run_ranks(R, true, construction_body), 0) << "R = " << R;
}

TEST(AgreementGpu, ConstructionTwoGpus) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(run_ranks(2, false, construction_body), 0);
}

// ---- ll per call -----------------------------------------------------------------------------

int ll_body(const Group& g) {
  const int R = g.size(), me = g.rank();
  Failures f{me};
  cudaStream_t own = nullptr;
  const cudaStream_t stream = stream_of_rank(own);
  const int dev = gpu_testing::device_of(g);
  const int64_t T = 4, H = 256;
  Buffer buf(g, MoeShape{H, 2, 2 * R, 8}, BufferConfig{false, true});
  Tensor x = gpu_testing::to_device(std::vector<uint16_t>(T * H, 0x3F80), DType::kBF16, {T, H}, dev);
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < T; ++t) ids.insert(ids.end(), {t % (2 * R), (t + 1) % (2 * R)});
  Tensor topk = gpu_testing::to_device(ids, DType::kI64, {T, 2}, dev);
  const Allocator alloc = gpu_testing::device_allocator();
  for (int option = 0; option < 2; ++option) {
    LlDispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.stream = stream;
    a.use_fp8 = option == 0 ? me != R - 1 : true;
    a.round_scale = option == 1 && me == R - 1;
    buf.ll_dispatch(a, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    const char* name = option == 0 ? "argument 'use_fp8' differs across ranks"
                                   : "argument 'round_scale' differs across ranks";
    f.expect_invalid([&] { buf.check(); }, {"ll_dispatch: ", name, "expected the same"}, name);
  }
  // Usable: a consistent dispatch.
  LlDispatchArgs a;
  a.x = x;
  a.topk_idx = topk;
  a.stream = stream;
  LlDispatchResult d = buf.ll_dispatch(a, alloc);
  CUDA_OK(cudaStreamSynchronize(stream));
  try {
    buf.check();
  } catch (const Error& e) {
    f.fail(std::string("consistent dispatch: ") + e.what());
  }
  const std::vector<int32_t> counts = gpu_testing::to_host<int32_t>(d.recv_count);
  int64_t rows = 0;
  for (int32_t c : counts) rows += c;
  if (rows <= 0) f.fail("consistent dispatch received nothing");
  // ll combine: use_logfmt on the last rank only, then the same on every rank.
  const int64_t RT = R * 8;
  Tensor y = gpu_testing::to_device(std::vector<uint16_t>(2 * RT * H, 0x3C00), DType::kBF16,
                                    {2, RT, H}, dev);
  Tensor w = gpu_testing::to_device(std::vector<float>(T * 2, 0.5f), DType::kF32, {T, 2}, dev);
  for (bool consistent : {false, true}) {
    buf.ll_combine({.y = y,
                    .topk_idx = topk,
                    .topk_weights = w,
                    .handle = &d.handle,
                    .use_logfmt = consistent || me == R - 1,
                    .stream = stream},
                   alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    const char* name = "argument 'use_logfmt' differs across ranks";
    if (!consistent) {
      f.expect_invalid([&] { buf.check(); }, {"ll_combine: ", name, "expected the same"}, name);
      continue;
    }
    try {
      buf.check();
    } catch (const Error& e) {
      f.fail(std::string("consistent combine: ") + e.what());
    }
  }
  if (own) cudaStreamDestroy(own);
  return f.n;
}

TEST(AgreementGpu, LlPerCallOneGpu) {
  EPX_REQUIRE_GPUS(1);
  for (int R : {2, 3}) EXPECT_EQ(run_ranks(R, true, ll_body), 0) << "R = " << R;
}

TEST(AgreementGpu, LlPerCallTwoGpus) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(run_ranks(2, false, ll_body), 0);
}

// ---- ht per call -----------------------------------------------------------------------------

int ht_body(const Group& g) {
  const int R = g.size(), me = g.rank(), odd = me == R - 1;
  Failures f{me};
  cudaStream_t own = nullptr;
  const cudaStream_t stream = stream_of_rank(own);
  const int dev = gpu_testing::device_of(g);
  const int64_t T = 8, H = 128;
  Buffer buf(g, MoeShape{H, 2, 2 * R, 16});
  const Allocator alloc = gpu_testing::device_allocator();
  Tensor x = gpu_testing::to_device(std::vector<uint16_t>(T * H, 0x3F80), DType::kBF16, {T, H}, dev);
  Tensor x8 = gpu_testing::to_device(std::vector<uint8_t>(T * H, 0x38), DType::kF8E4M3, {T, H}, dev);
  Tensor sc = gpu_testing::to_device(std::vector<float>(T, 1.0f), DType::kF32, {T, 1}, dev);
  Tensor w = gpu_testing::to_device(std::vector<float>(T * 2, 0.5f), DType::kF32, {T, 2}, dev);
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < T; ++t) ids.insert(ids.end(), {t % (2 * R), (t + 3) % (2 * R)});
  Tensor topk = gpu_testing::to_device(ids, DType::kI64, {T, 2}, dev);
  auto args = [&] {
    HtDispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.stream = stream;
    return a;
  };
  // Exact mode: raised by the dispatch itself, on every rank.
  struct Case {
    const char* label;
    std::function<void(HtDispatchArgs&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"fp8 vs bf16",
       [&](HtDispatchArgs& a) {
         a.x = x8;
         a.x_scales = sc;
       },
       {"the dtype of argument 'x' differs across ranks", "bf16", "fp8_e4m3"}},
      {"expert_alignment", [](HtDispatchArgs& a) { a.expert_alignment = 4; },
       {"argument 'expert_alignment' differs across ranks", "has 1", "has 4"}},
      {"zero_copy", [](HtDispatchArgs& a) { a.zero_copy = true; },
       {"argument 'zero_copy' differs across ranks"}},
      {"weights", [&](HtDispatchArgs& a) { a.topk_weights = w; },
       {"argument 'topk_weights' (given or absent) differs across ranks"}},
  };
  for (const Case& c : cases) {
    HtDispatchArgs a = args();
    if (odd) c.edit(a);
    f.expect_invalid([&] { buf.ht_dispatch(a, alloc); }, c.needles, c.label);
    CUDA_OK(cudaStreamSynchronize(stream));
  }
  // Worst-case mode: no host wait; the next check() raises it.
  {
    HtDispatchArgs a = args();
    a.num_worst_tokens = odd ? 48 : 32;
    buf.ht_dispatch(a, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    f.expect_invalid([&] { buf.check(); },
                     {"argument 'num_worst_tokens' differs across ranks", "has 32", "has 48"},
                     "num_worst_tokens");
  }
  // Usable: a consistent exact round trip (every x row is 1.0: out = ranks the token went to).
  HtDispatchResult d = buf.ht_dispatch(args(), alloc);
  HtCombineArgs ca;
  ca.y = d.recv_x;
  ca.handle = &d.handle;
  ca.stream = stream;
  HtCombineResult out = buf.ht_combine(ca, alloc);
  CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> o = gpu_testing::to_host<uint16_t>(out.out);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t e0 = ids[t * 2], e1 = ids[t * 2 + 1];
    const float n = (e0 / 2 == e1 / 2) ? 1.0f : 2.0f;  // L = 2 experts per rank
    const uint16_t want = n == 1.0f ? 0x3F80 : 0x4000;
    if (o[t * H] != want) {
      f.fail("round trip after the errors: token " + std::to_string(t) + " has " +
             std::to_string(o[t * H]) + ", want " + std::to_string(want));
      break;
    }
  }
  // Cached dispatch and combine: compared when the rows arrive (the format word each source
  // stores before its signals); the next check() raises it on every rank, ht refuses until
  // reset(), and after it a consistent round trip works.
  auto after_reset_round_trip = [&](const char* label) {
    try {
      buf.ht_dispatch(args(), alloc);
      f.fail(std::string(label) + ": no refusal before reset()");
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kOutOfStep) f.fail(std::string(label) + ": " + e.what());
    }
    buf.reset();
    HtDispatchResult d2 = buf.ht_dispatch(args(), alloc);
    HtCombineArgs c2;
    c2.y = d2.recv_x;
    c2.handle = &d2.handle;
    c2.stream = stream;
    buf.ht_combine(c2, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    buf.check();
    return d2;
  };
  {
    HtDispatchArgs a;
    a.x = odd ? x8 : x;
    if (odd) a.x_scales = sc;
    a.handle = &d.handle;
    a.stream = stream;
    buf.ht_dispatch(a, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    f.expect_invalid([&] { buf.check(); },
                     {"ht_dispatch (cached)", "the dtype of argument 'x' differs across ranks",
                      "until reset()"},
                     "cached fp8 vs bf16");
    d = after_reset_round_trip("cached");
  }
  {
    HtCombineArgs c;
    c.y = d.recv_x;
    c.handle = &d.handle;
    c.stream = stream;
    Tensor wn = gpu_testing::to_device(std::vector<float>(d.recv_x.shape[0] * 2, 0.5f),
                                       DType::kF32, {d.recv_x.shape[0], 2}, dev);
    if (odd) c.topk_weights = wn;
    buf.ht_combine(c, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    f.expect_invalid([&] { buf.check(); },
                     {"ht_combine", "argument 'topk_weights' (given or absent) differs across ranks"},
                     "combine weights");
    d = after_reset_round_trip("combine");
  }
  {
    // The odd rank combines while the others dispatch with the handle (cached): the same slots and
    // row counts (every rank routes alike), told apart by the operation in the format word.
    HtDispatchArgs a;
    a.x = x;
    a.handle = &d.handle;
    a.stream = stream;
    HtCombineArgs c;
    c.y = d.recv_x;
    c.handle = &d.handle;
    c.stream = stream;
    if (odd)
      buf.ht_combine(c, alloc);
    else
      buf.ht_dispatch(a, alloc);
    CUDA_OK(cudaStreamSynchronize(stream));
    // A rank whose expected row counts from a differing peer are not what arrives (R = 3 here)
    // waits for them until its timeout: Timeout there, never rows of the other operation.
    try {
      buf.check();
      f.fail("cached dispatch vs combine: no error");
    } catch (const Error& e) {
      const std::string m = e.what();
      const bool named = e.code() == ErrorCode::kInvalidArgument &&
                         m.find("the operation differs across ranks") != std::string::npos &&
                         m.find("called ht_combine") != std::string::npos &&
                         m.find("called ht_dispatch (cached)") != std::string::npos;
      if (!named && e.code() != ErrorCode::kTimeout)
        f.fail("cached dispatch vs combine: " + m);
      if (R == 2 && !named) f.fail("cached dispatch vs combine (R = 2, counts alike): " + m);
    }
    after_reset_round_trip("operation");
  }
  if (own) cudaStreamDestroy(own);
  return f.n;
}

TEST(AgreementGpu, HtPerCallOneGpu) {
  EPX_REQUIRE_GPUS(1);
  for (int R : {2, 3}) EXPECT_EQ(run_ranks(R, true, ht_body), 0) << "R = " << R;
}

TEST(AgreementGpu, HtPerCallTwoGpus) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(run_ranks(2, false, ht_body), 0);
}

}  // namespace
}  // namespace epx
