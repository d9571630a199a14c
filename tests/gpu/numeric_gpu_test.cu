// GPU tier: the device number conversions against their host emulation (src/core/numeric.h).
// The cuda kernels convert float32 to fp8 e4m3 with the hardware instruction
// (f32x2_to_fp8x2_e4m3: cvt.rn.satfinite.e4m3x2.f32 on sm_89+) while the cpu backend uses
// f32_to_fp8_e4m3; bit-exact results need the two to agree on every input, so every one of the
// 2^32 float32 bit patterns is converted both ways on the GPU, in both halves of the pair (and in
// every byte of the four-value form, f32x4_to_fp8x4_e4m3); the same for float32 -> bf16
// (f32x2_to_bf16x2, cvt.rn.bf16x2.f32 on sm_80+, vs f32_to_bf16) and float32 -> fp16
// (f32x2_to_f16x2, __floats2half2_rn, vs f32_to_f16); fp16 -> float32 (f16_to_f32,
// __half2float on the device) against the host's decode on all 65536 codes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "gpu/gpu_support.h"

namespace epx {
namespace {

// The two pair conversions, hardware (device path) and emulated, as one packed word each.
struct Fp8Pair {
  __device__ static uint32_t hw(float lo, float hi) { return detail::f32x2_to_fp8x2_e4m3(lo, hi); }
  __device__ static uint32_t sw(float lo, float hi) {
    return detail::f32_to_fp8_e4m3(lo) | detail::f32_to_fp8_e4m3(hi) << 8;
  }
};
// The quad form (f32x4_to_fp8x4_e4m3: one NaN fix-up for the word) with each pair in both
// orders, so each of its four bytes sees every input over all patterns.
struct Fp8Quad {
  __device__ static uint32_t hw(float lo, float hi) {
    return detail::f32x4_to_fp8x4_e4m3(lo, hi, hi, lo);
  }
  __device__ static uint32_t sw(float lo, float hi) {
    return Fp8Pair::sw(lo, hi) | Fp8Pair::sw(hi, lo) << 16;
  }
};
struct Bf16Pair {
  __device__ static uint32_t hw(float lo, float hi) { return detail::f32x2_to_bf16x2(lo, hi); }
  __device__ static uint32_t sw(float lo, float hi) {
    return static_cast<uint32_t>(detail::f32_to_bf16(lo)) |
           static_cast<uint32_t>(detail::f32_to_bf16(hi)) << 16;
  }
};

struct F16Pair {
  __device__ static uint32_t hw(float lo, float hi) { return detail::f32x2_to_f16x2(lo, hi); }
  __device__ static uint32_t sw(float lo, float hi) {
    return static_cast<uint32_t>(detail::f32_to_f16(lo)) |
           static_cast<uint32_t>(detail::f32_to_f16(hi)) << 16;
  }
};

// Every fp16 code decoded on the device.
__global__ void decode_f16(float* out) {
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < 65536) out[c] = detail::f16_to_f32(static_cast<uint16_t>(c));
}

// Pattern u goes into the low half and u ^ sign into the high half, so over all u each half sees
// every input. Mismatches counted; the smallest mismatching pattern kept.
template <typename Pair>
__global__ void compare_pairs(unsigned long long* mismatches, unsigned int* first) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
       i < (uint64_t{1} << 32); i += stride) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float lo = __uint_as_float(u), hi = __uint_as_float(u ^ 0x80000000u);
    if (Pair::hw(lo, hi) != Pair::sw(lo, hi)) {
      ++bad;
      atomicMin(first, u);
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// The architecture this file's device code was compiled for (each hardware conversion has its
// lowest arch: e4m3 sm_89, bf16x2 sm_80, f16 any; below it the helper falls back to the
// emulation and the comparison would be empty).
__global__ void compiled_arch(int* arch) {
#ifdef __CUDA_ARCH__
  *arch = __CUDA_ARCH__;
#endif
}

// "" when the device code uses the hardware conversion that needs sm_`need` (as 890), else the
// skip reason.
std::string hardware_path_missing(int need) {
  int* d = nullptr;
  int arch = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return "cudaMalloc failed";
  compiled_arch<<<1, 1>>>(d);
  cudaMemcpy(&arch, d, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d);
  if (arch == 0) return "the arch probe kernel did not run (no device code for this GPU?)";
  if (arch >= need) return "";
  return "device code compiled for sm_" + std::to_string(arch / 10) + ": the hardware conversion "
         "needs sm_" + std::to_string(need / 10) + "+ (CMAKE_CUDA_ARCHITECTURES)";
}

// Runs `kernel` over all 2^32 patterns; "" or the failure.
template <typename Kernel>
std::string exhaustive(Kernel kernel) {
  unsigned long long* mismatches = nullptr;
  unsigned int* first = nullptr;
  if (cudaMalloc(&mismatches, sizeof(*mismatches)) != cudaSuccess ||
      cudaMalloc(&first, sizeof(*first)) != cudaSuccess)
    return "cudaMalloc failed";
  cudaMemset(mismatches, 0, sizeof(*mismatches));
  cudaMemset(first, 0xFF, sizeof(*first));
  kernel<<<1024, 256>>>(mismatches, first);
  if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
    return "kernel failed";
  unsigned long long bad = 0;
  unsigned int f = 0;
  cudaMemcpy(&bad, mismatches, sizeof(bad), cudaMemcpyDeviceToHost);
  cudaMemcpy(&f, first, sizeof(f), cudaMemcpyDeviceToHost);
  cudaFree(mismatches);
  cudaFree(first);
  if (bad == 0) return "";
  char msg[128];
  std::snprintf(msg, sizeof(msg), "%llu mismatches, the first at float32 bits 0x%08x", bad, f);
  return msg;
}

TEST(NumericGpu, HardwareBf16ConversionMatchesEmulationOnEveryFloat) {
  EPX_REQUIRE_GPUS(1);
  if (const std::string why = hardware_path_missing(800); !why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(exhaustive(compare_pairs<Bf16Pair>), "");
}

TEST(NumericGpu, HardwareF16ConversionMatchesEmulationOnEveryFloat) {
  EPX_REQUIRE_GPUS(1);
  if (const std::string why = hardware_path_missing(1); !why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(exhaustive(compare_pairs<F16Pair>), "");
}

TEST(NumericGpu, HardwareF16DecodeMatchesHostOnEveryCode) {
  EPX_REQUIRE_GPUS(1);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 65536 * sizeof(float)), cudaSuccess);
  decode_f16<<<256, 256>>>(d);
  std::vector<float> got(65536);
  ASSERT_EQ(cudaMemcpy(got.data(), d, 65536 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d);
  int bad = 0;
  for (uint32_t c = 0; c < 65536; ++c) {
    const float want = detail::f16_to_f32(static_cast<uint16_t>(c));
    const bool same = want != want ? got[c] != got[c]  // NaN: any NaN (payloads may differ)
                                   : detail::f32_bits(got[c]) == detail::f32_bits(want);
    if (!same && ++bad <= 8) ADD_FAILURE() << "code 0x" << std::hex << c << ": " << got[c];
  }
  EXPECT_EQ(bad, 0);
}

TEST(NumericGpu, HardwareFp8ConversionMatchesEmulationOnEveryFloat) {
  EPX_REQUIRE_GPUS(1);
  if (const std::string why = hardware_path_missing(890); !why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(exhaustive(compare_pairs<Fp8Pair>), "");
}

TEST(NumericGpu, HardwareFp8QuadConversionMatchesEmulationOnEveryFloat) {
  EPX_REQUIRE_GPUS(1);
  if (const std::string why = hardware_path_missing(890); !why.empty()) GTEST_SKIP() << why;
  EXPECT_EQ(exhaustive(compare_pairs<Fp8Quad>), "");
}

}  // namespace
}  // namespace epx
