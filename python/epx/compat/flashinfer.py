"""Drop-in for FlashInfer's ``MoeAlltoAll`` (flashinfer.comm, TensorRT-LLM's one-sided NVLink
all-to-all), implemented on epx's a2a mode (SPEC 3.6): ``from epx.compat.flashinfer import
MoeAlltoAll, Mapping, moe_a2a_get_workspace_size_per_rank``.

How it maps, and what differs:

* The workspace: epx sizes it from the payloads. FlashInfer takes one byte count; epx creates its
  A2a lazily at the first dispatch (collectively, every rank passes payloads of the same row
  sizes), with the row bytes of that call's payloads, and re-creates it when a later dispatch
  brings more payloads or longer rows. The combine capacity per token is ``hidden_size * 4``
  (bf16 or float32 payloads) when ``hidden_size`` is given, capped by ``workspace_size_per_rank``
  when that is given too; with only ``workspace_size_per_rank`` it is what fits in it.
* The group: ``mnnvl_config.comm_backend`` (anything with Get_rank / Get_size / allgather, e.g.
  :class:`TorchDistBackend` or an engine's CommBackend over a ProcessGroup) bootstraps the epx
  group; without it the default torch.distributed group is used. The backend is chosen when the
  MoeAlltoAll is made, before any tensor is seen: cuda where epx was built with CUDA and torch
  sees a GPU, else cpu; the epx-only keyword ``backend="cpu"`` / ``"cuda"`` overrides it. The
  tensors must then be on that backend's device (cpu tensors on a cuda MoeAlltoAll raise
  InvalidArgument naming the argument and the device expected).
* State machine: dispatch -> combine -> dispatch; anything else raises InvalidArgument (epx::A2a
  enforces it too). ``get_combine_payload_tensor_in_workspace`` is valid between dispatch and
  combine.
* Rank mask (fault tolerance): ``enable_rank_mask=True`` and ``active_rank_mask=`` (FlashInfer's
  CPU uint64 bitmask, see :func:`moe_a2a_active_rank_mask`; a sequence of bools is accepted too)
  on dispatch and combine. epx keeps the mask as state (epx.A2a.set_active_ranks): a dispatch
  whose mask differs from the current one applies it first, which is collective over the ranks
  it marks active (every one of them passes the same mask to the same dispatch); masks only
  shrink; combine's mask must equal its dispatch's. After a TimeoutError caused by a dead peer,
  the survivors' next dispatch with a mask without it continues. A workspace re-created for
  larger payloads needs every rank (it is collective over the whole group), so it raises
  Unsupported while a rank is masked off. ``dropped_counts()`` (epx extension) returns
  (tokens, selections) the mask dropped from this rank's dispatches.
* Not supported (raise Unsupported naming the option): eplb_stats_num_experts > 0.
"""

import math

import torch
import torch.distributed as dist

from .. import _epx, _torch, errors
from ..buffer import A2a as _EpxA2a
from ..group import Group as _EpxGroup

__all__ = ["CommBackend", "Mapping", "MnnvlConfig", "MoeAlltoAll", "TorchDistBackend",
           "moe_a2a_active_rank_mask", "moe_a2a_get_workspace_size_per_rank"]

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


def _backend_name():
    return "cuda" if _epx.built_with_cuda and torch.cuda.is_available() else "cpu"


class Mapping:
    """Rank layout of a model-parallel job (TensorRT-LLM's Mapping, the fields MoeAlltoAll uses).

    Ranks are laid out tp fastest, then cp, then pp: rank = (pp_rank * cp_size + cp_rank) *
    tp_size + tp_rank. The MoE part splits the tp ranks into moe_tp_size x moe_ep_size (x
    moe_cluster_size): moe_ep_rank = tp_rank % moe_ep_size.
    """

    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, tp_size=1,
                 pp_size=1, moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1,
                 enable_attention_dp=False):
        op = "Mapping"
        for name, v in (("world_size", world_size), ("gpus_per_node", gpus_per_node),
                        ("cp_size", cp_size), ("tp_size", tp_size), ("pp_size", pp_size)):
            errors.check_int(op, name, v, 1)
        errors.check_int(op, "rank", rank, 0)
        if world_size != tp_size * pp_size * cp_size:
            raise errors.invalid(op, f"world_size = {world_size}, expected tp_size * pp_size * "
                                 f"cp_size = {tp_size * pp_size * cp_size}")
        if rank >= world_size:
            raise errors.invalid(op, f"rank = {rank}, expected < world_size = {world_size}")
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

    @property
    def tp_rank(self):
        return self.rank % self.tp_size

    @property
    def cp_rank(self):
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def pp_rank(self):
        return self.rank // (self.tp_size * self.cp_size)

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


class TorchDistBackend(CommBackend):
    """CommBackend over a torch ProcessGroup (default: the default group)."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD

    def Get_rank(self):
        return dist.get_rank(self.group)

    def Get_size(self):
        return dist.get_world_size(self.group)

    def allgather(self, data):
        out = [None] * self.Get_size()
        dist.all_gather_object(out, data, group=self.group)
        return out

    def barrier(self):
        dist.barrier(group=self.group)


class MnnvlConfig:
    """Holds the communication backend MoeAlltoAll bootstraps through (other fields accepted)."""

    def __init__(self, comm_backend=None, fabric_page_size=1 << 29, allocation_granularity=0):
        self.comm_backend = comm_backend
        self.fabric_page_size = fabric_page_size
        self.allocation_granularity = allocation_granularity


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens,
                                        total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token):
    """Bytes per rank epx's a2a workspace takes for these payloads (on the cuda backend when it is
    built and a GPU is present, else the cpu one), with room for the alignment of up to 8
    separate payloads."""
    op = "moe_a2a_get_workspace_size_per_rank"
    errors.check_int(op, "ep_size", ep_size, 1)
    errors.check_int(op, "max_num_tokens", max_num_tokens, 1)
    errors.check_int(op, "total_dispatch_payload_size_per_token",
               total_dispatch_payload_size_per_token, 1)
    errors.check_int(op, "combine_payload_size_per_token", combine_payload_size_per_token, 1)
    num = _EpxA2a.workspace_bytes(max_num_tokens, 1, ep_size,
                                  [_round4(total_dispatch_payload_size_per_token)],
                                  _round4(combine_payload_size_per_token), ep_size,
                                  _backend_name())
    return num + 2 * _epx.kMaxA2aPayloads * 256


class MoeAlltoAll:
    """FlashInfer's one-sided all-to-all for MoE, on epx a2a. Collective to create."""

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0,
                 enable_rank_mask=False, *, backend=None):
        op = "MoeAlltoAll"
        if eplb_stats_num_experts:
            raise errors.unsupported(op, f"eplb_stats_num_experts={eplb_stats_num_experts}: "
                                     "epx records expert load in its Dispatcher, not here")
        if not isinstance(mapping, Mapping) and not hasattr(mapping, "moe_ep_size"):
            raise errors.invalid(op, f"argument 'mapping' is a {type(mapping).__name__}, "
                                 "expected a Mapping")
        errors.check_int(op, "max_num_tokens", max_num_tokens, 1)
        errors.check_int(op, "top_k", top_k, 1)
        errors.check_int(op, "num_experts", num_experts, 1)
        if workspace_size_per_rank is not None:
            errors.check_int(op, "workspace_size_per_rank", workspace_size_per_rank, 1)
        if hidden_size is not None:
            errors.check_int(op, "hidden_size", hidden_size, 1)
        if workspace_size_per_rank is None and hidden_size is None:
            raise errors.invalid(op, "neither 'workspace_size_per_rank' nor 'hidden_size' is "
                                 "given, expected at least one (it sizes the combine payload)")
        self.mapping = mapping
        self.ep_size = int(mapping.moe_ep_size)
        self.ep_rank = int(mapping.moe_ep_rank)
        self.max_num_tokens = max_num_tokens
        self.top_k = top_k
        self.num_experts = num_experts
        self.workspace_size_per_rank = workspace_size_per_rank
        self.hidden_size = hidden_size
        if num_experts % self.ep_size:
            raise errors.invalid(op, f"num_experts = {num_experts}, expected a multiple of "
                                 f"moe_ep_size = {self.ep_size}")

        comm = getattr(mnnvl_config, "comm_backend", None) if mnnvl_config is not None else None
        if comm is None:
            if not dist.is_initialized():
                raise errors.invalid(op, "no mnnvl_config.comm_backend and torch.distributed is "
                                     "not initialised, expected one of them")
            comm = TorchDistBackend()
        elif isinstance(comm, dist.ProcessGroup):
            comm = TorchDistBackend(comm)
        rank, size = int(comm.Get_rank()), int(comm.Get_size())
        if size != self.ep_size or rank != self.ep_rank:
            raise errors.invalid(op, f"the communicator has rank {rank} of {size}, expected "
                                 f"mapping.moe_ep_rank {self.ep_rank} of moe_ep_size "
                                 f"{self.ep_size}")
        if backend is None:
            backend = _backend_name()
        if backend not in ("cpu", "cuda"):
            raise errors.invalid(op, f"argument 'backend' is {backend!r}, expected 'cpu' or "
                                 "'cuda'")
        device = "cpu" if backend == "cpu" else torch.device("cuda", torch.cuda.current_device())
        self._group = _EpxGroup.from_comm(comm, device)
        self._a2a = None
        self._a2a_bytes = []
        self.enable_rank_mask = bool(enable_rank_mask)
        self._active = [True] * self.ep_size  # the mask applied (epx keeps it as state)
        self._state = "idle"  # idle -> dispatched -> idle
        self._runtime_max = 0
        self._num_tokens = 0
        self.recv_counts = None  # [ep_size] int32 of the last dispatch (epx extension)

    # ---- internals ---------------------------------------------------------------------------
    def _combine_bytes(self, payload_bytes):
        cap = None if self.hidden_size is None else self.hidden_size * 4
        if self.workspace_size_per_rank is None:
            return cap

        def fits(c):
            return _EpxA2a.workspace_bytes(self.max_num_tokens, self.top_k, self.num_experts,
                                           payload_bytes, c, self.ep_size,
                                           self._group.backend) <= self.workspace_size_per_rank

        if not fits(4):
            need = _EpxA2a.workspace_bytes(self.max_num_tokens, self.top_k, self.num_experts,
                                           payload_bytes, cap or 4, self.ep_size,
                                           self._group.backend)
            raise errors.out_of_capacity(
                "MoeAlltoAll.dispatch", f"workspace_size_per_rank = "
                f"{self.workspace_size_per_rank} bytes is too small for payloads of "
                f"{payload_bytes} bytes per token; epx needs {need} bytes "
                "(see moe_a2a_get_workspace_size_per_rank)")
        lo, hi = 4, (cap or 1 << 40)
        if fits(hi):
            return hi
        while hi - lo > 4:  # largest multiple of 4 that fits
            mid = (lo + hi) // 8 * 4
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _workspace(self, payloads):
        """The A2a for these payloads: the current one when they fit (the per-call fast path),
        else a new one sized for them (collective: every rank passes the same row sizes)."""
        try:
            payload_bytes = [p.element_size() * math.prod(p.shape[1:]) for p in payloads]
        except (AttributeError, TypeError):
            payload_bytes = None
        a2a = self._a2a
        if a2a is not None and payload_bytes is not None:
            have = self._a2a_bytes
            if len(have) == len(payload_bytes) and all(
                    n <= h for n, h in zip(payload_bytes, have)):
                return a2a
        if not all(self._active):
            raise errors.unsupported("MoeAlltoAll.dispatch", "payloads larger than the first "
                                     "dispatch's while ranks are masked off: re-creating the "
                                     "workspace is collective over every rank")
        for i, p in enumerate(payloads):
            if not isinstance(p, torch.Tensor) or p.dim() < 1:
                raise errors.invalid("MoeAlltoAll.dispatch", f"argument 'input_payloads[{i}]' "
                                     "must be a torch.Tensor [T, ...]")
        payload_bytes = [max(_round4(n), 4) for n in payload_bytes]
        if a2a is not None and len(self._a2a_bytes) == len(payload_bytes):
            payload_bytes = [max(n, h) for n, h in zip(payload_bytes, self._a2a_bytes)]
        if not 1 <= len(payload_bytes) <= _epx.kMaxA2aPayloads:
            raise errors.invalid("MoeAlltoAll.dispatch", f"argument 'input_payloads' has "
                                 f"{len(payload_bytes)} tensors, expected 1.."
                                 f"{_epx.kMaxA2aPayloads}")
        self._a2a = None
        self._a2a = _EpxA2a(self._group, self.max_num_tokens, self.top_k, self.num_experts,
                            payload_bytes, self._combine_bytes(payload_bytes))
        self._a2a_bytes = payload_bytes
        return self._a2a

    # ---- API ---------------------------------------------------------------------------------
    def _rank_mask(self, op, active_rank_mask):
        """The mask of a call as bools (the current one when not given)."""
        if active_rank_mask is None:
            return self._active
        if not self.enable_rank_mask:
            raise errors.invalid(op, "argument 'active_rank_mask' is given but the MoeAlltoAll "
                                 "was created with enable_rank_mask=False, expected True")
        return _mask_bools(op, active_rank_mask, self.ep_size)

    def reset_dropped_counts(self):
        """epx extension: zero the drop counters (see dropped_counts)."""
        if self._a2a is not None:
            self._a2a.reset_dropped_counts()

    def dropped_counts(self):
        """epx extension: (tokens, selections) the rank mask dropped from this rank's
        dispatches (include/epx/a2a.h, A2aDropCounts)."""
        return (0, 0) if self._a2a is None else self._a2a.dropped_counts()

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None, *,
                 active_rank_mask=None):
        """Collective (over the active ranks). -> list of [ep_size, runtime_max_tokens_per_rank,
        ...] views of the receive workspace, one per payload: row [s][j] is the j-th token rank
        s sent here (nothing from masked-off ranks)."""
        op = "MoeAlltoAll.dispatch"
        if self._state != "idle" and active_rank_mask is None:
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        active = self._rank_mask(op, active_rank_mask)
        if not isinstance(input_payloads, (list, tuple)):
            raise errors.invalid(op, "argument 'input_payloads' must be a list of tensors")
        errors.check_int(op, "runtime_max_tokens_per_rank", runtime_max_tokens_per_rank, 0)
        if runtime_max_tokens_per_rank > self.max_num_tokens:
            raise errors.out_of_capacity(op, f"runtime_max_tokens_per_rank = "
                                         f"{runtime_max_tokens_per_rank} exceeds max_num_tokens "
                                         f"= {self.max_num_tokens}")
        a2a = self._workspace(input_payloads)
        if active != self._active:  # collective over the ranks it marks active
            a2a.set_active_ranks(active, stream=_torch.stream_of(token_selected_experts))
            self._active = list(active)
        elif self._state != "idle":
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        idx = -1 if expert_id_payload_index is None else expert_id_payload_index
        recv, counts = a2a._native.dispatch(token_selected_experts, list(input_payloads),
                                            runtime_max_tokens_per_rank, invalid_token_expert_id,
                                            idx, _torch.stream_of(token_selected_experts))
        self._state = "dispatched"
        self._runtime_max = runtime_max_tokens_per_rank
        self._num_tokens = token_selected_experts.shape[0]
        self.recv_counts = counts
        return recv

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank, hidden_size,
                                                dtype):
        """The [ep_size, runtime_max, hidden_size] workspace view the MoE kernel writes its output
        into for combine(..., payload_in_workspace=True). Valid between dispatch and combine."""
        op = "MoeAlltoAll.get_combine_payload_tensor_in_workspace"
        if self._state != "dispatched":
            raise errors.invalid(op, "called before dispatch; expected dispatch -> "
                                 "get_combine_payload_tensor_in_workspace -> combine")
        return self._a2a.combine_payload_view(runtime_max_tokens_per_rank, hidden_size, dtype)

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, *,
                active_rank_mask=None):
        """Collective (over the active ranks). payload [ep_size, runtime_max, H] -> [T, H]: per
        token the sum, in ascending rank order, of the rows the active ranks it went to return
        (zeros when it went to none)."""
        op = "MoeAlltoAll.combine"
        if self._state != "dispatched":
            raise errors.invalid(op, "called without a preceding dispatch; expected the order "
                                 "dispatch -> combine -> dispatch")
        if self._rank_mask(op, active_rank_mask) != self._active:
            raise errors.invalid(op, "argument 'active_rank_mask' differs from the mask of the "
                                 "preceding dispatch, expected the same mask")
        out = self._a2a._native.combine(payload, int(runtime_max_tokens_per_rank),
                                        bool(payload_in_workspace),
                                        _torch.stream_of(payload))
        self._state = "idle"
        return out
