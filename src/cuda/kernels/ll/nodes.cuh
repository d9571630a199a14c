// src/cuda/kernels/ll/nodes.cuh — the kernels of the ll across nodes that are not node-local ll
// kernels (docs/design.md §13.1, host side src/cuda/ll_nodes.cu; the pack is ht's,
// kernels/ht/nodes.cuh). R = N nodes x G ranks, this rank (n, g), L local experts, C = T_max.
// Block m: what the node-local dispatch of source node m returned ([L, G * C] rows per expert,
// the rows of sources (m, 0 .. G - 1) packed from row 0).
//
//   assemble  the flat dispatch outputs ([L, R * C]): per local expert l, block m's rows behind
//             the earlier blocks' (off_m[l] = sum over m' < m of count_m'[l]): recv_x rows,
//             scales (column-major per expert), src_info; layout_range[l][m * G + g] = block
//             m's with begin + off_m[l]; recv_count[l] = sum over m of count_m[l]. Counts are
//             read on the device (no host wait).
//   restage   y's block m (the caller's [L, R * C] rows) into the node-local combine buffer of
//             block m's handle ([L, G * C], rows from 0): off and count from the flat
//             layout_range, so the node-local combine runs zero-copy.
//   add       out[t] = bf16(own[t] + partial_m[t] for m != n ascending with a selection of t on
//             node m): the cpu backend's node-first order (src/cpu/ll_combine.cc).
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

inline constexpr int kLlNodesThreads = 512;
inline constexpr int kLlNodesMaxNodes = 16;

struct LlNodesBlock {
  const uint8_t* x;             // [L, G * C] rows of row_bytes
  const uint32_t* scales;       // storage [L, cols, G * C] of 4-byte scales, or null
  const int32_t* count;         // [L]
  const int32_t* src_info;      // [L, G * C]
  const int64_t* layout_range;  // [L, G]
};

struct LlNodesAssembleParams {
  LlNodesBlock blocks[kLlNodesMaxNodes];
  int num_nodes, ranks_per_node, num_local_experts, scale_cols;
  int64_t block_rows;  // G * C
  int64_t rows;        // R * C
  int64_t row_bytes;   // H (fp8) or 2H (bf16), a multiple of 16
  uint8_t* x;
  uint32_t* scales;  // storage [L, cols, R * C], or null
  int32_t* count;
  int32_t* src_info;
  int64_t* layout_range;  // [L, R]
};

// One CTA per unit (l, m) at a time, grid-stride.
__global__ void __launch_bounds__(kLlNodesThreads)
    ll_nodes_assemble_kernel(LlNodesAssembleParams p) {
  const int N = p.num_nodes, G = p.ranks_per_node, L = p.num_local_experts, R = N * G;
  for (int u = blockIdx.x; u < L * N; u += gridDim.x) {
    const int l = u / N, m = u - l * N;
    int64_t off = 0;
    for (int mb = 0; mb < m; ++mb) off += p.blocks[mb].count[l];
    const LlNodesBlock& b = p.blocks[m];
    const int64_t cnt = b.count[l];
    if (m == N - 1 && threadIdx.x == 0) p.count[l] = static_cast<int32_t>(off + cnt);
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      const int64_t range = b.layout_range[l * G + g];
      p.layout_range[l * R + m * G + g] = ((range >> 32) + off) << 32 | (range & 0xFFFFFFFF);
    }
    const int64_t nv = p.row_bytes / 16;
    const auto* src = reinterpret_cast<const uint4*>(b.x + l * p.block_rows * p.row_bytes);
    auto* dst = reinterpret_cast<uint4*>(p.x + (l * p.rows + off) * p.row_bytes);
    for (int64_t i = threadIdx.x; i < cnt * nv; i += blockDim.x) dst[i] = src[i];
    for (int64_t j = threadIdx.x; j < cnt; j += blockDim.x)
      p.src_info[l * p.rows + off + j] = b.src_info[l * p.block_rows + j];
    for (int64_t i = threadIdx.x; i < cnt * p.scale_cols; i += blockDim.x) {
      const int64_t c = i / cnt, j = i - c * cnt;
      p.scales[(l * p.scale_cols + c) * p.rows + off + j] =
          b.scales[(l * p.scale_cols + c) * p.block_rows + j];
    }
  }
}

struct LlNodesRestageParams {
  const uint16_t* y;  // [L, R * C, H] bf16, strides in elements
  int64_t y_stride0, y_stride1;
  const int64_t* layout_range;  // the flat handle's [L, R], row stride layout_stride
  int64_t layout_stride;
  int block, ranks_per_node, num_local_experts;
  int64_t hidden;
  uint16_t* comb_y;    // [L, G * C, H] contiguous
  int64_t block_rows;  // G * C
};

// One CTA per local expert at a time; V: 16-byte vectors where y allows, else single elements.
template <typename V>
__global__ void __launch_bounds__(kLlNodesThreads) ll_nodes_restage_kernel(LlNodesRestageParams p) {
  const int G = p.ranks_per_node;
  constexpr int64_t kPer = sizeof(V) / 2;
  const int64_t nv = p.hidden / kPer;
  for (int l = blockIdx.x; l < p.num_local_experts; l += gridDim.x) {
    const int64_t* ranges = p.layout_range + l * p.layout_stride + p.block * G;
    const int64_t off = ranges[0] >> 32;
    int64_t cnt = 0;
    for (int g = 0; g < G; ++g) cnt += ranges[g] & 0xFFFFFFFF;
    cnt = min(cnt, p.block_rows);
    for (int64_t i = threadIdx.x; i < cnt * nv; i += blockDim.x) {
      const int64_t j = i / nv, v = i - j * nv;
      const V* src = reinterpret_cast<const V*>(p.y + l * p.y_stride0 + (off + j) * p.y_stride1);
      reinterpret_cast<V*>(p.comb_y + (l * p.block_rows + j) * p.hidden)[v] = ld_input(src + v);
    }
  }
}

struct LlNodesAddParams {
  const float* own;      // [T, H] this node's partial
  const char* partials;  // N - 1 chunks [C, H] f32, `partial_stride` bytes apart, other_index
  int64_t partial_stride;
  const void* topk_idx;  // [T, K]
  int64_t topk_stride;
  int topk_is_i64;
  int64_t num_tokens, hidden;
  int top_k, experts_per_node, num_nodes, node;
  uint16_t* out;  // [T, H] bf16, row stride out_stride elements
  int64_t out_stride;
};

// One CTA per token at a time: the nodes its selections reach, then its elements.
__global__ void __launch_bounds__(kLlNodesThreads) ll_nodes_add_kernel(LlNodesAddParams p) {
  __shared__ uint32_t s_nodes;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    if (threadIdx.x == 0) s_nodes = 0;
    __syncthreads();
    if (threadIdx.x < p.top_k) {
      const int64_t e = ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, threadIdx.x);
      if (e >= 0 && e < int64_t{p.experts_per_node} * p.num_nodes)
        atomicOr(&s_nodes, 1u << (e / p.experts_per_node));
    }
    __syncthreads();
    const uint32_t nodes = s_nodes;
    for (int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x) {
      float acc = p.own[t * p.hidden + c];
      for (int m = 0; m < p.num_nodes; ++m) {
        if (m == p.node || !((nodes >> m) & 1u)) continue;
        const char* chunk = p.partials + (m < p.node ? m : m - 1) * p.partial_stride;
        acc = acc + reinterpret_cast<const float*>(chunk)[t * p.hidden + c];
      }
      p.out[t * p.out_stride + c] = f32_to_bf16(acc);
    }
    __syncthreads();  // s_nodes is rewritten for the next token
  }
}

}  // namespace epx::detail
