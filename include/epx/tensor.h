// epx/tensor.h — framework-free tensor views, owning tensors and allocators.
//
// epx never includes torch. Inputs arrive as TensorView (pointer, dtype, shape, strides in
// elements, device); outputs are Tensor (a view plus shared ownership of its storage), created
// through an Allocator the caller may supply (the Python layer passes one that allocates torch
// tensors from PyTorch's caching allocator; C++ callers get malloc / cudaMalloc by default).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace epx {

enum class DType : uint8_t {
  kBF16,     // bfloat16
  kF16,      // float16 (accepted where noted)
  kF32,      // float32
  kF8E4M3,   // fp8 e4m3fn
  kI32,      // int32
  kI64,      // int64
  kU8,       // uint8 / opaque bytes (NVFP4 packed values, UE8M0 bytes)
  kBool,     // bool, one byte
};

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA ordinal; 0 for CPU
  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceType::kCuda, index}; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:1"
};

// An opaque stream handle: a cudaStream_t cast to void* (nullptr = legacy default stream).
// The cpu backend runs every operation synchronously on the calling thread and ignores it.
using Stream = void*;

inline constexpr int kMaxDims = 6;

// A non-owning view. Strides are in elements (as in PyTorch). ndim == 0 with data == nullptr is
// "absent" (optional arguments).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kU8;
  Device device;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  // A contiguous (row-major) view of `data`.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());

  bool defined() const { return ndim > 0 || data != nullptr; }
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  // Typed access to the base pointer.
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // "bf16[4096, 7168] strides [7168, 1] on cuda:0" — used in error messages.
  std::string describe() const;
};

// An owning tensor: the view plus a reference that keeps its storage alive.
struct Tensor : TensorView {
  std::shared_ptr<void> storage;
};

// Allocates a contiguous tensor of `shape` on `device`. Must return memory aligned to 16 bytes.
using Allocator =
    std::function<Tensor(DType dtype, const std::vector<int64_t>& shape, Device device)>;

// aligned_alloc for CPU (64-byte aligned; blocks of 8 MiB or more 2 MiB aligned and advised to
// use transparent huge pages), cudaMalloc for CUDA (freed with cudaFree). Contents uninitialised.
Allocator default_allocator();

}  // namespace epx
