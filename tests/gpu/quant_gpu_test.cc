// GPU tier: the dispatch-quantisation, topk-narrowing and expert-load kernels of
// src/cuda/quant.cu against the cpu path (src/core/quant.cc, src/core/expert_load.cc) bit for bit
// (the Dispatcher on cuda: dispatcher_gpu_test.cc). Skipped, with the reason, where no GPU is
// visible.
//
// Kernel checks (one forked child on GPU 0; the test process never initialises CUDA, as in the
// other GPU suites): random bf16 rows plus adversarial ones (all zero, huge incl. +-inf, tiny and
// subnormal, NaN, random bit patterns, mixed groups); x contiguous, with padded 16-byte aligned
// rows, or misaligned (scalar load paths); the default stream and a created one. Every byte of
// every output storage is compared (fp8 values, f32 scales, UE8M0 words incl. the padding tokens
// and unused group bytes, NVFP4 values and scales), after the device outputs were poisoned with
// 0xFF. The UE8M0 re-layout (row-major words -> column-major, TMA-aligned; ht's x_scale) from
// contiguous, padded-row and transposed words, every storage byte incl. the padding tokens.
// Narrowing: int64/int32 ids, out-of-int32-range ids, strided and transposed views. NVFP4 scale
// interleave: shapes, dtypes and strides against the cpu path, every output byte.
// Expert load: local ids (int64/int32, duplicates, -1, out of range), a2a global ids with
// counts and garbage past them, ll counts, small and shared-memory-exceeding L, more rows than one
// grid covers, reset; the device counter against the host counter after every call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/expert_load.h"
#include "core/numeric.h"
#include "core/quant.h"
#include "epx/epx.h"
#include "gpu/gpu_support.h"
#include "support/harness.h"
#include "support/routing.h"

namespace epx {
namespace {

using detail::f32_to_bf16;
using detail::Ue8m0Layout;

// Runs `body` in one forked child bound to GPU 0; it returns "" or what went wrong.
int run_on_gpu(const std::function<std::string()>& body) {
  return launch_local(
      1,
      [&](int) {
        try {
          CUDA_OK(cudaSetDevice(0));
          const std::string err = body();
          if (err.empty()) return 0;
          std::fprintf(stderr, "%s\n", err.c_str());
          return 1;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "exception: %s\n", e.what());
          return 2;
        }
      },
      std::chrono::minutes(5));
}

using gpu_testing::poison_allocator;

using gpu_testing::diff_bytes;
using gpu_testing::logical_bytes;
using gpu_testing::storage_bytes;
using testing::make_x;

// ---- inputs ----------------------------------------------------------------------------------

enum class XLayout { kContiguous, kPaddedAligned, kMisaligned };

const char* layout_name(XLayout l) {
  return l == XLayout::kContiguous      ? "contiguous"
         : l == XLayout::kPaddedAligned ? "padded"
                                        : "misaligned";
}

// x on GPU 0 with the given row layout; `storage` keeps the allocation alive.
struct DeviceX {
  Tensor storage;
  TensorView view;
};

DeviceX upload_x(const std::vector<uint16_t>& x, int64_t T, int64_t H, XLayout layout) {
  const int64_t stride = layout == XLayout::kContiguous      ? H
                         : layout == XLayout::kPaddedAligned ? H + 64
                                                             : H + 3;
  const int64_t offset = layout == XLayout::kMisaligned ? 1 : 0;
  std::vector<uint16_t> host(static_cast<size_t>(offset + std::max<int64_t>(T, 1) * stride),
                             0xDEAD);
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(x.begin() + t * H, H, host.begin() + offset + t * stride);
  DeviceX d;
  d.storage = gpu_testing::to_device(host, DType::kBF16, {static_cast<int64_t>(host.size())}, 0);
  d.view = TensorView::contiguous(static_cast<uint16_t*>(d.storage.data) + offset, DType::kBF16,
                                  {T, H}, Device::cuda(0));
  d.view.strides = {stride, 1};
  return d;
}

// ---- fp8 and NVFP4 -----------------------------------------------------------------------------

struct QuantCase {
  int64_t T, H;
  XLayout layout;
  bool own_stream;
};

std::vector<QuantCase> quant_cases(int64_t multiple) {
  std::vector<QuantCase> v;
  const int64_t hs[] = {multiple, 3 * multiple, 640, 7168};
  const int64_t ts[] = {0, 1, 3, 5, 9, 67, 1000};
  int i = 0;
  for (int64_t H : hs)
    for (int64_t T : ts) {
      if (H == 7168 && T > 67) continue;  // keeps the suite fast; 7168 runs at 0..67 tokens
      const XLayout layout = static_cast<XLayout>(i % 3);
      v.push_back({T, H, layout, i % 4 == 1});
      ++i;
    }
  v.push_back({4099, 256, XLayout::kContiguous, false});  // more units than one grid covers
  return v;
}

std::string describe(const QuantCase& c) {
  return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " " + layout_name(c.layout) +
         (c.own_stream ? " stream" : " default-stream");
}

std::string check_fp8(const QuantCase& c, bool ue8m0, Ue8m0Layout scale_layout, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> x = make_x(c.T, c.H, rng);
  const TensorView xh = TensorView::contiguous(x.data(), DType::kBF16, {c.T, c.H});
  const detail::QuantizedTensor want =
      detail::quantize_fp8(xh, ue8m0, default_allocator(), nullptr, scale_layout);
  const DeviceX dx = upload_x(x, c.T, c.H, c.layout);
  cudaStream_t stream = nullptr;
  if (c.own_stream) CUDA_OK(cudaStreamCreate(&stream));
  const detail::QuantizedTensor got =
      detail::quantize_fp8(dx.view, ue8m0, poison_allocator(), stream, scale_layout);
  if (stream) {
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
  }
  const std::string what = "fp8 " + std::string(ue8m0 ? "ue8m0 " : "f32 ") +
                           (scale_layout == Ue8m0Layout::kRowMajor ? "row-major " : "") +
                           describe(c);
  if (got.scales.shape != want.scales.shape || got.scales.strides != want.scales.strides ||
      got.values.shape != want.values.shape)
    return what + ": output shapes or strides differ from the cpu path's";
  const int64_t G = c.H / 128, W = (G + 3) / 4;
  const int64_t scale_elems = !ue8m0                                   ? c.T * G
                              : scale_layout == Ue8m0Layout::kRowMajor ? c.T * W
                                                                       : W * ((c.T + 3) / 4 * 4);
  std::string err = diff_bytes(what + " values", storage_bytes(want.values, c.T * c.H),
                               storage_bytes(got.values, c.T * c.H));
  if (err.empty())
    err = diff_bytes(what + " scales (whole storage)", storage_bytes(want.scales, scale_elems),
                     storage_bytes(got.scales, scale_elems));
  return err;
}

std::string check_nvfp4(const QuantCase& c, int scale_kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> x = make_x(c.T, c.H, rng);
  float amax = 0.0f;
  for (uint16_t v : x) {
    const float f = std::fabs(detail::bf16_to_f32(v));
    if (std::isfinite(f)) amax = std::max(amax, f);
  }
  // What engines pass (448 * 6 / amax), 1, and extremes that drive block scales to 0 / 448.
  const float gs[] = {amax > 0 ? 448.0f * 6.0f / amax : 1.0f, 1.0f, 1e-20f, 3e30f};
  const float global_scale = gs[scale_kind];
  const TensorView xh = TensorView::contiguous(x.data(), DType::kBF16, {c.T, c.H});
  const detail::QuantizedTensor want =
      detail::quantize_nvfp4(xh, global_scale, default_allocator(), nullptr);
  const DeviceX dx = upload_x(x, c.T, c.H, c.layout);
  cudaStream_t stream = nullptr;
  if (c.own_stream) CUDA_OK(cudaStreamCreate(&stream));
  const detail::QuantizedTensor got =
      detail::quantize_nvfp4(dx.view, global_scale, poison_allocator(), stream);
  if (stream) {
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
  }
  const std::string what = "nvfp4 global_scale=" + std::to_string(global_scale) + " " + describe(c);
  std::string err = diff_bytes(what + " values", storage_bytes(want.values, c.T * c.H / 2),
                               storage_bytes(got.values, c.T * c.H / 2));
  if (err.empty())
    err = diff_bytes(what + " scales", storage_bytes(want.scales, c.T * c.H / 16),
                     storage_bytes(got.scales, c.T * c.H / 16));
  return err;
}

TEST(QuantGpu, Fp8MatchesCpuBitForBit) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    int n = 0;
    uint64_t seed = 1;
    for (const QuantCase& c : quant_cases(128)) {
      for (const auto& [ue8m0, layout] :
           {std::pair{false, Ue8m0Layout::kColumnMajor}, std::pair{true, Ue8m0Layout::kColumnMajor},
            std::pair{true, Ue8m0Layout::kRowMajor}}) {
        const std::string e = check_fp8(c, ue8m0, layout, seed++);
        if (!e.empty()) errors += e + "\n";
        ++n;
      }
    }
    std::fprintf(stderr, "fp8: %d cases compared\n", n);
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the differing bytes";
}

// ue8m0_to_column_major (the Dispatcher's ht re-layout of received UE8M0 words) on the device
// against the host: random words [T, W] contiguous, with padded rows or transposed; every byte of
// the column-major storage [W, align4(T)] (padding tokens 0 over the 0xFF poison).
std::string check_ue8m0_relayout(const QuantCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t W = (c.H / 128 + 3) / 4, padded = (c.T + 3) / 4 * 4;
  const int layout = static_cast<int>(c.layout);  // 0 contiguous, 1 padded rows, 2 transposed
  const int64_t row_stride = layout == 1 ? W + 5 : W;
  std::vector<int32_t> host(static_cast<size_t>(std::max<int64_t>(c.T, 1) * row_stride));
  for (auto& v : host) v = static_cast<int32_t>(rng());
  TensorView hv = TensorView::contiguous(host.data(), DType::kI32, {c.T, W});
  hv.strides = layout == 2 ? std::array<int64_t, kMaxDims>{1, c.T}
                           : std::array<int64_t, kMaxDims>{row_stride, 1};
  const Tensor want = detail::ue8m0_to_column_major(hv, default_allocator());
  const Tensor dev =
      gpu_testing::to_device(host, DType::kI32, {static_cast<int64_t>(host.size())}, 0);
  TensorView dv = hv;
  dv.data = dev.data;
  dv.device = Device::cuda(0);
  cudaStream_t stream = nullptr;
  if (c.own_stream) CUDA_OK(cudaStreamCreate(&stream));
  const Tensor got = detail::ue8m0_to_column_major(dv, poison_allocator(), stream);
  if (stream) {
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
  }
  const std::string what = "ue8m0 re-layout " +
                           std::string(layout == 0   ? "contiguous "
                                       : layout == 1 ? "padded-rows "
                                                     : "transposed ") +
                           describe(c);
  if (got.shape != want.shape || got.strides != want.strides || got.strides[1] != padded)
    return what + ": output shape or strides differ from the cpu path's";
  return diff_bytes(what + " (whole storage)", storage_bytes(want, W * padded),
                    storage_bytes(got, W * padded));
}

TEST(QuantGpu, Ue8m0ReLayoutMatchesCpuBitForBit) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    int n = 0;
    uint64_t seed = 7;
    for (const QuantCase& c : quant_cases(128)) {
      const std::string e = check_ue8m0_relayout(c, seed++);
      if (!e.empty()) errors += e + "\n";
      ++n;
    }
    std::fprintf(stderr, "ue8m0 re-layout: %d cases compared\n", n);
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the differing bytes";
}

TEST(QuantGpu, Nvfp4MatchesCpuBitForBit) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    int n = 0;
    uint64_t seed = 1000;
    for (const QuantCase& c : quant_cases(16))
      for (int kind = 0; kind < 4; ++kind) {
        const std::string e = check_nvfp4(c, kind, seed++);
        if (!e.empty()) errors += e + "\n";
        ++n;
      }
    std::fprintf(stderr, "nvfp4: %d cases compared\n", n);
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the differing bytes";
}

// ---- NVFP4 scale interleave ---------------------------------------------------------------

// nvfp4_block_scale_interleave of cuda tensors (one kernel on a created stream) against the cpu
// path, every output byte (padding included, after poisoning): 2-D and batched shapes with
// partial row and column tiles, u8 / e4m3 / bf16, contiguous and strided (every other column)
// inputs; plus DeepSeek's ll shape ([L, RT, H/16] with RT = 1024, H = 7168).
TEST(QuantGpu, Nvfp4InterleaveMatchesCpuBitForBit) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    std::mt19937_64 rng(17);
    const std::vector<std::vector<int64_t>> shapes = {
        {1, 1}, {128, 4}, {130, 5}, {300, 10}, {2, 127, 6}, {3, 33, 1}, {4, 0, 4}, {8, 1024, 448}};
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreate(&stream));
    for (const auto& shape : shapes)
      for (DType dtype : {DType::kU8, DType::kF8E4M3, DType::kBF16})
        for (bool strided : {false, true}) {
          const bool batched = shape.size() == 3;
          const int64_t B = batched ? shape[0] : 1, rows = shape[shape.size() - 2];
          const int64_t cols = shape.back(), step = strided ? 2 : 1;
          const size_t elem = dtype_size(dtype);
          std::vector<uint8_t> host(std::max<int64_t>(B * rows * cols * step, 1) * elem);
          for (auto& b : host) b = static_cast<uint8_t>(rng());
          TensorView h = TensorView::contiguous(host.data(), dtype, shape);
          h.strides[h.ndim - 1] = step;
          h.strides[h.ndim - 2] = cols * step;
          if (batched) h.strides[0] = rows * cols * step;
          const Tensor d_in = gpu_testing::to_device(host.data(), host.size(), DType::kU8,
                                                     {static_cast<int64_t>(host.size())}, 0);
          TensorView d = h;
          d.data = d_in.data;
          d.device = Device::cuda(0);
          const Tensor want = nvfp4_block_scale_interleave(h);
          const Tensor got = nvfp4_block_scale_interleave(d, poison_allocator(), stream);
          CUDA_OK(cudaStreamSynchronize(stream));
          const std::string what = "interleave " + h.describe();
          if (got.device != Device::cuda(0) || got.dtype != dtype || got.ndim != 1 ||
              got.shape[0] != want.shape[0]) {
            errors += what + ": got " + got.describe() + "\n";
            continue;
          }
          const std::string e = diff_bytes(what, storage_bytes(want, want.shape[0]),
                                           storage_bytes(got, got.shape[0]));
          if (!e.empty()) errors += e + "\n";
        }
    CUDA_OK(cudaStreamDestroy(stream));
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the differing bytes";
}

// ---- topk narrowing
// ------------------------------------------------------------------------------

TEST(QuantGpu, NarrowTopkMatchesCpu) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    std::mt19937_64 rng(7);
    for (int64_t T : {0, 1, 5, 1000, 70000})
      for (int K : {1, 4, 9})
        for (int variant = 0; variant < 4; ++variant) {  // i64, i32, strided i64, transposed i64
          const bool i32 = variant == 1;
          // Storage [rows_s, cols_s]; the view [T, K] picks strides into it.
          const int64_t rows_s = variant == 3 ? K : T,
                        cols_s = variant == 3 ? T : K + 2 * (variant == 2);
          std::vector<int64_t> v(static_cast<size_t>(rows_s * cols_s));
          for (auto& id : v) {
            const int pick = static_cast<int>(rng() % 20);
            id = pick == 0   ? (int64_t{1} << 33) + 5
                 : pick == 1 ? -(int64_t{1} << 40)
                 : pick == 2 ? int64_t{std::numeric_limits<int32_t>::max()}
                 : pick == 3 ? int64_t{std::numeric_limits<int32_t>::min()}
                             : static_cast<int64_t>(rng() % 300) - 2;
          }
          std::vector<int32_t> v32(v.begin(), v.end());
          std::array<int64_t, kMaxDims> strides{};
          strides[0] = variant == 3 ? 1 : cols_s;
          strides[1] = variant == 3 ? T : 1;
          TensorView host = i32 ? TensorView::contiguous(v32.data(), DType::kI32, {T, K})
                                : TensorView::contiguous(v.data(), DType::kI64, {T, K});
          host.strides = strides;
          Tensor dev = i32 ? gpu_testing::to_device(v32, DType::kI32, {rows_s * cols_s}, 0)
                           : gpu_testing::to_device(v, DType::kI64, {rows_s * cols_s}, 0);
          TensorView dview = host;
          dview.data = dev.data;
          dview.device = Device::cuda(0);
          const Tensor want = detail::narrow_topk_idx(host, default_allocator());
          const Tensor got = detail::narrow_topk_idx(dview, poison_allocator());
          const std::string e =
              diff_bytes("narrow T=" + std::to_string(T) + " K=" + std::to_string(K) + " variant " +
                             std::to_string(variant),
                         storage_bytes(want, T * K), storage_bytes(got, T * K));
          if (!e.empty()) errors += e + "\n";
        }
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr";
}

// ---- expert load
// ----------------------------------------------------------------------------------

std::string load_str(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 16; ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + (v.size() > 16 ? ",..." : "");
}

TEST(QuantGpu, ExpertLoadKernelsMatchHostCounts) {
  EPX_REQUIRE_GPUS(1);
  const int rc = run_on_gpu([] {
    std::string errors;
    std::mt19937_64 rng(11);
    for (int L : {1, 3, 64, 13000}) {  // 13000 int32 bins exceed 48 KiB: global atomics
      detail::ExpertLoad host(L), dev(L);
      auto compare = [&](const std::string& after) {
        const std::vector<int64_t> want = host.read(nullptr), got = dev.read(nullptr);
        if (want != got)
          errors += "L=" + std::to_string(L) + " after " + after + ": device [" + load_str(got) +
                    "], host [" + load_str(want) + "]\n";
      };
      // Ids in [-2, L + 1] with duplicates; rows of `dup` repeat their previous entry.
      auto random_id = [&](int64_t lo, int64_t hi) {
        return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
      };
      for (int round = 0; round < 2; ++round) {
        for (int64_t rows : {0, 1, 37, 300000}) {  // 300000 rows: more than one grid covers
          for (bool i32 : {false, true}) {
            const int K = static_cast<int>(1 + rng() % 9);
            std::vector<int64_t> ids(static_cast<size_t>(rows * K));
            for (size_t i = 0; i < ids.size(); ++i)
              ids[i] = (i % K != 0 && rng() % 4 == 0) ? ids[i - 1] : random_id(-2, L + 1);
            std::vector<int32_t> ids32(ids.begin(), ids.end());
            const TensorView hv = i32 ? TensorView::contiguous(ids32.data(), DType::kI32, {rows, K})
                                      : TensorView::contiguous(ids.data(), DType::kI64, {rows, K});
            const Tensor d = i32 ? gpu_testing::to_device(ids32, DType::kI32, {rows, K}, 0)
                                 : gpu_testing::to_device(ids, DType::kI64, {rows, K}, 0);
            host.add_local_ids(hv, nullptr);
            dev.add_local_ids(d, nullptr);
            compare("local ids rows=" + std::to_string(rows) + (i32 ? " i32" : " i64"));
          }
        }
        {  // a2a: [R, M, K] global ids, counts per source, garbage (not -1) past the counts
          const int R = 3, rank = static_cast<int>(rng() % R), K = 5;
          const int64_t M = 50;
          std::vector<int32_t> ids(static_cast<size_t>(R * M * K));
          std::vector<int32_t> counts(R);
          for (int s = 0; s < R; ++s) counts[s] = static_cast<int32_t>(rng() % (M + 1));
          for (size_t i = 0; i < ids.size(); ++i)
            ids[i] = (i % K != 0 && rng() % 4 == 0)
                         ? ids[i - 1]
                         : static_cast<int32_t>(random_id(-1, int64_t{R} * L - 1));
          const Tensor d = gpu_testing::to_device(ids, DType::kI32, {R, M, K}, 0);
          const Tensor dc = gpu_testing::to_device(counts, DType::kI32, {R}, 0);
          host.add_global_ids(TensorView::contiguous(ids.data(), DType::kI32, {R, M, K}),
                              TensorView::contiguous(counts.data(), DType::kI32, {R}), rank,
                              nullptr);
          dev.add_global_ids(d, dc, rank, nullptr);
          compare("global ids rank=" + std::to_string(rank));
        }
        {  // ll: counts [L]
          std::vector<int32_t> counts(L);
          for (auto& v : counts) v = static_cast<int32_t>(rng() % 1000);
          const Tensor d = gpu_testing::to_device(counts, DType::kI32, {L}, 0);
          host.add_counts(TensorView::contiguous(counts.data(), DType::kI32, {L}), nullptr);
          dev.add_counts(d, nullptr);
          compare("counts");
        }
        host.reset(nullptr);
        dev.reset(nullptr);
        compare("reset");
        if (dev.read(nullptr) != std::vector<int64_t>(L, 0))
          errors += "L=" + std::to_string(L) + ": not zero after reset\n";
      }
    }
    return errors;
  });
  EXPECT_EQ(rc, 0) << "see stderr";
}

}  // namespace
}  // namespace epx
