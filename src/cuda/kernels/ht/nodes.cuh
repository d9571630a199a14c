// src/cuda/kernels/ht/nodes.cuh — the kernels of the hierarchical ht that are not node-local ht
// kernels (docs/design.md §13.1, host side src/cuda/ht_nodes.cu). R = N nodes x G ranks, this
// rank (n, g), L experts per rank, E_node = G * L experts per node, C = max_tokens_per_rank.
//
//   pack     per other node m (slot i = other_index(m, n)), chunk i holds C token slots: slot t
//            is this rank's token t when t goes to some rank of m (once per node, ascending t):
//              rows[t] = x[t], scales[t] = x_scales[t], weights[t] = topk_weights[t],
//              ids[t][k] = topk_idx[t][k] - m * E_node where that expert is on m, else -1
//            and ids[t][k] = -1 for every other slot (tokens that do not go to m, t >= T), so the
//            chunk is the node-local dispatch's input of T = C tokens on the rail partner (m, g);
//            its recv_src_idx is then the source's token index. own_ids: this node's ids the same
//            way (ids outside [-1, E) kept as they are: the node-local count kernel reports them).
//            Cached: rows and scales of the tokens the handle routes to m (is_token_in_rank).
//   columns  this node's columns of the global count matrix, from the node-local prefix
//            matrices of the N dispatches: cols[m * G + g'][d'] = rows (n, d') got from (m, g').
//   handle   from every node's columns (this node's and the other nodes' from the rail):
//            rank_prefix_matrix[s][d] = sum over s' <= s of count(s' -> d); is_token_in_rank and
//            send_pos[t][d] = rpm[r - 1][d] + (tokens before t going to d), or -1: the flat ones.
//   widen    int32 ids to int64 (recv_topk_idx of an int64 caller).
//   add      out[t] = bf16(own[t] + partial_0[t] + ... ), the other nodes' fp32 partials in node
//            order (docs/semantics.md §1.6 node-first order; own[t] carries the biases);
//            combined_topk_weights the same without rounding.
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "cuda/kernels/ht/common.cuh"
#include "cuda/kernels/ht/nodes_pack.cuh"

namespace epx::detail {

struct HtNodesColumnsParams {
  const int32_t* node_rpm[kMaxHtRanks];  // per source node m: the node-local [G, G] prefix matrix
  int32_t* cols;                         // [R, G]
  int num_nodes, ranks_per_node;
};

// One CTA: thread i < R * G computes cols[i].
__global__ void ht_nodes_columns_kernel(HtNodesColumnsParams p) {
  const int G = p.ranks_per_node;
  for (int i = threadIdx.x; i < p.num_nodes * G * G; i += blockDim.x) {
    const int s = i / G, dl = i % G, m = s / G, gs = s % G;
    const int32_t* rpm = p.node_rpm[m];
    p.cols[i] = rpm[gs * G + dl] - (gs > 0 ? rpm[(gs - 1) * G + dl] : 0);
  }
}

struct HtNodesHandleParams {
  const int32_t* own_cols;   // [R, G] this node's columns
  const char* recv_cols;     // (N - 1) blocks [R, G], `cols_stride` bytes apart, other_index order
  int64_t cols_stride;
  const void* topk_idx;  // [T, K]
  int64_t topk_stride;
  int topk_is_i64;
  int num_tokens, top_k, num_local_experts, num_nodes, node, ranks_per_node, rank;
  int32_t* rank_prefix_matrix;  // [R, R]
  bool* is_token_in_rank;       // [T, R]
  int32_t* send_pos;            // [T, R]
};

// One CTA of kHtNodesThreads: the prefix matrix (a thread per column), then one warp per column
// d scans the tokens 32 at a time.
__global__ void __launch_bounds__(kHtNodesThreads) ht_nodes_handle_kernel(HtNodesHandleParams p) {
  const int G = p.ranks_per_node, R = p.num_nodes * G, n = p.node;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int d = threadIdx.x; d < R; d += blockDim.x) {
    const int m = d / G;
    const char* theirs = p.recv_cols + (m < n ? m : m - 1) * p.cols_stride;
    const int32_t* cols = m == n ? p.own_cols : reinterpret_cast<const int32_t*>(theirs);
    int32_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += cols[s * G + d % G];
      p.rank_prefix_matrix[s * R + d] = acc;
    }
  }
  __syncthreads();
  const int L = p.num_local_experts;
  for (int d = warp; d < R; d += blockDim.x / 32) {
    int32_t next = p.rank > 0 ? p.rank_prefix_matrix[(p.rank - 1) * R + d] : 0;
    for (int64_t t0 = 0; t0 < p.num_tokens; t0 += 32) {
      const int64_t t = t0 + lane;
      bool in = false;
      for (int k = 0; t < p.num_tokens && k < p.top_k; ++k) {
        const int64_t e = ht_load_expert(p.topk_idx, p.topk_stride, p.topk_is_i64, t, k);
        in |= e >= int64_t{d} * L && e < int64_t{d + 1} * L;
      }
      const uint32_t ballot = __ballot_sync(0xffffffffu, in);
      if (t < p.num_tokens) {
        p.is_token_in_rank[t * R + d] = in;
        p.send_pos[t * R + d] = in ? next + __popc(ballot & ((1u << lane) - 1u)) : -1;
      }
      next += __popc(ballot);
    }
  }
}

__global__ void __launch_bounds__(kHtNodesThreads)
    ht_nodes_widen_kernel(const int32_t* src, int64_t* dst, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

struct HtNodesAddParams {
  const float* own;    // [T, H] this node's partial (from 0.0f + biases)
  const float* own_w;  // [T, K] or null
  const char* partials;  // N - 1 chunks, `partial_stride` bytes apart: [C, H] f32, weights [C, K]
  int64_t partial_stride, weights_off;
  int num_other;
  int64_t num_tokens, hidden;
  int top_k;
  uint16_t* out;  // [T, H] bf16
  float* combined_weights;  // [T, K] or null
};

__global__ void __launch_bounds__(kHtNodesThreads) ht_nodes_add_kernel(HtNodesAddParams p) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < p.num_tokens * p.hidden; i += step) {
    float acc = p.own[i];
    for (int q = 0; q < p.num_other; ++q)
      acc = acc + reinterpret_cast<const float*>(p.partials + q * p.partial_stride)[i];
    p.out[i] = f32_to_bf16(acc);
  }
  if (!p.combined_weights) return;
  for (int64_t i = first; i < p.num_tokens * p.top_k; i += step) {
    float acc = p.own_w[i];
    for (int q = 0; q < p.num_other; ++q)
      acc = acc + reinterpret_cast<const float*>(p.partials + q * p.partial_stride +
                                                 p.weights_off)[i];
    p.combined_weights[i] = acc;
  }
}

}  // namespace epx::detail
