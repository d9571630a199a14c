// src/cuda/ll_send.h — the launcher of the hooked ll dispatch's send half (src/cuda/ll_send.cu).
#pragma once

#include <cuda_runtime.h>

namespace epx::detail {

struct LlDispatchParams;

// One launch of the send-only dispatch kernel of p's form (LlQuant from use_fp8 / use_nvfp4,
// kShrink = symm.shrink) on `ctas` CTAs; p.phases is kLlPhaseSend. Errors name `what`.
void launch_ll_dispatch_send(int ctas, cudaStream_t stream, const char* what,
                             const LlDispatchParams& p);

}  // namespace epx::detail
