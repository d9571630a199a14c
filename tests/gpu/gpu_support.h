// tests/gpu/gpu_support.h — what the GPU tier needs around GoogleTest: counting GPUs without
// initialising CUDA in the test process (CUDA does not survive fork, and every cuda test forks
// its ranks), running a body on R forked ranks of a cuda group, and host <-> device copies.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/group.h"
#include "epx/ll.h"
#include "epx/tensor.h"

namespace epx::testing {
struct LlCase;
struct LlRankInput;
}  // namespace epx::testing

namespace epx::gpu_testing {

// GPUs visible to CUDA, counted in a throw-away child process (0 when CUDA fails there).
int visible_gpus();

// Skips the current test, with the reason, unless `n` GPUs are visible.
// Throws epx::Error(kCuda) naming the call when a CUDA runtime call fails (GPU test bodies run in
// forked ranks: an exception is reported by run_cuda_ranks as that rank's failure).
#define CUDA_OK(call)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess)                                                               \
      throw ::epx::Error(::epx::ErrorCode::kCuda,                                        \
                         std::string(#call) + ": " + cudaGetErrorString(e_));           \
  } while (0)

#define EPX_REQUIRE_GPUS(n)                                                                 \
  do {                                                                                      \
    const int epx_have_ = ::epx::gpu_testing::visible_gpus();                               \
    if (epx_have_ < (n))                                                                    \
      GTEST_SKIP() << "needs " << (n) << " GPU(s), " << epx_have_ << " visible (GPU tier)"; \
  } while (0)

// Forks R ranks; rank r binds GPU r and joins a cuda group (unique id through a temp file made
// by rank 0). Returns 0 when every rank's body returned 0.
int run_cuda_ranks(int num_ranks, const std::function<int(const Group&)>& body,
                   GroupOptions options = {});

// One GPU, R ranks (Group::cuda_shared_device; issue 8: the GPU tier at R = 4 and 8 on 1 GPU).
// Forks one child (CUDA does not survive fork; the test process stays CUDA-free) that sets
// CUDA_DEVICE_MAX_CONNECTIONS=32 and runs body(group) on R threads, rank r with its own
// non-blocking stream, rank_stream(), and a non-blocking side stream, rank_side_stream(), both
// made when the thread starts and kept for the whole run: with the per-thread streams the child
// holds 3R streams, within the hardware queues the mode requires (min(32, 3R)). Streams made per
// case would outnumber the queues after a few cases, and work on a stream that shares a queue
// with a peer's waits behind that peer's spinning kernel. `options.num_sms` 0 = SMs / R
// (co-residency, see group.h). Returns 0 when every rank's body returned 0; an exception prints
// and counts as 1.
// In this mode the helpers below (to_device, to_host_bytes, poison_allocator, device_allocator)
// work on rank_stream() and never synchronise the device, since a device-wide wait would wait
// for a peer's kernel spinning on this rank (see Group::cuda_shared_device); device memory comes
// from the rank's own pool (one shared pool may make a rank's stream wait for a peer's stream to
// reuse a block the peer freed; EPX_TEST_SHARED_POOL=1 uses the device's default pool instead).
int run_cuda_ranks_one_gpu(int num_ranks, int device,
                           const std::function<int(const Group&)>& body,
                           GroupOptions options = {});
// This thread's rank stream under run_cuda_ranks_one_gpu; nullptr elsewhere.
cudaStream_t rank_stream();
// This thread's side stream under run_cuda_ranks_one_gpu (work beside the rank stream, e.g. a
// combine overlapped with a GEMM); nullptr elsewhere.
cudaStream_t rank_side_stream();
// The CUDA device of a group's rank (rank r under run_cuda_ranks, the shared device otherwise).
int device_of(const Group& group);
// `own` when this thread has no rank stream; else rank_stream() (bodies shared by both modes).
inline cudaStream_t stream_or(cudaStream_t own) { return rank_stream() ? rank_stream() : own; }
// The stream a test rank works on: `given` (by default rank_stream(); rank_side_stream() for a
// second stream) where it is not null, else one created here with `flags`
// (cudaStreamCreateWithFlags) and destroyed with this object.
class RankStream {
 public:
  explicit RankStream(unsigned flags = cudaStreamDefault, cudaStream_t given = rank_stream())
      : stream_(given) {
    if (!stream_) {
      CUDA_OK(cudaStreamCreateWithFlags(&own_, flags));
      stream_ = own_;
    }
  }
  ~RankStream() {
    if (own_) cudaStreamDestroy(own_);
  }
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t own_ = nullptr;
  cudaStream_t stream_ = nullptr;
};
// EPX_TEST_TRACE=1: prints "[trace <ms> ms] rank <r>: <step>" (ms since the process's first
// step), so a one-GPU run that times out or faults shows which rank was at which step.
void trace_step(const Group& group, const char* step);

// default_allocator(), except under run_cuda_ranks_one_gpu: stream-ordered allocations from the
// rank's own pool / cudaFreeAsync on rank_stream() for cuda tensors (cudaFree would synchronise
// the device).
Allocator device_allocator();

// `bytes` of pageable host memory to `dst` on `stream`, synchronously: the stream is drained
// first. A pageable copy queued behind this rank's kernel that spins on its peers blocks the
// calling thread inside the driver, and the peers' own pageable copies (their next launch) queue
// behind it: under run_cuda_ranks_one_gpu the ranks deadlocked until the device timeout (LlOneGpu
// R8 took 2 x the 30 s timeout: the other ranks timed out first, then the blocked rank's kernel
// ran and timed out itself; 3b00b5c, 2026-11-30).
void upload_on_rank_stream(void* dst, const void* host, size_t bytes, cudaStream_t stream);

// Device copies (synchronous; the caller owns nothing but the returned Tensor).
Tensor to_device(const void* host, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                 int device);
template <typename T>
Tensor to_device(const std::vector<T>& host, DType dtype, const std::vector<int64_t>& shape,
                 int device) {
  return to_device(host.data(), host.size() * sizeof(T), dtype, shape, device);
}
// The whole tensor (contiguous) as bytes, after synchronising the device (under
// run_cuda_ranks_one_gpu: rank_stream()).
std::vector<uint8_t> to_host_bytes(const TensorView& t);
template <typename T>
std::vector<T> to_host(const TensorView& t) {
  std::vector<uint8_t> b = to_host_bytes(t);
  std::vector<T> out(b.size() / sizeof(T));
  if (!b.empty()) std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
  return out;
}

// A host tensor with t's shape and strides over a copy of its whole storage, which `keep` holds
// (every tensor `keep` holds stays valid as long as `keep`: it only grows).
Tensor host_copy(const TensorView& t, std::vector<std::vector<uint8_t>>& keep);
// Rows [n, H] of 16-bit values laid out with row stride H, or H + pad when `padded` (the stride in
// *stride; the padding and an empty image's one row hold 0xDEAD): what upload_rows uploads. An
// odd pad leaves every other row not 16-byte aligned.
std::vector<uint16_t> rows_image(const std::vector<uint16_t>& src, int64_t n, int64_t H,
                                 bool padded, int64_t* stride, int64_t pad = 64);
// ll test inputs on `device`: rows_image as a flat tensor; topk ids [T, K] as int32 or int64.
Tensor upload_rows(const std::vector<uint16_t>& src, int64_t n, int64_t H, bool padded, int device,
                   int64_t* stride, int64_t pad = 64);
Tensor upload_topk(const std::vector<int64_t>& topk, int64_t T, int K, bool i32, int device);
// One rank's ll inputs of case c uploaded (`keep` holds the tensors): the dispatch's x (padded
// when c.padded), topk_idx (int32 when c.topk_i32) and c.p's fp8 options (not NVFP4's); the
// combine's topk_idx and topk_weights, and y [L, R * T_max, H] (padded when c.padded) unless
// `y` is null (zero-copy).
LlDispatchArgs ll_dispatch_inputs(const testing::LlCase& c, const testing::LlRankInput& in,
                                  int device, std::vector<Tensor>& keep);
LlCombineArgs ll_combine_inputs(const testing::LlCase& c, const testing::LlRankInput& in,
                                const std::vector<uint16_t>* y, int device,
                                std::vector<Tensor>& keep);
// An ll dispatch result with every tensor copied to the host (host_copy), for the oracle checks.
LlDispatchResult host_ll_dispatch(const LlDispatchResult& d,
                                  std::vector<std::vector<uint8_t>>& keep);

// `elems` elements from the start of t's storage (cpu or cuda; cuda: after a device sync), as
// bytes.
std::vector<uint8_t> storage_bytes(const TensorView& t, int64_t elems);
// t's elements in logical row-major order (any strides), as bytes.
std::vector<uint8_t> logical_bytes(const TensorView& t);
// "" when equal, else where the first difference is and how many bytes differ.
std::string diff_bytes(const std::string& what, const std::vector<uint8_t>& want,
                       const std::vector<uint8_t>& got);

// The benches' graph rows: after a group barrier, two warm-up replays of `exec`; after another
// barrier, `replays` replays back to back between two CUDA events; their microseconds (all of
// them: divide by replays x calls per graph for a per-call time).
double graph_replays_us(const Group& group, cudaStream_t stream, cudaGraphExec_t exec, int replays);

// Command-line lists of the GPU benchmarks: "a,b,c" -> its items (empty items dropped), and
// -> integers (an empty item reads as 0).
std::vector<std::string> split_commas(const std::string& list);
std::vector<int64_t> parse_int_list(const std::string& list);

// default_allocator(), every byte of a new tensor set to `byte` (cpu or cuda) and, on cuda,
// waited for: outputs the library must overwrite start as garbage, and the fill can never land
// after a kernel on another stream wrote (a legacy-stream memset is not ordered with
// non-blocking streams).
Allocator poison_allocator(int byte = 0xFF);

// `fn` enqueued on `stream` under a thread-local capture; the capture is ended whatever `fn`
// raises (the stream must not stay capturing), and the graph returned (null when the capture
// was invalidated; the CUDA error cleared).
cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& fn);

// Hands out, in order, the tensors a first (eager) pass allocated from `base`, so a CUDA graph
// captured from the same sequence of calls has its outputs at fixed addresses and nothing is
// allocated during capture. Throws Internal when the sequence differs.
struct Arena {
  explicit Arena(Allocator base_allocator = default_allocator()) : base(std::move(base_allocator)) {}
  Allocator base;
  std::vector<Tensor> tensors;
  size_t next = 0;
  bool recording = true;
  // Replays the recorded sequence from its start.
  void replay() {
    recording = false;
    next = 0;
  }
  Allocator allocator();
};

// 0 when f() raises an Error of `code` whose message holds every one of `words`; else 1, printed
// with the rank and `what` (no error, another code, or the message).
int expect_error(int rank, const char* what, const std::function<void()>& f, ErrorCode code,
                 std::initializer_list<const char*> words);
// expect_error with ErrorCode::kUnsupported.
int expect_unsupported(int rank, const char* what, const std::function<void()>& f,
                       std::initializer_list<const char*> words);

// The test-name suffix of a (nodes, ranks per node) parameter: testing::topology_name's "NxG".
struct TopologyParamName {
  template <class Info>
  std::string operator()(const Info& info) const {
    return topology_suffix(info.param.first, info.param.second);
  }
  static std::string topology_suffix(int nodes, int per_node);
};

}  // namespace epx::gpu_testing
