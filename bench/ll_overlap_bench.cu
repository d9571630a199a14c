// bench/ll_overlap_bench.cu — the ll combine overlapped with the expert down GEMM (docs/design.md
// §7.6) against the GEMM followed by the plain combine, on one GPU: R = 1 (no link bytes: what
// the overlap hides of the send's SM work and what it costs the GEMM) and R = 2 as rank threads
// sharing the GPU (Group::cuda_shared_device: the protocol between ranks, not NVLink). Checks
// nothing (the GPU tier does: gpu_ll_overlap_gpu_test).
//
//   epx_ll_overlap_bench [--ranks 1,2] [--sms 3,8,16,32] [--replays 200] [--tokens 128]
//                        [--hidden 7168] [--inter 2048] [--local-experts 32] [--block-m 64]
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
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

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

// signals[first .. first + n) += 1, after the expert's GEMM on the same stream (the GEMM's
// stores are visible: kernel boundary; the fence stands for a fused GEMM's release).
__global__ void raise_signals(int32_t* signals, int64_t first, int n) {
  __threadfence();
  for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(signals + first + i, 1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Row {
  int R = 0, S = 0;
  std::string form;
  double gemm = 0, gemm_s = 0, gemm_sig = 0, combine = 0, send_hook = 0, a = 0, b = 0;
};

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
  // forks `sig` from main before and joins it after (gemm_signalled below).
  std::vector<cudaEvent_t> gemm_done(L);
  for (cudaEvent_t& e : gemm_done) CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  auto gemm = [&](cublasHandle_t h, cudaStream_t s, int form) {
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
      if (form == 1)
        raise_signals<<<1, 32, 0, sig>>>(signals.ptr<int32_t>(), l * blocks,
                                         static_cast<int>((n + o.block_m - 1) / o.block_m));
      if (form == 2) raise_signals<<<1, 32, 0, sig>>>(signals.ptr<int32_t>(), l, 1);
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
  auto gemm_signalled = [&](cublasHandle_t h, int form) {
    CUDA_OK(cudaEventRecord(sig_fork, main));
    CUDA_OK(cudaStreamWaitEvent(sig, sig_fork, 0));
    gemm(h, main, form);
    CUDA_OK(cudaEventRecord(sig_join, sig));
    CUDA_OK(cudaStreamWaitEvent(main, sig_join, 0));
  };
  CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  std::vector<cudaEvent_t> ev(o.replays + 1);
  for (cudaEvent_t& e : ev) CUDA_OK(cudaEventCreate(&e));
  // Captures `work` on the main stream, replays it (every rank alike: the combines pair up
  // across ranks), returns the median replay in µs.
  auto time_graph = [&](const std::function<void()>& work) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_OK(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal));
    work();
    CUDA_OK(cudaStreamEndCapture(main, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    g.transport()->barrier("ll overlap bench warm-up");
    for (int i = 0; i < 10; ++i) CUDA_OK(cudaGraphLaunch(exec, main));
    CUDA_OK(cudaStreamSynchronize(main));
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
    cudaGraphDestroy(graph);
    return median(us);
  };

  Row base;
  base.R = R;
  base.gemm = time_graph([&] { gemm(all_sms, main, 0); });
  base.combine = time_graph([&] { plain(main); });
  base.a = time_graph([&] {
    gemm(all_sms, main, 0);
    plain(main);
  });
  for (int S : o.sms) {
    cublasHandle_t budget = make_handle(std::max(1, sm_count - S));
    const double gemm_s = time_graph([&] { gemm(budget, main, 0); });
    for (int form = 1; form <= 2; ++form) {
      Row row = base;
      row.S = S;
      row.form = form == 1 ? "blocks of " + std::to_string(o.block_m) : "experts";
      row.gemm_s = gemm_s;
      row.gemm_sig = time_graph([&] {
        CUDA_OK(cudaMemsetAsync(signals.data, 0, signals.nbytes(), main));
        gemm_signalled(budget, form);
      });
      row.send_hook = time_graph([&] {
        CUDA_OK(cudaMemsetAsync(signals.data, 0x01, signals.nbytes(), main));  // all reached
        overlapped(main, form, S);
      });
      row.b = time_graph([&] {
        CUDA_OK(cudaMemsetAsync(signals.data, 0, signals.nbytes(), main));
        CUDA_OK(cudaEventRecord(fork, main));
        CUDA_OK(cudaStreamWaitEvent(side, fork, 0));
        gemm_signalled(budget, form);
        overlapped(side, form, S);
        CUDA_OK(cudaEventRecord(join, side));
        CUDA_OK(cudaStreamWaitEvent(main, join, 0));
      });
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
    if (a == "--help" || i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--ranks 1,2] [--sms 3,8,16,32] [--replays 200] [--tokens 128] "
                   "[--hidden 7168] [--inter 2048] [--local-experts 32] [--block-m 64]\n",
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
        std::fflush(stdout);
      }
      return status;
    });
    if (rc) break;
  }
  return rc;
}
