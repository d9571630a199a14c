// GPU tier: the dispatch-quantisation, topk-narrowing and expert-load kernels of
// src/cuda/quant.cu against the cpu path (src/core/quant.cc, src/core/expert_load.cc) bit for bit,
// and the Dispatcher on cuda tensors against the Dispatcher on the cpu backend. Skipped, with the
// reason, where no GPU (or fewer GPUs than ranks) is visible.
//
// Kernel checks (one forked child on GPU 0; the test process never initialises CUDA, as in the
// other GPU suites): random bf16 rows plus adversarial ones (all zero, huge incl. +-inf, tiny and
// subnormal, NaN, random bit patterns, mixed groups); x contiguous, with padded 16-byte aligned
// rows, or misaligned (scalar load paths); the default stream and a created one. Every byte of
// every output storage is compared (fp8 values, f32 scales, UE8M0 words incl. the padding tokens
// and unused group bytes, NVFP4 values and scales), after the device outputs were poisoned with
// 0xFF. The UE8M0 re-layout (row-major words -> column-major, TMA-aligned; ht's x_scale) from
// contiguous, padded-row and transposed words, every storage byte incl. the padding tokens.
// Narrowing: int64/int32 ids, out-of-int32-range ids, strided and transposed views.
// Expert load: local ids (int64/int32, duplicates, -1, out of range), a2a global ids with
// counts and garbage past them, ll counts, small and shared-memory-exceeding L, more rows than one
// grid covers, reset; the device counter against the host counter after every call.
//
// Dispatcher: the same sequence of calls (a2a with bf16/fp8/fp8_ue8m0/nvfp4, deepep auto with
// ht/ll switches, worst-case ht, int32 topk, T = 0 ranks) on the cpu backend (threads, in the
// parent) and on R = 1, 2 forked cuda ranks; every valid received row, scale, routing row,
// masked_m, combine output and the expert load after every call must be identical, and ht's
// UE8M0 x_scale storage (MN-major, TMA-aligned, padding included) byte for byte. The cpu
// run's expert load is also checked against a count from the routing.
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

// `elems` elements from the start of t's storage (cpu or cuda), as bytes.
std::vector<uint8_t> storage_bytes(const TensorView& t, int64_t elems) {
  std::vector<uint8_t> out(static_cast<size_t>(elems) * dtype_size(t.dtype));
  if (out.empty()) return out;
  if (t.device.type == DeviceType::kCpu) {
    std::memcpy(out.data(), t.data, out.size());
  } else {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out.data(), t.data, out.size(), cudaMemcpyDeviceToHost));
  }
  return out;
}

// t's elements in logical row-major order (any strides), as bytes.
std::vector<uint8_t> logical_bytes(const TensorView& t) {
  const size_t es = dtype_size(t.dtype);
  int64_t n = 1, extent = 1;
  for (int d = 0; d < t.ndim; ++d) {
    n *= t.shape[d];
    extent += (t.shape[d] - 1) * t.strides[d];
  }
  if (n == 0) return {};
  const std::vector<uint8_t> raw = storage_bytes(t, extent);
  std::vector<uint8_t> out(static_cast<size_t>(n) * es);
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off = 0;
    for (int d = t.ndim - 1; d >= 0; --d) {
      off += (rem % t.shape[d]) * t.strides[d];
      rem /= t.shape[d];
    }
    std::memcpy(out.data() + i * es, raw.data() + off * es, es);
  }
  return out;
}

// "" when equal, else where the first difference is and how many bytes differ.
std::string diff_bytes(const std::string& what, const std::vector<uint8_t>& want,
                       const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return what + ": " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(want.size());
  size_t first = want.size(), count = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i]) {
      if (first == want.size()) first = i;
      ++count;
    }
  if (count == 0) return "";
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                ": %zu of %zu bytes differ, first at byte %zu (got 0x%02x, "
                "expected 0x%02x)",
                count, want.size(), first, got[first], want[first]);
  return what + buf;
}

// ---- inputs ----------------------------------------------------------------------------------

// [T, H] bf16: random rows plus, by row index, the adversarial kinds listed at the top.
std::vector<uint16_t> make_x(int64_t T, int64_t H, std::mt19937_64& rng) {
  std::vector<uint16_t> x = testing::make_bf16(T, H, rng);
  std::uniform_int_distribution<int> bit(0, 1);
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* row = x.data() + t * H;
    switch (t % 9) {
      case 0:
        std::fill(row, row + H, uint16_t{0});
        break;
      case 1:  // huge: exponents near the top, some +-inf
        for (int64_t h = 0; h < H; ++h)
          row[h] =
              static_cast<uint16_t>((bit(rng) << 15) | (0xFC + (rng() % 3)) << 7 | (rng() & 0x7F));
        row[rng() % H] = 0x7F80;
        row[rng() % H] = 0xFF80;
        break;
      case 2:  // tiny: subnormal and smallest normals (amax below the 1e-4 floor)
        for (int64_t h = 0; h < H; ++h)
          row[h] = static_cast<uint16_t>((bit(rng) << 15) | ((rng() % 3) << 7) | (rng() & 0x7F));
        break;
      case 3:  // NaNs in a normal row
        for (int i = 0; i < 5; ++i) row[rng() % H] = (i % 2) ? 0x7FC0 : 0xFFC1;
        break;
      case 4:  // random bit patterns: every class of value
        for (int64_t h = 0; h < H; ++h) row[h] = static_cast<uint16_t>(rng());
        break;
      case 5:  // mixed groups: a zero group, one huge value, -0.0
        std::fill(row, row + std::min<int64_t>(H, 16), uint16_t{0x8000});
        row[H - 1] = f32_to_bf16(3.0e5f);
        break;
      default:
        break;  // random normal rows
    }
  }
  return x;
}

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

// ---- the Dispatcher on cuda vs on cpu
// -------------------------------------------------------------

struct DispCase {
  std::string name;
  DispatcherBackend backend;
  DispatchMode mode;
  DispatchQuant quant;
  int64_t num_worst_tokens;  // in units of R * T_max (0 or 1)
  bool hook;
  bool topk_i32;
};

constexpr int kE = 8, kK = 4, kCalls = 6;
constexpr int64_t kH = 640, kTMax = 24;  // H / 128 = 5 groups: a partial UE8M0 word

struct RankCall {
  std::vector<uint16_t> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  int64_t T = 0;
};

struct Problem {
  int R = 1;
  std::vector<std::vector<RankCall>> calls;  // [call][rank]
  std::vector<ForwardMode> modes;            // [call]
};

// `graph`: decode calls only, each rank's T the same in every call (a captured graph's shapes).
Problem make_problem(int R, uint64_t seed, int num_calls = kCalls, bool graph = false) {
  std::mt19937_64 rng(seed);
  Problem p;
  p.R = R;
  const auto routings = testing::all_routings();
  for (int c = 0; c < num_calls; ++c) {
    p.modes.push_back(graph || c % 3 == 1 ? ForwardMode::kDecode : ForwardMode::kExtend);
    std::vector<RankCall> ranks;
    for (int r = 0; r < R; ++r) {
      RankCall rc;
      if (graph)
        rc.T = kTMax - 7 * r;
      else
        rc.T = (c + r) % 4 == 3 ? 0 : static_cast<int64_t>(1 + rng() % kTMax);
      rc.x = make_x(rc.T, kH, rng);
      rc.idx = testing::make_topk_idx(routings[(c + r) % routings.size()], rc.T, kK, kE, R, rng,
                                      static_cast<int>(rng() % kE));
      rc.w = testing::make_topk_weights(rc.idx, rng);
      ranks.push_back(std::move(rc));
    }
    p.calls.push_back(std::move(ranks));
  }
  return p;
}

// Tokens each source sends to `rank` in call c (a2a counts; their sum is ht's N).
std::vector<int64_t> tokens_to(const Problem& p, int c, int rank) {
  const int L = kE / p.R;
  std::vector<int64_t> n(p.R, 0);
  for (int s = 0; s < p.R; ++s) {
    const RankCall& rc = p.calls[c][s];
    for (int64_t t = 0; t < rc.T; ++t) {
      bool any = false;
      for (int k = 0; k < kK; ++k) any |= rc.idx[t * kK + k] >= 0 && rc.idx[t * kK + k] / L == rank;
      n[s] += any;
    }
  }
  return n;
}

// Expert load of `rank` implied by the routing of calls [from, to).
std::vector<int64_t> routing_load(const Problem& p, int rank, int from, int to) {
  const int L = kE / p.R;
  std::vector<int64_t> load(L, 0);
  for (int c = from; c < to; ++c)
    for (const RankCall& rc : p.calls[c])
      for (int64_t t = 0; t < rc.T; ++t)
        for (int l = 0; l < L; ++l) {
          bool sel = false;
          for (int k = 0; k < kK; ++k) sel |= rc.idx[t * kK + k] == rank * L + l;
          load[l] += sel;
        }
  return load;
}

using Records = std::vector<std::pair<std::string, std::vector<uint8_t>>>;

// Rows [begin, begin + n) of a logical byte image with `rows` rows.
std::vector<uint8_t> row_range(const std::vector<uint8_t>& all, int64_t rows, int64_t begin,
                               int64_t n) {
  if (rows == 0 || n == 0) return {};
  const size_t rb = all.size() / static_cast<size_t>(rows);
  return std::vector<uint8_t>(all.begin() + begin * rb, all.begin() + (begin + n) * rb);
}

std::vector<uint8_t> as_bytes(const std::vector<int64_t>& v) {
  std::vector<uint8_t> b(v.size() * 8);
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

DispatcherConfig disp_config(const DispCase& dc, int R) {
  DispatcherConfig cfg;
  cfg.num_experts = kE;
  cfg.hidden = kH;
  cfg.top_k = kK;
  cfg.max_tokens_per_rank = kTMax;
  cfg.backend = dc.backend;
  cfg.mode = dc.mode;
  cfg.quant = dc.quant;
  cfg.num_worst_tokens = dc.num_worst_tokens * R * kTMax;
  cfg.return_recv_hook = dc.hook;
  return cfg;
}

// Host bytes -> `t` (cpu or cuda; cuda: queued on `stream`, then waited for).
void copy_in(const TensorView& t, const void* data, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (t.device.type == DeviceType::kCpu) {
    std::memcpy(t.data, data, bytes);
    return;
  }
  CUDA_OK(cudaMemcpyAsync(t.data, data, bytes, cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}

// `t` exists with exactly `shape` (then it is reused: the captured tensors of a graph run keep
// their addresses; eager calls whose shapes change get new ones).
bool same_shape(const Tensor& t, const std::vector<int64_t>& shape) {
  if (!t.defined() || t.ndim != static_cast<int>(shape.size())) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (t.shape[i] != shape[i]) return false;
  return true;
}

// One call's inputs as tensors on `device` (new ones, or the captured ones in `into`).
struct CallTensors {
  Tensor x, idx, w, y;
};

void load_inputs(CallTensors& t, const RankCall& in, bool topk_i32, Device device,
                 cudaStream_t stream) {
  auto make = [&](Tensor& dst, DType dtype, std::vector<int64_t> shape) {
    if (!same_shape(dst, shape)) dst = default_allocator()(dtype, shape, device);
  };
  make(t.x, DType::kBF16, {in.T, kH});
  make(t.idx, topk_i32 ? DType::kI32 : DType::kI64, {in.T, kK});
  make(t.w, DType::kF32, {in.T, kK});
  copy_in(t.x, in.x.data(), in.x.size() * 2, stream);
  if (topk_i32) {
    std::vector<int32_t> idx32(in.idx.begin(), in.idx.end());
    copy_in(t.idx, idx32.data(), idx32.size() * 4, stream);
  } else {
    copy_in(t.idx, in.idx.data(), in.idx.size() * 8, stream);
  }
  copy_in(t.w, in.w.data(), in.w.size() * 4, stream);
}

// The expert outputs of call c on rank r for `out` (random, from the call's seed) into t.y.
void load_y(CallTensors& t, const DispatchOutput& out, int R, int c, int r, Device device,
            cudaStream_t stream) {
  std::vector<int64_t> shape;
  if (out.format == OutputFormat::kA2a) shape = {R, kTMax, kH};
  if (out.format == OutputFormat::kHt) shape = {out.x.shape[0], kH};
  if (out.format == OutputFormat::kLl) shape = {kE / R, out.x.shape[1], kH};
  if (!same_shape(t.y, shape)) t.y = default_allocator()(DType::kBF16, shape, device);
  std::mt19937_64 yrng(1000003ull * c + r);
  const std::vector<uint16_t> yh = testing::make_bf16(t.y.numel() / kH, kH, yrng);
  copy_in(t.y, yh.data(), yh.size() * 2, stream);
}

// What call c's outputs must agree on between the cpu and the cuda runs.
void record_outputs(Records& rec, const DispatcherConfig& cfg, const Problem& p, int c, int r,
                    const DispatchOutput& out) {
  const int R = p.R;
  auto put = [&](const std::string& what, const TensorView& t) {
    rec.emplace_back(what, t.defined() ? logical_bytes(t) : std::vector<uint8_t>{});
  };
  const std::string tag = "call " + std::to_string(c) + " ";
  rec.emplace_back(tag + "format", std::vector<uint8_t>{static_cast<uint8_t>(out.format)});
  const std::vector<int64_t> from = tokens_to(p, c, r);
  if (out.format == OutputFormat::kA2a) {
    // Valid rows of every source; the routing payload whole (padding rows must be -1).
    const int64_t M = kTMax;
    const std::pair<const char*, const TensorView*> rows_of[] = {
        {"x", &out.x}, {"x_scale", &out.x_scale}, {"topk_weights", &out.topk_weights}};
    for (const auto& [name, t] : rows_of) {
      if (!t->defined()) continue;
      const std::vector<uint8_t> all = logical_bytes(*t);
      for (int s = 0; s < R; ++s)
        rec.emplace_back(tag + name + " from " + std::to_string(s),
                         row_range(all, R * M, s * M, from[s]));
    }
    put(tag + "topk_idx", out.topk_idx);
  } else if (out.format == OutputFormat::kHt) {
    int64_t N = 0;
    for (int64_t n : from) N += n;
    const int64_t rows = out.x.shape[0];
    if (rows != (cfg.num_worst_tokens > 0 ? cfg.num_worst_tokens : N))
      throw std::runtime_error(tag + "ht returned " + std::to_string(rows) + " rows, expected " +
                               std::to_string(cfg.num_worst_tokens > 0 ? cfg.num_worst_tokens : N));
    rec.emplace_back(tag + "x", row_range(logical_bytes(out.x), rows, 0, N));
    if (out.x_scale.defined())
      rec.emplace_back(tag + "x_scale", row_range(logical_bytes(out.x_scale), rows, 0, N));
    if (out.x_scale.defined() && out.x_scale.dtype == DType::kI32) {
      // UE8M0: MN-major, TMA-aligned (strides {1, align4(rows)}); the whole storage
      // [W, align4(rows)] byte for byte, padding and worst-case rows (0) included.
      const int64_t M = out.x_scale.strides[1];
      if (out.x_scale.strides[0] != 1 || M != (rows + 3) / 4 * 4)
        throw std::runtime_error(tag + "ht UE8M0 x_scale has strides " + out.x_scale.describe() +
                                 ", expected {1, align4(rows)}");
      rec.emplace_back(tag + "x_scale storage",
                       storage_bytes(out.x_scale, out.x_scale.shape[1] * M));
    }
    put(tag + "topk_idx", out.topk_idx);  // rows past N: -1
    rec.emplace_back(tag + "topk_weights", row_range(logical_bytes(out.topk_weights), rows, 0, N));
    std::vector<int64_t> n32(out.num_recv_tokens_per_expert.begin(),
                             out.num_recv_tokens_per_expert.end());
    rec.emplace_back(tag + "num_recv_tokens_per_expert", as_bytes(n32));
  } else {
    put(tag + "masked_m", out.masked_m);
    rec.emplace_back(tag + "expected_m", as_bytes({out.expected_m}));
  }
}

// The combine output and the expert load after call c (reset after the middle call).
void record_combine(Records& rec, Dispatcher& d, int c, int num_calls, const TensorView& combined) {
  const std::string tag = "call " + std::to_string(c) + " ";
  rec.emplace_back(tag + "combine out",
                   combined.defined() ? logical_bytes(combined) : std::vector<uint8_t>{});
  rec.emplace_back(tag + "expert_load", as_bytes(d.expert_load()));
  if (c == num_calls / 2) {
    d.reset_expert_load();
    rec.emplace_back(tag + "expert_load after reset", as_bytes(d.expert_load()));
  }
}

// Runs the problem's calls on one rank (cpu or cuda tensors; cuda on `stream`) and records what
// must agree.
Records run_calls(const Group& g, const DispCase& dc, const Problem& p, Device device,
                  cudaStream_t stream = nullptr) {
  const int R = p.R, r = g.rank(), num_calls = static_cast<int>(p.calls.size());
  const DispatcherConfig cfg = disp_config(dc, R);
  Dispatcher d(g, cfg);
  Records rec;
  for (int c = 0; c < num_calls; ++c) {
    CallTensors t;
    load_inputs(t, p.calls[c][r], dc.topk_i32, device, stream);
    const std::optional<float> gs =
        dc.quant == DispatchQuant::kNvfp4 ? std::optional<float>(1.5f) : std::nullopt;
    DispatchOutput out = d.dispatch(t.x, t.idx, t.w, p.modes[c], gs, stream);
    record_outputs(rec, cfg, p, c, r, out);
    load_y(t, out, R, c, r, device, stream);
    CombineInput ci;
    ci.y = t.y;  // on the dispatch's stream
    const Tensor combined = d.combine(ci);
    record_combine(rec, d, c, num_calls, combined);
  }
  return rec;
}

// The same calls with call 0 eager and call 1 captured into a CUDA graph on a non-blocking
// stream (global capture mode: any legacy-stream or device-wide synchronisation inside the
// Dispatcher fails the capture); calls 1.. are replays on new inputs copied into the captured
// input tensors. Every rank's T is the same in every call (p from make_graph_problem).
Records run_graph_calls(const Group& g, const DispCase& dc, const Problem& p) {
  const int R = p.R, r = g.rank(), num_calls = static_cast<int>(p.calls.size());
  const Device device = Device::cuda(r);
  DispatcherConfig cfg = disp_config(dc, R);
  gpu_testing::Arena arena;
  cfg.allocator = arena.allocator();
  Dispatcher d(g, cfg);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  CallTensors t;  // the captured inputs
  DispatchOutput out;
  Tensor combined;
  Records rec;
  for (int c = 0; c < num_calls; ++c) {
    load_inputs(t, p.calls[c][r], dc.topk_i32, device, stream);
    if (c <= 1) {
      cudaGraph_t graph = nullptr;
      if (c == 1) {
        arena.replay();
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      }
      out = d.dispatch(t.x, t.idx, t.w, p.modes[c], std::nullopt, stream);
      if (c == 0) load_y(t, out, R, c, r, device, stream);  // allocates the captured y
      CombineInput ci;
      ci.y = t.y;
      combined = d.combine(ci);
      if (c == 1) {
        CUDA_OK(cudaStreamEndCapture(stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
        CUDA_OK(cudaGraphDestroy(graph));
      }
    }
    if (c >= 1) {
      load_y(t, out, R, c, r, device, stream);
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    record_outputs(rec, cfg, p, c, r, out);
    record_combine(rec, d, c, num_calls, combined);
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaStreamDestroy(stream));
  return rec;
}

// ht exact mode called while its stream is capturing raises Unsupported naming the ways out
// (before queueing anything, on every rank alike: no rank waits for another).
std::string ht_exact_under_capture(const Group& g) {
  DispatcherConfig cfg = disp_config({"ht_exact", DispatcherBackend::kDeepEp,
                                      DispatchMode::kNormal, DispatchQuant::kBf16, 0, false, false},
                                     g.size());
  Dispatcher d(g, cfg);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Problem p = make_problem(g.size(), 7);
  CallTensors t;
  load_inputs(t, p.calls[0][g.rank()], false, Device::cuda(g.rank()), stream);
  std::string err = "ht exact mode under capture did not raise";
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  try {
    d.dispatch(t.x, t.idx, t.w, ForwardMode::kExtend, std::nullopt, stream);
  } catch (const Error& e) {
    const std::string what = e.what();
    err = e.code() == ErrorCode::kUnsupported && what.find("num_worst_tokens") != std::string::npos &&
                  what.find("captur") != std::string::npos
              ? ""
              : "unexpected error: " + what;
  }
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  if (err.empty() && std::string(d.stage_name()) != "initial")
    err = std::string("stage after the refused dispatch is ") + d.stage_name();
  CUDA_OK(cudaStreamDestroy(stream));
  return err;
}

std::string compare_records(const Records& want, const Records& got) {
  if (want.size() != got.size())
    return std::to_string(got.size()) + " records, expected " + std::to_string(want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i].first != got[i].first)
      return "record " + got[i].first + ", expected " + want[i].first;
    const std::string e = diff_bytes(want[i].first, want[i].second, got[i].second);
    if (!e.empty()) return e;
  }
  return "";
}

std::vector<DispCase> disp_cases() {
  using B = DispatcherBackend;
  using M = DispatchMode;
  using Q = DispatchQuant;
  return {
      {"a2a_bf16", B::kA2a, M::kAuto, Q::kBf16, 0, false, false},
      {"a2a_fp8", B::kA2a, M::kNormal, Q::kFp8, 0, false, true},
      {"a2a_fp8_ue8m0", B::kA2a, M::kAuto, Q::kFp8Ue8m0, 0, false, false},
      {"a2a_nvfp4", B::kA2a, M::kAuto, Q::kNvfp4, 0, false, false},
      {"deepep_auto_fp8_hook", B::kDeepEp, M::kAuto, Q::kFp8, 0, true, false},
      {"deepep_auto_ue8m0_worst", B::kDeepEp, M::kAuto, Q::kFp8Ue8m0, 1, false, false},
      {"deepep_normal_ue8m0", B::kDeepEp, M::kNormal, Q::kFp8Ue8m0, 0, false, false},
      {"deepep_normal_bf16_i32", B::kDeepEp, M::kNormal, Q::kBf16, 0, false, true},
  };
}

class DispatcherGpu : public ::testing::TestWithParam<int> {};

TEST_P(DispatcherGpu, CudaMatchesCpuBackend) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  const std::vector<DispCase> cases = disp_cases();
  std::vector<Problem> problems;
  std::vector<std::vector<Records>> want(cases.size(), std::vector<Records>(R));
  for (size_t i = 0; i < cases.size(); ++i) {
    problems.push_back(make_problem(R, 100 + i));
    testing::run_threads(R, [&](const Group& g) {
      want[i][g.rank()] = run_calls(g, cases[i], problems[i], Device::cpu());
    });
    // The cpu run against the routing: load after each call (reset after call kCalls / 2).
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCalls; ++c) {
        const int from = c <= kCalls / 2 ? 0 : kCalls / 2 + 1;
        const std::string key = "call " + std::to_string(c) + " expert_load";
        for (const auto& [name, bytes] : want[i][r])
          if (name == key)
            ASSERT_EQ(bytes, as_bytes(routing_load(problems[i], r, from, c + 1)))
                << cases[i].name << " rank " << r << " " << key;
      }
  }
  // Each case on the legacy default stream and on a created non-blocking stream.
  const int rc = gpu_testing::run_cuda_ranks(R, [&](const Group& g) {
    int failures = 0;
    cudaStream_t created = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    for (cudaStream_t stream : {cudaStream_t{nullptr}, created}) {
      for (size_t i = 0; i < cases.size() && failures == 0; ++i) {
        std::string err;
        try {
          err = compare_records(
              want[i][g.rank()],
              run_calls(g, cases[i], problems[i], Device::cuda(g.rank()), stream));
        } catch (const std::exception& e) {
          err = std::string("exception: ") + e.what();
        }
        if (!err.empty()) {
          std::fprintf(stderr, "rank %d %s (%s stream): %s\n", g.rank(), cases[i].name.c_str(),
                       stream ? "created" : "default", err.c_str());
          ++failures;  // stop: after an exception the group may be unusable
        }
      }
    }
    return failures == 0 ? 0 : 1;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the first difference per case";
}

// The capturable paths: ll (bf16 and fp8, with and without return_recv_hook), a2a and ht
// worst-case mode, each dispatch + combine captured on a side stream and replayed kGraphCalls - 1
// times on new inputs; every replay's outputs, combine and expert load against the cpu backend
// run eagerly on the same calls. Then ht exact mode under capture must raise Unsupported.
TEST_P(DispatcherGpu, CapturedGraphReplaysMatchCpuBackend) {
  const int R = GetParam();
  EPX_REQUIRE_GPUS(R);
  constexpr int kGraphCalls = 12;  // 1 eager + 11 replays
  using B = DispatcherBackend;
  using M = DispatchMode;
  using Q = DispatchQuant;
  const std::vector<DispCase> cases = {
      {"ll_bf16", B::kDeepEp, M::kLowLatency, Q::kBf16, 0, false, false},
      {"ll_bf16_hook", B::kDeepEp, M::kLowLatency, Q::kBf16, 0, true, true},
      {"ll_fp8", B::kDeepEp, M::kLowLatency, Q::kFp8, 0, false, false},
      {"ll_fp8_hook_auto", B::kDeepEp, M::kAuto, Q::kFp8, 0, true, false},
      {"ll_ue8m0_hook", B::kDeepEp, M::kLowLatency, Q::kFp8Ue8m0, 0, true, false},
      {"a2a_bf16", B::kA2a, M::kNormal, Q::kBf16, 0, false, false},
      {"a2a_fp8", B::kA2a, M::kAuto, Q::kFp8, 0, false, true},
      {"ht_worst_fp8", B::kDeepEp, M::kNormal, Q::kFp8, 1, false, false},
  };
  std::vector<Problem> problems;
  std::vector<std::vector<Records>> want(cases.size(), std::vector<Records>(R));
  for (size_t i = 0; i < cases.size(); ++i) {
    problems.push_back(make_problem(R, 500 + i, kGraphCalls, /*graph=*/true));
    testing::run_threads(R, [&](const Group& g) {
      want[i][g.rank()] = run_calls(g, cases[i], problems[i], Device::cpu());
    });
  }
  const int rc = gpu_testing::run_cuda_ranks(R, [&](const Group& g) {
    for (size_t i = 0; i < cases.size(); ++i) {
      std::string err;
      try {
        err = compare_records(want[i][g.rank()], run_graph_calls(g, cases[i], problems[i]));
      } catch (const std::exception& e) {
        err = std::string("exception: ") + e.what();
      }
      if (!err.empty()) {
        std::fprintf(stderr, "rank %d graph %s: %s\n", g.rank(), cases[i].name.c_str(),
                     err.c_str());
        return 1;  // the group may be unusable now
      }
    }
    const std::string err = ht_exact_under_capture(g);
    if (!err.empty()) std::fprintf(stderr, "rank %d ht exact under capture: %s\n", g.rank(), err.c_str());
    return err.empty() ? 0 : 1;
  });
  EXPECT_EQ(rc, 0) << "see stderr for the first difference per case";
}

INSTANTIATE_TEST_SUITE_P(Ranks, DispatcherGpu, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "R" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace epx
