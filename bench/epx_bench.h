// bench/epx_bench.h — internals shared by the epx-bench sources (not a public header).
//
// Data flow of one run:
//   main (epx_bench.cc): parse Options -> start R ranks (threads, forked processes, or one forked
//   process per GPU) -> each rank runs the modes (epx_bench_{ht,ll,a2a}.cc) and writes its
//   RankReport into memory shared with the parent (an anonymous MAP_SHARED mapping made before
//   any fork) -> the parent merges the reports (times from rank 0, bytes averaged over ranks,
//   check failures from any rank) and prints the table and the JSON.
//
// Bytes (per rank, payload only: hidden row plus its fp8 scales, or the a2a payload rows;
// routing metadata is not counted):
//   cross_bytes  bytes this rank receives from OTHER ranks (its own tokens excluded): what has to
//                cross NVLink. GB/s = cross_bytes / median time. The NCCL all-to-all and the
//                NVLink ceiling move cross_bytes / (R - 1) to every peer.
//   recv_bytes   all bytes this rank receives, its own tokens included (how DeepEP reports
//                "GB/s (NVL)"); recv GB/s = recv_bytes / median time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench/baselines.h"
#include "epx/epx.h"

namespace epx::bench {

// ---- options ----------------------------------------------------------------------------------

// --dtype / --quant: what the dispatches move (kStandard: each mode's standard set; kNvfp4: ll
// only).
enum class DTypeChoice { kStandard, kBf16, kFp8, kNvfp4 };

struct Options {
  std::vector<std::string> modes;  // subset of {ht, ll, a2a}, in that order
  Backend backend = Backend::kCpu;
  int num_ranks = 0;            // 0 = default (cpu: 4; cuda: every visible GPU)
  bool procs = false;           // cpu: forked processes over POSIX shared memory
  int num_nodes = 1;            // --nodes: the group's ranks as nodes of R / N ranks
  std::vector<int64_t> tokens;  // empty = per-mode default
  int64_t hidden = 7168;
  int top_k = 8;
  int num_experts = 256;
  DTypeChoice dtype = DTypeChoice::kStandard;
  std::string routing = "uniform";
  int iters = -1;   // -1 = default for the backend
  int warmup = -1;  // -1 = default for the backend
  int num_sms = 0;  // 0 = auto
  bool pipelined = false;  // --timing pipelined (cuda): TimeMethod::kPipelined, else kBarrier
  bool check = false;
  std::string json_path;
  uint64_t seed = 1;
  int timeout_ms = 0;  // 0 = epx default (EPX_TIMEOUT_MS or 30 s)
  std::string command_line;
};

// Default tokens per rank of `mode` ("ht", "ll", "a2a") on `backend` (the standard workloads of
// docs/perf.md §3 on cuda; smaller on cpu so a run takes seconds).
std::vector<int64_t> default_tokens(const std::string& mode, Backend backend);

// ---- results (plain data: they live in memory shared across fork) ----------------------------

inline constexpr int kMaxOps = 48;

enum class CheckState : int32_t { kNotRun = 0, kPass = 1, kFail = 2 };

struct OpResult {
  char op[40];         // "ht.dispatch bf16"
  int64_t num_tokens;  // T per rank
  Timing time;         // this rank's timing (the parent reports rank 0's)
  double cross_bytes;  // see the file comment
  double recv_bytes;
  double row_bytes;    // bytes of one token row as it crosses to a rank (0: not reported)
  bool has_baselines;  // cuda: nccl and ceiling are set
  Timing nccl;         // NCCL all-to-all of cross_bytes / (R - 1) per peer
  Timing ceiling;      // SM-driven peer copy of the same bytes
  int ceiling_sms;
  int num_sms;        // SMs the op may use (GroupOptions::num_sms; 0 = auto)
  int64_t sym_bytes;  // Buffer::bytes_allocated / A2a::bytes_allocated
  CheckState check;
  char check_detail[240];  // first mismatch, or empty; the reason when skipped
  bool skipped;            // the mode is Unsupported on this backend (the row holds why)
};

struct RankReport {
  int32_t num_ops;
  int32_t failed;  // exception or check failure on this rank
  char error[512];
  OpResult ops[kMaxOps];
};

// ---- what a mode runner gets --------------------------------------------------------------------

struct Ctx {
  const Options& opt;
  const Group& group;
  RankReport& report;
  Device device;  // where inputs and outputs live
  Stream stream;  // cuda stream (nullptr on cpu)
  int iters;
  int warmup;
  Allocator alloc;  // outputs: a caching pool (make_caching_allocator)
  bool is_cuda() const { return device.type == DeviceType::kCuda; }
  int rank() const { return group.rank(); }
  int num_ranks() const { return group.size(); }
};

// Mode runners: build the buffer for T tokens per rank, check (if asked), time, append results.
void run_ht(Ctx& ctx, int64_t num_tokens);
void run_ll(Ctx& ctx, int64_t num_tokens);
void run_a2a(Ctx& ctx, int64_t num_tokens);

// ---- helpers (epx_bench_util.cc) ---------------------------------------------------------------

// The rng of rank `rank`'s inputs for `salt` (one stream per mode): every rank can regenerate any
// other rank's inputs, which is how the naive oracles get the whole group's inputs.
std::mt19937_64 rank_rng(uint64_t seed, int rank, uint64_t salt);

// Inputs of one rank. The routing comes first in the rank's rng stream, so the routing of every
// rank is cheap to regenerate (for the byte counts) without its data.
struct RankData {
  std::vector<int64_t> topk_idx;    // [T, K]
  std::vector<float> topk_weights;  // [T, K] (with_data)
  std::vector<uint16_t> x;          // [T, H] bf16 bits (with_data)
};
inline constexpr uint64_t kSaltHt = 1, kSaltLl = 2, kSaltA2a = 3;
RankData make_rank_data(const Options& opt, int rank, int num_ranks, int64_t num_tokens,
                        uint64_t salt, bool with_data);

// n finite bf16 values (|v| < 8, varied exponents), a pure function of (key, index): used for the
// expert outputs y, cheap enough to regenerate every rank's on every rank.
void fill_hash_bf16(uint16_t* dst, int64_t n, uint64_t key);

// The distinct ranks token row `row[K]` goes to (ascending), for experts on L per rank.
std::vector<int> ranks_of(const int64_t* row, int top_k, int num_local_experts);

// An allocator that keeps freed blocks and hands them out again for the same size and device,
// as engines do with PyTorch's caching allocator: timed calls then pay neither cudaMalloc /
// cudaFree (cudaFree synchronises the device) nor the page faults of fresh host memory.
Allocator make_caching_allocator();

// A tensor on `device` holding a copy of `bytes` (host memory, contiguous).
Tensor upload(const void* bytes, DType dtype, const std::vector<int64_t>& shape, Device device);
template <typename T>
Tensor upload(const std::vector<T>& v, DType dtype, const std::vector<int64_t>& shape,
              Device device) {
  return upload(v.data(), dtype, shape, device);
}

// A host copy of a (possibly strided, possibly device) view, in logical row-major order.
std::vector<uint8_t> download(const TensorView& t);
template <typename T>
std::vector<T> download_as(const TensorView& t) {
  std::vector<uint8_t> b = download(t);
  std::vector<T> v(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(v.data(), b.data(), v.size() * sizeof(T));
  return v;
}

// A host copy of a view with the same shape and strides (the raw span it covers is copied), so a
// check that reads through strides sees exactly the device layout. Host views are copied too.
Tensor host_copy(const TensorView& t);

// "" when the logical contents of `got` (any device, any strides) equal `want_bytes` bytes at
// `want`, else the first mismatching element (index and bits) and how many differ.
std::string compare_tensor(const char* name, const TensorView& got, const void* want,
                           size_t want_bytes);
template <typename T>
std::string compare_tensor(const char* name, const TensorView& got, const std::vector<T>& want) {
  return compare_tensor(name, got, want.data(), want.size() * sizeof(T));
}

// Copies `bytes` of host memory into a (contiguous) view, on host or device.
void copy_into(const TensorView& dst, const void* bytes, size_t num_bytes);
void device_synchronize(Device device);
// Waits for the work enqueued on `stream` (nothing on cpu).
void stream_synchronize(Device device, Stream stream);
Stream make_stream(Device device);  // nullptr on cpu

// Times `step` (iters times after warmup). cpu: barrier before each call, wall clock of this rank.
// cuda: bench::time_on_device (CUDA events around each call) with time_method(ctx).
Timing time_op(Ctx& ctx, const std::function<void()>& step);
TimeMethod time_method(const Ctx& ctx);  // --timing

// cpu only: times each step of a sequence separately, iteration by iteration (barrier before
// every step), for ops that must alternate (a2a dispatch -> combine). Returns one Timing per step
// plus, last, the per-iteration sum of the steps where `in_total` is true (all if empty).
std::vector<Timing> time_sequence(Ctx& ctx, const std::vector<std::function<void()>>& steps,
                                  const std::vector<bool>& in_total = {});

// The outcome of comparing one op's outputs with the naive oracle on this rank.
struct Check {
  bool run = false;
  std::string failure;  // empty = pass; else the first mismatch
  // Records a mismatch (keeps the first).
  void fail(const std::string& what) {
    if (failure.empty()) failure = what;
  }
  bool ok() const { return failure.empty(); }
};

// Appends a result row for this rank: the timing, the byte totals, the check outcome and, on
// cuda, the NCCL all-to-all and NVLink-ceiling baselines of the same cross bytes (collective).
// row_bytes: bytes of one token row on the wire (the row_B column; 0: not reported).
void add_result(Ctx& ctx, const std::string& op, int64_t num_tokens, const Timing& t,
                double cross_bytes, double recv_bytes, int64_t sym_bytes, const Check& check,
                double row_bytes = 0);
// Progress line on stderr from rank 0.
void progress(const Ctx& ctx, const std::string& line);

}  // namespace epx::bench
