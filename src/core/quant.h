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
//   scales u8 [T, H/16] (row-major). nvfp4_block_scale / nvfp4_pack8 are the formula, used by
//   the host loops, the quantisation kernel and the ll dispatch kernel alike.
//
// NVFP4 scale interleave (FlashInfer's nvfp4_block_scale_interleave; docs/semantics.md §8): the
// scales [rows, cols] of one batch entry in 128 x 4 tiles of 512 elements, row tiles outermost,
// inside a tile rows r, r + 32, r + 64, r + 96 interleaved, each with its 4 columns contiguous;
// rows padded to a multiple of 128, columns to a multiple of 4 (nvfp4_sf_offset). The ll NVFP4
// dispatch writes its received scales in this layout per local expert.
//
// Devices: cpu tensors are quantised on the calling thread (quant.cc); cuda tensors by the
// kernels of src/cuda/quant.cu on the given stream (asynchronous; Unsupported in a build without
// CUDA). Both use the EPX_HD functions here and in numeric.h, so their bytes are identical.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

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

// The block scale of one 16-value block from its amax (amax_bf16's order: NaNs skipped) and the
// global scale g: sf = e4m3((amax / 6) * g) and the multiplier inv = g / f32(sf) (0 when sf
// is 0) applied before the e2m1 conversion. IEEE operations only.
struct Nvfp4Scale {
  uint8_t sf;
  float inv;
};
EPX_HD Nvfp4Scale nvfp4_block_scale(float amax, float global_scale) {
  const uint8_t sf = f32_to_fp8_e4m3((amax / 6.0f) * global_scale);
  const float sf_f = fp8_e4m3_to_f32(sf);
  return {sf, sf_f == 0.0f ? 0.0f : global_scale / sf_f};
}

// 8 values -> 4 bytes: byte j = e2m1(f[2j] * inv) | e2m1(f[2j + 1] * inv) << 4 (little endian).
EPX_HD uint32_t nvfp4_pack8(const float* f, float inv) {
  uint32_t packed = 0;
  for (int i = 0; i < 8; i += 2) {
    const uint32_t lo = f32_to_e2m1(f[i] * inv);
    const uint32_t hi = f32_to_e2m1(f[i + 1] * inv);
    packed |= (lo | (hi << 4)) << (4 * i);
  }
  return packed;
}

// One token row of `hidden` bf16 values (hidden % 16 == 0).
inline void quantize_row_nvfp4(const uint16_t* x, int64_t hidden, float global_scale,
                               uint8_t* q, uint8_t* scales) {
  for (int64_t b = 0; b < hidden / kNvfp4Block; ++b) {
    const Nvfp4Scale s =
        nvfp4_block_scale(amax_bf16(x + b * kNvfp4Block, kNvfp4Block), global_scale);
    for (int half = 0; half < 2; ++half) {
      float f[8];
      for (int i = 0; i < 8; ++i) f[i] = bf16_to_f32(x[b * kNvfp4Block + 8 * half + i]);
      const uint32_t packed = nvfp4_pack8(f, s.inv);
      for (int j = 0; j < 4; ++j)
        q[b * kNvfp4Block / 2 + 4 * half + j] = static_cast<uint8_t>(packed >> (8 * j));
    }
    scales[b] = s.sf;
  }
}

// ---- the interleaved (128 x 4 tiled) scale layout ---------------------------------------------

inline constexpr int64_t kNvfp4SfTileRows = 128;  // rows of one tile
inline constexpr int64_t kNvfp4SfTileCols = 4;    // columns of one tile (512 elements a tile)

EPX_HD int64_t nvfp4_sf_padded_rows(int64_t rows) {
  return (rows + kNvfp4SfTileRows - 1) / kNvfp4SfTileRows * kNvfp4SfTileRows;
}
EPX_HD int64_t nvfp4_sf_padded_cols(int64_t cols) {
  return (cols + kNvfp4SfTileCols - 1) / kNvfp4SfTileCols * kNvfp4SfTileCols;
}

// Offset of scale (row, col) within one batch entry (padded_cols = nvfp4_sf_padded_cols(cols)):
//   (row / 128) * 128 * padded_cols + (col / 4) * 512 + (row % 32) * 16 + (row % 128 / 32) * 4
//   + col % 4
EPX_HD int64_t nvfp4_sf_offset(int64_t row, int64_t col, int64_t padded_cols) {
  return (row / 128) * 128 * padded_cols + (col / 4) * 512 + (row % 32) * 16 +
         (row % 128 / 32) * 4 + col % 4;
}

// One interleave call's geometry (nvfp4_block_scale_interleave): strides in elements
// (stride_batch 0 for a 2-D input), per_batch = pad128(rows) * pad4(cols).
struct Nvfp4InterleaveShape {
  int64_t batch = 1, rows = 0, cols = 0;
  int64_t stride_batch = 0, stride_row = 0, stride_col = 0;
  int64_t padded_cols = 0, per_batch = 0;
};

// The inverse within one batch entry: the (row, col) whose scale nvfp4_sf_offset puts at `offset`
// (row may lie in the padding rows, col in the padding columns).
EPX_HD void nvfp4_sf_coords(int64_t offset, int64_t padded_cols, int64_t* row, int64_t* col) {
  const int64_t tile_row = offset / (128 * padded_cols);
  const int64_t in_row_tile = offset % (128 * padded_cols);
  const int64_t in_tile = in_row_tile % 512;
  *row = tile_row * 128 + (in_tile % 16) / 4 * 32 + in_tile / 16;
  *col = in_row_tile / 512 * 4 + in_tile % 4;
}

// ---- the ll NVFP4 outputs (epx/ll.h; the layout of DeepEP's NVFP4 forks) ---------------------
// Storages: values u8 [L, RT, H/2]; scales e4m3 [L, ceil(RT/128), H/64, 32, 4, 4], i.e. per local
// expert the interleaved layout of its [RT, H/16] scales (H % 64 == 0: no padding columns).

// Bytes of one local expert's scales: pad128(RT) * H/16.
EPX_HD int64_t ll_nvfp4_scale_expert_bytes(int64_t rows_per_expert, int64_t hidden) {
  return nvfp4_sf_padded_rows(rows_per_expert) * (hidden / kNvfp4Block);
}
std::vector<int64_t> ll_nvfp4_x_storage(int64_t num_local_experts, int64_t rows_per_expert,
                                        int64_t hidden);
std::vector<int64_t> ll_nvfp4_scale_storage(int64_t num_local_experts, int64_t rows_per_expert,
                                            int64_t hidden);
// The storages (contiguous, shapes above) -> the returned views: recv_x (RT, H/2, L) with strides
// {H/2, 1, RT*H/2}; recv_scales (32, 4, ceil(RT/128), 4, H/64, L), the storage permuted by
// (3, 4, 1, 5, 2, 0).
void set_ll_nvfp4_views(Tensor& recv_x, Tensor& recv_scales);

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
