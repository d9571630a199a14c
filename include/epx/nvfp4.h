// epx/nvfp4.h — NVFP4 helpers for the expert GEMMs (docs/semantics.md §8).
//
// nvfp4_block_scale_interleave: FlashInfer's function of that name (alias block_scale_interleave)
// — NVFP4 block scales [rows, cols] (or [B, rows, cols]) into the 128 x 4 tiled order CUTLASS's
// NVFP4 GEMMs read. Within one batch entry, scale (r, c) goes to
//     (r / 128) * 128 * pad4(cols) + (c / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4
// (integer division; pad4 / pad128 round up to a multiple of 4 / 128); batch entry b starts at
// b * pad128(rows) * pad4(cols); every other element (the padding) is 0. Example: 130 x 5 ->
// 256 x 8 = 2048 elements, scale (129, 4) at 1552.
// The ll NVFP4 dispatch already writes its received scales in this layout (epx/ll.h), so no
// interleave is needed after it.
#pragma once

#include "epx/tensor.h"

namespace epx {

// sf: [rows, cols] or [B, rows, cols] of u8, fp8 e4m3 or bf16, any strides, on the cpu or a cuda
// device. Returns a contiguous 1-D tensor of B * pad128(rows) * pad4(cols) elements of sf's dtype
// on sf's device, from `alloc` (default_allocator() when empty). cuda tensors: one kernel queued
// on `stream`, no host wait (capturable); the cpu computes it on the calling thread. A build
// without CUDA raises Unsupported for cuda tensors. Anything else is InvalidArgument.
Tensor nvfp4_block_scale_interleave(const TensorView& sf, const Allocator& alloc = {},
                                    Stream stream = nullptr);

}  // namespace epx
