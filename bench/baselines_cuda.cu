// bench/baselines_cuda.cu — the cuda baselines of bench/baselines.h, measured in the same run as
// epx: a CUDA-event device timer, NCCL all-to-all of the same bytes (grouped ncclSend/ncclRecv
// of bf16 on the group's own communicator), and the NVLink ceiling (num_sms CTAs pushing
// 16-byte stores into every peer's symmetric memory, all ranks at once).
//
// Every timed iteration starts with a group barrier (a bounded device barrier + host sync), so
// ranks start together and one rank's time is not its wait for a late peer.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <vector>

#include "bench/baselines.h"
#include "epx/error.h"
#include "transport/nccl_transport.h"
#include "transport/transport.h"

namespace epx::bench {

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(ErrorCode::kCuda, std::string(what) + ": " + cudaGetErrorString(e));
}
void nccl_ok(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw Error(ErrorCode::kNccl, std::string(what) + ": " + ncclGetErrorString(r));
}

Timing summarize(std::vector<double> us) {
  Timing t;
  if (us.empty()) return t;
  std::sort(us.begin(), us.end());
  t.min_us = us.front();
  t.max_us = us.back();
  t.median_us = us[us.size() / 2];
  return t;
}

// Pushes `bytes` from `src` into dst[p] for every peer p != rank; CTAs are spread over the peers.
__global__ void __launch_bounds__(512) push_kernel(const uint4* __restrict__ src, uint4* const* dst,
                                                   int num_ranks, int rank, size_t num_vec) {
  const int num_peers = num_ranks - 1;
  if (num_peers == 0) return;
  const int ctas_per_peer = max(1, static_cast<int>(gridDim.x) / num_peers);
  const int peer_idx = min(static_cast<int>(blockIdx.x) / ctas_per_peer, num_peers - 1);
  const int cta = blockIdx.x - peer_idx * ctas_per_peer;
  const int ctas = peer_idx == num_peers - 1 ? gridDim.x - peer_idx * ctas_per_peer : ctas_per_peer;
  const int peer = (rank + 1 + peer_idx) % num_ranks;
  uint4* d = dst[peer];
  const size_t per = (num_vec + ctas - 1) / ctas;
  const size_t beg = min(num_vec, per * cta), end = min(num_vec, beg + per);
  constexpr int kUnroll = 8;
  size_t i = beg + threadIdx.x;
  for (; i + (kUnroll - 1) * blockDim.x < end; i += kUnroll * blockDim.x) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(src + i + u * blockDim.x);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = v[u];
  }
  for (; i < end; i += blockDim.x) d[i] = __ldg(src + i);
  // The stores must have reached the peer when the kernel ends: wait for them.
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
}

__global__ void empty_kernel() {}

}  // namespace

void launch_empty_kernel(void* stream) {
  empty_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>();
  cuda_ok(cudaGetLastError(), "launch_empty_kernel");
}

Timing time_on_device(const Group& group, void* stream, int warmup, int iters,
                      const std::function<void()>& body, TimeMethod method) {
  auto s = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warmup; ++i) body();
  cuda_ok(cudaStreamSynchronize(s), "time_on_device: warmup");
  std::vector<double> us;
  if (method == TimeMethod::kPipelined) {
    std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(iters), nullptr);
    for (cudaEvent_t& e : ev) cuda_ok(cudaEventCreate(&e), "time_on_device");
    group.transport()->barrier("time_on_device");
    for (int i = 0; i < iters; ++i) {
      cuda_ok(cudaEventRecord(ev[2 * i], s), "time_on_device");
      body();
      cuda_ok(cudaEventRecord(ev[2 * i + 1], s), "time_on_device");
    }
    cuda_ok(cudaStreamSynchronize(s), "time_on_device");
    for (int i = 0; i < iters; ++i) {
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "time_on_device");
      us.push_back(ms * 1000.0);
    }
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
    return summarize(us);
  }
  cudaEvent_t e0, e1;
  cuda_ok(cudaEventCreate(&e0), "time_on_device");
  cuda_ok(cudaEventCreate(&e1), "time_on_device");
  for (int i = 0; i < iters; ++i) {
    group.transport()->barrier("time_on_device");
    cuda_ok(cudaEventRecord(e0, s), "time_on_device");
    body();
    cuda_ok(cudaEventRecord(e1, s), "time_on_device");
    cuda_ok(cudaEventSynchronize(e1), "time_on_device");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, e0, e1), "time_on_device");
    us.push_back(ms * 1000.0);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return summarize(us);
}

Timing nccl_all_to_all(const Group& group, size_t bytes_per_peer, int warmup, int iters,
                       TimeMethod method) {
  auto comm = static_cast<ncclComm_t>(detail::nccl_comm_of(*group.transport()));
  if (!comm) throw Error(ErrorCode::kUnsupported, "nccl_all_to_all: needs a cuda group");
  const int R = group.size();
  const size_t count = bytes_per_peer / 2;  // bf16 elements per peer
  void *send = nullptr, *recv = nullptr;
  cuda_ok(cudaMalloc(&send, std::max<size_t>(1, count * 2 * R)), "nccl_all_to_all");
  cuda_ok(cudaMalloc(&recv, std::max<size_t>(1, count * 2 * R)), "nccl_all_to_all");
  cuda_ok(cudaMemset(send, 0x3c, count * 2 * R), "nccl_all_to_all");
  cudaStream_t s;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "nccl_all_to_all");
  auto body = [&] {
    nccl_ok(ncclGroupStart(), "ncclGroupStart");
    for (int p = 0; p < R; ++p) {
      nccl_ok(ncclSend(static_cast<char*>(send) + p * count * 2, count, ncclBfloat16, p, comm, s),
              "ncclSend");
      nccl_ok(ncclRecv(static_cast<char*>(recv) + p * count * 2, count, ncclBfloat16, p, comm, s),
              "ncclRecv");
    }
    nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
  };
  Timing t = time_on_device(group, s, warmup, iters, body, method);
  cudaStreamDestroy(s);
  cudaFree(send);
  cudaFree(recv);
  return t;
}

Timing nvlink_copy_ceiling(const Group& group, size_t bytes_per_peer, int num_sms, int warmup,
                           int iters, TimeMethod method) {
  const int R = group.size(), me = group.rank();
  const size_t bytes = (bytes_per_peer + 15) / 16 * 16;
  auto mem = group.transport()->allocate(bytes * R);
  void* src = nullptr;
  cuda_ok(cudaMalloc(&src, std::max<size_t>(16, bytes)), "nvlink_copy_ceiling");
  cuda_ok(cudaMemset(src, 0x5a, bytes), "nvlink_copy_ceiling");
  std::vector<uint4*> dst(R);
  for (int p = 0; p < R; ++p)
    dst[p] = reinterpret_cast<uint4*>(static_cast<char*>(mem->peer(p)) + me * bytes);
  uint4** d_dst = nullptr;
  cuda_ok(cudaMalloc(&d_dst, sizeof(uint4*) * R), "nvlink_copy_ceiling");
  cuda_ok(cudaMemcpy(d_dst, dst.data(), sizeof(uint4*) * R, cudaMemcpyHostToDevice),
          "nvlink_copy_ceiling");
  cudaStream_t s;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "nvlink_copy_ceiling");
  auto body = [&] {
    push_kernel<<<std::max(1, num_sms), 512, 0, s>>>(static_cast<const uint4*>(src), d_dst, R, me,
                                                     bytes / 16);
  };
  Timing t = time_on_device(group, s, warmup, iters, body, method);
  cuda_ok(cudaGetLastError(), "nvlink_copy_ceiling");
  cudaStreamDestroy(s);
  cudaFree(d_dst);
  cudaFree(src);
  group.transport()->barrier("nvlink_copy_ceiling");  // no peer still writes into `mem`
  return t;
}

}  // namespace epx::bench
