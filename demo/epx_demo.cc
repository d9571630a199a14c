// demo/epx_demo.cc — an expert-parallel MoE layer on the cpu backend, end to end.
//
// Every rank (a thread): x[T, H] bf16 -> router (top-k of random logits, softmax weights) ->
// epx::Dispatcher.dispatch -> its local experts (y = x @ W_e, a plain loop) -> combine -> out.
// Checked against a dense single-device reference out_ref[t] = sum_k w[t][k] * (x[t] @ W_e),
// computed from the same seeds (every rank can regenerate any expert's weights).
// Prints, per configuration, the max relative error (per token, L2) and the layer time next to
// the time of dispatch + combine alone.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/quant.h"
#include "epx/epx.h"
#include "support/harness.h"

using namespace epx;
using detail::bf16_to_f32;
using detail::f32_to_bf16;

namespace {

struct Options {
  int ranks = 4;
  int64_t tokens = 96;
  int64_t hidden = 256;
  int top_k = 4;
  int experts = 16;
  int iters = 3;
  uint64_t seed = 1;
};

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// W_e [H, H] float, deterministic per expert.
std::vector<float> expert_weights(int e, int64_t H, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000003 + e);
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(H)));
  std::vector<float> w(static_cast<size_t>(H * H));
  for (auto& v : w) v = n(rng);
  return w;
}

// y[H] = x[H] @ W[H, H]
void apply_expert(const float* x, const std::vector<float>& W, int64_t H, float* y) {
  std::fill(y, y + H, 0.0f);
  for (int64_t i = 0; i < H; ++i) {
    const float xi = x[i];
    if (xi == 0.0f) continue;
    const float* row = W.data() + i * H;
    for (int64_t j = 0; j < H; ++j) y[j] += xi * row[j];
  }
}

struct RankData {
  std::vector<uint16_t> x;   // [T, H] bf16
  std::vector<int64_t> idx;  // [T, K]
  std::vector<float> w;      // [T, K]
};

RankData make_rank_data(const Options& o, int rank, int64_t T, uint64_t round) {
  std::mt19937_64 rng(o.seed * 7919 + rank * 104729 + round * 15485863);
  RankData d;
  std::normal_distribution<float> n(0.0f, 1.0f);
  d.x.resize(T * o.hidden);
  for (auto& v : d.x) v = f32_to_bf16(n(rng));
  d.idx.resize(T * o.top_k);
  d.w.resize(T * o.top_k);
  std::vector<float> logits(o.experts);
  std::vector<int> order(o.experts);
  for (int64_t t = 0; t < T; ++t) {
    for (auto& l : logits) l = n(rng);
    for (int e = 0; e < o.experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + o.top_k, order.end(),
                      [&](int a, int b) { return logits[a] > logits[b]; });
    float sum = 0.0f;
    for (int k = 0; k < o.top_k; ++k) sum += std::exp(logits[order[k]]);
    for (int k = 0; k < o.top_k; ++k) {
      d.idx[t * o.top_k + k] = order[k];
      d.w[t * o.top_k + k] = std::exp(logits[order[k]]) / sum;
    }
  }
  return d;
}

// Dequantised row of a dispatched tensor (bf16, fp8 + f32 scales, fp8 + UE8M0, NVFP4).
void load_row(const DispatchOutput& d, DispatchQuant q, int64_t row, int64_t H, float gscale,
              float* out) {
  const Tensor& x = d.x;
  if (q == DispatchQuant::kBf16) {
    const uint16_t* p = x.ptr<uint16_t>() + row * H;
    for (int64_t i = 0; i < H; ++i) out[i] = bf16_to_f32(p[i]);
    return;
  }
  const Tensor& s = d.x_scale;
  if (q == DispatchQuant::kNvfp4) {
    const uint8_t* v = x.ptr<uint8_t>() + row * (H / 2);
    const uint8_t* sc = s.ptr<uint8_t>() + row * (H / 16);
    for (int64_t i = 0; i < H; ++i) {
      const uint8_t code = (i & 1) ? (v[i / 2] >> 4) : (v[i / 2] & 0xF);
      out[i] = detail::e2m1_to_f32(code) * detail::fp8_e4m3_to_f32(sc[i / 16]) / gscale;
    }
    return;
  }
  const uint8_t* v = x.ptr<uint8_t>() + row * H;
  const int64_t rs = s.strides[s.ndim - 2], cs = s.strides[s.ndim - 1];
  int64_t base = 0, r = row;  // ll scales are [L, rows, G]: split the flat row index
  if (s.ndim == 3) {
    base = (row / s.shape[1]) * s.strides[0];
    r = row % s.shape[1];
  }
  for (int64_t i = 0; i < H; ++i) {
    float scale;
    if (q == DispatchQuant::kFp8) {
      scale = s.ptr<float>()[base + r * rs + (i / 128) * cs];
    } else {
      const int64_t g = i / 128;
      const uint8_t* word =
          reinterpret_cast<const uint8_t*>(s.ptr<int32_t>() + base + r * rs + (g / 4) * cs);
      scale = detail::bits_f32(static_cast<uint32_t>(word[g % 4]) << 23);
    }
    out[i] = detail::fp8_e4m3_to_f32(v[i]) * scale;
  }
}

struct Config {
  const char* name;
  DispatcherBackend backend;
  DispatchMode mode;
  DispatchQuant quant;
  double tolerance;
};

struct Result {
  double max_rel_err = 0, layer_us = 0, comm_us = 0;
  int calls = 0;
};

void run_rank(const Group& g, const Options& o, const Config& c, Result& result,
              std::mutex& mu) {
  const int R = g.size(), rank = g.rank(), L = o.experts / R, K = o.top_k;
  const int64_t H = o.hidden;
  const float gscale = 448.0f * 6.0f / 8.0f;  // inputs are ~N(0,1): amax ~ 4-5
  std::vector<std::vector<float>> local_w(L);
  for (int l = 0; l < L; ++l) local_w[l] = expert_weights(rank * L + l, H, o.seed);

  DispatcherConfig dc;
  dc.num_experts = o.experts;
  dc.hidden = H;
  dc.top_k = K;
  dc.max_tokens_per_rank = o.tokens;
  dc.backend = c.backend;
  dc.mode = c.mode;
  dc.quant = c.quant;
  Dispatcher disp(g, dc);
  std::vector<float> xin(H), y(H), acc(H);
  double max_err = 0, layer_us = 0, comm_us = 0;
  for (int it = 0; it < o.iters; ++it) {
    // auto alternates prefill (T = max) and decode (small T) batches.
    const bool decode = c.mode == DispatchMode::kLowLatency ||
                        (c.mode == DispatchMode::kAuto && it % 2 == 1);
    const int64_t T = decode ? std::max<int64_t>(1, o.tokens / 8 + rank) : o.tokens - rank;
    RankData d = make_rank_data(o, rank, T, it);
    TensorView xv = TensorView::contiguous(d.x.data(), DType::kBF16, {T, H});
    TensorView iv = TensorView::contiguous(d.idx.data(), DType::kI64, {T, K});
    TensorView wv = TensorView::contiguous(d.w.data(), DType::kF32, {T, K});
    g.barrier();
    const auto t0 = Clock::now();
    DispatchOutput out = disp.dispatch(xv, iv, wv, decode ? ForwardMode::kDecode : ForwardMode::kExtend,
                                       c.quant == DispatchQuant::kNvfp4 ? std::optional<float>(gscale)
                                                                         : std::nullopt);
    double t_comm = us_since(t0);
    // Experts.
    Tensor yt;
    CombineInput ci;
    if (out.format == OutputFormat::kHt) {
      const int64_t N = out.x.shape[0];
      yt = default_allocator()(DType::kBF16, {N, H}, Device::cpu());
      for (int64_t i = 0; i < N; ++i) {
        load_row(out, c.quant, i, H, gscale, xin.data());
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int k = 0; k < K; ++k) {
          const int64_t l = out.topk_idx.ptr<int64_t>()[i * K + k];
          if (l < 0) continue;
          apply_expert(xin.data(), local_w[l], H, y.data());
          const float w = out.topk_weights.ptr<float>()[i * K + k];
          for (int64_t j = 0; j < H; ++j) acc[j] += w * y[j];
        }
        for (int64_t j = 0; j < H; ++j) yt.ptr<uint16_t>()[i * H + j] = f32_to_bf16(acc[j]);
      }
      ci.y = yt;
    } else if (out.format == OutputFormat::kLl) {
      const int64_t rows = out.x.shape[1];
      yt = default_allocator()(DType::kBF16, {L, rows, H}, Device::cpu());
      for (int l = 0; l < L; ++l)
        for (int64_t i = 0; i < out.masked_m.ptr<int32_t>()[l]; ++i) {
          load_row(out, c.quant, l * rows + i, H, gscale, xin.data());
          apply_expert(xin.data(), local_w[l], H, y.data());
          for (int64_t j = 0; j < H; ++j)
            yt.ptr<uint16_t>()[(l * rows + i) * H + j] = f32_to_bf16(y[j]);
        }
      ci.y = yt;
    } else {
      const int64_t M = out.x.shape[1];
      uint16_t* dst = out.moe_output_view.ptr<uint16_t>();
      for (int64_t i = 0; i < R * M; ++i) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        const int32_t* ids = out.topk_idx.ptr<int32_t>() + i * K;
        bool any = false;
        for (int k = 0; k < K; ++k) {
          if (ids[k] < 0 || ids[k] / L != rank) continue;
          if (!any) load_row(out, c.quant, i, H, gscale, xin.data());
          any = true;
          apply_expert(xin.data(), local_w[ids[k] % L], H, y.data());
          const float w = out.topk_weights.ptr<float>()[i * K + k];
          for (int64_t j = 0; j < H; ++j) acc[j] += w * y[j];
        }
        for (int64_t j = 0; j < H; ++j) dst[i * H + j] = f32_to_bf16(acc[j]);
      }
      ci.y_in_output_view = true;
    }
    const auto t1 = Clock::now();
    Tensor res = disp.combine(ci);
    t_comm += us_since(t1);
    const double t_layer = us_since(t0);
    // Dense reference for this rank's tokens.
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < H; ++j) xin[j] = bf16_to_f32(d.x[t * H + j]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < K; ++k) {
        apply_expert(xin.data(), expert_weights(static_cast<int>(d.idx[t * K + k]), H, o.seed), H,
                     y.data());
        for (int64_t j = 0; j < H; ++j) acc[j] += d.w[t * K + k] * y[j];
      }
      double num = 0, den = 0;
      for (int64_t j = 0; j < H; ++j) {
        const double diff = bf16_to_f32(res.ptr<uint16_t>()[t * H + j]) - acc[j];
        num += diff * diff;
        den += static_cast<double>(acc[j]) * acc[j];
      }
      max_err = std::max(max_err, std::sqrt(num / std::max(den, 1e-30)));
    }
    layer_us += t_layer;
    comm_us += t_comm;
  }
  std::lock_guard<std::mutex> lock(mu);
  result.max_rel_err = std::max(result.max_rel_err, max_err);
  if (rank == 0) {
    result.layer_us = layer_us / o.iters;
    result.comm_us = comm_us / o.iters;
    result.calls = o.iters;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ranks") o.ranks = std::stoi(next());
    else if (a == "--tokens") o.tokens = std::stoll(next());
    else if (a == "--hidden") o.hidden = std::stoll(next());
    else if (a == "--topk") o.top_k = std::stoi(next());
    else if (a == "--experts") o.experts = std::stoi(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--seed") o.seed = std::stoull(next());
    else {
      std::printf(
          "epx-demo: an expert-parallel MoE layer (router, dispatch, experts, combine) on the cpu\n"
          "backend, checked against a dense single-device reference.\n"
          "  --ranks R     ranks (threads), default 4\n"
          "  --tokens T    tokens per rank (prefill batches; decode batches use ~T/8), default 96\n"
          "  --hidden H    hidden size (multiple of 128), default 256\n"
          "  --topk K      experts per token, default 4\n"
          "  --experts E   experts (multiple of R), default 16\n"
          "  --iters N     layer calls per configuration, default 3\n"
          "  --seed S      random seed, default 1\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  const Config configs[] = {
      {"normal (ht) bf16", DispatcherBackend::kDeepEp, DispatchMode::kNormal, DispatchQuant::kBf16, 0.02},
      {"normal (ht) fp8", DispatcherBackend::kDeepEp, DispatchMode::kNormal, DispatchQuant::kFp8, 0.08},
      {"low_latency (ll) bf16", DispatcherBackend::kDeepEp, DispatchMode::kLowLatency, DispatchQuant::kBf16, 0.02},
      {"low_latency (ll) fp8 ue8m0", DispatcherBackend::kDeepEp, DispatchMode::kLowLatency, DispatchQuant::kFp8Ue8m0, 0.12},
      {"auto (ht/ll) fp8", DispatcherBackend::kDeepEp, DispatchMode::kAuto, DispatchQuant::kFp8, 0.08},
      {"a2a bf16", DispatcherBackend::kA2a, DispatchMode::kNormal, DispatchQuant::kBf16, 0.02},
      {"a2a nvfp4", DispatcherBackend::kA2a, DispatchMode::kNormal, DispatchQuant::kNvfp4, 0.25},
  };
  std::printf("epx-demo: cpu backend, %d ranks, T=%lld H=%lld K=%d E=%d, %d calls each\n", o.ranks,
              static_cast<long long>(o.tokens), static_cast<long long>(o.hidden), o.top_k,
              o.experts, o.iters);
  std::fflush(stdout);
  std::printf("%-28s %11s %9s %9s %20s\n", "configuration", "max rel err", "tolerance",
              "layer ms", "dispatch+combine ms");
  std::fflush(stdout);
  int failures = 0;
  for (const Config& c : configs) {
    Result r;
    std::mutex mu;
    try {
      testing::run_threads(o.ranks, [&](const Group& g) { run_rank(g, o, c, r, mu); });
    } catch (const std::exception& e) {
      std::printf("%-28s FAILED: %s\n", c.name, e.what());
      std::fflush(stdout);
      ++failures;
      continue;
    }
    const bool ok = r.max_rel_err <= c.tolerance;
    failures += !ok;
    // The units and columns of demo/epx_demo.py (ms), each row as soon as it is known.
    std::printf("%-28s %11.2e %9.2g %9.3f %20.3f %s\n", c.name, r.max_rel_err, c.tolerance,
                r.layer_us / 1000, r.comm_us / 1000, ok ? "ok" : "TOO LARGE");
    std::fflush(stdout);
  }
  return failures ? 1 : 0;
}
