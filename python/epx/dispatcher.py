"""epx.Dispatcher: the layer an engine's MoE layer calls (docs/semantics.md §7), a thin mirror of
epx::Dispatcher.

    d = epx.Dispatcher(group, num_experts=E, hidden=H, top_k=K, max_tokens_per_rank=T_max,
                       backend="deepep", mode="auto", quant="fp8")
    out = d.dispatch(x, topk_idx, topk_weights, forward_mode="decode")   # DispatchOutput
    ... experts on out (out.format says which fields are set) ...
    y = d.combine(expert_out)                                             # [T, H] bf16

Data flow: every call goes straight to the C++ Dispatcher (mode resolution, quantisation, the
stage machine, hooks, expert-load recording all live there); outputs are torch tensors that
PyTorch's allocator made, or views of the communication workspace that keep the Dispatcher alive
(a2a receive rows, ``moe_output_view``). Every call is collective over the group.

Streams: every call runs on torch.cuda.current_stream() of the device of its tensors (the
dispatch's device for calls without one), as torch ops do, and outputs come from torch's
allocator on that stream; nothing synchronises the device (host waits: ht exact mode, an ht -> ll
switch under 'auto', expert_load()). Registered hooks run with the dispatch's stream current.
CUDA graphs: ll (mode 'low_latency', or decode batches under 'auto'), 'a2a' and ht with
num_worst_tokens > 0 can be captured (torch.cuda.graph) on a side stream and replayed; ht exact
mode raises Unsupported under capture (use num_worst_tokens or ll). On CPU tensors the stream is
ignored.
"""

import weakref
from collections import namedtuple

import torch
import torch.distributed as dist

from . import _epx, _torch, errors
from .buffer import _overlap_arg
from .group import Group

_FIELDS = ("format x x_scale topk_idx topk_weights num_recv_tokens_per_expert masked_m "
           "expected_m moe_output_view")


class DispatchOutput(namedtuple("DispatchOutput", _FIELDS)):
    """What the experts receive. ``format`` is 'ht', 'll' or 'a2a'; fields a format does not
    have are None.

    ht:  x [N, H] (bf16, or fp8 with x_scale f32 [N, H/128] contiguous / UE8M0 int32
         [N, ceil(H/512)] MN-major and TMA-aligned as DeepGEMM's grouped GEMMs read it:
         stride() == (1, M), M = (N + 3) // 4 * 4, word (m, w) at offset m + w * M, padding
         words 0), topk_idx [N, K] local expert ids or -1, topk_weights [N, K] f32,
         num_recv_tokens_per_expert (list of L ints).
    ll:  x [L, R*T_max, H] (bf16 or fp8 + x_scale [L, R*T_max, H/128]; NVFP4: the u8 view
         (R*T_max, H/2, L) + the e4m3 x_scale view (32, 4, ceil(R*T_max/128), 4, H/64, L),
         interleaved: docs/semantics.md §2.2.1), masked_m [L] int32 (rows valid per local
         expert), expected_m, topk_idx / topk_weights: the caller's own routing.
    a2a: x [R, M, H] (fp8 [R, M, H] + scales, or NVFP4 u8 [R, M, H/2] + e4m3 scales
         [R, M, H/16]), topk_idx [R, M, K] int32 global ids (padding rows -1), topk_weights
         [R, M, K], moe_output_view [R, M, H] bf16 to write the weighted expert sums into.
    """

    __slots__ = ()

    @property
    def topk(self):
        """(topk_idx, topk_weights), the a2a name of the pair."""
        return self.topk_idx, self.topk_weights


_FORWARD_MODES = {"extend": "extend", "prefill": "extend", "decode": "decode"}


def _as_group(group, device):
    if isinstance(group, Group):
        return group
    if isinstance(group, _epx.Group):
        return Group(group)
    if group is None or isinstance(group, dist.ProcessGroup):
        return Group.from_process_group(group, device=device)
    raise errors.invalid("Dispatcher", f"argument 'group' is a {type(group).__name__}, expected "
                         "an epx.Group or a torch ProcessGroup")


def _current_stream(device):
    """The current stream of a cuda device as an int cudaStream_t; None for cpu (ignored)."""
    return None if device is None else _torch.current_stream(device)


def _run_hooks(ref):
    def run():
        owner = ref()
        if owner is not None:
            for hook in list(owner._hooks):
                hook()
    return run


class Dispatcher:
    """One per MoE layer group. Collective to create.

    group: epx.Group, or a torch ProcessGroup (gloo -> cpu backend, NCCL -> cuda; ``device``
      picks as in epx.Group.from_process_group).
    num_experts E (a multiple of the group size), hidden H (a multiple of 128), top_k K,
    max_tokens_per_rank: the largest T of any call (ll T_max, a2a rows per source).
    backend: 'deepep' (ht + ll) or 'a2a'. mode: 'normal' (ht), 'low_latency' (ll) or 'auto'
      (extend batches ht, decode batches ll). quant: 'bf16', 'fp8' (e4m3 per token per 128
      channels, f32 scales), 'fp8_ue8m0' (power-of-two scales packed as UE8M0, column-major,
      TMA-aligned) or 'nvfp4' (e2m1 values, e4m3 scales per 16, a global scale; backend 'a2a',
      or 'deepep' with mode 'low_latency': ll's NVFP4 dispatch).
    num_worst_tokens: ht worst-case rows (0: exact, one host sync per dispatch).
    return_recv_hook: ll dispatch_a only sends; dispatch_b (after the hooks) receives.
    ht_zero_copy: ht x (and fp8 x_scale) are views of the buffer, valid until the next dispatch_a
      / combine_a; experts may write y into moe_output_view (in place over a bf16 x is fine) and
      call combine() without y (epx/dispatcher.h).
    """

    def __init__(self, group, num_experts, hidden, top_k, max_tokens_per_rank, backend="deepep",
                 mode="auto", quant="bf16", num_worst_tokens=0, return_recv_hook=True,
                 device=None, ht_zero_copy=False):
        self.group = _as_group(group, device)
        self._native = _epx.Dispatcher(self.group._native, int(num_experts), int(hidden),
                                       int(top_k), int(max_tokens_per_rank), str(backend),
                                       str(mode), str(quant), int(num_worst_tokens),
                                       bool(return_recv_hook), ht_zero_copy=bool(ht_zero_copy))
        self._hooks = []
        self._device = None  # the cuda device of the call in flight (None: cpu)

    num_experts = property(lambda self: self._native.num_experts)
    num_local_experts = property(lambda self: self._native.num_local_experts)
    hidden = property(lambda self: self._native.hidden)
    top_k = property(lambda self: self._native.top_k)
    max_tokens_per_rank = property(lambda self: self._native.max_tokens_per_rank)
    backend = property(lambda self: self._native.backend)
    mode = property(lambda self: self._native.mode)
    quant = property(lambda self: self._native.quant)
    num_worst_tokens = property(lambda self: self._native.num_worst_tokens)
    return_recv_hook = property(lambda self: self._native.return_recv_hook)
    ht_zero_copy = property(lambda self: self._native.ht_zero_copy)
    #: The stage of the stage machine: 'initial', 'after_dispatch_a', 'after_dispatch_b',
    #: 'after_combine_a'.
    stage = property(lambda self: self._native.stage)
    #: The format the last dispatch_a resolved to ('ht', 'll' or 'a2a').
    last_format = property(lambda self: self._native.last_format)

    # ---- the two-stage calls -----------------------------------------------------------------
    def dispatch_a(self, x, topk_idx, topk_weights, forward_mode="extend", global_scale=None):
        """Collective. x [T, H] bf16, topk_idx [T, K] int64/int32 (-1 = none), topk_weights
        [T, K] f32. forward_mode 'extend' (or 'prefill') / 'decode' picks the mode under 'auto'.
        global_scale (float): required with quant 'nvfp4' (dequant = e2m1 * scale / global).
        Registered hooks run before this returns."""
        mode = _FORWARD_MODES.get(forward_mode)
        if mode is None:
            raise errors.invalid("Dispatcher.dispatch_a", f"argument 'forward_mode' is "
                                 f"{forward_mode!r}, expected 'extend', 'prefill' or 'decode'")
        gs = None if global_scale is None else float(global_scale)
        device = x.device if getattr(x, "is_cuda", False) else None
        self._native.dispatch_a(x, topk_idx, topk_weights, mode, gs,
                                _current_stream(device) or 0)
        self._device = device

    @_torch.plain_torch
    def dispatch_b(self):
        """Collective. Finishes the dispatch -> DispatchOutput, on the current stream (ordered
        after dispatch_a's when it differs)."""
        return DispatchOutput(*self._native.dispatch_b(_current_stream(self._device)))

    @_torch.plain_torch
    def combine_a(self, y=None, y_in_output_view=None, overlap=None):
        """Collective. Starts the combine of the expert outputs ``y``: ht [N, H] bf16 weighted by
        the caller; ll [L, R*T_max, H] bf16 (combine applies the weights); a2a [R, M, H] bf16
        weighted sums, or None when the experts wrote into ``moe_output_view``.

        overlap (ll only): an epx.LlCombineOverlap; call combine_a on another stream after the
        expert GEMM that writes ``y`` and raises the signals was enqueued: each block is sent as
        soon as its signal is reached (docs/semantics.md §2.7)."""
        if y_in_output_view is None:
            y_in_output_view = y is None
        kw = {} if overlap is None else {
            "overlap": _overlap_arg("Dispatcher.combine_a", overlap)}
        self._native.combine_a(y, bool(y_in_output_view), _current_stream(self._device), **kw)

    @_torch.plain_torch
    def combine_b(self):
        """Collective. Finishes the combine -> out [T, H] bf16, on the current stream (ordered
        after combine_a's when it differs)."""
        return self._native.combine_b(_current_stream(self._device))

    def dispatch(self, x, topk_idx, topk_weights, forward_mode="extend", global_scale=None):
        """dispatch_a + dispatch_b."""
        self.dispatch_a(x, topk_idx, topk_weights, forward_mode, global_scale)
        return self.dispatch_b()

    @_torch.plain_torch
    def combine(self, y=None, y_in_output_view=None):
        """combine_a + combine_b."""
        self.combine_a(y, y_in_output_view)
        return self.combine_b()

    # ---- hooks and expert load ---------------------------------------------------------------
    def register_hook(self, hook):
        """Runs ``hook()`` (any Python callable), in registration order, between dispatch_a and
        dispatch_b (the C++ Dispatcher calls them, taking the GIL). A hook that raises makes
        dispatch_a raise; the call stays started (call dispatch_b next). The C++ side holds only
        a weak reference to this object, so hooks that refer to it do not keep it alive."""
        if not callable(hook):
            raise errors.invalid("Dispatcher.register_hook",
                                 f"argument 'hook' is a {type(hook).__name__}, expected a "
                                 "callable")
        self._hooks.append(hook)
        if len(self._hooks) == 1:
            self._native.register_hook(_run_hooks(weakref.ref(self)))

    def clear_hooks(self):
        self._native.clear_hooks()
        self._hooks.clear()

    def expert_load(self):
        """Local. int64 [L]: per local expert, the received tokens that selected it (a token
        selecting it twice counts once), accumulated since the last reset_expert_load(). On CUDA
        it waits on the host for the stream of the last call (where the counts were recorded)."""
        return torch.tensor(self._native.expert_load(), dtype=torch.int64)

    def reset(self):
        """Collective. Back in step after a Timeout (docs/semantics.md §4.3): resets the buffer
        (backend deep_ep) or makes every rank active again (backend a2a, on the current stream);
        the stage returns to initial and the call in flight is dropped."""
        self._native.reset(_current_stream(self._device))

    def reset_expert_load(self):
        """Zeroes the counts; on CUDA queued on the current stream (before later dispatches on
        it)."""
        self._native.reset_expert_load(_current_stream(self._device))

    def __repr__(self):
        return (f"epx.Dispatcher(E={self.num_experts}, H={self.hidden}, K={self.top_k}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, backend={self.backend!r}, "
                f"mode={self.mode!r}, quant={self.quant!r}, stage={self.stage!r})")
