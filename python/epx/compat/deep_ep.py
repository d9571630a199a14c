"""Drop-in for DeepEP's legacy (V1) Python API, implemented on epx: ``import epx.compat.deep_ep
as deep_ep``. Names, defaults, return shapes and meanings follow DeepEP's ``deep_ep.Buffer``;
semantics are docs/semantics.md §1 and §2 (normal mode = epx ht, low-latency mode = epx ll).

How it differs, and why:

* Sizing. DeepEP's Buffer takes byte sizes; epx sizes every buffer from the MoE shape. The byte
  counts are accepted (and kept as attributes) but not used. The epx buffers are created lazily,
  collectively, on first use, from the call's shapes:
    - low latency: (num_max_dispatch_tokens_per_rank, hidden, top-k, num_experts) of the call;
      a call with another shape re-creates the ll buffer. Every rank must pass the same values:
      creating the buffer first agrees on them (one small exchange through the epx group), so a
      difference is an InvalidArgument on every rank naming the argument and each rank's value
      (docs/semantics.md §4); the calls on an existing buffer exchange nothing extra, so ranks
      must also switch shapes at the same call.
    - normal mode: (T, H, K, E). H, K and E come from the call; the token capacity is the
      largest T over the ranks, rounded up to a power of two. Both come from one small
      all-gather through the group per non-cached dispatch (skipped while a CUDA graph is being
      captured), which also raises InvalidArgument on every rank naming x.shape[1],
      topk_idx.shape[1] or the number of experts where they differ across ranks. A later call
      needing more re-creates the buffer collectively. Handles keep the buffer that made them
      alive, so an older handle stays usable.
    - The epx group itself is created at the first op from the group given here (tensors on CPU:
      the cpu backend over shared memory; on a GPU: the cuda backend, adopting an NCCL group's
      communicator or bootstrapping one through the group).
* Streams. epx runs on the caller's current stream (no separate communication stream):
  ``previous_event`` is waited on first, ``async_finish`` returns an event recorded after the op,
  ``allocate_on_comm_stream`` is accepted and has nothing to change, ``get_comm_stream()``
  returns the current stream (None on CPU). On CPU every op is synchronous. ``EventHandle``
  (DeepEP's; importable from ``deep_ep.utils`` as Megatron-LM does, from ``deep_ep.buffer``, and
  from ``deep_ep`` as DeepEP 2.x exports it) records an event on the current stream, none where
  CUDA is not in use.
* Nodes. As DeepEP, a group that spans nodes runs normal mode (and low latency) across them: on
  epx's hierarchical path (docs/design.md §13; the cpu backend only for now, the cuda backend
  raises Unsupported at the first op). The node size: ``Buffer(..., ranks_per_node=n)`` (an epx
  keyword after DeepEP's, a divisor of the group size); else the whole group with
  ``allow_mnnvl=True`` (one NVLink domain); else ``LOCAL_WORLD_SIZE`` from the environment
  (torchrun's ranks per host, at most the group size); else DeepEP's NUM_MAX_NVL_PEERS rule,
  min(8, R). Ranks are node-major (rank = node * ranks_per_node + local), as DeepEP's. Kept as
  ``Buffer.ranks_per_node`` / ``Buffer.num_nodes``.
* Handles. The normal-mode handle of one node is DeepEP's intranode 6-tuple
  ``(rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, send_pos)``: handle[0] is
  the [R, R] int32 inclusive prefix over source ranks of the tokens each rank receives (DeepEP's
  meaning); epx has no channels, so the two channel matrices are None. Across nodes it is
  DeepEP's internode 10-tuple ``(is_token_in_rank, None, None, None, recv_rdma_rank_prefix_sum,
  None, recv_gbl_rank_prefix_sum, recv_src_idx, None, None)``: recv_rdma_rank_prefix_sum int32
  [N] is the inclusive prefix over source nodes m of the tokens rank (m, this local index) sends
  to this node (DeepEP's meaning), recv_gbl_rank_prefix_sum int32 [R] the inclusive prefix over
  source ranks of the tokens this rank receives (handle[-4], which DeepEP's test reads), and
  DeepEP's opaque SourceMeta rows are the received rows' source token indices (int32 [N_recv]);
  the channel matrices and DeepEP's ring heads (send_rdma_head, send_nvl_head) have no epx
  counterpart and are None. The low-latency handle is ``(src_info, layout_range,
  num_max_dispatch_tokens_per_rank, hidden, num_experts)`` as in DeepEP.
* Internode arguments: get_dispatch_layout returns num_tokens_per_rdma_rank (int32 [N], this
  rank's tokens that go to each node) across nodes, None on one node, as DeepEP;
  dispatch(num_tokens_per_rdma_rank=) is shape-checked ([N]) and optional (the routing
  decides, as for num_tokens_per_rank); internode_dispatch / internode_combine are dispatch /
  combine of a group that spans nodes (InvalidArgument on one node, where DeepEP's internode
  kernels do not run); Config's rdma chunk sizes are checked as DeepEP checks them and kept;
  num_rdma_bytes is kept (epx sizes the rail's chunks from the shapes).
* fp8 on torch without ``float8_e4m3fn`` (1.13): fp8 tensors are uint8 tensors holding e4m3 bit
  patterns, in both directions.
* Routing of a normal-mode dispatch: by ``topk_idx`` when given (``num_tokens_per_rank`` and
  ``is_token_in_rank`` are then shape-checked only; ``num_tokens_per_expert`` tells E); without
  ``topk_idx``, by ``is_token_in_rank`` alone, as DeepEP: each token goes once to each marked
  rank, received tokens carry no top-k (recv_topk_idx / recv_topk_weights None), the per-expert
  list is the sum over the ranks of ``num_tokens_per_expert`` (one all-reduce over the group).
* SM budget: ``num_sms`` (class attribute, set_num_sms, Config.num_sms; an even number of at
  least 2 at the call, as DeepEP's kernels need) is the SM budget of a normal-mode dispatch,
  handed to its kernels through the epx group (a dispatch whose num_sms differs from the
  previous one's re-creates the normal-mode buffer, collectively). Its combine and a cached
  dispatch through its handle run with that dispatch's budget; a config naming another num_sms
  is refused (InvalidArgument), as DeepEP's check of the handle's channel count refuses it. The
  low-latency kernels ignore it, as DeepEP's do: they take epx's own grid.
* Lifetime: nothing the caller passes is read after the call returns. With
  ``return_recv_hook=True`` the send half copies what the receive needs (the combine's expert
  rows, topk_idx, topk_weights, the layout) into epx's memory, so the caller may drop or
  overwrite them before calling the hook; the hook keeps the tensors it writes
  (``cumulative_local_expert_recv_stats``, the wait-cost stats, ``out``) alive until it ran.
* Wait-cost statistics (``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``,
  int64 ``[num_ranks]`` on the buffer's device, as DeepEP's C++ checks): accumulated per source
  rank in NANOSECONDS (``%globaltimer``), not DeepEP's clock64 cycles; one wait per source per
  call; with ``return_recv_hook`` in the hook. Ratios between ranks are unaffected by the unit
  (docs/semantics.md §2.5).
* Kernels: one CUDA kernel per op, hook or not (profiler rows ``epx::ll::dispatch`` and
  ``epx::ll::combine<N>``, N the combine's form: 0 plain, 1 LogFMT, 2 overlapped; the hook
  launches the receive half of the same kernel), as DeepEP.
* NVFP4 (``low_latency_dispatch(use_nvfp4=True, x_global_scale=g, use_fp8=False)``, DeepEP's
  hybrid-ep / sglang forks): returns ``(recv_x, recv_scales)`` in the forks' layout — uint8
  (R*T_max, H/2, L) and e4m3 (32, 4, ceil(R*T_max/128), 4, H/64, L), the scales already
  interleaved per expert; quantised with epx's formula (docs/semantics.md §2.2), so a rare byte
  may differ from the forks' approximate reciprocals. ``use_fp8=True`` with it is
  InvalidArgument (DeepEP's use_fp8 defaults to True), ``use_ue8m0=True`` Unsupported;
  ``x_global_scale`` without ``use_nvfp4`` is accepted and unused, as in the forks.
* Combine overlapped with the expert GEMM (``low_latency_combine(overlap=True, ...)``, both
  forks' forms, as sglang calls them): ``comp_signal`` (DeepEP antgroup-opt: int32 [L *
  ceil(R*T_max / block_m)], one signal per expert block, reached at ``threshold``; ``num_sms``
  send SMs, ``packed_recv_count`` checked against the handle) or ``src_signals`` (hybrid-ep:
  [L] uint32 or int32, one per expert, reached at ``src_signal_expect_value``; 32 send SMs).
  Exactly one of them with ``overlap=True``; ``overlap=False`` ignores them all, as the forks do.
  The result equals the plain combine's bit for bit (docs/semantics.md §2.7).
* Rank masks (``enable_shrink=True``, ``low_latency_update_mask_buffer`` /
  ``low_latency_query_mask_buffer`` / ``low_latency_clean_mask_buffer``): epx's ll masks
  (docs/semantics.md §2.6), the same meaning: a masked rank is neither sent to nor waited for,
  its tokens and its experts' terms are left out, and a low-latency wait (or
  clean_low_latency_buffer's) that times out masks the rank it waited for instead of failing.
  Differences: the low-latency buffer of a shape is created collectively at its first call, so
  every rank makes that first call (engines do at warm-up; DeepEP's own --shrink-test stops a
  rank before it, which then times out its peers' first call), and a call that needs a new
  buffer while ranks are masked raises Unsupported; a rank cannot mask itself; an unmasked
  rank takes part again after clean_low_latency_buffer on every rank that takes part;
  low_latency_clean_mask_buffer, local in DeepEP, also resets the buffer collectively, so that
  vLLM's fault-tolerance retry (every rank zeroes DeepEP's raw buffer, then cleans the mask)
  brings the masked ranks back.
* ``allow_nvlink_for_low_latency_mode=False`` is accepted with a warning (DeepEP's choice of its
  RDMA NICs within the node; epx's results are the same over NVLink), and
  ``get_local_buffer_tensor`` views a raw buffer of ``num_nvl_bytes`` / ``num_rdma_bytes`` that
  epx's kernels never touch (docs/semantics.md §9).
  ``allow_mnnvl=True`` (kept as ``allow_mnnvl``) permits, and does not require, a multi-node
  NVLink domain, which is then one node (see Nodes); ``use_fabric`` is accepted: NCCL picks the
  handle type (docs/semantics.md §8.1).
  ``comm=`` (an mpi4py communicator, used when ``group`` is None) is honoured through its
  ``allgather``. ``num_qps_per_rank``, ``num_nvl_bytes``, ``num_rdma_bytes``,
  ``allocate_on_comm_stream`` and Config's chunk sizes (checked as DeepEP checks them) are
  accepted and kept, changing nothing.
"""

import os
import warnings
import weakref

import torch
import torch.distributed as dist

from .. import _epx, _torch, errors
from ..buffer import Buffer as _EpxBuffer
from ..buffer import LlCombineOverlap, _overlap_arg
from ..group import Group as _EpxGroup
from ._deep_ep_types import Config, EventHandle, EventOverlap, _align

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

#: dtype of topk_idx in DeepEP.
topk_idx_t = torch.int64

_NO_KW = {}  # no extra keywords (never written)


def _next_pow2(n):
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _backend_name():
    return "cuda" if _epx.built_with_cuda else "cpu"


class _Handle(tuple):
    """A handle is never changed: a copy (copy.copy, copy.deepcopy) is the handle itself."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class _HtHandle(_Handle):
    """DeepEP's normal-mode handle; also carries the epx handle, the buffer that made it and the
    dispatch's SM budget (`num_sms`).
    One node: DeepEP's intranode 6-tuple. Across nodes (`rdma_prefix` given: the
    recv_rdma_rank_prefix_sum of this dispatch): its internode 10-tuple (module docstring)."""

    def __new__(cls, native, buffer, rank, num_sms, rdma_prefix=None):
        if rdma_prefix is None:
            items = (native.rank_prefix_matrix, None, None, native.recv_src_idx,
                     native.is_token_in_rank, native.send_pos)
        else:
            items = (native.is_token_in_rank, None, None, None, rdma_prefix, None,
                     native.rank_prefix_matrix[:, rank].contiguous(), native.recv_src_idx, None,
                     None)
        self = super().__new__(cls, items)
        self._handle = native
        self._buffer = buffer
        self._num_sms = num_sms  # the dispatch's SM budget, which its combine keeps
        return self


class _LlHandle(_Handle):
    """DeepEP's low-latency handle (src_info, layout_range, T_max, hidden, num_experts); also
    carries the epx handle and the buffer that made it. `tail`: (T_max, hidden, num_experts) of
    the buffer when the caller has them (the handle's own, read from it otherwise)."""

    def __new__(cls, native, buffer, tail=None):
        if tail is None:
            tail = (native.max_tokens, native.hidden, native.num_experts)
        self = _tuple_new(cls, (native.src_info, native.layout_range) + tail)
        self._handle = native
        self._buffer = buffer
        return self


# How the normal-mode agreement names H, K and E (DeepEP's arguments they come from).
_LAYOUT_NAMES = {"hidden": "hidden (x.shape[1] of this Buffer's previous dispatch, 128 before "
                           "any)",
                 "top_k": "top-k (topk_idx.shape[1])", "num_experts": "argument 'num_experts'"}
_BY_RANK_NAMES = {"hidden": "hidden (x.shape[1])",
                  "top_k": "the routing width (this Buffer's previous top-k, or the group size)",
                  "num_experts": "the number of experts (num_tokens_per_expert.shape[0])"}


def _dispatch_names(experts_given):
    return {"hidden": "hidden (x.shape[1])", "top_k": "top-k (topk_idx.shape[1])",
            "num_experts": "the number of experts (num_tokens_per_expert.shape[0])"
            if experts_given else "the number of experts (this Buffer's previous one)"}


#: DeepEP's NUM_MAX_NVL_PEERS: the ranks per node it assumes (num_rdma_ranks = R / 8 above 8).
_NUM_MAX_NVL_PEERS = 8


def _node_size(op, group_size, ranks_per_node, allow_mnnvl, environ):
    """Ranks per node of a Buffer's group (module docstring, "Nodes"): `ranks_per_node` when
    given (a divisor of the group size); else the whole group with allow_mnnvl (one NVLink
    domain); else LOCAL_WORLD_SIZE from `environ` (torchrun's ranks on this host; at most the
    group size) when set; else DeepEP's min(8, R). InvalidArgument naming the source when it
    does not divide the group size."""
    R = group_size
    divisors = ", ".join(str(d) for d in range(1, R + 1) if R % d == 0)
    expected = f"expected a divisor of the group size {R} ({divisors})"
    if ranks_per_node is not None:
        n = errors.check_int(op, "ranks_per_node", ranks_per_node, 1)
        if R % n:
            raise errors.invalid(op, f"argument 'ranks_per_node' is {n}, {expected}")
        return n
    if allow_mnnvl:
        return R
    local = environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        try:
            n = min(int(local), R)
        except ValueError:
            n = 0
        if n < 1 or R % n:
            raise errors.invalid(op, f"LOCAL_WORLD_SIZE is {local!r} (the ranks per node), "
                                 f"{expected}; pass Buffer(..., ranks_per_node=) to override")
        return n
    n = min(_NUM_MAX_NVL_PEERS, R)
    if R % n:
        raise errors.invalid(op, f"the group of {R} ranks is not a whole number of nodes of "
                             f"{n} (DeepEP's 8 GPUs per node; LOCAL_WORLD_SIZE is not set), "
                             f"{expected}; pass Buffer(..., ranks_per_node=) or set "
                             "LOCAL_WORLD_SIZE")
    return n


def _ht_state(op, handle):
    if not isinstance(handle, _HtHandle):
        raise errors.invalid(op, f"argument 'handle' is a {type(handle).__name__}, expected the "
                             "handle returned by Buffer.dispatch")
    return handle._handle, handle._buffer


def _ll_state(op, handle):
    if not isinstance(handle, _LlHandle):
        raise errors.invalid(op, f"argument 'handle' is a {type(handle).__name__}, expected the "
                             "handle returned by Buffer.low_latency_dispatch")
    return handle._handle, handle._buffer


_tuple_new = tuple.__new__


def _fork_overlap(op, handle, packed_recv_count, comp_signal, block_m, threshold, num_sms,
                  src_signals, src_signal_expect_value):
    """The epx.LlCombineOverlap of low_latency_combine(overlap=True, ...): the Hopper form
    (comp_signal, antgroup-opt) or the Blackwell form (src_signals, hybrid-ep), exactly one;
    their values checked under the forks' names."""
    if (comp_signal is None) == (src_signals is None):
        raise errors.invalid(op, "overlap=True needs exactly one of 'comp_signal' (one signal per "
                             "block_m rows of each local expert) and 'src_signals' (one per "
                             "local expert); got " + ("both" if comp_signal is not None else
                                                      "neither"))
    _, layout_range, max_tokens, _, num_experts = handle
    num_ranks = layout_range.shape[1]
    experts = num_experts // num_ranks
    if comp_signal is not None:
        for name, v in (("block_m", block_m), ("threshold", threshold), ("num_sms", num_sms)):
            if type(v) is not int or v < 1:
                errors.check_int(op, name, v, 1)
        need = experts * -(-num_ranks * max_tokens // block_m)
        signals, form = comp_signal, f"L * ceil(R * T_max / block_m) = {need}"
        options = (block_m, threshold, num_sms, packed_recv_count)
    else:
        v = src_signal_expect_value
        if type(v) is not int or v < 1:
            errors.check_int(op, "src_signal_expect_value", v, 1)
        need, signals, form = experts, src_signals, f"L = {experts}"
        options = (0, v, 0, None)  # 0 SMs: auto, the forks' 32
    name = "comp_signal" if comp_signal is not None else "src_signals"
    if not isinstance(signals, torch.Tensor) or signals.numel() < need:
        seen = (f"a tensor of {signals.numel()} elements" if isinstance(signals, torch.Tensor)
                else f"a {type(signals).__name__}")
        raise errors.invalid(op, f"argument '{name}' is {seen}, expected a tensor of at least "
                             f"{form} elements")
    return LlCombineOverlap(signals, *options)

#: x dtypes the low-latency dispatch refuses (it quantises bf16 x itself): fp8 and uint8.
_LL_NOT_X = frozenset((_torch.FP8_DTYPE, torch.uint8))


def _config_sms(op, config):
    """The SM budget of a normal-mode call: ``config.num_sms`` (a deep_ep.Config), else the
    class's ``Buffer.num_sms``; an even number of at least 2, as DeepEP's kernels need (two SMs per
    channel), else InvalidArgument."""
    if config is None:
        return Buffer.num_sms
    if not isinstance(config, Config):
        raise errors.invalid(op, f"argument 'config' is a {type(config).__name__}, expected "
                             "deep_ep.Config")
    n = config.num_sms
    if n < 2 or n % 2:
        raise errors.invalid(op, f"argument 'config' has num_sms {n}, expected an even number of "
                             "at least 2 (DeepEP's kernels take two SMs per channel)")
    return n


def _same_sms(op, num_sms, handle):
    """A combine or a cached dispatch runs with the SM budget of the dispatch that made `handle`
    (DeepEP's checks its config's channel count against the handle's): InvalidArgument when its
    config names another."""
    if num_sms != handle._num_sms:
        raise errors.invalid(op, f"argument 'config' has num_sms {num_sms}, expected "
                             f"{handle._num_sms}: the SM budget of the dispatch that made "
                             "'handle' (DeepEP requires the same channel count, num_sms / 2)")


def _tensor(op, name, value, ndim=None):
    if not isinstance(value, torch.Tensor):
        raise errors.invalid(op, f"argument '{name}' is a {type(value).__name__}, expected a "
                             "torch.Tensor")
    if ndim is not None and value.dim() != ndim:
        raise errors.invalid(op, f"argument '{name}' has shape {list(value.shape)}, expected "
                             f"{ndim} dims")
    return value


class _Runtime:
    """``Buffer.runtime``: the queries of DeepEP's C++ runtime object that callers read
    (torchtitan's autotune asks get_num_rdma_ranks), answered from epx's node layout (module
    docstring, "Nodes"): nodes are DeepEP's RDMA ranks, a rank's place in its node its NVL rank.
    DeepEP's runtime internals (IPC handles, NVSHMEM ids, sync, the kernels' entry points) have
    no epx counterpart: Unsupported naming them."""

    def __init__(self, buffer):
        self._buffer = weakref.ref(buffer)

    def _b(self):
        return self._buffer()

    def is_available(self):
        b = self._b()
        return b is not None and not b._destroyed

    def get_num_rdma_ranks(self):
        return self._b().num_nodes

    def get_rdma_rank(self):
        b = self._b()
        return b.rank // b.ranks_per_node

    def get_root_rdma_rank(self, is_global):
        b = self._b()
        return b.rank % b.ranks_per_node if is_global else 0

    def get_local_device_id(self):
        device = self._b().get_comm_stream()
        return device.device.index if device is not None else -1

    def get_comm_stream(self):
        return self._b().get_comm_stream()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        e = errors.unsupported(f"Buffer.runtime.{name}", "DeepEP's C++ runtime internals (IPC "
                               "handles, NVSHMEM ids, sync, its kernels' entry points) have no "
                               "epx counterpart; call the Buffer's methods")
        raise _RuntimeUnsupported(str(e))


class _RuntimeUnsupported(errors.Unsupported, AttributeError):
    """Unsupported that is also an AttributeError, so hasattr(buffer.runtime, name) and
    getattr(buffer.runtime, name, default) answer for DeepEP's runtime internals."""


class Buffer:
    """DeepEP's communication buffer, on epx. Collective to create (as in DeepEP)."""

    #: SMs the normal-mode kernels use (DeepEP's class attribute).
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, enable_shrink=False, comm=None,
                 ranks_per_node=None):
        op = "Buffer"
        if not allow_nvlink_for_low_latency_mode:
            # DeepEP then moves low-latency traffic over its RDMA NICs even within the node
            # (NVSHMEM P2P off): a choice of transport, not of results. epx has no RDMA path on
            # one node; its results are the same over NVLink.
            warnings.warn("epx.compat.deep_ep: allow_nvlink_for_low_latency_mode=False is "
                          "accepted; epx's low-latency kernels still use NVLink within the node "
                          "(same results)", stacklevel=2)
        if group is None and comm is None:
            raise errors.invalid(op, "arguments 'group' and 'comm' are both None, expected a "
                                 "torch ProcessGroup as 'group' or an mpi4py communicator as "
                                 "'comm'")
        if group is None:
            for name in ("Get_rank", "Get_size", "allgather"):
                if not callable(getattr(comm, name, None)):
                    raise errors.invalid(op, f"argument 'comm' is a {type(comm).__name__} "
                                         f"without {name}(), expected an mpi4py communicator")
        errors.check_int(op, "num_nvl_bytes", num_nvl_bytes)
        errors.check_int(op, "num_rdma_bytes", num_rdma_bytes)
        errors.check_int(op, "num_qps_per_rank", num_qps_per_rank)
        # As DeepEP: the group when given, else the communicator (then also kept as 'group').
        self._comm = None if group is not None else comm
        self.group = group if group is not None else comm
        if group is not None:
            self.rank = dist.get_rank(group)
            self.group_size = dist.get_world_size(group)
        else:
            self.rank = int(comm.Get_rank())
            self.group_size = int(comm.Get_size())
        self.allow_mnnvl = bool(allow_mnnvl)
        #: Ranks per node and nodes of the group (epx's; module docstring, "Nodes").
        self.ranks_per_node = _node_size(op, self.group_size, ranks_per_node, self.allow_mnnvl,
                                         os.environ)
        self.num_nodes = self.group_size // self.ranks_per_node
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self._mask_pending = 0  # enable_shrink: the rank mask while no low-latency buffer exists
        self._destroyed = False
        self._groups = {}       # (device, num_sms) -> epx Group (num_sms 0: ll, epx's own grid)
        self._ht = None         # epx Buffer for normal mode
        self._ht_key = None     # (device, num_sms, H, K, E)
        self._ll = None         # epx Buffer for low-latency mode
        self._ll_key = None     # (device, T_max, H, K, E)
        self._ll_tail = None    # (T_max, H, E) of the ll buffer, as its handles carry them
        self._device = None     # 'cpu' / 'cuda:i' of the last op
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self._raw = {}          # use_rdma_buffer -> the raw byte buffer of get_local_buffer_tensor
        #: DeepEP's C++ runtime object: its queries of the group's layout (_Runtime).
        self.runtime = _Runtime(self)

    # ---- class-level API ---------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms):
        """Sets the SM budget of normal-mode kernels (an even number)."""
        errors.check_int("Buffer.set_num_sms", "new_num_sms", new_num_sms, 2)
        if new_num_sms % 2:
            raise errors.invalid("Buffer.set_num_sms",
                                 f"argument 'new_num_sms' is {new_num_sms}, expected even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def is_sm90_compiled():
        """True when epx's cuda kernels are built and run on a Hopper (sm90+) GPU."""
        return bool(_epx.built_with_cuda and torch.cuda.is_available() and
                    torch.cuda.get_device_capability()[0] >= 9)

    @staticmethod
    def get_dispatch_config(num_ranks):
        errors.check_int("Buffer.get_dispatch_config", "num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        errors.check_int("Buffer.get_combine_config", "num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes per rank epx's low-latency buffer takes for this shape (at top-k = min(E, 32),
        the largest the formula allows, since the call does not give it), a multiple of 128."""
        op = "Buffer.get_low_latency_rdma_size_hint"
        errors.check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        errors.check_int(op, "hidden", hidden, 1)
        errors.check_int(op, "num_ranks", num_ranks, 1)
        errors.check_int(op, "num_experts", num_experts, 1)
        top_k = min(num_experts, 32)
        return _align(_EpxBuffer.bytes_needed("ll", hidden, top_k, num_experts,
                                              num_max_dispatch_tokens_per_rank, num_ranks,
                                              _backend_name()))

    # ---- life cycle and streams --------------------------------------------------------------
    def destroy(self):
        """Releases the epx buffers (requires explicitly_destroy=True, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise errors.invalid("Buffer.destroy", "the Buffer was created with "
                                 "explicitly_destroy=False, expected True")
        self._ht = self._ll = None
        self._groups.clear()
        self._raw.clear()
        self._destroyed = True

    def get_comm_stream(self):
        """epx runs on the caller's current stream: that stream on the Buffer's device (its last
        op's; before any, the current GPU where CUDA is available), None on the CPU."""
        device = self._device or self._default_device()
        if device.startswith("cuda"):
            return torch.cuda.current_stream(torch.device(device))
        return None

    def _default_device(self):
        """The device of a Buffer before its first op: the current GPU where CUDA is available,
        whatever the group's backend (DeepEP's Buffer lives there; vLLM hands it a gloo group),
        else 'cpu'."""
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def capture():
        """An EventOverlap recorded on the current CUDA stream (static, as DeepEP's; no event
        where CUDA is not initialised, e.g. on the cpu backend)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return EventOverlap(EventHandle())
        return EventOverlap(None)

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """DeepEP's raw buffer as a tensor: a view of ``dtype`` elements from byte ``offset`` of a
        raw buffer of ``num_nvl_bytes`` (``num_rdma_bytes`` with ``use_rdma_buffer``) that this
        Buffer allocates at the first call, on its device, and keeps until it is destroyed;
        ``size`` (a torch.Size) takes its first elements in that shape. DeepEP's raw buffer is
        its communication buffer, which its kernels overwrite; epx's kernels use their own
        memory, so this one holds what the caller writes (docs/semantics.md §9)."""
        op = "get_local_buffer_tensor"
        self._check_alive(op)
        capacity = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        name = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        errors.check_int(op, "offset", offset, 0)
        if not isinstance(dtype, torch.dtype):
            raise errors.invalid(op, f"argument 'dtype' is {dtype!r}, expected a torch.dtype")
        item = torch.empty((), dtype=dtype).element_size()
        if offset > capacity or offset % item:
            raise errors.invalid(op, f"argument 'offset' is {offset}, expected a multiple of "
                                 f"{item} (the element size) at most {name} = {capacity}")
        raw = self._raw.get(bool(use_rdma_buffer))
        if raw is None:
            device = self._device or self._default_device()
            raw = torch.zeros(capacity, dtype=torch.uint8, device=device)
            self._raw[bool(use_rdma_buffer)] = raw
        count = (capacity - offset) // item
        tensor = raw[offset:offset + count * item].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > count:
            raise errors.invalid(op, f"argument 'size' is {tuple(size)} ({size.numel()} "
                                 f"elements), expected at most {count} ({name} = {capacity} "
                                 f"bytes from offset {offset})")
        return tensor[:size.numel()].view(size)

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment=1, num_worst_tokens=0, config=None,
                           previous_event=None, async_finish=False,
                           allocate_on_comm_stream=False):
        """DeepEP's internode dispatch: dispatch() of a group that spans nodes (on one node
        InvalidArgument, as DeepEP's internode kernels need more than one node)."""
        self._check_internode("internode_dispatch")
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, num_worst_tokens, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None,
                          previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's internode combine: combine() of a group that spans nodes (on one node
        InvalidArgument)."""
        self._check_internode("internode_combine")
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ---- internals ---------------------------------------------------------------------------
    def _nccl_group(self):
        """Whether the ProcessGroup is NCCL's (its collectives take CUDA tensors)."""
        return str(dist.get_backend(self.group)).lower() == "nccl"

    def _check_alive(self, op):
        if self._destroyed:
            raise errors.invalid(op, "the Buffer was destroyed")

    def _check_internode(self, op):
        if self.num_nodes == 1:
            raise errors.invalid(op, f"the group's {self.group_size} ranks are one node "
                                 f"(ranks_per_node {self.ranks_per_node}), expected a group that "
                                 "spans nodes; dispatch() / combine() serve one node")

    def _group_for(self, device, num_sms):
        key = (device, num_sms)
        group = self._groups.get(key)
        if group is None:
            per_node = self.ranks_per_node if self.num_nodes > 1 else 0
            if self._comm is not None:
                group = _EpxGroup.from_comm(self._comm, device=device, num_sms=num_sms,
                                            ranks_per_node=per_node)
            else:
                group = _EpxGroup.from_process_group(self.group, device=device, num_sms=num_sms,
                                                     ranks_per_node=per_node)
            self._groups[key] = group
        return group

    def _capturing(self, device):
        return device.startswith("cuda") and torch.cuda.is_current_stream_capturing()

    def _agree(self, op, fields, extra, device):
        """Collective: one small all-gather through the ProcessGroup (or the communicator's
        allgather) of the (name, int) `fields`, which must be equal on every rank (else
        InvalidArgument on every rank naming each differing one with every rank's value), and of
        the `extra` ints, which need not be: returns every rank's `extra`, a list per rank."""
        values = [int(v) for _, v in fields] + [int(v) for v in extra]
        if self.group_size == 1:
            rows = [values]
        elif self._comm is not None:
            rows = [[int(v) for v in row] for row in self._comm.allgather(values)]
        else:
            on_gpu = self._nccl_group()
            # Scratch tensors of our own, never inference tensors: gloo writes the received
            # parts on its worker thread, outside the caller's torch.inference_mode().
            with torch.inference_mode(False):
                mine = torch.tensor(values, dtype=torch.int64,
                                    device=device if on_gpu else "cpu")
                parts = [torch.empty_like(mine) for _ in range(self.group_size)]
                dist.all_gather(parts, mine, group=self.group)
            rows = [[int(v) for v in row] for row in torch.stack(parts).tolist()]  # one sync
        errors.check_agreement(op, [(name, [row[i] for row in rows])
                                    for i, (name, _) in enumerate(fields)])
        return [row[len(fields):] for row in rows]

    def _sum_over_ranks(self, counts, device):
        """The element-wise sum over the ranks of an int64 tensor, as a list (one all-reduce
        through the ProcessGroup, or an allgather through the communicator)."""
        if self.group_size == 1:
            return [int(c) for c in counts.tolist()]
        if self._comm is not None:
            rows = self._comm.allgather([int(c) for c in counts.tolist()])
            return [sum(col) for col in zip(*rows)]
        t = counts.to(device if self._nccl_group() else "cpu").clone()
        dist.all_reduce(t, group=self.group)
        return [int(c) for c in t.tolist()]

    def _ht_buffer(self, op, device, num_tokens, hidden, top_k, num_experts, num_sms, names,
                   extra=()):
        """(buffer, rows): the normal-mode epx buffer for this shape, created or grown
        collectively when the largest T over the ranks exceeds its capacity, and every rank's
        `extra` ints (None during capture). Outside CUDA graph capture every call
        first agrees with the other ranks (one small all-gather, _agree): H, K and E
        must be the same on every rank (else InvalidArgument on every rank naming the DeepEP
        argument each comes from, ``names`` = its names for 'hidden', 'top_k', 'num_experts'),
        and the largest T sizes the buffer."""
        key = (device, num_sms, hidden, top_k, num_experts)
        buf = self._ht if self._ht_key == key else None
        if self._capturing(device):
            if buf is None:
                raise errors.invalid(op, "the first normal-mode call of a shape cannot run inside"
                                     " CUDA graph capture (epx sizes its buffer then); run it "
                                     "once before capturing")
            if num_tokens > buf.max_tokens_per_rank:
                raise errors.out_of_capacity(
                    op, f"T = {num_tokens} tokens exceeds the normal-mode buffer's capacity of "
                    f"{buf.max_tokens_per_rank}, and the buffer cannot grow during CUDA graph "
                    "capture; run a call with the largest T before capturing")
            return buf, None
        gathered = self._agree(op, [(names["hidden"], hidden), (names["top_k"], top_k),
                                    (names["num_experts"], num_experts)],
                               [num_tokens] + list(extra), device)
        rows = [v[1:] for v in gathered]
        need = max(v[0] for v in gathered)
        if buf is not None and need <= buf.max_tokens_per_rank:
            return buf, rows
        self._ht = None  # release before allocating the replacement
        self._ht = _EpxBuffer(self._group_for(device, num_sms), hidden, top_k, num_experts,
                              _next_pow2(max(need, 1)), enable_ht=True, enable_ll=False)
        self._ht_key = key
        return self._ht, rows

    def _tokens_per_node(self, reached):
        """The ints DeepEP calls num_tokens_per_rdma_rank: per node, this rank's tokens that go to
        some rank of it, from `reached` (bool [T, num_nodes])."""
        return [int(c) for c in reached.sum(dim=0).tolist()]

    def _reached_nodes(self, topk_idx, num_experts):
        """bool [T, num_nodes]: token t selects an expert of some rank of node m (values outside
        [0, E) count for none; the dispatch refuses them)."""
        N = self.num_nodes
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        nodes = torch.where(valid, topk_idx // (num_experts // N), torch.full_like(topk_idx, N))
        reached = torch.zeros(topk_idx.shape[0], N + 1, dtype=torch.bool,
                              device=topk_idx.device)
        reached.scatter_(1, nodes.long(), True)
        return reached[:, :N]

    def _rdma_prefix(self, rows, device):
        """DeepEP's recv_rdma_rank_prefix_sum (int32 [num_nodes]): the inclusive prefix over the
        source nodes m of the tokens rank (m, g) sends to this rank's node, own node included,
        from every rank's tokens per node (`rows`, gathered by _ht_buffer; never None here: a
        group that spans nodes is cpu-only, so no call is captured)."""
        G = self.ranks_per_node
        node, local = self.rank // G, self.rank % G
        counts = [rows[m * G + local][node] for m in range(self.num_nodes)]
        return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)

    def _ll_buffer(self, op, device, max_tokens, hidden, top_k, num_experts):
        """The low-latency epx buffer of this shape. (Re-)creating it is collective and starts
        with an agreement (Group.agree) naming DeepEP's arguments (InvalidArgument on every rank where they
        differ); calls on an existing buffer exchange nothing extra (the kernels compare the
        per-call options in their own exchange)."""
        # DeepEP's low-latency kernels size their own grid: num_sms (a normal-mode budget) never
        # throttles them; epx's ll kernels take their default grid (group num_sms 0).
        key = (device, max_tokens, hidden, top_k, num_experts)
        if self._ll is None or self._ll_key != key:
            if self.enable_shrink and self._masked_ranks():
                raise errors.unsupported(op, "a low-latency call of another shape (or the first "
                                         "one) while ranks are masked: epx creates the "
                                         "low-latency buffer of a shape collectively over every "
                                         f"rank, and ranks {self._masked_ranks()} are masked")
            # Through the epx group (not the ProcessGroup): a rank that re-creates its buffer
            # while its peers still dispatch on theirs then meets them in epx's own exchange,
            # where (cpu) every rank raises InvalidArgument instead of waiting for a timeout.
            group = self._group_for(device, 0)
            group.agree(op, [("argument 'num_max_dispatch_tokens_per_rank'", max_tokens),
                             ("hidden (x.shape[1])", hidden), ("top-k (topk_idx.shape[1])", top_k),
                             ("argument 'num_experts'", num_experts)])
            self._ll = None  # release before allocating the replacement
            self._ll = _EpxBuffer(group, hidden, top_k, num_experts, max_tokens, enable_ht=False,
                                  enable_ll=True, enable_shrink=self.enable_shrink)
            self._ll_key = key
            # The int fields of every handle of this buffer (DeepEP's handle[2:]), read once.
            self._ll_tail = (self._ll.max_tokens_per_rank, self._ll.hidden, self._ll.num_experts)
        return self._ll

    def _begin(self, op, t, previous_event):
        self._check_alive(op)
        self._device = _torch.device_key(t)
        # As DeepEP (getattr(previous_event, 'event', None)): an object without an event to wait
        # for is no dependency; its event is awaited on the current stream.
        event = getattr(previous_event, "event", None)
        if event is not None:
            wait = getattr(previous_event, "current_stream_wait", None) or \
                getattr(event, "current_stream_wait", None)
            if wait is not None:
                wait()
            else:  # a torch.cuda.Event
                torch.cuda.current_stream().wait_event(event)
        return self._device

    def _event(self, async_finish, tensors):
        if async_finish and self._device.startswith("cuda"):
            return EventOverlap(EventHandle(), tensors)
        return EventOverlap(None, tensors if async_finish else None)

    # ---- normal mode (epx ht) ----------------------------------------------------------------
    @_torch.plain_torch
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """-> (num_tokens_per_rank[R] i32, None, num_tokens_per_expert[E] i32,
        is_token_in_rank[T, R] bool, event). Local, except that the first call of a shape
        creates the epx buffer collectively."""
        op = "get_dispatch_layout"
        _tensor(op, "topk_idx", topk_idx, 2)
        errors.check_int(op, "num_experts", num_experts, 1)
        device = self._begin(op, topk_idx, previous_event)
        buf = self._ht
        key = self._ht_key
        top_k = topk_idx.shape[1]
        if buf is None or key[0] != device or key[3] != top_k or key[4] != num_experts:
            hidden = key[2] if key is not None else 128  # H is unknown until dispatch
            buf, _ = self._ht_buffer(op, device, topk_idx.shape[0], hidden, top_k, num_experts,
                                     Buffer.num_sms, _LAYOUT_NAMES)
        per_rank, per_expert, in_rank = buf.ht_layout(topk_idx)
        per_node = None  # DeepEP's num_tokens_per_rdma_rank: None on one node
        if self.num_nodes > 1:
            per_node = in_rank.view(-1, self.num_nodes, self.ranks_per_node).any(dim=2).sum(
                dim=0, dtype=torch.int32)
        return (per_rank, per_node, per_expert, in_rank,
                self._event(async_finish, (topk_idx, per_rank, per_node, per_expert, in_rank)))

    @_torch.plain_torch
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """Normal-mode dispatch (docs/semantics.md §1.2-1.5).

        -> (recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); cached mode (handle given):
        (recv_x, None, None, None, None, event).
        """
        op = "dispatch"
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise errors.invalid(op, f"argument 'x' is a tuple of {len(x)}, expected "
                                     "(fp8 x [T, H], scales)")
            x_data, x_scales = x
            if x_scales is not None:  # (x, None): bf16 x, as DeepEP reads it
                _tensor(op, "x[1] (scales)", x_scales, 2)
        else:
            x_data, x_scales = x, None
        _tensor(op, "x", x_data, 2)
        if x_scales is None:
            err = _torch.fp8_without_scales(op, x_data,
                                            "passed as x = (x, x_scales) with x_scales")
            if err is not None:
                raise err
        if x_scales is not None and not _torch.is_fp8(x_data):
            raise errors.invalid(op, f"argument 'x' is a tuple with scales but x[0] has dtype "
                                 f"{x_data.dtype}, expected {_torch.FP8_DTYPE} (fp8 e4m3)")
        num_sms = _config_sms(op, config)
        errors.check_int(op, "expert_alignment", expert_alignment, 1)
        errors.check_int(op, "num_worst_tokens", num_worst_tokens, 0)
        device = self._begin(op, x_data, previous_event)
        stream = _torch.stream_of(x_data)
        fp8 = x_scales is not None

        if handle is not None:  # cached mode
            native, buf = _ht_state(op, handle)
            if config is not None:
                _same_sms(op, num_sms, handle)
            if topk_idx is not None or topk_weights is not None:
                raise errors.invalid(op, "cached dispatch (handle given) takes no topk_idx / "
                                     "topk_weights: the routing is the handle's")
            r = buf.ht_dispatch(x_data, x_scales=x_scales, handle=native)
            recv_x = (r.recv_x, r.recv_x_scales) if fp8 else r.recv_x
            return recv_x, None, None, None, None, self._event(async_finish, (x, recv_x))

        T, H = x_data.shape
        R = self.group_size
        if num_tokens_per_expert is not None:
            num_experts = _tensor(op, "num_tokens_per_expert", num_tokens_per_expert, 1).numel()
        elif self._ht_key is not None:
            num_experts = self._ht_key[4]
        else:
            raise errors.invalid(op, "argument 'num_tokens_per_expert' is required on the first "
                                 "dispatch (it tells the number of experts)")
        if num_experts % R:
            raise errors.invalid(op, f"the number of experts is {num_experts} (from "
                                 f"'num_tokens_per_expert'), expected a multiple of the {R} ranks")
        if num_tokens_per_rank is not None and tuple(num_tokens_per_rank.shape) != (R,):
            raise errors.invalid(op, f"argument 'num_tokens_per_rank' has shape "
                                 f"{list(num_tokens_per_rank.shape)}, expected [{R}]")
        if is_token_in_rank is not None and tuple(is_token_in_rank.shape) != (T, R):
            raise errors.invalid(op, f"argument 'is_token_in_rank' has shape "
                                 f"{list(is_token_in_rank.shape)}, expected [{T}, {R}]")
        if num_tokens_per_rdma_rank is not None:
            N = self.num_nodes
            _tensor(op, "num_tokens_per_rdma_rank", num_tokens_per_rdma_rank)
            if tuple(num_tokens_per_rdma_rank.shape) != (N,):
                raise errors.invalid(op, f"argument 'num_tokens_per_rdma_rank' has shape "
                                     f"{list(num_tokens_per_rdma_rank.shape)}, expected [{N}] "
                                     f"(a count per node: {N} nodes of {self.ranks_per_node} "
                                     "ranks)")
        if topk_idx is None:
            if topk_weights is not None:
                raise errors.invalid(op, "argument 'topk_weights' is given without 'topk_idx', "
                                     "expected both or neither")
            return self._dispatch_by_rank(op, device, stream, x, x_data, x_scales, fp8,
                                          is_token_in_rank, num_tokens_per_expert, num_experts,
                                          expert_alignment, num_worst_tokens, num_sms,
                                          async_finish)
        _tensor(op, "topk_idx", topk_idx, 2)
        K = topk_idx.shape[1]
        across = self.num_nodes > 1
        per_node = self._tokens_per_node(self._reached_nodes(topk_idx, num_experts)) \
            if across else ()
        buf, rows = self._ht_buffer(op, device, T, H, K, num_experts, num_sms,
                                    _dispatch_names(num_tokens_per_expert is not None), per_node)
        r = buf.ht_dispatch(x_data, topk_idx, topk_weights, x_scales=x_scales,
                            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        recv_x = (r.recv_x, r.recv_x_scales) if fp8 else r.recv_x
        new_handle = _HtHandle(r.handle, buf, self.rank, num_sms,
                               self._rdma_prefix(rows, device) if across else None)
        event = self._event(async_finish, (x, topk_idx, topk_weights, recv_x, r.recv_topk_idx,
                                           r.recv_topk_weights))
        return (recv_x, r.recv_topk_idx, r.recv_topk_weights, list(r.num_recv_tokens_per_expert),
                new_handle, event)

    def _dispatch_by_rank(self, op, device, stream, x, x_data, x_scales, fp8, is_token_in_rank,
                          num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens,
                          num_sms, async_finish):
        """A dispatch routed by is_token_in_rank alone (DeepEP's layout-only call): token t goes
        once to every rank r with is_token_in_rank[t, r]; received tokens carry no top-k. epx
        routes it as a top-k dispatch whose row for t names the first local expert of each such
        rank (so the received order, the handle and combine are those of DeepEP), and the
        per-expert list is the sum over the ranks of num_tokens_per_expert (one all-reduce over
        the group, as DeepEP's notify step exchanges it), aligned to expert_alignment."""
        if is_token_in_rank is None:
            raise errors.invalid(op, "neither 'topk_idx' nor 'is_token_in_rank' nor 'handle' is "
                                 "given, expected one of them to route the tokens")
        if num_tokens_per_expert is None:
            raise errors.invalid(op, "argument 'num_tokens_per_expert' is required with "
                                 "'is_token_in_rank' (it gives the received per-expert counts)")
        _tensor(op, "is_token_in_rank", is_token_in_rank, 2)
        if is_token_in_rank.dtype != torch.bool:
            raise errors.invalid(op, f"argument 'is_token_in_rank' has dtype "
                                 f"{is_token_in_rank.dtype}, expected torch.bool")
        T, H = x_data.shape
        R = self.group_size
        L = num_experts // R
        # The routing width: the current normal-mode buffer's top-k when it holds R columns (no
        # re-creation), else R.
        key = self._ht_key
        K = key[3] if key is not None and key[:3] == (device, num_sms, H) and \
            key[4] == num_experts and key[3] >= R else R
        first_expert = torch.arange(R, dtype=torch.int64, device=is_token_in_rank.device) * L
        routed = torch.where(is_token_in_rank, first_expert.unsqueeze(0),
                             torch.full_like(first_expert, -1).unsqueeze(0))
        if K > R:
            routed = torch.cat([routed, routed.new_full((T, K - R), -1)], dim=1)
        routed = routed.contiguous()
        across = self.num_nodes > 1
        per_node = self._tokens_per_node(
            is_token_in_rank.view(T, self.num_nodes, self.ranks_per_node).any(dim=2)) \
            if across else ()
        buf, rows = self._ht_buffer(op, device, T, H, K, num_experts, num_sms, _BY_RANK_NAMES,
                                    per_node)
        r = buf.ht_dispatch(x_data, routed, x_scales=x_scales, num_worst_tokens=num_worst_tokens)
        recv_x = (r.recv_x, r.recv_x_scales) if fp8 else r.recv_x
        new_handle = _HtHandle(r.handle, buf, self.rank, num_sms,
                               self._rdma_prefix(rows, device) if across else None)
        if num_worst_tokens > 0:
            per_expert = []  # DeepEP returns no list in worst-case mode
        else:
            counts = self._sum_over_ranks(num_tokens_per_expert.to(torch.int64), device)
            mine = counts[self.rank * L:(self.rank + 1) * L]
            a = expert_alignment
            per_expert = [(int(c) + a - 1) // a * a for c in mine]
        event = self._event(async_finish, (x, is_token_in_rank, recv_x, routed))
        return recv_x, None, None, per_expert, new_handle, event

    @_torch.plain_torch
    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        """Normal-mode combine (docs/semantics.md §1.6): unweighted sum over the ranks each token
        went to, plus bias. -> (combined_x[T, H], combined_topk_weights or None, event)."""
        op = "combine"
        _tensor(op, "x", x, 2)
        native, buf = _ht_state(op, handle)
        if config is not None:
            _same_sms(op, _config_sms(op, config), handle)
        if bias is None:
            bias0 = bias1 = None
        elif isinstance(bias, torch.Tensor):
            bias0, bias1 = bias, None
        elif isinstance(bias, (tuple, list)) and len(bias) <= 2:
            bias0, bias1 = (tuple(bias) + (None, None))[:2]
        else:
            raise errors.invalid(op, "argument 'bias' must be a tensor or a tuple of up to two "
                                 "tensors [T, H]")
        self._begin(op, x, previous_event)
        out, weights = buf.ht_combine(x, native, topk_weights, bias0, bias1)
        return out, weights, self._event(async_finish, (x, topk_weights, bias0, bias1, out))

    # ---- low-latency mode (epx ll) -----------------------------------------------------------
    def _check_ll(self, op):
        if not self.low_latency_mode:
            raise errors.invalid(op, "the Buffer was created with low_latency_mode=False, "
                                 "expected True")

    @_torch.plain_torch
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False,
                             use_ue8m0=False, async_finish=False, return_recv_hook=False,
                             use_nvfp4=False, x_global_scale=None):
        """Low-latency dispatch (docs/semantics.md §2.1-2.2).

        -> (recv_x or (recv_x, recv_scales), recv_count[L] i32, handle, event, hook); recv_x
        [L, R*T_max, H] (fp8 or bf16), recv_scales column-major in the last two dims; with
        use_nvfp4 the forks' NVFP4 views (module docstring); hook is None unless
        return_recv_hook.
        """
        op = "low_latency_dispatch"
        # Per call (docs/perf.md §4.5): each check is a plain test with the full check, and its
        # message, behind it; the epx op is called through the extension directly (the checks of
        # epx.Buffer.ll_dispatch are made here), no per-call object beyond the results.
        if not self.low_latency_mode:
            self._check_ll(op)
        if async_finish and return_recv_hook:
            raise errors.invalid(op, "async_finish and return_recv_hook are both True, expected "
                                 "at most one")
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            _tensor(op, "x", x, 2)
        if x.dtype in _LL_NOT_X:
            raise errors.invalid(op, f"argument 'x' has dtype {x.dtype}, expected "
                                 "torch.bfloat16: the low-latency dispatch quantises bf16 x to "
                                 "fp8 itself (use_fp8=True) and takes no scales")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            _tensor(op, "topk_idx", topk_idx, 2)
        max_tokens = num_max_dispatch_tokens_per_rank
        if type(max_tokens) is not int or max_tokens < 1:
            errors.check_int(op, "num_max_dispatch_tokens_per_rank", max_tokens, 1)
        if type(num_experts) is not int or num_experts < 1:
            errors.check_int(op, "num_experts", num_experts, 1)
        if self._destroyed:
            self._check_alive(op)
        device = self._device = _torch.device_key(x)
        key = (device, max_tokens, x.shape[1], topk_idx.shape[1], num_experts)
        buf = self._ll
        if buf is None or key != self._ll_key:
            buf = self._ll_buffer(op, *key)
        # Without use_nvfp4, x_global_scale is not read (the forks accept it with fp8 and bf16).
        nvfp4 = {"use_nvfp4": True, "x_global_scale": x_global_scale} if use_nvfp4 else _NO_KW
        if not use_fp8 and not use_nvfp4 and (round_scale or not use_ue8m0):
            # As DeepEP: the scale options act on fp8 only (use_ue8m0 without round_scale is
            # refused in every format, as DeepEP asserts it)
            round_scale = use_ue8m0 = False
        recv_x, scales, count, native, hook = buf._native.ll_dispatch(
            x, topk_idx, bool(use_fp8), bool(round_scale), bool(use_ue8m0),
            bool(return_recv_hook), cumulative_local_expert_recv_stats, _torch.stream_of(x),
            dispatch_wait_recv_cost_stats, **nvfp4)
        handle = _LlHandle(native, buf, self._ll_tail)
        packed = (recv_x, scales) if use_fp8 or use_nvfp4 else recv_x
        event = (self._event(True, (x, topk_idx, recv_x, scales, count, x_global_scale))
                 if async_finish else EventOverlap())
        return packed, count, handle, event, hook

    @_torch.plain_torch
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None, overlap=False,
                            packed_recv_count=None, comp_signal=None, block_m=64, threshold=0,
                            num_sms=3, src_signals=None, src_signal_expect_value=0):
        """Low-latency combine (docs/semantics.md §2.3): out[t] = sum_k w[t][k] * x(t, k).
        -> (combined_x[T, H], event, hook). use_logfmt: LogFMT-10 rows (§2.3.1), zero_copy too.

        overlap=True (the forks' signal-driven combine, §2.7): called on another stream after the
        expert GEMM that writes x and raises the signals was enqueued, it sends each part of x
        as soon as its signal is reached. Either comp_signal (int32, one signal per block of
        block_m rows of each local expert, reached at threshold; num_sms send SMs;
        packed_recv_count, the dispatch's recv_count, checked) or src_signals (one per local
        expert, reached at src_signal_expect_value; 32 send SMs). overlap=False ignores them."""
        op = "low_latency_combine"
        if not self.low_latency_mode:
            self._check_ll(op)
        if async_finish and return_recv_hook:
            raise errors.invalid(op, "async_finish and return_recv_hook are both True, expected "
                                 "at most one")
        if not isinstance(handle, _LlHandle):
            _ll_state(op, handle)
        if self._destroyed:
            self._check_alive(op)
        self._device = _torch.device_key(topk_weights)
        kw = _NO_KW if not overlap else {"overlap": _overlap_arg(op, _fork_overlap(
            op, handle, packed_recv_count, comp_signal, block_m, threshold, num_sms, src_signals,
            src_signal_expect_value))}
        combined, hook = handle._buffer._native.ll_combine(
            x, topk_idx, topk_weights, handle._handle, bool(zero_copy), bool(return_recv_hook),
            out, _torch.stream_of(topk_weights), combine_wait_recv_cost_stats, bool(use_logfmt),
            **kw)
        event = (self._event(True, (x, topk_idx, topk_weights, combined)) if async_finish else
                 EventOverlap())
        return combined, event, hook

    @_torch.plain_torch
    def get_next_low_latency_combine_buffer(self, handle):
        """The bf16 [L, R*T_max, H] view to write expert outputs into before
        low_latency_combine(..., zero_copy=True)."""
        op = "get_next_low_latency_combine_buffer"
        self._check_ll(op)
        self._check_alive(op)
        native, buf = _ll_state(op, handle)
        return buf.ll_next_combine_buffer(native)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Collective. Resets the low-latency buffer of this shape (a no-op when none exists:
        a fresh buffer is clean)."""
        op = "clean_low_latency_buffer"
        self._check_ll(op)
        self._check_alive(op)
        errors.check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        errors.check_int(op, "hidden", hidden, 1)
        errors.check_int(op, "num_experts", num_experts, 1)
        key = self._ll_key
        if self._ll is not None and key[1:3] == (num_max_dispatch_tokens_per_rank, hidden) and \
                key[4] == num_experts:
            self._ll.ll_clean()

    # ---- rank masks (enable_shrink; docs/semantics.md §2.6) ----------------------------------
    def _check_shrink(self, op):
        self._check_alive(op)
        if not self.enable_shrink:
            raise errors.invalid(op, "the Buffer was created with enable_shrink=False, expected "
                                 "True (the rank mask needs it)")

    def _masked_ranks(self):
        """The ranks this rank masks, as a sorted list (host copy of the low-latency buffer's
        mask, or the mask kept while none exists)."""
        if self._ll is None:
            bits = self._mask_pending
        else:
            status = torch.zeros(self.group_size, dtype=torch.int32,
                                 device=torch.device(self._ll._native.device))
            self._ll.ll_query_mask(status)
            bits = sum(1 << p for p, v in enumerate(status.tolist()) if v)
        return [p for p in range(self.group_size) if bits >> p & 1]

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (mask=True) or unmasks rank ``rank_to_mask`` for this rank's low-latency calls
        (and clean_low_latency_buffer): nothing is sent to it, it is not waited for, its tokens
        and its experts' terms are left out (docs/semantics.md §2.6). Local, on the current
        stream. A rank cannot mask itself. An unmasked rank takes part again once every rank that
        takes part called clean_low_latency_buffer() (or low_latency_clean_mask_buffer(), which
        resets the buffer too)."""
        op = "low_latency_update_mask_buffer"
        self._check_shrink(op)
        errors.check_int(op, "rank_to_mask", rank_to_mask)
        if rank_to_mask >= self.group_size:
            raise errors.invalid(op, f"argument 'rank_to_mask' is {rank_to_mask}, expected 0.."
                                 f"{self.group_size - 1}")
        if self._ll is not None:
            self._ll.ll_update_mask(rank_to_mask, bool(mask))
            return
        if mask and rank_to_mask == self.rank:
            raise errors.invalid(op, f"argument 'rank_to_mask' is {rank_to_mask}, this rank, with "
                                 "mask=True; expected another rank (a rank cannot mask itself)")
        bit = 1 << rank_to_mask
        self._mask_pending = self._mask_pending | bit if mask else self._mask_pending & ~bit

    def low_latency_query_mask_buffer(self, mask_status):
        """Writes into ``mask_status`` (int32 [num_ranks] on the low-latency calls' device) 1 for
        every rank this rank masks (by low_latency_update_mask_buffer, or because a wait for it
        timed out), else 0. On the current stream."""
        op = "low_latency_query_mask_buffer"
        self._check_shrink(op)
        if self._ll is not None:
            self._ll.ll_query_mask(mask_status)
            return
        _tensor(op, "mask_status", mask_status, 1)
        if mask_status.dtype != torch.int32 or mask_status.numel() != self.group_size:
            raise errors.invalid(op, f"argument 'mask_status' is {mask_status.dtype} "
                                 f"{list(mask_status.shape)}, expected torch.int32 "
                                 f"[{self.group_size}]")
        bits = [self._mask_pending >> p & 1 for p in range(self.group_size)]
        mask_status.copy_(torch.tensor(bits, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self):
        """Unmasks every rank and, where the low-latency buffer exists, resets it collectively
        (clean_low_latency_buffer's reset, over every rank), so that the ranks that were masked
        take part again at the next call. DeepEP's call is local; its callers (vLLM's
        fault-tolerance retry) make it on every rank after zeroing DeepEP's raw buffer, which
        resets DeepEP's low-latency state and not epx's (docs/semantics.md §9). A rank that does
        not make the call within twice the group's timeout is masked again."""
        op = "low_latency_clean_mask_buffer"
        self._check_shrink(op)
        self._mask_pending = 0
        if self._ll is not None:
            self._ll.ll_clean_mask()
            self._ll.ll_clean()
