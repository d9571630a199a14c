// src/core/quant.h — dispatch quantisation for the expert GEMMs (docs/semantics.md §7), one
// definition for the cpu backend and the cuda kernels.
//
// fp8 (per token, per 128 channels): src/core/numeric.h's formula. Scales are float32 [T, H/128]
// row-major, or with UE8M0 int32 [T, ceil(H/512)] (4 exponent bytes per int, group g in byte g%4
// of int g/4) stored column-major (MN-major) with the token dimension padded to a multiple of 4
// (16 bytes, the TMA alignment grouped-GEMM kernels need, DeepGEMM's get_tma_aligned_size(T, 4)):
// storage [ceil(H/512), align4(T)], view [T, ceil(H/512)] with strides {1, align4(T)}, word
// (t, w) at int offset t + w * align4(T). Padding tokens t in [T, align4(T)) and the bytes of
// groups >= H/128 in the last word are 0.
//
// NVFP4 (per token, per 16 values), with a float32 global scale g (engines pass 448*6/amax):
//   sf   = e4m3( (amax_16 / 6.0f) * g )            block scale, fp8 e4m3 byte
//   inv  = f32(sf) == 0 ? 0 : g / f32(sf)
//   q_i  = e2m1( x_i * inv )                        round-to-nearest-even, saturating at 6
//   dequant: x_i ~= e2m1_value(q_i) * f32(sf) / g
//   Values packed two per byte, element 2j in the low nibble. Output: values u8 [T, H/2],
//   scales u8 [T, H/16] (row-major).
//
// Devices: cpu tensors are quantised on the calling thread (quant.cc); cuda tensors by the
// kernels of src/cuda/quant.cu on the given stream (asynchronous; Unsupported in a build without
// CUDA). Both use the EPX_HD functions here and in numeric.h, so their bytes are identical.
#pragma once

#include <cstdint>
#include <limits>

#include "core/numeric.h"
#include "epx/tensor.h"

namespace epx::detail {

inline constexpr int kNvfp4Block = 16;

// e2m1 code (sign in bit 3) of x, round-to-nearest-even on {0, .5, 1, 1.5, 2, 3, 4, 6};
// NaN -> 0.
EPX_HD uint8_t f32_to_e2m1(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  const float a = bits_f32(u & 0x7FFFFFFFu);
  uint8_t m;
  if (!(a == a)) return 0;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;
  return sign | m;
}

EPX_HD float e2m1_to_f32(uint8_t code) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = mags[code & 7];
  return (code & 8) ? -v : v;
}

// One token row of `hidden` bf16 values (hidden % 16 == 0).
inline void quantize_row_nvfp4(const uint16_t* x, int64_t hidden, float global_scale,
                               uint8_t* q, uint8_t* scales) {
  for (int64_t b = 0; b < hidden / kNvfp4Block; ++b) {
    const float amax = amax_bf16(x + b * kNvfp4Block, kNvfp4Block);
    const uint8_t sf = f32_to_fp8_e4m3((amax / 6.0f) * global_scale);
    const float sf_f = fp8_e4m3_to_f32(sf);
    const float inv = sf_f == 0.0f ? 0.0f : global_scale / sf_f;
    for (int i = 0; i < kNvfp4Block; i += 2) {
      const uint8_t lo = f32_to_e2m1(bf16_to_f32(x[b * kNvfp4Block + i]) * inv);
      const uint8_t hi = f32_to_e2m1(bf16_to_f32(x[b * kNvfp4Block + i + 1]) * inv);
      q[(b * kNvfp4Block + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
    scales[b] = sf;
  }
}

// An expert id narrowed to int32 (the a2a routing input): ids outside int32 become INT32_MIN,
// which is < -1 and so reported as an out-of-range id instead of aliasing a valid expert.
EPX_HD int32_t narrow_expert_id(int64_t id) {
  return (id < INT32_MIN || id > INT32_MAX) ? INT32_MIN : static_cast<int32_t>(id);
}

struct QuantizedTensor {
  Tensor values;  // fp8 [T, H] or u8 [T, H/2]
  Tensor scales;  // see the layouts above
};

// Where UE8M0 scale words go: the column-major, TMA-aligned layout above (what grouped-GEMM
// kernels read), or plain row-major int32 [T, ceil(H/512)] (one contiguous row per token, what
// a per-token payload moves).
enum class Ue8m0Layout { kColumnMajor, kRowMajor };

// Tokens of the column-major UE8M0 storage: n rounded up to the TMA alignment (16 bytes = 4
// int32 words).
EPX_HD int64_t ue8m0_tma_aligned_tokens(int64_t n) {
  return (n + 3) / 4 * 4;
}

// An uninitialised column-major, TMA-aligned UE8M0 scale tensor for `num_tokens` tokens of
// `num_words` words from `alloc` on `device`: storage int32 [num_words, align4(num_tokens)],
// view [num_tokens, num_words] with strides {1, align4(num_tokens)}.
Tensor alloc_ue8m0_column_major(const Allocator& alloc, int64_t num_tokens, int64_t num_words,
                                const Device& device);

// x [T, H] bf16 (innermost stride 1). Outputs come from `alloc` on x's device. `stream` is used
// for cuda tensors only (the kernels are queued on it; no host synchronisation).
QuantizedTensor quantize_fp8(const TensorView& x, bool ue8m0, const Allocator& alloc,
                             Stream stream = nullptr,
                             Ue8m0Layout ue8m0_layout = Ue8m0Layout::kColumnMajor);
QuantizedTensor quantize_nvfp4(const TensorView& x, float global_scale, const Allocator& alloc,
                               Stream stream = nullptr);

// Row-major UE8M0 words (int32 [N, W], any strides: what ht_dispatch receives) -> the same words
// in the column-major, TMA-aligned layout above (alloc_ue8m0_column_major(alloc, N, W)); padding
// tokens are 0. cuda tensors: one kernel queued on `stream` (no host synchronisation, graph-safe).
Tensor ue8m0_to_column_major(const TensorView& words, const Allocator& alloc,
                             Stream stream = nullptr);

// topk_idx [T, K] int64 or int32 (any strides) -> contiguous int32 [T, K] on the same device,
// each id through narrow_expert_id.
Tensor narrow_topk_idx(const TensorView& topk_idx, const Allocator& alloc, Stream stream = nullptr);

}  // namespace epx::detail
