"""Drop-in for FlashInfer's ``MoeAlltoAll`` (flashinfer.comm, TensorRT-LLM's one-sided NVLink
all-to-all), implemented on epx's a2a mode (docs/semantics.md §3): ``from epx.compat.flashinfer
import MoeAlltoAll, Mapping, moe_a2a_get_workspace_size_per_rank``. ``python3 -m epx.compat.shim``
prints a directory to put first on PYTHONPATH so that ``import flashinfer`` itself gives these names
(epx/compat/shim/flashinfer/__init__.py).

How it maps, and what differs:

* The workspace: epx sizes it from the payloads. FlashInfer takes one byte count; epx creates its
  A2a lazily at the first dispatch (collectively, every rank passes payloads of the same row
  sizes), with the row bytes of that call's payloads, and re-creates it when a later dispatch
  brings more payloads or longer rows. The combine capacity per token is ``hidden_size * 4``
  (bf16 or float32 payloads) when ``hidden_size`` is given, capped by ``workspace_size_per_rank``
  when that is given too; with only ``workspace_size_per_rank`` it is what fits in it.
* The group: ``mnnvl_config.comm_backend`` (anything with Get_rank / Get_size / allgather, e.g.
  :class:`TorchDistBackend`, FlashInfer's own, or an engine's CommBackend over a ProcessGroup)
  bootstraps the epx group; without it the default torch.distributed group is used. The backend
  is chosen when the MoeAlltoAll is made, before any tensor is seen: cuda where epx was built
  with CUDA and torch sees a GPU, else cpu; the epx-only keyword ``backend="cpu"`` / ``"cuda"``
  overrides it. The tensors must then be on that backend's device (cpu tensors on a cuda
  MoeAlltoAll raise InvalidArgument naming the argument and the device expected).
* State machine: dispatch -> combine -> dispatch; anything else raises InvalidArgument (epx::A2a
  enforces it too). ``get_combine_payload_tensor_in_workspace`` is valid between dispatch and
  combine.
* Rank mask (fault tolerance): ``enable_rank_mask=True`` and ``active_rank_mask=`` (FlashInfer's
  CPU uint64 bitmask, see :func:`moe_a2a_active_rank_mask`; a sequence of bools is accepted too)
  on dispatch and combine; as in FlashInfer, such a MoeAlltoAll needs the mask on every call
  (all ranks: ``moe_a2a_active_rank_mask(range(ep_size), ep_size)``). epx keeps the mask as state
  (epx.A2a.set_active_ranks): a dispatch whose mask differs from the current one applies it
  first, which is collective over the ranks it marks active (every one of them passes the same
  mask to the same dispatch); masks only shrink; combine's mask must equal its dispatch's. After
  a TimeoutError caused by a dead peer, the survivors' next dispatch with a mask without it
  continues. A workspace re-created for larger payloads needs every rank (it is collective over
  the whole group), so it raises Unsupported while a rank is masked off. ``dropped_counts()``
  (epx extension) returns (tokens, selections) the mask dropped from this rank's dispatches.
* Multi-node NVLink: epx has no MNNVL fabric path; :func:`is_mnnvl_fabric_supported` is False.

Accepted options (every keyword of FlashInfer's API; what is not honoured raises
``epx.Unsupported`` naming it, never a TypeError; docs/semantics.md "FlashInfer drop-in: accepted
options" has the same table):

================================================  =============================================
FlashInfer API / option                           epx
================================================  =============================================
MoeAlltoAll(mapping, max_num_tokens, top_k,       honoured (workspace sized lazily, see above)
num_experts, workspace_size_per_rank,
hidden_size, mnnvl_config)
MoeAlltoAll(eplb_stats_num_experts=n)             honoured: dispatch(eplb_local_stats=[n] int32)
                                                  fills ``eplb_gathered_stats`` [ep_size, n]
                                                  (row r = rank r's stats; None after combine).
                                                  Gathered on the host through the comm backend
                                                  (waits for the stats' stream; Unsupported
                                                  during CUDA-graph capture and while ranks are
                                                  masked off); every rank passes it, or none
MoeAlltoAll(enable_rank_mask=True)                honoured; a dispatch/combine without
                                                  ``active_rank_mask`` is InvalidArgument (as in
                                                  FlashInfer)
dispatch(token_selected_experts, input_payloads,  honoured (T = 0 allowed)
runtime_max_tokens_per_rank)
dispatch(invalid_token_expert_id=v,               honoured (padding rows of that payload = v);
expert_id_payload_index=i)                        ``i`` without ``v`` is ignored, ``v`` without
                                                  ``i`` is InvalidArgument
dispatch(eplb_local_stats=), combine/dispatch     honoured (see above)
(active_rank_mask=)
combine(payload, runtime_max_tokens_per_rank,     honoured
payload_in_workspace)
combine(output=t)                                 honoured: the result is copied into ``t``
                                                  ([T, H], the payload's dtype and device,
                                                  contiguous) and ``t`` is returned
combine(output_dtype=d)                           honoured when ``d`` is the payload's dtype;
                                                  another ``d`` without ``output_scales`` is
                                                  InvalidArgument (as in FlashInfer)
combine(output_scales=)                           Unsupported (quantised MXFP8/MXFP4/NVFP4
                                                  combine output)
combine(output_scalar_scale=, sf_layout=)         accepted; they only act with output_scales
                                                  (FlashInfer ignores them otherwise too)
combine(use_low_precision=True)                   Unsupported (FP8 combine transport)
get_combine_payload_tensor_in_workspace           honoured
MoeAlltoAll.get_moe_workspace_size_per_rank       honoured (epx's sizes, 16-bit hidden states)
(static), moe_a2a_get_workspace_size_per_rank
(... eplb_stats_num_experts)
eplb_gathered_stats, enable_rank_mask, ep_rank,   honoured (attributes)
ep_size, top_k, num_experts, max_num_tokens
workspace, metainfo, mnnvl_mem,                   Unsupported: FlashInfer's raw MNNVL workspace
MoeAlltoAll.get_workspace                         and its metainfo do not exist in epx (its
                                                  symmetric memory is NCCL's, sized per payload)
checkpoint_prepare, checkpoint_restore            Unsupported (MNNVL handles unmapped for
                                                  process checkpointing)
moe_a2a_initialize, moe_a2a_dispatch,             Unsupported: the functional API runs on a
moe_a2a_combine, moe_a2a_sanitize_expert_ids      caller-owned MNNVL workspace; use MoeAlltoAll
moe_a2a_wrap_payload_tensor_in_workspace          honoured (a byte-range view of any tensor)
moe_a2a_active_rank_mask                          honoured
is_mnnvl_fabric_supported(device_idx)             False (no multi-node NVLink fabric path)
Mapping(..., cp_config, attn_tp_size,             honoured (auto_parallel: tp/pp/cp ranks are 0)
attn_cp_size, auto_parallel)
MnnvlConfig(comm_backend, allocation_granularity, comm_backend honoured; the sizes are kept
fabric_page_size)                                 (epx does not map fabric pages)
================================================  =============================================
"""

import math

import torch
import torch.distributed as dist

from .. import _epx, _torch, errors
from ..buffer import A2a as _EpxA2a
from ..group import Group as _EpxGroup

__all__ = ["CommBackend", "Mapping", "MnnvlConfig", "MoeAlltoAll", "TorchDistBackend",
           "is_mnnvl_fabric_supported", "moe_a2a_active_rank_mask", "moe_a2a_combine",
           "moe_a2a_dispatch", "moe_a2a_get_workspace_size_per_rank", "moe_a2a_initialize",
           "moe_a2a_sanitize_expert_ids", "moe_a2a_wrap_payload_tensor_in_workspace",
           "nvfp4_block_scale_interleave"]

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


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens,
                                        total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token,
                                        eplb_stats_num_experts=0):
    """Bytes per rank epx's a2a workspace takes for these payloads (on the cuda backend when it is
    built and a GPU is present, else the cpu one), with room for the alignment of up to 8
    separate payloads. ``eplb_stats_num_experts`` adds nothing: epx gathers the EPLB stats
    outside the workspace."""
    op = "moe_a2a_get_workspace_size_per_rank"
    errors.check_int(op, "eplb_stats_num_experts", eplb_stats_num_experts, 0)
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


def moe_a2a_wrap_payload_tensor_in_workspace(workspace, leading_shape, slice_start, slice_end,
                                             dtype):
    """The bytes ``[slice_start, slice_end)`` of ``workspace`` (``[ep_size, size_per_rank]`` or
    ``[size_per_rank]``; offsets count from the start of row 0, and the range must lie in one
    row) as a view of ``dtype`` and shape ``leading_shape + [-1]`` (FlashInfer's meaning; pure
    view arithmetic, no communication)."""
    op = "moe_a2a_wrap_payload_tensor_in_workspace"
    if not isinstance(workspace, torch.Tensor) or workspace.dim() not in (1, 2):
        raise errors.invalid(op, "argument 'workspace' must be a torch.Tensor [ep_size, "
                             "size_per_rank] or [size_per_rank]")
    errors.check_int(op, "slice_start", slice_start, 0)
    errors.check_int(op, "slice_end", slice_end, slice_start)
    ws = workspace if workspace.dim() == 2 else workspace.unsqueeze(0)
    if ws.stride(1) != 1:
        raise errors.invalid(op, "argument 'workspace' must be contiguous in its last dimension")
    ws = ws.view(torch.uint8) if ws.dtype != torch.uint8 else ws
    row_bytes, row_stride = ws.shape[1], ws.stride(0)
    row, start = divmod(slice_start, row_stride) if ws.shape[0] > 1 else (0, slice_start)
    end = start + (slice_end - slice_start)
    if row >= ws.shape[0] or end > row_bytes:
        raise errors.invalid(op, f"bytes [{slice_start}, {slice_end}) leave workspace row "
                             f"{row} (rows of {row_bytes} bytes, stride {row_stride}), expected a "
                             "range inside one row")
    return ws[row, start:end].view(dtype).view(*leading_shape, -1)


def _functional_unsupported(op):
    return errors.unsupported(op, "FlashInfer's functional all-to-all runs on a caller-owned "
                              "MNNVL workspace and its metainfo, which epx does not have (its "
                              "workspace is NCCL symmetric memory sized per payload); use "
                              "MoeAlltoAll(...).dispatch / combine")


def moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts=0):
    """Unsupported in epx (see :class:`MoeAlltoAll`)."""
    raise _functional_unsupported("moe_a2a_initialize")


def moe_a2a_dispatch(token_selected_experts, input_payloads, workspace, metainfo,
                     runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                     enable_pdl=None, eplb_local_stats=None, enable_rank_mask=False,
                     active_rank_mask=None):
    """Unsupported in epx: use :meth:`MoeAlltoAll.dispatch`."""
    raise _functional_unsupported("moe_a2a_dispatch")


def moe_a2a_combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank,
                    ep_rank, ep_size, top_k, combine_payload_offset, payload_in_workspace=False,
                    output_dtype=None, output_scales=None, output_scalar_scale=1.0,
                    sf_layout=None, output=None, *, use_low_precision=False, enable_pdl=None,
                    enable_rank_mask=False, active_rank_mask=None):
    """Unsupported in epx: use :meth:`MoeAlltoAll.combine`."""
    raise _functional_unsupported("moe_a2a_combine")


def moe_a2a_sanitize_expert_ids(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id,
                                enable_pdl=None):
    """Unsupported in epx: ``MoeAlltoAll.dispatch(invalid_token_expert_id=...,
    expert_id_payload_index=...)`` sanitises the padding rows."""
    raise _functional_unsupported("moe_a2a_sanitize_expert_ids")


class MoeAlltoAll:
    """FlashInfer's one-sided all-to-all for MoE, on epx a2a. Collective to create."""

    @staticmethod
    def get_moe_workspace_size_per_rank(ep_size, top_k, max_num_tokens, hidden_size,
                                        extra_payload_bytes_per_token=0,
                                        eplb_stats_num_experts=0):
        """:func:`moe_a2a_get_workspace_size_per_rank` for 16-bit hidden states, int32 expert ids
        and float32 weights (top_k each) plus ``extra_payload_bytes_per_token``, and a 16-bit
        combine payload of ``hidden_size`` (FlashInfer's convenience sizing)."""
        op = "MoeAlltoAll.get_moe_workspace_size_per_rank"
        errors.check_int(op, "top_k", top_k, 1)
        errors.check_int(op, "hidden_size", hidden_size, 1)
        errors.check_int(op, "extra_payload_bytes_per_token", extra_payload_bytes_per_token, 0)
        return moe_a2a_get_workspace_size_per_rank(
            ep_size, max_num_tokens, hidden_size * 2 + top_k * 8 + extra_payload_bytes_per_token,
            hidden_size * 2, eplb_stats_num_experts)

    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                      eplb_stats_num_experts=0):
        """Unsupported: FlashInfer's raw MNNVL workspace does not exist in epx."""
        raise errors.unsupported("MoeAlltoAll.get_workspace", "FlashInfer's raw MNNVL "
                                 "workspace (and its metainfo) does not exist in epx; its "
                                 "workspace is created per MoeAlltoAll, sized per payload")

    @property
    def workspace(self):
        raise errors.unsupported("MoeAlltoAll.workspace", "FlashInfer's raw MNNVL workspace "
                                 "tensor does not exist in epx; use "
                                 "get_combine_payload_tensor_in_workspace / the dispatch views")

    @property
    def metainfo(self):
        raise errors.unsupported("MoeAlltoAll.metainfo", "FlashInfer's workspace metainfo "
                                 "(offsets into its MNNVL workspace) does not exist in epx")

    @property
    def mnnvl_mem(self):
        raise errors.unsupported("MoeAlltoAll.mnnvl_mem", "epx allocates no MNNVL memory (its "
                                 "workspace is NCCL symmetric memory)")

    def checkpoint_prepare(self):
        """Unsupported: epx cannot unmap its symmetric workspace for process checkpointing."""
        raise errors.unsupported("MoeAlltoAll.checkpoint_prepare", "epx cannot unmap and "
                                 "re-map its NCCL symmetric workspace for checkpointing")

    def checkpoint_restore(self, comm_backend):
        """Unsupported (see checkpoint_prepare)."""
        raise errors.unsupported("MoeAlltoAll.checkpoint_restore", "epx cannot unmap and "
                                 "re-map its NCCL symmetric workspace for checkpointing")

    @property
    def eplb_gathered_stats(self):
        """[ep_size, eplb_stats_num_experts] int32 of the last dispatch's ``eplb_local_stats``
        (row r = rank r's), between that dispatch and its combine; else None."""
        return self._eplb_gathered

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0,
                 enable_rank_mask=False, *, backend=None):
        op = "MoeAlltoAll"
        errors.check_int(op, "eplb_stats_num_experts", eplb_stats_num_experts, 0)
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
        if eplb_stats_num_experts > num_experts:
            raise errors.invalid(op, f"eplb_stats_num_experts = {eplb_stats_num_experts}, "
                                 f"expected <= num_experts = {num_experts}")
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self.enable_eplb = eplb_stats_num_experts > 0
        self._eplb_gathered = None

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
        self._comm = comm
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
            try:
                need = _EpxA2a.workspace_bytes(self.max_num_tokens, self.top_k, self.num_experts,
                                               payload_bytes, c, self.ep_size,
                                               self._group.backend)
            except errors.OutOfCapacity:
                return False  # more than one allocation may take (1 TiB per rank)
            return need <= self.workspace_size_per_rank

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
        # Every rank must size the workspace alike: agreed first (InvalidArgument on every rank
        # naming the payload and each rank's value), before the collective construction.
        self._group.agree("MoeAlltoAll.dispatch", [("the number of 'input_payloads'",
                                                    len(payload_bytes))] +
                          [(f"the bytes per token of 'input_payloads[{i}]' (rounded up to 4, at "
                            "least the workspace's)", payload_bytes[i] if i < len(payload_bytes)
                            else 0) for i in range(_epx.kMaxA2aPayloads)])
        self._a2a = None
        self._a2a = _EpxA2a(self._group, self.max_num_tokens, self.top_k, self.num_experts,
                            payload_bytes, self._combine_bytes(payload_bytes))
        self._a2a_bytes = payload_bytes
        return self._a2a

    # ---- API ---------------------------------------------------------------------------------
    def _rank_mask(self, op, active_rank_mask):
        """The mask of a call as bools (the current one when not given)."""
        if active_rank_mask is None:
            if self.enable_rank_mask:
                raise errors.invalid(op, "argument 'active_rank_mask' is not given but the "
                                     "MoeAlltoAll was created with enable_rank_mask=True, "
                                     "expected a mask on every dispatch and combine (as "
                                     "FlashInfer; every rank: moe_a2a_active_rank_mask("
                                     "range(ep_size), ep_size))")
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

    def _gather_eplb(self, op, stats, active):
        """eplb_local_stats of every rank -> [ep_size, n] int32 (host all-gather, collective)."""
        n = self.eplb_stats_num_experts
        if not self.enable_eplb:
            raise errors.invalid(op, "argument 'eplb_local_stats' is given but the MoeAlltoAll "
                                 "was created with eplb_stats_num_experts=0, expected > 0")
        if not isinstance(stats, torch.Tensor) or list(stats.shape) != [n] or \
                stats.is_floating_point() or stats.dtype == torch.bool:
            raise errors.invalid(op, f"argument 'eplb_local_stats' must be an integer tensor "
                                 f"[{n}] (eplb_stats_num_experts)")
        if not all(active):
            raise errors.unsupported(op, "eplb_local_stats while ranks are masked off: epx "
                                     "gathers them through the comm backend, over every rank")
        if stats.is_cuda and torch.cuda.is_current_stream_capturing():
            raise errors.unsupported(op, "eplb_local_stats while a CUDA graph is being "
                                     "captured: epx gathers them on the host")
        rows = self._comm.allgather([int(v) for v in stats.cpu().tolist()])
        return torch.tensor(rows, dtype=torch.int32).to(stats.device)

    @_torch.plain_torch
    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None,
                 eplb_local_stats=None, active_rank_mask=None):
        """Collective (over the active ranks). -> list of [ep_size, runtime_max_tokens_per_rank,
        ...] views of the receive workspace, one per payload: row [s][j] is the j-th token rank
        s sent here (nothing from masked-off ranks)."""
        op = "MoeAlltoAll.dispatch"
        if self._state != "idle" and active_rank_mask is None:
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        active = self._rank_mask(op, active_rank_mask)
        if invalid_token_expert_id is None:
            expert_id_payload_index = None  # FlashInfer sanitises only with both given
        elif expert_id_payload_index is None:
            raise errors.invalid(op, "argument 'invalid_token_expert_id' is given without "
                                 "'expert_id_payload_index', expected both")
        if not isinstance(input_payloads, (list, tuple)):
            raise errors.invalid(op, "argument 'input_payloads' must be a list of tensors")
        errors.check_int(op, "runtime_max_tokens_per_rank", runtime_max_tokens_per_rank, 0)
        if runtime_max_tokens_per_rank > self.max_num_tokens:
            raise errors.out_of_capacity(op, f"runtime_max_tokens_per_rank = "
                                         f"{runtime_max_tokens_per_rank} exceeds max_num_tokens "
                                         f"= {self.max_num_tokens}")
        a2a = self._workspace(input_payloads)
        gathered = None
        if eplb_local_stats is not None:
            gathered = self._gather_eplb(op, eplb_local_stats, active)
        if active != self._active:  # collective over the ranks it marks active
            a2a.set_active_ranks(active, stream=_torch.stream_of(token_selected_experts))
            self._active = list(active)
        elif self._state != "idle":
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        recv, counts = a2a.dispatch(token_selected_experts, list(input_payloads),
                                    runtime_max_tokens_per_rank, invalid_token_expert_id,
                                    expert_id_payload_index)
        self._state = "dispatched"
        self._eplb_gathered = gathered
        self._runtime_max = runtime_max_tokens_per_rank
        self._num_tokens = token_selected_experts.shape[0]
        self.recv_counts = counts
        return recv

    @_torch.plain_torch
    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank, hidden_size,
                                                dtype):
        """The [ep_size, runtime_max, hidden_size] workspace view the MoE kernel writes its output
        into for combine(..., payload_in_workspace=True). Valid between dispatch and combine."""
        op = "MoeAlltoAll.get_combine_payload_tensor_in_workspace"
        if self._state != "dispatched":
            raise errors.invalid(op, "called before dispatch; expected dispatch -> "
                                 "get_combine_payload_tensor_in_workspace -> combine")
        return self._a2a.combine_payload_view(runtime_max_tokens_per_rank, hidden_size, dtype)

    @_torch.plain_torch
    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False,
                output_dtype=None, output_scales=None, output_scalar_scale=1.0, sf_layout=None,
                output=None, *, use_low_precision=False, active_rank_mask=None):
        """Collective (over the active ranks). payload [ep_size, runtime_max, H] -> [T, H]: per
        token the sum, in ascending rank order, of the rows the active ranks it went to return
        (zeros when it went to none). With ``output``, the result is copied into it and it is
        returned. ``output_scalar_scale`` and ``sf_layout`` only matter for quantised outputs
        (``output_scales``), which epx does not produce."""
        op = "MoeAlltoAll.combine"
        if output_scales is not None:
            raise errors.unsupported(op, "output_scales: epx's combine returns the payload's "
                                     "dtype; quantised (MXFP8/MXFP4/NVFP4) combine outputs are "
                                     "not implemented")
        if use_low_precision:
            raise errors.unsupported(op, "use_low_precision=True: epx's combine moves the "
                                     "payload's own dtype (no FP8 combine transport)")
        if self._state != "dispatched":
            raise errors.invalid(op, "called without a preceding dispatch; expected the order "
                                 "dispatch -> combine -> dispatch")
        if self._rank_mask(op, active_rank_mask) != self._active:
            raise errors.invalid(op, "argument 'active_rank_mask' differs from the mask of the "
                                 "preceding dispatch, expected the same mask")
        dtype = getattr(payload, "dtype", None)
        if output_dtype is not None and output_dtype != dtype:
            raise errors.invalid(op, f"argument 'output_dtype' is {output_dtype} without "
                                 f"output_scales, expected the payload's dtype {dtype}")
        if output is not None:
            want = [self._num_tokens, payload.shape[-1] if payload.dim() else 0]
            if not isinstance(output, torch.Tensor) or list(output.shape) != want or \
                    output.dtype != dtype or output.device != payload.device or \
                    not output.is_contiguous():
                got = (f"{list(output.shape)} {output.dtype} on {output.device}"
                       f"{'' if output.is_contiguous() else ', not contiguous'}"
                       if isinstance(output, torch.Tensor) else type(output).__name__)
                raise errors.invalid(op, f"argument 'output' is {got}, expected a contiguous "
                                     f"{want} {dtype} tensor on {payload.device}")
        out = self._a2a.combine(payload, int(runtime_max_tokens_per_rank),
                                bool(payload_in_workspace))
        self._state = "idle"
        self._eplb_gathered = None
        if output is not None:
            output.copy_(out)
            return output
        return out
