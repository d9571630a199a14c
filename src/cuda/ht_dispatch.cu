// src/cuda/ht_dispatch.cu — instantiations and launch of the ht dispatch kernel.
#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/dyn_smem.h"
#include "cuda/ht_launch.h"
#include "cuda/kernels/ht/dispatch.cuh"
#include "cuda/launch.h"

namespace epx::detail {

namespace {

// kBulk launches: the device must be sm_90+ and allow the ring's dynamic shared memory.
DynSmemKernel g_bulk_kernel(reinterpret_cast<const void*>(ht_dispatch_kernel<uint4, true>));

void prepare_bulk(const HtDispatchParams& p, int smem) {
  const DynSmemFacts d = g_bulk_kernel.facts("ht_dispatch");
  EPX_CHECK(d.sm_major >= 9, ErrorCode::kUnsupported,
            "ht_dispatch: bulk copies (EPX_HT_COPY=bulk) need compute capability 9.0+, device ",
            d.device, " has ", d.sm_major, ".x");
  EPX_CHECK(smem + d.static_smem <= d.optin, ErrorCode::kInvalidArgument,
            "ht_dispatch: bulk copies with ", p.bulk_stages, " x ", p.bulk_chunk,
            " bytes per warp need ", smem, " bytes of shared memory per CTA (+", d.static_smem,
            " static); device ", d.device, " allows ", d.optin);
  g_bulk_kernel.allow(smem, "ht_dispatch");
}

// One warp: lane q < R (q != rank) handles peer q. seq is the op: for dispatch the one its kernel
// just finished (it advanced state->seq); for combine (seq_ahead) the one about to run, noted in
// state->engine_op by the kEngineWaitReady step that precedes the kernel — the later steps run
// beside the kernel, which advances state->seq when it ends, so they must not read it. After an
// earlier failed wait (abort set) nothing is signalled: the error is already recorded and the
// host raises it.
__global__ void ht_engine_sync_kernel(HtEngineSyncParams p) {
  const int q = threadIdx.x, me = p.rank;
  if (*reinterpret_cast<volatile uint32_t*>(&p.wait.state->abort)) return;
  volatile uint32_t* state_seq = &p.wait.state->seq;
  volatile uint32_t* engine_op = &p.wait.state->engine_op;
  uint32_t seq = *state_seq;
  if (p.seq_ahead) {
    if (p.step == kEngineWaitReady) {
      seq += 1;
      if (q == 0) *engine_op = seq;
    } else {
      seq = *engine_op;
    }
  }
  if (p.step == kEngineWaitReady && q == 0) publish_deferred_ready(p.symm, p.wait, p.num_ranks);
  __syncwarp();
  if (q >= p.num_ranks || q == me) return;
  const HtRegion& g = p.symm.region;
  if (p.step == kEngineWaitReady) {
    wait_flag<true>(g.ready(p.symm.local) + q, seq - 1, p.wait, kWaitReady, q);  // op seq - 1
    return;
  }
  const uint32_t value = seq * static_cast<uint32_t>(kHtEngineChunks) + p.chunk;
  if (p.step == kEngineWait) {
    wait_flag<true>(g.arrived(p.symm.local) + q, value, p.wait, kWaitRows, q);
    return;
  }
  // The copies before this kernel on the stream are complete (stream order); the fence makes
  // them visible system-wide before the flag.
  __threadfence_system();
  if (p.step == kEngineReady) {
    st_release_sys(g.ready(p.symm.peers[q]) + me, seq);  // our slots are free again
  } else {
    st_release_sys(g.arrived(p.symm.peers[q]) + me, value);  // the chunk's rows are in q's slot
  }
}

}  // namespace

const void* ht_dispatch_kernel_address() {
  return reinterpret_cast<const void*>(ht_dispatch_kernel<uint4, false>);
}

void launch_ht_engine_sync(const HtEngineSyncParams& p, cudaStream_t stream) {
  ht_engine_sync_kernel<<<1, 32, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), "ht_dispatch: engine sync launch");
}

void launch_ht_dispatch(const HtDispatchParams& p, int vec_bytes, int grid, cudaStream_t stream,
                        int launch_pdl) {
  const bool pdl = launch_pdl < 0 ? p.pdl != 0 : launch_pdl != 0;
  if (p.copy_mode == static_cast<int>(HtCopyMode::kBulk) && vec_bytes == 16) {
    const int smem = bulk_smem_bytes(p.bulk_stages, p.bulk_chunk);
    prepare_bulk(p, smem);
    launch_kernel(ht_dispatch_kernel<uint4, true>, grid, kHtThreads, smem, stream, pdl,
                  "ht_dispatch: launch", p);
    return;
  }
  switch (vec_bytes) {
    case 16:
      launch_kernel(ht_dispatch_kernel<uint4, false>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 8:
      launch_kernel(ht_dispatch_kernel<uint2, false>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 4:
      launch_kernel(ht_dispatch_kernel<uint32_t, false>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    case 2:
      launch_kernel(ht_dispatch_kernel<uint16_t, false>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
    default:
      launch_kernel(ht_dispatch_kernel<uint8_t, false>, grid, kHtThreads, 0, stream, pdl,
                    "ht_dispatch: launch", p);
      break;
  }
  // (launch_kernel checked the launch itself; no cudaGetLastError here, which could report an
  // earlier call's error after this kernel was queued — the split dispatch's drain relies on a
  // throw meaning "not launched".)
}

}  // namespace epx::detail
