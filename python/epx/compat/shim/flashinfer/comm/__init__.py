"""Minimal ``flashinfer.comm`` (no real FlashInfer installed): every name epx.compat.flashinfer
exports (MoeAlltoAll, moe_a2a_*, Mapping, MnnvlConfig, CommBackend, TorchDistBackend, ...)."""

import epx.compat.flashinfer as _fi
from epx.compat.flashinfer import *  # noqa: F401,F403

from . import mapping, mnnvl, trtllm_moe_alltoall  # noqa: F401,E402

MOE_A2A_RANK_MASK_WORDS = _fi.MOE_A2A_RANK_MASK_WORDS
__all__ = list(_fi.__all__)
