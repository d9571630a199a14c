// bench/ht_onegpu_bench.cc — a proxy for the ht dispatch kernels' GPU-side costs where only
// one GPU is lent: R ranks as threads sharing GPU 0 (Group::cuda_shared_device, as the one-GPU
// GPU tests), each rank's kernels on `--sms` SMs of its own (co-resident), every "peer" store
// and load going to the same GPU's memory instead of over NVLink. Not a measure of epx's EP
// speed (no link; the ranks share the GPU's memory bandwidth) — a same-run view of the kernels'
// side: exact vs cached vs worst-case, zero-copy or not.
//
//   epx_ht_onegpu_bench [--ranks 2] [--tokens 4096] [--hidden 7168] [--topk 8] [--experts 256]
//                       [--sms 16] [--calls 20] [--rounds 5] [--trace] [--combine-only]
//                       diagnostics builds (-DEPX_DIAGNOSTICS=ON) also: [--bits N] (ablation
//                       bits of cuda/tuning.h for every row; outputs wrong)
//
// Per row: `calls` dispatches back to back on the rank's stream between two CUDA events (after a
// group barrier), µs per call; the median of `rounds` such rounds; rank 0's time and the slowest
// rank's. Rows also note the host time per call and epx-bench's measure (one call alone between
// two events after a barrier, the median over calls x rounds). Then the combine (copying,
// zero-copy). The kernels move every row in this mode, or the copy engines copy the kept rows
// with EPX_ONE_GPU_SIDE_STREAMS=1 (R <= 6; CudaHt's engine_kept_).
// --trace (a -DEPX_HT_TRACE=ON build): then each dispatch kind alone, the count exchange's and the
// dispatch kernel's phase stamps (kernels/ht/trace.cuh), rank 0's.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/kernels/ht/trace.cuh"
#include "cuda/tuning.h"
#include "epx/buffer.h"
#include "epx/group.h"
#include "gpu/gpu_support.h"
#include "support/routing.h"
#include "transport/transport.h"

using namespace epx;

namespace {

struct Options {
  int ranks = 2;
  int64_t tokens = 4096, hidden = 7168;
  int topk = 8, experts = 256, sms = 16, calls = 20, rounds = 5;
  int bits = 0;        // --bits N (diagnostics builds): ablation bits for every row (outputs wrong)
  bool trace = false;  // --trace (EPX_HT_TRACE builds): the phase stamps of each dispatch kind
  bool combine_only = false;  // --combine-only: only the combine rows (e.g. under a profiler)
};

// --bits (diagnostics builds): every rank's process is the same one here, so rank 0 sets them
// between two barriers.
void set_bits(const Group& g, int bits) {
#ifdef EPX_DIAGNOSTICS
  g.transport()->barrier("onegpu bench bits");
  if (g.rank() == 0) detail::set_ht_ablation(bits);
  g.transport()->barrier("onegpu bench bits set");
#else
  (void)g;
  (void)bits;
#endif
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

#ifdef EPX_HT_TRACE
// The calling rank's trace stamps (kernels/ht/trace.cuh) of one call at a time, for the first
// `ctas` CTAs: cleared before the call, read after it.
struct TraceStamps {
  uint64_t* buf = detail::ht_trace_buffer_of_thread();  // null: no trace buffer (nothing traced)
  int n;
  std::vector<uint64_t> host = std::vector<uint64_t>(detail::kHtTraceWords);
  explicit TraceStamps(int ctas) : n(std::min(ctas, detail::kHtTraceCtas)) {}
  // Clears the stamps, meets the group at a barrier, runs `call` (which queues its work on
  // `stream`) between two CUDA events and reads the stamps once it is done; its time, µs.
  double run(const Group& g, cudaStream_t stream, const std::function<void()>& call) {
    CUDA_OK(cudaMemsetAsync(buf, 0, detail::kHtTraceWords * sizeof(uint64_t), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    g.transport()->barrier("onegpu trace");
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventRecord(e0, stream));
    call();
    CUDA_OK(cudaEventRecord(e1, stream));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaMemcpy(host.data(), buf, detail::kHtTraceWords * sizeof(uint64_t),
                       cudaMemcpyDeviceToHost));
    return 1e3 * ms;
  }
  uint64_t at(int op, int ph, int c) const {
    return host[(static_cast<size_t>(op) * detail::kHtTracePhases + ph) * detail::kHtTraceCtas + c];
  }
  // Op `op`'s stamps of phase `ph` over the CTAs that reached it, sorted.
  std::vector<uint64_t> ctas_of(int op, int ph) const {
    std::vector<uint64_t> v;
    for (int c = 0; c < n; ++c)
      if (at(op, ph, c)) v.push_back(at(op, ph, c));
    std::sort(v.begin(), v.end());
    return v;
  }
};

// --trace (a -DEPX_HT_TRACE=ON build): `call` (one dispatch) `iters` times, each alone after a
// group barrier, the calling rank's stamps read after each (kernels/ht/trace.cuh: op 2 = the
// count exchange, op 0 = the dispatch kernel); per phase the median over calls of the time after
// the count exchange's entry (cached: the dispatch kernel's first CTA entry), µs.
void trace_dispatch(const Group& g, cudaStream_t stream, int iters, int ctas, const char* name,
                    const std::function<void()>& call) {
  TraceStamps st(ctas);
  if (st.buf == nullptr) return;
  struct Col {
    const char* what;
    std::vector<double> v;
  };
  std::vector<Col> cols = {{"exchange: set-up done", {}},
                           {"exchange: pass 1 round 0 done", {}},
                           {"exchange: pass 1 done", {}},
                           {"exchange: counts in", {}},
                           {"exchange: N published", {}},
                           {"exchange: pass 2 done", {}},
                           {"exchange: exit", {}},
                           {"dispatch: first CTA entry", {}},
                           {"dispatch: peers ready (median CTA)", {}},
                           {"dispatch: warp 0 sent (median CTA)", {}},
                           {"dispatch: warp 0 sent (last CTA)", {}},
                           {"dispatch: receive done (median CTA)", {}},
                           {"dispatch: receive done (last CTA)", {}},
                           {"dispatch: exit (last CTA)", {}}};
  for (int i = 0; i < iters; ++i) {
    (void)st.run(g, stream, call);
    auto at = [&](int op, int ph, int c) { return st.at(op, ph, c); };
    auto ctas_of = [&](int ph) { return st.ctas_of(0, ph); };  // the dispatch kernel's
    const std::vector<uint64_t> entry = ctas_of(detail::kHtTrEntry);
    if (entry.empty()) continue;
    const uint64_t t0 = at(2, detail::kHtTrEntry, 0) ? at(2, detail::kHtTrEntry, 0) : entry[0];
    auto us = [&](uint64_t t) { return t >= t0 ? (t - t0) / 1e3 : -1.0; };
    int c = 0;
    // The count exchange (zero where the op had none: cached).
    const int ex[] = {detail::kHtTrNotifySetUp, detail::kHtTrNotifyRound0, detail::kHtTrStart,
                      detail::kHtTrWork,        detail::kHtTrRecv,         detail::kHtTrDone,
                      detail::kHtTrExit};
    for (int ph : ex) {
      if (at(2, ph, 0)) cols[c].v.push_back(us(at(2, ph, 0)));
      ++c;
    }
    cols[c++].v.push_back(us(entry[0]));
    auto mid_last = [&](int ph, bool with_mid) {
      const std::vector<uint64_t> v = ctas_of(ph);
      if (with_mid) {
        if (!v.empty()) cols[c].v.push_back(us(v[v.size() / 2]));
        ++c;
      }
      if (!v.empty()) cols[c].v.push_back(us(v.back()));
      ++c;
    };
    {
      const std::vector<uint64_t> v = ctas_of(detail::kHtTrStart);
      if (!v.empty()) cols[c].v.push_back(us(v[v.size() / 2]));
      ++c;
    }
    mid_last(detail::kHtTrWork, true);
    mid_last(detail::kHtTrRecv, true);
    mid_last(detail::kHtTrExit, false);
  }
  if (g.rank() != 0) return;  // every rank traced its own; rank 0 prints
  std::printf("[trace rank %d] %s: us after the count exchange's entry, median of %d calls\n",
              g.rank(), name, iters);
  for (const Col& col : cols)
    if (!col.v.empty())
      std::printf("[trace rank %d]   %-40s %8.2f\n", g.rank(), col.what, median(col.v));
  std::fflush(stdout);
}
#endif

#ifdef EPX_HT_TRACE
// --trace: `call` (one combine) `iters` times, each alone after a group barrier between two CUDA
// events; the staged pull combine's stamps (op 1) of the calling rank, µs after the kernel's first
// CTA entry (median over calls), and the call's event time (the part before the kernel's entry is
// roughly that minus the last exit).
void trace_combine(const Group& g, cudaStream_t stream, int iters, int ctas, const char* name,
                   const std::function<void()>& call) {
  TraceStamps stamps(ctas);
  if (stamps.buf == nullptr) return;
  std::vector<double> total, start_mid, work_mid, work_last, done_last, exit_last;
  for (int i = 0; i < iters; ++i) {
    const double call_us = stamps.run(g, stream, call);
    auto ctas_of = [&](int ph) { return stamps.ctas_of(1, ph); };  // the staged combine's
    const std::vector<uint64_t> entry = ctas_of(detail::kHtTrEntry);
    if (entry.empty()) continue;  // not the staged kernel: no stamps
    auto us = [&](uint64_t t) { return (static_cast<double>(t) - entry[0]) / 1e3; };
    total.push_back(call_us);
    const auto st = ctas_of(detail::kHtTrStart), wk = ctas_of(detail::kHtTrWork),
               dn = ctas_of(detail::kHtTrDone), ex = ctas_of(detail::kHtTrExit);
    if (!st.empty()) start_mid.push_back(us(st[st.size() / 2]));
    if (!wk.empty()) work_mid.push_back(us(wk[wk.size() / 2]));
    if (!wk.empty()) work_last.push_back(us(wk.back()));
    if (!dn.empty()) done_last.push_back(us(dn.back()));
    if (!ex.empty()) exit_last.push_back(us(ex.back()));
  }
  if (g.rank() != 0) return;
  if (total.empty()) {
    std::printf("[trace rank 0] %s: no staged-combine stamps\n", name);
    return;
  }
  std::printf(
      "[trace rank 0] %s: call %.1f us (events); after the first CTA entry: warp 0's first token "
      "set up %.1f (median CTA), warp 0 done %.1f / %.1f (median / last CTA), CTA done %.1f, "
      "exit %.1f (last)\n",
      name, median(total), median(start_mid), median(work_mid), median(work_last),
      median(done_last), median(exit_last));
  std::fflush(stdout);
}
#endif

int run_rank(const Group& g, const Options& o) {
  const int R = g.size(), r = g.rank(), dev = gpu_testing::device_of(g);
  const int64_t T = o.tokens, H = o.hidden;
  const int K = o.topk;
  cudaStream_t stream = gpu_testing::rank_stream();
  // The rank's stream-ordered allocator, timed (host µs spent allocating, per row: the share of
  // exact mode's host gap that is allocation).
  const Allocator device_alloc = gpu_testing::device_allocator();
  double alloc_us = 0;
  int64_t alloc_calls = 0;
  const Allocator alloc = [&](DType dtype, const std::vector<int64_t>& shape, Device device) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor t = device_alloc(dtype, shape, device);
    alloc_us +=
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    ++alloc_calls;
    return t;
  };
  std::mt19937_64 rng(4321 + r);
  auto topk = epx::testing::make_topk_idx(epx::testing::Routing::kUniform, T, K, o.experts, R, rng);
  auto weights = epx::testing::make_topk_weights(topk, rng);
  auto xb = epx::testing::make_bf16(T, H, rng);
  Tensor d_topk = gpu_testing::to_device(topk, DType::kI64, {T, K}, dev);
  Tensor d_w = gpu_testing::to_device(weights, DType::kF32, {T, K}, dev);
  Tensor d_x = gpu_testing::to_device(xb, DType::kBF16, {T, H}, dev);
  MoeShape shape;
  shape.hidden = H;
  shape.top_k = K;
  shape.num_experts = o.experts;
  shape.max_tokens_per_rank = T;
  Buffer buf(g, shape);
  HtDispatchArgs exact;
  exact.x = d_x;
  exact.topk_idx = d_topk;
  exact.topk_weights = d_w;
  exact.stream = stream;
  const HtDispatchResult first = buf.ht_dispatch(exact, alloc);
  HtDispatchArgs cached = exact;
  cached.handle = &first.handle;
  cached.topk_idx = TensorView();
  cached.topk_weights = TensorView();
  HtDispatchArgs zc_exact = exact, zc_cached = cached;
  zc_exact.zero_copy = zc_cached.zero_copy = true;
  HtDispatchArgs worst = exact;  // no host wait: the count exchange and the kernel back to back
  worst.num_worst_tokens = T * R;

  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  // µs per call of o.calls dispatches back to back, median of o.rounds; every rank times its own.
  auto timed_op = [&](const std::function<void()>& op) {
    std::vector<double> us;
    for (int round = 0; round <= o.rounds; ++round) {  // round 0: warm-up
      CUDA_OK(cudaStreamSynchronize(stream));
      g.transport()->barrier("onegpu bench round");
      CUDA_OK(cudaEventRecord(e0, stream));
      for (int c = 0; c < o.calls; ++c) op();
      CUDA_OK(cudaEventRecord(e1, stream));
      CUDA_OK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      if (round > 0) us.push_back(1e3 * ms / o.calls);
    }
    return median(us);
  };
  // µs of one call timed alone between two events right after a group barrier (epx-bench's
  // method, bench/baselines_cuda.cu time_on_device), median of calls x rounds such calls.
  auto timed_single = [&](const HtDispatchArgs& args) {
    std::vector<double> us;
    for (int i = 0; i < o.calls * o.rounds + 2; ++i) {  // 2 warm-up calls
      CUDA_OK(cudaStreamSynchronize(stream));
      g.transport()->barrier("onegpu bench single");
      CUDA_OK(cudaEventRecord(e0, stream));
      (void)buf.ht_dispatch(args, alloc);
      CUDA_OK(cudaEventRecord(e1, stream));
      CUDA_OK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 2) us.push_back(1e3 * ms);
    }
    return median(us);
  };
  // Also the host time per call spent in the allocator (alloc_per_call) and inside ht_dispatch.
  double alloc_per_call = 0, host_per_call = 0;
  int allocs_per_call = 0;
  auto timed = [&](const HtDispatchArgs& args) {
    alloc_us = 0;
    alloc_calls = 0;
    double host_us = 0;
    int calls = 0;
    const double us = timed_op([&] {
      const auto t0 = std::chrono::steady_clock::now();
      (void)buf.ht_dispatch(args, alloc);
      host_us +=
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      ++calls;
    });
    alloc_per_call = alloc_us / calls;
    host_per_call = host_us / calls;
    allocs_per_call = static_cast<int>(alloc_calls / calls);
    return us;
  };
  struct Row {
    const char* op;
    const HtDispatchArgs* args;
  };
  const Row rows[] = {{"cached", &cached},
                      {"exact", &exact},
                      {"worst-case", &worst},
                      {"cached, zero-copy", &zc_cached},
                      {"exact, zero-copy", &zc_exact}};
  // Rank 0 prints its time and the slowest rank's (gathered through a device-free exchange:
  // every rank writes its time into a shared vector between two barriers).
  static std::vector<double> g_times;
  if (r == 0) {
    g_times.assign(R, 0.0);
    std::printf(
        "ht one-GPU proxy: R=%d ranks on one GPU, %d SMs each, T=%lld H=%lld K=%d E=%d, uniform "
        "routing; us per dispatch (%d back to back, median of %d rounds): rank 0 / slowest "
        "rank\n",
        R, o.sms, static_cast<long long>(T), static_cast<long long>(H), K, o.experts, o.calls,
        o.rounds);
  }
  g.transport()->barrier("onegpu bench start");
  // One row: every rank's time gathered, rank 0 prints its own and the slowest rank's.
  auto report = [&](const std::string& what, double us, const std::string& note = "") {
    g_times[r] = us;
    g.transport()->barrier("onegpu bench gathered");
    if (r == 0) {
      std::printf("  %s %10.1f %10.1f   %s\n", what.c_str(), us,
                  *std::max_element(g_times.begin(), g_times.end()), note.c_str());
      std::fflush(stdout);
    }
  };
  set_bits(g, o.bits);
  // The layout alone: the count-exchange kernel's pass 1 (no exchange, no pass 2).
  if (!o.combine_only) {
    report("layout (count kernel, pass 1 only)",
           timed_op([&] { (void)buf.ht_layout(d_topk, stream, alloc); }));
    for (const Row& row : rows) {
      const double us = timed(*row.args);
      char host[160];
      std::snprintf(host, sizeof host, "host %.1f us/call, %d allocations %.1f us", host_per_call,
                    allocs_per_call, alloc_per_call);
      // Also epx-bench's way: one call alone after a barrier.
      const double single = timed_single(*row.args);
      const size_t n = std::strlen(host);
      std::snprintf(host + n, sizeof host - n, "; one call after a barrier %.1f us", single);
      report(std::string("dispatch bf16 (") + row.op + ")", us, host);
    }
  }
  // Combine with the first exact dispatch's handle and weights, y [N, H] of arbitrary values:
  // the copying combine (the kernels' senders and reducers in this mode) and the zero-copy
  // combine (y already there).
  {
    const int64_t N = first.recv_x.shape[0];
    Tensor y = device_alloc(DType::kBF16, {N, H}, Device::cuda(dev));
    CUDA_OK(cudaMemsetAsync(y.data, 0x3c, y.nbytes(), stream));
    HtCombineArgs comb;
    comb.y = y;
    comb.handle = &first.handle;
    comb.topk_weights = first.recv_topk_weights;
    comb.stream = stream;
    HtCombineArgs zc_comb = comb;
    zc_comb.y = buf.ht_combine_buffer(first.handle);
    zc_comb.zero_copy = true;
    struct CombineRow {
      const char* name;
      const HtCombineArgs* args;
    };
    const CombineRow crows[] = {{"combine bf16", &comb}, {"combine bf16 (zero-copy)", &zc_comb}};
    for (const CombineRow& row : crows) {
      g.transport()->barrier("onegpu bench combine");
      report(row.name, timed_op([&] { (void)buf.ht_combine(*row.args, alloc); }));
#ifdef EPX_HT_TRACE
      if (o.trace)
        trace_combine(g, stream, o.rounds * 4, o.sms, row.name,
                      [&] { (void)buf.ht_combine(*row.args, alloc); });
#endif
    }
  }
#ifdef EPX_HT_TRACE
  if (o.trace && !o.combine_only) {
    for (const Row& row : rows) {
      g.transport()->barrier("onegpu trace row");
      trace_dispatch(g, stream, o.rounds * 4, o.sms, row.op,
                     [&] { (void)buf.ht_dispatch(*row.args, alloc); });
    }
  }
#endif
  g.transport()->barrier("onegpu bench end");
  set_bits(g, 0);
  buf.check();
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--combine-only") {
      o.combine_only = true;
      continue;
    }
    if (a == "--trace") {
#ifndef EPX_HT_TRACE
      std::fprintf(stderr, "--trace needs a build with -DEPX_HT_TRACE=ON\n");
      return 2;
#endif
      o.trace = true;
      continue;
    }
    if (a == "--help" || i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--ranks R] [--tokens T] [--hidden H] [--topk K] [--experts E] "
                   "[--sms S] [--calls N] [--rounds N] [--trace] [--combine-only]%s\n",
                   argv[0],
#ifdef EPX_DIAGNOSTICS
                   " [--bits N]"
#else
                   ""
#endif
      );
      return a == "--help" ? 0 : 2;
    }
    const char* v = argv[++i];
    if (a == "--ranks")
      o.ranks = std::atoi(v);
    else if (a == "--tokens")
      o.tokens = std::atoll(v);
    else if (a == "--hidden")
      o.hidden = std::atoll(v);
    else if (a == "--topk")
      o.topk = std::atoi(v);
    else if (a == "--experts")
      o.experts = std::atoi(v);
    else if (a == "--sms")
      o.sms = std::atoi(v);
    else if (a == "--calls")
      o.calls = std::atoi(v);
    else if (a == "--rounds")
      o.rounds = std::atoi(v);
#ifdef EPX_DIAGNOSTICS
    else if (a == "--bits")
      o.bits = std::atoi(v);
#endif
    else {
      std::fprintf(stderr, "unknown option %s (--help)\n", a.c_str());
      return 2;
    }
  }
  if (gpu_testing::visible_gpus() == 0) {
    std::printf("epx_ht_onegpu_bench: no GPU visible, nothing to measure\n");
    return 0;
  }
  GroupOptions options;
  options.num_sms = o.sms;
  return gpu_testing::run_cuda_ranks_one_gpu(
      o.ranks, 0, [&](const Group& g) { return run_rank(g, o); }, options);
}
