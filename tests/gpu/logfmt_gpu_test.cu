// GPU tier: LogFMT-10 (src/core/logfmt.h, docs/semantics.md §2.3.1) evaluated on the device —
// __fadd_rn / __fmul_rn / __fdiv_rn, floorf, the table read from shared memory as the ll combine
// kernel holds it — against the host's evaluation, bit for bit: log2b of every bf16 magnitude,
// exp2x on 2^24 + arguments, and 8192 groups of every kind (meta word, every code byte and word,
// every decoded value). The combine's results can equal the cpu backend's only if these agree;
// the protocol itself is tested by ll_gpu_test (LlGpu / LlOneGpu.LogfmtCasesMatchOracle).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/logfmt.h"
#include "gpu/gpu_support.h"
#include "support/ll_cases.h"

namespace epx {
namespace {

using namespace detail;

__device__ float* shared_table(const float* table) {
  __shared__ float t[128];
  if (threadIdx.x < 128) t[threadIdx.x] = table[threadIdx.x];
  __syncthreads();
  return t;
}

__global__ void log2_kernel(const float* table, float* out) {
  const float* t = shared_table(table);
  for (uint32_t mag = 1 + blockIdx.x * blockDim.x + threadIdx.x; mag <= 0x7F7Fu;
       mag += gridDim.x * blockDim.x)
    out[mag] = logfmt_log2(mag, t);
}

__global__ void exp2_kernel(const float* ts, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = logfmt_exp2(ts[i]);
}

// One group per thread: meta, the 160 bytes of a cast group (encode8 per 8 channels), the decoded
// values (decode8, or the bf16 values of a raw group).
__global__ void group_kernel(const float* table, const uint16_t* x, int64_t num_groups,
                             uint32_t* meta, uint8_t* bytes, float* values) {
  const float* t = shared_table(table);
  for (int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; g < num_groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint16_t* h = x + g * kLogfmtGroup;
    uint32_t amax = 0, amin = 0xFFFFu;
    for (int i = 0; i < kLogfmtGroup; ++i) {
      amax = max(amax, h[i] & 0x7FFFu);
      amin = min(amin, h[i] & 0x7FFFu);
    }
    const uint32_t m = logfmt_meta(amax, amin);
    meta[g] = m;
    float* v = values + g * kLogfmtGroup;
    if (m == kLogfmtRawMeta) {
      for (int i = 0; i < kLogfmtGroup; ++i) v[i] = bf16_to_f32(h[i]);
      continue;
    }
    const LogfmtParams par = logfmt_params(m, t);
    const float inv = f32_div(1.0f, par.step);
    uint8_t* b = bytes + g * kLogfmtCastBytes;
    for (int j = 0; j < kLogfmtGroup / 8; ++j) {
      uint64_t low;
      uint32_t hs;
      logfmt_encode8(h + 8 * j, par, inv, t, &low, &hs);
      for (int i = 0; i < 8; ++i) b[8 * j + i] = static_cast<uint8_t>(low >> (8 * i));
      b[kLogfmtGroup + 2 * j] = static_cast<uint8_t>(hs);
      b[kLogfmtGroup + 2 * j + 1] = static_cast<uint8_t>(hs >> 8);
      logfmt_decode8(low, hs, par, v + 8 * j);
    }
  }
}

template <typename T>
T* device_copy(const std::vector<T>& v) {
  T* d = nullptr;
  CUDA_OK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> host_copy(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

const std::vector<float> kTable(kLogfmtLog2Frac, kLogfmtLog2Frac + 128);

TEST(LogfmtGpu, Log2OfEveryBf16MagnitudeMatchesHost) {
  EPX_REQUIRE_GPUS(1);
  float* table = device_copy(kTable);
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&out, 0x8000 * sizeof(float)));
  log2_kernel<<<64, 256>>>(table, out);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = host_copy(out, 0x8000);
  int bad = 0;
  for (uint32_t mag = 1; mag <= 0x7F7Fu && bad < 5; ++mag)
    if (bits(got[mag]) != bits(logfmt_log2(mag, kLogfmtLog2Frac))) {
      ADD_FAILURE() << "log2b(0x" << std::hex << mag << ")";
      ++bad;
    }
  cudaFree(table);
  cudaFree(out);
}

TEST(LogfmtGpu, Exp2MatchesHost) {
  EPX_REQUIRE_GPUS(1);
  std::vector<float> ts;
  // Every float in [-2, 0) on a 2^-22 grid (the decode's arguments near la), the scaling edges,
  // and random arguments down to -260.
  for (int i = 0; i < (1 << 23); ++i) ts.push_back(-static_cast<float>(i) * 0x1p-22f);
  for (float t : {-126.0f, -126.5f, -127.0f, -149.0f, -149.5f, -150.0f, -252.0f, -253.0f})
    ts.push_back(t);
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> any(-260.0f, 0.0f);
  for (int i = 0; i < (1 << 23); ++i) ts.push_back(any(rng));
  float* d_ts = device_copy(ts);
  float* out = nullptr;
  CUDA_OK(cudaMalloc(&out, ts.size() * sizeof(float)));
  exp2_kernel<<<1024, 256>>>(d_ts, static_cast<int64_t>(ts.size()), out);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = host_copy(out, ts.size());
  int bad = 0;
  for (size_t i = 0; i < ts.size() && bad < 5; ++i)
    if (bits(got[i]) != bits(logfmt_exp2(ts[i]))) {
      ADD_FAILURE() << "exp2x(" << ts[i] << ")";
      ++bad;
    }
  cudaFree(d_ts);
  cudaFree(out);
}

TEST(LogfmtGpu, GroupsOfEveryKindMatchHost) {
  EPX_REQUIRE_GPUS(1);
  std::mt19937_64 rng(29);
  const int64_t num_groups = 8192;
  const std::vector<uint16_t> x = testing::make_logfmt_bf16(64, num_groups * 128 / 64, rng);
  float* table = device_copy(kTable);
  uint16_t* d_x = device_copy(x);
  uint32_t* meta = nullptr;
  uint8_t* bytes = nullptr;
  float* values = nullptr;
  CUDA_OK(cudaMalloc(&meta, num_groups * 4));
  CUDA_OK(cudaMalloc(&bytes, num_groups * kLogfmtCastBytes));
  CUDA_OK(cudaMalloc(&values, num_groups * 128 * sizeof(float)));
  group_kernel<<<64, 128>>>(table, d_x, num_groups, meta, bytes, values);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint32_t> got_meta = host_copy(meta, num_groups);
  const std::vector<uint8_t> got_bytes = host_copy(bytes, num_groups * kLogfmtCastBytes);
  const std::vector<float> got_values = host_copy(values, num_groups * 128);
  int bad = 0, cast = 0;
  for (int64_t g = 0; g < num_groups && bad < 5; ++g) {
    uint8_t slot[kLogfmtRawBytes];
    float want[128];
    const uint32_t m = logfmt_encode_group(x.data() + g * 128, slot);
    logfmt_decode_group(m, slot, want);
    cast += m != kLogfmtRawMeta;
    bool ok = got_meta[g] == m;
    if (ok && m != kLogfmtRawMeta)
      ok = std::memcmp(got_bytes.data() + g * kLogfmtCastBytes, slot, kLogfmtCastBytes) == 0;
    for (int i = 0; ok && i < 128; ++i) ok = bits(got_values[g * 128 + i]) == bits(want[i]);
    if (!ok) {
      ADD_FAILURE() << "group " << g << " (meta 0x" << std::hex << m << ")";
      ++bad;
    }
  }
  EXPECT_GT(cast, num_groups / 2);
  cudaFree(table);
  cudaFree(d_x);
  cudaFree(meta);
  cudaFree(bytes);
  cudaFree(values);
}

}  // namespace
}  // namespace epx
