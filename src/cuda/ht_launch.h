// src/cuda/ht_launch.h — launchers of the ht kernels, one translation unit per kernel family
// (ht_notify.cu, ht_dispatch.cu, ht_combine.cu) so they compile in parallel. `vec_bytes` picks
// the copy unit (16/8/4/2/1 bytes) the row addresses and strides allow.
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels/ht/ht_params.cuh"

namespace epx::detail {

void launch_ht_notify(const HtNotifyParams& p, cudaStream_t stream);
void launch_ht_dispatch(const HtDispatchParams& p, int vec_bytes, int grid, cudaStream_t stream);
// The ht dispatch kernel, for pdl_usable (cuda/launch.h) in host code that cannot name it.
const void* ht_dispatch_kernel_address();
// The copy-engine combine's wait-ready / arrive steps around its copies (HtEngineSyncParams).
void launch_ht_engine_sync(const HtEngineSyncParams& p, cudaStream_t stream);
void launch_ht_combine(const HtCombineParams& p, int vec_bytes, int grid, cudaStream_t stream);
// The same kernels with out float32 and the sums unrounded (the hierarchical ht's node-local
// partials, CudaHt::combine_partial); separate instantiations, so the bf16 ones stay as they are.
void launch_ht_combine_f32(const HtCombineParams& p, int vec_bytes, int grid,
                           cudaStream_t stream);
// The zero-copy combine's staged reducer (kernels/ht/combine_staged.cuh): true when this device
// runs it with `stages` x `chunk` (sm_90+, enough shared memory; the kernel's limit is raised);
// InvalidArgument for a staging outside 2..8 x multiples of 512 in [512, 16384].
bool prepare_ht_combine_staged(int stages, int chunk);
// Launches it with p.pull_stages x p.pull_chunk (after prepare_ht_combine_staged said true).
void launch_ht_combine_staged(const HtCombineParams& p, int grid, cudaStream_t stream);

}  // namespace epx::detail
