"""epx.Buffer (ht and ll modes) and epx.A2a: the C++ classes, taking torch tensors.

Data flow: tensors go to C++ as views (pointer, dtype, shape, strides, device) on the current
stream of their device; outputs are torch tensors that PyTorch's allocator made (the caching
allocator on GPU). Views into the communication workspace (a2a receive views, the ll zero-copy
combine buffer) keep their Buffer/A2a alive. Semantics: docs/semantics.md.
"""

from collections import namedtuple

import torch

from . import _epx, _torch, errors
from .group import Group

HtLayout = namedtuple("HtLayout", "num_tokens_per_rank num_tokens_per_expert is_token_in_rank")
HtDispatchResult = namedtuple(
    "HtDispatchResult", "recv_x recv_x_scales recv_topk_idx recv_topk_weights recv_src_idx "
    "num_recv_tokens_per_expert handle")
HtCombineResult = namedtuple("HtCombineResult", "out combined_topk_weights")
LlDispatchResult = namedtuple("LlDispatchResult", "recv_x recv_scales recv_count handle hook")
LlCombineResult = namedtuple("LlCombineResult", "out hook")
A2aDispatchResult = namedtuple("A2aDispatchResult", "recv recv_counts")
#: The overlapped ll combine's signals and options (include/epx/ll.h LlCombineOverlap,
#: docs/semantics.md §2.7): `signals` an int32 (or uint32) tensor on the buffer's device the
#: expert GEMM raises; `block_rows` rows per signal (0: one signal per local expert);
#: `expected` the value a signal must reach (wrap-safe); `num_sms` the send's SMs (0: auto, 3
#: with blocks, 32 per expert); `recv_count` optional, the dispatch's recv_count, checked.
LlCombineOverlap = namedtuple("LlCombineOverlap", "signals block_rows expected num_sms recv_count",
                              defaults=(0, 1, 0, None))

#: torch.uint32 where this torch has it (signals of the forks' Blackwell form are uint32).
_UINT32 = getattr(torch, "uint32", None)


def _overlap_arg(op, overlap):
    """None, or `overlap` (an LlCombineOverlap) as the tuple the extension takes, uint32
    signals as their int32 view (the comparison is wrap-safe: only the bits count)."""
    if overlap is None:
        return None
    if not isinstance(overlap, LlCombineOverlap):
        raise errors.invalid(op, f"argument 'overlap' is a {type(overlap).__name__}, expected "
                             "epx.LlCombineOverlap(signals, block_rows, expected, num_sms, "
                             "recv_count)")
    signals = overlap.signals
    if _UINT32 is not None and isinstance(signals, torch.Tensor) and signals.dtype == _UINT32:
        signals = signals.view(torch.int32)
    values = []
    for name in ("block_rows", "expected", "num_sms"):
        v = getattr(overlap, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise errors.invalid(op, f"argument 'overlap.{name}' is a {type(v).__name__}, "
                                 "expected an int")
        values.append(v)
    return (signals, *values, overlap.recv_count)

HtHandle = _epx.HtHandle
LlHandle = _epx.LlHandle


def _native_group(group):
    if isinstance(group, Group):
        return group._native
    if isinstance(group, _epx.Group):
        return group
    raise errors.invalid("Buffer", f"argument 'group' is a {type(group).__name__}, expected "
                         "epx.Group (see epx.Group.from_process_group)")


_tuple_new = tuple.__new__  # a namedtuple from the extension's tuple, without its __new__ frame

#: x dtypes ll refuses (it quantises bf16 x itself): fp8 and uint8.
_LL_NOT_X = frozenset((_torch.FP8_DTYPE, torch.uint8))


def _check_ll_x(op, x):
    """ll takes bf16 x and quantises it itself (use_fp8): an fp8 (or uint8) x is a mistake."""
    if isinstance(x, torch.Tensor) and x.dtype in _LL_NOT_X:
        raise errors.invalid(op, f"argument 'x' has dtype {x.dtype}, expected bfloat16: ll "
                             "dispatch quantises bf16 x to fp8 itself (use_fp8=True) and takes "
                             "no scales")


def _stream(t):
    return 0 if t is None else _torch.stream_of(t)


class Buffer:
    """Communication buffer for ht and ll, sized from the MoE shape. Collective to create.

    `max_tokens_per_rank`: ht, the largest T of any call; ll, T_max (equal on every rank).
    `enable_shrink` (with enable_ll): the ll rank masks (ll_update_mask, ll_query_mask,
    ll_clean_mask; docs/semantics.md §2.7): an ll wait for a peer that times out masks it and
    completes without it instead of raising TimeoutError.
    """

    def __init__(self, group, hidden, top_k, num_experts, max_tokens_per_rank, enable_ht=True,
                 enable_ll=False, enable_shrink=False):
        self.group = group if isinstance(group, Group) else Group(_native_group(group))
        self._native = _epx.Buffer(_native_group(group), int(hidden), int(top_k),
                                   int(num_experts), int(max_tokens_per_rank), bool(enable_ht),
                                   bool(enable_ll), bool(enable_shrink))

    @staticmethod
    def bytes_needed(mode, hidden, top_k, num_experts, max_tokens_per_rank, num_ranks,
                     backend="cpu", ranks_per_node=0):
        """Symmetric bytes per rank `mode` ('ht' or 'll') takes on `backend`, in nodes of
        `ranks_per_node` ranks (0: one node; see Group.from_process_group)."""
        return _epx.Buffer.bytes_needed(mode, hidden, top_k, num_experts, max_tokens_per_rank,
                                        num_ranks, backend, int(ranks_per_node))

    hidden = property(lambda self: self._native.hidden)
    top_k = property(lambda self: self._native.top_k)
    num_experts = property(lambda self: self._native.num_experts)
    max_tokens_per_rank = property(lambda self: self._native.max_tokens_per_rank)
    bytes_allocated = property(lambda self: self._native.bytes_allocated)
    id = property(lambda self: self._native.id)

    def check(self):
        """Raises a pending asynchronous error recorded by an earlier op."""
        self._native.check()

    # ---- ht ----------------------------------------------------------------------------------
    @_torch.plain_torch
    def ht_layout(self, topk_idx):
        """Local. -> HtLayout(num_tokens_per_rank[R] i32, num_tokens_per_expert[E] i32,
        is_token_in_rank[T, R] bool)."""
        return HtLayout(*self._native.ht_layout(topk_idx, _stream(topk_idx)))

    @_torch.plain_torch
    def ht_dispatch(self, x, topk_idx=None, topk_weights=None, x_scales=None, expert_alignment=1,
                    num_worst_tokens=0, handle=None, zero_copy=False):
        """Collective. x [T, H] bf16, or fp8 with x_scales [T, H/128] f32 / [T, H/512] i32.
        With `handle` (cached mode) only recv_x (and recv_x_scales) are returned.
        zero_copy: recv_x is a view of the buffer's memory, valid until this rank's next
        ht_dispatch / ht_combine on the buffer starts on the stream (epx/ht.h); not accepted as
        combine's y. The cpu backend returns an ordinary tensor."""
        if x_scales is None:
            err = _torch.fp8_without_scales("ht_dispatch", x, "argument 'x_scales'")
            if err is not None:
                raise err
        r = self._native.ht_dispatch(x, x_scales, x_scales is not None and _torch.is_fp8(x),
                                     topk_idx, topk_weights, int(expert_alignment),
                                     int(num_worst_tokens), handle, _stream(x),
                                     zero_copy=bool(zero_copy))
        return HtDispatchResult(*r)

    @_torch.plain_torch
    def ht_combine(self, y, handle, topk_weights=None, bias0=None, bias1=None, zero_copy=False):
        """Collective. y [rows, H] bf16 in recv_x order -> HtCombineResult(out[T, H], weights).
        zero_copy: y is the view ht_combine_buffer(handle) returned, already written."""
        return HtCombineResult(*self._native.ht_combine(y, handle, topk_weights, bias0, bias1,
                                                        _stream(y), zero_copy=bool(zero_copy)))

    @_torch.plain_torch
    def ht_combine_buffer(self, handle):
        """Local. The bf16 [rows, H] view to write expert outputs into before
        ht_combine(..., zero_copy=True); buffer memory shared with a zero-copy recv_x (epx/buffer.h)."""
        return self._native.ht_combine_buffer(handle)

    # ---- ll ----------------------------------------------------------------------------------
    @_torch.plain_torch
    def ll_dispatch(self, x, topk_idx, use_fp8=True, round_scale=False, use_ue8m0=False,
                    return_recv_hook=False, cumulative_local_expert_recv_stats=None,
                    dispatch_wait_recv_cost_stats=None, use_nvfp4=False, x_global_scale=None):
        """Collective. -> LlDispatchResult(recv_x[L, R*T_max, H], recv_scales, recv_count[L],
        handle, hook). With return_recv_hook the outputs are valid once hook() returned.

        dispatch_wait_recv_cost_stats: optional int64 [R] tensor on the buffer's device; element s
        is added the nanoseconds this rank's receive waited for rank s's tokens (in the hook with
        return_recv_hook; docs/semantics.md §2.5).

        use_nvfp4 (with use_fp8=False): e2m1 values with an e4m3 scale per 16 values from the
        global scale ``x_global_scale`` — a float32 tensor on the buffer's device whose element 0
        is read in stream order (capturable), or a Python float. recv_x is then the uint8 view
        (R*T_max, H/2, L) of storage [L, R*T_max, H/2] and recv_scales the e4m3 view
        (32, 4, ceil(R*T_max/128), 4, H/64, L), per expert in nvfp4_block_scale_interleave's
        layout (docs/semantics.md §2.2; DeepEP's NVFP4 forks return the same)."""
        _check_ll_x("ll_dispatch", x)
        tensor_scale = x_global_scale if isinstance(x_global_scale, torch.Tensor) else None
        host_scale = None
        if x_global_scale is not None and tensor_scale is None:
            if not isinstance(x_global_scale, (int, float)) or isinstance(x_global_scale, bool):
                raise errors.invalid("ll_dispatch", "argument 'x_global_scale' is a "
                                     f"{type(x_global_scale).__name__}, expected a float32 "
                                     "torch.Tensor or a float")
            host_scale = float(x_global_scale)
        return _tuple_new(LlDispatchResult, self._native.ll_dispatch(
            x, topk_idx, bool(use_fp8), bool(round_scale), bool(use_ue8m0),
            bool(return_recv_hook), cumulative_local_expert_recv_stats, _torch.stream_of(x),
            dispatch_wait_recv_cost_stats, use_nvfp4=bool(use_nvfp4),
            x_global_scale=tensor_scale, global_scale=host_scale))

    @_torch.plain_torch
    def ll_combine(self, y, topk_idx, topk_weights, handle, zero_copy=False,
                   return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                   use_logfmt=False, overlap=None):
        """Collective. -> LlCombineResult(out[T, H] bf16, hook).

        combine_wait_recv_cost_stats: optional int64 [R] tensor on the buffer's device; element s
        is added the nanoseconds this rank's receive waited for rank s's expert outputs (in the
        hook with return_recv_hook; docs/semantics.md §2.5).
        use_logfmt: the expert rows cross as LogFMT-10 and are summed as decoded
        (docs/semantics.md §2.3.1); the same on every rank.
        overlap: an epx.LlCombineOverlap: the combine, called on another stream after the
        expert GEMM was enqueued, sends each block of y as soon as the GEMM raised its signal
        (docs/semantics.md §2.7); the result is the plain combine's, bit for bit."""
        kw = {} if overlap is None else {"overlap": _overlap_arg("ll_combine", overlap)}
        return _tuple_new(LlCombineResult, self._native.ll_combine(
            y, topk_idx, topk_weights, handle, bool(zero_copy), bool(return_recv_hook), out,
            _torch.stream_of(topk_weights), combine_wait_recv_cost_stats, bool(use_logfmt), **kw))

    @_torch.plain_torch
    def ll_next_combine_buffer(self, handle):
        """Local. The bf16 [L, R*T_max, H] view to write expert outputs into for zero_copy."""
        return self._native.ll_next_combine_buffer(handle)

    def ll_clean(self):
        """Collective. Resets ll state; after a Timeout in ll, ll calls raise OutOfStep until
        every rank called this (or reset()). With enable_shrink: over the ranks this rank does not
        mask; one that does not arrive within twice the group's timeout is masked."""
        self._native.ll_clean()

    # ---- ll rank masks (enable_shrink; docs/semantics.md §2.7) ------------------------------
    def ll_update_mask(self, rank, mask):
        """Local. Masks (mask=True) or unmasks rank `rank` for this rank's ll calls: they neither
        send to nor wait for a masked rank; its tokens are absent from the dispatch, its experts'
        terms from the combine. An unmasked rank takes part again after every rank that takes
        part called ll_clean(). Stream-ordered on the current stream (cuda)."""
        self._native.ll_update_mask(int(rank), bool(mask), self._current_stream())

    def ll_query_mask(self, mask_status):
        """Local. Writes into `mask_status` (int32 [R] on the buffer's device) 1 for every rank
        this rank masks (set by ll_update_mask, or by a wait that timed out), else 0.
        Stream-ordered on the current stream (cuda)."""
        self._native.ll_query_mask(mask_status, self._current_stream())

    def ll_clean_mask(self):
        """Local. Unmasks every rank (see ll_update_mask for taking part again)."""
        self._native.ll_clean_mask(self._current_stream())

    def _current_stream(self):
        # The cpu backend ignores streams (0); on cuda the current stream of the buffer's device.
        device = torch.device(self._native.device)
        return _torch.current_stream(device) if device.type == "cuda" else 0

    def reset(self):
        """Collective. After a Timeout, calls of that mode raise OutOfStep until every rank called
        this: it waits (up to twice the group's timeout) for every rank to leave its earlier
        calls, then resets ht and ll (docs/semantics.md §4.3)."""
        self._native.reset()


class A2a:
    """Fixed-geometry multi-payload all-to-all (docs/semantics.md §3). Collective to create.

    `payload_bytes_per_token`: bytes of one row of each dispatch payload (up to 8);
    `combine_bytes_per_token`: bytes of one row of the combine payload (H * element size).
    """

    def __init__(self, group, max_tokens_per_rank, top_k, num_experts, payload_bytes_per_token,
                 combine_bytes_per_token):
        self.group = group if isinstance(group, Group) else Group(_native_group(group))
        self._native = _epx.A2a(_native_group(group), int(max_tokens_per_rank), int(top_k),
                                int(num_experts), [int(b) for b in payload_bytes_per_token],
                                int(combine_bytes_per_token))
        self._on_cuda = self.group.backend == "cuda"

    @staticmethod
    def workspace_bytes(max_tokens_per_rank, top_k, num_experts, payload_bytes_per_token,
                        combine_bytes_per_token, num_ranks, backend="cpu"):
        return _epx.A2a.workspace_bytes(max_tokens_per_rank, top_k, num_experts,
                                        list(payload_bytes_per_token), combine_bytes_per_token,
                                        num_ranks, backend)

    bytes_allocated = property(lambda self: self._native.bytes_allocated)
    max_tokens_per_rank = property(lambda self: self._native.max_tokens_per_rank)
    payload_bytes_per_token = property(lambda self: self._native.payload_bytes_per_token)
    combine_bytes_per_token = property(lambda self: self._native.combine_bytes_per_token)

    def check(self):
        self._native.check()

    def set_active_ranks(self, active, stream=None):
        """Collective over the ranks marked active (fault tolerance; include/epx/a2a.h).

        `active`: one bool per rank, this rank True. Inactive ranks are skipped: selections of
        their experts are dropped (counted), recv_counts is 0 for them, combine sums active
        ranks only. After a TimeoutError caused by a dead peer, every survivor calls this
        without it to continue. Masks only shrink. cuda: stream-ordered on `stream` (default:
        the current torch stream)."""
        active = [bool(a) for a in active]
        self._native.set_active_ranks(active, self._current_stream() if stream is None
                                      else int(stream))

    def active_ranks(self):
        """Local. The current mask, one bool per rank."""
        return list(self._native.active_ranks())

    def dropped_counts(self):
        """Local. -> (tokens, selections) the mask dropped from this rank's dispatches since
        construction or reset_dropped_counts(). cuda: synchronises the device."""
        return tuple(self._native.dropped_counts())

    def reset_dropped_counts(self):
        """Local. Zeroes both counters (cuda: stream-ordered on the current stream)."""
        self._native.reset_dropped_counts(self._current_stream())

    def _current_stream(self):
        # The cpu backend ignores streams (0); on cuda the current stream of the group's device
        # (not the current device's: a process driving several GPUs may have another current).
        return _torch.current_stream(torch.device(self._native.device)) if self._on_cuda else 0

    @_torch.plain_torch
    def dispatch(self, topk_idx, payloads, runtime_max_tokens_per_rank, invalid_expert_id=None,
                 expert_id_payload_index=None):
        """Collective. -> A2aDispatchResult(recv: list of [R, M, ...] workspace views,
        recv_counts[R] i32). Views stay valid until the next dispatch."""
        idx = -1 if expert_id_payload_index is None else int(expert_id_payload_index)
        return A2aDispatchResult(*self._native.dispatch(
            topk_idx, list(payloads), int(runtime_max_tokens_per_rank), invalid_expert_id, idx,
            _stream(topk_idx)))

    @_torch.plain_torch
    def combine_payload_view(self, runtime_max_tokens_per_rank, hidden, dtype):
        """Local. The [R, M, hidden] workspace view for combine(payload_in_workspace=True)."""
        code = _torch.CODE_OF.get(dtype)
        if code is None:
            raise errors.invalid("a2a combine_payload_view",
                                 f"argument 'dtype' is {dtype}, expected bfloat16, float16 or "
                                 "float32")
        return self._native.combine_payload_view(int(runtime_max_tokens_per_rank), int(hidden),
                                                 code)

    @_torch.plain_torch
    def combine(self, y, runtime_max_tokens_per_rank, payload_in_workspace=False):
        """Collective. y [R, M, H] bf16, float16 or float32 -> out [T, H] of y's dtype: per token
        the float32 sum of its rows in ascending rank order, rounded once (docs/semantics.md
        §3.3)."""
        return self._native.combine(y, int(runtime_max_tokens_per_rank),
                                    bool(payload_in_workspace), _stream(y))
