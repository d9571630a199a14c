// bench/ll_overlap_bench.cu — the ll combine overlapped with the expert down GEMM (docs/design.md
// §7.6) against the GEMM followed by the plain combine, on one GPU: R = 1 (no link bytes: what
// the overlap hides of the send's SM work and what it costs the GEMM) and R = 2 as rank threads
// sharing the GPU (Group::cuda_shared_device: the protocol between ranks, not NVLink). Checks
// nothing (the GPU tier does: gpu_ll_overlap_gpu_test).
//
//   epx_ll_overlap_bench [--ranks 1,2] [--sms 3,8,16,32] [--replays 200] [--tokens 128]
//                        [--hidden 7168] [--inter 2048] [--local-experts 32] [--block-m 64]
//                        [--trace]
//
// Workload per rank (EP8's per-rank down GEMM of DeepSeek-V3 at T = 128): T tokens, K = 8,
// L local experts (E = L * R), uniform routing (≈ T * R * K / E rows per expert); per expert a
// cuBLAS bf16 GEMM y[l] [n_l, H] = act[l] [n_l, I] x W[l] [I, H] (W: L * I * H bf16, 0.94 GB at
// the defaults), then a one-warp kernel raising the expert's signals (blocks form: every block of
// block_m rows, reached at 1; experts form: its one signal) on a third stream that waits for that
// GEMM only, so the GEMMs still run back to back: a kernel between two GEMMs of one stream adds
// kernel boundaries a GEMM that raises its signals in its epilogue does not have (suspected
// for the ≈ 86 µs by which (b) ended after the GEMM at every S on 2026-12-01, when the signal
// kernels ran on the GEMMs' stream; the gemm-S+sig column measures what they cost now). The
// combine reads y (copy mode) with
// the dispatch's routing. Every row is one CUDA graph replayed `replays` times after 10 warm-up
// replays, each replay timed by events around its launch: the median, in µs.
//
// Columns, per R, signal form and send SM budget S:
//   gemm       the GEMMs on every SM (cuBLAS's default)
//   gemm-S     the GEMMs with cublasSetSmCountTarget(SMs - S)
//   gemm-S+sig the same with the signal kernels (no combine): what raising the signals costs
//   combine    the plain combine alone (one kernel, C CTAs)
//   send+hook  the overlapped combine alone, signals already reached (send on S CTAs, receive)
//   (a)        gemm, then the plain combine (one stream)
//   (b)        signals zeroed; fork; gemm-S with the signal kernels || the overlapped send on a
//              side stream; the hook (receive) on the side stream; join
//   gain       (a) - (b): the hidden send less the GEMM's loss of S SMs, the tail (the last
//              block's push after the last signal) and the hook
//
// --trace (a build with -DEPX_LL_TRACE=ON; docs/design.md §7.6): after each row, the (b) graph
// again with %globaltimer stamps on the kernels' clock: a one-thread kernel on the GEMM stream
// after each GEMM (its end; these add 32 kernel boundaries to the GEMM chain, so the traced
// replay's span is printed beside (b)), the signal kernels' own time, the graph's start and end,
// and the overlapped send's item stamps and both launches' phases (src/cuda/kernels/ll/trace.cuh).
// Printed per local expert: GEMM end, signal raised, the send CTA's wait start, signal seen, rows
// stored, the gaps; then per send CTA its waiting and pushing time, and the tail after the last
// GEMM end: signal, seen, stored, send CTAs done, receive entry and exit, graph end. Rank 0's
// timeline, three traced replays (a tail line each, the tables of the last).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/trace_clock.cuh"
#include "cuda/kernels/ll/trace.cuh"
#include "epx/buffer.h"
#include "epx/group.h"
#include "gpu/gpu_support.h"
#include "support/routing.h"
#include "transport/transport.h"

using namespace epx;

namespace {

#define CUBLAS_OK(call)                                                                            \
  do {                                                                                             \
    const cublasStatus_t s_ = (call);                                                              \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                               \
      throw Error(ErrorCode::kCuda,                                                                \
                  std::string(#call) + ": cuBLAS status " + std::to_string(static_cast<int>(s_))); \
  } while (0)

struct Options {
  std::vector<int> ranks = {1, 2};
  std::vector<int> sms = {3, 8, 16, 32};
  int replays = 200, top_k = 8, local_experts = 32;
  int64_t tokens = 128, hidden = 7168, inter = 2048, block_m = 64;
  bool trace = false;  // EPX_LL_TRACE builds only
};

// Values in [-scale, scale) from a hash of the index (no host copy of 0.94 GB of weights).
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(scale * (static_cast<float>(h & 0xFFFF) / 32768.0f - 1.0f));
  }
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// signals[first .. first + n) += 1, after the expert's GEMM on the same stream (the GEMM's
// stores are visible: kernel boundary; the fence stands for a fused GEMM's release). `stamp`
// (--trace; else null): %globaltimer after the adds.
__global__ void raise_signals(int32_t* signals, int64_t first, int n, unsigned long long* stamp) {
  __threadfence();
  for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(signals + first + i, 1);
  if (stamp && threadIdx.x == 0) *stamp = globaltimer();
}

// --trace: %globaltimer into *out (one thread), on the clock of the kernels' stamps.
__global__ void stamp_time(unsigned long long* out) {
  *out = globaltimer();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Row {
  int R = 0, S = 0;
  std::string form;
  double gemm = 0, gemm_s = 0, gemm_sig = 0, combine = 0, send_hook = 0, a = 0, b = 0;
  std::string trace;  // --trace: the timeline of (b), printed after the row
};

#ifdef EPX_LL_TRACE
__attribute__((format(printf, 2, 3))) void appendf(std::string& out, const char* fmt, ...) {
  char line[400];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  out += line;
}

// --trace: three replays of the traced (b) graph `exec` (`stamps` as in run_rank's `gemm`), the
// ll trace buffer and the stamps cleared before each; this rank's timeline, µs from the graph's
// start (every rank replays alike: the combines pair up).
std::string trace_overlap(const Group& g, const Options& o, cudaStream_t s, cudaGraphExec_t exec,
                          const Tensor& stamps, const std::vector<int32_t>& counts, int form,
                          int S, const Row& row) {
  using namespace epx::detail;
  uint64_t* dbuf = ll_trace_buffer_of_thread();
  if (dbuf == nullptr) return "[trace] no ll trace buffer (a build with -DEPX_LL_TRACE=ON?)\n";
  const int L = o.local_experts;
  const int64_t RT = g.size() * o.tokens;
  const int64_t blocks = form == 1 ? (RT + o.block_m - 1) / o.block_m : 1;  // signals per expert
  std::string txt;
  if (g.rank() == 0) {
    static const bench::TraceClock clk = bench::probe_clock(gpu_testing::device_of(g));
    appendf(txt,
            "[trace] R=%d %s S=%d: us from the graph's start; %%globaltimer steps %.0f ns "
            "(mean)\n",
            row.R, row.form.c_str(), S, clk.mean_step_ns);
  }
  std::vector<uint64_t> h(kLlTraceWords), st(2 * static_cast<size_t>(L) + 2);
  const int samples = 3;
  for (int smp = 0; smp < samples; ++smp) {
    g.transport()->barrier("ll overlap bench trace");
    CUDA_OK(cudaMemsetAsync(dbuf, 0, kLlTraceWords * sizeof(uint64_t), s));
    CUDA_OK(cudaMemsetAsync(stamps.data, 0, stamps.nbytes(), s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(h.data(), dbuf, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(st.data(), stamps.data, st.size() * sizeof(uint64_t),
                       cudaMemcpyDeviceToHost));
    const uint64_t t0 = st[0];
    auto us = [&](uint64_t t) {
      return t ? static_cast<double>(static_cast<int64_t>(t - t0)) / 1e3 : -1.0;
    };
    auto phase = [&](int ph, int c) {  // the combine's stamps (op 1)
      return h[2 * ((static_cast<size_t>(1) * kLlTracePhases + ph) * 128 + c)];
    };
    auto item = [&](int64_t i, int w) { return h[kLlTraceItemBase + kLlTraceItemWords * i + w]; };
    // Over the CTAs of one launch: the smallest and largest stamp of a phase (0: none).
    auto span_of = [&](int ph, int ctas, uint64_t& lo, uint64_t& hi, int& n) {
      lo = ~0ull, hi = 0, n = 0;
      for (int c = 0; c < ctas; ++c) {
        const uint64_t v = phase(ph, c);
        if (v < t0) continue;  // not reached in this replay
        lo = std::min(lo, v), hi = std::max(hi, v), ++n;
      }
      if (n == 0) lo = 0;
    };
    // Per expert, and per send CTA: items, time waiting for signals, time pushing, bytes.
    struct Cta {
      int items = 0;
      double waited = 0, pushed = 0, bytes = 0;
    };
    std::vector<Cta> cta(S);
    std::string table;
    uint64_t last_gemm = 0, last_raised = 0, last_seen = 0, last_stored = 0;
    int missing = 0;
    for (int l = 0; l < L; ++l) {
      const int64_t n = counts[l];
      if (n == 0) continue;
      const int64_t block = form == 1 ? o.block_m : n, nb = (n + block - 1) / block;
      uint64_t wait = ~0ull, seen_lo = ~0ull, seen_hi = 0, stored = 0;
      int first_cta = -1, n_items = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = l * blocks + b;
        if (i >= kLlTraceItems || item(i, 0) == 0) {
          ++missing;
          continue;
        }
        const int c = static_cast<int>(item(i, 0)) - 1;
        const uint64_t w = item(i, 1), sn = item(i, 2), sd = item(i, 3);
        wait = std::min(wait, w), seen_lo = std::min(seen_lo, sn), seen_hi = std::max(seen_hi, sn);
        stored = std::max(stored, sd);
        if (first_cta < 0) first_cta = c;
        ++n_items;
        if (c < S) {
          cta[c].items++;
          cta[c].waited += (sn - w) / 1e3;
          cta[c].pushed += (sd - sn) / 1e3;
          cta[c].bytes += static_cast<double>(std::min(n, (b + 1) * block) - b * block) *
                          static_cast<double>(o.hidden) * 2;
        }
      }
      const uint64_t gend = st[1 + l], raised = st[1 + L + l];
      last_gemm = std::max(last_gemm, gend), last_raised = std::max(last_raised, raised);
      if (n_items == 0) continue;
      last_seen = std::max(last_seen, seen_hi), last_stored = std::max(last_stored, stored);
      appendf(table,
              "  %3d %5lld %5d %4d | %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f | %7.1f %7.1f %7.1f\n",
              l, static_cast<long long>(n), n_items, first_cta, us(gend), us(raised), us(wait),
              us(seen_lo), us(seen_hi), us(stored), us(seen_lo) - us(gend),
              us(stored) - us(seen_lo), std::max(0.0, us(wait) - us(raised)));
    }
    uint64_t e_lo, e_hi, routed_lo, routed_hi, items_lo, items_hi, sig_lo, sig_hi;
    uint64_t r_lo, r_hi, ready_lo, ready_hi, pull_lo, pull_hi, x_lo, x_hi;
    int n_send, n_tmp, n_recv;
    span_of(kTrCEntry, S, e_lo, e_hi, n_send);
    span_of(kTrCRouted, S, routed_lo, routed_hi, n_tmp);
    span_of(kTrCSendCopy, S, items_lo, items_hi, n_tmp);
    span_of(kTrCSignal, S, sig_lo, sig_hi, n_tmp);
    span_of(kTrCRecvEntry, 128, r_lo, r_hi, n_recv);
    span_of(kTrCReadyWait, 128, ready_lo, ready_hi, n_tmp);
    span_of(kTrCPull, 128, pull_lo, pull_hi, n_tmp);
    span_of(kTrCExit, 128, x_lo, x_hi, n_tmp);
    const uint64_t end = st[1 + 2 * L];
    const double G = us(last_gemm);
    if (g.rank() != 0) continue;
    appendf(txt,
            "[trace] replay %d: span %.1f ((b) %.1f, gemm-S+sig %.1f); after the last GEMM end "
            "(%.1f): signal raised %+.1f, seen %+.1f, rows stored %+.1f, send done %+.1f, "
            "recv entry %+.1f..%+.1f, ready %+.1f, recv exit %+.1f, graph end %+.1f%s\n",
            smp, us(end), row.b, row.gemm_sig, G, us(last_raised) - G, us(last_seen) - G,
            us(last_stored) - G, us(sig_hi) - G, us(r_lo) - G, us(r_hi) - G, us(ready_hi) - G,
            us(x_hi) - G, us(end) - G, missing ? " (items not stamped!)" : "");
    if (smp != samples - 1) continue;
    appendf(txt,
            "[trace]   send: %d CTAs, entry %.1f..%.1f, routed (O2) %.1f..%.1f, items done "
            "%.1f..%.1f, O4 %.1f..%.1f; receive: %d CTAs, entry %.1f..%.1f, ready %.1f, "
            "pulls %.1f, exit %.1f\n",
            n_send, us(e_lo), us(e_hi), us(routed_lo), us(routed_hi), us(items_lo),
            us(items_hi), us(sig_lo), us(sig_hi), n_recv, us(r_lo), us(r_hi), us(ready_hi),
            us(pull_hi), us(x_hi));
    txt +=
        "    l  rows items cta |  gemm end   raised wait st.  seen lo  seen hi   stored | "
        "seen-gemm stored-seen late\n";
    txt += table;
    txt += "  send CTA: items, us waiting for signals, us pushing, GB/s while pushing, done\n";
    for (int c = 0; c < S; ++c)
      appendf(txt, "  %3d %4d %8.1f %8.1f %6.1f %8.1f\n", c, cta[c].items, cta[c].waited,
              cta[c].pushed, cta[c].pushed > 0 ? cta[c].bytes / cta[c].pushed / 1e3 : 0.0,
              us(phase(kTrCSendCopy, c)));
  }
  return txt;
}
#endif

// One rank: every graph of every row, timed; rank 0's medians into `rows`.
int run_rank(const Group& g, const Options& o, std::vector<Row>& rows) {
  const int R = g.size(), r = g.rank(), dev = gpu_testing::device_of(g);
  const int K = o.top_k, L = o.local_experts, E = L * R;
  const int64_t T = o.tokens, H = o.hidden, I = o.inter, RT = R * T;
  cudaStream_t main = gpu_testing::rank_stream(), side = nullptr, sig = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&sig, cudaStreamNonBlocking));
  int sm_count = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev));
  const Allocator alloc = gpu_testing::device_allocator();

  // Routing, dispatch (once: every combine reuses its handle), the counts on the host.
  std::mt19937_64 rng(4099 + 17 * r);
  const auto idx = epx::testing::make_topk_idx(epx::testing::Routing::kUniform, T, K, E, R, rng);
  Tensor x = gpu_testing::to_device(epx::testing::make_bf16(T, H, rng), DType::kBF16, {T, H}, dev);
  Tensor topk = gpu_testing::to_device(idx, DType::kI64, {T, K}, dev);
  Tensor w =
      gpu_testing::to_device(epx::testing::make_topk_weights(idx, rng), DType::kF32, {T, K}, dev);
  BufferConfig ll_only;
  ll_only.enable_ht = false;
  ll_only.enable_ll = true;
  Buffer buf(g, MoeShape{H, K, E, T}, ll_only);
  LlDispatchArgs da;
  da.x = x;
  da.topk_idx = topk;
  da.use_fp8 = false;
  da.stream = main;
  const LlDispatchResult d = buf.ll_dispatch(da, alloc);
  const std::vector<int32_t> counts = gpu_testing::to_host<int32_t>(d.recv_count);

  // GEMM operands and output (y, the combine's input).
  Tensor act = alloc(DType::kBF16, {L, RT, I}, Device::cuda(dev));
  Tensor weights = alloc(DType::kBF16, {L, I, H}, Device::cuda(dev));
  Tensor y = alloc(DType::kBF16, {L, RT, H}, Device::cuda(dev));
  Tensor out = alloc(DType::kBF16, {T, H}, Device::cuda(dev));
  fill_bf16<<<1024, 256, 0, main>>>(static_cast<__nv_bfloat16*>(act.data), act.numel(), 7 + r,
                                    1.0f);
  fill_bf16<<<1024, 256, 0, main>>>(static_cast<__nv_bfloat16*>(weights.data), weights.numel(),
                                    11 + r, 0.02f);
  CUDA_OK(cudaGetLastError());
  const int64_t blocks = (RT + o.block_m - 1) / o.block_m;
  Tensor signals = alloc(DType::kI32, {L * blocks}, Device::cuda(dev));
  Tensor workspace = alloc(DType::kU8, {int64_t{64} << 20}, Device::cuda(dev));
  Tensor stamps = alloc(DType::kI64, {2 * int64_t{L} + 2}, Device::cuda(dev));  // --trace

  // cuBLAS: one handle on every SM, one per budget S (SMs - S).
  auto make_handle = [&](int target) {
    cublasHandle_t h = nullptr;
    CUBLAS_OK(cublasCreate(&h));
    CUBLAS_OK(cublasSetWorkspace(h, workspace.data, workspace.nbytes()));
    CUBLAS_OK(cublasSetSmCountTarget(h, target));
    return h;
  };
  cublasHandle_t all_sms = make_handle(0);
  // form: 0 none, 1 a signal per block of block_m rows, 2 one per expert. With a form, the
  // signal kernels run on `sig`, each after its expert's GEMM (event gemm_done[l]); the caller
  // forks `sig` from main before and joins it after (gemm_signalled below). `stamps` (--trace;
  // else null): [0] the graph's start, [1 + l] GEMM l's end (a stamp kernel after it on `s`),
  // [1 + L + l] signal l raised, [1 + 2 L] the graph's end.
  std::vector<cudaEvent_t> gemm_done(L);
  for (cudaEvent_t& e : gemm_done) CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  auto gemm = [&](cublasHandle_t h, cudaStream_t s, int form, unsigned long long* stamps) {
    CUBLAS_OK(cublasSetStream(h, s));
    const float one = 1.0f, zero = 0.0f;
    for (int l = 0; l < L; ++l) {
      const int n = counts[l];
      if (n == 0) continue;  // no rows, no signal awaited
      const auto* wl = static_cast<const __nv_bfloat16*>(weights.data) + l * I * H;
      const auto* al = static_cast<const __nv_bfloat16*>(act.data) + l * RT * I;
      auto* yl = static_cast<__nv_bfloat16*>(y.data) + l * RT * H;
      // Row-major y[n, H] = act[n, I] x W[I, H]: column-major y^T = W^T x act^T.
      CUBLAS_OK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(H), n,
                             static_cast<int>(I), &one, wl, CUDA_R_16BF, static_cast<int>(H), al,
                             CUDA_R_16BF, static_cast<int>(I), &zero, yl, CUDA_R_16BF,
                             static_cast<int>(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      if (form == 0) continue;
      CUDA_OK(cudaEventRecord(gemm_done[l], s));
      CUDA_OK(cudaStreamWaitEvent(sig, gemm_done[l], 0));
      if (stamps) stamp_time<<<1, 1, 0, s>>>(stamps + 1 + l);
      unsigned long long* raised = stamps ? stamps + 1 + L + l : nullptr;
      if (form == 1)
        raise_signals<<<1, 32, 0, sig>>>(signals.ptr<int32_t>(), l * blocks,
                                         static_cast<int>((n + o.block_m - 1) / o.block_m), raised);
      if (form == 2) raise_signals<<<1, 32, 0, sig>>>(signals.ptr<int32_t>(), l, 1, raised);
    }
    CUDA_OK(cudaGetLastError());
  };
  LlCombineArgs ca;
  ca.y = y;
  ca.topk_idx = topk;
  ca.topk_weights = w;
  ca.handle = &d.handle;
  ca.out = out;
  auto plain = [&](cudaStream_t s) {
    ca.overlap.reset();
    ca.return_recv_hook = false;
    ca.stream = s;
    (void)buf.ll_combine(ca, alloc);
  };
  auto overlapped = [&](cudaStream_t s, int form, int S) {
    LlCombineOverlap ov;
    ov.signals = signals;
    ov.block_rows = form == 1 ? o.block_m : 0;
    ov.expected = 1;
    ov.num_sms = S;
    ca.overlap = ov;
    ca.return_recv_hook = true;
    ca.stream = s;
    LlCombineResult res = buf.ll_combine(ca, alloc);
    res.hook();
  };
  cudaEvent_t fork = nullptr, join = nullptr, sig_fork = nullptr, sig_join = nullptr;
  CUDA_OK(cudaEventCreateWithFlags(&sig_fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&sig_join, cudaEventDisableTiming));
  // `gemm` on main with signals, `sig` forked from main (after the signals were zeroed) and
  // joined back.
  auto gemm_signalled = [&](cublasHandle_t h, int form, unsigned long long* stamps) {
    CUDA_OK(cudaEventRecord(sig_fork, main));
    CUDA_OK(cudaStreamWaitEvent(sig, sig_fork, 0));
    gemm(h, main, form, stamps);
    CUDA_OK(cudaEventRecord(sig_join, sig));
    CUDA_OK(cudaStreamWaitEvent(main, sig_join, 0));
  };
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  std::vector<cudaEvent_t> ev(o.replays + 1);
  for (cudaEvent_t& e : ev) CUDA_OK(cudaEventCreate(&e));
  // `work` captured on the main stream, instantiated and replayed 10 times (every rank alike:
  // the combines pair up across ranks).
  auto warm_graph = [&](const std::function<void()>& work) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal));
    work();
    CUDA_OK(cudaStreamEndCapture(main, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
    g.transport()->barrier("ll overlap bench warm-up");
    for (int i = 0; i < 10; ++i) CUDA_OK(cudaGraphLaunch(exec, main));
    CUDA_OK(cudaStreamSynchronize(main));
    return exec;
  };
  // The same, then `replays` replays: the median replay in µs.
  auto time_graph = [&](const std::function<void()>& work) {
    cudaGraphExec_t exec = warm_graph(work);
    g.transport()->barrier("ll overlap bench replays");
    CUDA_OK(cudaEventRecord(ev[0], main));
    for (int i = 0; i < o.replays; ++i) {
      CUDA_OK(cudaGraphLaunch(exec, main));
      CUDA_OK(cudaEventRecord(ev[i + 1], main));
    }
    CUDA_OK(cudaStreamSynchronize(main));
    buf.check();
    std::vector<double> us;
    for (int i = 0; i < o.replays; ++i) {
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
      us.push_back(1e3 * ms);
    }
    cudaGraphExecDestroy(exec);
    return median(us);
  };
  // (b): signals zeroed; fork; the GEMMs with the signal kernels || the overlapped send on a side
  // stream; the hook (receive) on the side stream; join. `stamps`: as in `gemm`.
  auto overlapped_graph = [&](cublasHandle_t h, int form, int S, unsigned long long* stamps) {
    CUDA_OK(cudaMemsetAsync(signals.data, 0, signals.nbytes(), main));
    if (stamps) stamp_time<<<1, 1, 0, main>>>(stamps);
    CUDA_OK(cudaEventRecord(fork, main));
    CUDA_OK(cudaStreamWaitEvent(side, fork, 0));
    gemm_signalled(h, form, stamps);
    overlapped(side, form, S);
    CUDA_OK(cudaEventRecord(join, side));
    CUDA_OK(cudaStreamWaitEvent(main, join, 0));
    if (stamps) stamp_time<<<1, 1, 0, main>>>(stamps + 1 + 2 * L);
  };

  Row base;
  base.R = R;
  base.gemm = time_graph([&] { gemm(all_sms, main, 0, nullptr); });
  base.combine = time_graph([&] { plain(main); });
  base.a = time_graph([&] {
    gemm(all_sms, main, 0, nullptr);
    plain(main);
  });
  for (int S : o.sms) {
    cublasHandle_t budget = make_handle(std::max(1, sm_count - S));
    const double gemm_s = time_graph([&] { gemm(budget, main, 0, nullptr); });
    for (int form = 1; form <= 2; ++form) {
      Row row = base;
      row.S = S;
      row.form = form == 1 ? "blocks of " + std::to_string(o.block_m) : "experts";
      row.gemm_s = gemm_s;
      row.gemm_sig = time_graph([&] {
        CUDA_OK(cudaMemsetAsync(signals.data, 0, signals.nbytes(), main));
        gemm_signalled(budget, form, nullptr);
      });
      row.send_hook = time_graph([&] {
        CUDA_OK(cudaMemsetAsync(signals.data, 0x01, signals.nbytes(), main));  // all reached
        overlapped(main, form, S);
      });
      row.b = time_graph([&] { overlapped_graph(budget, form, S, nullptr); });
#ifdef EPX_LL_TRACE
      if (o.trace) {
        const cudaGraphExec_t exec =
            warm_graph([&] { overlapped_graph(budget, form, S, stamps.ptr<unsigned long long>()); });
        row.trace = trace_overlap(g, o, main, exec, stamps, counts, form, S, row);
        cudaGraphExecDestroy(exec);
      }
#endif
      if (r == 0) rows.push_back(row);
    }
    CUBLAS_OK(cublasDestroy(budget));
  }
  CUBLAS_OK(cublasDestroy(all_sms));
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  for (cudaEvent_t e : gemm_done) cudaEventDestroy(e);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaEventDestroy(sig_fork);
  cudaEventDestroy(sig_join);
  cudaStreamDestroy(side);
  cudaStreamDestroy(sig);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--trace") {
      o.trace = true;
      continue;
    }
    if (a == "--help" || i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--ranks 1,2] [--sms 3,8,16,32] [--replays 200] [--tokens 128] "
                   "[--hidden 7168] [--inter 2048] [--local-experts 32] [--block-m 64] "
                   "[--trace]\n"
                   "  --trace: the (b) timeline (needs a build with -DEPX_LL_TRACE=ON)\n",
                   argv[0]);
      return a == "--help" ? 0 : 2;
    }
    const char* v = argv[++i];
    auto ints = [&] {
      std::vector<int> out;
      for (int64_t x : gpu_testing::parse_int_list(v)) out.push_back(static_cast<int>(x));
      return out;
    };
    if (a == "--ranks") {
      o.ranks = ints();
    } else if (a == "--sms") {
      o.sms = ints();
    } else if (a == "--replays") {
      o.replays = std::atoi(v);
    } else if (a == "--tokens") {
      o.tokens = std::atoll(v);
    } else if (a == "--hidden") {
      o.hidden = std::atoll(v);
    } else if (a == "--inter") {
      o.inter = std::atoll(v);
    } else if (a == "--local-experts") {
      o.local_experts = std::atoi(v);
    } else if (a == "--block-m") {
      o.block_m = std::atoll(v);
    } else {
      std::fprintf(stderr, "unknown option %s (--help)\n", a.c_str());
      return 2;
    }
  }
  if (o.replays < 1 || o.tokens < 1 || o.hidden % 128 != 0 || o.inter < 1 || o.local_experts < 1 ||
      o.block_m < 1 || o.ranks.empty() || o.sms.empty()) {
    std::fprintf(stderr,
                 "--replays, --tokens, --inter, --local-experts and --block-m must be >= 1 "
                 "and --hidden a multiple of 128\n");
    return 2;
  }
#ifndef EPX_LL_TRACE
  if (o.trace) {
    std::fprintf(stderr, "epx_ll_overlap_bench: --trace needs a build with -DEPX_LL_TRACE=ON\n");
    return 2;
  }
#endif
  if (gpu_testing::visible_gpus() == 0) {
    std::printf("epx_ll_overlap_bench: no GPU visible, nothing to measure\n");
    return 0;
  }
  std::printf(
      "ll combine overlapped with the down GEMM: T = %lld, H = %lld, I = %lld, K = %d, "
      "L = %d per rank, median of %d graph replays, us (R > 1: ranks share GPU 0)\n",
      static_cast<long long>(o.tokens), static_cast<long long>(o.hidden),
      static_cast<long long>(o.inter), o.top_k, o.local_experts, o.replays);
  std::printf(
      "| R | signals | S | gemm | gemm-S | gemm-S+sig | combine | send+hook | (a) gemm, combine | "
      "(b) gemm-S || send, hook | gain (a)-(b) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);  // before the fork: the child would print the buffer again
  int rc = 0;
  for (int R : o.ranks) {
    std::vector<Row> rows;
    rc |= gpu_testing::run_cuda_ranks_one_gpu(R, 0, [&](const Group& g) {
      const int status = run_rank(g, o, rows);
      if (g.rank() == 0) {
        for (const Row& w : rows)
          std::printf("| %d | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                      w.R, w.form.c_str(), w.S, w.gemm, w.gemm_s, w.gemm_sig, w.combine,
                      w.send_hook, w.a, w.b, w.a - w.b);
        for (const Row& w : rows) std::fputs(w.trace.c_str(), stdout);
        std::fflush(stdout);
      }
      return status;
    });
    if (rc) break;
  }
  return rc;
}
