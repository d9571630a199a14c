// src/transport/cuda_shared_device_transport.cc — the cuda backend's one-GPU test mode
// (Group::cuda_shared_device): R ranks as threads of one process on one GPU, so the GPU tier runs
// at R = 4 and 8 before machines with that many GPUs are lent (issue 8). Kernels are untouched:
// they see the same SymmetricMemory (local/peer device pointers) as under the NCCL transport.
//
//   allocate(bytes)  each rank cudaMallocs and zero-fills its own block (on its thread's
//                    per-thread stream, waited for), the blocks are exchanged through the shared
//                    host world (make_thread_transport): peer(p) is rank p's block on the same
//                    device, no NCCL, no LSA window. The last rank to drop a block cudaFrees it.
//   barrier / abort  on the host, exactly the cpu backend's (bounded by the group timeout,
//                    Timeout names the missing ranks; subsets and resync work too).
//   nccl_comm_of     nullptr (no communicator: NCCL baselines are unavailable in this mode).
//
// Co-residency (why num_sms is resolved here): every device-side wait (flags, counters) spins
// until a peer's kernel writes, so the kernels of all R ranks must run at the same time. Each
// rank runs one op at a time (its ops are ordered on its stream) with at most max(2, num_sms)
// CTAs (ht: tuning.num_sms, at least 2; ll: resolve_ll_ctas <= num_sms; a2a: num_sms), and the
// ht/ll kernels are __launch_bounds__(512, 1) (count one CTA per SM). So we require
// R * max(2, num_sms) <= SMs and resolve auto num_sms to SMs / R (132 / 8 = 16 on an H200).
// Streams beyond CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default
// 8) share a queue, and a rank's kernel queued behind a peer's spinning kernel would wait for it:
// a rank uses its own stream, the per-thread stream of its allocations and at most one side
// stream of its own (the test harness makes both of the rank's streams once per run), plus a
// Buffer's side streams only where EPX_ONE_GPU_SIDE_STREAMS=1 asks for them (core/env.h: the
// driver may still put one in a peer's queue), so we require at least min(32, 3R) connections
// (the one-GPU test harness sets 32 before CUDA starts).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/check.h"
#include "core/env.h"
#include "cuda/cuda_check.h"
#include "transport/transport.h"

namespace epx::detail {

namespace {

std::shared_ptr<void> device_block(size_t bytes, int device) {
  DeviceGuard guard(device);
  const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, rounded);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw_error(ErrorCode::kOutOfCapacity,
                cat("symmetric allocation (cuda_shared_device): cudaMalloc of ", rounded,
                    " bytes on cuda:", device, " failed: ", cudaGetErrorString(e)));
  }
  std::shared_ptr<void> block(p, [device](void* q) {
    int previous = 0;  // no throwing guard inside a deleter
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaFree(q);
    cudaSetDevice(previous);
  });
  // The per-thread stream: not ordered with the other ranks' streams, waited for here, so the
  // zeros land before the allocation barrier lets any peer write.
  EPX_CUDA_CHECK(cudaMemsetAsync(p, 0, rounded, cudaStreamPerThread), "symmetric allocation");
  EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread), "symmetric allocation");
  return block;
}

}  // namespace

std::shared_ptr<Transport> make_cuda_shared_device_transport(int rank, int size,
                                                             const std::string& world_name,
                                                             int cuda_device,
                                                             GroupOptions* options) {
  const char* what = "Group::cuda_shared_device";
  EPX_CHECK_ARG(size >= 1 && size <= kMaxRanks, what, ": argument 'size' is ", size,
                ", expected 1..", kMaxRanks);
  // The environment first (no CUDA call before these: they must hold when CUDA initialises).
  int connections = 0;
  try {
    connections = env_cuda_device_max_connections();
  } catch (const Error& e) {
    rethrow_with_op(e, what);
  }
  const int needed = std::min(32, 3 * size);
  EPX_CHECK_ARG(connections >= needed, what, ": CUDA_DEVICE_MAX_CONNECTIONS is ", connections,
                " but ", size, " ranks on one GPU need at least ", needed,
                " hardware queues (a rank's kernel queued behind a peer's spinning kernel would "
                "wait for it): set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA initialises");
  // Lazy loading (CUDA's default) loads a kernel at its first use, and a load may wait for the
  // kernels already running on the device: a peer's kernel spinning on this rank's next kernel
  // then holds that kernel back until the peer times out. Seen as the one-GPU R = 2 ht test's
  // timeouts, cured by EAGER (80deb94, 2026-11-30; docs/design.md §5).
  EPX_CHECK_ARG(env_cuda_module_loading() == "EAGER", what, ": CUDA_MODULE_LOADING is '",
                env_cuda_module_loading(), "' but ranks sharing one GPU need 'EAGER' (a lazily ",
                "loaded kernel's first launch waits for the peers' running kernels, which wait "
                "for it): set CUDA_MODULE_LOADING=EAGER before CUDA initialises");
  int num_devices = 0;
  EPX_CUDA_CHECK(cudaGetDeviceCount(&num_devices), what);
  EPX_CHECK_ARG(cuda_device >= 0 && cuda_device < num_devices, what, ": argument 'cuda_device' is ",
                cuda_device, ", expected 0..", num_devices - 1, " (", num_devices,
                " GPUs visible)");
  EPX_CUDA_CHECK(cudaSetDevice(cuda_device), what);  // binds this thread's device
  // The mode CUDA actually runs in (the variable counts only if set before CUDA initialised, e.g.
  // not when set after torch started): the driver's cuModuleGetLoadingMode, found through the
  // runtime (epx does not link the driver library). Where it cannot be asked, the variable's
  // check above stands.
  using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr ||
      reinterpret_cast<GetLoadingMode>(fn)(&mode) != CUDA_SUCCESS) {
    (void)cudaGetLastError();  // a failed query is not an error of ours
    mode = CU_MODULE_EAGER_LOADING;
  }
  EPX_CHECK_ARG(mode == CU_MODULE_EAGER_LOADING, what,
                ": CUDA runs with lazy kernel loading although CUDA_MODULE_LOADING is '",
                env_cuda_module_loading(),
                "' (set after CUDA initialised?); ranks sharing one GPU ",
                "need eager loading: set CUDA_MODULE_LOADING=EAGER before the process's first CUDA "
                "call");
  int sms = 0;
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cuda_device), what);
  if (options->num_sms <= 0) options->num_sms = std::max(1, sms / size);
  const int ctas = std::max(2, options->num_sms);
  EPX_CHECK_ARG(static_cast<int64_t>(size) * ctas <= sms, what, ": ", size, " ranks x up to ", ctas,
                " CTAs per launch (GroupOptions::num_sms = ", options->num_sms,
                ", ht launches at least 2) = ", size * ctas, " CTAs exceed the ", sms,
                " SMs of cuda:", cuda_device,
                "; all ranks' kernels must be co-resident for their flag waits to progress: set "
                "num_sms <= ",
                sms / size, " (or leave it 0 for SMs / ranks)");
  ThreadMemory memory;
  memory.backend = Backend::kCuda;
  memory.device = Device::cuda(cuda_device);
  memory.allocate = [cuda_device](size_t bytes) { return device_block(bytes, cuda_device); };
  return make_thread_transport(rank, size, world_name, options->timeout, std::move(memory), what);
}

}  // namespace epx::detail
