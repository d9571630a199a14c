// bench/send_probe.cu — a diagnostic for issue 26 (not a test, not in ctest): the ll dispatch's
// send half alone, the production code (kernels/ll/dispatch.cuh: ll_dispatch_send, and in one
// form ll_dispatch_route) in a kernel of its own, so that its time can be set apart from the
// receive it overlaps in the real launch (docs/perf.md §5 item 59). One GPU, R = 1.
//
// Each launch sends T = C tokens from C CTAs of 512 threads (one token per CTA, as the fused
// dispatch at T <= 128), H = 7168, K = 8, E = 288, random x and routing ids (one of 4 sets made at
// the start, copied in before each launch); the flags are cleared before every launch, so step
// 1's freed wait passes at once. Forms:
//   fused, other team idle     warps 0-7 send (kSplit: 256 sending threads, 3.5 vectors each);
//                              warps 8-15 arrive at the routed barrier and leave (ptxas compiles
//                              this kernel's send with a different register plan: compare the
//                              forms through the next two)
//   fused, other team polls    the same, warps 8-15's first thread then polls a word with
//                              ld.acquire.sys (as the routing team's flag waits do) until warp 0
//                              stores it after its signal, the team at its barrier meanwhile
//   fused, production routing  warps 8-15 run ll_dispatch_route (routing rows, routed signal) and
//                              then the receive's dispatch_routed wait, as in the real launch
//   whole CTA                  the hooked send: all 16 warps send (1.75 vectors each) and store
//                              the routing rows
//   production dispatch        the production's fused kernel itself (epx::ll::dispatch<Q, false,
//                              true>: both halves, its outputs in cudaMalloc memory): the anchor
//                              of the other rows in the same process
// in fp8 (the quantising send) and bf16 (the same stores of twice the bytes, no arithmetic), and
// with every routing id -1 (no message: the send's waits, barriers and signal only). The staging
// (messages, routing rows, flags) lies in cudaMalloc memory, and each fp8 row is repeated at once
// with it where the production's lies: an ncclMemAlloc allocation (cuMem), and the same
// registered as a one-rank NCCL window (transport/nccl_transport.cc, as Group::cuda makes it; the
// ll kernels reach their own rank's window through its allocation address, as here). The phase
// stamps are the trace build's (EPX_LL_TRACE, defined here for this file's kernels only): per
// CTA, clock64 cycles from its entry to each phase (kernels/ll/trace.cuh), in µs at each launch's
// own SM clock (the CTA's clock64 over %globaltimer from its entry to its last stamp); the median
// CTA, the latest CTA's signal, and the production row's exit. Rows: the median over `--iters`
// launches (after one warm-up). Every row's last launch's message of token 0 (fp8 and bf16) is
// checked against the host's quantiser (core/numeric.h) or x.
//   epx_send_probe [--iters I]
#define EPX_LL_TRACE 1

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_common.cuh"
#include "core/numeric.h"
#include "cuda/kernels/ll/dispatch.cuh"
#include "gpu/gpu_support.h"
#include "transport/nccl_transport.h"

namespace {

using namespace epx::detail;
using epx::bench::median;

constexpr int64_t kH = 7168;
constexpr int kK = 8, kE = 288, kTMax = 128;

enum Form : int { kIdle = 0, kPolls, kRouting, kWhole, kProduction, kForms };
const char* const kFormNames[kForms] = {"fused, other team idle", "fused, other team polls",
                                        "fused, production routing", "whole CTA (hooked send)",
                                        "production dispatch"};

template <int kQuant, int kForm>
__global__ void __launch_bounds__(kLlThreads, 1)
    send_kernel(LlDispatchParams p, uint32_t* done, uint32_t epoch) {
  const uint32_t e = 1;  // the flags are cleared before each launch: step 1 waits for 0
  const bool other = kForm != kWhole && threadIdx.x >= kLlThreads / 2;
  const LlTeam team = kForm == kWhole ? ll_team_all()
                      : ll_team_opaque(other ? LlTeam{kLlThreads / 2, kLlThreads / 2, 2}
                                             : LlTeam{0, kLlThreads / 2, 1});
  if (kForm == kWhole) {
    EPX_LL_STAMP(p, 0, kTrDEntry);
    ll_dispatch_send<kQuant, false, false>(p, e, team);
    return;
  }
  if (!other) {
    EPX_LL_STAMP(p, 0, kTrDEntry);
    const bool ok = ll_dispatch_send<kQuant, false, true>(p, e, team);
    // The polling form's end: the send's signal is out.
    if (kForm == kPolls && ok && threadIdx.x == 0) st_relaxed_sys(done + blockIdx.x, epoch);
    return;
  }
  if (kForm == kRouting) {
    if (!ll_dispatch_route<kQuant>(p, e, team)) return;
    const LlSymm& symm = p.symm;
    ll_wait_ranks<false>(
        team, symm, p.rank, symm.layout.sync(symm.local)->dispatch_routed[p.slot], 0,
        [&](int) { return e * gridDim.x; }, p.wait, kWaitCounts);
    EPX_LL_STAMP(p, 0, kTrDRecvWait);
    return;
  }
  if (team.tid() == 0) ll_routed_ok() = true;
  ll_bar_arrive_routed();
  if (kForm == kPolls) {
    if (team.tid() == 0) {
      const uint64_t give_up = globaltimer_ns() + 10000000ull;  // 10 ms: a probe never hangs
      while (!seq_reached(ld_acquire_sys(done + blockIdx.x), epoch) && globaltimer_ns() < give_up) {
      }
    }
    team.sync();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
      if (iters < 1 || iters > 10000) {
        std::printf("epx_send_probe: --iters %d is out of range\n", iters);
        return 2;
      }
    } else {
      std::printf("usage: epx_send_probe [--iters I]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (epx::gpu_testing::visible_gpus() == 0) {
    std::printf("epx_send_probe: no GPU visible\n");
    return 0;
  }
  CUDA_OK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));

  epx::MoeShape shape;
  shape.hidden = kH;
  shape.top_k = kK;
  shape.num_experts = kE;
  shape.max_tokens_per_rank = kTMax;
  const LlLayout g = LlLayout::make(shape, 1);
  const int L = kE, G = static_cast<int>(kH / 128);

  // The stagings (the file's header): cudaMalloc, an ncclMemAlloc allocation, and the same
  // registered as a one-rank NCCL window; the last two where NCCL provides them.
  struct Staging {
    const char* name;
    char* base;
  };
  std::vector<Staging> stagings;
  char* base = nullptr;
  CUDA_OK(cudaMalloc(&base, g.total_bytes));
  CUDA_OK(cudaMemset(base, 0, g.total_bytes));
  stagings.push_back({"cudaMalloc", base});
  void* cumem = nullptr;
  if (ncclMemAlloc(&cumem, g.total_bytes) == ncclSuccess) {
    CUDA_OK(cudaMemset(cumem, 0, g.total_bytes));
    stagings.push_back({"ncclMemAlloc", static_cast<char*>(cumem)});
  } else {
    std::printf("staging: ncclMemAlloc failed: its rows are left out\n");
  }
  std::shared_ptr<Transport> transport;
  std::shared_ptr<SymmetricMemory> window;
  try {
    transport =
        make_nccl_transport(0, 1, nccl_new_unique_id(), 0, std::chrono::milliseconds(30000));
    window = transport->allocate(static_cast<size_t>(g.total_bytes));
    stagings.push_back({"NCCL window", static_cast<char*>(window->local())});
  } catch (const std::exception& ex) {
    std::printf("staging: no NCCL window (%s): its rows are left out\n", ex.what());
  }

  DeviceErrorRecord* err = nullptr;
  uint64_t* trace = nullptr;
  uint32_t* done = nullptr;
  uint16_t* x = nullptr;
  int64_t *ids = nullptr, *no_ids = nullptr;
  CUDA_OK(cudaMalloc(&err, sizeof(DeviceErrorRecord)));
  CUDA_OK(cudaMemset(err, 0, sizeof(DeviceErrorRecord)));
  CUDA_OK(cudaMalloc(&trace, sizeof(uint64_t) * kLlTraceWords));
  CUDA_OK(cudaMalloc(&done, sizeof(uint32_t) * kTMax));
  CUDA_OK(cudaMemset(done, 0, sizeof(uint32_t) * kTMax));
  CUDA_OK(cudaMalloc(&x, sizeof(uint16_t) * kTMax * kH));
  CUDA_OK(cudaMalloc(&ids, sizeof(int64_t) * kTMax * kK));
  CUDA_OK(cudaMalloc(&no_ids, sizeof(int64_t) * kTMax * kK));
  std::vector<int64_t> minus(kTMax * kK, -1);
  CUDA_OK(cudaMemcpy(no_ids, minus.data(), sizeof(int64_t) * minus.size(), cudaMemcpyHostToDevice));
  // The production dispatch's outputs (bf16-sized: both formats fit).
  const int RT = kTMax;
  uint8_t* recv_x = nullptr;
  float* recv_scales = nullptr;
  int32_t *recv_count = nullptr, *src_info = nullptr;
  int64_t* layout_range = nullptr;
  CUDA_OK(cudaMalloc(&recv_x, static_cast<size_t>(L) * RT * kH * 2));
  CUDA_OK(cudaMalloc(&recv_scales, sizeof(float) * L * G * RT));
  CUDA_OK(cudaMalloc(&recv_count, sizeof(int32_t) * L));
  CUDA_OK(cudaMalloc(&src_info, sizeof(int32_t) * L * RT));
  CUDA_OK(cudaMalloc(&layout_range, sizeof(int64_t) * L));

  // Four input sets (x, routing ids with K distinct experts per token), made once.
  constexpr int kSets = 4;
  std::mt19937_64 rng(26);
  std::vector<std::vector<uint16_t>> hx(kSets, std::vector<uint16_t>(kTMax * kH));
  std::vector<std::vector<int64_t>> hids(kSets, std::vector<int64_t>(kTMax * kK));
  for (int set = 0; set < kSets; ++set) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : hx[set]) v = f32_to_bf16(nd(rng));
    std::vector<int64_t> e(kE);
    for (int t = 0; t < kTMax; ++t) {
      for (int i = 0; i < kE; ++i) e[i] = i;
      for (int k = 0; k < kK; ++k) {  // K distinct experts
        std::uniform_int_distribution<int> pick(k, kE - 1);
        std::swap(e[k], e[pick(rng)]);
        hids[set][t * kK + k] = e[k];
      }
    }
  }
  int set = 0;  // the set of the latest launch
  auto next_inputs = [&] {
    set = (set + 1) % kSets;
    CUDA_OK(cudaMemcpy(x, hx[set].data(), sizeof(uint16_t) * hx[set].size(),
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(ids, hids[set].data(), sizeof(int64_t) * hids[set].size(),
                       cudaMemcpyHostToDevice));
  };

  LlDispatchParams p{};
  p.x = x;
  p.x_stride = kH;
  p.topk_stride = kK;
  p.topk_is_i64 = 1;
  p.x_vec16 = 1;
  p.slot = 0;
  p.rank = 0;
  p.units_per_expert = 1;  // C <= 128 < L
  p.recv_x = recv_x;
  p.recv_scales = recv_scales;
  p.recv_count = recv_count;
  p.src_info = src_info;
  p.layout_range = layout_range;
  p.phases = kLlPhaseBoth;
  char* staging = base;  // where the rows below put the staging (use_staging)
  auto use_staging = [&](char* at) {
    staging = at;
    p.symm.local = at;
    p.symm.peers[0] = at;
    p.wait.state = &g.state(at)->dev;
  };
  use_staging(base);
  p.symm.layout = g;
  p.symm.shrink = 0;
  p.symm.one_gpu = 1;
  p.wait.error = err;
  p.wait.timeout_ns = 1000000000ull;
  p.wait.rank = 0;
  p.trace = trace;

  std::printf(
      "epx_send_probe: %s, R = 1, H = %lld, K = %d, E = %d, one token per CTA, %d launches per "
      "row (medians); µs after the CTA's entry at its launch's SM clock, median CTA\n",
      prop.name, static_cast<long long>(kH), kK, kE, iters);
  std::printf("%-44s %-12s %4s %5s | %7s %7s %7s %7s %7s | %7s %7s | %9s %7s | %5s\n", "form",
              "staging", "fmt", "C", "freed", "routed", "stored", "sent", "signal", "rt-sig",
              "rt-wait", "latest-sig", "exit", "MHz");

  std::vector<uint64_t> h(kLlTraceItemBase);
  uint32_t epoch = 0;
  // The last launch's message of token 0 against the host's quantiser (core/numeric.h
  // quantize_row_fp8: the semantics' bytes and scales) or, in bf16, against x.
  auto check = [&](int quant) {
    std::vector<unsigned char> msg(static_cast<size_t>(g.msg_bytes));
    CUDA_OK(cudaMemcpy(msg.data(), g.msg(staging, 0, 0, 0), msg.size(), cudaMemcpyDeviceToHost));
    std::vector<unsigned char> want(static_cast<size_t>(g.msg_bytes), 0);
    size_t bytes = 2 * kH;
    if (quant == kLlQuantFp8) {
      std::vector<float> scales(kH / 128);
      quantize_row_fp8(hx[set].data(), kH, false, want.data(), scales.data());
      std::memcpy(want.data() + kH, scales.data(), 4 * scales.size());
      bytes = kH + 4 * scales.size();
    } else {
      std::memcpy(want.data(), hx[set].data(), bytes);
    }
    return std::memcmp(msg.data(), want.data(), bytes) == 0;
  };
  bool ok = true;
  auto run = [&](int quant, int form, int ctas, bool messages, const Staging& st) {
    use_staging(st.base);
    p.use_fp8 = quant == kLlQuantFp8;
    p.num_tokens = ctas;
    p.topk_idx = messages ? static_cast<const void*>(ids) : static_cast<const void*>(no_ids);
    std::vector<std::vector<double>> ph(kTrDNum);
    std::vector<double> latest, mhz;
    for (int i = 0; i <= iters; ++i) {
      next_inputs();
      CUDA_OK(cudaMemset(staging, 0, g.control_bytes()));  // the flags: step 1 passes at once
      CUDA_OK(cudaMemset(trace, 0, sizeof(uint64_t) * kLlTraceItemBase));
      ++epoch;
      auto launch = [&](auto kernel) { kernel<<<ctas, kLlThreads>>>(p, done, epoch); };
#define EPX_PROBE_FORMS(Q)                                                    \
  switch (form) {                                                             \
    case kIdle: launch(send_kernel<Q, kIdle>); break;                         \
    case kPolls: launch(send_kernel<Q, kPolls>); break;                       \
    case kRouting: launch(send_kernel<Q, kRouting>); break;                   \
    case kWhole: launch(send_kernel<Q, kWhole>); break;                       \
    default: epx::ll::dispatch<Q, false, true><<<ctas, kLlThreads>>>(p); break; \
  }
      if (quant == kLlQuantFp8) {
        EPX_PROBE_FORMS(kLlQuantFp8)
      } else {
        EPX_PROBE_FORMS(kLlQuantBf16)
      }
#undef EPX_PROBE_FORMS
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(h.data(), trace, sizeof(uint64_t) * h.size(), cudaMemcpyDeviceToHost));
      if (i == 0) continue;  // warm-up
      // Per CTA: its SM clock (clock64 over %globaltimer from its entry to its latest stamp),
      // each phase's µs after its entry at that clock; and (%globaltimer: across SMs) the first
      // CTA's entry and the latest CTA's signal.
      std::vector<std::vector<double>> per(kTrDNum);
      std::vector<double> cta_mhz;
      uint64_t first = ~0ull, last = 0;
      for (int c = 0; c < ctas; ++c) {
        const uint64_t n0 = h[ll_trace_word(0, kTrDEntry, c)];
        const uint64_t c0 = h[ll_trace_word(0, kTrDEntry, c) + 1];
        if (n0 == 0 || c0 == 0) continue;
        uint64_t n1 = n0, c1 = c0;
        for (int ph_i = 1; ph_i < kTrDNum; ++ph_i) {
          const uint64_t ni = h[ll_trace_word(0, ph_i, c)];
          if (ni > n1) n1 = ni, c1 = h[ll_trace_word(0, ph_i, c) + 1];
        }
        if (n1 <= n0 + 200) continue;  // too short a span for a clock
        const double ghz = static_cast<double>(c1 - c0) / static_cast<double>(n1 - n0);
        cta_mhz.push_back(ghz * 1e3);
        for (int ph_i = 1; ph_i < kTrDNum; ++ph_i) {
          const uint64_t ci = h[ll_trace_word(0, ph_i, c) + 1];
          if (ci != 0) per[ph_i].push_back(static_cast<double>(ci - c0) / ghz / 1e3);
        }
        first = std::min(first, n0);
        last = std::max(last, h[ll_trace_word(0, kTrDSignal, c)]);
      }
      if (first != ~0ull && last > first) latest.push_back(static_cast<double>(last - first) / 1e3);
      if (!cta_mhz.empty()) mhz.push_back(median(cta_mhz));
      for (int ph_i = 1; ph_i < kTrDNum; ++ph_i)
        if (!per[ph_i].empty()) ph[ph_i].push_back(median(per[ph_i]));
    }
    auto col = [&](int phase) {
      char b[16];
      if (ph[phase].empty())
        std::snprintf(b, sizeof b, "%7s", "-");
      else
        std::snprintf(b, sizeof b, "%7.2f", median(ph[phase]));
      return std::string(b);
    };
    char name[64];
    std::snprintf(name, sizeof name, "%s%s", kFormNames[form], messages ? "" : ", ids -1");
    std::printf("%-44s %-12s %4s %5d | %s %s %s %s %s | %s %s | %9.2f %s | %5.0f", name, st.name,
                quant == kLlQuantFp8 ? "fp8" : "bf16", ctas, col(kTrDFreed).c_str(),
                col(kTrDRouted).c_str(), col(kTrDStored).c_str(), col(kTrDSent).c_str(),
                col(kTrDSignal).c_str(), col(kTrDRoutedSig).c_str(), col(kTrDRecvWait).c_str(),
                latest.empty() ? 0.0 : median(latest), col(kTrDExit).c_str(),
                mhz.empty() ? 0.0 : median(mhz));
    if (messages) {
      const bool same = check(quant);
      ok = same && ok;
      std::printf(" | token 0 %s\n", same ? "checked" : "DIFFERS from the host's");
    } else {
      std::printf("\n");
    }
  };

  for (int quant : {kLlQuantFp8, kLlQuantBf16}) {
    for (int ctas : {1, 128}) {
      for (int form = 0; form < kForms; ++form) {
        // fp8: the stagings one after another for each row (interleaved); bf16: cudaMalloc.
        for (const Staging& st : stagings) {
          run(quant, form, ctas, true, st);
          if (quant != kLlQuantFp8) break;
        }
      }
      run(quant, kIdle, ctas, false, stagings[0]);
    }
  }
  DeviceErrorRecord rec{};
  CUDA_OK(cudaMemcpy(&rec, err, sizeof rec, cudaMemcpyDeviceToHost));
  if (rec.code != 0) {
    std::printf("device error record: code %u, peer %d (a wait timed out or an id was refused)\n",
                rec.code, rec.peer);
    ok = false;
  }
  std::printf("check: every row's token 0 %s\n", ok ? "matches the host's" : "DIFFERS (above)");
  window.reset();
  transport.reset();
  if (cumem) ncclMemFree(cumem);
  for (void* d : std::initializer_list<void*>{base, err, trace, done, x, ids, no_ids, recv_x,
                                              recv_scales, recv_count, src_info, layout_range})
    CUDA_OK(cudaFree(d));
  return ok ? 0 : 1;
}
