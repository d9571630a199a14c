#include "epx/tensor.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "core/check.h"
#include "core/cuda_runtime_shim.h"

namespace epx {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kF8E4M3: case DType::kU8: case DType::kBool: return 1;
  }
  return 1;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF32: return "f32";
    case DType::kF8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
    case DType::kBool: return "bool";
  }
  return "?";
}

std::string Device::str() const {
  return type == DeviceType::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  EPX_CHECK_ARG(shape.size() <= static_cast<size_t>(kMaxDims), "TensorView: ", shape.size(),
                " dims, expected at most ", kMaxDims);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    stride *= shape[i] > 0 ? shape[i] : 1;
  }
  return v;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return ndim == 0 ? (data ? 1 : 0) : n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // as in PyTorch: an empty view is contiguous
  int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string s = std::string(dtype_name(dtype)) + detail::shape_str(*this) + " strides [";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(strides[i]);
  return s + "] on " + device.str();
}

Allocator default_allocator() {
  return [](DType dtype, const std::vector<int64_t>& shape, Device device) {
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    size_t bytes = t.nbytes();
    if (device.type == DeviceType::kCpu) {
      // Large blocks: 2 MiB aligned and transparent huge pages, so first touch costs one fault
      // per 2 MiB instead of one per 4 KiB (page faults dominate a first cpu-backend call).
      const size_t align = bytes >= (size_t(8) << 20) ? (size_t(2) << 20) : 64;
      size_t rounded = (bytes + align - 1) / align * align;
      void* p = std::aligned_alloc(align, rounded ? rounded : align);
      if (!p) throw std::bad_alloc();
      if (align > 64) madvise(p, rounded, MADV_HUGEPAGE);
      t.storage = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
    } else {
      t.storage = detail::cuda_alloc_shared(bytes, device.index);
    }
    t.data = t.storage.get();
    return t;
  };
}

}  // namespace epx
