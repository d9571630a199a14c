// src/core/host_view.h — element access to TensorViews held in host memory, the one definition of
// "element [i][j] through the strides" used by the cpu backend, the host-side validation and the
// Dispatcher. (tests/support's oracles deliberately do not use it: they stay independent.)
#pragma once

#include <cstdint>

#include "epx/tensor.h"

namespace epx::detail {

// Element [i][j] of a 2-D view of T, through its strides (in elements).
template <typename T>
T& element(const TensorView& v, int64_t i, int64_t j) {
  return v.ptr<T>()[i * v.strides[0] + j * v.strides[1]];
}

// topk_idx[t][k] of an int64 or int32 [T, K] view, widened to int64.
inline int64_t topk_at(const TensorView& v, int64_t t, int64_t k) {
  return v.dtype == DType::kI64 ? element<int64_t>(v, t, k) : element<int32_t>(v, t, k);
}

}  // namespace epx::detail
