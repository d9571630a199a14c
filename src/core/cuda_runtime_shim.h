// src/core/cuda_runtime_shim.h — the few CUDA runtime services core code needs, without CUDA
// headers. Implemented in src/cuda/runtime.cc when built with CUDA, else src/core/cuda_stub.cc
// (which throws Unsupported).
#pragma once

#include <cstddef>
#include <memory>

#include "epx/tensor.h"

namespace epx::detail {

bool cuda_available();  // built with CUDA and at least one device visible
int cuda_device_count();
std::shared_ptr<void> cuda_alloc_shared(size_t bytes, int device);  // cudaMalloc / cudaFree
// Streams are cudaStream_t as void* (nullptr = the legacy default stream), used on `device`.
// True while `stream` is being captured into a CUDA graph (cudaStreamIsCapturing).
bool cuda_stream_is_capturing(Stream stream, int device);
// Orders `waiter` after the work queued so far on `waited` (an event recorded on `waited` and
// waited for on `waiter`; no host wait, capturable). Nothing when they are the same stream.
void cuda_stream_wait_stream(Stream waiter, Stream waited, int device);

}  // namespace epx::detail
