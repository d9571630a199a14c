"""Private to :mod:`epx.compat.flashinfer` (import the names from there): the configuration types
a MoeAlltoAll is made with -- :class:`Mapping` (the rank layout; FlashInfer's
``flashinfer.comm.mapping``), :class:`MnnvlConfig`, the :class:`CommBackend` interface it
bootstraps the epx group through and :class:`TorchDistBackend` (over a torch ProcessGroup), and
:func:`is_mnnvl_fabric_supported` (FlashInfer's ``flashinfer.comm.mnnvl``). No tensors, no epx
objects: plain values and the torch.distributed calls of TorchDistBackend (epx.Group's own over a
ProcessGroup, group.py's _ProcessGroupComm, and a barrier).
"""

import torch.distributed as dist

from .. import errors
from ..group import _ProcessGroupComm


class Mapping:
    """Rank layout of a model-parallel job (TensorRT-LLM's Mapping, the fields MoeAlltoAll uses).

    Ranks are laid out tp fastest, then cp, then pp: rank = (pp_rank * cp_size + cp_rank) *
    tp_size + tp_rank. The MoE part splits the tp ranks into moe_tp_size x moe_ep_size (x
    moe_cluster_size): moe_ep_rank = tp_rank % moe_ep_size.
    """

    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, cp_config=None,
                 tp_size=1, pp_size=1, moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1,
                 attn_tp_size=-1, attn_cp_size=-1, auto_parallel=False,
                 enable_attention_dp=False):
        op = "Mapping"
        for name, v in (("world_size", world_size), ("gpus_per_node", gpus_per_node),
                        ("cp_size", cp_size), ("tp_size", tp_size), ("pp_size", pp_size)):
            errors.check_int(op, name, v, 1)
        errors.check_int(op, "rank", rank, 0)
        if auto_parallel:  # every rank is rank 0 of its tp/pp/cp groups (FlashInfer's meaning)
            if (tp_size, pp_size, cp_size) != (1, 1, 1):
                raise errors.invalid(op, f"auto_parallel=True with tp_size, pp_size, cp_size = "
                                     f"{tp_size}, {pp_size}, {cp_size}, expected 1, 1, 1")
        elif world_size != tp_size * pp_size * cp_size:
            raise errors.invalid(op, f"world_size = {world_size}, expected tp_size * pp_size * "
                                 f"cp_size = {tp_size * pp_size * cp_size}")
        if rank >= world_size:
            raise errors.invalid(op, f"rank = {rank}, expected < world_size = {world_size}")
        if attn_tp_size == -1 and attn_cp_size == -1:
            attn_tp_size, attn_cp_size = tp_size * cp_size, 1
        elif attn_tp_size == -1:
            attn_tp_size = tp_size * cp_size // attn_cp_size
        elif attn_cp_size == -1:
            attn_cp_size = tp_size * cp_size // attn_tp_size
        if attn_cp_size != 1 or attn_tp_size * attn_cp_size != tp_size * cp_size:
            raise errors.invalid(op, f"attn_tp_size = {attn_tp_size}, attn_cp_size = "
                                 f"{attn_cp_size}, expected attn_cp_size = 1 and attn_tp_size = "
                                 f"tp_size * cp_size = {tp_size * cp_size}")
        cluster = 1 if moe_cluster_size == -1 else moe_cluster_size
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size // cluster, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // (moe_ep_size * cluster)
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // (moe_tp_size * cluster)
        for name, v in (("moe_cluster_size", cluster), ("moe_tp_size", moe_tp_size),
                        ("moe_ep_size", moe_ep_size)):
            errors.check_int(op, name, v, 1)
        if moe_tp_size * moe_ep_size * cluster != tp_size:
            raise errors.invalid(op, f"moe_tp_size * moe_ep_size * moe_cluster_size = "
                                 f"{moe_tp_size * moe_ep_size * cluster}, expected tp_size = "
                                 f"{tp_size}")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.cp_size, self.tp_size, self.pp_size = cp_size, tp_size, pp_size
        self.moe_cluster_size, self.moe_tp_size, self.moe_ep_size = cluster, moe_tp_size, \
            moe_ep_size
        self.enable_attention_dp = bool(enable_attention_dp)
        self.cp_config = cp_config if cp_config is not None else {}
        self.attn_tp_size, self.attn_cp_size = attn_tp_size, attn_cp_size
        self.auto_parallel = bool(auto_parallel)

    @property
    def tp_rank(self):
        return 0 if self.auto_parallel else self.rank % self.tp_size

    @property
    def cp_rank(self):
        return 0 if self.auto_parallel else (self.rank // self.tp_size) % self.cp_size

    @property
    def pp_rank(self):
        return 0 if self.auto_parallel else self.rank // (self.tp_size * self.cp_size)

    @property
    def moe_ep_rank(self):
        return self.tp_rank % self.moe_ep_size

    @property
    def moe_tp_rank(self):
        return self.tp_rank // (self.moe_ep_size * self.moe_cluster_size)

    @property
    def local_rank(self):
        return self.rank % self.gpus_per_node

    def __repr__(self):
        return (f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size="
                f"{self.tp_size}, pp_size={self.pp_size}, cp_size={self.cp_size}, moe_tp_size="
                f"{self.moe_tp_size}, moe_ep_size={self.moe_ep_size})")


class CommBackend:
    """The bootstrap interface MoeAlltoAll needs from a communicator."""

    def Get_rank(self):
        raise NotImplementedError

    def Get_size(self):
        raise NotImplementedError

    def allgather(self, data):
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError


class TorchDistBackend(_ProcessGroupComm, CommBackend):
    """CommBackend over a torch ProcessGroup (default: the default group): Get_rank, Get_size and
    allgather as epx.Group makes them over a ProcessGroup (outside the caller's inference mode),
    and barrier."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        super().__init__(self.group)

    def barrier(self):
        dist.barrier(group=self.group)


class MnnvlConfig:
    """Holds the communication backend MoeAlltoAll bootstraps through (the other fields, in
    FlashInfer's order, are kept and not used: epx maps no fabric pages)."""

    def __init__(self, comm_backend=None, allocation_granularity=0, fabric_page_size=1 << 29):
        self.comm_backend = comm_backend
        self.allocation_granularity = allocation_granularity
        self.fabric_page_size = fabric_page_size

    def __repr__(self):
        return (f"MnnvlConfig(comm_backend={self.comm_backend!r}, allocation_granularity="
                f"{self.allocation_granularity}, fabric_page_size={self.fabric_page_size})")


def is_mnnvl_fabric_supported(device_idx=None):
    """False: epx has no multi-node NVLink (MNNVL fabric) path; its cuda backend reaches the peers
    of one NVLink domain through NCCL symmetric memory. Engines that ask (FlashInfer's
    ``flashinfer.comm.mnnvl.is_mnnvl_fabric_supported(device_idx)``) then pick their single-node
    set-up. ``device_idx`` (an int, a torch.device or None) is not looked at."""
    return False
