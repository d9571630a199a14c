"""Minimal ``flashinfer.comm.trtllm_moe_alltoall`` (where FlashInfer defines MoeAlltoAll)."""

from epx.compat.flashinfer import (MOE_A2A_RANK_MASK_WORDS, Mapping, MnnvlConfig, MoeAlltoAll,
                                   moe_a2a_active_rank_mask, moe_a2a_combine, moe_a2a_dispatch,
                                   moe_a2a_get_workspace_size_per_rank, moe_a2a_initialize,
                                   moe_a2a_sanitize_expert_ids,
                                   moe_a2a_wrap_payload_tensor_in_workspace)

__all__ = ["MoeAlltoAll", "moe_a2a_active_rank_mask", "moe_a2a_combine", "moe_a2a_dispatch",
           "moe_a2a_get_workspace_size_per_rank", "moe_a2a_initialize",
           "moe_a2a_sanitize_expert_ids", "moe_a2a_wrap_payload_tensor_in_workspace",
           "MOE_A2A_RANK_MASK_WORDS", "Mapping", "MnnvlConfig"]
