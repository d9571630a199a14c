// src/cuda/kernels/ht/nodes_pack.cuh — the pack kernel of the hierarchical ht (nodes.cuh's file
// comment), with its chunk layout and parameters: apart from nodes.cuh's other kernels, so the ll
// across nodes (src/cuda/ll_nodes.cu, which packs with it) includes it without them.
#pragma once

#include <cstdint>

#include "cuda/kernels/ht/common.cuh"

namespace epx::detail {

inline constexpr int kHtNodesThreads = 512;

// One chunk of the dispatch leg (byte offsets; -1: absent). Host and device.
struct HtNodesChunk {
  int64_t rows_off = 0, scales_off = -1, ids_off = -1, weights_off = -1, bytes = 0;

  static __host__ __device__ int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }
  // Rows of row_bytes, num_scales 4-byte scales; ids and weights unless cached.
  static __host__ __device__ HtNodesChunk make(int64_t max_tokens, int64_t row_bytes,
                                               int num_scales, int top_k, bool weights,
                                               bool cached) {
    HtNodesChunk c;
    int64_t at = align16(max_tokens * row_bytes);
    if (num_scales > 0) {
      c.scales_off = at;
      at = align16(at + max_tokens * num_scales * 4);
    }
    if (!cached) {
      c.ids_off = at;
      at = align16(at + max_tokens * top_k * 4);
      if (weights) {
        c.weights_off = at;
        at = align16(at + max_tokens * top_k * 4);
      }
    }
    c.bytes = at;
    return c;
  }
};

struct HtNodesPackParams {
  const char* x;  // [T, H] rows of row_bytes, x_stride apart
  int64_t x_stride, row_bytes;
  const uint32_t* scales;  // [T, num_scales] 4-byte elements, strides in elements, or null
  int64_t scale_stride0, scale_stride1;
  int num_scales;
  const void* topk_idx;  // [T, K] (not cached)
  int64_t topk_stride;
  int topk_is_i64;
  const float* weights;  // [T, K] or null
  int64_t weights_stride0, weights_stride1;
  int cached;           // the handle's routing (in_rank), no ids or weights in the chunks
  const bool* in_rank;  // cached: [T, R] the handle's is_token_in_rank (null when T = 0)
  int num_tokens, max_tokens, top_k, num_experts, num_nodes, node, ranks_per_node;
  int32_t* own_ids;  // [T, K] (not cached)
  char* chunks;      // (N - 1) chunks, `chunk_stride` bytes apart, slot other_index(m, n)
  int64_t chunk_stride;
  HtNodesChunk chunk;
};

template <typename V>
__device__ __forceinline__ void warp_copy_row(char* dst, const char* src, int64_t bytes,
                                              int lane) {
  const int64_t nv = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = lane; i < nv; i += 32)
    reinterpret_cast<V*>(dst)[i] = ld_input(reinterpret_cast<const V*>(src) + i);
}

// One warp per token slot t in [0, C).
template <typename V>
__global__ void __launch_bounds__(kHtNodesThreads) ht_nodes_pack_kernel(HtNodesPackParams p) {
  const int lane = threadIdx.x & 31, K = p.top_k, n = p.node, G = p.ranks_per_node;
  const int e_node = p.num_experts / p.num_nodes;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // From the call, never from in_rank: a cached call with T = 0 has a null in_rank, and taking
  // it for an exact one wrote ids at the chunks' absent ids_off (-1).
  const bool cached = p.cached != 0;
  for (int64_t t = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5); t < p.max_tokens;
       t += warps) {
    const bool real = t < p.num_tokens;
    // Bit m of `nodes`: token t goes to some rank of node m.
    uint64_t nodes = 0;
    int64_t e = -1;
    if (real && cached) {
      for (int d = lane; d < p.num_nodes * G; d += 32)
        if (p.in_rank[t * p.num_nodes * G + d]) nodes |= 1ull << (d / G);
    } else if (real && lane < K) {
      e = ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, lane);
      if (e >= 0 && e < p.num_experts) nodes = 1ull << (e / e_node);
    }
    for (int s = 16; s > 0; s >>= 1) nodes |= __shfl_xor_sync(0xffffffffu, nodes, s);
    if (real && !cached && lane < K) {
      const bool valid = e >= -1 && e < p.num_experts;
      // An invalid id stays invalid for the node-local count exchange, which reports it; an
      // int64 one beyond the int32 range is clamped to it (never narrowed into a valid id).
      constexpr int64_t kLo = INT32_MIN, kHi = INT32_MAX;
      const int32_t invalid = static_cast<int32_t>(e < -1 ? max(e, kLo) : min(e, kHi));
      p.own_ids[t * K + lane] = !valid                      ? invalid
                                : e >= 0 && e / e_node == n ? static_cast<int32_t>(e - n * e_node)
                                                            : -1;
    }
    for (int m = 0; m < p.num_nodes; ++m) {
      if (m == n) continue;
      char* chunk = p.chunks + (m < n ? m : m - 1) * p.chunk_stride;
      const bool goes = (nodes >> m) & 1u;
      if (!cached && lane < K) {
        auto* ids = reinterpret_cast<int32_t*>(chunk + p.chunk.ids_off);
        ids[t * K + lane] =
            goes && e >= 0 && e / e_node == m ? static_cast<int32_t>(e - m * e_node) : -1;
        if (goes && p.weights)
          reinterpret_cast<float*>(chunk + p.chunk.weights_off)[t * K + lane] =
              p.weights[t * p.weights_stride0 + lane * p.weights_stride1];
      }
      if (!goes) continue;
      warp_copy_row<V>(chunk + p.chunk.rows_off + t * p.row_bytes, p.x + t * p.x_stride,
                       p.row_bytes, lane);
      if (p.num_scales > 0) {
        auto* sc = reinterpret_cast<uint32_t*>(chunk + p.chunk.scales_off);
        for (int j = lane; j < p.num_scales; j += 32)
          sc[t * p.num_scales + j] = p.scales[t * p.scale_stride0 + j * p.scale_stride1];
      }
    }
  }
}

}  // namespace epx::detail
