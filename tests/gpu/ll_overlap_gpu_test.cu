// GPU tier of the overlapped ll combine (LlCombineArgs::overlap, docs/semantics.md §2.7,
// docs/design.md §7.6) on the cuda backend.
//
// A stand-in expert GEMM (stand_in_gemm below) runs on the rank's main stream: it stores y part
// by part (tests/support/ll_overlap.h: the same parts, order and signal forms as the cpu tier's
// GEMM thread) in a seeded random order, each part after a random __nanosleep delay, and raises
// each part's signal with a fence and an atomic add, the way DeepGEMM (one add per N tile of a
// block) and the cute-dsl masked GEMM (one add per CTA of an expert) do. The overlapped combine
// runs on a side stream forked from the main stream before the GEMM (events), as sglang calls
// it, its hook on the side stream, then the main stream joins. y (or the zero-copy buffer) is
// poisoned (NaN) before the GEMM, so a block sent before its signal shows. Every out row is
// compared bit for bit with the oracle (which the cpu backend matches, tests/unit/
// ll_overlap_test.cc) and with the plain cuda combine of the same y.
//
// Cases: both signal forms, hook or not, copy and zero_copy, empty experts (all-to-one and
// empty-rank routings), T = 0 on some ranks, SM budgets 0 (auto) to 8; R = 1, 2, 4, 8 forked
// ranks (one GPU each) and R = 2, 4, 8 ranks sharing GPU 0. Errors: a signal never raised
// (Timeout naming it; the peers time out; ll_clean; the next overlapped combine exact), ranks
// that disagree on overlap, a recv_count that is not the handle's. CUDA graphs: {signals zeroed,
// dispatch, y poisoned, fork, stand-in GEMM || overlapped combine, hook, join} captured once and
// replayed on new inputs, every replay checked.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "epx/buffer.h"
#include "epx/error.h"
#include "gpu/gpu_support.h"
#include "support/ll_cases.h"
#include "support/ll_overlap.h"
#include "support/oracle_ll.h"
#include "support/routing.h"

namespace epx {
namespace {

using gpu_testing::RankStream;
using testing::LlBatch;
using testing::LlCase;
using testing::LlProblem;
using testing::OverlapCase;
using testing::OverlapForm;
using testing::OverlapGemmPart;

// ---- the stand-in GEMM ---------------------------------------------------------------------

// CTA c takes parts c, c + gridDim.x, ... of parts[0, *num_parts): sleeps its delay, stores its
// rows x columns of src into dst, then (one thread, after a barrier) __threadfence + atomicAdd 1
// on its signal: the release the combine's acquire pairs with.
__global__ void stand_in_gemm(const OverlapGemmPart* parts, const int* num_parts,
                              const uint16_t* src, uint16_t* dst, int64_t dst_stride0,
                              int64_t dst_stride1, int64_t rows_per_expert, int64_t hidden,
                              int32_t* signals) {
  for (int i = blockIdx.x; i < *num_parts; i += gridDim.x) {
    const OverlapGemmPart p = parts[i];
    if (threadIdx.x == 0) {
      for (int64_t slept = 0; slept < p.delay_ns; slept += 1000) __nanosleep(1000);
    }
    __syncthreads();
    const int64_t cols = p.col_end - p.col_begin;
    const int64_t n = (p.row_end - p.row_begin) * cols;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t row = p.row_begin + j / cols, c = p.col_begin + j % cols;
      dst[p.l * dst_stride0 + row * dst_stride1 + c] =
          src[(p.l * rows_per_expert + row) * hidden + c];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(signals + p.signal, 1);
    }
  }
}

// What the stand-in GEMM of one rank needs on the device: the parts (capacity for a case's
// largest list), their count, y's source rows and the signals.
struct GemmIo {
  Tensor parts, num_parts, src, signals;
  int64_t capacity = 0;
};

GemmIo make_gemm_io(const LlProblem& p, const OverlapForm& form, int dev) {
  const int L = p.num_local_experts();
  const int64_t RT = p.rows_per_expert(), H = p.hidden;
  const int64_t blocks = testing::overlap_blocks(RT, form.block_rows);
  GemmIo io;
  io.capacity = L * blocks * form.parts;
  const Allocator alloc = gpu_testing::device_allocator();
  io.parts =
      alloc(DType::kU8, {io.capacity * int64_t{sizeof(OverlapGemmPart)} + 1}, Device::cuda(dev));
  io.num_parts = alloc(DType::kI32, {1}, Device::cuda(dev));
  io.src = alloc(DType::kBF16, {L, RT, H}, Device::cuda(dev));
  io.signals = alloc(DType::kI32, {L * blocks}, Device::cuda(dev));
  return io;
}

// Uploads rank r's GEMM of batch b (parts from `rng`; `skip_signal`: one never raised).
void upload_gemm(GemmIo& io, const LlProblem& p, const OverlapForm& form, const LlBatch& b, int r,
                 std::mt19937_64& rng, cudaStream_t stream, int skip_signal = -1) {
  const std::vector<OverlapGemmPart> parts = testing::overlap_gemm_parts(
      b.want[r].recv_count, p.rows_per_expert(), p.hidden, form, rng, 20000, skip_signal);
  const int n = static_cast<int>(parts.size());
  gpu_testing::upload_on_rank_stream(io.parts.data, parts.data(), parts.size() * sizeof(parts[0]),
                                     stream);
  gpu_testing::upload_on_rank_stream(io.num_parts.data, &n, sizeof(n), stream);
  gpu_testing::upload_on_rank_stream(io.src.data, b.y[r].data(), b.y[r].size() * 2, stream);
}

// On `main`: signals zeroed, dst poisoned (NaN), then the GEMM (after `fork` was recorded, so
// the side stream does not wait for it).
void launch_gemm(const GemmIo& io, const TensorView& dst, const LlProblem& p, cudaStream_t main,
                 cudaEvent_t fork) {
  CUDA_OK(cudaMemsetAsync(io.signals.data, 0, io.signals.nbytes(), main));
  for (int64_t l = 0; l < dst.shape[0]; ++l)
    CUDA_OK(cudaMemset2DAsync(static_cast<uint16_t*>(dst.data) + l * dst.strides[0],
                              dst.strides[1] * 2, 0xFF, p.hidden * 2, dst.shape[1], main));
  CUDA_OK(cudaEventRecord(fork, main));
  stand_in_gemm<<<4, 256, 0, main>>>(
      static_cast<const OverlapGemmPart*>(io.parts.data), io.num_parts.ptr<int>(),
      io.src.ptr<uint16_t>(), static_cast<uint16_t*>(dst.data), dst.strides[0], dst.strides[1],
      p.rows_per_expert(), p.hidden, io.signals.ptr<int32_t>());
  CUDA_OK(cudaGetLastError());
}

// ---- one rank ------------------------------------------------------------------------------

BufferConfig ll_only() {
  BufferConfig config;
  config.enable_ht = false;
  config.enable_ll = true;
  return config;
}

// The rank's inputs of batch b on the device.
struct RankInputs {
  Tensor x, topk, w, y;
};

// `odd_y`: y's rows H + 4 elements apart, 8 bytes off 16-byte alignment (the copies' scalar-load
// path in the overlapped send and the plain combine's copy), else contiguous.
RankInputs upload_inputs(const LlProblem& p, const LlBatch& b, int r, int dev, cudaStream_t stream,
                         bool odd_y = false) {
  const testing::LlRankInput& in = b.in[r];
  const int64_t T = in.num_tokens, H = p.hidden;
  const int K = p.top_k, L = p.num_local_experts();
  const Allocator alloc = gpu_testing::device_allocator();
  RankInputs io;
  io.x = alloc(DType::kBF16, {T, H}, Device::cuda(dev));
  io.topk = alloc(DType::kI64, {T, K}, Device::cuda(dev));
  io.w = alloc(DType::kF32, {T, K}, Device::cuda(dev));
  const int64_t RT = p.rows_per_expert(), row = odd_y ? H + 4 : H;
  io.y = alloc(DType::kBF16, {L, RT, row}, Device::cuda(dev));
  io.y.shape = {L, RT, H};
  io.y.strides = {RT * row, row, 1};
  gpu_testing::upload_on_rank_stream(io.x.data, in.x.data(), in.x.size() * 2, stream);
  gpu_testing::upload_on_rank_stream(io.topk.data, in.topk_idx.data(), in.topk_idx.size() * 8,
                                     stream);
  gpu_testing::upload_on_rank_stream(io.w.data, in.topk_weights.data(), in.topk_weights.size() * 4,
                                     stream);
  return io;
}

// y of batch b into io.y (its row stride).
void upload_y(const RankInputs& io, const std::vector<uint16_t>& y, cudaStream_t stream) {
  const int64_t H = io.y.shape[2], rows = io.y.shape[0] * io.y.shape[1];
  CUDA_OK(cudaStreamSynchronize(stream));
  if (rows > 0)
    CUDA_OK(cudaMemcpy2DAsync(io.y.data, io.y.strides[1] * 2, y.data(), H * 2, H * 2, rows,
                              cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}

LlDispatchResult dispatch(Buffer& buf, const RankInputs& io, cudaStream_t stream) {
  LlDispatchArgs a;
  a.x = io.x;
  a.topk_idx = io.topk;
  a.use_fp8 = false;
  a.stream = stream;
  return buf.ll_dispatch(a, gpu_testing::poison_allocator());
}

LlCombineArgs combine_args(const RankInputs& io, const LlHandle& h, cudaStream_t stream) {
  LlCombineArgs a;
  a.handle = &h;
  a.y = io.y;  // copy mode (the overlapped zero_copy case clears it)
  a.topk_idx = io.topk;
  a.topk_weights = io.w;
  a.stream = stream;
  return a;
}

// "" when out (device, [T, H]) equals `want` on every row, else the first difference.
std::string check_out(const LlProblem& p, const std::vector<uint16_t>& want, const Tensor& out) {
  std::vector<uint16_t> host = gpu_testing::to_host<uint16_t>(out);
  TensorView v = out;
  v.data = host.data();
  v.device = Device::cpu();
  return testing::check_ll_combine(p, want, v);
}

// One rank's set-up for a case: a Buffer of its shape, the GEMM's device memory, the main stream
// and a side stream for the combine (under one-GPU mode the rank's two streams, kept for the whole
// run: gpu_support.h), the fork / join events.
struct Rig {
  Rig(const Group& g, const OverlapCase& oc)
      : group(g),
        r(g.rank()),
        dev(gpu_testing::device_of(g)),
        main(main_stream.get()),
        side(side_stream.get()),
        buf(g, oc.c.p.moe_shape(), ll_only()),
        gemm(make_gemm_io(oc.c.p, oc.form, dev)) {
    CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  }
  ~Rig() {
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;

  // The overlapped combine of `io` on the side stream, overlapped with the GEMM on the main one;
  // the hook on the side stream, then the main stream joins. Returns the combine's result (out
  // valid once the main stream is synchronised). Without `out`, a poisoned one is allocated here
  // before the GEMM is enqueued (the result holds it), so that the host does not wait between
  // enqueueing the GEMM and the send: the poison allocator waits for the rank stream, and inside
  // ll_combine that wait held the send back until the GEMM was done while the peers' sends spun
  // for this rank's routing (O2; docs/design.md §10: one-GPU R = 4 case 3).
  LlCombineResult overlapped(const OverlapCase& oc, const RankInputs& io, const LlDispatchResult& d,
                             const TensorView& out = {}) {
    LlCombineArgs a = combine_args(io, d.handle, side);
    TensorView dst = io.y;
    if (oc.c.zero_copy) {
      dst = buf.ll_next_combine_buffer(d.handle);
      a.zero_copy = true;
      a.y = {};
    }
    Tensor own;
    if (!out.defined())
      own = gpu_testing::poison_allocator()(DType::kBF16, {d.handle.num_tokens, oc.c.p.hidden},
                                            Device::cuda(dev));
    a.out = out.defined() ? out : own;
    a.return_recv_hook = oc.c.hook;
    LlCombineOverlap o;
    o.signals = gemm.signals;
    o.block_rows = oc.form.block_rows;
    o.expected = oc.form.parts;
    o.num_sms = oc.num_sms;
    if (oc.check_count) o.recv_count = d.recv_count;
    a.overlap = o;
    trace("overlapped: out allocated");
    launch_gemm(gemm, dst, oc.c.p, main, fork);
    CUDA_OK(cudaStreamWaitEvent(side, fork, 0));
    trace("overlapped: GEMM enqueued");
    LlCombineResult res = buf.ll_combine(a, gpu_testing::poison_allocator());
    trace("overlapped: ll_combine returned");
    if (own.defined()) res.out = own;
    if (res.hook) res.hook();
    CUDA_OK(cudaEventRecord(join, side));
    CUDA_OK(cudaStreamWaitEvent(main, join, 0));
    return res;
  }

  // A step's host time, kept for print_steps() (the process's clock, so the ranks' threads
  // compare) and with EPX_TEST_TRACE=1 also on stderr (gpu_testing::trace_step).
  void trace(const char* step) {
    static const auto t0 = std::chrono::steady_clock::now();
    steps.emplace_back(
        step,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    gpu_testing::trace_step(group, step);
  }
  void print_steps() const {
    for (const auto& [step, ms] : steps)
      std::fprintf(stderr, "rank %d at %9.1f ms: %s\n", r, ms, step);
  }

  std::vector<std::pair<const char*, double>> steps;

  const Group& group;
  const int r, dev;
  RankStream main_stream{cudaStreamNonBlocking};
  RankStream side_stream{cudaStreamNonBlocking, gpu_testing::rank_side_stream()};
  const cudaStream_t main, side;
  cudaEvent_t fork = nullptr, join = nullptr;
  Buffer buf;
  GemmIo gemm;
};

// Case oc on this rank: per batch a dispatch, the plain combine, the overlapped one; "" or the
// first failure.
std::string run_rank(const OverlapCase& oc, const std::vector<LlBatch>& batches, const Group& g) {
  const LlProblem& p = oc.c.p;
  Rig rig(g, oc);
  const int r = rig.r;
  std::mt19937_64 rng(oc.c.seed * 131 + r);
  for (size_t i = 0; i < batches.size(); ++i) {
    const LlBatch& b = batches[i];
    const std::string where = "rank " + std::to_string(r) + " batch " + std::to_string(i) + ": ";
    RankInputs io = upload_inputs(p, b, r, rig.dev, rig.main, oc.c.padded);
    const LlDispatchResult d = dispatch(rig.buf, io, rig.main);
    upload_y(io, b.y[r], rig.main);
    const LlCombineResult plain =
        rig.buf.ll_combine(combine_args(io, d.handle, rig.main), gpu_testing::poison_allocator());
    CUDA_OK(cudaStreamSynchronize(rig.main));
    std::string e = check_out(p, b.want_out[r], plain.out);
    if (!e.empty()) return where + "plain combine: " + e;
    upload_gemm(rig.gemm, p, oc.form, b, r, rng, rig.main);
    const LlCombineResult ov = rig.overlapped(oc, io, d);
    CUDA_OK(cudaStreamSynchronize(rig.main));
    rig.buf.check();
    e = check_out(p, b.want_out[r], ov.out);
    if (!e.empty()) return where + "overlapped combine: " + e;
  }
  return "";
}

OverlapCase random_case(int R, uint64_t seed) {
  std::mt19937_64 rng(seed * 6151 + 1);
  auto pick = [&](std::vector<int64_t> v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  OverlapCase oc;
  LlCase& c = oc.c;
  c.seed = seed;
  c.p.num_ranks = R;
  while (true) {  // each rank's y ([E, T_max, H] over the ranks) within ~8M elements
    c.p.num_experts = static_cast<int>(R * pick({1, 3, 8, 32}));
    c.p.top_k = static_cast<int>(pick({1, 4, 8}));
    c.p.max_tokens = pick({1, 16, 64, 128});
    c.p.hidden = pick({128, 1024, 7168});
    if (double(c.p.num_experts) * c.p.max_tokens * c.p.hidden <= 8e6) break;
  }
  const auto routings = testing::all_routings();
  c.routing = routings[seed % routings.size()];
  c.hook = rng() % 2;
  c.zero_copy = rng() % 2;
  c.num_iters = seed % 3 == 0 ? 2 : 1;
  c.padded = seed % 4 == 1;  // y's rows off 16-byte alignment (upload_inputs)
  if (rng() % 2) {
    oc.form.block_rows = pick({1, 7, 64, c.p.rows_per_expert()});
    oc.form.parts = static_cast<int>(pick({1, 3, 7}));
  } else {
    oc.form.parts = static_cast<int>(pick({1, 2, 4}));
  }
  oc.num_sms = static_cast<int>(pick({0, 1, 3, 8}));
  oc.check_count = rng() % 2;
  return oc;
}

// Runs cases on R forked ranks (one GPU each) or R ranks sharing GPU 0; returns the failures.
int run_cases(int R, bool one_gpu, const std::vector<OverlapCase>& cases) {
  std::vector<std::vector<LlBatch>> data;
  for (const OverlapCase& oc : cases) data.push_back(testing::make_ll_batches(oc.c));
  auto body = [&](const Group& g) {
    int bad = 0;
    for (size_t i = 0; i < cases.size() && bad == 0; ++i) {
      std::string err;
      try {
        err = run_rank(cases[i], data[i], g);
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      if (!err.empty()) {
        std::fprintf(stderr, "case %zu (%s): %s\n", i, cases[i].describe().c_str(), err.c_str());
        ++bad;  // one diagnosis: the peers time out after it
      }
    }
    return bad;
  };
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body)
                 : gpu_testing::run_cuda_ranks(R, body);
}

std::vector<OverlapCase> random_cases(int R, uint64_t seed, int n, bool one_gpu) {
  std::vector<OverlapCase> cases;
  for (int i = 0; i < n; ++i) {
    cases.push_back(random_case(R, seed + i));
    if (one_gpu) cases.back().num_sms = std::min(cases.back().num_sms, 3);
  }
  return cases;
}

class LlOverlapGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlOverlapGpu, MatchesOracleAndPlainCombine) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  EXPECT_EQ(run_cases(R, false, random_cases(R, 1000 * R, 16, false)), 0);
}

// "R4" for R = 4.
std::string ranks_name(const ::testing::TestParamInfo<int>& i) {
  std::string name = "R";
  name += std::to_string(i.param);
  return name;
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlOverlapGpu, ::testing::Values(1, 2, 4, 8), ranks_name);

class LlOverlapOneGpu : public ::testing::TestWithParam<int> {};

TEST_P(LlOverlapOneGpu, MatchesOracleAndPlainCombine) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(run_cases(R, true, random_cases(R, 50000 + 1000 * R, 10, true)), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LlOverlapOneGpu, ::testing::Values(2, 4, 8), ranks_name);

// Empty experts (all tokens of every rank to one expert of rank 0) in both forms: signals of
// experts without rows are never raised and must not be waited for.
TEST(LlOverlapEdge, EmptyExpertsAreNotWaitedFor) {
  EPX_REQUIRE_GPUS(1);
  std::vector<OverlapCase> cases;
  for (int64_t block_rows : {int64_t{0}, int64_t{8}}) {
    OverlapCase oc;
    oc.c.p = LlProblem{2, 32, 512, 4, 16};
    oc.c.routing = testing::Routing::kAllToOne;
    oc.c.seed = 31 + block_rows;
    oc.c.hook = block_rows > 0;
    oc.form = {block_rows, 2};
    cases.push_back(oc);
  }
  EXPECT_EQ(run_cases(2, true, cases), 0);
}

// ---- errors ----------------------------------------------------------------------------------

// Rank 0's GEMM never raises one signal: rank 0 raises Timeout naming the expert, the block, the
// value wanted and the value seen; rank 1's receive times out waiting for rank 0's rows. After
// ll_clean on both, a new dispatch and overlapped combine are exact. R = 2 on one GPU (or two).
TEST(LlOverlapErrors, SignalNeverRaisedTimesOutThenCleanRecovers) {
  EPX_REQUIRE_GPUS(1);
  const bool two = gpu_testing::visible_gpus() >= 2;
  const OverlapCase oc = testing::two_round_case(LlProblem{2, 16, 256, 2, 4}, 17, {4, 2});
  const std::vector<LlBatch> batches = testing::make_ll_batches(oc.c);
  const LlProblem& p = oc.c.p;
  GroupOptions options;
  options.timeout = std::chrono::milliseconds(2000);
  // Set by a rank whose first round went wrong: then every rank prints its steps' host times at
  // its end (docs/design.md §10: which rank's which step was late).
  std::atomic<bool> wrong{false};
  auto body = [&](const Group& g) {
    Rig rig(g, oc);
    rig.trace("rig built");
    const int r = rig.r;
    std::mt19937_64 rng(5 + r);
    const int skip = testing::first_signal_with_rows(batches[0].want[0].recv_count,
                                                     p.rows_per_expert(), oc.form.block_rows);
    const int64_t blocks = testing::overlap_blocks(p.rows_per_expert(), oc.form.block_rows);
    int bad = 0;
    {
      RankInputs io = upload_inputs(p, batches[0], r, rig.dev, rig.main);
      rig.trace("inputs uploaded");
      const LlDispatchResult d = dispatch(rig.buf, io, rig.main);
      rig.trace("dispatch returned");
      upload_gemm(rig.gemm, p, oc.form, batches[0], r, rng, rig.main, r == 0 ? skip : -1);
      rig.trace("GEMM inputs uploaded");
      rig.overlapped(oc, io, d);
      CUDA_OK(cudaStreamSynchronize(rig.main));
      rig.trace("synchronised");
      try {
        rig.buf.check();
        std::fprintf(stderr, "rank %d: no Timeout\n", r);
        ++bad;
      } catch (const Error& e) {
        const std::string want = "local expert " + std::to_string(skip / blocks) +
                                 ", block 0 (overlap.signals[" + std::to_string(skip) +
                                 "] wanted >= 2, seen 0)";
        if (e.code() != ErrorCode::kTimeout ||
            (r == 0 && std::string(e.what()).find(want) == std::string::npos)) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
          ++bad;
        }
      }
      if (bad > 0) wrong = true;
    }
    rig.buf.ll_clean();
    RankInputs io = upload_inputs(p, batches[1], r, rig.dev, rig.main);
    const LlDispatchResult d = dispatch(rig.buf, io, rig.main);
    upload_gemm(rig.gemm, p, oc.form, batches[1], r, rng, rig.main);
    const LlCombineResult res = rig.overlapped(oc, io, d);
    CUDA_OK(cudaStreamSynchronize(rig.main));
    rig.buf.check();
    const std::string e = check_out(p, batches[1].want_out[r], res.out);
    if (!e.empty()) {
      std::fprintf(stderr, "rank %d after ll_clean: %s\n", r, e.c_str());
      ++bad;
    }
    rig.trace("second round checked");
    if (wrong || bad > 0) rig.print_steps();
    return bad;
  };
  EXPECT_EQ(two ? gpu_testing::run_cuda_ranks(2, body, options)
                : gpu_testing::run_cuda_ranks_one_gpu(2, 0, body, options),
            0);
}

// Rank 0 passes overlap, rank 1 does not: both complete and raise InvalidArgument naming it;
// then a recv_count that is not the handle's: InvalidArgument from check(), the result exact.
TEST(LlOverlapErrors, DisagreementAndRecvCount) {
  EPX_REQUIRE_GPUS(1);
  const OverlapCase oc = testing::two_round_case(LlProblem{2, 8, 128, 2, 4}, 23, {0, 1});
  const std::vector<LlBatch> batches = testing::make_ll_batches(oc.c);
  const LlProblem& p = oc.c.p;
  auto body = [&](const Group& g) {
    Rig rig(g, oc);
    const int r = rig.r;
    std::mt19937_64 rng(7 + r);
    int bad = 0;
    auto expect_invalid = [&](const char* what, const std::string& needle) {
      try {
        rig.buf.check();
        std::fprintf(stderr, "rank %d %s: no error\n", r, what);
        ++bad;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kInvalidArgument ||
            std::string(e.what()).find(needle) == std::string::npos) {
          std::fprintf(stderr, "rank %d %s: %s\n", r, what, e.what());
          ++bad;
        }
      }
    };
    RankInputs io = upload_inputs(p, batches[0], r, rig.dev, rig.main);
    LlDispatchResult d = dispatch(rig.buf, io, rig.main);
    upload_gemm(rig.gemm, p, oc.form, batches[0], r, rng, rig.main);
    upload_y(io, batches[0].y[r], rig.main);
    // Every output from the rank's stream-ordered pool: the default allocator's cudaFree of a
    // dropped output synchronises the device, and with ranks sharing it the rank then waits for
    // its own combine, which waits for the peer whose API calls wait behind that free.
    LlCombineResult plain;
    if (r == 0) {
      rig.overlapped(oc, io, d);
    } else {
      plain =
          rig.buf.ll_combine(combine_args(io, d.handle, rig.main), gpu_testing::poison_allocator());
    }
    CUDA_OK(cudaStreamSynchronize(rig.main));
    expect_invalid("disagreement", "whether argument 'overlap' is given differs across ranks");
    // A wrong recv_count on rank 1 only: its check raises, the result is still exact.
    io = upload_inputs(p, batches[1], r, rig.dev, rig.main);
    d = dispatch(rig.buf, io, rig.main);
    upload_gemm(rig.gemm, p, oc.form, batches[1], r, rng, rig.main);
    OverlapCase checked = oc;
    checked.check_count = true;
    LlDispatchResult d_wrong = d;
    Tensor wrong;
    if (r == 1) {
      std::vector<int32_t> count = batches[1].want[r].recv_count;
      count[0] += 3;
      wrong = gpu_testing::to_device(count, DType::kI32, {p.num_local_experts()}, rig.dev);
      d_wrong.recv_count = wrong;
    }
    const LlCombineResult res = rig.overlapped(checked, io, d_wrong);
    CUDA_OK(cudaStreamSynchronize(rig.main));
    if (r == 1) expect_invalid("recv_count", "'overlap.recv_count' has [0] = ");
    rig.buf.check();
    const std::string e = check_out(p, batches[1].want_out[r], res.out);
    if (!e.empty()) {
      std::fprintf(stderr, "rank %d: %s\n", r, e.c_str());
      ++bad;
    }
    return bad;
  };
  EXPECT_EQ(gpu_testing::run_cuda_ranks_one_gpu(2, 0, body), 0);
}

// ---- CUDA graphs -------------------------------------------------------------------------------

// {signals zeroed, dispatch, y poisoned, fork, stand-in GEMM || overlapped combine (+ hook),
// join} captured once per mode (blocks form with a hook and the handle's recv_count checked;
// experts form without a hook, zero_copy) and replayed on new inputs and a new GEMM order each
// time; every replay checked. R ranks, one GPU each, or R ranks sharing GPU 0.
int graph_replays(int R, bool one_gpu) {
  constexpr int kReplays = 20;
  OverlapCase modes[2];
  modes[0].form = {16, 3};
  modes[0].c.hook = true;
  modes[0].check_count = true;
  modes[1].form = {0, 2};
  modes[1].c.zero_copy = true;
  std::vector<LlBatch> data[2];
  std::mt19937_64 rng(99);
  const std::vector<testing::Routing> all = testing::all_routings();
  for (int m = 0; m < 2; ++m) {
    modes[m].c.p = LlProblem{R, 32, 512, 4, 4 * R};
    modes[m].c.fixed_tokens.assign(R, 32);
    modes[m].c.fixed_tokens[0] = 27;
    modes[m].num_sms = 2;
    for (int i = 0; i <= kReplays; ++i) {
      modes[m].c.routing = all[(i + m) % all.size()];
      data[m].push_back(testing::make_ll_batch(modes[m].c, rng));
    }
  }
  auto body = [&](const Group& g) {
    int bad = 0;
    for (int m = 0; m < 2 && bad == 0; ++m) {
      const OverlapCase& oc = modes[m];
      const LlProblem& p = oc.c.p;
      Rig rig(g, oc);
      const int r = rig.r;
      const cudaStream_t main = rig.main;
      // Outputs at fixed addresses: one tensor per (dtype, shape), made by the eager call.
      auto pool = std::make_shared<std::map<std::string, Tensor>>();
      const Allocator base = gpu_testing::device_allocator();
      const Allocator alloc = [pool, base](DType dt, const std::vector<int64_t>& s, Device d) {
        std::string key = dtype_name(dt);
        for (int64_t v : s) key.append(",").append(std::to_string(v));
        auto it = pool->find(key);
        if (it == pool->end()) it = pool->emplace(key, base(dt, s, d)).first;
        return it->second;
      };
      Tensor out = base(DType::kBF16, {oc.c.fixed_tokens[r], p.hidden}, Device::cuda(rig.dev));
      std::mt19937_64 grng(1000 * m + r);
      RankInputs io = upload_inputs(p, data[m][0], r, rig.dev, main);
      auto upload = [&](const LlBatch& b) {
        const testing::LlRankInput& in = b.in[r];
        gpu_testing::upload_on_rank_stream(io.x.data, in.x.data(), in.x.size() * 2, main);
        gpu_testing::upload_on_rank_stream(io.topk.data, in.topk_idx.data(), in.topk_idx.size() * 8,
                                           main);
        gpu_testing::upload_on_rank_stream(io.w.data, in.topk_weights.data(),
                                           in.topk_weights.size() * 4, main);
        upload_gemm(rig.gemm, p, oc.form, b, r, grng, main);
        CUDA_OK(cudaMemsetAsync(out.data, 0xFF, out.nbytes(), main));
      };
      LlDispatchResult d;
      auto round = [&] {
        LlDispatchArgs a;
        a.x = io.x;
        a.topk_idx = io.topk;
        a.use_fp8 = false;
        a.stream = main;
        d = rig.buf.ll_dispatch(a, alloc);
        rig.overlapped(oc, io, d, out);
      };
      auto verify = [&](int i) {
        std::string e;
        try {
          rig.buf.check();
          e = check_out(p, data[m][i].want_out[r], out);
        } catch (const std::exception& ex) {
          e = std::string("exception: ") + ex.what();
        }
        if (!e.empty()) {
          std::fprintf(stderr, "rank %d mode %d replay %d: %s\n", r, m, i, e.c_str());
          ++bad;
        }
      };
      upload(data[m][0]);
      round();  // eager: fills the pool
      CUDA_OK(cudaStreamSynchronize(main));
      verify(0);
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_OK(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal));
      round();
      CUDA_OK(cudaStreamEndCapture(main, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 1; i <= kReplays && bad == 0; ++i) {
        upload(data[m][i]);
        CUDA_OK(cudaGraphLaunch(exec, main));
        CUDA_OK(cudaStreamSynchronize(main));
        verify(i);
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
    return bad;
  };
  return one_gpu ? gpu_testing::run_cuda_ranks_one_gpu(R, 0, body)
                 : gpu_testing::run_cuda_ranks(R, body);
}

TEST(LlOverlapGraph, CaptureReplayedOnNewInputsOneRank) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(graph_replays(1, false), 0);
}

TEST(LlOverlapGraph, CaptureReplayedOnNewInputs) {
  EPX_REQUIRE_GPUS(2);
  EXPECT_EQ(graph_replays(2, false), 0);
}

TEST(LlOverlapGraph, CaptureReplayedOnNewInputsOneGpuR2) {
  EPX_REQUIRE_GPUS(1);
  EXPECT_EQ(graph_replays(2, true), 0);
}

}  // namespace
}  // namespace epx
