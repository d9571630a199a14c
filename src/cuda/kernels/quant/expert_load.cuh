// src/cuda/kernels/quant/expert_load.cuh — expert-load recording on the device (docs/semantics.md
// §7): per local expert l < L, the received rows (tokens) that selected it, added into load[L]
// int64.
//
// expert_load_rows_kernel — one thread per received row r of ids [num_sources, rows_per_source,
//   K] (ht: one source, local ids; a2a: R sources, global ids):
//     source s = r / rows_per_source, j = r % rows_per_source; skipped when counts && j >=
//     counts[s]; local id of entry k: ht: id; a2a: id >= 0 && id / L == rank ? id % L : -1;
//     each DISTINCT local id in [0, L) of the row (first occurrence in k order) adds 1 into
//     a per-CTA shared histogram (or straight into load when L is too large for shared memory);
//     after the CTA's rows, nonzero bins are added into load with 64-bit atomics.
// expert_load_counts_kernel — load[l] += counts[l] (ll recv_count), one thread per l.
// Integer adds commute, so the result does not depend on the schedule: it equals the host count
// of src/core/expert_load.cc exactly.
#pragma once

#include <cstdint>

namespace epx::detail {

struct ExpertLoadConfig {
  static constexpr int kThreads = 256;
  static constexpr int kMaxBlocks = 1024;                // grid-stride beyond (bounds the flushes)
  static constexpr int kMaxSmemExperts = 48 * 1024 / 4;  // int32 bins in 48 KiB
};

struct ExpertLoadRowsParams {
  const void* ids;  // [num_sources, rows_per_source, K] int64 or int32, strides in elements
  int64_t source_stride;
  int64_t row_stride;
  int64_t k_stride;
  int64_t num_sources;
  int64_t rows_per_source;
  const int32_t* counts;  // optional [num_sources]: rows received per source
  int32_t top_k;
  int32_t is_i64;
  int32_t global_ids;  // 1: ids are global, local when id / L == rank
  int32_t rank;
  int32_t num_local_experts;  // L
  int32_t use_smem;           // L <= kMaxSmemExperts: dynamic shared histogram of L int32
  unsigned long long* load;   // [L] int64
};

struct ExpertLoadCountsParams {
  const int32_t* counts;  // [L], element stride counts_stride
  int64_t counts_stride;
  int32_t num_local_experts;
  unsigned long long* load;  // [L] int64
};

__device__ __forceinline__ int64_t expert_load_local_id(const ExpertLoadRowsParams& p,
                                                        const char* row, int k) {
  const int64_t off = k * p.k_stride;
  const int64_t id = p.is_i64 ? reinterpret_cast<const int64_t*>(row)[off]
                              : reinterpret_cast<const int32_t*>(row)[off];
  if (!p.global_ids) return id;
  return (id >= 0 && id / p.num_local_experts == p.rank) ? id % p.num_local_experts : -1;
}

__global__ void __launch_bounds__(ExpertLoadConfig::kThreads)
    expert_load_rows_kernel(const ExpertLoadRowsParams p) {
  extern __shared__ int hist[];  // [L] when use_smem
  const int L = p.num_local_experts;
  if (p.use_smem) {
    for (int l = threadIdx.x; l < L; l += blockDim.x) hist[l] = 0;
    __syncthreads();
  }
  const size_t elem = p.is_i64 ? 8 : 4;
  const int64_t num_rows = p.num_sources * p.rows_per_source;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < num_rows;
       r += step) {
    const int64_t s = r / p.rows_per_source, j = r % p.rows_per_source;
    if (p.counts != nullptr && j >= p.counts[s]) continue;
    const char* row = static_cast<const char*>(p.ids) +
                      (s * p.source_stride + j * p.row_stride) * static_cast<int64_t>(elem);
    for (int k = 0; k < p.top_k; ++k) {
      const int64_t l = expert_load_local_id(p, row, k);
      if (l < 0 || l >= L) continue;
      bool seen = false;
      for (int i = 0; i < k && !seen; ++i) seen = expert_load_local_id(p, row, i) == l;
      if (seen) continue;
      if (p.use_smem)
        atomicAdd(&hist[l], 1);
      else
        atomicAdd(&p.load[l], 1ull);
    }
  }
  if (p.use_smem) {
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += blockDim.x)
      if (hist[l] != 0) atomicAdd(&p.load[l], static_cast<unsigned long long>(hist[l]));
  }
}

__global__ void __launch_bounds__(ExpertLoadConfig::kThreads)
    expert_load_counts_kernel(const ExpertLoadCountsParams p) {
  for (int l = blockIdx.x * blockDim.x + threadIdx.x; l < p.num_local_experts;
       l += gridDim.x * blockDim.x)
    p.load[l] +=
        static_cast<unsigned long long>(static_cast<int64_t>(p.counts[l * p.counts_stride]));
}

}  // namespace epx::detail
