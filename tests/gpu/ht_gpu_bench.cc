// tests/gpu/ht_gpu_bench.cc — a standalone cuda ht benchmark (until epx-bench drives the cuda
// backend): the SPEC 6 standard ht workload, epx's dispatch/combine times next to NCCL's
// all-to-all of the same bytes and the NVLink copy ceiling of the same bytes, same run, same SMs.
//
//   epx_ht_gpu_bench [--ranks R] [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
//                    [--sms 8,16,24,32] [--send-pct 38] [--warmup 5] [--iters 30] [--ablate]
//                    [--copy warp,bulk,bulk:3x4096:b8] [--ce-share 100,70] [--ce-probe]
//                    [--pull 3x2048,2x3584] [--trace] [--kept-runs N]
// --copy times dispatch and combine under each copy path (cuda/tuning.h parse_ht_copy;
// EPX_HT_COPY's values) in the same process, same buffer; --ce-share also times combine with the
// copy engines pushing that percent of the rows and the kernel the rest (set_ht_engine_share_
// override; only where combine uses the copy engines: ":combine", or ":combine-auto" at sizes
// it picks them). --pull also times the zero-copy combine (graph) with the staged reducer's
// stages x chunk bytes (set_ht_pull_staging_override); it always times the register pair step.
// --kept-runs N: ce:kept copies the kept rows by copy engine up to N runs of kept tokens instead
// of the library's limit (set_ht_kept_copy_max_runs_override; --topk 1 gives ~T/4 runs at EP2).
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
  std::vector<int> send_pct = {0};  // 0: the library's default split
  int warmup = 5, iters = 30;
  bool ablate = false;            // also time stage ablations (cuda/tuning.h HtAblate)
  bool ce_probe = false;          // only the copy-engine rate probe (ce_probe below)
  bool trace = false;             // --trace (EPX_HT_TRACE builds): phase stamps of zero-copy ops
  std::vector<std::string> copy;  // dispatch copy paths to time (empty: the process default)
  std::vector<std::string> pull;  // zero-copy combine stagings to time (SxC)
  std::vector<int> ce_share;      // combine: copy-engine shares (percent) to time as well
  int64_t kept_runs = -1;         // --kept-runs: ce:kept's run limit (-1: the library's)
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

int run_rank(const Group& g, const Options& o) {
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
  // Runs of consecutive tokens this rank keeps (ce:kept: one copy call each, ht_kept_copies_pay).
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
  detail::set_ht_kept_copy_max_runs_override(o.kept_runs);
  if (r == 0)
    std::printf(
        "ht T=%lld H=%lld K=%d E=%d R=%d uniform routing; buffer %.1f MB/rank; rank 0 keeps its "
        "tokens in %lld runs (ce:kept copies them by copy engine: %s)\n",
        static_cast<long long>(T), static_cast<long long>(H), K, o.experts, R,
        Buffer::bytes_needed(Mode::kHt, shape, R, Backend::kCuda) / 1e6,
        static_cast<long long>(kept_runs),
        detail::ht_kept_copies_pay(static_cast<size_t>(kept_runs)) ? "yes" : "no, the kernel");
  for (int sms : o.sms) {
    for (int pct : o.send_pct) {
      detail::set_ht_tuning_override(sms, pct, pct);
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
      // One set of timings per copy path; the ablations run under the last one.
      struct CopyTimes {
        std::string name;
        bench::Timing disp, disp8, exact, worst, graph16, graph8, comb;
        // HtDispatchArgs::zero_copy: cached bf16 / fp8 event-timed and graph-replayed, exact.
        bench::Timing zc16, zc8, zcg16, zcg8, zc_exact;
        // The exact rows again with the copy plan built from host copies of send_pos after a
        // stream synchronisation (kHtKeptPlanCopied: the ninth session's A/B; ce:kept only).
        bench::Timing exact_copied, zc_exact_copied;
        // The exact and worst-case rows with the count exchange before the tenth session
        // (kHtNotifyOld: ids loaded one by one, pass 2 reloading them; its same-run A/B).
        bench::Timing exact_old, zc_exact_old, worst_old;
        // ... and with a kept row's metadata loads in series (kHtKeptMetaLate, its A/B).
        bench::Timing exact_kml, zc_exact_kml;
        // ... with the receivers' metadata copied out row by row (kHtRecvMetaRows, its A/B), and
        // with both metadata paths as before the eleventh session (kml | rmr).
        bench::Timing exact_rmr, zc_exact_rmr, exact_meta_old, zc_exact_meta_old;
        // ... with the count exchange on one CTA (kHtNotifyOneCta, the eleventh session's A/B).
        bench::Timing exact_one_cta, zc_exact_one_cta, worst_one_cta;
        // ... and the split exact dispatch (kHtSplitSend, opt-in: senders before the host wait).
        bench::Timing exact_split;
        // The copying combine through the pull protocol (kHtCombineViaPull, opt-in), and the
        // copying dispatch through the zero-copy kernels (kHtDispatchViaZeroCopy, opt-in):
        // cached bf16 / fp8 and exact bf16.
        bench::Timing comb_via_pull, comb_via_pull_whole, via_zc16, via_zc8, via_zc_exact;
        bench::Timing zcomb, zcomb_graph;  // HtCombineArgs::zero_copy, event / graph
        bench::Timing zcomb_nopair;        // the same (graph) without the pair step
        bench::Timing zcomb_regpair;       // the same (graph) with the register pair step
        bench::Timing zcomb_now;           // the same (graph) without topk_weights
        // Per call, 10 calls per graph replayed back to back (graph_run_op): zero-copy dispatch
        // bf16 / fp8, zero-copy combine, copying combine.
        double run_zc16 = 0, run_zc8 = 0, run_zcomb = 0, run_comb = 0;
        // The same two dispatch rows and the copying bf16 graph row with the senders' fixed
        // batch order (kHtSendStatic, the A/B of the dynamic order).
        double run_zc16_st = 0, run_zc8_st = 0;
        bench::Timing graph16_st;
        std::vector<std::pair<std::string, bench::Timing>> zcomb_pull;  // --pull stagings
        std::vector<std::pair<int, bench::Timing>> comb_share;          // --ce-share
        double host16 = 0;  // host time of one cached bf16 call (launches and copy calls), mean
        double host_zc16 = 0;  // the same, zero-copy
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
      // Per-call time of kGraphRunOps calls captured in one CUDA graph, replayed back to back
      // with no barrier between replays (as epx_ll_gpu_bench's graph rows and as an engine's
      // step graph runs them): the ranks' launch skew after a barrier is paid once per replay,
      // not once per call.
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
      std::vector<CopyTimes> per_copy;
      const std::vector<std::string> copies =
          o.copy.empty() ? std::vector<std::string>{""} : o.copy;
      for (const std::string& spec : copies) {
        if (!spec.empty()) {
          const detail::HtCopyConfig cfg = detail::parse_ht_copy(spec, "--copy");
          detail::set_ht_copy_override(&cfg);
        }
        // Handles made under this path (ce keeps its host copy plan in them).
        const HtDispatchResult h16 = buf.ht_dispatch(a), h8 = buf.ht_dispatch(a8);
        HtDispatchArgs c16 = cached, c8 = cached8;
        c16.handle = &h16.handle;
        c8.handle = &h8.handle;
        CopyTimes ct;
        ct.name = spec;
        ct.disp = timed([&](const Allocator& al) { buf.ht_dispatch(c16, al); });
        ct.disp8 = timed([&](const Allocator& al) { buf.ht_dispatch(c8, al); });
        detail::set_ht_ablation(detail::kHtDispatchViaZeroCopy);
        ct.via_zc16 = timed([&](const Allocator& al) { buf.ht_dispatch(c16, al); });
        ct.via_zc8 = timed([&](const Allocator& al) { buf.ht_dispatch(c8, al); });
        ct.via_zc_exact = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
        detail::set_ht_ablation(0);
        ct.graph16 = graph_timed(c16);
        ct.graph8 = graph_timed(c8);
        ct.host16 = host_timed(c16);
        {
          HtDispatchArgs z16 = c16, z8 = c8, ze = a;
          z16.zero_copy = z8.zero_copy = ze.zero_copy = true;
          ct.zc16 = timed([&](const Allocator& al) { buf.ht_dispatch(z16, al); });
          ct.zc8 = timed([&](const Allocator& al) { buf.ht_dispatch(z8, al); });
          ct.zcg16 = graph_timed(z16);
          ct.zcg8 = graph_timed(z8);
          ct.host_zc16 = host_timed(z16);
#ifdef EPX_HT_TRACE
          if (o.trace)
            trace_op(g, stream, o.iters, sms, 0, "dispatch bf16 zero-copy", [&] {
              pool.reset();
              (void)buf.ht_dispatch(z16, pool.get());
            });
#endif
          ct.run_zc16 = graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z16, al); });
          ct.run_zc8 = graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z8, al); });
          detail::set_ht_ablation(detail::kHtSendStatic);
          ct.run_zc16_st =
              graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z16, al); });
          ct.run_zc8_st = graph_run_op([&](const Allocator& al) { (void)buf.ht_dispatch(z8, al); });
          ct.graph16_st = graph_timed(c16);
          detail::set_ht_ablation(0);
          ct.zc_exact = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
        }
        HtCombineArgs cc = ca;  // combine with this path's handle (":combine" needs its plan)
        cc.handle = &h16.handle;
        ct.comb = timed([&](const Allocator& al) { buf.ht_combine(cc, al); });
        detail::set_ht_ablation(detail::kHtCombineViaPull);
        ct.comb_via_pull = timed([&](const Allocator& al) { buf.ht_combine(cc, al); });
        detail::set_ht_ablation(detail::kHtCombineViaPull | detail::kHtCombineViaPullWhole);
        ct.comb_via_pull_whole = timed([&](const Allocator& al) { buf.ht_combine(cc, al); });
        detail::set_ht_ablation(0);
        {  // zero-copy combine: the same y rows written once into the combine buffer
          const TensorView view = buf.ht_combine_buffer(h16.handle);
          CUDA_OK(cudaMemcpy(view.data, cc.y.data, view.nbytes(), cudaMemcpyDeviceToDevice));
          HtCombineArgs cz = cc;
          cz.y = view;
          cz.zero_copy = true;
          ct.zcomb = timed([&](const Allocator& al) { buf.ht_combine(cz, al); });
          ct.zcomb_graph = graph_timed_op([&](const Allocator& al) { buf.ht_combine(cz, al); });
          ct.run_zcomb = graph_run_op([&](const Allocator& al) { buf.ht_combine(cz, al); });
          ct.run_comb = graph_run_op([&](const Allocator& al) { buf.ht_combine(cc, al); });
#ifdef EPX_HT_TRACE
          if (o.trace)
            trace_op(g, stream, o.iters, sms, 1, "combine zero-copy (staged)", [&] {
              pool.reset();
              buf.ht_combine(cz, pool.get());
            });
#endif
          detail::set_ht_ablation(detail::kHtReducePairOff);  // its A/B: the general step
          ct.zcomb_nopair = graph_timed_op([&](const Allocator& al) { buf.ht_combine(cz, al); });
          detail::set_ht_ablation(detail::kHtPullStagedOff);  // the register pair step
          ct.zcomb_regpair = graph_timed_op([&](const Allocator& al) { buf.ht_combine(cz, al); });
          detail::set_ht_ablation(0);
          HtCombineArgs czw = cz;  // no weights: no mirror copy before the kernel
          czw.topk_weights = TensorView{};
          ct.zcomb_now = graph_timed_op([&](const Allocator& al) { buf.ht_combine(czw, al); });
          for (const std::string& spec : o.pull) {
            int st = 0, ch = 0;
            std::sscanf(spec.c_str(), "%dx%d", &st, &ch);
            detail::set_ht_pull_staging_override(st, ch);
            ct.zcomb_pull.emplace_back(
                spec, graph_timed_op([&](const Allocator& al) { buf.ht_combine(cz, al); }));
          }
          detail::set_ht_pull_staging_override(-1, 0);
        }
        for (int pct : o.ce_share) {
          detail::set_ht_engine_share_override(pct);
          ct.comb_share.emplace_back(pct,
                                     timed([&](const Allocator& al) { buf.ht_combine(cc, al); }));
        }
        detail::set_ht_engine_share_override(100);
        ct.exact = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
        {
          HtDispatchArgs ze = a;
          ze.zero_copy = true;
          detail::set_ht_ablation(detail::kHtKeptPlanCopied);
          ct.exact_copied = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_copied = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
          detail::set_ht_ablation(detail::kHtNotifyOld);
          ct.exact_old = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_old = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
          ct.worst_old = timed([&](const Allocator& al) { buf.ht_dispatch(worst, al); });
          detail::set_ht_ablation(detail::kHtKeptMetaLate);
          ct.exact_kml = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_kml = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
          detail::set_ht_ablation(detail::kHtRecvMetaRows);
          ct.exact_rmr = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_rmr = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
          detail::set_ht_ablation(detail::kHtNotifyOneCta);
          ct.exact_one_cta = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_one_cta = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
          ct.worst_one_cta = timed([&](const Allocator& al) { buf.ht_dispatch(worst, al); });
          detail::set_ht_ablation(detail::kHtSplitSend);
          ct.exact_split = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          detail::set_ht_ablation(detail::kHtKeptMetaLate | detail::kHtRecvMetaRows);
          ct.exact_meta_old = timed([&](const Allocator& al) { buf.ht_dispatch(a, al); });
          ct.zc_exact_meta_old = timed([&](const Allocator& al) { buf.ht_dispatch(ze, al); });
#ifdef EPX_HT_TRACE
          if (o.trace)
            trace_op(g, stream, o.iters, sms, 0, "dispatch bf16 zero-copy exact, metadata old",
                     [&] {
                       pool.reset();
                       (void)buf.ht_dispatch(ze, pool.get());
                     });
#endif
          detail::set_ht_ablation(0);
#ifdef EPX_HT_TRACE
          if (o.trace)
            trace_op(g, stream, o.iters, sms, 0, "dispatch bf16 zero-copy exact", [&] {
              pool.reset();
              (void)buf.ht_dispatch(ze, pool.get());
            });
#endif
        }
        ct.worst = timed([&](const Allocator& al) { buf.ht_dispatch(worst, al); });
        buf.check();
        per_copy.push_back(ct);
      }
      // Combine without the --copy override (EPX_HT_COPY or the default), then the last
      // override again for the ablations below.
      const detail::HtCopyConfig last_copy = detail::ht_copy_config();
      detail::set_ht_copy_override(nullptr);
      auto t_comb = timed([&](const Allocator& al) { buf.ht_combine(ca, al); });
      // The same with the float32 -> bf16 emulation in the reducers (the A/B of the hardware
      // conversion; same outputs).
      detail::set_ht_ablation(detail::kHtEmulatedBf16);
      auto t_comb_emu = timed([&](const Allocator& al) { buf.ht_combine(ca, al); });
      // And with the reducers' narrow step (kHtReduceNarrow, the step before the wide default;
      // same outputs).
      detail::set_ht_ablation(detail::kHtReduceNarrow);
      auto t_comb_narrow = timed([&](const Allocator& al) { buf.ht_combine(ca, al); });
      // And without the pair step (kHtReducePairOff: the general wide step for every token).
      detail::set_ht_ablation(detail::kHtReducePairOff);
      auto t_comb_nopair = timed([&](const Allocator& al) { buf.ht_combine(ca, al); });
      detail::set_ht_ablation(0);
      detail::set_ht_copy_override(&last_copy);
      buf.check();
      std::vector<std::pair<std::string, bench::Timing>> ablations;
      if (o.ablate) {
        const std::pair<const char*, int> cases[] = {
            {"dispatch bf16 cached, no kept-row copy", detail::kAblateSelf},
            {"dispatch bf16 cached, no received-row copy", detail::kAblateRemoteCopy},
            {"dispatch bf16 cached, senders only", detail::kAblateSelf | detail::kAblateRemoteCopy},
        };
        // A handle made under the last copy path (ce: with its copy plan).
        const HtDispatchResult hab = buf.ht_dispatch(a);
        HtDispatchArgs cab = cached;
        cab.handle = &hab.handle;
        for (const auto& [name, bits] : cases) {
          detail::set_ht_ablation(bits);
          ablations.emplace_back(name,
                                 timed([&](const Allocator& al) { buf.ht_dispatch(cab, al); }));
        }
        // Copy-engine path stages (graph-timed: no host cost); no effect under other paths.
        const std::pair<const char*, int> engine_cases[] = {
            {"ce graph: full", 0},
            {"ce graph: no push copies", detail::kAblateEnginePush},
            {"ce graph: no kept-row copies", detail::kAblateEngineKept},
            {"ce graph: no copy-out", detail::kAblateEngineOut},
            {"ce graph: no copies at all",
             detail::kAblateEnginePush | detail::kAblateEngineKept | detail::kAblateEngineOut},
        };
        for (const auto& [name, bits] : engine_cases) {
          detail::set_ht_ablation(bits);
          ablations.emplace_back(name, graph_timed(cab));
        }
        detail::set_ht_ablation(detail::kAblateReduce);
        ablations.emplace_back("combine, senders only (reducers wait)",
                               timed([&](const Allocator& al) { buf.ht_combine(ca, al); }));
        detail::set_ht_ablation(0);
      }
      auto n_bf16 = bench::nccl_all_to_all(g, bf16_bytes, o.warmup, o.iters);
      auto n_fp8 = bench::nccl_all_to_all(g, fp8_bytes, o.warmup, o.iters);
      auto c_bf16 = bench::nvlink_copy_ceiling(g, bf16_bytes, sms, o.warmup, o.iters);
      // NCCL's all-to-all of 16 bytes per peer: the fixed cost of an op that waits for its peers
      // (launch, handshake, and the ranks' launch skew after the per-iteration group barrier),
      // which the ceiling kernel (pushes only, no cross-rank wait) does not pay.
      auto n_tiny = bench::nccl_all_to_all(g, 16, o.warmup, o.iters);
      // An empty kernel timed as the ops are (one-call graph after a barrier; 10-call graph):
      // the launch and timing overhead inside every row.
      const bench::Timing empty1 =
          graph_timed_op([&](const Allocator&) { bench::launch_empty_kernel(stream); });
      const double empty10 =
          graph_run_op([&](const Allocator&) { bench::launch_empty_kernel(stream); });
      auto c_fp8 = bench::nvlink_copy_ceiling(g, fp8_bytes, sms, o.warmup, o.iters);
      if (r == 0) {
        const detail::HtTuning& tu = static_cast<detail::CudaBuffer&>(buf.impl()).tuning();
        std::printf(
            "\nSMs %d (sender CTAs: dispatch %d, ce:kept %d, zero-copy %d, combine %d): remote "
            "rows/peer %lld (%.1f MB bf16, %.1f MB fp8), self rows %lld\n",
            sms, tu.dispatch_send_ctas, tu.dispatch_send_ctas_kept, tu.dispatch_send_ctas_zero_copy,
            tu.combine_send_ctas, static_cast<long long>(remote_rows), bf16_bytes / 1e6,
            fp8_bytes / 1e6, static_cast<long long>(self_rows));
        std::printf("  %-52s %10s %10s %10s %10s %12s %10s\n", "op", "epx us", "min us", "nccl us",
                    "ceil us", "epx/nccl", "ceil/epx");
        auto row = [&](const char* name, const bench::Timing& e, const bench::Timing& n,
                       const bench::Timing& c) {
          std::printf("  %-52s %10.1f %10.1f %10.1f %10.1f %12.2f %10.2f\n", name, e.median_us,
                      e.min_us, n.median_us, c.median_us, e.median_us / n.median_us,
                      c.median_us / e.median_us);
        };
        for (const CopyTimes& ct : per_copy) {
          auto name = [&](const std::string& op) {
            return ct.name.empty() ? op : op + " [" + ct.name + "]";
          };
          row(name("dispatch bf16 (cached)").c_str(), ct.disp, n_bf16, c_bf16);
          row(name("dispatch fp8 (cached)").c_str(), ct.disp8, n_fp8, c_fp8);
          row(name("dispatch bf16 (cached, via zero-copy kernels)").c_str(), ct.via_zc16, n_bf16,
              c_bf16);
          row(name("dispatch fp8 (cached, via zero-copy kernels)").c_str(), ct.via_zc8, n_fp8,
              c_fp8);
          row(name("dispatch bf16 (exact, via zero-copy kernels)").c_str(), ct.via_zc_exact, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (cached, graph)").c_str(), ct.graph16, n_bf16, c_bf16);
          row(name("dispatch fp8 (cached, graph)").c_str(), ct.graph8, n_fp8, c_fp8);
          row(name("dispatch bf16 (cached, zero-copy)").c_str(), ct.zc16, n_bf16, c_bf16);
          row(name("dispatch fp8 (cached, zero-copy)").c_str(), ct.zc8, n_fp8, c_fp8);
          row(name("dispatch bf16 (cached, zero-copy, graph)").c_str(), ct.zcg16, n_bf16, c_bf16);
          row(name("dispatch fp8 (cached, zero-copy, graph)").c_str(), ct.zcg8, n_fp8, c_fp8);
          row(name("dispatch bf16 (exact, zero-copy)").c_str(), ct.zc_exact, n_bf16, c_bf16);
          std::printf("  %-52s %10.1f\n", name("host us per cached bf16 call").c_str(), ct.host16);
          std::printf("  %-52s %10.1f\n", name("host us per cached zero-copy bf16 call").c_str(),
                      ct.host_zc16);
          row(name("dispatch bf16 (exact)").c_str(), ct.exact, n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, plan copied)").c_str(), ct.exact_copied, n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, zero-copy, plan copied)").c_str(), ct.zc_exact_copied,
              n_bf16, c_bf16);
          row(name("dispatch bf16 (worst-case)").c_str(), ct.worst, n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, old count exchange)").c_str(), ct.exact_old, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (exact, zero-copy, old count exchange)").c_str(), ct.zc_exact_old,
              n_bf16, c_bf16);
          row(name("dispatch bf16 (worst-case, old count exchange)").c_str(), ct.worst_old, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (exact, kept metadata late)").c_str(), ct.exact_kml, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (exact, zero-copy, kept metadata late)").c_str(), ct.zc_exact_kml,
              n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, receive metadata by row)").c_str(), ct.exact_rmr, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (exact, zero-copy, receive metadata by row)").c_str(),
              ct.zc_exact_rmr, n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, metadata old)").c_str(), ct.exact_meta_old, n_bf16,
              c_bf16);
          row(name("dispatch bf16 (exact, count exchange on one CTA)").c_str(), ct.exact_one_cta,
              n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, zero-copy, count exchange on one CTA)").c_str(),
              ct.zc_exact_one_cta, n_bf16, c_bf16);
          row(name("dispatch bf16 (worst-case, count exchange on one CTA)").c_str(),
              ct.worst_one_cta, n_bf16, c_bf16);
          row(name("dispatch bf16 (exact, split: senders before the host wait)").c_str(),
              ct.exact_split, n_bf16, c_bf16);

          row(name("dispatch bf16 (exact, zero-copy, metadata old)").c_str(), ct.zc_exact_meta_old,
              n_bf16, c_bf16);
          row(name("combine bf16").c_str(), ct.comb, n_bf16, c_bf16);
          row(name("combine bf16 (via pull: the peers' rows copied into the buffer)").c_str(),
              ct.comb_via_pull, n_bf16, c_bf16);
          row(name("combine bf16 (via pull, the whole copy before the kernel)").c_str(),
              ct.comb_via_pull_whole, n_bf16, c_bf16);
          row(name("combine bf16 (zero-copy)").c_str(), ct.zcomb, n_bf16, c_bf16);
          row(name("combine bf16 (zero-copy, graph)").c_str(), ct.zcomb_graph, n_bf16, c_bf16);
          row(name("combine bf16 (zero-copy, graph, no pair step)").c_str(), ct.zcomb_nopair,
              n_bf16, c_bf16);
          row(name("combine bf16 (zero-copy, graph, register pair step)").c_str(), ct.zcomb_regpair,
              n_bf16, c_bf16);
          row(name("combine bf16 (zero-copy, graph, no weights)").c_str(), ct.zcomb_now, n_bf16,
              c_bf16);
          std::printf("  %-52s %10.1f %10.1f %10.1f %10.1f\n",
                      name("graph of 10 calls, per call: dispatch bf16 / fp8 zero-copy").c_str(),
                      ct.run_zc16, ct.run_zc8, n_bf16.median_us, c_bf16.median_us);
          std::printf("  %-52s %10.1f %10.1f %10.1f %10.1f\n",
                      name("graph of 10 calls, per call: the same, fixed send order").c_str(),
                      ct.run_zc16_st, ct.run_zc8_st, n_bf16.median_us, c_bf16.median_us);
          row(name("dispatch bf16 (cached, graph, fixed send order)").c_str(), ct.graph16_st,
              n_bf16, c_bf16);
          std::printf("  %-52s %10.1f %10.1f %10.1f %10.1f\n",
                      name("graph of 10 calls, per call: combine zero-copy / copying").c_str(),
                      ct.run_zcomb, ct.run_comb, n_bf16.median_us, c_bf16.median_us);
          for (const auto& [spec, t] : ct.zcomb_pull)
            row(name("combine bf16 (zero-copy, graph, staged " + spec + ")").c_str(), t, n_bf16,
                c_bf16);
          for (const auto& [pct, t] : ct.comb_share)
            row(name("combine bf16 ce share " + std::to_string(pct) + "%").c_str(), t, n_bf16,
                c_bf16);
        }
        row("combine bf16 [EPX_HT_COPY / default]", t_comb, n_bf16, c_bf16);
        row("combine bf16 [default, emulated bf16 rounding]", t_comb_emu, n_bf16, c_bf16);
        row("combine bf16 [default, narrow reducer step]", t_comb_narrow, n_bf16, c_bf16);
        row("combine bf16 [default, no pair step]", t_comb_nopair, n_bf16, c_bf16);
        if (o.ablate) {
          std::printf("  ablations (same run; outputs wrong):\n");
          for (const auto& [name, t] : ablations)
            std::printf("  %-40s %10.1f %10.1f\n", name.c_str(), t.median_us, t.min_us);
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
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

// --ce-probe (2 ranks): copy-engine rates into a peer's memory, to explain the ≈ 225 GB/s the
// ce path reached (docs/perf-cuda-ht.md run 10). cudaMemcpyAsync of S bytes from a local
// cudaMalloc buffer into (a) the peer's NCCL window through its LSA mapping (what the ce path
// writes), (b) a cudaMalloc buffer of the peer opened with cudaIpcOpenMemHandle (the classic peer
// path; reference/nvlink.md measured 395 GB/s there), (c) this rank's own window (local copy);
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
    else if (a == "--send-pct")
      o.send_pct = parse_list(next());
    else if (a == "--warmup")
      o.warmup = std::atoi(next());
    else if (a == "--iters")
      o.iters = std::atoi(next());
    else if (a == "--ablate")
      o.ablate = true;
    else if (a == "--ce-probe")
      o.ce_probe = true;
    else if (a == "--copy")
      o.copy = gpu_testing::split_commas(next());
    else if (a == "--ce-share")
      o.ce_share = parse_list(next());
    else if (a == "--pull")
      o.pull = gpu_testing::split_commas(next());
    else if (a == "--trace")
      o.trace = true;
    else if (a == "--kept-runs")
      o.kept_runs = std::atoll(next());
    else {
      std::fprintf(stderr,
                   "usage: %s [--ranks R] [--tokens T] [--hidden H] [--topk K] [--experts E] "
                   "[--sms a,b] [--send-pct p,q] [--warmup W] [--iters N] [--ablate] "
                   "[--copy warp,bulk[:SxC][:bN],ce[:kept][:combine[-auto]],...] [--ce-share p,q] "
                   "[--ce-probe] [--pull SxC,...] [--trace] [--kept-runs N]\n",
                   argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  for (const std::string& spec : o.copy) {
    try {
      detail::parse_ht_copy(spec, "--copy");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 2;
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
  return gpu_testing::run_cuda_ranks(
      R, [&](const Group& g) { return o.ce_probe ? ce_probe(g, o) : run_rank(g, o); });
}
