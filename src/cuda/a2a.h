// src/cuda/a2a.h — the cuda a2a mode's entry points for the factories (defined in
// src/cuda/a2a.cu, where CudaA2a lives).
#pragma once

#include <cstddef>
#include <memory>

#include "core/buffer_impl.h"

namespace epx::detail {

std::unique_ptr<A2aImpl> cuda_a2a_create(const Group& group, const A2aShape& shape);
size_t cuda_a2a_layout_bytes(const A2aShape& shape, int num_ranks);

}  // namespace epx::detail
