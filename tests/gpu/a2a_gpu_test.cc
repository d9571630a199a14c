// GPU tier: the cuda a2a backend (src/cuda/a2a.cu) against the naive oracle of docs/semantics.md §3
// (tests/support/oracle_a2a.h, which the cpu backend also matches bit for bit), on R = 1, 2, 4 and
// 8 forked ranks, one GPU each. Skipped, with the reason, where fewer GPUs are visible.
//
// Every check compares every element: all valid rows of every payload, recv_counts, the
// sanitised padding of the expert-id payload and combine's out, bit for bit (padding rows of the
// other payloads are unspecified on cuda and not compared). Outputs are poisoned before the
// library writes them: out comes from an allocator that fills it with 0xFF, the receive views
// are overwritten with 0xA5 after each cycle (the next dispatch must rewrite every valid row),
// the combine region is filled with 0xFF before a copying combine, and graph outputs are
// poisoned before every replay. Problems are generated in the parent and inherited through fork.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "epx/a2a.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/a2a_cycle.h"
#include "support/oracle_a2a.h"
#include "support/routing.h"

namespace epx {
namespace {

using gpu_testing::run_cuda_ranks;
using gpu_testing::to_host_bytes;
using testing::A2aExpected;
using testing::A2aPayloadSpec;
using testing::A2aProblem;
using testing::CycleOptions;
using testing::describe;
using testing::next_cycle;
using testing::Routing;
using Fill = A2aPayloadSpec::Fill;

// ---- helpers ---------------------------------------------------------------------------------


using gpu_testing::poison_allocator;

std::vector<int64_t> dims_of(const TensorView& v) {
  return std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim);
}

// The dispatch outputs copied to host memory, as cpu views the oracle comparison accepts.
struct HostDispatch {
  std::vector<std::vector<uint8_t>> bytes;
  A2aDispatchResult views;
};
HostDispatch to_host(const A2aDispatchResult& dev) {
  HostDispatch h;
  h.bytes.reserve(dev.recv.size() + 1);
  for (const TensorView& v : dev.recv) {
    h.bytes.push_back(to_host_bytes(v));
    h.views.recv.push_back(TensorView::contiguous(h.bytes.back().data(), v.dtype, dims_of(v)));
  }
  h.bytes.push_back(to_host_bytes(dev.recv_counts));
  h.views.recv_counts =
      TensorView::contiguous(h.bytes.back().data(), DType::kI32, dims_of(dev.recv_counts));
  return h;
}

TensorView host_view(std::vector<uint8_t>& bytes, const TensorView& like) {
  return TensorView::contiguous(bytes.data(), like.dtype, dims_of(like));
}

// Device copies of rank r's dispatch inputs.
struct DeviceInputs {
  Tensor topk;
  std::vector<Tensor> payloads;
};
DeviceInputs upload_inputs(const A2aProblem& p, int r, bool topk_int64, int device) {
  const int64_t T = p.num_tokens[r];
  const int K = p.top_k;
  DeviceInputs in;
  if (topk_int64) {
    std::vector<int64_t> v(p.topk_idx[r].begin(), p.topk_idx[r].end());
    in.topk = gpu_testing::to_device(v, DType::kI64, {T, K}, device);
  } else {
    in.topk = gpu_testing::to_device(p.topk_idx[r], DType::kI32, {T, K}, device);
  }
  for (size_t i = 0; i < p.payloads.size(); ++i) {
    std::vector<int64_t> dims = {T};
    dims.insert(dims.end(), p.payloads[i].row_shape.begin(), p.payloads[i].row_shape.end());
    in.payloads.push_back(
        gpu_testing::to_device(p.payload[r][i], p.payloads[i].dtype, dims, device));
  }
  return in;
}

A2aDispatchArgs dispatch_args(const A2aProblem& p, const DeviceInputs& in, cudaStream_t stream) {
  A2aDispatchArgs args;
  args.topk_idx = in.topk;
  for (const Tensor& t : in.payloads) args.payloads.push_back(t);
  args.runtime_max_tokens_per_rank = p.runtime_max;
  args.invalid_expert_id = p.invalid_expert_id;
  args.expert_id_payload_index = p.expert_id_payload_index;
  args.stream = stream;
  return args;
}

// One dispatch + combine cycle of problem p on rank r. Returns "" or what went wrong.
std::string run_cycle(A2a& a2a, const A2aProblem& p, int r, const CycleOptions& o,
                      cudaStream_t stream, int device) {
  const int R = p.num_ranks;
  const int64_t M = p.runtime_max, H = p.hidden;
  DeviceInputs in = upload_inputs(p, r, o.topk_int64, device);
  A2aDispatchResult res = a2a.dispatch(dispatch_args(p, in, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  a2a.check();
  const A2aExpected ex = testing::a2a_oracle(p, r);
  HostDispatch got = to_host(res);
  std::string err = testing::a2a_compare_dispatch(p, r, ex, got.views, false);
  for (const TensorView& v : res.recv) {
    if (v.device != Device::cuda(device)) err += "\n  recv view on " + v.device.str();
  }

  const size_t elem = dtype_size(p.combine_dtype);
  const size_t y_bytes = static_cast<size_t>(R * M * H) * elem;
  TensorView ws = a2a.combine_payload_view(M, H, p.combine_dtype);
  Tensor out;
  Tensor y_dev;  // keeps the copy path's y alive until combine finished
  if (o.payload_in_workspace) {
    if (y_bytes)
      CUDA_OK(
          cudaMemcpyAsync(ws.data, p.combine_y[r].data(), y_bytes, cudaMemcpyHostToDevice, stream));
    out = a2a.combine(ws, M, true, stream, poison_allocator());
  } else {
    if (y_bytes) CUDA_OK(cudaMemsetAsync(ws.data, 0xFF, y_bytes, stream));
    const int64_t row_stride = o.strided_y ? H + 3 : H;
    std::vector<uint8_t> y(static_cast<size_t>(R * M * row_stride) * elem + 16, 0xEE);
    for (int64_t row = 0; row < R * M; ++row)
      std::memcpy(y.data() + row * row_stride * elem, p.combine_y[r].data() + row * H * elem,
                  H * elem);
    y_dev = gpu_testing::to_device(y.data(), y.size(), DType::kU8, {static_cast<int64_t>(y.size())},
                                   device);
    TensorView yv =
        TensorView::contiguous(y_dev.data, p.combine_dtype, {R, M, H}, Device::cuda(device));
    yv.strides = {M * row_stride, row_stride, 1};
    out = a2a.combine(yv, M, false, stream, poison_allocator());
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  a2a.check();
  std::vector<uint8_t> out_host = to_host_bytes(out);
  std::string cerr = testing::a2a_compare_combine(p, r, ex, host_view(out_host, out));
  if (!cerr.empty()) err += (err.empty() ? "" : "\n") + cerr;

  // Poison the receive views: the next dispatch must rewrite every valid row and count.
  for (const TensorView& v : res.recv)
    if (v.nbytes()) CUDA_OK(cudaMemsetAsync(v.data, 0xA5, v.nbytes(), stream));
  CUDA_OK(cudaMemsetAsync(res.recv_counts.data, 0xA5, res.recv_counts.nbytes(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  return err;
}

// One case: an A2a built from the first problem's shape, then every cycle in order.
struct Case {
  std::string label;
  std::vector<A2aProblem> problems;
  std::vector<CycleOptions> options;
};

// Runs `cases` on R forked GPU ranks (one group, one A2a object per case). Returns the number
// of failing cycles over all ranks; failures are printed.
// With `one_gpu`, R ranks share GPU 0 (Group::cuda_shared_device).
int run_cases(int R, const std::vector<Case>& cases, bool one_gpu = false) {
  const auto body = [&](const Group& g) {
    const int device = gpu_testing::device_of(g);
    cudaStream_t own = nullptr;
    if (!gpu_testing::rank_stream()) CUDA_OK(cudaStreamCreate(&own));
    cudaStream_t stream = gpu_testing::stream_or(own);
    int bad = 0;
    for (const Case& c : cases) {
      A2a a2a(g, c.problems.front().shape());
      for (size_t i = 0; i < c.problems.size(); ++i) {
        std::string err;
        try {
          err = run_cycle(a2a, c.problems[i], g.rank(), c.options[i], stream, device);
        } catch (const std::exception& e) {
          err = std::string("  exception: ") + e.what();
        }
        if (!err.empty()) {
          std::fprintf(stderr, "%s cycle %zu (%s) rank %d:\n%s\n", c.label.c_str(), i,
                       describe(c.problems[i], c.options[i]).c_str(), g.rank(), err.c_str());
          if (++bad >= 3) return bad;  // one diagnosis is enough
        }
      }
    }
    if (own) cudaStreamDestroy(own);
    return bad;
  };
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body) : run_cuda_ranks(R, body);
}

// ---- problem generation (all in the parent) --------------------------------------------------
// (next_cycle: tests/support/a2a_cycle.h.) The payload kinds differ from the cpu tests': 12-byte
// and 520-byte rows exercise the kernels' 4- and 8-byte vector paths.

A2aPayloadSpec random_payload(std::mt19937_64& rng, int K, bool allow_big) {
  const int n = allow_big ? 13 : 11;
  switch (std::uniform_int_distribution<int>(0, n - 1)(rng)) {
    case 0:
      return {DType::kBF16, {128}};
    case 1:
      return {DType::kI32, {K}, Fill::kExpertIds};
    case 2:
      return {DType::kF32, {K}, Fill::kWeights};
    case 3:
      return {DType::kU8, {128}};
    case 4:
      return {DType::kU8, {12}};  // 12-byte rows: 4-byte vectors
    case 5:
      return {DType::kF8E4M3, {520}};  // 8-byte vectors
    case 6:
      return {DType::kF32, {4}};
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
    default:
      return {DType::kU8, {3584}};
  }
}

A2aProblem random_config(std::mt19937_64& rng, int R, int c) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  A2aProblem p;
  p.num_ranks = R;
  const int ks[] = {1, 8, 9};
  p.top_k = ks[c % 3];
  const int local = c % 4 == 0 ? pick(1, 2) : pick(1, 288 / R);
  p.num_experts = local * R;
  const int num_payloads = 1 + c % 8;
  int num_big = 0;
  for (int i = 0; i < num_payloads; ++i) {
    A2aPayloadSpec s = random_payload(rng, p.top_k, num_big < 2);
    num_big += s.row_bytes() >= 3584;
    p.payloads.push_back(s);
  }
  if (c % 5 == 0) p.payloads.back() = {DType::kI32, {p.top_k}, Fill::kExpertIds};
  p.expert_id_payload_index = -1;
  for (size_t i = 0; i < p.payloads.size(); ++i)
    if (p.payloads[i].fill == Fill::kExpertIds) p.expert_id_payload_index = static_cast<int>(i);
  if (p.expert_id_payload_index >= 0 && pick(0, 9) < 7) {
    const int32_t ids[] = {-1, p.num_experts, 1 << 20};
    p.invalid_expert_id = ids[pick(0, 2)];
  } else if (pick(0, 1) == 0) {
    p.expert_id_payload_index = -1;
  }
  size_t dispatch_bytes = 0;
  for (const auto& s : p.payloads) {
    p.payload_bytes_per_token.push_back(s.row_bytes() + (pick(0, 3) == 0 ? 4 * pick(1, 8) : 0));
    dispatch_bytes += p.payload_bytes_per_token.back();
  }
  const int64_t hs[] = {1, 2, 33, 128, 256, 7168};
  p.hidden = hs[c % 6];
  const DType combine_dtypes[] = {DType::kBF16, DType::kF32, DType::kF16};
  p.combine_dtype = combine_dtypes[(c / 6) % 3];  // each with every H of hs
  const size_t hb = static_cast<size_t>(p.hidden) * dtype_size(p.combine_dtype);
  p.combine_bytes_per_token = (hb + 3) / 4 * 4 + (pick(0, 3) == 0 ? 4 * pick(1, 16) : 0);
  const size_t budget = size_t{24} << 20;
  const int64_t budget_max = std::max<int64_t>(
      1, static_cast<int64_t>(
             budget / (static_cast<size_t>(R * R) * (dispatch_bytes + p.combine_bytes_per_token))));
  const int64_t want = pick(0, 4) == 0 ? pick(1, 300) : pick(1, 40);
  p.max_tokens_per_rank = std::min(want, budget_max);
  return p;
}

CycleOptions option_for(int c) {
  CycleOptions o;
  o.payload_in_workspace = c % 2 == 0;
  o.topk_int64 = c % 4 == 1;
  o.strided_y = c % 4 == 3;
  return o;
}

std::vector<Case> random_cases(int R, int num_cases, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  for (int c = 0; c < num_cases; ++c) {
    const A2aProblem config = random_config(rng, R, c);
    Case k;
    k.label = "random case " + std::to_string(c);
    for (int i = 0; i < 3; ++i) {
      k.problems.push_back(next_cycle(config, rng));
      k.options.push_back(option_for(c + i));
    }
    cases.push_back(std::move(k));
  }
  return cases;
}

// ---- tests -----------------------------------------------------------------------------------

class A2aGpu : public ::testing::TestWithParam<int> {};

TEST_P(A2aGpu, RandomMatchesOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  EXPECT_EQ(run_cases(R, random_cases(R, 36, 20241130 + R)), 0);
}

// Engines' payloads [x, x_scale, topk_ids, topk_weights] with sanitised padding, every routing.
TEST_P(A2aGpu, EnginePayloadsEveryRouting) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::mt19937_64 rng(7 + R);
  std::vector<Case> cases;
  int c = 0;
  for (Routing routing : testing::all_routings()) {
    const int kind = c++ % 3;  // bf16, fp8 block-128, nvfp4
    A2aProblem p;
    p.num_ranks = R;
    p.top_k = 8;
    p.num_experts = 256;
    const int64_t H = 7168;
    if (kind == 0) {
      p.payloads = {{DType::kBF16, {H}}, {DType::kF32, {1}}};  // bf16 x, a per-token scale
    } else if (kind == 1) {
      p.payloads = {{DType::kF8E4M3, {H}}, {DType::kF32, {H / 128}}};
    } else {
      p.payloads = {{DType::kU8, {H / 2}}, {DType::kU8, {H / 16}}};
    }
    p.expert_id_payload_index = static_cast<int>(p.payloads.size());
    p.payloads.push_back({DType::kI32, {p.top_k}, Fill::kExpertIds});
    p.payloads.push_back({DType::kF32, {p.top_k}, Fill::kWeights});
    p.invalid_expert_id = p.num_experts;
    p.hidden = H;
    p.combine_dtype = DType::kBF16;
    p.max_tokens_per_rank = 160;
    Case k;
    k.label = std::string("engine ") + testing::routing_name(routing);
    k.problems = {next_cycle(p, rng, routing), next_cycle(p, rng, routing)};
    k.options = {{true, false, false}, {false, false, false}};
    cases.push_back(std::move(k));
  }
  EXPECT_EQ(run_cases(R, cases), 0);
}

TEST_P(A2aGpu, ZeroTokensAndDifferentTokensPerRank) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::mt19937_64 rng(3);
  A2aProblem config;
  config.num_ranks = R;
  config.top_k = 8;
  config.num_experts = 16 * R;
  config.payloads = {{DType::kBF16, {256}}, {DType::kI32, {8}, Fill::kExpertIds}};
  config.expert_id_payload_index = 1;
  config.invalid_expert_id = -1;
  config.hidden = 256;
  config.max_tokens_per_rank = 96;
  Case k;
  k.label = "zero tokens";
  auto with_tokens = [&](std::vector<int64_t> tokens, int64_t M) {
    A2aProblem p = config;
    p.num_tokens = tokens;
    p.runtime_max = M;
    testing::fill_a2a_inputs(p, std::vector<Routing>(R, Routing::kUniform), rng);
    return p;
  };
  std::vector<int64_t> zero(R, 0), ramp(R, 0), one_empty(R, 90);
  for (int r = 0; r < R; ++r) ramp[r] = 1 + 40 * r % 95;  // 1, 41, 81, 26, ... <= 91
  one_empty[0] = 0;
  k.problems = {with_tokens(zero, 0),  with_tokens(zero, 3),
                with_tokens(ramp, 96), with_tokens(one_empty, 90),
                with_tokens(zero, 0),  with_tokens(ramp, std::min(41 * R, 96))};
  for (size_t i = 0; i < k.problems.size(); ++i)
    k.options.push_back(option_for(static_cast<int>(i)));
  EXPECT_EQ(run_cases(R, {k}), 0);
}

// CUDA graph: dispatch + snapshot copies + the "MoE" (y into the workspace, or the copy path) +
// combine captured once, replayed on new inputs written into the captured input buffers.
TEST_P(A2aGpu, GraphReplayOnNewInputs) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  constexpr int kReplaysInWorkspace = 100, kReplaysCopy = 20;
  std::mt19937_64 rng(11);
  A2aProblem config;
  config.num_ranks = R;
  config.top_k = 8;
  config.num_experts = 32 * R;
  config.payloads = {{DType::kBF16, {256}},
                     {DType::kU8, {20}},
                     {DType::kI32, {8}, Fill::kExpertIds},
                     {DType::kF32, {8}, Fill::kWeights}};
  config.expert_id_payload_index = 2;
  config.invalid_expert_id = -1;
  config.hidden = 256;
  config.max_tokens_per_rank = 64;
  config.runtime_max = 64;
  config.num_tokens.resize(R);
  for (int r = 0; r < R; ++r) config.num_tokens[r] = 37 + 11 * r % 28;  // 37, 48, 59, 42, ... <= 64
  const std::vector<Routing> all = testing::all_routings();
  std::vector<A2aProblem> problems;
  for (int i = 0; i < kReplaysInWorkspace + kReplaysCopy; ++i) {
    A2aProblem p = config;
    std::vector<Routing> routing;
    for (int r = 0; r < R; ++r) routing.push_back(all[(i + r) % all.size()]);
    testing::fill_a2a_inputs(p, routing, rng);
    problems.push_back(std::move(p));
  }

  const int rc = run_cuda_ranks(R, [&](const Group& g) {
    const int r = g.rank(), device = r;
    const int64_t T = config.num_tokens[r], M = config.runtime_max, H = config.hidden, K = 8;
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    A2a a2a(g, config.shape());
    DeviceInputs in = upload_inputs(problems[0], r, false, device);
    const size_t y_bytes = static_cast<size_t>(R * M * H) * 2;
    Tensor y_in = gpu_testing::to_device(problems[0].combine_y[r].data(), y_bytes, DType::kBF16,
                                         {R, M, H}, device);
    Tensor out_buf = default_allocator()(DType::kBF16, {T, H}, Device::cuda(device));
    const Allocator fixed = [&](DType, const std::vector<int64_t>&, Device) { return out_buf; };
    // Snapshots of the views, allocated before capture (no cudaMalloc while capturing).
    std::vector<Tensor> snap;
    for (const A2aPayloadSpec& spec : config.payloads) {
      std::vector<int64_t> dims = {R, M};
      dims.insert(dims.end(), spec.row_shape.begin(), spec.row_shape.end());
      snap.push_back(default_allocator()(spec.dtype, dims, Device::cuda(device)));
    }
    snap.push_back(default_allocator()(DType::kI32, {R}, Device::cuda(device)));
    int bad = 0;
    for (int mode = 0; mode < 2; ++mode) {
      const bool in_ws = mode == 0;
      // Capture.
      cudaGraph_t graph = nullptr;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      A2aDispatchResult res = a2a.dispatch(dispatch_args(problems[0], in, stream));
      for (size_t i = 0; i < res.recv.size(); ++i)
        CUDA_OK(cudaMemcpyAsync(snap[i].data, res.recv[i].data, res.recv[i].nbytes(),
                                cudaMemcpyDeviceToDevice, stream));
      CUDA_OK(cudaMemcpyAsync(snap.back().data, res.recv_counts.data, 4 * R,
                              cudaMemcpyDeviceToDevice, stream));
      TensorView ws = a2a.combine_payload_view(M, H, DType::kBF16);
      if (in_ws) {
        CUDA_OK(cudaMemcpyAsync(ws.data, y_in.data, y_bytes, cudaMemcpyDeviceToDevice, stream));
        a2a.combine(ws, M, true, stream, fixed);
      } else {
        a2a.combine(y_in, M, false, stream, fixed);
      }
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

      const int first = in_ws ? 0 : kReplaysInWorkspace;
      const int last = in_ws ? kReplaysInWorkspace : kReplaysInWorkspace + kReplaysCopy;
      for (int i = first; i < last && bad < 3; ++i) {
        const A2aProblem& p = problems[i];
        // New inputs into the captured buffers; poisoned outputs.
        CUDA_OK(cudaMemcpyAsync(in.topk.data, p.topk_idx[r].data(), 4 * T * K,
                                cudaMemcpyHostToDevice, stream));
        for (size_t j = 0; j < p.payloads.size(); ++j)
          CUDA_OK(cudaMemcpyAsync(in.payloads[j].data, p.payload[r][j].data(),
                                  p.payload[r][j].size(), cudaMemcpyHostToDevice, stream));
        CUDA_OK(cudaMemcpyAsync(y_in.data, p.combine_y[r].data(), y_bytes, cudaMemcpyHostToDevice,
                                stream));
        for (const Tensor& s : snap) CUDA_OK(cudaMemsetAsync(s.data, 0xA5, s.nbytes(), stream));
        CUDA_OK(cudaMemsetAsync(out_buf.data, 0xFF, out_buf.nbytes(), stream));
        // (The combine region is not poisoned here: peers may still be pulling from it for the
        // previous replay until this replay's dispatch; run_cycle poisons it after dispatch.)
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        std::string err;
        try {
          a2a.check();
          const A2aExpected ex = testing::a2a_oracle(p, r);
          HostDispatch got;
          for (size_t j = 0; j + 1 < snap.size(); ++j) {
            got.bytes.push_back(to_host_bytes(snap[j]));
          }
          got.bytes.push_back(to_host_bytes(snap.back()));
          for (size_t j = 0; j + 1 < snap.size(); ++j)
            got.views.recv.push_back(host_view(got.bytes[j], snap[j]));
          got.views.recv_counts = host_view(got.bytes.back(), snap.back());
          err = testing::a2a_compare_dispatch(p, r, ex, got.views, false);
          std::vector<uint8_t> out_host = to_host_bytes(out_buf);
          const std::string cerr =
              testing::a2a_compare_combine(p, r, ex, host_view(out_host, out_buf));
          if (!cerr.empty()) err += (err.empty() ? "" : "\n") + cerr;
        } catch (const std::exception& e) {
          err = std::string("exception: ") + e.what();
        }
        if (!err.empty()) {
          ++bad;
          std::fprintf(stderr, "graph replay %d (%s) rank %d:\n%s\n", i, in_ws ? "in_ws" : "copy",
                       r, err.c_str());
        }
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    cudaStreamDestroy(stream);
    return bad;
  });
  EXPECT_EQ(rc, 0);
}

// Out-of-range expert ids are found on the device and raised as InvalidArgument by check(); the
// selection is dropped, the collective completes and the object stays usable.
TEST_P(A2aGpu, BadExpertIdIsInvalidArgumentAndDropped) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  std::mt19937_64 rng(5);
  A2aProblem p;
  p.num_ranks = R;
  p.top_k = 4;
  p.num_experts = 8 * R;
  p.payloads = {{DType::kBF16, {64}}, {DType::kI32, {4}, Fill::kExpertIds}};
  p.expert_id_payload_index = 1;
  p.invalid_expert_id = -1;
  p.hidden = 64;
  p.max_tokens_per_rank = 32;
  p.runtime_max = 32;
  p.num_tokens.assign(R, 20);
  testing::fill_a2a_inputs(p, std::vector<Routing>(R, Routing::kUniform), rng);
  A2aProblem bad = p;  // rank 0 sends ids E and -7; the oracle sees them as -1
  bad.topk_idx[0][3 * 4 + 2] = p.num_experts;
  bad.topk_idx[0][9 * 4 + 0] = -7;
  A2aProblem dropped = bad;
  dropped.topk_idx[0][3 * 4 + 2] = -1;
  dropped.topk_idx[0][9 * 4 + 0] = -1;
  // The expert-id payload travels as sent (it is opaque to the library).
  const int rc = run_cuda_ranks(R, [&](const Group& g) {
    const int r = g.rank();
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreate(&stream));
    A2a a2a(g, p.shape());
    int failures = 0;
    auto fail = [&](const std::string& what) {
      std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
      ++failures;
    };
    DeviceInputs in = upload_inputs(bad, r, false, r);
    A2aDispatchResult res = a2a.dispatch(dispatch_args(bad, in, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    try {
      a2a.check();
      if (r == 0) fail("check() did not raise for an out-of-range expert id");
    } catch (const Error& e) {
      const std::string m = e.what();
      if (r != 0 || e.code() != ErrorCode::kInvalidArgument ||
          m.find("'topk_idx'") == std::string::npos)
        fail("unexpected error: " + m);
    }
    const A2aExpected ex = testing::a2a_oracle(dropped, r);
    HostDispatch got = to_host(res);
    std::string err = testing::a2a_compare_dispatch(dropped, r, ex, got.views, false);
    if (!err.empty()) fail("dispatch with a dropped selection:\n" + err);
    TensorView ws = a2a.combine_payload_view(p.runtime_max, p.hidden, DType::kBF16);
    CUDA_OK(cudaMemcpy(ws.data, dropped.combine_y[r].data(), dropped.combine_y[r].size(),
                       cudaMemcpyHostToDevice));
    Tensor out = a2a.combine(ws, p.runtime_max, true, stream, poison_allocator());
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> out_host = to_host_bytes(out);
    err = testing::a2a_compare_combine(dropped, r, ex, host_view(out_host, out));
    if (!err.empty()) fail("combine after a dropped selection:\n" + err);
    // A clean cycle afterwards.
    err = run_cycle(a2a, p, r, {}, stream, r);
    if (!err.empty()) fail("clean cycle after the error:\n" + err);
    cudaStreamDestroy(stream);
    return failures;
  });
  EXPECT_EQ(rc, 0);
}

// A rank that uses another runtime_max_tokens_per_rank than its peers: InvalidArgument on every
// rank (found on the device), then a consistent call works again.
TEST(A2aGpuErrors, RuntimeMaxDifferingAcrossRanks) {
  EPX_REQUIRE_GPUS(2);
  std::mt19937_64 rng(9);
  A2aProblem p;
  p.num_ranks = 2;
  p.top_k = 2;
  p.num_experts = 8;
  p.payloads = {{DType::kF32, {16}}};
  p.hidden = 16;
  p.max_tokens_per_rank = 16;
  p.runtime_max = 12;
  p.num_tokens = {5, 7};
  testing::fill_a2a_inputs(p, {Routing::kUniform, Routing::kUniform}, rng);
  const int rc = run_cuda_ranks(2, [&](const Group& g) {
    const int r = g.rank();
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreate(&stream));
    A2a a2a(g, p.shape());
    int failures = 0;
    DeviceInputs in = upload_inputs(p, r, false, r);
    A2aDispatchArgs args = dispatch_args(p, in, stream);
    args.runtime_max_tokens_per_rank = r == 0 ? 8 : 9;
    a2a.dispatch(args);
    CUDA_OK(cudaStreamSynchronize(stream));
    try {
      a2a.check();
      std::fprintf(stderr, "rank %d: no error for differing runtime_max\n", r);
      ++failures;
    } catch (const Error& e) {
      const std::string m = e.what();
      if (e.code() != ErrorCode::kInvalidArgument ||
          m.find("runtime_max_tokens_per_rank") == std::string::npos) {
        std::fprintf(stderr, "rank %d: unexpected error %s\n", r, m.c_str());
        ++failures;
      }
    }
    const int64_t M = args.runtime_max_tokens_per_rank;
    TensorView ws = a2a.combine_payload_view(M, p.hidden, p.combine_dtype);
    a2a.combine(ws, M, true, stream, poison_allocator());
    CUDA_OK(cudaStreamSynchronize(stream));
    a2a.check();
    const std::string err = run_cycle(a2a, p, r, {}, stream, r);
    if (!err.empty()) {
      std::fprintf(stderr, "rank %d: clean cycle after the error:\n%s\n", r, err.c_str());
      ++failures;
    }
    cudaStreamDestroy(stream);
    return failures;
  });
  EXPECT_EQ(rc, 0);
}

// A peer that never calls dispatch: the waiting rank's kernel gives up after the group timeout,
// check() raises Timeout (naming the operation and the peer), and later calls say why the object
// is unusable. No hang, no trap.
TEST(A2aGpuErrors, MissingPeerIsTimeout) {
  EPX_REQUIRE_GPUS(2);
  std::mt19937_64 rng(13);
  A2aProblem p;
  p.num_ranks = 2;
  p.top_k = 2;
  p.num_experts = 4;
  p.payloads = {{DType::kBF16, {32}}};
  p.hidden = 32;
  p.max_tokens_per_rank = 8;
  p.runtime_max = 8;
  p.num_tokens = {6, 6};
  testing::fill_a2a_inputs(p, {Routing::kUniform, Routing::kUniform}, rng);
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  // Rank 1 stays alive (without dispatching) until rank 0 wrote this file, so that both reach
  // the destructors' barrier together.
  const std::string done_path = "/tmp/epx-a2a-timeout-" + std::to_string(getpid());
  std::remove(done_path.c_str());
  const int rc = run_cuda_ranks(
      2,
      [&](const Group& g) {
        const int r = g.rank();
        A2a a2a(g, p.shape());
        if (r == 1) {
          for (int i = 0; i < 3000 && access(done_path.c_str(), F_OK) != 0; ++i)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          return 0;
        }
        struct Done {
          std::string path;
          ~Done() { std::fclose(std::fopen(path.c_str(), "w")); }
        } done{done_path};
        int failures = 0;
        DeviceInputs in = upload_inputs(p, r, false, r);
        const auto start = std::chrono::steady_clock::now();
        a2a.dispatch(dispatch_args(p, in, nullptr));
        CUDA_OK(cudaDeviceSynchronize());
        const double waited =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        try {
          a2a.check();
          std::fprintf(stderr, "rank 0: no Timeout\n");
          ++failures;
        } catch (const Error& e) {
          const std::string m = e.what();
          if (e.code() != ErrorCode::kTimeout || m.find("a2a dispatch") == std::string::npos ||
              m.find("rank 1") == std::string::npos) {
            std::fprintf(stderr, "rank 0: unexpected error %s\n", m.c_str());
            ++failures;
          }
        }
        if (waited < 1.2 || waited > 10) {
          std::fprintf(stderr, "rank 0: the kernel gave up after %.2f s, expected ~1.5 s\n",
                       waited);
          ++failures;
        }
        try {
          a2a.dispatch(dispatch_args(p, in, nullptr));
          std::fprintf(stderr, "rank 0: dispatch after a timeout did not raise\n");
          ++failures;
        } catch (const Error& e) {
          if (std::string(e.what()).find("unusable") == std::string::npos) {
            std::fprintf(stderr, "rank 0: unexpected error %s\n", e.what());
            ++failures;
          }
        }
        return failures;
      },
      options);
  std::remove(done_path.c_str());
  EXPECT_EQ(rc, 0);
}

// Workspace size: within FlashInfer's formula R * max * (D + C) plus a small auxiliary part
// (the a2a memory target, docs/perf.md §3). Host arithmetic only; no GPU needed.
A2aShape engine_shape() {
  A2aShape s;
  s.max_tokens_per_rank = 4096;
  s.top_k = 8;
  s.num_experts = 256;
  s.payload_bytes_per_token = {7168 * 2, 32, 32};
  s.combine_bytes_per_token = 7168 * 2;
  return s;
}

TEST(A2aGpuWorkspace, BytesStayNearFlashInferFormula) {
  const A2aShape s = engine_shape();
  for (int R : {1, 2, 8}) {
    const size_t bytes = A2a::workspace_bytes(s, R, Backend::kCuda);
    const size_t D = 7168 * 2 + 64, C = 7168 * 2;
    const size_t formula = static_cast<size_t>(R) * 4096 * (D + C);
    EXPECT_GE(bytes, formula) << "R=" << R;
    EXPECT_LE(bytes, formula + 4096 * (8 + 4 * static_cast<size_t>(R)) + (64 << 10)) << "R=" << R;
  }
}

// What A2a::workspace_bytes promises is what a rank allocates.
TEST(A2aGpuWorkspace, BytesAllocatedMatchWorkspaceBytes) {
  EPX_REQUIRE_GPUS(1);
  const A2aShape s = engine_shape();
  const int rc = run_cuda_ranks(1, [&](const Group& g) {
    A2a a2a(g, s);
    return a2a.bytes_allocated() == A2a::workspace_bytes(s, 1, Backend::kCuda) ? 0 : 1;
  });
  EXPECT_EQ(rc, 0);
}

// f16 combine: the hand-worked sums of f16_sum_cases (overflow to +-inf, subnormal results, ties,
// one rounding in rank order, NaN; tests/unit/a2a_test.cc checks the oracle's bits against the
// hand values), with H giving rows of 34, 36, 40 and 48 bytes: the kernel's 2-, 4-, 8- and
// 16-byte vector paths; copy, in-workspace and strided y.
std::vector<Case> f16_sum_runs(int R) {
  std::vector<Case> cases;
  for (int64_t H : {17, 18, 20, 24}) {
    Case k;
    k.label = "f16 sums H=" + std::to_string(H);
    const A2aProblem p = testing::f16_sum_problem(R, H);
    k.problems = {p, p, p};
    k.options = {{false}, {true}, {false, true, true}};
    cases.push_back(std::move(k));
  }
  return cases;
}

TEST_P(A2aGpu, F16SumsMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  EXPECT_EQ(run_cases(R, f16_sum_runs(R)), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, A2aGpu, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

// R ranks as threads sharing GPU 0 (Group::cuda_shared_device, issue 8): EP4 and EP8 before
// machines with that many GPUs.
class A2aOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(A2aOneGpu, RandomMatchesOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  // 18 cases: random_config gives case c the H hs[c % 6] and the combine dtype of c / 6, so each
  // of bf16, f32 and f16 meets every H (the first 16 cases are those of 16 cases).
  EXPECT_EQ(run_cases(R, random_cases(R, 18, 20250800 + R), /*one_gpu=*/true), 0);
}

TEST_P(A2aOneGpu, F16SumsMatchOracle) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_cases(R, f16_sum_runs(R), /*one_gpu=*/true), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, A2aOneGpu, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace epx
