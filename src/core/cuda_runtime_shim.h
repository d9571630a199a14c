// src/core/cuda_runtime_shim.h — the few CUDA runtime services core code needs, without CUDA
// headers. Implemented in src/cuda/runtime.cc when built with CUDA, else src/core/cuda_stub.cc
// (which throws Unsupported).
#pragma once

#include <cstddef>
#include <memory>

namespace epx::detail {

bool cuda_available();  // built with CUDA and at least one device visible
int cuda_device_count();
std::shared_ptr<void> cuda_alloc_shared(size_t bytes, int device);  // cudaMalloc / cudaFree

}  // namespace epx::detail
