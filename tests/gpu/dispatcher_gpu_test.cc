// GPU tier: the Dispatcher on cuda tensors against the Dispatcher on the cpu backend. Skipped,
// with the reason, where fewer GPUs than ranks are visible.
//
// The same sequence of calls (a2a with bf16/fp8/fp8_ue8m0/nvfp4, deepep auto with ht/ll switches,
// ll NVFP4, worst-case ht, int32 topk, T = 0 ranks) on the cpu backend (threads, in the parent)
// and on R = 1, 2, 4, 8 forked cuda ranks, on the legacy default stream and on a created one;
// every valid received row, scale, routing row, masked_m, combine output and the expert load
// after every call must be identical (ll's rows and scales read through their views), and ht's
// UE8M0 x_scale storage (MN-major, TMA-aligned, padding included) byte for byte. The cpu run's
// expert load is also checked against a count from the routing.
// Then the capturable paths (ll with and without hooks, auto, a2a, ht worst-case) captured in a
// CUDA graph on a side stream and replayed on new inputs, every replay checked; ht exact mode
// must refuse capture.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "epx/epx.h"
#include "gpu/gpu_support.h"
#include "support/harness.h"
#include "support/routing.h"

namespace epx {
namespace {

using gpu_testing::diff_bytes;
using gpu_testing::logical_bytes;
using gpu_testing::storage_bytes;
using testing::make_x;

// ---- the Dispatcher on cuda vs on cpu
// -------------------------------------------------------------

struct DispCase {
  std::string name;
  DispatcherBackend backend;
  DispatchMode mode;
  DispatchQuant quant;
  int64_t num_worst_tokens;  // in units of R * T_max (0 or 1)
  bool hook;
  bool topk_i32;
};

constexpr int kE = 8, kK = 4, kCalls = 6;
constexpr int64_t kH = 640, kTMax = 24;  // H / 128 = 5 groups: a partial UE8M0 word

struct RankCall {
  std::vector<uint16_t> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  int64_t T = 0;
};

struct Problem {
  int R = 1;
  std::vector<std::vector<RankCall>> calls;  // [call][rank]
  std::vector<ForwardMode> modes;            // [call]
};

// `graph`: decode calls only, each rank's T the same in every call (a captured graph's shapes).
Problem make_problem(int R, uint64_t seed, int num_calls = kCalls, bool graph = false) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.R = R;
  const auto routings = testing::all_routings();
  for (int c = 0; c < num_calls; ++c) {
    p.modes.push_back(graph || c % 3 == 1 ? ForwardMode::kDecode : ForwardMode::kExtend);
    std::vector<RankCall> ranks;
    for (int r = 0; r < R; ++r) {
      RankCall rc;
      if (graph)
        rc.T = kTMax - (7 * r) % kTMax;  // R <= 4 as before; never negative
      else
        rc.T = (c + r) % 4 == 3 ? 0 : static_cast<int64_t>(1 + rng() % kTMax);
      rc.x = make_x(rc.T, kH, rng);
      rc.idx = testing::make_topk_idx(routings[(c + r) % routings.size()], rc.T, kK, kE, R, rng,
                                      static_cast<int>(rng() % kE));
      rc.w = testing::make_topk_weights(rc.idx, rng);
      ranks.push_back(std::move(rc));
    }
    p.calls.push_back(std::move(ranks));
  }
  return p;
}

// Tokens each source sends to `rank` in call c (a2a counts; their sum is ht's N).
std::vector<int64_t> tokens_to(const Problem& p, int c, int rank) {
  const int L = kE / p.R;
  std::vector<int64_t> n(p.R, 0);
  for (int s = 0; s < p.R; ++s) {
    const RankCall& rc = p.calls[c][s];
    for (int64_t t = 0; t < rc.T; ++t) {
      bool any = false;
      for (int k = 0; k < kK; ++k) any |= rc.idx[t * kK + k] >= 0 && rc.idx[t * kK + k] / L == rank;
      n[s] += any;
    }
  }
  return n;
}

// Expert load of `rank` implied by the routing of calls [from, to).
std::vector<int64_t> routing_load(const Problem& p, int rank, int from, int to) {
  const int L = kE / p.R;
  std::vector<int64_t> load(L, 0);
  for (int c = from; c < to; ++c)
    for (const RankCall& rc : p.calls[c])
      for (int64_t t = 0; t < rc.T; ++t)
        for (int l = 0; l < L; ++l) {
          bool sel = false;
          for (int k = 0; k < kK; ++k) sel |= rc.idx[t * kK + k] == rank * L + l;
          load[l] += sel;
        }
  return load;
}

using Records = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

// Rows [begin, begin + n) of a logical byte image with `rows` rows.
std::vector<uint8_t> row_range(const std::vector<uint8_t>& all, int64_t rows, int64_t begin,
                               int64_t n) {
  if (rows == 0 || n == 0) return {};
  const size_t rb = all.size() / static_cast<size_t>(rows);
  return std::vector<uint8_t>(all.begin() + begin * rb, all.begin() + (begin + n) * rb);
}

std::vector<uint8_t> as_bytes(const std::vector<int64_t>& v) {
  std::vector<uint8_t> b(v.size() * 8);
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

DispatcherConfig disp_config(const DispCase& dc, int R) {
  DispatcherConfig cfg;
  cfg.num_experts = kE;
  cfg.hidden = kH;
  cfg.top_k = kK;
  cfg.max_tokens_per_rank = kTMax;
  cfg.backend = dc.backend;
  cfg.mode = dc.mode;
  cfg.quant = dc.quant;
  cfg.num_worst_tokens = dc.num_worst_tokens * R * kTMax;
  cfg.return_recv_hook = dc.hook;
  return cfg;
}

// Host bytes -> `t` (cpu or cuda; cuda: queued on `stream`, then waited for).
void copy_in(const TensorView& t, const void* data, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (t.device.type == DeviceType::kCpu) {
    std::memcpy(t.data, data, bytes);
    return;
  }
  CUDA_OK(cudaMemcpyAsync(t.data, data, bytes, cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}

// `t` exists with exactly `shape` (then it is reused: the captured tensors of a graph run keep
// their addresses; eager calls whose shapes change get new ones).
bool same_shape(const Tensor& t, const std::vector<int64_t>& shape) {
  if (!t.defined() || t.ndim != static_cast<int>(shape.size())) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (t.shape[i] != shape[i]) return false;
  return true;
}

// One call's inputs as tensors on `device` (new ones, or the captured ones in `into`).
struct CallTensors {
  Tensor x, idx, w, y;
};

void load_inputs(CallTensors& t, const RankCall& in, bool topk_i32, Device device,
                 cudaStream_t stream) {
  auto make = [&](Tensor& dst, DType dtype, std::vector<int64_t> shape) {
    if (!same_shape(dst, shape)) dst = default_allocator()(dtype, shape, device);
  };
  make(t.x, DType::kBF16, {in.T, kH});
  make(t.idx, topk_i32 ? DType::kI32 : DType::kI64, {in.T, kK});
  make(t.w, DType::kF32, {in.T, kK});
  copy_in(t.x, in.x.data(), in.x.size() * 2, stream);
  if (topk_i32) {
    std::vector<int32_t> idx32(in.idx.begin(), in.idx.end());
    copy_in(t.idx, idx32.data(), idx32.size() * 4, stream);
  } else {
    copy_in(t.idx, in.idx.data(), in.idx.size() * 8, stream);
  }
  copy_in(t.w, in.w.data(), in.w.size() * 4, stream);
}

// The expert outputs of call c on rank r for `out` (random, from the call's seed) into t.y.
void load_y(CallTensors& t, const DispatchOutput& out, int R, int c, int r, Device device,
            cudaStream_t stream) {
  std::vector<int64_t> shape;
  if (out.format == OutputFormat::kA2a) shape = {R, kTMax, kH};
  if (out.format == OutputFormat::kHt) shape = {out.x.shape[0], kH};
  if (out.format == OutputFormat::kLl) shape = {kE / R, R * kTMax, kH};
  if (!same_shape(t.y, shape)) t.y = default_allocator()(DType::kBF16, shape, device);
  std::mt19937_64 yrng(1000003ull * c + r);
  const std::vector<uint16_t> yh = testing::make_bf16(t.y.numel() / kH, kH, yrng);
  copy_in(t.y, yh.data(), yh.size() * 2, stream);
}

// ll: every valid row (rows < masked_m[l]) of x and x_scale, element by element through the
// views ([L, RT, cols], or NVFP4's (RT, H/2, L) and (32, 4, rm, 4, rk, L) of epx/ll.h).
void record_ll_rows(Records& rec, const std::string& tag, const DispatchOutput& out, int R) {
  const std::vector<uint8_t> masked = logical_bytes(out.masked_m);
  const int L = kE / R;
  const int64_t RT = R * kTMax;
  const bool nvfp4 = out.x.dtype == DType::kU8;
  const std::pair<const char*, const TensorView*> views[] = {{"x", &out.x},
                                                             {"x_scale", &out.x_scale}};
  for (const auto& [name, t] : views) {
    if (!t->defined()) continue;
    const bool is_x = t == &out.x;
    const std::vector<uint8_t> all = logical_bytes(*t);
    const size_t es = dtype_size(t->dtype);
    const int64_t cols = !nvfp4 ? t->shape[2] : is_x ? kH / 2 : kH / 16;
    std::vector<uint8_t> rows;
    for (int l = 0; l < L; ++l) {
      int32_t n = 0;
      std::memcpy(&n, masked.data() + 4 * l, 4);
      for (int64_t row = 0; row < n; ++row)
        for (int64_t c = 0; c < cols; ++c) {
          int64_t e = (l * RT + row) * cols + c;  // the element's logical index
          if (nvfp4 && is_x) e = (row * cols + c) * L + l;
          if (nvfp4 && !is_x) {
            // (row % 32, row % 128 / 32, row / 128, c % 4, c / 4, l) of (32, 4, rm, 4, rk, L)
            const int64_t rm = t->shape[2], rk = t->shape[4];
            const int64_t row_part = (row % 32 * 4 + row % 128 / 32) * rm + row / 128;
            e = ((row_part * 4 + c % 4) * rk + c / 4) * L + l;
          }
          rows.insert(rows.end(), all.begin() + e * es, all.begin() + (e + 1) * es);
        }
    }
    rec.emplace_back(tag + name + " valid rows", rows);
  }
}

// The NVFP4 global scale the calls pass (nullopt without NVFP4).
std::optional<float> global_scale_of(const DispCase& dc) {
  return dc.quant == DispatchQuant::kNvfp4 ? std::optional<float>(1.5f) : std::nullopt;
}

// What call c's outputs must agree on between the cpu and the cuda runs.
void record_outputs(Records& rec, const DispatcherConfig& cfg, const Problem& p, int c, int r,
                    const DispatchOutput& out) {
  const int R = p.R;
  auto put = [&](const std::string& what, const TensorView& t) {
    rec.emplace_back(what, t.defined() ? logical_bytes(t) : std::vector<uint8_t>{});
  };
  const std::string tag = "call " + std::to_string(c) + " ";
  rec.emplace_back(tag + "format", std::vector<uint8_t>{static_cast<uint8_t>(out.format)});
  const std::vector<int64_t> from = tokens_to(p, c, r);
  if (out.format == OutputFormat::kA2a) {
    // Valid rows of every source; the routing payload whole (padding rows must be -1).
    const int64_t M = kTMax;
    const std::pair<const char*, const TensorView*> rows_of[] = {
        {"x", &out.x}, {"x_scale", &out.x_scale}, {"topk_weights", &out.topk_weights}};
    for (const auto& [name, t] : rows_of) {
      if (!t->defined()) continue;
      const std::vector<uint8_t> all = logical_bytes(*t);
      for (int s = 0; s < R; ++s)
        rec.emplace_back(tag + name + " from " + std::to_string(s),
                         row_range(all, R * M, s * M, from[s]));
    }
    put(tag + "topk_idx", out.topk_idx);
  } else if (out.format == OutputFormat::kHt) {
    int64_t N = 0;
    for (int64_t n : from) N += n;
    const int64_t rows = out.x.shape[0];
    if (rows != (cfg.num_worst_tokens > 0 ? cfg.num_worst_tokens : N))
      throw std::runtime_error(tag + "ht returned " + std::to_string(rows) + " rows, expected " +
                               std::to_string(cfg.num_worst_tokens > 0 ? cfg.num_worst_tokens : N));
    rec.emplace_back(tag + "x", row_range(logical_bytes(out.x), rows, 0, N));
    if (out.x_scale.defined())
      rec.emplace_back(tag + "x_scale", row_range(logical_bytes(out.x_scale), rows, 0, N));
    if (out.x_scale.defined() && out.x_scale.dtype == DType::kI32) {
      // UE8M0: MN-major, TMA-aligned (strides {1, align4(rows)}); the whole storage
      // [W, align4(rows)] byte for byte, padding and worst-case rows (0) included.
      const int64_t M = out.x_scale.strides[1];
      if (out.x_scale.strides[0] != 1 || M != (rows + 3) / 4 * 4)
        throw std::runtime_error(tag + "ht UE8M0 x_scale has strides " + out.x_scale.describe() +
                                 ", expected {1, align4(rows)}");
      rec.emplace_back(tag + "x_scale storage",
                       storage_bytes(out.x_scale, out.x_scale.shape[1] * M));
    }
    put(tag + "topk_idx", out.topk_idx);  // rows past N: -1
    rec.emplace_back(tag + "topk_weights", row_range(logical_bytes(out.topk_weights), rows, 0, N));
    std::vector<int64_t> n32(out.num_recv_tokens_per_expert.begin(),
                             out.num_recv_tokens_per_expert.end());
    rec.emplace_back(tag + "num_recv_tokens_per_expert", as_bytes(n32));
  } else {
    put(tag + "masked_m", out.masked_m);
    rec.emplace_back(tag + "expected_m", as_bytes({out.expected_m}));
    record_ll_rows(rec, tag, out, R);
  }
}

// The combine output and the expert load after call c (reset after the middle call).
void record_combine(Records& rec, Dispatcher& d, int c, int num_calls, const TensorView& combined) {
  const std::string tag = "call " + std::to_string(c) + " ";
  rec.emplace_back(tag + "combine out",
                   combined.defined() ? logical_bytes(combined) : std::vector<uint8_t>{});
  rec.emplace_back(tag + "expert_load", as_bytes(d.expert_load()));
  if (c == num_calls / 2) {
    d.reset_expert_load();
    rec.emplace_back(tag + "expert_load after reset", as_bytes(d.expert_load()));
  }
}

// Runs the problem's calls on one rank (cpu or cuda tensors; cuda on `stream`) and records what
// must agree.
Records run_calls(const Group& g, const DispCase& dc, const Problem& p, Device device,
                  cudaStream_t stream = nullptr) {
  const int R = p.R, r = g.rank(), num_calls = static_cast<int>(p.calls.size());
  const DispatcherConfig cfg = disp_config(dc, R);
  Dispatcher d(g, cfg);
  Records rec;
  for (int c = 0; c < num_calls; ++c) {
    CallTensors t;
    load_inputs(t, p.calls[c][r], dc.topk_i32, device, stream);
    DispatchOutput out = d.dispatch(t.x, t.idx, t.w, p.modes[c], global_scale_of(dc), stream);
    record_outputs(rec, cfg, p, c, r, out);
    load_y(t, out, R, c, r, device, stream);
    CombineInput ci;
    ci.y = t.y;  // on the dispatch's stream
    const Tensor combined = d.combine(ci);
    record_combine(rec, d, c, num_calls, combined);
  }
  return rec;
}

// The same calls with call 0 eager and call 1 captured into a CUDA graph on a non-blocking
// stream (global capture mode: any legacy-stream or device-wide synchronisation inside the
// Dispatcher fails the capture); calls 1.. are replays on new inputs copied into the captured
// input tensors. Every rank's T is the same in every call (p from make_graph_problem).
Records run_graph_calls(const Group& g, const DispCase& dc, const Problem& p) {
  const int R = p.R, r = g.rank(), num_calls = static_cast<int>(p.calls.size());
  const Device device = Device::cuda(r);
  DispatcherConfig cfg = disp_config(dc, R);
  gpu_testing::Arena arena;
  cfg.allocator = arena.allocator();
  Dispatcher d(g, cfg);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  CallTensors t;  // the captured inputs
  DispatchOutput out;
  Tensor combined;
  Records rec;
  for (int c = 0; c < num_calls; ++c) {
    load_inputs(t, p.calls[c][r], dc.topk_i32, device, stream);
    if (c <= 1) {
      cudaGraph_t graph = nullptr;
      if (c == 1) {
        arena.replay();
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      }
      out = d.dispatch(t.x, t.idx, t.w, p.modes[c], global_scale_of(dc), stream);
      if (c == 0) load_y(t, out, R, c, r, device, stream);  // allocates the captured y
      CombineInput ci;
      ci.y = t.y;
      combined = d.combine(ci);
      if (c == 1) {
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
    }
    if (c >= 1) {
      load_y(t, out, R, c, r, device, stream);
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    record_outputs(rec, cfg, p, c, r, out);
    record_combine(rec, d, c, num_calls, combined);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaStreamDestroy(stream));
  return rec;
}

// ht exact mode called while its stream is capturing raises Unsupported naming the ways out
// (before queueing anything, on every rank alike: no rank waits for another).
std::string ht_exact_under_capture(const Group& g) {
  DispatcherConfig cfg = disp_config({"ht_exact", DispatcherBackend::kDeepEp,
                                      DispatchMode::kNormal, DispatchQuant::kBf16, 0, false, false},
                                     g.size());
  Dispatcher d(g, cfg);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Problem p = make_problem(g.size(), 7);
  CallTensors t;
  load_inputs(t, p.calls[0][g.rank()], false, Device::cuda(g.rank()), stream);
  std::string err = "ht exact mode under capture did not raise";
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    d.dispatch(t.x, t.idx, t.w, ForwardMode::kExtend, std::nullopt, stream);
  } catch (const Error& e) {
    const std::string what = e.what();
    err = e.code() == ErrorCode::kUnsupported && what.find("num_worst_tokens") != std::string::npos &&
                  what.find("captur") != std::string::npos
              ? ""
              : "unexpected error: " + what;
  }
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  if (err.empty() && std::string(d.stage_name()) != "initial")
    err = std::string("stage after the refused dispatch is ") + d.stage_name();
  CUDA_OK(cudaStreamDestroy(stream));
  return err;
}

std::string compare_records(const Records& want, const Records& got) {
  if (want.size() != got.size())
    return std::to_string(got.size()) + " records, expected " + std::to_string(want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i].first != got[i].first)
      return "record " + got[i].first + ", expected " + want[i].first;
    const std::string e = diff_bytes(want[i].first, want[i].second, got[i].second);
    if (!e.empty()) return e;
  }
  return "";
}

std::vector<DispCase> disp_cases() {
  using B = DispatcherBackend;
  using M = DispatchMode;
  using Q = DispatchQuant;
  return {
      {"a2a_bf16", B::kA2a, M::kAuto, Q::kBf16, 0, false, false},
      {"a2a_fp8", B::kA2a, M::kNormal, Q::kFp8, 0, false, true},
      {"a2a_fp8_ue8m0", B::kA2a, M::kAuto, Q::kFp8Ue8m0, 0, false, false},
      {"a2a_nvfp4", B::kA2a, M::kAuto, Q::kNvfp4, 0, false, false},
      {"deepep_ll_nvfp4_hook", B::kDeepEp, M::kLowLatency, Q::kNvfp4, 0, true, true},
      {"deepep_auto_fp8_hook", B::kDeepEp, M::kAuto, Q::kFp8, 0, true, false},
      {"deepep_auto_ue8m0_worst", B::kDeepEp, M::kAuto, Q::kFp8Ue8m0, 1, false, false},
      {"deepep_normal_ue8m0", B::kDeepEp, M::kNormal, Q::kFp8Ue8m0, 0, false, false},
      {"deepep_normal_bf16_i32", B::kDeepEp, M::kNormal, Q::kBf16, 0, false, true},
  };
}

class DispatcherGpu : public ::testing::TestWithParam<int> {};

TEST_P(DispatcherGpu, CudaMatchesCpuBackend) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  const std::vector<DispCase> cases = disp_cases();
  std::vector<Problem> problems;
  std::vector<std::vector<Records>> want(cases.size(), std::vector<Records>(R));
  for (size_t i = 0; i < cases.size(); ++i) {
    problems.push_back(make_problem(R, 100 + i));
    testing::run_threads(R, [&](const Group& g) {
      want[i][g.rank()] = run_calls(g, cases[i], problems[i], Device::cpu());
    });
    // The cpu run against the routing: load after each call (reset after call kCalls / 2).
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCalls; ++c) {
        const int from = c <= kCalls / 2 ? 0 : kCalls / 2 + 1;
        const std::string key = "call " + std::to_string(c) + " expert_load";
        for (const auto& [name, bytes] : want[i][r])
          if (name == key)
            ASSERT_EQ(bytes, as_bytes(routing_load(problems[i], r, from, c + 1)))
                << cases[i].name << " rank " << r << " " << key;
      }
  }
  // Each case on the legacy default stream and on a created non-blocking stream.
  const int rc = gpu_testing::run_cuda_ranks(R, [&](const Group& g) {
    int failures = 0;
    cudaStream_t created = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    for (cudaStream_t stream : {cudaStream_t{nullptr}, created}) {
      for (size_t i = 0; i < cases.size() && failures == 0; ++i) {
        std::string err;
        try {
          err = compare_records(
              want[i][g.rank()],
              run_calls(g, cases[i], problems[i], Device::cuda(g.rank()), stream));
        } catch (const std::exception& e) {
          err = std::string("exception: ") + e.what();
        }
        if (!err.empty()) {
          std::fprintf(stderr, "rank %d %s (%s stream): %s\n", g.rank(), cases[i].name.c_str(),
                       stream ? "created" : "default", err.c_str());
          ++failures;  // stop: after an exception the group may be unusable
        }
      }
    }
    return failures == 0 ? 0 : 1;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the first difference per case";
}

// The capturable paths: ll (bf16, fp8 and NVFP4, with and without return_recv_hook), a2a and ht
// worst-case mode, each dispatch + combine captured on a side stream and replayed kGraphCalls - 1
// times on new inputs; every replay's outputs, combine and expert load against the cpu backend
// run eagerly on the same calls. Then ht exact mode under capture must raise Unsupported.
TEST_P(DispatcherGpu, CapturedGraphReplaysMatchCpuBackend) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  constexpr int kGraphCalls = 12;  // 1 eager + 11 replays
  using B = DispatcherBackend;
  using M = DispatchMode;
  using Q = DispatchQuant;
  const std::vector<DispCase> cases = {
      {"ll_bf16", B::kDeepEp, M::kLowLatency, Q::kBf16, 0, false, false},
      {"ll_bf16_hook", B::kDeepEp, M::kLowLatency, Q::kBf16, 0, true, true},
      {"ll_fp8", B::kDeepEp, M::kLowLatency, Q::kFp8, 0, false, false},
      {"ll_fp8_hook_auto", B::kDeepEp, M::kAuto, Q::kFp8, 0, true, false},
      {"ll_ue8m0_hook", B::kDeepEp, M::kLowLatency, Q::kFp8Ue8m0, 0, true, false},
      {"ll_nvfp4", B::kDeepEp, M::kLowLatency, Q::kNvfp4, 0, false, false},
      {"ll_nvfp4_hook", B::kDeepEp, M::kLowLatency, Q::kNvfp4, 0, true, false},
      {"a2a_bf16", B::kA2a, M::kNormal, Q::kBf16, 0, false, false},
      {"a2a_fp8", B::kA2a, M::kAuto, Q::kFp8, 0, false, true},
      {"ht_worst_fp8", B::kDeepEp, M::kNormal, Q::kFp8, 1, false, false},
  };
  std::vector<Problem> problems;
  std::vector<std::vector<Records>> want(cases.size(), std::vector<Records>(R));
  for (size_t i = 0; i < cases.size(); ++i) {
    problems.push_back(make_problem(R, 500 + i, kGraphCalls, /*graph=*/true));
    testing::run_threads(R, [&](const Group& g) {
      want[i][g.rank()] = run_calls(g, cases[i], problems[i], Device::cpu());
    });
  }
  const int rc = gpu_testing::run_cuda_ranks(R, [&](const Group& g) {
    for (size_t i = 0; i < cases.size(); ++i) {
      std::string err;
      try {
        err = compare_records(want[i][g.rank()], run_graph_calls(g, cases[i], problems[i]));
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      if (!err.empty()) {
        std::fprintf(stderr, "rank %d graph %s: %s\n", g.rank(), cases[i].name.c_str(),
                     err.c_str());
        return 1;  // the group may be unusable now
      }
    }
    const std::string err = ht_exact_under_capture(g);
    if (!err.empty()) std::fprintf(stderr, "rank %d ht exact under capture: %s\n", g.rank(), err.c_str());
    return err.empty() ? 0 : 1;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the first difference per case";
}

INSTANTIATE_TEST_SUITE_P(Ranks, DispatcherGpu, ::testing::Values(1, 2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace epx
