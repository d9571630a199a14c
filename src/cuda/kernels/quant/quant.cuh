// src/cuda/kernels/quant/quant.cuh — dispatch quantisation on the device (the formats of
// src/core/quant.h, through its EPX_HD functions and numeric.h's, so the bytes equal the cpu
// path's) and the topk-id narrowing of the a2a routing input.
//
// fp8_quant_kernel — one warp per (token t, scale word w) unit, 4 groups of 128 channels each:
//   units u = t * W + w over t < S (S = T, or align4(T) for column-major UE8M0), W = ceil(G/4),
//   G = H / 128; warps take units u = warp, warp + num_warps, ...
//   group g = 4w + i (g < G): lane l holds x[t][128g + 4l .. 4l+3] (bf16 -> f32),
//     amax = max |x| (per lane in order, then a butterfly over the warp; max is exact, so any
//            order gives numeric.h's value; NaN never wins, as on the host)
//     scale = fp8_scale_from_amax(amax, ue8m0);  q = e4m3(x * (1.0f / scale))
//            (f32x2_to_fp8x2_e4m3: the hardware conversion, equal to f32_to_fp8_e4m3)
//     values[t][128g + 4l .. 4l+3] = q (one 32-bit store per lane)
//     f32:    scales_f32[t * G + g] = scale                       (lane 0)
//     UE8M0:  byte i of word = ue8m0_of_scale(scale); bytes of g >= G stay 0;
//             scales_ue8m0[t * token_stride + w * word_stride] = word   (lane 0)
//   t >= T (UE8M0 padding tokens): the word is 0.
//
// ue8m0_transpose_kernel — one thread per word of the column-major storage [W, S] (S = align4(N)),
//   units u = w * S + t, grid-stride (consecutive threads write consecutive tokens):
//     out[u] = t < N ? words[t * token_stride + w * word_stride] : 0
//   The words are moved, not re-packed: ht received them as the fp8 kernel packed them.
//
// nvfp4_quant_kernel — one thread per (token t, 16-value block b), units u = t * B + b,
//   B = H / 16, grid-stride:
//     amax over the block; (sf, inv) = nvfp4_block_scale(amax, g) (core/quant.h:
//     sf = e4m3((amax / 6) * g), inv = f32(sf) == 0 ? 0 : g / f32(sf)); q_i = e2m1(x_i * inv)
//     values[t][8b .. 8b+7] = pairs (element 2j low nibble), one 64-bit store; scales[t][b] = sf.
//
// nvfp4_interleave_kernel — one thread per output element o (grid-stride): b = o / per_batch,
//   (r, c) = nvfp4_sf_coords(o % per_batch); out[o] = sf[b][r][c], or 0 in the padding (r >= rows
//   or c >= cols). Coalesced stores; the loads gather (scales are small).
//
// narrow_topk_kernel — one thread per element: out[t][k] = narrow_expert_id(topk_idx[t][k]).
//
// Only IEEE-exact float operations (max, *, / with round-to-nearest) and the integer code of
// numeric.h; built without fast-math, so every result equals the host's.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/quant.h"

namespace epx::detail {

struct QuantConfig {
  static constexpr int kFp8Threads = 256;        // 8 warps, one (token, word) unit each
  static constexpr int kNvfp4Threads = 256;      // one 16-value block per thread
  static constexpr int kNarrowThreads = 256;     // one id per thread
  static constexpr int kTransposeThreads = 256;  // one UE8M0 word per thread
  static constexpr int kInterleaveThreads = 256;  // one interleaved scale per thread
  static constexpr int kMaxBlocks = 8192;        // grid-stride beyond this
};

struct Fp8QuantParams {
  const uint16_t* x;  // [T, H] bf16, row stride x_stride elements, innermost 1
  int64_t x_stride;
  int64_t num_tokens;        // T
  int64_t num_scale_tokens;  // S >= T (UE8M0 column-major: align4(T))
  int32_t num_groups;        // G = H / 128
  int32_t num_words;         // W = ceil(G / 4)
  int32_t ue8m0;
  int32_t x_vec8;         // x rows and base 8-byte aligned: one 64-bit load per lane
  uint8_t* values;        // [T, H] e4m3, contiguous
  float* scales_f32;      // [T, G] (f32 mode)
  int32_t* scales_ue8m0;  // words at t * token_stride + w * word_stride (UE8M0 mode)
  int64_t scale_token_stride;
  int64_t scale_word_stride;
};

struct Ue8m0TransposeParams {
  const int32_t* words;  // [N, W], strides in elements
  int64_t token_stride;
  int64_t word_stride;
  int64_t num_tokens;         // N
  int64_t num_padded_tokens;  // S = align4(N)
  int64_t num_words;          // W
  int32_t* out;               // [W, S] contiguous
};

struct Nvfp4QuantParams {
  const uint16_t* x;  // [T, H] bf16, row stride x_stride elements, innermost 1
  int64_t x_stride;
  int64_t num_tokens;  // T
  int64_t num_blocks;  // B = H / 16 per token
  float global_scale;
  int32_t x_vec16;  // x rows and base 16-byte aligned: two 128-bit loads per block
  uint8_t* values;  // [T, H/2] packed e2m1, contiguous
  uint8_t* scales;  // [T, H/16] e4m3, contiguous
};

struct Nvfp4InterleaveParams {
  const void* sf;  // [B, rows, cols], strides in shape
  Nvfp4InterleaveShape shape;
  void* out;  // [B * per_batch] contiguous
};

struct NarrowTopkParams {
  const void* topk_idx;  // [T, K] int64 or int32, strides in elements
  int64_t stride_t;
  int64_t stride_k;
  int64_t num_tokens;
  int32_t top_k;
  int32_t is_i64;
  int32_t* out;  // [T, K] contiguous
};

// 4 bf16 at p as float; `vec8`: p is 8-byte aligned.
__device__ __forceinline__ void quant_load4(const uint16_t* p, bool vec8, float* f) {
  uint16_t h[4];
  if (vec8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    h[0] = static_cast<uint16_t>(v.x & 0xFFFFu);
    h[1] = static_cast<uint16_t>(v.x >> 16);
    h[2] = static_cast<uint16_t>(v.y & 0xFFFFu);
    h[3] = static_cast<uint16_t>(v.y >> 16);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __ldg(p + i);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = bf16_to_f32(h[i]);
}

__global__ void __launch_bounds__(QuantConfig::kFp8Threads)
    fp8_quant_kernel(const Fp8QuantParams p) {
  constexpr int kWarps = QuantConfig::kFp8Threads / 32;
  const int lane = threadIdx.x % 32;
  const int64_t num_units = p.num_scale_tokens * p.num_words;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t u = first; u < num_units; u += step) {
    const int64_t t = u / p.num_words;
    const int w = static_cast<int>(u % p.num_words);
    uint32_t word = 0;
    if (t < p.num_tokens) {
      const uint16_t* row = p.x + t * p.x_stride;
      for (int i = 0; i < 4; ++i) {
        const int g = 4 * w + i;
        if (g >= p.num_groups) break;  // warp-uniform
        const int64_t col = static_cast<int64_t>(g) * kQuantGroup + 4 * lane;
        float f[4];
        quant_load4(row + col, p.x_vec8 != 0, f);
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float a = f[j] < 0 ? -f[j] : f[j];
          amax = a > amax ? a : amax;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const float o = __shfl_xor_sync(0xffffffffu, amax, off);
          amax = o > amax ? o : amax;
        }
        const float scale = fp8_scale_from_amax(amax, p.ue8m0 != 0);
        const float inv = 1.0f / scale;
        const uint32_t q = f32x4_to_fp8x4_e4m3(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv);
        *reinterpret_cast<uint32_t*>(p.values + t * p.num_groups * kQuantGroup + col) = q;
        if (p.ue8m0) {
          word |= static_cast<uint32_t>(ue8m0_of_scale(scale)) << (8 * i);
        } else if (lane == 0) {
          p.scales_f32[t * p.num_groups + g] = scale;
        }
      }
    }
    if (p.ue8m0 && lane == 0)
      p.scales_ue8m0[t * p.scale_token_stride + w * p.scale_word_stride] =
          static_cast<int32_t>(word);
  }
}

__global__ void __launch_bounds__(QuantConfig::kTransposeThreads)
    ue8m0_transpose_kernel(const Ue8m0TransposeParams p) {
  const int64_t n = p.num_words * p.num_padded_tokens;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < n; u += step) {
    const int64_t w = u / p.num_padded_tokens, t = u % p.num_padded_tokens;
    p.out[u] = t < p.num_tokens ? __ldg(p.words + t * p.token_stride + w * p.word_stride) : 0;
  }
}

__global__ void __launch_bounds__(QuantConfig::kNvfp4Threads)
    nvfp4_quant_kernel(const Nvfp4QuantParams p) {
  const int64_t num_units = p.num_tokens * p.num_blocks;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < num_units;
       u += step) {
    const int64_t t = u / p.num_blocks, b = u % p.num_blocks;
    const uint16_t* src = p.x + t * p.x_stride + b * kNvfp4Block;
    uint16_t h[kNvfp4Block];
    if (p.x_vec16) {
      const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(src));
      const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(src) + 1);
      const uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        h[2 * i] = static_cast<uint16_t>(words[i] & 0xFFFFu);
        h[2 * i + 1] = static_cast<uint16_t>(words[i] >> 16);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kNvfp4Block; ++i) h[i] = __ldg(src + i);
    }
    float f[kNvfp4Block];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) {
      f[i] = bf16_to_f32(h[i]);
      const float a = f[i] < 0 ? -f[i] : f[i];
      amax = a > amax ? a : amax;
    }
    const Nvfp4Scale s = nvfp4_block_scale(amax, p.global_scale);
    *reinterpret_cast<uint2*>(p.values + t * (p.num_blocks * kNvfp4Block / 2) + b * 8) =
        make_uint2(nvfp4_pack8(f, s.inv), nvfp4_pack8(f + 8, s.inv));
    p.scales[t * p.num_blocks + b] = s.sf;
  }
}

template <typename T>
__global__ void __launch_bounds__(QuantConfig::kInterleaveThreads)
    nvfp4_interleave_kernel(const Nvfp4InterleaveParams p) {
  const Nvfp4InterleaveShape& s = p.shape;
  const int64_t n = s.batch * s.per_batch;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < n; o += step) {
    const int64_t b = o / s.per_batch;
    int64_t r = 0, c = 0;
    nvfp4_sf_coords(o - b * s.per_batch, s.padded_cols, &r, &c);
    T v = 0;
    if (r < s.rows && c < s.cols)
      v = __ldg(static_cast<const T*>(p.sf) + b * s.stride_batch + r * s.stride_row +
                c * s.stride_col);
    static_cast<T*>(p.out)[o] = v;
  }
}

__global__ void __launch_bounds__(QuantConfig::kNarrowThreads)
    narrow_topk_kernel(const NarrowTopkParams p) {
  const int64_t n = p.num_tokens * p.top_k;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t t = i / p.top_k, k = i % p.top_k;
    const int64_t off = t * p.stride_t + k * p.stride_k;
    const int64_t id = p.is_i64 ? static_cast<const int64_t*>(p.topk_idx)[off]
                                : static_cast<const int32_t*>(p.topk_idx)[off];
    p.out[i] = narrow_expert_id(id);
  }
}

}  // namespace epx::detail
