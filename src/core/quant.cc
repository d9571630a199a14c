// Host implementations of dispatch quantisation (formats in quant.h).
#include "core/quant.h"

#include <cstring>
#include <vector>

#include "core/check.h"

namespace epx::detail {

static void check_quant_input(const TensorView& x, int64_t multiple, const char* op) {
  check_defined(x, op, "x");
  check_dtype(x, op, "x", {DType::kBF16});
  check_shape(x, op, "x", {-1, -1});
  check_inner_contiguous(x, op, "x");
  EPX_CHECK_ARG(x.shape[1] % multiple == 0, op, ": argument 'x' has hidden size ", x.shape[1],
                ", expected a multiple of ", multiple);
  EPX_CHECK(x.device.type == DeviceType::kCpu, ErrorCode::kUnsupported, op,
            ": quantisation of ", x.device.str(),
            " tensors is not implemented yet (cpu tensors only)");
}

static int64_t align4(int64_t n) { return (n + 3) / 4 * 4; }

QuantizedTensor quantize_fp8(const TensorView& x, bool ue8m0, const Allocator& alloc) {
  check_quant_input(x, kQuantGroup, "quantize_fp8");
  const int64_t T = x.shape[0], H = x.shape[1], G = H / kQuantGroup;
  QuantizedTensor out;
  out.values = alloc(DType::kF8E4M3, {T, H}, x.device);
  std::vector<float> scales(static_cast<size_t>(G));
  if (!ue8m0) {
    out.scales = alloc(DType::kF32, {T, G}, x.device);
  } else {
    const int64_t words = (G + 3) / 4, padded = align4(T);
    out.scales = alloc(DType::kI32, {words, padded}, x.device);
    std::memset(out.scales.data, 0, out.scales.nbytes());
    out.scales.shape = {T, words};
    out.scales.strides = {1, padded};
  }
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = x.ptr<uint16_t>() + t * x.strides[0];
    quantize_row_fp8(row, H, /*round_scale=*/ue8m0,
                     out.values.ptr<uint8_t>() + t * H, scales.data());
    if (!ue8m0) {
      std::memcpy(out.scales.ptr<float>() + t * G, scales.data(), G * sizeof(float));
    } else {
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* word = reinterpret_cast<uint8_t*>(out.scales.ptr<int32_t>() +
                                                   (g / 4) * out.scales.strides[1] + t);
        word[g % 4] = ue8m0_of_scale(scales[g]);
      }
    }
  }
  return out;
}

QuantizedTensor quantize_nvfp4(const TensorView& x, float global_scale, const Allocator& alloc) {
  check_quant_input(x, kNvfp4Block, "quantize_nvfp4");
  EPX_CHECK_ARG(global_scale > 0.0f && global_scale < 3.0e38f,
                "quantize_nvfp4: argument 'global_scale' is ", global_scale,
                ", expected a finite value > 0");
  const int64_t T = x.shape[0], H = x.shape[1];
  QuantizedTensor out;
  out.values = alloc(DType::kU8, {T, H / 2}, x.device);
  out.scales = alloc(DType::kU8, {T, H / kNvfp4Block}, x.device);
  for (int64_t t = 0; t < T; ++t) {
    quantize_row_nvfp4(x.ptr<uint16_t>() + t * x.strides[0], H, global_scale,
                       out.values.ptr<uint8_t>() + t * (H / 2),
                       out.scales.ptr<uint8_t>() + t * (H / kNvfp4Block));
  }
  return out;
}

}  // namespace epx::detail
