// src/cuda/quant.cu — host launchers of the dispatch-quantisation, topk-narrowing and
// expert-load kernels (src/core/quant_cuda.h; device code in kernels/quant/).
//
// Data flow: quant.cc / expert_load.cc validate and allocate -> these fill one params struct from
// the tensor views, make the tensors' device current and queue ONE kernel on the caller's stream
// (nothing when there is no work). No host synchronisation, except cuda_expert_load_read (a
// copy to the host followed by cudaStreamSynchronize of the given stream) and
// cuda_expert_load_zero(wait = true) (the counter's initial zeroing, outside any stream work).
//
// Layouts (see kernels/quant/quant.cuh for the index mapping):
//   fp8     x [T, H] bf16 -> values [T, H] e4m3; scales f32 [T, H/128], or UE8M0 int32 words at
//           t * strides[0] + w * strides[1] for t < S (column-major: [ceil(H/512), align4(T)])
//   ue8m0   words [N, W] int32 (any strides) -> column-major [W, align4(N)], padding tokens 0
//   nvfp4   x [T, H] bf16 -> values [T, H/2] u8, scales [T, H/16] u8
//   narrow  [T, K] int64/int32 -> [T, K] int32
//   interleave  NVFP4 scales [B, rows, cols] -> the flat 128 x 4 tiled layout (one thread per
//           output element, padding 0)
//   load    int64 [L] on the device, added to by the rows / counts kernels
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/quant_cuda.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels/quant/expert_load.cuh"
#include "cuda/kernels/quant/quant.cuh"

namespace epx::detail {

namespace {

cudaStream_t as_stream(Stream s) {
  return static_cast<cudaStream_t>(s);
}

int blocks_for(int64_t work, int per_block, int max_blocks) {
  return static_cast<int>(std::min<int64_t>((work + per_block - 1) / per_block, max_blocks));
}

bool aligned(const void* p, int64_t stride_bytes, int64_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0 && stride_bytes % alignment == 0;
}

void require_cuda(const TensorView& t, const char* op, const char* name) {
  EPX_CHECK_ARG(t.device.type == DeviceType::kCuda, op, ": argument '", name, "' is on ",
                t.device.str(), ", expected a cuda tensor");
}

void require_same_device(const TensorView& t, const Device& device, const char* op,
                         const char* name) {
  EPX_CHECK_ARG(t.device == device, op, ": argument '", name, "' is on ", t.device.str(),
                ", expected ", device.str(), " (the device of the input)");
}

}  // namespace

void cuda_quantize_fp8(const TensorView& x, bool ue8m0, const TensorView& values,
                       const TensorView& scales, int64_t num_scale_tokens, Stream stream) {
  const char* op = "quantize_fp8";
  require_cuda(x, op, "x");
  require_same_device(values, x.device, op, "values");
  require_same_device(scales, x.device, op, "scales");
  EPX_CHECK_ARG(reinterpret_cast<uintptr_t>(values.data) % 4 == 0, op,
                ": the allocator returned fp8 values at ", values.data,
                ", expected a 4-byte aligned (16 by contract) address");
  const int64_t T = x.shape[0], H = x.shape[1];
  Fp8QuantParams p{};
  p.x = x.ptr<const uint16_t>();
  p.x_stride = x.strides[0];
  p.num_tokens = T;
  p.num_scale_tokens = ue8m0 ? num_scale_tokens : T;
  p.num_groups = static_cast<int32_t>(H / kQuantGroup);
  p.num_words = (p.num_groups + 3) / 4;
  p.ue8m0 = ue8m0;
  p.x_vec8 = aligned(x.data, x.strides[0] * 2, 8);
  p.values = values.ptr<uint8_t>();
  if (ue8m0) {
    p.scales_ue8m0 = scales.ptr<int32_t>();
    p.scale_token_stride = scales.strides[0];
    p.scale_word_stride = scales.strides[1];
  } else {
    p.scales_f32 = scales.ptr<float>();
  }
  const int64_t num_units = p.num_scale_tokens * p.num_words;
  if (num_units == 0) return;
  DeviceGuard guard(x.device.index);
  constexpr int kWarps = QuantConfig::kFp8Threads / 32;
  fp8_quant_kernel<<<blocks_for(num_units, kWarps, QuantConfig::kMaxBlocks),
                     QuantConfig::kFp8Threads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

void cuda_ue8m0_to_column_major(const TensorView& words, const TensorView& out, Stream stream) {
  const char* op = "ue8m0_to_column_major";
  require_cuda(words, op, "words");
  require_same_device(out, words.device, op, "out");
  Ue8m0TransposeParams p{};
  p.words = words.ptr<const int32_t>();
  p.token_stride = words.strides[0];
  p.word_stride = words.strides[1];
  p.num_tokens = words.shape[0];
  p.num_padded_tokens = out.strides[1];
  p.num_words = words.shape[1];
  p.out = out.ptr<int32_t>();
  const int64_t n = p.num_words * p.num_padded_tokens;
  if (n == 0) return;
  DeviceGuard guard(words.device.index);
  ue8m0_transpose_kernel<<<blocks_for(n, QuantConfig::kTransposeThreads, QuantConfig::kMaxBlocks),
                           QuantConfig::kTransposeThreads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

void cuda_quantize_nvfp4(const TensorView& x, float global_scale, const TensorView& values,
                         const TensorView& scales, Stream stream) {
  const char* op = "quantize_nvfp4";
  require_cuda(x, op, "x");
  require_same_device(values, x.device, op, "values");
  require_same_device(scales, x.device, op, "scales");
  EPX_CHECK_ARG(reinterpret_cast<uintptr_t>(values.data) % 8 == 0, op,
                ": the allocator returned nvfp4 values at ", values.data,
                ", expected an 8-byte aligned (16 by contract) address");
  Nvfp4QuantParams p{};
  p.x = x.ptr<const uint16_t>();
  p.x_stride = x.strides[0];
  p.num_tokens = x.shape[0];
  p.num_blocks = x.shape[1] / kNvfp4Block;
  p.global_scale = global_scale;
  p.x_vec16 = aligned(x.data, x.strides[0] * 2, 16);
  p.values = values.ptr<uint8_t>();
  p.scales = scales.ptr<uint8_t>();
  const int64_t num_units = p.num_tokens * p.num_blocks;
  if (num_units == 0) return;
  DeviceGuard guard(x.device.index);
  nvfp4_quant_kernel<<<blocks_for(num_units, QuantConfig::kNvfp4Threads, QuantConfig::kMaxBlocks),
                       QuantConfig::kNvfp4Threads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

void cuda_nvfp4_block_scale_interleave(const TensorView& sf, const Nvfp4InterleaveShape& shape,
                                       const TensorView& out, Stream stream) {
  const char* op = "nvfp4_block_scale_interleave";
  require_cuda(sf, op, "sf");
  require_same_device(out, sf.device, op, "out");
  const int64_t n = shape.batch * shape.per_batch;
  if (n == 0) return;
  const Nvfp4InterleaveParams p{sf.data, shape, out.data};
  DeviceGuard guard(sf.device.index);
  const int blocks = blocks_for(n, QuantConfig::kInterleaveThreads, QuantConfig::kMaxBlocks);
  if (dtype_size(sf.dtype) == 1)
    nvfp4_interleave_kernel<uint8_t>
        <<<blocks, QuantConfig::kInterleaveThreads, 0, as_stream(stream)>>>(p);
  else
    nvfp4_interleave_kernel<uint16_t>
        <<<blocks, QuantConfig::kInterleaveThreads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

void cuda_narrow_topk_idx(const TensorView& topk_idx, const TensorView& out, Stream stream) {
  const char* op = "narrow_topk_idx";
  require_cuda(topk_idx, op, "topk_idx");
  require_same_device(out, topk_idx.device, op, "out");
  NarrowTopkParams p{};
  p.topk_idx = topk_idx.data;
  p.stride_t = topk_idx.strides[0];
  p.stride_k = topk_idx.strides[1];
  p.num_tokens = topk_idx.shape[0];
  p.top_k = static_cast<int32_t>(topk_idx.shape[1]);
  p.is_i64 = topk_idx.dtype == DType::kI64;
  p.out = out.ptr<int32_t>();
  const int64_t n = p.num_tokens * p.top_k;
  if (n == 0) return;
  DeviceGuard guard(topk_idx.device.index);
  narrow_topk_kernel<<<blocks_for(n, QuantConfig::kNarrowThreads, QuantConfig::kMaxBlocks),
                       QuantConfig::kNarrowThreads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

namespace {

void launch_expert_load_rows(ExpertLoadRowsParams p, const TensorView& load, Stream stream,
                             const char* op) {
  p.num_local_experts = static_cast<int32_t>(load.shape[0]);
  p.use_smem = p.num_local_experts <= ExpertLoadConfig::kMaxSmemExperts;
  p.load = reinterpret_cast<unsigned long long*>(load.data);
  const int64_t num_rows = p.num_sources * p.rows_per_source;
  if (num_rows == 0 || p.top_k == 0) return;
  DeviceGuard guard(load.device.index);
  const size_t smem = p.use_smem ? static_cast<size_t>(p.num_local_experts) * sizeof(int) : 0;
  expert_load_rows_kernel<<<blocks_for(num_rows, ExpertLoadConfig::kThreads,
                                       ExpertLoadConfig::kMaxBlocks),
                            ExpertLoadConfig::kThreads, smem, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

}  // namespace

void cuda_expert_load_add_local_ids(const TensorView& ids, const TensorView& load, Stream stream) {
  const char* op = "expert load (local ids)";
  require_cuda(ids, op, "ids");
  require_same_device(load, ids.device, op, "load");
  ExpertLoadRowsParams p{};
  p.ids = ids.data;
  p.source_stride = 0;
  p.row_stride = ids.strides[0];
  p.k_stride = ids.strides[1];
  p.num_sources = 1;
  p.rows_per_source = ids.shape[0];
  p.top_k = static_cast<int32_t>(ids.shape[1]);
  p.is_i64 = ids.dtype == DType::kI64;
  launch_expert_load_rows(p, load, stream, op);
}

void cuda_expert_load_add_global_ids(const TensorView& ids, const TensorView& counts, int rank,
                                     const TensorView& load, Stream stream) {
  const char* op = "expert load (global ids)";
  require_cuda(ids, op, "ids");
  require_same_device(load, ids.device, op, "load");
  ExpertLoadRowsParams p{};
  p.ids = ids.data;
  p.source_stride = ids.strides[0];
  p.row_stride = ids.strides[1];
  p.k_stride = ids.strides[2];
  p.num_sources = ids.shape[0];
  p.rows_per_source = ids.shape[1];
  if (counts.defined()) {
    require_same_device(counts, ids.device, op, "counts");
    EPX_CHECK_ARG(counts.is_contiguous(), op, ": argument 'counts' is ", counts.describe(),
                  ", expected contiguous");
    p.counts = counts.ptr<const int32_t>();
  }
  p.top_k = static_cast<int32_t>(ids.shape[2]);
  p.is_i64 = 0;
  p.global_ids = 1;
  p.rank = rank;
  launch_expert_load_rows(p, load, stream, op);
}

void cuda_expert_load_add_counts(const TensorView& counts, const TensorView& load, Stream stream) {
  const char* op = "expert load (counts)";
  require_cuda(counts, op, "counts");
  require_same_device(load, counts.device, op, "load");
  ExpertLoadCountsParams p{};
  p.counts = counts.ptr<const int32_t>();
  p.counts_stride = counts.strides[0];
  p.num_local_experts = static_cast<int32_t>(load.shape[0]);
  p.load = reinterpret_cast<unsigned long long*>(load.data);
  if (p.num_local_experts == 0) return;
  DeviceGuard guard(load.device.index);
  expert_load_counts_kernel<<<blocks_for(p.num_local_experts, ExpertLoadConfig::kThreads,
                                         ExpertLoadConfig::kMaxBlocks),
                              ExpertLoadConfig::kThreads, 0, as_stream(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), op);
}

void cuda_expert_load_zero(const TensorView& load, Stream stream, bool wait) {
  require_cuda(load, "expert load reset", "load");
  if (load.nbytes() == 0) return;
  DeviceGuard guard(load.device.index);
  EPX_CUDA_CHECK(cudaMemsetAsync(load.data, 0, load.nbytes(), as_stream(stream)),
                 "expert load reset");
  if (wait) EPX_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)), "expert load reset");
}

std::vector<int64_t> cuda_expert_load_read(const TensorView& load, Stream stream) {
  require_cuda(load, "expert load read", "load");
  std::vector<int64_t> out(static_cast<size_t>(load.numel()));
  if (out.empty()) return out;
  DeviceGuard guard(load.device.index);
  EPX_CUDA_CHECK(cudaMemcpyAsync(out.data(), load.data, load.nbytes(), cudaMemcpyDeviceToHost,
                                 as_stream(stream)),
                 "expert load read");
  EPX_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)), "expert load read");
  return out;
}

}  // namespace epx::detail
