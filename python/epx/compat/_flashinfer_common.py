"""Private to :mod:`epx.compat.flashinfer` (import the names from there): the stateless helpers
its MoeAlltoAll and the functional API share.

* Rank masks: ``MOE_A2A_RANK_MASK_WORDS``, :func:`moe_a2a_active_rank_mask` (FlashInfer's CPU
  uint64 bitmask) and ``_mask_bools`` (any accepted mask -> ep_size bools).
* Payload rows of any byte count and dtype: ``_pad_rows`` / ``_unpad_view`` (epx's a2a moves
  rows of a multiple of 4 bytes of its own dtypes; others travel as uint8 bytes), ``_round4``.
* Low precision: ``_round_to_e4m3`` (the FP8 rounding of ``combine(use_low_precision=True)``,
  ``_LOW_PRECISION_DTYPES``) and :func:`nvfp4_block_scale_interleave` (epx's own,
  :mod:`epx.nvfp4`: the permutation in epx's C++ core, a kernel on CUDA tensors).
* ``_backend_name``: the backend a MoeAlltoAll (and the workspace sizing) picks by default.
"""

import math

import torch

from .. import _epx, _torch, errors
from ..nvfp4 import nvfp4_block_scale_interleave as _interleave

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


def _mask_bools(op, active_rank_mask, ep_size, ep_rank):
    """active_rank_mask (uint64 tensor / int / sequence of bools) -> list of ep_size bools, with
    ep_rank (the caller) among the active (InvalidArgument otherwise, as FlashInfer)."""
    if isinstance(active_rank_mask, torch.Tensor):
        if active_rank_mask.numel() != MOE_A2A_RANK_MASK_WORDS:
            raise errors.invalid(op, f"argument 'active_rank_mask' has "
                                 f"{active_rank_mask.numel()} words, expected "
                                 f"{MOE_A2A_RANK_MASK_WORDS}")
        bits = int(active_rank_mask.reshape(-1)[0].item()) & ((1 << 64) - 1)
        active = [bool(bits >> r & 1) for r in range(ep_size)]
    elif isinstance(active_rank_mask, int):
        active = [bool(active_rank_mask >> r & 1) for r in range(ep_size)]
    else:
        active = [bool(a) for a in active_rank_mask]
        if len(active) != ep_size:
            raise errors.invalid(op, f"argument 'active_rank_mask' has {len(active)} entries, "
                                 f"expected {ep_size}")
    if not active[ep_rank]:
        raise errors.invalid(op, f"argument 'active_rank_mask' leaves out this rank (ep_rank "
                             f"{ep_rank}), expected it marked active (as FlashInfer)")
    return active


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
    """epx's a2a moves rows of a multiple of 4 bytes of its dtypes; FlashInfer moves any rows of
    any dtype as bytes (e.g. a uint8 [T, 1], int8, float8_e5m2). -> (payloads with each other one
    as uint8 rows [T, bytes], copied into the first bytes of a zeroed uint8 [T, round4(bytes)]
    where bytes is not a multiple of 4; per payload None or (dtype, trailing shape, bytes) to
    undo it)."""
    if not isinstance(payloads, (list, tuple)):
        return payloads, []
    out, widths = [], []
    for p in payloads:
        if not isinstance(p, torch.Tensor) or p.dim() < 1:
            out.append(p)  # (refused with its name by the dispatch)
            widths.append(None)
            continue
        n = p.element_size() * math.prod(p.shape[1:])
        if n % 4 == 0 and p.dtype in _torch.CODE_OF:
            out.append(p)
            widths.append(None)
            continue
        rows = p.contiguous().view(p.shape[0], n // p.element_size()).view(torch.uint8)
        if n % 4:
            padded = torch.zeros(p.shape[0], _round4(n), dtype=torch.uint8, device=p.device)
            padded[:, :n] = rows
            rows = padded
        out.append(rows)
        widths.append((p.dtype, tuple(p.shape[1:]), n))
    return type(payloads)(out), widths


def _unpad_view(view, dtype, trailing, n):
    """A received [R, M, round4(n)] uint8 view of padded rows -> [R, M, *trailing] of dtype."""
    return view[:, :, :n].view(dtype).view(view.shape[0], view.shape[1], *trailing)


def nvfp4_block_scale_interleave(unswizzled_sf):
    """FlashInfer's ``nvfp4_block_scale_interleave`` (alias ``block_scale_interleave``): epx's
    own, :func:`epx.nvfp4_block_scale_interleave` (docs/semantics.md §8 has the layout)."""
    return _interleave(unswizzled_sf)


def _backend_name():
    return "cuda" if _epx.built_with_cuda and torch.cuda.is_available() else "cpu"


def check_kernel_backend(op, backend):
    """FlashInfer's ``backend`` keyword of the functional ops (its kernel choice): None or its
    default "trtllm" are accepted (epx runs its own a2a on the workspace's device); "cake" (its
    generated kernels for compute capability 10.0 / 10.3 only) is Unsupported."""
    if backend is None or backend == "trtllm":
        return
    if backend == "cake":
        raise errors.unsupported(op, "backend='cake': FlashInfer's generated Blackwell kernels "
                                 "(compute capability 10.0 / 10.3 only); epx runs its own a2a")
    raise errors.invalid(op, f"argument 'backend' is {backend!r}, expected FlashInfer's 'trtllm' "
                         "(or None)")
