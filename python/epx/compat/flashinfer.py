"""Drop-in for FlashInfer's ``MoeAlltoAll`` (flashinfer.comm, TensorRT-LLM's one-sided NVLink
all-to-all), implemented on epx's a2a mode (docs/semantics.md §3): ``from epx.compat.flashinfer
import MoeAlltoAll, Mapping, moe_a2a_get_workspace_size_per_rank``. ``python3 -m epx.compat.shim``
prints a directory to put first on PYTHONPATH so that ``import flashinfer`` itself gives these names
(epx/compat/shim/flashinfer/__init__.py).

Where it lives: this module holds :class:`MoeAlltoAll`, the workspace sizing
(:func:`moe_a2a_get_workspace_size_per_rank`) and :func:`moe_a2a_initialize` (it creates a
MoeAlltoAll), and re-exports the rest from private siblings, which import nothing from here:
``_flashinfer_functional`` (``moe_a2a_dispatch`` / ``_combine`` / ``_sanitize_expert_ids`` /
``_wrap_payload_tensor_in_workspace`` and the registry of the contexts they run in),
``_flashinfer_config`` (Mapping, MnnvlConfig, CommBackend, TorchDistBackend,
is_mnnvl_fabric_supported) and ``_flashinfer_common`` (rank masks, the padding of rows of any
byte count, the FP8 rounding of ``use_low_precision``, nvfp4_block_scale_interleave: epx's own,
:func:`epx.nvfp4_block_scale_interleave`, in C++ with a CUDA kernel). Import every name from
here.

How it maps, and what differs:

* The workspace: epx sizes it from the payloads. FlashInfer takes one byte count; epx creates an
  A2a per payload list (number of payloads, top_k, num_experts) lazily at that list's first
  dispatch (collectively, every rank passes payloads of the same row sizes), with the row bytes
  of that call's payloads, and re-creates it when a later dispatch of the list brings longer
  rows; a given ``workspace_size_per_rank`` bounds each list's A2a (so an object serving two
  lists takes up to twice it). The combine capacity per token is ``hidden_size * 4`` (bf16,
  float16 or float32 payloads) when ``hidden_size`` is given, capped by
  ``workspace_size_per_rank`` when that is given too; with only ``workspace_size_per_rank`` it is
  what fits in it. A CUDA graph captured through an A2a that a later dispatch re-creates replays
  into freed memory: run every layer (every object sharing the workspace) once with its largest
  payloads before capturing.
* The group: ``mnnvl_config.comm_backend`` (anything with Get_rank / Get_size / allgather, e.g.
  :class:`TorchDistBackend`, FlashInfer's own, or an engine's CommBackend over a ProcessGroup)
  bootstraps the epx group; without it the default torch.distributed group is used. The backend
  is chosen when the MoeAlltoAll is made, before any tensor is seen: cuda where epx was built
  with CUDA and torch sees a GPU, else cpu; the epx-only keyword ``backend="cpu"`` / ``"cuda"``
  overrides it. The tensors must then be on that backend's device (cpu tensors on a cuda
  MoeAlltoAll raise InvalidArgument naming the argument and the device expected).
* One workspace, many objects: engines make one MoeAlltoAll per MoE layer with the same sizes,
  and FlashInfer's class-level cache gives them one workspace. epx's objects with the same
  workspace_size_per_rank and hidden_size, ep_rank, ep_size, max_num_tokens,
  eplb_stats_num_experts and device share one epx group and its A2as (the first one's
  comm_backend makes the group; making an object is collective: the ranks agree to join the
  live workspace or to make a new one) while any of them lives; their calls must not interleave
  (one layer's dispatch -> combine, then the next's), as on FlashInfer's shared workspace. An
  object keeps one A2a per payload list (number of payloads, top_k, num_experts), so layers of
  different payloads (an NVFP4 model's 4, a bf16 head's 3) each reuse theirs.
  moe_a2a_initialize's contexts have their own (the caller's workspace tensor is its own).
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
  continues. An A2a created or re-created (a payload list's first use, larger payloads) needs
  every rank (it is collective over the whole group), so it raises Unsupported while a rank is
  masked off. ``dropped_counts()`` (epx extension) returns (tokens, selections) the mask
  dropped from this rank's dispatches.
* The functional API (``moe_a2a_initialize``, ``moe_a2a_dispatch``, ``moe_a2a_combine``,
  ``moe_a2a_sanitize_expert_ids``): ``moe_a2a_initialize(workspace, ...)`` (collective) creates a
  context, a MoeAlltoAll over the group (the default torch.distributed group, or the epx-only
  keyword ``comm_backend=``), and returns the metainfo naming it (CPU int64 [8]); the other calls
  run the class's dispatch / combine in that context. The caller's ``workspace`` (uint8
  ``[ep_size, size_per_rank]``, on the CPU for the cpu backend, on the GPU for cuda) is the
  handle: its row size bounds epx's workspace, as ``workspace_size_per_rank`` does, and its row
  ``ep_rank`` is where the caller may write the combine payload
  (``moe_a2a_wrap_payload_tensor_in_workspace`` at ``combine_payload_offset``, which is 0; the
  combine copies it from there). The data moves through epx's own workspace; the received views
  are views of it. ``top_k`` / ``num_experts`` may change between dispatches (the first of each
  geometry creates its A2a, collectively). The context lives while a metainfo tensor returned for
  it does.
* Payload rows of any byte count and dtype (FlashInfer's test sends uint8 [T, 1] and bool rows):
  rows that are not a multiple of 4 bytes travel padded (one copy into a zeroed uint8 [T,
  round4] tensor) and come back as views of the padded rows (not contiguous); dtypes epx's a2a
  does not name (int8, int16, float64, float8_e5m2, ...) travel as their bytes.
* ``use_low_precision=True``: FlashInfer's FP8 combine, its result: every row rounded to FP8
  e4m3 (nearest, ties to even, saturating at +-448), the rounded values summed in float32 in
  ascending rank order, the sum rounded once to bfloat16 (the output dtype, whatever the
  payload's: bf16, fp16 or f32). epx moves the rounded rows in bfloat16 (f32 for an f32 payload
  in epx's workspace; an fp16 one's are written over it as bf16 rows), so the bytes on the wire
  are not halved as in FlashInfer.
* Multi-node NVLink: epx has no MNNVL fabric path of its own; :func:`is_mnnvl_fabric_supported`
  is False and ``MnnvlConfig``'s sizes are kept, unused. The cuda backend's memory is NCCL
  symmetric memory over the ranks of the group's NVLink (LSA) domain (docs/semantics.md §8.1).

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
                                                  Gathered on the device by a second, small epx
                                                  A2a (stream-ordered, capturable, masked like
                                                  the dispatch: masked-off rows unspecified),
                                                  made with the MoeAlltoAll (so a gather needs
                                                  only the active ranks); every rank passes
                                                  stats, or none
MoeAlltoAll(enable_rank_mask=True)                honoured; a dispatch/combine without
                                                  ``active_rank_mask``, or with one leaving out
                                                  this rank, is InvalidArgument (as in
                                                  FlashInfer)
MoeAlltoAll(backend=), get_workspace(backend=)    FlashInfer's "trtllm": epx's default backend;
                                                  "cake" (SM 100 / 103 kernels): Unsupported;
                                                  epx's "cpu" / "cuda": that backend
dispatch(enable_pdl=), combine(enable_pdl=)       accepted (epx's PDL is EPX_PDL)
MoeAlltoAll(num_experts=E), E not a multiple of   InvalidArgument (FlashInfer splits the
ep_size                                           experts ceil/floor; epx's a2a E / ep_size)
dispatch(token_selected_experts, input_payloads,  honoured (T = 0 allowed; rows of any byte
runtime_max_tokens_per_rank)                      count, see above)
dispatch(invalid_token_expert_id=v,               honoured (padding rows of that payload = v);
expert_id_payload_index=i)                        ``i`` without ``v`` is ignored, ``v`` without
                                                  ``i`` is InvalidArgument
dispatch(eplb_local_stats=), combine/dispatch     honoured (see above)
(active_rank_mask=)
combine(payload, runtime_max_tokens_per_rank,     honoured
payload_in_workspace)
combine(output=t)                                 honoured: the result is copied into ``t``
                                                  ([T, H], the output's dtype, the payload's
                                                  device, contiguous) and ``t`` is returned
combine(payload) of float16                       honoured: the f32 sum rounded once to
                                                  float16 (nearest, ties to even; +-inf from
                                                  65520 on), the output's dtype (output= /
                                                  output_dtype= float16), as FlashInfer, whose
                                                  sum in top-k slot order can differ in the
                                                  last bit where the order matters
combine(payload) of float8_e4m3fn                 InvalidArgument without use_low_precision
                                                  (epx's combine sums bf16, f16 or f32 rows)
combine(output_dtype=d)                           honoured when ``d`` is the payload's dtype;
                                                  another ``d`` without ``output_scales`` is
                                                  InvalidArgument (as in FlashInfer)
combine(output_scales=)                           Unsupported: FlashInfer's quantised combine
                                                  (MXFP8 / MXFP4 / NVFP4 outputs) runs only on
                                                  compute capability >= 10.0, never on Hopper
                                                  (its binding refuses SM < 100; its converters
                                                  exist only for SM >= 100). What it computes,
                                                  and FlashInfer's source files that say so:
                                                  docs/semantics.md §8.2
combine(output_scalar_scale=, sf_layout=)         accepted; they only act with output_scales
                                                  (FlashInfer ignores them otherwise too)
combine(use_low_precision=True)                   honoured: FlashInfer's result (rows rounded
                                                  to e4m3, f32 sum, bf16 output); the rows
                                                  travel in bf16 (see above)
get_combine_payload_tensor_in_workspace           honoured
MoeAlltoAll.get_moe_workspace_size_per_rank       honoured (epx's sizes, 16-bit hidden states)
(static), moe_a2a_get_workspace_size_per_rank
(... eplb_stats_num_experts)
eplb_gathered_stats, enable_rank_mask, ep_rank,   honoured (attributes)
ep_size, top_k, num_experts, max_num_tokens
MoeAlltoAll.get_workspace (classmethod)           honoured: collective at the first call for
                                                  its arguments, then cached; FlashInfer's dict
                                                  (workspace: uint8 [ep_size, size], rows views
                                                  of one zeroed row; metainfo of
                                                  moe_a2a_initialize; mnnvl_mem None)
workspace, metainfo                               honoured: a workspace and a metainfo naming
                                                  this object for the functional API (made at
                                                  the first access, nothing collective)
mnnvl_mem                                         None (epx maps no MNNVL memory)
checkpoint_prepare, checkpoint_restore            honoured, collective: the A2a, the EPLB
                                                  exchange and the group released, then made
                                                  again over restore's comm_backend; between
                                                  them dispatch / combine are InvalidArgument
moe_a2a_initialize, moe_a2a_dispatch,             honoured (see above); ``enable_pdl``
moe_a2a_combine (output=, use_low_precision,      accepted (epx's PDL is EPX_PDL); a mask with
enable_rank_mask, active_rank_mask),              enable_rank_mask=False, enable_rank_mask=True
moe_a2a_sanitize_expert_ids                       without a mask, a mask leaving out ep_rank:
                                                  InvalidArgument (as FlashInfer)
moe_a2a_wrap_payload_tensor_in_workspace          honoured (a byte-range view of any tensor)
moe_a2a_active_rank_mask                          honoured
is_mnnvl_fabric_supported(device_idx)             False (no multi-node NVLink fabric path)
Mapping(..., cp_config, attn_tp_size,             honoured (auto_parallel: tp/pp/cp ranks are 0)
attn_cp_size, auto_parallel)
MnnvlConfig(comm_backend, allocation_granularity, comm_backend honoured; the sizes are kept
fabric_page_size)                                 (epx does not map fabric pages)
================================================  =============================================
"""

import contextlib
import math
import weakref

import torch
import torch.distributed as dist

from .. import _epx, _torch, errors
from ..buffer import A2a as _EpxA2a
from ..group import Group as _EpxGroup
from ._flashinfer_common import MOE_A2A_RANK_MASK_WORDS  # noqa: F401 (re-exported for the shim)
from ._flashinfer_common import (_LOW_PRECISION_DTYPES, _backend_name, _mask_bools, _pad_rows,
                                 _round4, _round_to_e4m3, _unpad_view, check_kernel_backend,
                                 moe_a2a_active_rank_mask, nvfp4_block_scale_interleave)
from ._flashinfer_config import (CommBackend, Mapping, MnnvlConfig, TorchDistBackend,
                                 is_mnnvl_fabric_supported)
from ._flashinfer_functional import (_context_counter, _context_ids, _contexts, _FunctionalContext,
                                     _release_context, moe_a2a_combine, moe_a2a_dispatch,
                                     moe_a2a_sanitize_expert_ids,
                                     moe_a2a_wrap_payload_tensor_in_workspace)

__all__ = ["CommBackend", "Mapping", "MnnvlConfig", "MoeAlltoAll", "TorchDistBackend",
           "is_mnnvl_fabric_supported", "moe_a2a_active_rank_mask", "moe_a2a_combine",
           "moe_a2a_dispatch", "moe_a2a_get_workspace_size_per_rank", "moe_a2a_initialize",
           "moe_a2a_sanitize_expert_ids", "moe_a2a_wrap_payload_tensor_in_workspace",
           "nvfp4_block_scale_interleave"]

# The public names the private siblings define are this module's, as before they moved there:
# reprs, the type names in error messages and pickles name epx.compat.flashinfer.
for _public in (CommBackend, Mapping, MnnvlConfig, TorchDistBackend, is_mnnvl_fabric_supported,
                moe_a2a_active_rank_mask, moe_a2a_combine, moe_a2a_dispatch,
                moe_a2a_sanitize_expert_ids, moe_a2a_wrap_payload_tensor_in_workspace,
                nvfp4_block_scale_interleave):
    _public.__module__ = __name__
del _public

#: The largest top-k of epx's a2a (include/epx/a2a.h, A2aShape; src/core/a2a_validate.cc).
_MAX_A2A_TOP_K = 32

#: Why combine(output_scales=) is Unsupported (docs/semantics.md §8.2 has what FlashInfer computes
#: there): a program written for FlashInfer cannot use it on Hopper, so nothing reachable there is
#: missing.
_QUANTISED_COMBINE = (
    "output_scales: FlashInfer's quantised combine (MXFP8 / MXFP4 / NVFP4 outputs) runs only on "
    "compute capability >= 10.0: its binding (csrc/trtllm_moe_alltoall.cu) rejects SM < 100 and "
    "its converters (csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh) are compiled "
    "for SM >= 100 only, so no Hopper program uses it; epx's combine returns the sum in the "
    "payload's dtype (docs/semantics.md §8.2)")


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens,
                                        total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token,
                                        eplb_stats_num_experts=0, *, backend=None):
    """Bytes per rank epx's a2a workspace takes for these payloads (on the cuda backend when it is
    built and a GPU is present, else the cpu one), whatever the split of the dispatch bytes into
    up to 8 payloads: each payload's row is rounded up to 4 bytes (at least 4), so the total is
    counted with 4 bytes more per possible payload, and each payload's region aligned.
    ``eplb_stats_num_experts`` adds nothing: epx gathers the EPLB stats through a separate small
    A2a (MoeAlltoAll._gather_eplb)."""
    op = "moe_a2a_get_workspace_size_per_rank"
    check_kernel_backend(op, backend)
    errors.check_int(op, "eplb_stats_num_experts", eplb_stats_num_experts, 0)
    errors.check_int(op, "ep_size", ep_size, 1)
    errors.check_int(op, "max_num_tokens", max_num_tokens, 1)
    errors.check_int(op, "total_dispatch_payload_size_per_token",
                     total_dispatch_payload_size_per_token, 0)
    errors.check_int(op, "combine_payload_size_per_token", combine_payload_size_per_token, 0)
    return _workspace_size(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                           combine_payload_size_per_token, _backend_name())


def _workspace_size(ep_size, max_num_tokens, dispatch_bytes, combine_bytes, backend):
    """moe_a2a_get_workspace_size_per_rank on `backend` ("cpu" / "cuda"): the most payloads, all
    but one of the least row (4 bytes), the last with the rest and 4 bytes of rounding per
    payload; then 256 bytes per payload for its region's alignment."""
    P = _epx.kMaxA2aPayloads
    rows = [4] * (P - 1) + [_round4(dispatch_bytes + 4 * P)]
    num = _EpxA2a.workspace_bytes(max_num_tokens, 1, ep_size, rows,
                                  max(_round4(combine_bytes), 4), ep_size, backend)
    return num + P * 256


def _check_backend(op, backend):
    """The keyword ``backend`` -> "cpu" or "cuda": epx's own "cpu" / "cuda"; None or FlashInfer's
    default "trtllm" (its kernel choice): :func:`_backend_name`; FlashInfer's "cake" (generated
    kernels for SM 100 / 103 only) is Unsupported."""
    if backend in ("cpu", "cuda"):
        return backend
    if backend not in (None, "trtllm", "cake"):
        raise errors.invalid(op, f"argument 'backend' is {backend!r}, expected 'cpu', 'cuda' "
                             "or FlashInfer's 'trtllm'")
    check_kernel_backend(op, backend)
    return _backend_name()


def _device_of(backend):
    return torch.device("cpu") if backend == "cpu" else \
        torch.device("cuda", torch.cuda.current_device())


def _row_workspace(ep_size, size_per_rank, device):
    """uint8 [ep_size, size_per_rank], zeroed, every row a view of one row (epx reads only row
    ep_rank of a caller's workspace, the combine payload's place)."""
    return torch.zeros(size_per_rank, dtype=torch.uint8, device=device).expand(ep_size, -1)


def _comm_of(op, comm, ep_rank, ep_size, what):
    """A CommBackend (anything with Get_rank / Get_size / allgather), a ProcessGroup, or None
    (the default torch.distributed group) -> a CommBackend of rank ep_rank of ep_size."""
    if comm is None:
        if not dist.is_initialized():
            raise errors.invalid(op, f"no {what} and torch.distributed is not initialised, "
                                 "expected one of them")
        comm = TorchDistBackend()
    elif isinstance(comm, dist.ProcessGroup):
        comm = TorchDistBackend(comm)
    rank, size = int(comm.Get_rank()), int(comm.Get_size())
    if (rank, size) != (ep_rank, ep_size):
        raise errors.invalid(op, f"argument '{what}' has rank {rank} of {size}, expected "
                             f"mapping.moe_ep_rank {ep_rank} of moe_ep_size {ep_size}")
    return comm


# moe_a2a_initialize creates a MoeAlltoAll, so it lives here; the other functional calls
# (_flashinfer_functional) only use the context it registers there.
def moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts=0, *,
                       backend=None, comm_backend=None):
    """Collective: every rank calls it once for its workspace before the other moe_a2a_* calls.
    ``workspace``: uint8 ``[ep_size, size_per_rank]`` on this rank's device (a CPU tensor: the
    cpu backend; on a GPU: cuda), row ``ep_rank`` zeroed here. Returns the metainfo (CPU int64
    ``[8]``) that names the context the other calls run in: a :class:`MoeAlltoAll` over the group
    (``comm_backend``, an epx-only keyword: a CommBackend or ProcessGroup; default: the default
    torch.distributed group), whose epx workspace moves the data, bounded by ``size_per_rank``.
    Calling it again with the same arguments returns an equal metainfo and the same context
    (FlashInfer's is idempotent too). The context lives while a metainfo returned for it does."""
    op = "moe_a2a_initialize"
    check_kernel_backend(op, backend)
    errors.check_int(op, "ep_size", ep_size, 1)
    errors.check_int(op, "ep_rank", ep_rank, 0)
    errors.check_int(op, "max_num_tokens", max_num_tokens, 1)
    errors.check_int(op, "eplb_stats_num_experts", eplb_stats_num_experts, 0)
    if ep_rank >= ep_size:
        raise errors.invalid(op, f"ep_rank = {ep_rank}, expected < ep_size = {ep_size}")
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or \
            workspace.dim() != 2 or workspace.shape[0] != ep_size or workspace.shape[1] < 1 or \
            workspace.stride(1) != 1:
        got = (f"{workspace.dtype} {list(workspace.shape)}" if isinstance(workspace, torch.Tensor)
               else type(workspace).__name__)
        raise errors.invalid(op, f"argument 'workspace' is {got}, expected a uint8 tensor "
                             f"[ep_size = {ep_size}, size_per_rank >= 1], rows contiguous")
    key = (workspace.data_ptr(), str(workspace.device), tuple(workspace.shape),
           workspace.stride(0), ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts)
    workspace[ep_rank].zero_()
    cid = _context_ids.get(key)
    if cid is None:
        mapping = Mapping(world_size=ep_size, rank=ep_rank, tp_size=ep_size, moe_ep_size=ep_size)
        cfg = MnnvlConfig(comm_backend=comm_backend)
        # top_k and num_experts come with every dispatch (MoeAlltoAll._set_geometry); every
        # call passes its mask (enable_rank_mask=False: all ranks).
        on_gpu = workspace.is_cuda
        with torch.cuda.device(workspace.device) if on_gpu else contextlib.nullcontext():
            # Its own epx workspace, as the caller's workspace tensor is its own (not shared
            # with MoeAlltoAll objects of the same sizes).
            moe = MoeAlltoAll.__new__(MoeAlltoAll)
            moe._setup(mapping, max_num_tokens, 1, ep_size, workspace.shape[1], None, cfg, 0,
                       True, "cuda" if on_gpu else "cpu", share=False)
        moe._eplb_capacity, moe._eplb_exact = eplb_stats_num_experts, False
        moe._make_eplb_exchange()
        cid = next(_context_counter)
        _contexts[cid] = _FunctionalContext(key, cid, moe, workspace, ep_rank, ep_size,
                                            max_num_tokens, eplb_stats_num_experts)
        _context_ids[key] = cid
    ctx = _contexts[cid]
    metainfo = torch.tensor(ctx.metainfo, dtype=torch.int64)
    ctx.refs += 1
    weakref.finalize(metainfo, _release_context, cid).atexit = False
    return metainfo


class _Workspace:
    """What the MoeAlltoAll objects of one FlashInfer workspace share (FlashInfer's class-level
    cache gives every MoeAlltoAll of the same workspace_size_per_rank, ep_rank, ep_size,
    max_num_tokens and eplb_stats_num_experts one workspace, and engines make one object per MoE
    layer): the epx group, one epx A2a per payload layout (the number of payloads, top_k,
    num_experts; its rows grow to the largest seen, so layers of different payloads each keep
    theirs instead of re-creating one), the rank mask the group is in, and the EPLB stats'
    exchange. An A2a entry is [A2a, row bytes, the mask applied to it]."""

    def __init__(self, group, ep_size):
        self.group = group
        self.a2as = {}
        self.active = [True] * ep_size
        self.eplb = None  # [A2a, topk_idx to every rank, zero combine payload, mask applied]
        self.restores = 0  # checkpoint_restore calls: each object's state is idle after one


class MoeAlltoAll:
    """FlashInfer's one-sided all-to-all for MoE, on epx a2a. Collective to create (the first
    object of a workspace; later objects of the same workspace share it, _Workspace)."""

    @staticmethod
    def get_moe_workspace_size_per_rank(ep_size, top_k, max_num_tokens, hidden_size,
                                        extra_payload_bytes_per_token=0,
                                        eplb_stats_num_experts=0, *, backend=None):
        """:func:`moe_a2a_get_workspace_size_per_rank` for 16-bit hidden states, int32 expert ids
        and float32 weights (top_k each) plus ``extra_payload_bytes_per_token``, and a 16-bit
        combine payload of ``hidden_size`` (FlashInfer's convenience sizing)."""
        op = "MoeAlltoAll.get_moe_workspace_size_per_rank"
        errors.check_int(op, "top_k", top_k, 1)
        errors.check_int(op, "hidden_size", hidden_size, 1)
        errors.check_int(op, "extra_payload_bytes_per_token", extra_payload_bytes_per_token, 0)
        return moe_a2a_get_workspace_size_per_rank(
            ep_size, max_num_tokens, hidden_size * 2 + top_k * 8 + extra_payload_bytes_per_token,
            hidden_size * 2, eplb_stats_num_experts, backend=backend)

    #: get_workspace's workspaces, one per (workspace_size_per_rank, ep_rank, ep_size,
    #: max_num_tokens, eplb_stats_num_experts, backend), as FlashInfer's class-level cache.
    _WORKSPACE_CACHE = {}

    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                      eplb_stats_num_experts=0, *, comm_backend=None, backend=None):
        """Collective at the first call for these arguments (moe_a2a_initialize), cached after:
        FlashInfer's dict of ``workspace_size_per_rank``, ``max_num_tokens``, ``ep_rank``,
        ``ep_size``, ``eplb_stats_num_experts``, ``workspace`` (uint8 ``[ep_size,
        workspace_size_per_rank]``, zeroed, on the backend's device; every row is a view of this
        rank's one row, the only one epx's calls read, so it takes the memory of one row as
        FlashInfer's MNNVL mapping does), ``metainfo`` (moe_a2a_initialize's for it) and
        ``mnnvl_mem`` (None: epx maps no MNNVL memory). ``comm_backend`` and ``backend``
        (``"cpu"`` / ``"cuda"``) are epx-only keywords, as for moe_a2a_initialize and
        MoeAlltoAll."""
        op = "MoeAlltoAll.get_workspace"
        errors.check_int(op, "workspace_size_per_rank", workspace_size_per_rank, 1)
        errors.check_int(op, "ep_size", ep_size, 1)
        errors.check_int(op, "ep_rank", ep_rank, 0)
        errors.check_int(op, "max_num_tokens", max_num_tokens, 1)
        errors.check_int(op, "eplb_stats_num_experts", eplb_stats_num_experts, 0)
        got = (getattr(mapping, "moe_ep_rank", None), getattr(mapping, "moe_ep_size", None))
        if got != (ep_rank, ep_size):
            raise errors.invalid(op, f"argument 'mapping' has moe_ep_rank, moe_ep_size = {got}, "
                                 f"expected ep_rank, ep_size = {(ep_rank, ep_size)}")
        backend = _check_backend(op, backend)
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts,
               backend)
        if key not in cls._WORKSPACE_CACHE:
            workspace = _row_workspace(ep_size, workspace_size_per_rank, _device_of(backend))
            metainfo = moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens,
                                          eplb_stats_num_experts, comm_backend=comm_backend)
            cls._WORKSPACE_CACHE[key] = {
                "workspace_size_per_rank": workspace_size_per_rank,
                "max_num_tokens": max_num_tokens, "ep_rank": ep_rank, "ep_size": ep_size,
                "eplb_stats_num_experts": eplb_stats_num_experts, "mnnvl_mem": None,
                "workspace": workspace, "metainfo": metainfo}
        return cls._WORKSPACE_CACHE[key]

    @property
    def workspace(self):
        """uint8 ``[ep_size, workspace_size_per_rank]`` (FlashInfer's sizing from
        ``hidden_size`` when not given): this MoeAlltoAll's handle for the functional API. With
        :attr:`metainfo`, ``moe_a2a_dispatch`` / ``_combine`` / ``_sanitize_expert_ids`` run on
        this object (its state, its epx workspace), as FlashInfer's methods run those ops on its
        workspace. Made at the first access of either, locally (nothing collective); its rows
        are views of one zeroed row (see get_workspace), row ``ep_rank`` is where the combine
        payload may be written (``combine_payload_offset`` 0)."""
        return self._handle()[0]

    @property
    def metainfo(self):
        """CPU int64 ``[8]`` naming this MoeAlltoAll for the functional API (see
        :attr:`workspace`); ``moe_a2a_initialize(self.workspace, ep_rank, ep_size,
        max_num_tokens, eplb_stats_num_experts)`` returns an equal one. Valid while the object
        lives."""
        return self._handle()[1]

    @property
    def mnnvl_mem(self):
        """None: epx maps no MNNVL memory (its cuda workspace is NCCL symmetric memory);
        FlashInfer's own calls read it only to see whether checkpoint_prepare released the
        workspace, which this class tracks itself."""
        return None

    def checkpoint_prepare(self):
        """Collective over every rank: releases epx's workspaces (the A2a, the EPLB exchange)
        and its group (the NCCL communicator on cuda) so that the process can be checkpointed;
        checkpoint_restore re-creates them. Between the two, dispatch / combine raise
        InvalidArgument. Again before a restore: nothing. Between dispatch and combine:
        InvalidArgument (as FlashInfer)."""
        op = "MoeAlltoAll.checkpoint_prepare"
        if self._group is None:
            return
        self._check_live(op)
        if self._state != "idle":
            raise errors.invalid(op, "called between dispatch and combine, expected the "
                                 "MoeAlltoAll idle (after combine)")
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        ws = self._ws
        ws.group.barrier()  # no rank still reads a peer's workspace
        ws.eplb = None
        ws.a2as = {key: [None, entry[1], None] for key, entry in ws.a2as.items()}
        ws.group.barrier()  # every rank has released its workspaces
        ws.group = None

    def checkpoint_restore(self, comm_backend):
        """Collective over every rank, after checkpoint_prepare (else nothing): a new group over
        ``comm_backend`` (rank and size as the MoeAlltoAll's; a CommBackend or ProcessGroup),
        the A2a re-created for the payload sizes and geometry it had, the EPLB exchange too;
        every rank active again, the state idle."""
        op = "MoeAlltoAll.checkpoint_restore"
        if self._group is not None:
            return
        comm = _comm_of(op, comm_backend, self.ep_rank, self.ep_size, "comm_backend")
        ws = self._ws
        ws.group = _EpxGroup.from_comm(comm, self._device)
        ws.active = [True] * self.ep_size
        ws.restores += 1
        self._check_live(op)  # this object's state idle (and every other's at its next call)
        for key, entry in list(ws.a2as.items()):
            self._create_a2a(key, entry[1])
        self._make_eplb_exchange()

    @property
    def eplb_gathered_stats(self):
        """[ep_size, eplb_stats_num_experts] int32 of the last dispatch's ``eplb_local_stats``
        (row r = rank r's), between that dispatch and its combine; else None."""
        return self._eplb_gathered

    #: The shared workspaces of the live objects (_Workspace), by FlashInfer's cache key and the
    #: sizes epx's A2a depends on; an entry ends with its last object.
    _WORKSPACES = weakref.WeakValueDictionary()

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0,
                 enable_rank_mask=False, *, backend=None):
        self._setup(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank,
                    hidden_size, mnnvl_config, eplb_stats_num_experts, enable_rank_mask, backend,
                    share=True)

    def _setup(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank,
               hidden_size, mnnvl_config, eplb_stats_num_experts, enable_rank_mask, backend,
               share):
        """__init__; `share`: join the live objects' workspace of the same key (a functional
        context, whose workspace tensor is its own, does not)."""
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
        # FlashInfer's attribute: the size given, else its convenience size for hidden_size.
        # epx bounds its own workspace by a given size only (_ws_limit); without one it sizes it
        # from the payloads (module docstring).
        self._ws_limit = workspace_size_per_rank
        self.workspace_size_per_rank = workspace_size_per_rank or \
            self.get_moe_workspace_size_per_rank(self.ep_size, top_k, max_num_tokens, hidden_size,
                                                 eplb_stats_num_experts=eplb_stats_num_experts)
        self.hidden_size = hidden_size
        if num_experts % self.ep_size:
            raise errors.invalid(op, f"num_experts = {num_experts}, expected a multiple of "
                                 f"moe_ep_size = {self.ep_size}")
        if eplb_stats_num_experts > num_experts:
            raise errors.invalid(op, f"eplb_stats_num_experts = {eplb_stats_num_experts}, "
                                 f"expected <= num_experts = {num_experts}")
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self.enable_eplb = eplb_stats_num_experts > 0
        self._eplb_capacity = eplb_stats_num_experts  # stats entries the exchange holds
        self._eplb_exact = True  # stats must have exactly that many (functional API: up to)
        self._eplb_gathered = None

        comm = getattr(mnnvl_config, "comm_backend", None) if mnnvl_config is not None else None
        comm = _comm_of(op, comm, self.ep_rank, self.ep_size, "mnnvl_config.comm_backend")
        self._device = _device_of(_check_backend(op, backend))
        key = (self._ws_limit, hidden_size, self.ep_rank, self.ep_size, max_num_tokens,
               eplb_stats_num_experts, str(self._device))
        ws = MoeAlltoAll._WORKSPACES.get(key) if share else None
        if ws is not None and ws.group is None:
            ws = None  # released by checkpoint_prepare
        if share:
            # Every rank joins, or every rank creates (collective): whether a rank still holds a
            # live workspace of the key depends on when its own garbage collector ran.
            if not all(comm.allgather(int(ws is not None))):
                ws = None
        if ws is None:
            ws = _Workspace(_EpxGroup.from_comm(comm, self._device), self.ep_size)
            if share:
                MoeAlltoAll._WORKSPACES[key] = ws
        self._ws = ws
        self._handles = None  # (workspace, metainfo) of the properties, made at first access
        self._layout = None  # the A2a layout (_Workspace.a2as key) of this object's last dispatch
        self._dispatch_mask = None  # the mask of this object's last dispatch
        self.enable_rank_mask = bool(enable_rank_mask)
        self._state = "idle"  # idle -> dispatched -> idle
        self._restores = ws.restores
        self._runtime_max = 0
        self._num_tokens = 0
        self.recv_counts = None  # [ep_size] int32 of the last dispatch (epx extension)
        self._make_eplb_exchange()

    # ---- internals ---------------------------------------------------------------------------
    @property
    def _group(self):
        return self._ws.group

    @property
    def _a2a(self):
        """The shared A2a of this object's last dispatch (None before one, or after
        checkpoint_prepare)."""
        entry = self._ws.a2as.get(self._layout)
        return entry[0] if entry is not None else None

    @property
    def _active(self):
        """The rank mask the group is in (epx keeps it as state; masks only shrink)."""
        return self._ws.active

    def _handle(self):
        """(workspace, metainfo) of the properties: a functional context whose MoeAlltoAll is
        this object (a weak proxy: the registry does not keep it alive; it ends with it)."""
        if self._handles is None:
            size = self.workspace_size_per_rank
            ws = _row_workspace(self.ep_size, size, self._device)
            n = self.eplb_stats_num_experts
            key = (ws.data_ptr(), str(ws.device), tuple(ws.shape), ws.stride(0), self.ep_rank,
                   self.ep_size, self.max_num_tokens, n)
            cid = next(_context_counter)
            ctx = _FunctionalContext(key, cid, weakref.proxy(self), ws, self.ep_rank,
                                     self.ep_size, self.max_num_tokens, n)
            ctx.refs = 1  # this object's; released when it is collected
            _contexts[cid], _context_ids[key] = ctx, cid
            weakref.finalize(self, _release_context, cid).atexit = False
            self._handles = (ws, torch.tensor(ctx.metainfo, dtype=torch.int64))
        return self._handles

    def _check_live(self, op):
        """InvalidArgument between checkpoint_prepare and checkpoint_restore; after a restore
        (through any object of the shared workspace) this object's state is idle again."""
        if self._group is None:
            raise errors.invalid(op, "called after checkpoint_prepare released the workspace, "
                                 "expected checkpoint_restore(comm_backend) first")
        if self._restores != self._ws.restores:
            self._restores = self._ws.restores
            self._state = "idle"
            self._eplb_gathered = self.recv_counts = None

    def _create_a2a(self, key, payload_bytes):
        """Collective: the shared A2a of layout `key` (number of payloads, top_k, num_experts)
        for payload rows of these byte counts (rounded), replacing the layout's smaller one."""
        ws = self._ws
        ws.a2as.pop(key, None)  # released before allocating the replacement
        a2a = _EpxA2a(ws.group, self.max_num_tokens, key[1], key[2], payload_bytes,
                      self._combine_bytes(payload_bytes))
        ws.a2as[key] = [a2a, payload_bytes, [True] * self.ep_size]
        return ws.a2as[key]

    def _make_eplb_exchange(self):
        """Collective: the EPLB stats' exchange (see _gather_eplb), made with the MoeAlltoAll
        (every rank active then), so that no gather ever needs a collective creation."""
        if self._eplb_capacity == 0 or self._ws.eplb is not None:
            return
        R = self.ep_size
        k = min(R, _MAX_A2A_TOP_K)
        g = -(-R // k)
        a2a = _EpxA2a(self._group, g, k, R, [4 * self._eplb_capacity], 4)
        ids = torch.arange(g * k, dtype=torch.int32).view(g, k)
        ids[ids >= R] = -1
        self._ws.eplb = [a2a, ids.to(self._device),
                         torch.zeros(R, g, 1, dtype=torch.float32, device=self._device),
                         [True] * R]

    def _combine_bytes(self, payload_bytes):
        cap = None if self.hidden_size is None else self.hidden_size * 4
        if self._ws_limit is None:
            return cap

        def fits(c):
            try:
                need = _EpxA2a.workspace_bytes(self.max_num_tokens, self.top_k, self.num_experts,
                                               payload_bytes, c, self.ep_size,
                                               self._group.backend)
            except errors.OutOfCapacity:
                return False  # more than one allocation may take (1 TiB per rank)
            return need <= self._ws_limit

        if not fits(4):
            need = _EpxA2a.workspace_bytes(self.max_num_tokens, self.top_k, self.num_experts,
                                           payload_bytes, cap or 4, self.ep_size,
                                           self._group.backend)
            raise errors.out_of_capacity(
                "MoeAlltoAll.dispatch", f"workspace_size_per_rank = "
                f"{self._ws_limit} bytes is too small for payloads of "
                f"{payload_bytes} bytes per token; epx needs {need} bytes "
                "(see moe_a2a_get_workspace_size_per_rank)")
        lo, hi = 4, (cap or 1 << 40)
        if fits(hi):
            return hi
        while hi - lo > 4:  # largest multiple of 4 that fits
            mid = (lo + hi) // 8 * 4
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _workspace(self, payloads, key):
        """The shared A2a entry of layout `key` (_Workspace: these payloads' count, top_k,
        num_experts): the layout's when they fit (the per-call fast path), else a new one sized
        for them (collective: every rank passes the same row sizes)."""
        try:
            payload_bytes = [p.element_size() * math.prod(p.shape[1:]) for p in payloads]
        except (AttributeError, TypeError):
            payload_bytes = None
        entry = self._ws.a2as.get(key)
        if entry is not None and payload_bytes is not None and all(
                n <= h for n, h in zip(payload_bytes, entry[1])):
            return entry
        if not all(self._active):
            raise errors.unsupported("MoeAlltoAll.dispatch", "a payload list's first use, "
                                     "payloads larger than its workspace's, or another top_k / "
                                     "num_experts while ranks are masked off: creating a "
                                     "workspace is collective over every rank")
        for i, p in enumerate(payloads):
            if not isinstance(p, torch.Tensor) or p.dim() < 1:
                raise errors.invalid("MoeAlltoAll.dispatch", f"argument 'input_payloads[{i}]' "
                                     "must be a torch.Tensor [T, ...]")
        payload_bytes = [max(_round4(n), 4) for n in payload_bytes]
        if entry is not None:
            payload_bytes = [max(n, h) for n, h in zip(payload_bytes, entry[1])]
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
        return self._create_a2a(key, payload_bytes)

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
        return _mask_bools(op, active_rank_mask, self.ep_size, self.ep_rank)

    def _set_geometry(self, op, top_k, num_experts):
        """The functional API's dispatch: top_k and num_experts come with every call; the first
        dispatch of a geometry creates its A2a (collective, as for larger payloads)."""
        if (top_k, num_experts) == (self.top_k, self.num_experts):
            return
        errors.check_int(op, "top_k", top_k, 1)
        errors.check_int(op, "num_experts", num_experts, 1)
        if num_experts % self.ep_size:
            raise errors.invalid(op, f"num_experts = {num_experts}, expected a multiple of "
                                 f"ep_size = {self.ep_size}")
        if self._state != "idle":
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        self.top_k, self.num_experts = top_k, num_experts

    def reset_dropped_counts(self):
        """epx extension: zero the drop counters (see dropped_counts)."""
        for entry in self._ws.a2as.values():
            if entry[0] is not None:
                entry[0].reset_dropped_counts()

    def dropped_counts(self):
        """epx extension: (tokens, selections) the rank mask dropped from this rank's
        dispatches through the workspace (include/epx/a2a.h, A2aDropCounts): every object
        sharing it (one per MoE layer) and every payload list counts."""
        counts = [e[0].dropped_counts() for e in self._ws.a2as.values() if e[0] is not None]
        return (sum(c[0] for c in counts), sum(c[1] for c in counts))

    def _check_eplb(self, op, stats):
        """eplb_local_stats checked before anything collective: an integer tensor of
        eplb_stats_num_experts entries (functional API: 1 .. its reserve, at most
        num_experts)."""
        cap = self._eplb_capacity
        if cap == 0:
            raise errors.invalid(op, "argument 'eplb_local_stats' is given but the "
                                 "MoeAlltoAll was created with eplb_stats_num_experts=0, "
                                 "expected > 0")
        ok = isinstance(stats, torch.Tensor) and stats.dim() == 1 and \
            not stats.is_floating_point() and stats.dtype != torch.bool
        n = stats.shape[0] if ok else -1
        if self._eplb_exact:
            ok, want = ok and n == cap, f"[{cap}] (eplb_stats_num_experts)"
        else:
            top = min(cap, self.num_experts)
            ok, want = ok and 1 <= n <= top, (f"[n], 1 <= n <= {top} (the "
                                             "eplb_stats_num_experts of moe_a2a_initialize, at "
                                             "most num_experts)")
        if not ok:
            got = (f"{stats.dtype} {list(stats.shape)}" if isinstance(stats, torch.Tensor)
                   else type(stats).__name__)
            raise errors.invalid(op, f"argument 'eplb_local_stats' is {got}, expected an "
                                 f"integer tensor {want}")

    def _gather_eplb(self, stats):
        """Every rank's eplb_local_stats -> [ep_size, n] int32, row r = rank r's: a view of a
        second, small epx A2a, valid until the next gather. Each rank sends its stats as G =
        ceil(ep_size / 32) tokens (top-k is at most 32), token g to ranks 32g .. 32g + 31 (one
        expert per rank), so every rank receives exactly one row from each. On the device and
        stream-ordered, so CUDA graphs capture it; it follows the rank mask (a masked-off rank's
        row is unspecified). Made with the MoeAlltoAll (_make_eplb_exchange)."""
        a2a, to_all, zeros, _ = self._ws.eplb
        g, n = to_all.shape[0], stats.shape[0]
        rows = stats.to(device=to_all.device, dtype=torch.int32).view(1, n)
        if g > 1:
            rows = rows.expand(g, n).contiguous()
        recv = a2a.dispatch(to_all, [rows], g).recv[0]
        a2a.combine(zeros, g)  # back to "idle" at once (dispatch -> combine -> dispatch)
        return recv[:, 0]

    @_torch.plain_torch
    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None,
                 eplb_local_stats=None, active_rank_mask=None, enable_pdl=None):
        """Collective (over the active ranks). -> list of [ep_size, runtime_max_tokens_per_rank,
        ...] views of the receive workspace, one per payload: row [s][j] is the j-th token rank
        s sent here (nothing from masked-off ranks). ``enable_pdl`` is accepted (epx's PDL is
        EPX_PDL)."""
        op = "MoeAlltoAll.dispatch"
        self._check_live(op)
        if self._state != "idle" and active_rank_mask is None:
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        return self._dispatch(op, self._rank_mask(op, active_rank_mask), token_selected_experts,
                              input_payloads, runtime_max_tokens_per_rank,
                              invalid_token_expert_id, expert_id_payload_index, eplb_local_stats)

    def _dispatch(self, op, active, token_selected_experts, input_payloads,
                  runtime_max_tokens_per_rank, invalid_token_expert_id=None,
                  expert_id_payload_index=None, eplb_local_stats=None):
        """dispatch with the mask as ep_size bools (the functional API's checked its own)."""
        self._check_live(op)
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
        if eplb_local_stats is not None:
            self._check_eplb(op, eplb_local_stats)
        ws = self._ws
        back = [p for p in range(self.ep_size) if active[p] and not ws.active[p]]
        if back:  # checked here: each A2a applies a new mask only when it is next used
            raise errors.invalid(op, f"argument 'active_rank_mask' marks rank {back[0]} active, "
                                 "which was masked off earlier; expected masks only to shrink "
                                 "(a masked-off rank cannot rejoin: create a new group and "
                                 "MoeAlltoAll to bring it back)")
        if active == self._dispatch_mask and self._state != "idle":
            raise errors.invalid(op, "called twice without combine in between; expected the "
                                 "order dispatch -> combine -> dispatch")
        input_payloads, widths = _pad_rows(input_payloads)
        layout = (len(input_payloads), self.top_k, self.num_experts)
        entry = self._workspace(input_payloads, layout)
        a2a = entry[0]
        # A new mask (collective over the ranks it marks active), on each A2a as it is used:
        # this layout's and the EPLB exchange (entries [A2a, ..., the mask applied to it]).
        stream = _torch.stream_of(token_selected_experts)
        for used in (entry, ws.eplb):
            if used is not None and used[-1] != active:
                used[0].set_active_ranks(active, stream=stream)
                used[-1] = list(active)
        ws.active = list(active)
        gathered = None
        if eplb_local_stats is not None:
            gathered = self._gather_eplb(eplb_local_stats)
        recv, counts = a2a.dispatch(token_selected_experts, list(input_payloads),
                                    runtime_max_tokens_per_rank, invalid_token_expert_id,
                                    expert_id_payload_index)
        recv = [v if w is None else _unpad_view(v, *w) for v, w in zip(recv, widths)]
        self._layout, self._dispatch_mask = layout, list(active)
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
        self._check_live(op)
        if self._state != "dispatched":
            raise errors.invalid(op, "called before dispatch; expected dispatch -> "
                                 "get_combine_payload_tensor_in_workspace -> combine")
        return self._a2a.combine_payload_view(runtime_max_tokens_per_rank, hidden_size, dtype)

    @_torch.plain_torch
    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False,
                output_dtype=None, output_scales=None, output_scalar_scale=1.0, sf_layout=None,
                output=None, *, use_low_precision=False, active_rank_mask=None,
                enable_pdl=None):
        """Collective (over the active ranks). payload [ep_size, runtime_max, H] -> [T, H]: per
        token the sum, in float32 and ascending rank order, of the rows the active ranks it went
        to return (zeros when it went to none), rounded once to the payload's dtype (bfloat16,
        float16 or float32; nearest, ties to even; float16 sums from 65520 on become +-inf). With
        ``output``, the result is copied into it and it is returned. ``output_scalar_scale`` and
        ``sf_layout`` only matter for quantised outputs (``output_scales``), which raise
        Unsupported: FlashInfer produces them only on compute capability >= 10.0
        (docs/semantics.md §8.2).

        ``use_low_precision=True`` (FlashInfer's FP8 combine): every row is first rounded to FP8
        e4m3 (nearest, ties to even, saturating at +-448), the rounded values are summed as
        above in float32 and the sum is rounded once to bfloat16, the output's dtype whatever the
        payload's (bf16, fp16 or f32). With ``payload_in_workspace`` the rows are rounded in
        place; an fp16 workspace payload's are written over it as bf16 rows, so that float16
        tensor afterwards holds bf16 bit patterns: refill it before using it again. epx moves
        the rounded rows in bfloat16 (f32 for an f32 workspace payload): the values are
        FlashInfer's (e4m3 values sum exactly in float32), the bytes on the wire are not halved.
        ``enable_pdl`` is accepted (epx's PDL is EPX_PDL)."""
        op = "MoeAlltoAll.combine"
        return self._combine(op, lambda: self._rank_mask(op, active_rank_mask), payload,
                             runtime_max_tokens_per_rank, payload_in_workspace, output_dtype,
                             output_scales, output, use_low_precision)

    def _check_workspace_view(self, op, payload, runtime_max_tokens_per_rank):
        """Checks that ``payload`` is this rank's get_combine_payload_tensor_in_workspace view
        (as epx's in-workspace combine checks it, InvalidArgument), before the low-precision
        combine rounds its rows in place."""
        M, hidden = int(runtime_max_tokens_per_rank), payload.shape[-1] if payload.dim() else 0
        view = self._a2a.combine_payload_view(M, hidden, payload.dtype)
        if payload.data_ptr() != view.data_ptr():
            raise errors.invalid(op, "payload_in_workspace=True but argument 'payload' does not "
                                 "point into this rank's workspace, expected the view of "
                                 "get_combine_payload_tensor_in_workspace")
        if payload.shape != view.shape or not payload.is_contiguous():
            raise errors.invalid(op, f"argument 'payload' is {list(payload.shape)} "
                                 f"{payload.dtype} (contiguous: {payload.is_contiguous()}), "
                                 f"expected the contiguous {list(view.shape)} view of "
                                 "get_combine_payload_tensor_in_workspace")

    def _combine(self, op, mask, payload, runtime_max_tokens_per_rank, payload_in_workspace,
                 output_dtype, output_scales, output, use_low_precision):
        """combine; ``mask()`` gives the call's mask as ep_size bools (checked after the
        state: the functional API's follows its own rules)."""
        self._check_live(op)
        if output_scales is not None:
            raise errors.unsupported(op, _QUANTISED_COMBINE)
        if self._state != "dispatched":
            raise errors.invalid(op, "called without a preceding dispatch; expected the order "
                                 "dispatch -> combine -> dispatch")
        if mask() != self._dispatch_mask:
            raise errors.invalid(op, "argument 'active_rank_mask' differs from the mask of the "
                                 "preceding dispatch, expected the same mask")
        dtype = getattr(payload, "dtype", None)
        if use_low_precision:
            if dtype not in _LOW_PRECISION_DTYPES:
                raise errors.invalid(op, f"argument 'payload' has dtype {dtype} with "
                                     "use_low_precision=True, expected bfloat16, float16 or "
                                     "float32")
            if output_dtype not in (None, torch.bfloat16):
                raise errors.invalid(op, f"argument 'output_dtype' is {output_dtype} with "
                                     "use_low_precision=True, expected bfloat16 (the "
                                     "low-precision combine's output, as in FlashInfer)")
            dtype = torch.bfloat16
        elif output_dtype is not None and output_dtype != dtype:
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
        if use_low_precision:
            rows = _round_to_e4m3(payload)
            if payload_in_workspace:  # checked before its rows are written over
                self._check_workspace_view(op, payload, runtime_max_tokens_per_rank)
                if payload.dtype == torch.float16:
                    # Summed as bf16 rows (exact; an f16 combine would round the sum to f16)
                    # written over the payload's bytes.
                    payload = payload.view(torch.bfloat16)
                payload.copy_(rows)  # exact: e4m3 values are bf16 and f32 values
            else:
                payload = rows.to(torch.bfloat16)  # exact: e4m3 values are bf16 values
        out = self._a2a.combine(payload, int(runtime_max_tokens_per_rank),
                                bool(payload_in_workspace))
        if use_low_precision and out.dtype != torch.bfloat16:
            out = out.to(torch.bfloat16)  # the f32 sum of an f32 workspace payload, rounded once
        self._state = "idle"
        self._eplb_gathered = None
        if output is not None:
            output.copy_(out)
            return output
        return out
