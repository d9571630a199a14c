// src/cuda/nccl_device_ops.cu — device side of the NCCL transport
// (src/transport/nccl_device_ops.h).
//
// lsa_pointers_kernel: thread p writes ncclGetLsaPointer(window, 0, p) to out[p]; run once per
//   window, so kernels later use plain peer pointers (no window lookups in hot loops).
// device_barrier_kernel: thread p (p != rank, p a member) stores epoch into rank p's
//   slots.arrive[rank] (release), then waits until the local slots.arrive[p] reaches epoch
//   (acquire), bounded by the timeout; it reports per peer 0 arrived (or not a member) / 1 timed
//   out / 2 aborted into mapped host memory.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "cuda/cuda_check.h"
#include "cuda/kernels/sync.cuh"
#include "transport/nccl_device_ops.h"

namespace epx::detail {

namespace {

__global__ void lsa_pointers_kernel(ncclWindow_t window, int num_ranks, void** out) {
  const int p = threadIdx.x;
  if (p < num_ranks) out[p] = ncclGetLsaPointer(window, 0, p);
}

__global__ void device_barrier_kernel(DeviceBarrierArgs args) {
  const int p = threadIdx.x;
  if (p >= args.size || p == args.rank) return;
  if (!((args.members >> p) & 1u) && !args.abort) {
    args.status[p] = 0;
    return;
  }
  uint32_t* arrive_there = &args.peers[p]->arrive[args.rank];
  uint32_t* abort_there = &args.peers[p]->aborted[args.rank];
  if (args.abort) {
    st_release_sys(abort_there, 1u);  // read below by rank p's barrier (aborted[rank])
    args.status[p] = 0;
    return;
  }
  // Pairs with the acquire loads of arrive[rank] in rank p's barrier.
  st_release_sys(arrive_there, args.epoch);
  const uint32_t* arrive_here = &args.local->arrive[p];
  const uint32_t* abort_here = &args.local->aborted[p];
  const uint64_t start = globaltimer_ns();
  int32_t result = 1;
  while (true) {
    if (seq_reached(ld_acquire_sys(arrive_here), args.epoch)) {
      result = 0;
      break;
    }
    if (ld_acquire_sys(abort_here) != 0u) {
      result = 2;
      break;
    }
    if (globaltimer_ns() - start > args.timeout_ns) break;
  }
  args.status[p] = result;
  __threadfence_system();
}

}  // namespace

void nccl_lsa_pointers(void* window, int num_ranks, void* stream, std::vector<void*>& out) {
  auto s = static_cast<cudaStream_t>(stream);
  void** d_out = nullptr;
  EPX_CUDA_CHECK(cudaMallocAsync(&d_out, sizeof(void*) * num_ranks, s), "nccl transport");
  lsa_pointers_kernel<<<1, 64, 0, s>>>(static_cast<ncclWindow_t>(window), num_ranks, d_out);
  EPX_CUDA_CHECK(cudaGetLastError(), "nccl transport: LSA pointer kernel");
  out.assign(num_ranks, nullptr);
  EPX_CUDA_CHECK(
      cudaMemcpyAsync(out.data(), d_out, sizeof(void*) * num_ranks, cudaMemcpyDeviceToHost, s),
      "nccl transport");
  EPX_CUDA_CHECK(cudaFreeAsync(d_out, s), "nccl transport");
  EPX_CUDA_CHECK(cudaStreamSynchronize(s), "nccl transport: LSA pointers");
}

void launch_device_barrier(const DeviceBarrierArgs& args, void* stream) {
  device_barrier_kernel<<<1, kMaxRanks, 0, static_cast<cudaStream_t>(stream)>>>(args);
  EPX_CUDA_CHECK(cudaGetLastError(), "barrier: kernel launch");
}

}  // namespace epx::detail
