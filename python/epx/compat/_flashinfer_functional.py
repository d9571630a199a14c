"""Private to :mod:`epx.compat.flashinfer` (import the names from there): FlashInfer's functional
MoE all-to-all API but ``moe_a2a_initialize`` -- :func:`moe_a2a_dispatch`,
:func:`moe_a2a_combine`, :func:`moe_a2a_sanitize_expert_ids`,
:func:`moe_a2a_wrap_payload_tensor_in_workspace` -- and the registry of the contexts they run in.

FlashInfer's moe_a2a_* functions run on a caller-owned workspace ([ep_size, size_per_rank] uint8,
row r = rank r's MNNVL memory) and the metainfo moe_a2a_initialize returns. Here
moe_a2a_initialize creates a context: a MoeAlltoAll over the group (collective), whose epx A2a
moves the data. The workspace and the metainfo name that context; the workspace's row size
bounds epx's (as workspace_size_per_rank does) and its row ep_rank is where the caller may write
the combine payload (moe_a2a_wrap_payload_tensor_in_workspace at combine_payload_offset).
A MoeAlltoAll's ``workspace`` / ``metainfo`` properties register a context too, whose MoeAlltoAll
is that object (held weakly; the context ends with it), so the calls here run on its state.

``moe_a2a_initialize`` creates that MoeAlltoAll, so it lives beside the class in flashinfer.py and
fills the registry here (``_contexts``, ``_context_ids``, ``_FunctionalContext``); the calls here
only use the context's MoeAlltoAll instance, so this module imports no class from flashinfer.py
(no import cycle).
"""

import itertools

import torch

from .. import _torch, errors
from ._flashinfer_common import _mask_bools, check_kernel_backend

_METAINFO_MAGIC = 0x657078A2A  # "epx a2a"
# metainfo: [magic, context id, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts,
#            bytes per rank, combine_payload_offset], CPU int64.
_METAINFO_FIELDS = 8
_COMBINE_PAYLOAD_OFFSET = 0  # epx keeps nothing in the caller's workspace: the row is free
_contexts = {}     # context id -> _FunctionalContext
_context_ids = {}  # workspace (address, device, shape, row stride) + initialize's args -> id
_context_counter = itertools.count(1)  # ids are never reused


class _FunctionalContext:
    def __init__(self, key, cid, moe, workspace, ep_rank, ep_size, max_num_tokens, eplb):
        self.key, self.moe = key, moe
        self.ptr, self.shape = workspace.data_ptr(), tuple(workspace.shape)
        self.row_stride, self.device = workspace.stride(0), workspace.device
        self.ep_rank, self.ep_size, self.eplb = ep_rank, ep_size, eplb
        self.metainfo = [_METAINFO_MAGIC, cid, ep_rank, ep_size, max_num_tokens, eplb,
                         self.shape[1], _COMBINE_PAYLOAD_OFFSET]
        self.refs = 0  # metainfo tensors handed out and alive


def _release_context(cid):
    ctx = _contexts.get(cid)
    if ctx is not None:
        ctx.refs -= 1
        if ctx.refs == 0:  # the last metainfo is gone: nobody can name the context any more
            del _contexts[cid]
            _context_ids.pop(ctx.key, None)


def _context(op, workspace, metainfo, ep_rank, ep_size=None):
    """The context `metainfo` names, checked against the call's workspace and ranks."""
    ok = isinstance(metainfo, torch.Tensor) and metainfo.device.type == "cpu" and \
        metainfo.dtype == torch.int64 and list(metainfo.shape) == [_METAINFO_FIELDS]
    fields = metainfo.tolist() if ok else []
    if not fields or fields[0] != _METAINFO_MAGIC:
        raise errors.invalid(op, "argument 'metainfo' is not a tensor moe_a2a_initialize "
                             f"returned, expected its CPU int64 [{_METAINFO_FIELDS}] metainfo")
    ctx = _contexts.get(fields[1])
    if ctx is None:
        raise errors.invalid(op, "argument 'metainfo' names a workspace context that no longer "
                             "exists (every metainfo moe_a2a_initialize returned for it was "
                             "freed), expected a live one: call moe_a2a_initialize again")
    if fields != ctx.metainfo:
        raise errors.invalid(op, f"argument 'metainfo' is {fields}, expected {ctx.metainfo} "
                             "(as moe_a2a_initialize returned it)")
    if not isinstance(workspace, torch.Tensor) or workspace.data_ptr() != ctx.ptr or \
            tuple(workspace.shape) != ctx.shape:
        raise errors.invalid(op, f"argument 'workspace' is not the [{ctx.shape[0]}, "
                             f"{ctx.shape[1]}] tensor moe_a2a_initialize was given with this "
                             "metainfo")
    if ep_rank != ctx.ep_rank or (ep_size is not None and ep_size != ctx.ep_size):
        got = f"ep_rank = {ep_rank}" + ("" if ep_size is None else f", ep_size = {ep_size}")
        raise errors.invalid(op, f"{got}, expected ep_rank = {ctx.ep_rank}, ep_size = "
                             f"{ctx.ep_size} (the workspace's, from moe_a2a_initialize)")
    return ctx


def _functional_mask(op, enable_rank_mask, active_rank_mask, ep_size, ep_rank):
    """The call's mask as ep_size bools, FlashInfer's rules: a mask needs enable_rank_mask=True,
    and enable_rank_mask=True needs a mask (no all-active default)."""
    if not enable_rank_mask:
        if active_rank_mask is not None:
            raise errors.invalid(op, "argument 'active_rank_mask' is given with "
                                 "enable_rank_mask=False, expected enable_rank_mask=True")
        return [True] * ep_size
    if active_rank_mask is None:
        raise errors.invalid(op, "enable_rank_mask=True without 'active_rank_mask', expected a "
                             "mask on the call (as FlashInfer; every rank: "
                             "moe_a2a_active_rank_mask(range(ep_size), ep_size))")
    return _mask_bools(op, active_rank_mask, ep_size, ep_rank)


@_torch.plain_torch
def moe_a2a_dispatch(token_selected_experts, input_payloads, workspace, metainfo,
                     runtime_max_tokens_per_rank, ep_rank, ep_size, top_k, num_experts,
                     enable_pdl=None, eplb_local_stats=None, enable_rank_mask=False,
                     active_rank_mask=None, *, backend=None, recv_view_cache=None):
    """Collective (over the active ranks): :meth:`MoeAlltoAll.dispatch` in the context of
    ``metainfo``. -> ``(recv, combine_payload_offset, eplb_gathered_stats)``: the
    ``[ep_size, runtime_max_tokens_per_rank, ...]`` views, one per payload; the byte offset in
    row ``ep_rank`` of ``workspace`` where the caller may write the combine payload (0: epx keeps
    nothing there); ``[ep_size, n]`` int32 (row r = rank r's ``eplb_local_stats`` of ``n <=
    eplb_stats_num_experts`` entries) or None. ``top_k`` / ``num_experts`` may change between
    calls (the first dispatch of each geometry creates its epx workspace, collectively).
    ``enable_pdl`` is accepted (epx's PDL is EPX_PDL). ``recv_view_cache`` (FlashInfer's opaque
    cache of the receive views: a dict or None) is accepted and left as it is: epx returns its
    own views, made per call."""
    op = "moe_a2a_dispatch"
    check_kernel_backend(op, backend)
    if recv_view_cache is not None and not isinstance(recv_view_cache, dict):
        raise errors.invalid(op, f"argument 'recv_view_cache' is a "
                             f"{type(recv_view_cache).__name__}, expected a dict or None")
    ctx = _context(op, workspace, metainfo, ep_rank, ep_size)
    moe = ctx.moe
    errors.check_int(op, "top_k", top_k, 1)
    errors.check_int(op, "num_experts", num_experts, 1)
    if not isinstance(token_selected_experts, torch.Tensor) or \
            token_selected_experts.dim() != 2 or token_selected_experts.shape[1] != top_k:
        got = (list(token_selected_experts.shape)
               if isinstance(token_selected_experts, torch.Tensor)
               else type(token_selected_experts).__name__)
        raise errors.invalid(op, f"argument 'token_selected_experts' is {got}, expected "
                             f"[local_num_tokens, top_k = {top_k}]")
    active = _functional_mask(op, enable_rank_mask, active_rank_mask, ctx.ep_size,
                              ctx.ep_rank)
    moe._check_live(op)
    if moe._state != "idle" and active == moe._dispatch_mask:
        raise errors.invalid(op, "called twice without moe_a2a_combine in between; expected "
                             "the order dispatch -> combine -> dispatch")
    moe._set_geometry(op, top_k, num_experts)
    recv = moe._dispatch(op, active, token_selected_experts, input_payloads,
                         runtime_max_tokens_per_rank, eplb_local_stats=eplb_local_stats)
    return recv, _COMBINE_PAYLOAD_OFFSET, moe.eplb_gathered_stats


@_torch.plain_torch
def moe_a2a_combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank,
                    ep_rank, ep_size, top_k, combine_payload_offset, payload_in_workspace=False,
                    output_dtype=None, output_scales=None, output_scalar_scale=1.0,
                    sf_layout=None, output=None, *, use_low_precision=False, enable_pdl=None,
                    enable_rank_mask=False, active_rank_mask=None, backend=None):
    """Collective (over the active ranks): :meth:`MoeAlltoAll.combine` in the context of
    ``metainfo``, after its dispatch (``local_num_tokens``, ``top_k`` and
    ``combine_payload_offset`` as that dispatch had and returned them). With
    ``payload_in_workspace=True`` the payload is the view
    ``moe_a2a_wrap_payload_tensor_in_workspace(workspace[ep_rank], [ep_size, M],
    combine_payload_offset, ...)`` (checked, as FlashInfer does); epx reads it from there (one
    copy into its own workspace). ``enable_pdl`` is accepted (epx's PDL is EPX_PDL)."""
    op = "moe_a2a_combine"
    check_kernel_backend(op, backend)
    ctx = _context(op, workspace, metainfo, ep_rank, ep_size)
    moe = ctx.moe
    active = _functional_mask(op, enable_rank_mask, active_rank_mask, ctx.ep_size,
                              ctx.ep_rank)
    moe._check_live(op)
    if moe._state != "dispatched":
        raise errors.invalid(op, "called without a preceding moe_a2a_dispatch on this "
                             "workspace; expected the order dispatch -> combine -> dispatch")
    for name, value, want in (("local_num_tokens", local_num_tokens, moe._num_tokens),
                              ("top_k", top_k, moe.top_k),
                              ("combine_payload_offset", combine_payload_offset,
                               _COMBINE_PAYLOAD_OFFSET)):
        if value != want:
            raise errors.invalid(op, f"argument '{name}' is {value!r}, expected {want} (the "
                                 "preceding moe_a2a_dispatch's)")
    if payload_in_workspace:
        start = ctx.ptr + ctx.ep_rank * ctx.row_stride + _COMBINE_PAYLOAD_OFFSET
        fits = isinstance(payload, torch.Tensor) and payload.device == ctx.device and \
            payload.data_ptr() == start and payload.is_contiguous() and \
            payload.numel() * payload.element_size() <= ctx.shape[1] - _COMBINE_PAYLOAD_OFFSET
        if not fits:
            raise errors.invalid(op, "payload_in_workspace=True but argument 'payload' is not "
                                 "the contiguous view of row ep_rank of 'workspace' at "
                                 "combine_payload_offset (moe_a2a_wrap_payload_tensor_in_"
                                 "workspace)")
    return moe._combine(op, lambda: active, payload, runtime_max_tokens_per_rank, False,
                        output_dtype, output_scales, output, use_low_precision)


@_torch.plain_torch
def moe_a2a_sanitize_expert_ids(expert_ids, workspace, metainfo, ep_rank, invalid_expert_id,
                                enable_pdl=None, *, backend=None):
    """In place: every row ``[s, j]`` of ``expert_ids`` (int32 ``[ep_size, M, top_k]``, the
    expert-id view a moe_a2a_dispatch returned) with ``j >= recv_counts[s]`` of that dispatch,
    i.e. every padding row, gets ``invalid_expert_id`` in all its entries; rows of tokens are
    kept. Local, stream-ordered torch ops (capturable). ``enable_pdl`` is accepted."""
    op = "moe_a2a_sanitize_expert_ids"
    check_kernel_backend(op, backend)
    ctx = _context(op, workspace, metainfo, ep_rank)
    ctx.moe._check_live(op)  # not between checkpoint_prepare and checkpoint_restore
    if isinstance(invalid_expert_id, bool) or not isinstance(invalid_expert_id, int) or \
            not -(1 << 31) <= invalid_expert_id < 1 << 31:
        raise errors.invalid(op, f"argument 'invalid_expert_id' is {invalid_expert_id!r}, "
                             "expected an int32 value")
    ids = expert_ids
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or ids.dim() != 3 or \
            ids.shape[0] != ctx.ep_size:
        got = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, torch.Tensor) else \
            type(ids).__name__
        raise errors.invalid(op, f"argument 'expert_ids' is {got}, expected int32 [ep_size = "
                             f"{ctx.ep_size}, runtime_max_tokens_per_rank, top_k]")
    counts = ctx.moe.recv_counts
    if counts is None:
        raise errors.invalid(op, "called before any moe_a2a_dispatch on this workspace, "
                             "expected after one (it reads that dispatch's receive counts)")
    counts = counts.to(ids.device, torch.int64)
    padding = torch.arange(ids.shape[1], device=ids.device)[None, :] >= counts[:, None]
    ids.masked_fill_(padding[:, :, None], invalid_expert_id)


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
    # rows that are views of one (stride 0, MoeAlltoAll.get_workspace's): row 0 is every row
    row, start = divmod(slice_start, row_stride) if ws.shape[0] > 1 and row_stride else \
        (0, slice_start)
    end = start + (slice_end - slice_start)
    if row >= ws.shape[0] or end > row_bytes:
        raise errors.invalid(op, f"bytes [{slice_start}, {slice_end}) leave workspace row "
                             f"{row} (rows of {row_bytes} bytes, stride {row_stride}), expected a "
                             "range inside one row")
    return ws[row, start:end].view(dtype).view(*leading_shape, -1)
