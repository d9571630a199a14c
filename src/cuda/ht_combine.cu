// src/cuda/ht_combine.cu — instantiations and launch of the ht combine kernels (bf16 rows: the
// copy unit is at least 2 bytes), and the copy-engine combine's one-warp sync steps.
#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/combine.cuh"
#include "cuda/kernels/ht/combine_staged.cuh"
#include "cuda/launch.h"

namespace epx::detail {

namespace {

// The staged reducer: sm_90+, built for it (below, the bulk-copy instructions compile to a trap),
// and the staging's shared memory.
DynSmemKernel g_staged_kernel(reinterpret_cast<const void*>(ht_combine_staged_kernel));

// One warp: lane q < R (q != rank) handles peer q. The op is the combine about to run: the
// kEngineWaitReady step that precedes the kernel reads it (state->seq + 1) and notes it in
// state->engine_op; the arrive steps run beside the kernel, which advances state->seq when it
// ends, so they read engine_op. After an earlier failed wait (abort set) nothing is signalled:
// the error is already recorded and the host raises it.
__global__ void ht_engine_sync_kernel(HtEngineSyncParams p) {
  const int q = threadIdx.x, me = p.rank;
  if (*reinterpret_cast<volatile uint32_t*>(&p.wait.state->abort)) return;
  volatile uint32_t* state_seq = &p.wait.state->seq;
  volatile uint32_t* engine_op = &p.wait.state->engine_op;
  uint32_t seq;
  if (p.step == kEngineWaitReady) {
    seq = *state_seq + 1;
    if (q == 0) *engine_op = seq;
  } else {
    seq = *engine_op;
  }
  if (p.step == kEngineWaitReady && q == 0) publish_deferred_ready(p.symm, p.wait, p.num_ranks);
  __syncwarp();
  if (q >= p.num_ranks || q == me) return;
  const HtRegion& g = p.symm.region;
  if (p.step == kEngineWaitReady) {
    wait_flag<true>(g.ready(p.symm.local) + q, seq - 1, p.wait, kWaitReady, q);  // op seq - 1
    return;
  }
  // kEngineArrive. The copies before this kernel on the stream are complete (stream order); the
  // fence makes them visible system-wide before the flag.
  const uint32_t value = seq * static_cast<uint32_t>(kHtEngineChunks) + p.chunk;
  __threadfence_system();
  st_release_sys(g.arrived(p.symm.peers[q]) + me, value);  // the chunk's rows are in q's slot
}

}  // namespace

void launch_ht_engine_sync(const HtEngineSyncParams& p, cudaStream_t stream) {
  ht_engine_sync_kernel<<<1, 32, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine: engine sync launch");
}

bool prepare_ht_combine_staged(int stages, int chunk) {
  EPX_CHECK(stages >= 2 && stages <= 8 && chunk >= 512 && chunk <= 16384 && chunk % 512 == 0,
            ErrorCode::kInvalidArgument, "ht_combine: staged reducer with ", stages, " x ", chunk,
            " bytes; expected 2..8 stages of a multiple of 512 bytes in [512, 16384]");
  const DynSmemFacts d = g_staged_kernel.facts("ht_combine");
  const int smem = pull_smem_bytes(stages, chunk);
  if (!d.hopper() || smem + d.static_smem > d.optin) return false;  // registers
  g_staged_kernel.allow(smem, "ht_combine");
  return true;
}

void launch_ht_combine_staged(const HtCombineParams& p, int grid, cudaStream_t stream) {
  launch_kernel(ht_combine_staged_kernel, grid, kHtThreads,
                pull_smem_bytes(p.pull_stages, p.pull_chunk), stream, p.pdl, "ht_combine: launch",
                p);
}

namespace {

// The kernel of the copy unit and the reducers' step; kOutF32: float32 out (ht_launch.h).
template <bool kOutF32>
void launch_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      if (p.num_ranks + (p.bias0 ? 1 : 0) + (p.bias1 ? 1 : 0) <= 2) {
        // Every token has <= 2 row sources.
        launch_kernel(ht_combine_kernel<uint4, kStepPair, kOutF32>, grid, kHtThreads, 0, stream,
                      p.pdl, "ht_combine: launch", p);
      } else {
        launch_kernel(ht_combine_kernel<uint4, kStepWide, kOutF32>, grid, kHtThreads, 0, stream,
                      p.pdl, "ht_combine: launch", p);
      }
      break;
    case 8:
      launch_kernel(ht_combine_kernel<uint2, kStepNarrow, kOutF32>, grid, kHtThreads, 0, stream,
                    p.pdl, "ht_combine: launch", p);
      break;
    case 4:
      launch_kernel(ht_combine_kernel<uint32_t, kStepNarrow, kOutF32>, grid, kHtThreads, 0,
                    stream, p.pdl, "ht_combine: launch", p);
      break;
    default:
      launch_kernel(ht_combine_kernel<uint16_t, kStepNarrow, kOutF32>, grid, kHtThreads, 0,
                    stream, p.pdl, "ht_combine: launch", p);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_combine: launch");
}

}  // namespace

void launch_ht_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream) {
  launch_combine<false>(p, vec_bytes, grid, stream);
}

void launch_ht_combine_f32(const HtCombineParams& p, int vec_bytes, int grid,
                           cudaStream_t stream) {
  launch_combine<true>(p, vec_bytes, grid, stream);
}

}  // namespace epx::detail
