"""Private to :mod:`epx.compat.flashinfer` (import the names from there): the stateless helpers
its MoeAlltoAll and the functional API share.

* Rank masks: ``MOE_A2A_RANK_MASK_WORDS``, :func:`moe_a2a_active_rank_mask` (FlashInfer's CPU
  uint64 bitmask) and ``_mask_bools`` (any accepted mask -> ep_size bools).
* Payload rows of any byte count: ``_pad_rows`` / ``_unpad_view`` (epx's a2a moves rows of a
  multiple of 4 bytes), ``_round4``.
* Low precision: ``_round_to_e4m3`` (the FP8 rounding of ``combine(use_low_precision=True)``,
  ``_LOW_PRECISION_DTYPES``) and :func:`nvfp4_block_scale_interleave`.
* ``_backend_name``: the backend a MoeAlltoAll (and the workspace sizing) picks by default.
"""

import math

import torch

from .. import _epx, errors

MOE_A2A_RANK_MASK_WORDS = 1  # one uint64 word: up to 64 ranks (FlashInfer's ABI)


def moe_a2a_active_rank_mask(active_ranks, ep_size):
    """CPU uint64 tensor [MOE_A2A_RANK_MASK_WORDS] with bit i set for each rank i of
    `active_ranks` (ranks that take part; e.g. [0, 1, 3] when rank 2 failed)."""
    mask = 0
    for rank in active_ranks:
        rank = int(rank)
        if not 0 <= rank < ep_size:
            raise errors.invalid("moe_a2a_active_rank_mask", f"rank {rank} is out of range, "
                                 f"expected 0..{ep_size - 1}")
        mask |= 1 << rank
    dtype = getattr(torch, "uint64", None)
    if dtype is None:  # older torch: the same 64 bits as int64
        return torch.tensor([mask - (1 << 64) if mask >= 1 << 63 else mask], dtype=torch.int64)
    return torch.tensor([mask], dtype=dtype)


def _mask_bools(op, active_rank_mask, ep_size):
    """active_rank_mask (uint64 tensor / int / sequence of bools) -> list of ep_size bools."""
    if isinstance(active_rank_mask, torch.Tensor):
        if active_rank_mask.numel() != MOE_A2A_RANK_MASK_WORDS:
            raise errors.invalid(op, f"argument 'active_rank_mask' has "
                                 f"{active_rank_mask.numel()} words, expected "
                                 f"{MOE_A2A_RANK_MASK_WORDS}")
        bits = int(active_rank_mask.reshape(-1)[0].item()) & ((1 << 64) - 1)
    elif isinstance(active_rank_mask, int):
        bits = active_rank_mask
    else:
        active = [bool(a) for a in active_rank_mask]
        if len(active) != ep_size:
            raise errors.invalid(op, f"argument 'active_rank_mask' has {len(active)} entries, "
                                 f"expected {ep_size}")
        return active
    return [bool(bits >> r & 1) for r in range(ep_size)]


def _round4(n):
    return (n + 3) // 4 * 4


#: Payload dtypes of combine(use_low_precision=True) (FlashInfer's combine dtypes but fp8).
_LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _round_to_e4m3(x):
    """float32 tensor of x's values rounded to FP8 e4m3 (fn: no infinities): the nearest e4m3
    value, ties to the even one, magnitudes above 448 (infinities too) saturated to 448, NaN
    kept -- the rounding of CUDA's saturating e4m3 conversion (cvt.rn.satfinite) that
    FlashInfer's low-precision combine applies to every row. Elementwise torch ops on x's
    device: no host synchronisation, capturable in CUDA graphs."""
    xf = x.float()
    mag = xf.abs().clamp(max=448.0)  # rounds to 448 at most; NaN stays NaN
    _, exp = torch.frexp(mag)  # mag = m * 2**exp, 0.5 <= m < 1
    # Spacing of the e4m3 values around mag: 2**(floor(log2 mag) - 3) = 2**(exp - 4) for normals,
    # 2**-9 below 2**-6 (subnormals: exp <= -5); built from its float32 bits, exactly.
    step = ((exp.clamp(-5, 9) + (127 - 4)).to(torch.int32) << 23).view(torch.float32)
    return torch.copysign(torch.round(mag / step) * step, xf)


def _pad_rows(payloads):
    """epx's a2a moves rows of a multiple of 4 bytes; FlashInfer takes any (e.g. a uint8 [T, 1]).
    -> (payloads with each other row copied into the first bytes of a zeroed uint8 [T,
    round4(bytes)], per payload None or (dtype, trailing shape, bytes) to undo it)."""
    if not isinstance(payloads, (list, tuple)):
        return payloads, []
    out, widths = [], []
    for p in payloads:
        n = p.element_size() * math.prod(p.shape[1:]) if isinstance(p, torch.Tensor) and \
            p.dim() >= 1 else 0
        if n % 4 == 0:
            out.append(p)
            widths.append(None)
            continue
        rows = p.contiguous().view(p.shape[0], n // p.element_size()).view(torch.uint8)
        padded = torch.zeros(p.shape[0], _round4(n), dtype=torch.uint8, device=p.device)
        padded[:, :n] = rows
        out.append(padded)
        widths.append((p.dtype, tuple(p.shape[1:]), n))
    return type(payloads)(out), widths


def _unpad_view(view, dtype, trailing, n):
    """A received [R, M, round4(n)] uint8 view of padded rows -> [R, M, *trailing] of dtype."""
    return view[:, :, :n].view(dtype).view(view.shape[0], view.shape[1], *trailing)


def _backend_name():
    return "cuda" if _epx.built_with_cuda and torch.cuda.is_available() else "cpu"


def _pad_up(n, m):
    return (n + m - 1) // m * m


def nvfp4_block_scale_interleave(unswizzled_sf):
    """FlashInfer's ``nvfp4_block_scale_interleave`` (``block_scale_interleave``): the NVFP4 block
    scale factors ``[rows, cols]`` or ``[batch, rows, cols]`` (one byte each: uint8 / int8 /
    float8, or bfloat16) in the 128x4-tiled order CUTLASS's NVFP4 GEMMs read, as one flat tensor
    of ``batch * pad128(rows) * pad4(cols)`` elements of the input's dtype on its device (padding
    0). Within one batch entry, scale ``(r, c)`` lands at

        (r // 128) * 128 * pad4(cols) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
        + c % 4

    i.e. 128-row x 4-column tiles (512 bytes), row tiles outermost, and inside a tile the 32 rows
    r, r + 32, r + 64, r + 96 interleaved, each with its 4 columns contiguous."""
    op = "nvfp4_block_scale_interleave"
    sf = unswizzled_sf
    if not isinstance(sf, torch.Tensor) or sf.dim() not in (2, 3):
        raise errors.invalid(op, "argument 'unswizzled_sf' must be a torch.Tensor [rows, cols] or "
                             "[batch, rows, cols]")
    if not (sf.element_size() == 1 and sf.dtype != torch.bool or sf.dtype == torch.bfloat16):
        raise errors.invalid(op, f"argument 'unswizzled_sf' has dtype {sf.dtype}, expected a "
                             "one-byte dtype (uint8, float8_e4m3fn, ...) or bfloat16")
    batch = sf.shape[0] if sf.dim() == 3 else 1
    rows, cols = sf.shape[-2], sf.shape[-1]
    rows_p, cols_p = _pad_up(rows, 128), _pad_up(cols, 4)
    src = sf.reshape(batch, rows, cols)
    if sf.element_size() == 1 and sf.dtype != torch.uint8:
        src = src.view(torch.uint8)  # the permutation moves bytes; any one-byte dtype alike
    padded = src.new_zeros(batch, rows_p, cols_p)
    padded[:, :rows, :cols] = src
    # [b, row tile, r // 32 % 4, r % 32, column tile, c % 4] -> [b, row tile, column tile,
    # r % 32, r // 32 % 4, c % 4]
    out = padded.view(batch, rows_p // 128, 4, 32, cols_p // 4, 4).permute(0, 1, 4, 3, 2, 5)
    out = out.reshape(-1)
    return out.view(sf.dtype) if out.dtype != sf.dtype else out
