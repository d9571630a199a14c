// src/core/quant.cc — dispatch quantisation and topk-id narrowing (formats in quant.h): output
// allocation and validation for both devices, the host loops for cpu tensors, and the hand-off
// to the kernels of src/cuda/quant.cu (core/quant_cuda.h) for cuda tensors.
//
//   quantize_fp8    x [T, H] bf16 -> values fp8 [T, H], scales f32 [T, H/128] row-major, or
//                   UE8M0 int32 words: column-major storage [ceil(H/512), align4(T)] (view
//                   [T, words], strides {1, align4(T)}) or row-major [T, words]; every storage
//                   byte is written (padding 0)
//   ue8m0_to_column_major  UE8M0 words [N, W] (row-major as ht receives them) -> the
//                   column-major storage [W, align4(N)] above, padding tokens 0
//   quantize_nvfp4  x [T, H] bf16 -> values u8 [T, H/2], scales u8 [T, H/16]
//   narrow_topk_idx topk_idx [T, K] int64/int32 -> int32 [T, K] contiguous
//   nvfp4_block_scale_interleave (public, epx/nvfp4.h)  scales [B, rows, cols] -> the flat
//                   128 x 4 tiled layout; every output element is computed from its own offset
//                   (nvfp4_sf_coords), so the padding is written 0 in the same pass
#include "core/quant.h"

#include <cstring>
#include <vector>

#include "core/check.h"
#include "core/quant_cuda.h"
#include "epx/nvfp4.h"

namespace epx::detail {

static void check_quant_input(const TensorView& x, int64_t multiple, const char* op) {
  check_defined(x, op, "x");
  check_dtype(x, op, "x", {DType::kBF16});
  check_shape(x, op, "x", {-1, -1});
  check_inner_contiguous(x, op, "x");
  EPX_CHECK_ARG(x.shape[1] % multiple == 0, op, ": argument 'x' has hidden size ", x.shape[1],
                ", expected a multiple of ", multiple);
}

Tensor alloc_ue8m0_column_major(const Allocator& alloc, int64_t num_tokens, int64_t num_words,
                                const Device& device) {
  const int64_t padded = ue8m0_tma_aligned_tokens(num_tokens);
  Tensor t = alloc(DType::kI32, {num_words, padded}, device);
  t.shape = {num_tokens, num_words};
  t.strides = {1, padded};
  return t;
}

QuantizedTensor quantize_fp8(const TensorView& x, bool ue8m0, const Allocator& alloc, Stream stream,
                             Ue8m0Layout ue8m0_layout) {
  check_quant_input(x, kQuantGroup, "quantize_fp8");
  const int64_t T = x.shape[0], H = x.shape[1], G = H / kQuantGroup;
  const bool rows = ue8m0_layout == Ue8m0Layout::kRowMajor;
  QuantizedTensor out;
  out.values = alloc(DType::kF8E4M3, {T, H}, x.device);
  int64_t num_scale_tokens = T;  // token columns of the UE8M0 storage (padding included)
  if (!ue8m0) {
    out.scales = alloc(DType::kF32, {T, G}, x.device);
  } else if (rows) {
    out.scales = alloc(DType::kI32, {T, (G + 3) / 4}, x.device);
  } else {
    out.scales = alloc_ue8m0_column_major(alloc, T, (G + 3) / 4, x.device);
    num_scale_tokens = ue8m0_tma_aligned_tokens(T);
  }
  if (x.device.type == DeviceType::kCuda) {
    cuda_quantize_fp8(x, ue8m0, out.values, out.scales, num_scale_tokens, stream);
    return out;
  }
  if (ue8m0) {
    // Every storage byte is defined: padding tokens and unused group bytes are 0.
    const size_t storage_bytes = static_cast<size_t>((G + 3) / 4 * num_scale_tokens) * 4;
    if (storage_bytes > 0) std::memset(out.scales.data, 0, storage_bytes);
  }
  std::vector<float> scales(static_cast<size_t>(G));
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = x.ptr<uint16_t>() + t * x.strides[0];
    quantize_row_fp8(row, H, /*round_scale=*/ue8m0,
                     out.values.ptr<uint8_t>() + t * H, scales.data());
    if (!ue8m0) {
      std::memcpy(out.scales.ptr<float>() + t * G, scales.data(), G * sizeof(float));
    } else {
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* word =
            reinterpret_cast<uint8_t*>(out.scales.ptr<int32_t>() + t * out.scales.strides[0] +
                                       (g / 4) * out.scales.strides[1]);
        word[g % 4] = ue8m0_of_scale(scales[g]);
      }
    }
  }
  return out;
}

Tensor ue8m0_to_column_major(const TensorView& words, const Allocator& alloc, Stream stream) {
  const char* op = "ue8m0_to_column_major";
  check_defined(words, op, "words");
  check_dtype(words, op, "words", {DType::kI32});
  check_shape(words, op, "words", {-1, -1});
  const int64_t N = words.shape[0], W = words.shape[1], padded = ue8m0_tma_aligned_tokens(N);
  Tensor out = alloc_ue8m0_column_major(alloc, N, W, words.device);
  if (words.device.type == DeviceType::kCuda) {
    cuda_ue8m0_to_column_major(words, out, stream);
    return out;
  }
  const int32_t* src = words.ptr<const int32_t>();
  int32_t* dst = out.ptr<int32_t>();
  for (int64_t w = 0; w < W; ++w)
    for (int64_t t = 0; t < padded; ++t)
      dst[w * padded + t] = t < N ? src[t * words.strides[0] + w * words.strides[1]] : 0;
  return out;
}

QuantizedTensor quantize_nvfp4(const TensorView& x, float global_scale, const Allocator& alloc,
                               Stream stream) {
  check_quant_input(x, kNvfp4Block, "quantize_nvfp4");
  EPX_CHECK_ARG(global_scale > 0.0f && global_scale < 3.0e38f,
                "quantize_nvfp4: argument 'global_scale' is ", global_scale,
                ", expected a finite value > 0");
  const int64_t T = x.shape[0], H = x.shape[1];
  QuantizedTensor out;
  out.values = alloc(DType::kU8, {T, H / 2}, x.device);
  out.scales = alloc(DType::kU8, {T, H / kNvfp4Block}, x.device);
  if (x.device.type == DeviceType::kCuda) {
    cuda_quantize_nvfp4(x, global_scale, out.values, out.scales, stream);
    return out;
  }
  for (int64_t t = 0; t < T; ++t) {
    quantize_row_nvfp4(x.ptr<uint16_t>() + t * x.strides[0], H, global_scale,
                       out.values.ptr<uint8_t>() + t * (H / 2),
                       out.scales.ptr<uint8_t>() + t * (H / kNvfp4Block));
  }
  return out;
}

std::vector<int64_t> ll_nvfp4_x_storage(int64_t num_local_experts, int64_t rows_per_expert,
                                        int64_t hidden) {
  return {num_local_experts, rows_per_expert, hidden / 2};
}

std::vector<int64_t> ll_nvfp4_scale_storage(int64_t num_local_experts, int64_t rows_per_expert,
                                            int64_t hidden) {
  const int64_t row_tiles = nvfp4_sf_padded_rows(rows_per_expert) / kNvfp4SfTileRows;
  const int64_t col_tiles = hidden / (kNvfp4Block * kNvfp4SfTileCols);
  return {num_local_experts, row_tiles, col_tiles, 32, 4, 4};
}

void set_ll_nvfp4_views(Tensor& recv_x, Tensor& recv_scales) {
  const int64_t L = recv_x.shape[0], RT = recv_x.shape[1], half = recv_x.shape[2];
  recv_x.shape = {RT, half, L};
  recv_x.strides = {half, 1, RT * half};
  const int64_t rm = recv_scales.shape[1], rk = recv_scales.shape[2];
  recv_scales.shape = {32, 4, rm, 4, rk, L};
  recv_scales.strides = {16, 4, rk * 512, 1, 512, rm * rk * 512};
}

Tensor narrow_topk_idx(const TensorView& topk_idx, const Allocator& alloc, Stream stream) {
  const char* op = "narrow_topk_idx";
  check_defined(topk_idx, op, "topk_idx");
  check_dtype(topk_idx, op, "topk_idx", {DType::kI64, DType::kI32});
  check_shape(topk_idx, op, "topk_idx", {-1, -1});
  const int64_t T = topk_idx.shape[0], K = topk_idx.shape[1];
  Tensor out = alloc(DType::kI32, {T, K}, topk_idx.device);
  if (topk_idx.device.type == DeviceType::kCuda) {
    cuda_narrow_topk_idx(topk_idx, out, stream);
    return out;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t off = t * topk_idx.strides[0] + k * topk_idx.strides[1];
      out.ptr<int32_t>()[t * K + k] =
          narrow_expert_id(topk_idx.dtype == DType::kI64 ? topk_idx.ptr<int64_t>()[off]
                                                         : topk_idx.ptr<int32_t>()[off]);
    }
  return out;
}

}  // namespace epx::detail

namespace epx {

Tensor nvfp4_block_scale_interleave(const TensorView& sf, const Allocator& alloc, Stream stream) {
  using namespace detail;
  const char* op = "nvfp4_block_scale_interleave";
  check_defined(sf, op, "sf");
  EPX_CHECK_ARG(sf.ndim == 2 || sf.ndim == 3, op, ": argument 'sf' is ", sf.describe(),
                ", expected [rows, cols] or [batch, rows, cols]");
  check_dtype(sf, op, "sf", {DType::kU8, DType::kF8E4M3, DType::kBF16});
  Nvfp4InterleaveShape s;
  s.batch = sf.ndim == 3 ? sf.shape[0] : 1;
  s.rows = sf.size(-2);
  s.cols = sf.size(-1);
  s.stride_batch = sf.ndim == 3 ? sf.strides[0] : 0;
  s.stride_row = sf.stride(-2);
  s.stride_col = sf.stride(-1);
  s.padded_cols = nvfp4_sf_padded_cols(s.cols);
  s.per_batch = nvfp4_sf_padded_rows(s.rows) * s.padded_cols;
  Tensor out = (alloc ? alloc : default_allocator())(sf.dtype, {s.batch * s.per_batch}, sf.device);
  if (sf.device.type == DeviceType::kCuda) {
    cuda_nvfp4_block_scale_interleave(sf, s, out, stream);
    return out;
  }
  const size_t elem = dtype_size(sf.dtype);
  const auto* src = static_cast<const char*>(sf.data);
  auto* dst = static_cast<char*>(out.data);
  for (int64_t o = 0; o < s.batch * s.per_batch; ++o) {
    const int64_t b = o / s.per_batch;
    int64_t r = 0, c = 0;
    nvfp4_sf_coords(o % s.per_batch, s.padded_cols, &r, &c);
    if (r < s.rows && c < s.cols)
      std::memcpy(dst + o * elem,
                  src + (b * s.stride_batch + r * s.stride_row + c * s.stride_col) * elem, elem);
    else
      std::memset(dst + o * elem, 0, elem);
  }
  return out;
}

}  // namespace epx
