"""NVFP4 helpers for the expert GEMMs: epx.nvfp4_block_scale_interleave (docs/semantics.md §8).

The permutation runs in epx's C++ core (include/epx/nvfp4.h): on the calling thread for CPU
tensors, as one kernel on the current stream for CUDA tensors (no host wait, capturable).
"""

import torch

from . import _epx, _torch, errors

# Element types the core permutes as they are; other one-byte dtypes travel as uint8 bits.
_NATIVE = frozenset((torch.uint8, torch.bfloat16, _torch.FP8_DTYPE))


@_torch.plain_torch
def nvfp4_block_scale_interleave(unswizzled_sf):
    """FlashInfer's ``nvfp4_block_scale_interleave`` (``block_scale_interleave``): the NVFP4 block
    scale factors ``[rows, cols]`` or ``[batch, rows, cols]`` (one byte each: uint8 / int8 /
    float8, or bfloat16; any strides) in the 128x4-tiled order CUTLASS's NVFP4 GEMMs read, as one
    flat tensor of ``batch * pad128(rows) * pad4(cols)`` elements of the input's dtype on its
    device (padding 0). Within one batch entry, scale ``(r, c)`` lands at

        (r // 128) * 128 * pad4(cols) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
        + c % 4

    i.e. 128-row x 4-column tiles (512 elements), row tiles outermost, and inside a tile the 32
    rows r, r + 32, r + 64, r + 96 interleaved, each with its 4 columns contiguous. Example:
    130 x 5 -> 256 x 8 = 2048 elements, scale (129, 4) at 1552. The scales of an ll NVFP4
    dispatch are already in this layout (per local expert)."""
    op = "nvfp4_block_scale_interleave"
    sf = unswizzled_sf
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3):
        raise errors.invalid(op, "argument 'unswizzled_sf' must be a torch.Tensor [rows, cols] or "
                             "[batch, rows, cols]")
    if not (sf.element_size() == 1 and sf.dtype != torch.bool or sf.dtype == torch.bfloat16):
        raise errors.invalid(op, f"argument 'unswizzled_sf' has dtype {sf.dtype}, expected a "
                             "one-byte dtype (uint8, float8_e4m3fn, ...) or bfloat16")
    src = sf if sf.dtype in _NATIVE else sf.view(torch.uint8)
    out = _epx.nvfp4_block_scale_interleave(src, _torch.stream_of(src))
    return out if out.dtype == sf.dtype else out.view(sf.dtype)
