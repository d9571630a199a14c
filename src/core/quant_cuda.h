// src/core/quant_cuda.h — host entry points of the dispatch-quantisation and expert-load kernels
// (src/cuda/quant.cu), callable from core code without CUDA headers. In a build without CUDA
// they are stubs that throw Unsupported (src/core/cuda_stub.cc).
//
// Every call validates nothing beyond what its caller (quant.cc, expert_load.cc) has checked,
// makes the tensors' device current for the launch, queues its kernel on `stream` (a
// cudaStream_t as void*, nullptr = the legacy default stream) and returns without waiting,
// except cuda_expert_load_read and cuda_expert_load_zero(wait), which synchronise `stream`.
#pragma once

#include <cstdint>
#include <vector>

#include "core/quant.h"
#include "epx/tensor.h"

namespace epx::detail {

// x [T, H] bf16 (row stride any, innermost 1), H % 128 == 0. values: fp8 [T, H] contiguous.
// scales: f32 [T, H/128] contiguous, or with `ue8m0` int32 words at
//   scales.data + t * scales.strides[0] + w * scales.strides[1],  w < ceil(H/512),
// for t < num_scale_tokens (>= T): token columns t >= T and the bytes of groups >= H/128 in the
// last word are written as 0, so every byte of the storage is defined.
void cuda_quantize_fp8(const TensorView& x, bool ue8m0, const TensorView& values,
                       const TensorView& scales, int64_t num_scale_tokens, Stream stream);

// words int32 [N, W] (any strides) -> out, the column-major storage int32 [W, S] with
// S = out.strides[1] >= N (quant.h's alloc_ue8m0_column_major): out[w * S + t] = words[t][w] for
// t < N, 0 for t in [N, S).
void cuda_ue8m0_to_column_major(const TensorView& words, const TensorView& out, Stream stream);

// x [T, H] bf16, H % 16 == 0. values u8 [T, H/2], scales u8 [T, H/16], both contiguous.
void cuda_quantize_nvfp4(const TensorView& x, float global_scale, const TensorView& values,
                         const TensorView& scales, Stream stream);

// sf [B, rows, cols] (2-D: B = 1) of one- or two-byte elements, described by `shape` (strides in
// elements) -> out, B * shape.per_batch contiguous elements: out[b * per_batch + o] = the scale
// nvfp4_sf_coords(o) names, or 0 in the padding.
void cuda_nvfp4_block_scale_interleave(const TensorView& sf, const Nvfp4InterleaveShape& shape,
                                       const TensorView& out, Stream stream);

// topk_idx [T, K] int64/int32 (any strides) -> out int32 [T, K] contiguous (narrow_expert_id).
void cuda_narrow_topk_idx(const TensorView& topk_idx, const TensorView& out, Stream stream);

// Expert load: `load` is a device int64 [L] (contiguous) that the calls below add to.
// (a) ids [rows, K] int64/int32 local expert ids or -1 (ht recv_topk_idx): per row, each distinct
//     id in [0, L) adds 1.
void cuda_expert_load_add_local_ids(const TensorView& ids, const TensorView& load, Stream stream);
// (b) ids [R, M, K] int32 global expert ids, padding rows -1 (a2a received expert ids); id is
//     local when id >= 0 and id / L == rank, as local expert id % L; per row, each distinct local
//     expert adds 1. With `counts` (int32 [R], optional) rows j >= counts[s] of source s are
//     skipped, as the cpu path does.
void cuda_expert_load_add_global_ids(const TensorView& ids, const TensorView& counts, int rank,
                                     const TensorView& load, Stream stream);
// (c) counts int32 [L] (ll recv_count): load[l] += counts[l].
void cuda_expert_load_add_counts(const TensorView& counts, const TensorView& load, Stream stream);
// load[:] = 0 (queued on `stream`; with `wait`, also synchronises `stream`).
void cuda_expert_load_zero(const TensorView& load, Stream stream, bool wait = false);
// A host copy of load; synchronises `stream` (waits for every kernel queued on it).
std::vector<int64_t> cuda_expert_load_read(const TensorView& load, Stream stream);

}  // namespace epx::detail
