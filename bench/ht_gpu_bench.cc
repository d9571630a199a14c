// bench/ht_gpu_bench.cc — the cuda ht benchmark beside epx-bench (SM sweeps, every path's
// rows, --trace): the standard ht workload, epx's dispatch/combine times next to NCCL's
// all-to-all of the same bytes and the NVLink copy ceiling of the same bytes, same run, same SMs.
//
//   epx_ht_gpu_bench [--ranks R] [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
//                    [--sms 8,16,24,32] [--warmup 5] [--iters 30] [--trace] [--ce-probe]
//                    diagnostics builds (-DEPX_DIAGNOSTICS=ON) also: [--send-pct 38,50] [--ablate]
// Each --sms value is a group of its own (GroupOptions::num_sms) running the library's default
// path: the rows an engine meets (cached / exact / worst-case dispatch, copying and zero-copy,
// eager and graph-replayed; combine copying and zero-copy). --trace (a -DEPX_HT_TRACE=ON build):
// the zero-copy ops' phase stamps. --send-pct: the senders' percent of the CTAs; --ablate: the
// same run with stages left out (cuda/tuning.h's ablation bits; outputs wrong).
// Times are medians over iters (CUDA events, one group barrier before each iteration); rank 0
// prints. "cached" dispatch = with a handle (no count exchange), as DeepEP's published numbers.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/baselines.h"
#include "cuda/cuda_buffer.h"
#include "cuda/kernels/ht/trace.cuh"
#include "cuda/tuning.h"
#include "epx/buffer.h"
#include "gpu/gpu_support.h"
#include "support/routing.h"
#include "transport/transport.h"

namespace {

using namespace epx;

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (int64_t x : gpu_testing::parse_int_list(s)) v.push_back(static_cast<int>(x));
  return v;
}

struct Options {
  int ranks = 0;
  int64_t tokens = 4096, hidden = 7168;
  int topk = 8, experts = 256;
  std::vector<int> sms = {16};
  std::vector<int> send_pct = {0};  // --send-pct (diagnostics builds); 0: the library's split
  int warmup = 5, iters = 30;
  bool ablate = false;    // --ablate (diagnostics builds): also time stage ablations
  bool ce_probe = false;  // only the copy-engine rate probe (ce_probe below)
  bool trace = false;     // --trace (EPX_HT_TRACE builds): phase stamps of zero-copy ops
};

// Hands back the same device storage for the i-th allocation of every call (reset() between
// calls), so timed calls neither cudaMalloc nor cudaFree (which would synchronise the device).
struct ReuseAllocator {
  std::vector<Tensor> slots;
  size_t next = 0;
  void reset() { next = 0; }
  Allocator get() {
    return [this](DType dtype, const std::vector<int64_t>& shape, Device device) {
      Tensor t;
      static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
      if (next >= slots.size() || slots[next].nbytes() < t.nbytes()) {
        Tensor fresh =
            default_allocator()(DType::kU8, {static_cast<int64_t>(t.nbytes()) + 16}, device);
        if (next >= slots.size()) {
          slots.push_back(fresh);
        } else {
          slots[next] = fresh;
        }
      }
      t.storage = slots[next].storage;
      t.data = slots[next].data;
      ++next;
      return t;
    };
  }
};

#ifdef EPX_HT_TRACE
// --trace: `call` (one op) `iters` times, each after a group barrier; per phase of
// kernels/ht/trace.cuh the median over calls of (min / median / max over CTAs of the stamp minus
// the call's first CTA entry), and the span (last exit - first entry). Printed by every rank.
void trace_op(const Group& g, cudaStream_t stream, int iters, int ctas, int op, const char* name,
              const std::function<void()>& call) {
  uint64_t* buf = detail::ht_trace_buffer(g.transport()->device().index);
  if (buf == nullptr) {
    std::printf("[trace rank %d] no trace buffer\n", g.rank());
    return;
  }
  const int n = std::min(ctas, detail::kHtTraceCtas);
  std::vector<uint64_t> host(detail::kHtTraceWords);
  std::vector<std::vector<double>> lo(detail::kHtTrNum), mid(detail::kHtTrNum),
      hi(detail::kHtTrNum);
  std::vector<double> span;
  for (int i = 0; i < iters; ++i) {
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemset(buf, 0, detail::kHtTraceWords * sizeof(uint64_t)));
    CUDA_OK(cudaDeviceSynchronize());
    g.transport()->barrier("trace_op");
    call();
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemcpy(host.data(), buf, detail::kHtTraceWords * sizeof(uint64_t),
                       cudaMemcpyDeviceToHost));
    auto at = [&](int ph, int c) {
      return host[(static_cast<size_t>(op) * detail::kHtTracePhases + ph) * detail::kHtTraceCtas +
                  c];
    };
    uint64_t t0 = UINT64_MAX, t1 = 0;
    for (int c = 0; c < n; ++c) {
      if (at(detail::kHtTrEntry, c)) t0 = std::min(t0, at(detail::kHtTrEntry, c));
      t1 = std::max(t1, at(detail::kHtTrExit, c));
    }
    if (t0 == UINT64_MAX || t1 < t0) continue;
    span.push_back((t1 - t0) / 1e3);
    for (int ph = 0; ph < detail::kHtTrNum; ++ph) {
      std::vector<double> v;
      for (int c = 0; c < n; ++c)
        if (at(ph, c) >= t0) v.push_back((at(ph, c) - t0) / 1e3);
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      lo[ph].push_back(v.front());
      mid[ph].push_back(v[v.size() / 2]);
      hi[ph].push_back(v.back());
    }
  }
  auto median = [](std::vector<double> v) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  static const char* const kNames[] = {"entry",
                                       "start (peers ready / first token set up)",
                                       "warp 0 done (sent / reduced)",
                                       "receive done (dispatch)",
                                       "CTA done (all warps)",
                                       "exit (last CTA: ready, end barrier)"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == detail::kHtTrNum);
  std::printf(
      "[trace rank %d] %s: span %.2f us (median of %zu calls); per phase min / median / "
      "max over %d CTAs, us after the first CTA entry\n",
      g.rank(), name, median(span), span.size(), n);
  for (int ph = 0; ph < detail::kHtTrNum; ++ph) {
    if (mid[ph].empty()) continue;
    std::printf("[trace rank %d]   %-44s %7.2f %7.2f %7.2f\n", g.rank(), kNames[ph], median(lo[ph]),
                median(mid[ph]), median(hi[ph]));
  }
  std::fflush(stdout);
}
#endif

// One SM count (the group's GroupOptions::num_sms, `sms`): the default path's rows, then the
// baselines of the same bytes. Under EPX_DIAGNOSTICS, per --send-pct value and with --ablate.
int run_rank(const Group& g, const Options& o, int sms) {
  const int R = g.size(), r = g.rank(), dev = r;
  const int64_t T = o.tokens, H = o.hidden;
  const int K = o.topk;
  std::mt19937_64 rng(1234 + r);
  auto topk = epx::testing::make_topk_idx(epx::testing::Routing::kUniform, T, K, o.experts, R, rng);
  auto weights = epx::testing::make_topk_weights(topk, rng);
  auto xb = epx::testing::make_bf16(T, H, rng);
  auto x8 = epx::testing::make_bytes(static_cast<size_t>(T * H), rng);
  std::vector<float> sc(static_cast<size_t>(T * (H / 128)));
  for (auto& v : sc) v = std::uniform_real_distribution<float>(0.001f, 1.0f)(rng);
  Tensor d_topk = gpu_testing::to_device(topk, DType::kI64, {T, K}, dev);
  Tensor d_w = gpu_testing::to_device(weights, DType::kF32, {T, K}, dev);
  Tensor d_xb = gpu_testing::to_device(xb, DType::kBF16, {T, H}, dev);
  Tensor d_x8 = gpu_testing::to_device(x8, DType::kF8E4M3, {T, H}, dev);
  Tensor d_sc = gpu_testing::to_device(sc, DType::kF32, {T, H / 128}, dev);
  MoeShape shape;
  shape.hidden = H;
  shape.top_k = K;
  shape.num_experts = o.experts;
  shape.max_tokens_per_rank = T;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  // Runs of consecutive tokens this rank keeps (one copy call each, ht_kept_copies_pay).
  int64_t kept_runs = 0;
  {
    const int64_t L = o.experts / R;
    bool prev = false;
    for (int64_t t = 0; t < T; ++t) {
      bool kept = false;
      for (int k = 0; k < K; ++k) {
        const int64_t e = topk[static_cast<size_t>(t * K + k)];
        kept = kept || (e >= r * L && e < (r + 1) * L);
      }
      kept_runs += kept && !prev;
      prev = kept;
    }
  }
  if (r == 0)
    std::printf(
        "ht T=%lld H=%lld K=%d E=%d R=%d uniform routing; buffer %.1f MB/rank; rank 0 keeps its "
        "tokens in %lld runs (copied by copy engine: %s)\n",
        static_cast<long long>(T), static_cast<long long>(H), K, o.experts, R,
        Buffer::bytes_needed(Mode::kHt, shape, R, Backend::kCuda) / 1e6,
        static_cast<long long>(kept_runs),
        detail::ht_kept_copies_pay(static_cast<size_t>(kept_runs)) ? "yes" : "no, the kernel");
  for (int pct : o.send_pct) {
#ifdef EPX_DIAGNOSTICS
    detail::set_ht_tuning_override(0, pct, pct);  // 0: the library's split
#endif
    Buffer buf(g, shape);
    HtDispatchArgs a;
    a.x = d_xb;
    a.topk_idx = d_topk;
    a.topk_weights = d_w;
    a.stream = stream;
    HtDispatchResult res = buf.ht_dispatch(a);
    HtDispatchArgs a8 = a;
    a8.x = d_x8;
    a8.x_scales = d_sc;
    HtDispatchResult res8 = buf.ht_dispatch(a8);
    // Rows this rank sends to each remote peer (largest), for the baselines' byte counts.
    std::vector<int32_t> rpm = gpu_testing::to_host<int32_t>(res.handle.rank_prefix_matrix);
    int64_t remote_rows = 0, self_rows = 0;
    for (int d = 0; d < R; ++d) {
      const int64_t c = rpm[r * R + d] - (r > 0 ? rpm[(r - 1) * R + d] : 0);
      if (d == r)
        self_rows = c;
      else
        remote_rows = std::max(remote_rows, c);
    }
    const size_t bf16_bytes = static_cast<size_t>(remote_rows * H * 2);
    const size_t fp8_bytes = static_cast<size_t>(remote_rows * (H + 4 * (H / 128)));

    HtDispatchArgs cached = a;
    cached.handle = &res.handle;
    cached.topk_idx = TensorView();
    cached.topk_weights = TensorView();
    HtDispatchArgs cached8 = a8;
    cached8.handle = &res8.handle;
    cached8.topk_idx = TensorView();
    cached8.topk_weights = TensorView();
    HtDispatchArgs worst = a;
    worst.num_worst_tokens = T * R;
    HtCombineArgs ca;
    ca.y = res.recv_x;
    ca.handle = &res.handle;
    ca.stream = stream;

    ReuseAllocator pool;
    auto timed = [&](auto&& op) {
      return bench::time_on_device(g, stream, o.warmup, o.iters, [&] {
        pool.reset();
        op(pool.get());
      });
    };
    // `calls` calls of an op captured in one CUDA graph; the first, eager call makes the pool's
    // slots exist before the capture.
    struct Captured {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      ~Captured() {
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
      }
    };
    auto capture = [&](const std::function<void(const Allocator&)>& op, int calls, Captured& c) {
      pool.reset();
      op(pool.get());
      CUDA_OK(cudaStreamSynchronize(stream));
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < calls; ++i) {
        pool.reset();
        op(pool.get());
      }
      CUDA_OK(cudaStreamEndCapture(stream, &c.graph));
      CUDA_OK(cudaGraphInstantiate(&c.exec, c.graph, 0));
    };
    // Per-call time of an op captured once in a CUDA graph (no host cost).
    auto graph_timed_op = [&](const std::function<void(const Allocator&)>& op) {
      Captured c;
      capture(op, 1, c);
      return bench::time_on_device(g, stream, o.warmup, o.iters,
                                   [&] { CUDA_OK(cudaGraphLaunch(c.exec, stream)); });
    };
    // Per-call time of kGraphRunOps calls captured in one CUDA graph, replayed back to back with
    // no barrier between replays (as epx_ll_gpu_bench's graph rows and as an engine's step graph
    // runs them): the ranks' launch skew after a barrier is paid once per replay, not per call.
    auto graph_run_op = [&](const std::function<void(const Allocator&)>& op) {
      constexpr int kGraphRunOps = 10;
      Captured c;
      capture(op, kGraphRunOps, c);
      const double us = gpu_testing::graph_replays_us(g, stream, c.exec, o.iters);
      buf.check();
      return us / (o.iters * kGraphRunOps);
    };
    auto graph_timed = [&](const HtDispatchArgs& args) {
      return graph_timed_op([&](const Allocator& al) { (void)buf.ht_dispatch(args, al); });
    };
    auto host_timed = [&](const HtDispatchArgs& args) {
      double total = 0;
      for (int i = 0; i < o.iters; ++i) {
        CUDA_OK(cudaStreamSynchronize(stream));
        pool.reset();
        const auto t0 = std::chrono::steady_clock::now();
        (void)buf.ht_dispatch(args, pool.get());
        total += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                     .count();
      }
      CUDA_OK(cudaStreamSynchronize(stream));
      return total / o.iters;
    };
    struct Row {
      std::string name;
      bench::Timing t;
      bool fp8;
    };
    std::vector<Row> rows;  // ops timed alone (CUDA events) or as one-call graphs
    auto row = [&](const std::string& name, const bench::Timing& t, bool fp8 = false) {
      rows.push_back({name, t, fp8});
    };
    std::vector<std::pair<std::string, double>> notes;  // host times, 10-call graphs
    HtDispatchArgs z16 = cached, z8 = cached8, ze = a;
    z16.zero_copy = z8.zero_copy = ze.zero_copy = true;
    row("dispatch bf16 (cached)", timed([&](const Allocator& al) { buf.ht_dispatch(cached, al); }));
    row("dispatch fp8 (cached)", timed([&](const Allocator& al) { buf.ht_dispatch(cached8, al); }),
        true);
    row("dispatch bf16 (cached, graph)", graph_timed(cached));
    row("dispatch fp8 (cached, graph)", graph_timed(cached8), true);
    notes.emplace_back("host us per cached bf16 call", host_timed(cached));
    row("dispatch bf16 (cached, zero-copy)",
        timed([&](const Allocator& al) { buf.ht_dispatch(z16, al); }));
    row("dispatch fp8 (cached, zero-copy)",
        timed([&](const Allocator& al) { buf.ht_dispatch(z8, al); }), true);
    row("dispatch bf16 (cached, zero-copy, graph)", graph_timed(z16));
    row("dispatch fp8 (cached, zero-copy, graph)", graph_timed(z8), true);
    notes.emplace_back("host us per cached zero-copy bf16 call", host_timed(z16));
#ifdef EPX_HT_TRACE
    if (o.trace)
      trace_op(g, stream, o.iters, sms, 0, "dispatch bf16 zero-copy", [&] {
        pool.reset();
        (void)buf.ht_dispatch(z16, pool.get());
      });
#endif
    notes.emplace_back("graph of 10 calls, per call: dispatch bf16 zero-copy",
                       graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z16, al); }));
    notes.emplace_back("graph of 10 calls, per call: dispatch fp8 zero-copy",
                       graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z8, al); }));
    row("dispatch bf16 (exact)", timed([&](const Allocator& al) { buf.ht_dispatch(a, al); }));
    row("dispatch bf16 (exact, zero-copy)",
        timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); }));
#ifdef EPX_HT_TRACE
    if (o.trace)
      trace_op(g, stream, o.iters, sms, 0, "dispatch bf16 zero-copy exact", [&] {
        pool.reset();
        (void)buf.ht_dispatch(ze, pool.get());
      });
#endif
    row("dispatch bf16 (worst-case)",
        timed([&](const Allocator& al) { buf.ht_dispatch(worst, al); }));
    row("combine bf16", timed([&](const Allocator& al) { buf.ht_combine(ca, al); }));
    notes.emplace_back("graph of 10 calls, per call: combine bf16",
                       graph_run_op([&](const Allocator& al) { buf.ht_combine(ca, al); }));
    {  // zero-copy combine: the same y rows written once into the combine buffer
      const TensorView view = buf.ht_combine_buffer(res.handle);
      CUDA_OK(cudaMemcpy(view.data, ca.y.data, view.nbytes(), cudaMemcpyDeviceToDevice));
      HtCombineArgs cz = ca;
      cz.y = view;
      cz.zero_copy = true;
      row("combine bf16 (zero-copy)", timed([&](const Allocator& al) { buf.ht_combine(cz, al); }));
      row("combine bf16 (zero-copy, graph)",
          graph_timed_op([&](const Allocator& al) { buf.ht_combine(cz, al); }));
      notes.emplace_back("graph of 10 calls, per call: combine bf16 zero-copy",
                         graph_run_op([&](const Allocator& al) { buf.ht_combine(cz, al); }));
#ifdef EPX_HT_TRACE
      if (o.trace)
        trace_op(g, stream, o.iters, sms, 1, "combine zero-copy", [&] {
          pool.reset();
          buf.ht_combine(cz, pool.get());
        });
#endif
      HtCombineArgs czw = cz;  // no weights: no mirror copy before the kernel
      czw.topk_weights = TensorView{};
      row("combine bf16 (zero-copy, graph, no weights)",
          graph_timed_op([&](const Allocator& al) { buf.ht_combine(czw, al); }));
    }
    buf.check();
    std::vector<std::pair<std::string, bench::Timing>> ablations;
#ifdef EPX_DIAGNOSTICS
    if (o.ablate) {
      const std::pair<const char*, int> cases[] = {
          {"dispatch bf16 cached, no kept-row copy", detail::kAblateSelf},
          {"dispatch bf16 cached, no received-row copy", detail::kAblateRemoteCopy},
          {"dispatch bf16 cached, senders only", detail::kAblateSelf | detail::kAblateRemoteCopy},
      };
      for (const auto& [name, bits] : cases) {
        detail::set_ht_ablation(bits);
        ablations.emplace_back(name,
                               timed([&](const Allocator& al) { buf.ht_dispatch(cached, al); }));
      }
      // The copy engines' stages (graph-timed: no host cost); no effect where they move nothing.
      detail::set_ht_ablation(0);
      ablations.emplace_back("dispatch bf16 cached graph: full", graph_timed(cached));
      detail::set_ht_ablation(detail::kAblateEngineKept);
      ablations.emplace_back("dispatch bf16 cached graph: no kept-row copies", graph_timed(cached));
      detail::set_ht_ablation(detail::kAblateEnginePush);
      ablations.emplace_back("combine, copy engines push nothing",
                             timed([&](const Allocator& al) { buf.ht_combine(ca, al); }));
      detail::set_ht_ablation(detail::kAblateReduce);
      ablations.emplace_back("combine, senders only (reducers wait)",
                             timed([&](const Allocator& al) { buf.ht_combine(ca, al); }));
      detail::set_ht_ablation(0);
    }
#endif
    auto n_bf16 = bench::nccl_all_to_all(g, bf16_bytes, o.warmup, o.iters);
    auto n_fp8 = bench::nccl_all_to_all(g, fp8_bytes, o.warmup, o.iters);
    auto c_bf16 = bench::nvlink_copy_ceiling(g, bf16_bytes, sms, o.warmup, o.iters);
    // NCCL's all-to-all of 16 bytes per peer: the fixed cost of an op that waits for its peers
    // (launch, handshake, and the ranks' launch skew after the per-iteration group barrier),
    // which the ceiling kernel (pushes only, no cross-rank wait) does not pay.
    auto n_tiny = bench::nccl_all_to_all(g, 16, o.warmup, o.iters);
    // An empty kernel timed as the ops are (one-call graph after a barrier; 10-call graph): the
    // launch and timing overhead inside every row.
    const bench::Timing empty1 =
        graph_timed_op([&](const Allocator&) { bench::launch_empty_kernel(stream); });
    const double empty10 =
        graph_run_op([&](const Allocator&) { bench::launch_empty_kernel(stream); });
    auto c_fp8 = bench::nvlink_copy_ceiling(g, fp8_bytes, sms, o.warmup, o.iters);
    if (r == 0) {
      const detail::HtTuning& tu = static_cast<detail::CudaBuffer&>(buf.impl()).tuning();
      std::printf(
          "\nSMs %d (sender CTAs: dispatch %d, kept rows by copy engine %d, zero-copy %d, combine "
          "%d): remote rows/peer %lld (%.1f MB bf16, %.1f MB fp8), self rows %lld\n",
          tu.num_sms, tu.dispatch_send_ctas, tu.dispatch_send_ctas_kept,
          tu.dispatch_send_ctas_zero_copy, tu.combine_send_ctas,
          static_cast<long long>(remote_rows), bf16_bytes / 1e6, fp8_bytes / 1e6,
          static_cast<long long>(self_rows));
      std::printf("  %-52s %10s %10s %10s %10s %12s %10s\n", "op", "epx us", "min us", "nccl us",
                  "ceil us", "epx/nccl", "ceil/epx");
      for (const Row& w : rows) {
        const bench::Timing& n = w.fp8 ? n_fp8 : n_bf16;
        const bench::Timing& c = w.fp8 ? c_fp8 : c_bf16;
        std::printf("  %-52s %10.1f %10.1f %10.1f %10.1f %12.2f %10.2f\n", w.name.c_str(),
                    w.t.median_us, w.t.min_us, n.median_us, c.median_us,
                    w.t.median_us / n.median_us, c.median_us / w.t.median_us);
      }
      for (const auto& [name, us] : notes) std::printf("  %-52s %10.1f\n", name.c_str(), us);
      if (!ablations.empty()) {
        std::printf("  ablations (same run; outputs wrong):\n");
        for (const auto& [name, t] : ablations)
          std::printf("  %-52s %10.1f %10.1f\n", name.c_str(), t.median_us, t.min_us);
      }
      std::printf("  NCCL a2a of 16 B per peer (fixed cost with a cross-rank wait): %.1f us\n",
                  n_tiny.median_us);
      std::printf("  empty kernel: one-call graph %.1f us, 10-call graph %.1f us per call\n",
                  empty1.median_us, empty10);
      std::printf("  NVLink ceiling: %.1f GB/s per direction (bf16 bytes), NCCL a2a %.1f GB/s\n",
                  bf16_bytes / c_bf16.median_us / 1e3, bf16_bytes / n_bf16.median_us / 1e3);
      std::fflush(stdout);
    }
  }
#ifdef EPX_DIAGNOSTICS
  detail::set_ht_tuning_override(0, 0, 0);
#endif
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

// --ce-probe (2 ranks): copy-engine rates into a peer's memory, to explain the ≈ 225 GB/s the
// copy engines reached pushing every row (2026-11-30). cudaMemcpyAsync of S bytes from a local
// cudaMalloc buffer into (a) the peer's NCCL window through its LSA mapping (what the ce path
// writes), (b) a cudaMalloc buffer of the peer opened with cudaIpcOpenMemHandle (the classic peer
// path; docs/perf.md §3: 395 GB/s one way), (c) this rank's own window (local copy);
// one rank pushing or both at once; the S bytes as 1 copy or 4 copies. Times: CUDA events,
// medians over iters, a barrier before each iteration.
int ce_probe(const Group& g, const Options& o) {
  const int R = g.size(), r = g.rank();
  if (R != 2) {
    if (r == 0) std::printf("--ce-probe needs 2 ranks\n");
    return 0;
  }
  const int peer = 1 - r;
  const size_t max_bytes = size_t{64} << 20;
  auto win = g.transport()->allocate(max_bytes + 4096);
  char* src = nullptr;
  char* ipc_local = nullptr;
  CUDA_OK(cudaMalloc(&src, max_bytes));
  CUDA_OK(cudaMemset(src, r + 1, max_bytes));
  CUDA_OK(cudaMalloc(&ipc_local, max_bytes));
  // IPC handles travel through the windows: ours into the peer's tail, barrier, read ours.
  cudaIpcMemHandle_t mine{}, theirs{};
  CUDA_OK(cudaIpcGetMemHandle(&mine, ipc_local));
  CUDA_OK(cudaMemcpy(static_cast<char*>(win->peer(peer)) + max_bytes, &mine, sizeof(mine),
                     cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize());
  g.transport()->barrier("ce-probe: handles");
  CUDA_OK(cudaMemcpy(&theirs, static_cast<char*>(win->local()) + max_bytes, sizeof(theirs),
                     cudaMemcpyDeviceToHost));
  void* ipc_peer = nullptr;
  CUDA_OK(cudaIpcOpenMemHandle(&ipc_peer, theirs, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::pair<const char*, char*> targets[] = {
      {"peer window (LSA mapping)", static_cast<char*>(win->peer(peer))},
      {"peer cudaMalloc (cudaIpc)", static_cast<char*>(ipc_peer)},
      {"own window (local copy)", static_cast<char*>(win->local())}};
  if (r == 0)
    std::printf(
        "copy-engine probe: cudaMemcpyAsync local -> target, GB/s per pushing rank "
        "(median of %d)\n  %-28s %8s %6s %7s %10s %8s\n",
        o.iters, "target", "MB", "both", "copies", "us", "GB/s");
  for (const size_t mb : {1, 4, 16, 58}) {
    const size_t bytes = mb << 20;
    for (const auto& [name, dst] : targets) {
      for (const bool both : {false, true}) {
        for (const int copies : {1, 4}) {
          const bench::Timing t = bench::time_on_device(g, s, 3, o.iters, [&] {
            if (!both && r != 0) return;
            for (int c = 0; c < copies; ++c) {
              const size_t lo = bytes * c / copies, hi = bytes * (c + 1) / copies;
              CUDA_OK(cudaMemcpyAsync(dst + lo, src + lo, hi - lo, cudaMemcpyDefault, s));
            }
          });
          if (r == 0)
            std::printf("  %-28s %8zu %6s %7d %10.1f %8.1f\n", name, mb, both ? "yes" : "no",
                        copies, t.median_us, bytes / t.median_us / 1e3);
        }
      }
    }
  }
  std::fflush(stdout);
  g.transport()->barrier("ce-probe: done");
  CUDA_OK(cudaIpcCloseMemHandle(ipc_peer));
  cudaStreamDestroy(s);
  cudaFree(ipc_local);
  cudaFree(src);
  return 0;
}

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value for %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ranks")
      o.ranks = std::atoi(next());
    else if (a == "--tokens")
      o.tokens = std::atoll(next());
    else if (a == "--hidden")
      o.hidden = std::atoll(next());
    else if (a == "--topk")
      o.topk = std::atoi(next());
    else if (a == "--experts")
      o.experts = std::atoi(next());
    else if (a == "--sms")
      o.sms = parse_list(next());
#ifdef EPX_DIAGNOSTICS
    else if (a == "--send-pct")
      o.send_pct = parse_list(next());
    else if (a == "--ablate")
      o.ablate = true;
#endif
    else if (a == "--warmup")
      o.warmup = std::atoi(next());
    else if (a == "--iters")
      o.iters = std::atoi(next());
    else if (a == "--ce-probe")
      o.ce_probe = true;
    else if (a == "--trace")
      o.trace = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--ranks R] [--tokens T] [--hidden H] [--topk K] [--experts E] "
                   "[--sms a,b] [--warmup W] [--iters N] [--ce-probe] [--trace]%s\n",
                   argv[0],
#ifdef EPX_DIAGNOSTICS
                   " [--send-pct p,q] [--ablate]"
#else
                   ""
#endif
      );
      return a == "--help" ? 0 : 2;
    }
  }
#ifndef EPX_HT_TRACE
  if (o.trace) {
    std::fprintf(stderr, "--trace needs a build with -DEPX_HT_TRACE=ON\n");
    return 2;
  }
#endif
  const int gpus = gpu_testing::visible_gpus();
  if (gpus == 0) {
    std::printf("epx_ht_gpu_bench: no GPU visible, nothing to measure\n");
    return 0;
  }
  const int R = o.ranks > 0 ? o.ranks : gpus;
  if (o.ce_probe)
    return gpu_testing::run_cuda_ranks(R, [&](const Group& g) { return ce_probe(g, o); });
  int rc = 0;
  for (int sms : o.sms) {  // a group per SM count: the buffers' CTAs follow GroupOptions::num_sms
    GroupOptions options;
    options.num_sms = sms;
    rc |= gpu_testing::run_cuda_ranks(
        R, [&](const Group& g) { return run_rank(g, o, sms); }, options);
  }
  return rc;
}
