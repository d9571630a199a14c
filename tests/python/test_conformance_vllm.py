"""Conformance tier: vLLM's DeepEP integration, replayed call for call on epx.

vLLM does ``import deep_ep``; every body here imports it the same way, through epx's shim
directory (README, "Engines switch with no code change"), and drives it as vLLM's modules do
(vLLM's main branch as of 2026-12-05; everything below is this repository's own code, written from
that reading; the comments name the vLLM file and function each piece mirrors):

* vllm/distributed/device_communicators/all2all.py
    - DeepEPHTAll2AllManager._make_all2all_kwargs / get_handle: ``deep_ep.Buffer(group=<the EP
      group's gloo cpu_group>, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB (1024) MiB,
      num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)``,
      built through vLLM's Cache (base_device_communicator.py: a WeakValueDictionary keyed by
      the sorted kwargs), so every MoE layer shares one Buffer; set_num_sms (capped at DeepEP's
      default 20, the DBO SM split's entry and exit); destroy() of every cached Buffer.
    - DeepEPLLAll2AllManager._make_all2all_kwargs / get_handle:
      ``Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=, hidden=,
      num_ranks=, num_experts=)`` by keyword, then ``Buffer(group=, num_nvl_bytes=,
      num_rdma_bytes=<the hint>, low_latency_mode=True, num_qps_per_rank=<local experts>,
      allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
      enable_shrink=<enable_fault_tolerance>)``; max_sms_used() = 0 (no SM split for LL);
      with fault tolerance query_active_mask / query_fault (low_latency_query_mask_buffer) and
      clean_buffers (get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_(),
      low_latency_clean_mask_buffer()).
* vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py (formerly
  fused_moe/deepep_ht_prepare_finalize.py), DeepEPHTPrepareAndFinalize: prepare_async /
  _do_dispatch (get_dispatch_layout(topk_idx=, num_experts=, previous_event=,
  async_finish=False, allocate_on_comm_stream=False); dispatch(x=bf16 or (fp8, row-major f32
  block scales), handle=None, num_tokens_per_rank=, num_tokens_per_rdma_rank=, is_token_in_rank=,
  num_tokens_per_expert=, topk_idx=, topk_weights=, expert_alignment=1, config=<get_dispatch_config
  (R) for R in vLLM's list, else None>, previous_event=, async_finish=<not DBO>,
  allocate_on_comm_stream=False)), _receiver (``if event.event is not None:
  event.current_stream_wait()``, the -1 ids remapped to a foreign expert and local ids offset to
  global ones, ExpertTokensMetadata.make_from_list of the per-expert list), _finalize (the top-k
  weight-and-reduce of TopKWeightAndReduceContiguous, then combine(x=, handle=,
  topk_weights=None, config=<get_combine_config>, previous_event=, async_finish=<do_async and not
  DBO>, allocate_on_comm_stream=False) and ``output.copy_(combined_x, non_blocking=True)`` into
  the layer's output), both finalize_async (what the modular kernel calls) and finalize;
  apply_router_weight_on_input (top-1 models: x scaled before the dispatch, no weights after).
* .../prepare_finalize/deepep_ll.py (formerly deepep_ll_prepare_finalize.py),
  DeepEPLLPrepareAndFinalize: prepare_async (low_latency_dispatch(a1, topk_ids,
  max_tokens_per_rank, num_experts, use_fp8=, round_scale=use_ue8m0, use_ue8m0=,
  async_finish=False, return_recv_hook=True), positional as vLLM passes them), _receiver
  (_do_quant: DeepEP's (fp8, scales) passed through for 128-blocks, bf16 viewed [-1, H] and
  back; ExpertTokensMetadata(expert_num_tokens=<the recv count>)), _finalize
  (low_latency_combine(x, topk_ids, topk_weights or ones, handle, async_finish=False,
  zero_copy=False, return_recv_hook=<DBO or async>, out=output)), finalize_async and finalize.
* .../fused_moe/modular_kernel.py, FusedMoEModularKernel: _prepare (dbo_maybe_run_recv_hook,
  prepare_async, the hook run at once or handed to the other micro-batch), _fused_experts (no
  rows received: torch.empty_like(a1q, dtype=bf16), finalize skips the reduction), _finalize
  (finalize_async, the hook, the receiver); output = torch.empty_like(hidden_states), poisoned
  here.
* vllm/v1/worker/ubatching.py + gpu_ubatch_wrapper.py (dual-batch overlap, DBO): two micro-batch
  threads that strictly alternate, recv hooks registered to the other micro-batch and run by
  its next dbo_maybe_run_recv_hook (or at its context's exit), buffer.capture() as the
  previous_event (dbo_get_previous_event), the compute/comm stream switches on CUDA, one handle
  per micro-batch, and SMControlContextManager's set_num_sms(VLLM_DBO_COMM_SMS) on entry and
  set_num_sms(<all SMs>) on exit.

Models replayed (each for several steps x MoE layers, token counts differing per rank and
step, a rank with vLLM's one-token dummy batch, a rank with no tokens, -1 slots in some layers):
bf16; fp8 with 128-blocks (HT: per_token_group_quant_fp8's row-major float32 scales, plain and
with the power-of-two scales of DeepGEMM's E8M0 mode; LL: DeepEP's own fp8, plain and UE8M0);
top-1 with apply_router_weight_on_input. HT runs at H = 256, LL at H = 2048 (the smallest hidden
size vLLM's LL path accepts). The experts are a stand-in (each expert scales its dequantised rows
by its own factor), computed on the CPU so that the reference reproduces them bit for bit; every
output element vLLM reads (received rows, scales, counts, ids, weights, the per-expert list, the
layer's output) is compared with reference.py, reusing test_deep_ep_ht._check_recv and
test_deep_ep_ll._check_dispatch / _assert_combined. Inputs are fresh random (seed in every
message). vLLM's V1 calls use none of num_worst_tokens, cached dispatch, combine's topk_weights
(None) and bias, zero_copy, use_logfmt, async_finish on the low-latency calls.

A real fault under fault tolerance (test_vllm_ll_retry_after_fault): a rank stalls through a step,
its peers' next dispatch waits one timeout and masks it, then every rank runs the retry's
clean_buffers and the following steps are exact on every rank.

Not replayed: vLLM's internode HT settings (num_rdma_bytes = the buffer size, num_qps_per_rank =
num_sms // 2: more than one node), NVFP4 dispatch (VLLM_DEEPEPLL_NVFP4_DISPATCH, DeepEP's
hybrid-ep fork), the EPLB routing tables (a mapping of ids before the calls, nothing new for the
Buffer), CUDA graphs, and a rank that dies (the retry then rebuilds vLLM's groups).
"""

import contextlib
import os
import random
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as compat_deep_ep
import reference as ref
import test_conformance_deep_ep as dconf
import test_deep_ep_ht as ht
import test_deep_ep_ll as ll
from conftest import deep_ep_shim_on_path, get_pool

HT_H = ht.H            # 256: bf16 rows of 512 bytes (vLLM's HT hidden-size rounding unit)
LL_H = 2048            # the smallest of DeepEPLLPrepareAndFinalize.SUPPORTED_HIDDEN_SIZES
LL_SUPPORTED_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
BUFFER_SIZE_MB = 1024  # VLLM_DEEPEP_BUFFER_SIZE_MB's default
DEEPEP_NUM_SMS = 20    # DeepEPAll2AllManagerBase.num_sms (DeepEP's default)
DBO_COMM_SMS = 16      # VLLM_DBO_COMM_SMS (default 20; 16 here so that the split changes it)
TOTAL_SMS = 132        # what SMControlContextManager restores on exit (an H100's SMs)
# DeepEPHTPrepareAndFinalize.available_rank_configs: group sizes DeepEP has tuned Configs for.
AVAILABLE_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
NUM_LAYERS = 2         # MoE layers per step, each its own prepare/finalize on the shared Buffer
LL_T_MAX = 8           # FusedMoEConfig.max_num_tokens (the LL buffer's tokens per rank)


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _num_experts(R):
    return max(16, 4 * R)


def _import_deep_ep():
    """``import deep_ep`` as vLLM does, through epx's shim (conftest.deep_ep_shim_on_path)."""
    with deep_ep_shim_on_path():
        import deep_ep as mod
    assert mod.Buffer is compat_deep_ep.Buffer, f"deep_ep is {mod.__file__}, not epx's shim"
    return mod


def _cpu_group(ctx):
    """vLLM hands DeepEP its EP group's cpu_group, a gloo ProcessGroup, whatever the device (on
    the CPU tier the pool's group is gloo already; on the GPU tier one is made once per pool)."""
    if str(dist.get_backend(ctx.group)).lower() == "gloo":
        return ctx.group
    group = ctx.cache.get("vllm_cpu_group")
    if group is None:
        group = ctx.cache["vllm_cpu_group"] = dist.new_group(backend="gloo")
    return group


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _ll_hidden(h):
    """test_deep_ep_ll's checks read its module-level H: point it at this file's LL hidden size
    for the call (the rank process runs one check at a time)."""
    saved = ll.H
    ll.H = h
    try:
        yield
    finally:
        ll.H = saved


# ==== the all2all managers (vllm/distributed/device_communicators/all2all.py) ====================

class _Cache:
    """base_device_communicator.Cache: one object per distinct kwargs, held weakly (the
    prepare/finalize objects of the MoE layers keep it alive)."""

    def __init__(self):
        self.objects = weakref.WeakValueDictionary()

    def get_or_create(self, kwargs, factory):
        key = tuple(sorted(kwargs.items()))
        obj = self.objects.get(key)
        if obj is None:
            obj = factory(**kwargs)
            self.objects[key] = obj
        return obj


class _HtManager:
    """DeepEPHTAll2AllManager (one node: intranode sizes)."""

    def __init__(self, deep_ep, cpu_group, world_size, rank):
        self.deep_ep = deep_ep
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.rank = rank
        self.handle_cache = _Cache()
        self.num_sms = DEEPEP_NUM_SMS

    def _make_all2all_kwargs(self):
        return dict(group=self.cpu_group, num_nvl_bytes=BUFFER_SIZE_MB * 1024 * 1024,
                    num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                    explicitly_destroy=True)

    def get_handle(self, kwargs):
        assert len(kwargs) == 0
        return self.handle_cache.get_or_create(self._make_all2all_kwargs(), self.deep_ep.Buffer)

    def set_num_sms(self, num_sms):
        # The buffers are sized for DeepEP's default: vLLM only ever lowers the SM count.
        self.deep_ep.Buffer.set_num_sms(min(num_sms, self.num_sms))

    def destroy(self):
        for handle in list(self.handle_cache.objects.values()):
            handle.destroy()
        self.handle_cache.objects.clear()


class _LlManager:
    """DeepEPLLAll2AllManager."""

    def __init__(self, deep_ep, cpu_group, world_size, rank, device, fault_tolerance):
        self.deep_ep = deep_ep
        self.cpu_group = cpu_group
        self.world_size = world_size
        self.rank = rank
        self.device = device
        self.support_fault_tolerance = fault_tolerance
        self.handle_cache = _Cache()
        self.buffer = None
        self.mask = None
        self.last_mask = None

    def _make_all2all_kwargs(self, max_num_tokens_per_dp_rank, token_hidden_size, num_ep_ranks,
                             num_global_experts, num_local_experts):
        num_rdma_bytes = self.deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank,
            hidden=token_hidden_size, num_ranks=num_ep_ranks, num_experts=num_global_experts)
        assert isinstance(num_rdma_bytes, int) and num_rdma_bytes > 0
        return dict(group=self.cpu_group, num_nvl_bytes=BUFFER_SIZE_MB * 1024 * 1024,
                    num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                    num_qps_per_rank=num_local_experts, allow_nvlink_for_low_latency_mode=True,
                    allow_mnnvl=False, explicitly_destroy=True,
                    enable_shrink=self.support_fault_tolerance)

    def get_handle(self, kwargs):
        handle = self.handle_cache.get_or_create(self._make_all2all_kwargs(**kwargs),
                                                 self.deep_ep.Buffer)
        self.buffer = handle
        return handle

    def max_sms_used(self):
        return 0  # no SM split under DBO for the low-latency kernels

    def query_active_mask(self):
        if self.mask is None:
            self.mask = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        self.buffer.low_latency_query_mask_buffer(self.mask)
        return self.mask

    def query_fault(self):
        current = self.query_active_mask()
        if self.last_mask is None:
            self.last_mask = torch.zeros_like(current)
        return (current != self.last_mask).any()

    def clean_buffers(self):
        self.buffer.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
        _sync(self.device)
        self.buffer.low_latency_clean_mask_buffer()
        _sync(self.device)
        self.last_mask = None

    def destroy(self):
        for handle in list(self.handle_cache.objects.values()):
            handle.destroy()
        self.handle_cache.objects.clear()


# ==== dual-batch overlap (vllm/v1/worker/ubatching.py) ===========================================

_UB = threading.local()  # .ctx: this thread's micro-batch context; absent: DBO off


def _ub():
    return getattr(_UB, "ctx", None)


def _dbo_enabled():
    return _ub() is not None


def _dbo_current_ubatch_id():
    ctx = _ub()
    return 0 if ctx is None else ctx.id


class _DualBatch:
    """Two micro-batch threads that run strictly one at a time, handing over at each yield, as
    vLLM's UBatchContext pair does; recv hooks go to the other micro-batch and run at its next
    maybe_run_recv_hook or when its context exits. On CUDA the two share one compute and one
    comm stream with per-micro-batch "done" events, switched as vLLM switches them."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.wake = [threading.Event(), threading.Event()]
        self.hooks = [None, None]
        self.failed = False
        if self.cuda:
            self.compute_stream = torch.cuda.current_stream(self.device)
            self.comm_stream = torch.cuda.Stream(self.device)
            self.comm_done = [torch.cuda.Event(), torch.cuda.Event()]
            self.compute_done = [torch.cuda.Event(), torch.cuda.Event()]

    # -- the ubatch functions (dbo_* in vLLM), on the calling thread's context --
    def _wait(self, i):
        while not self.wake[i].wait(0.5):
            if self.failed:
                raise RuntimeError("the other micro-batch failed")
        self.wake[i].clear()
        if self.failed:
            raise RuntimeError("the other micro-batch failed")

    def cpu_yield(self, i):
        self.wake[1 - i].set()
        self._wait(i)

    def set_stream(self, stream):
        if self.cuda:
            torch.cuda.set_stream(stream)

    def yield_(self, i):
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        self.cpu_yield(i)
        self.set_stream(stream)

    def switch_to_comm(self):
        self.set_stream(self.comm_stream if self.cuda else None)

    def switch_to_compute(self):
        self.set_stream(self.compute_stream if self.cuda else None)

    def _handover(self, i, to_comm, yield_first):
        """Micro-batch i leaves one stream for the other (compute -> comm when `to_comm`): its
        work so far recorded in its "done" event, the other micro-batch's turn first when
        `yield_first`, then the other stream made current and made to wait for that event."""
        if not self.cuda:
            if yield_first:
                self.cpu_yield(i)
            return
        if to_comm:
            src, dst, done = self.compute_stream, self.comm_stream, self.compute_done[i]
        else:
            src, dst, done = self.comm_stream, self.compute_stream, self.comm_done[i]
        done.record(src)
        if yield_first:
            self.cpu_yield(i)
        torch.cuda.set_stream(dst)
        dst.wait_event(done)

    def switch_to_compute_sync(self, i):
        self._handover(i, to_comm=False, yield_first=False)

    def yield_and_switch_from_compute_to_comm(self, i):
        self._handover(i, to_comm=True, yield_first=True)

    def yield_and_switch_from_comm_to_compute(self, i):
        self._handover(i, to_comm=False, yield_first=True)

    def maybe_run_recv_hook(self, i):
        hook, self.hooks[i] = self.hooks[i], None
        if hook is not None:
            hook()

    def register_recv_hook(self, i, hook):
        self.hooks[1 - i] = hook

    def previous_event(self, func):
        if self.cuda:
            with torch.cuda.stream(self.compute_stream):
                return func()
        return func()

    # -- running the two micro-batches --
    def run(self, forwards):
        """forwards[i](): micro-batch i's forward pass, on its own thread. Returns their
        results; re-raises the first failure."""
        results, errors = [None, None], [None, None]

        def thread(i):
            _UB.ctx = _Ctx(self, i)
            try:
                if self.cuda:
                    torch.cuda.set_device(self.device)
                self._wait(i)
                self.set_stream(self.compute_stream if self.cuda else None)
                results[i] = forwards[i]()
                self.maybe_run_recv_hook(i)  # UBatchContext.__exit__
            except BaseException as exc:  # re-raised by run()
                errors[i] = exc
                self.failed = True
            finally:
                del _UB.ctx
                self.wake[1 - i].set()  # the other one goes on (or, on failure, stops)

        threads = [threading.Thread(target=thread, args=(i,), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        self.wake[0].set()
        for t in threads:
            t.join(timeout=150)
            assert not t.is_alive(), "a micro-batch thread did not finish"
        if self.cuda:
            torch.cuda.set_stream(self.compute_stream)
            torch.cuda.synchronize(self.device)
        # The micro-batch that failed first, not the one that stopped because of it.
        for e in sorted((e for e in errors if e is not None),
                        key=lambda e: "other micro-batch failed" in str(e)):
            raise e
        return results


class _Ctx:
    def __init__(self, dual, i):
        self.dual = dual
        self.id = i


def _dbo_call(method, with_id=True):
    """vLLM's dbo_<name> functions: nothing (None) outside a micro-batch thread; inside, the
    dual batch's method, given the micro-batch's id where vLLM's passes it."""
    def call(*args):
        ctx = _ub()
        if ctx is None:
            return None
        fn = getattr(ctx.dual, method)
        return fn(ctx.id, *args) if with_id else fn(*args)
    return call


_dbo_yield = _dbo_call("yield_")
_dbo_maybe_run_recv_hook = _dbo_call("maybe_run_recv_hook")
_dbo_register_recv_hook = _dbo_call("register_recv_hook")
_dbo_get_previous_event = _dbo_call("previous_event", with_id=False)
_dbo_yield_and_switch_from_compute_to_comm = _dbo_call("yield_and_switch_from_compute_to_comm")
_dbo_yield_and_switch_from_comm_to_compute = _dbo_call("yield_and_switch_from_comm_to_compute")
_dbo_switch_to_compute_sync = _dbo_call("switch_to_compute_sync")
_dbo_switch_to_comm = _dbo_call("switch_to_comm", with_id=False)
_dbo_switch_to_compute = _dbo_call("switch_to_compute", with_id=False)


# ==== the experts (stand-ins) and the modular kernel ============================================

def _coef(e):
    """Expert e's factor (exact in float32)."""
    return 0.25 + (e % 5) * 0.125


def _dequant(x, scales):
    """What a grouped GEMM reads: bf16 rows as they are, fp8 rows times their 128-channel scales
    (float32 or packed UE8M0), as float32 on the CPU."""
    if scales is None:
        return x.cpu().to(torch.float32)
    return dconf._cast_back(x, scales).to(torch.float32)


def _ht_experts(rank, L, E):
    """The Standard-format fused experts with vLLM's expert_map (global id -> local, -1
    elsewhere): output [M, K, H], row (m, k) = expert k's output for token m where that expert
    is local, else 0. No rows: FusedMoEModularKernel._fused_experts' empty_like."""
    coef = torch.tensor([_coef(e) for e in range(E)], dtype=torch.float32)

    def run(a1q, a1q_scale, meta, topk_ids, topk_weights):
        if a1q.shape[0] == 0:
            return torch.empty_like(a1q, dtype=torch.bfloat16)
        ids = topk_ids.cpu()
        local = (ids // L) == rank
        c = torch.where(local, coef[ids], torch.zeros(()))
        x = _dequant(a1q, a1q_scale)
        return (x[:, None, :] * c[:, :, None]).to(torch.bfloat16).to(a1q.device)
    return run


def _weight_and_reduce(fused, topk_weights, apply_router_weight_on_input):
    """TopKWeightAndReduceContiguous: [M, K, H] bf16 times the weights in place (unless they
    were applied on the input), summed over K (ops.moe_sum) to bf16 [M, H]; on the CPU."""
    m, k = topk_weights.shape
    fused = fused.cpu()
    if fused.dim() == 2:
        fused = fused.view(m, k, fused.shape[-1])
    if not apply_router_weight_on_input:
        fused.mul_(topk_weights.cpu().view(m, -1, 1))
    return fused.to(torch.float32).sum(dim=1).to(torch.bfloat16)


def _ll_experts(rank, L):
    """The BatchedExperts-format experts: [L, R*T_max, H], expert l's first recv_count[l] rows
    computed, the rest left as the workspace had them (NaN here: combine must not read them)."""
    def run(a1q, a1q_scale, meta, topk_ids, topk_weights):
        nl, rows, hidden = a1q.shape
        out = torch.full((nl, rows, hidden), float("nan"), dtype=torch.bfloat16)
        for l, n in enumerate(meta.expert_num_tokens.cpu().tolist()):
            if n:
                s = None if a1q_scale is None else a1q_scale[l, :n]
                out[l, :n] = (_dequant(a1q[l, :n], s) * _coef(rank * L + l)).to(torch.bfloat16)
        return out.to(a1q.device)
    return run


class _ExpertTokensMetadata:
    """modular_kernel.ExpertTokensMetadata."""

    def __init__(self, expert_num_tokens, expert_num_tokens_cpu):
        self.expert_num_tokens = expert_num_tokens
        self.expert_num_tokens_cpu = expert_num_tokens_cpu

    @staticmethod
    def make_from_list(expert_num_tokens_list, device):
        cpu = torch.tensor(expert_num_tokens_list, device="cpu", dtype=torch.int32,
                           pin_memory=torch.device(device).type == "cuda")
        return _ExpertTokensMetadata(cpu.to(device, non_blocking=True), cpu)


def _hook_then_receiver(ret):
    """What FusedMoEModularKernel does with an async prepare's or finalize's result (a receiver,
    or (hook, receiver)): the hook runs at once, or under DBO is registered for the other
    micro-batch, which runs while this one yields. Returns the receiver."""
    hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
    if hook is not None:
        if _dbo_enabled():
            _dbo_register_recv_hook(hook)
            _dbo_yield()
        else:
            hook()
    return receiver


def _moe_layer(pf, experts, hidden_states, topk_weights, topk_ids, num_experts,
               apply_router_weight_on_input, finalize_async, on_prepared):
    """FusedMoEModularKernel.apply with an async-capable prepare/finalize: _prepare (hook at once,
    or registered to the other micro-batch under DBO), the experts, _finalize. `finalize_async`
    False calls the class's synchronous finalize() instead (what direct callers and older vLLM
    releases use). on_prepared(receiver's result) checks what prepare delivered."""
    output = torch.full_like(hidden_states, float("nan"))  # torch.empty_like in vLLM
    _dbo_maybe_run_recv_hook()
    prepared = _hook_then_receiver(pf.prepare_async(hidden_states, topk_weights, topk_ids,
                                                    num_experts, apply_router_weight_on_input))()
    on_prepared(prepared)
    a1q, a1q_scale, meta, expert_ids, expert_weights = prepared
    ids = topk_ids if expert_ids is None else expert_ids
    weights = topk_weights if expert_weights is None else expert_weights
    fused_out = experts(a1q, a1q_scale, meta, ids, weights)
    if finalize_async:
        ret = pf.finalize_async(output, fused_out, weights, ids, apply_router_weight_on_input)
        # The experts' workspace is reused before the combine's hook runs (the shared experts
        # overlap it; under DBO the other micro-batch's experts run first): the low-latency send
        # half must not have left anything behind in it (the normal-mode combine was given the
        # weighted copy, so this changes nothing there).
        fused_out.fill_(float("nan"))
        _hook_then_receiver(ret)()
    else:
        pf.finalize(output, fused_out, weights, ids, apply_router_weight_on_input)
    return output


class _Finalizes:
    """finalize_async / finalize of both DeepEP prepare-finalize classes: the class's _finalize,
    asynchronous (returns the receiver) or not."""

    def finalize_async(self, output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input):
        return self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                              apply_router_weight_on_input, True)

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                 apply_router_weight_on_input):
        self._finalize(output, fused_expert_output, topk_weights, topk_ids,
                       apply_router_weight_on_input, False)


# ==== DeepEPHTPrepareAndFinalize (prepare_finalize/deepep_ht.py) ================================

class _VllmHt(_Finalizes):
    def __init__(self, deep_ep, buffer, num_dispatchers, rank_expert_offset, quant):
        self.deep_ep = deep_ep
        self.buffer = buffer
        self.num_dispatchers_ = num_dispatchers
        self.rank_expert_offset = rank_expert_offset
        self.quant = quant            # block fp8: the pre-dispatch quantiser, else None
        self.async_prepare = True
        self.handles = [None, None]   # one per DBO micro-batch
        self.raw = [None, None]       # what the dispatch returned (for the checks)
        self.sent = [None, None]      # what it was given (kept alive; see _do_dispatch)

    def _get_dispatch_config(self):
        if self.num_dispatchers_ not in AVAILABLE_RANK_CONFIGS:
            return None
        return self.deep_ep.Buffer.get_dispatch_config(self.num_dispatchers_)

    def _get_combine_config(self):
        if self.num_dispatchers_ not in AVAILABLE_RANK_CONFIGS:
            return None
        return self.deep_ep.Buffer.get_combine_config(self.num_dispatchers_)

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input):
        if apply_router_weight_on_input:
            assert topk_ids.size(1) == 1
            a1 = a1 * topk_weights.to(a1.dtype)
        if self.quant is not None:  # block-quantised: DeepEP moves fp8 with its block scales
            a1q, a1q_scale = self.quant(a1)
        else:                       # dispatched in bf16 (quantised after, if at all)
            a1q, a1q_scale = a1, None
        return self._do_dispatch(a1q, a1q_scale, topk_ids, topk_weights, num_experts)

    def _do_dispatch(self, tokens, token_scales, rank_topk_ids, rank_topk_weights, num_experts):
        has_scales = token_scales is not None
        previous_event = _dbo_get_previous_event(self.buffer.capture)
        _dbo_yield_and_switch_from_compute_to_comm()
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens,
         is_token_in_rank, event) = self.buffer.get_dispatch_layout(
            topk_idx=rank_topk_ids, num_experts=num_experts, previous_event=previous_event,
            async_finish=False, allocate_on_comm_stream=False)
        token_data = (tokens, token_scales) if has_scales else tokens
        out = self.buffer.dispatch(
            x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=rank_topk_ids,
            topk_weights=rank_topk_weights, expert_alignment=1,
            config=self._get_dispatch_config(), previous_event=previous_event,
            async_finish=self.async_prepare and not _dbo_enabled(),
            allocate_on_comm_stream=False)
        token_data, expert_topk_ids, expert_topk_weights, num_list, handle, event = out
        ub = _dbo_current_ubatch_id()
        self.handles[ub] = handle
        self.raw[ub] = out
        # (Test harness, not vLLM: under DBO on CUDA the inputs were made on the shared compute
        # stream and are read on the comm stream; held until the next dispatch of this
        # micro-batch so that the other micro-batch's allocations cannot reuse them early.)
        self.sent[ub] = (tokens, token_scales, rank_topk_ids, rank_topk_weights)
        _dbo_switch_to_compute_sync()
        return lambda: self._receiver(event, has_scales, token_data, expert_topk_ids,
                                      num_experts, num_list, expert_topk_weights)

    def _receiver(self, event, has_scales, token_data, expert_topk_ids, num_experts, num_list,
                  expert_topk_weights):
        if event.event is not None:
            event.current_stream_wait()
        expert_x, expert_x_scale = token_data if has_scales else (token_data, None)
        # -1 (an expert of another rank) -> an expert vLLM's expert_map knows is not local;
        # DeepEP's local ids -> global ids.
        expert_topk_ids = torch.where(expert_topk_ids == -1,
                                      num_experts - 1 if self.rank_expert_offset == 0 else 0,
                                      expert_topk_ids + self.rank_expert_offset)
        meta = _ExpertTokensMetadata.make_from_list(num_list, expert_x.device)
        return expert_x, expert_x_scale, meta, expert_topk_ids, expert_topk_weights

    def _finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                  apply_router_weight_on_input, do_async):
        handle = self.handles[_dbo_current_ubatch_id()]
        assert handle is not None
        if fused_expert_output.numel() != 0:  # some rows were received
            fused_expert_output = _weight_and_reduce(
                fused_expert_output, topk_weights, apply_router_weight_on_input).to(output.device)
        previous_event = _dbo_get_previous_event(self.buffer.capture)
        _dbo_yield_and_switch_from_compute_to_comm()
        assert fused_expert_output.dtype == torch.bfloat16
        combined_x, _, event = self.buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None,
            config=self._get_combine_config(), previous_event=previous_event,
            async_finish=do_async and not _dbo_enabled(), allocate_on_comm_stream=False)
        _dbo_switch_to_compute()
        if do_async:
            # (Test harness: the combine's input is held until the compute stream waited for
            # the comm stream, as the dispatch's inputs are.)
            held = fused_expert_output

            def receiver():
                nonlocal held
                if event.event is not None:
                    event.current_stream_wait()
                _dbo_switch_to_comm()
                output.copy_(combined_x, non_blocking=True)
                _dbo_yield_and_switch_from_comm_to_compute()
                held = None
            return receiver
        assert not _dbo_enabled()
        output.copy_(combined_x, non_blocking=True)
        return None


# ==== DeepEPLLPrepareAndFinalize (prepare_finalize/deepep_ll.py) ================================

class _VllmLl(_Finalizes):
    def __init__(self, buffer, max_tokens_per_rank, num_dispatchers, use_fp8_dispatch,
                 use_ue8m0_dispatch):
        self.buffer = buffer
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_dispatchers_ = num_dispatchers
        self.use_fp8_dispatch = use_fp8_dispatch
        # post_init_setup: experts that take packed UE8M0 scales (DeepGEMM on Blackwell).
        self.use_ue8m0_dispatch = use_ue8m0_dispatch
        self.handles = [None, None]
        self.raw = [None, None]

    def prepare_async(self, a1, topk_weights, topk_ids, num_experts, apply_router_weight_on_input):
        hidden_size = a1.size(1)
        assert hidden_size in LL_SUPPORTED_HIDDEN_SIZES
        ub = _dbo_current_ubatch_id()
        if self.use_fp8_dispatch:
            assert hidden_size % 128 == 0
        if apply_router_weight_on_input:
            assert topk_ids.size(1) == 1
            a1 = a1 * topk_weights.to(a1.dtype)
        expert_x, expert_num_tokens, handle, event, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens_per_rank, num_experts,
            use_fp8=self.use_fp8_dispatch, round_scale=self.use_ue8m0_dispatch,
            use_ue8m0=self.use_ue8m0_dispatch, async_finish=False, return_recv_hook=True)
        self.handles[ub] = handle
        self.raw[ub] = (expert_x, expert_num_tokens, handle, event, hook)
        return hook, lambda: self._receiver(expert_x, expert_num_tokens)

    def _do_quant(self, x):
        if self.use_fp8_dispatch:  # 128-blocks: DeepEP quantised them already
            x, x_scales = x
            return x, x_scales
        # Unquantised model (quant_dtype None): moe_kernel_quantize_input returns x as it is,
        # seen through vLLM's [-1, H] view and back.
        num_experts, max_tokens, hidden_dim = x.size()
        x = x.view((-1, hidden_dim))
        return x.view((num_experts, -1, hidden_dim)), None

    def _receiver(self, expert_x, expert_num_tokens):
        expert_x, expert_x_scale = self._do_quant(expert_x)
        meta = _ExpertTokensMetadata(expert_num_tokens, None)
        return expert_x, expert_x_scale, meta, None, None

    def _finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                  apply_router_weight_on_input, do_async):
        handle = self.handles[_dbo_current_ubatch_id()]
        assert handle is not None
        do_recv_hook = _dbo_enabled() or do_async
        combine_topk_weights = topk_weights
        if apply_router_weight_on_input:  # applied before the dispatch already
            combine_topk_weights = torch.ones_like(topk_weights)
        _dbo_maybe_run_recv_hook()
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output, topk_ids, combine_topk_weights, handle, async_finish=False,
            zero_copy=False, return_recv_hook=do_recv_hook, out=output)
        assert (recv_hook is not None) == do_recv_hook
        return recv_hook, lambda: None


# ==== inputs and references =====================================================================

# (name, top-k, fp8 128-block quantisation before the dispatch, power-of-two scales,
#  apply_router_weight_on_input)
HT_MODELS = (
    ("bf16", 8, False, False, False),
    ("fp8-block", 8, True, False, False),
    ("fp8-block-pow2-scales", 8, True, True, False),  # with DeepGEMM's E8M0 (use_ue8m0)
    ("bf16-top1-weight-on-input", 1, False, False, True),
)

# (name, top-k, use_fp8_dispatch, use_ue8m0 (round_scale too), apply_router_weight_on_input,
#  enable_fault_tolerance)
LL_MODELS = (
    ("bf16-fault-tolerance", 8, False, False, False, True),
    ("fp8-block", 8, True, False, False, False),
    ("fp8-block-ue8m0", 8, True, True, False, False),
    ("bf16-top1-weight-on-input", 1, False, False, True, False),
)


def _tokens(seed, step, R, cap):
    """Tokens per rank in one step (every MoE layer of the step sees them): uneven; in step 1
    rank 0 runs vLLM's one-token dummy batch (an idle DP rank) and, with R > 1, the last rank
    has none."""
    def of(s):
        if step == 1 and s == R - 1 and R > 1:
            return 0
        if step == 1 and s == 0:
            return 1
        return 2 + (seed + 7 * s + 13 * step) % (cap - 1)
    return of


def _layer_inputs(seed, salt, R, E, K, T_of, H, drop, apply_router_weight_on_input, quant=None):
    """Every rank's hidden states, router output (top-k of distinct experts, `drop` of the slots
    -1) and what it dispatches (x: a1 after apply_router_weight_on_input, and for block fp8 its
    bits and scales)."""
    out = []
    for s in range(R):
        g = ref.generator(seed, *salt, s)
        T = T_of(s)
        hidden = ref.rand_bf16((T, H), g, scale=2.0)
        inp = dict(hidden=hidden, topk_idx=ref.routing("uniform", T, K, E, R, g, drop=drop),
                   topk_weights=ref.rand_weights(T, K, g))
        a1 = hidden * inp["topk_weights"].to(torch.bfloat16) if apply_router_weight_on_input \
            else hidden
        inp["x"] = a1
        if quant is not None:
            inp["x"], inp["scales"] = quant(a1)
        out.append(inp)
    return out


def _block_fp8_quantiser(pow2, device):
    """per_token_group_quant_fp8(a1, 128) (`pow2`: with DeepGEMM's E8M0, scales rounded up to
    powers of two): e4m3 rows and row-major float32 scales [T, H/128], as vLLM hands them to
    dispatch(x=(x, scales)). CPU half for the reference, device half for the replay."""
    def cpu(a1):
        return ref.quantize_fp8(a1.cpu(), round_scale=pow2)

    def dev(a1):
        q, s = cpu(a1)
        q = q.to(device)
        if epx.has_fp8_dtype:
            q = q.view(epx.fp8_dtype)
        return q, s.to(device)
    return cpu, dev


def _ht_remap(recv_topk_idx, rank, L, E):
    """The receiver's id rewrite, on the reference's ids."""
    return torch.where(recv_topk_idx == -1, torch.full_like(recv_topk_idx, E - 1 if rank == 0
                                                            else 0), recv_topk_idx + rank * L)


def _ht_reference_y(want, d, L, E, apply_router_weight_on_input):
    """Rank d's combine input from its reference receive: the experts, then the reduction."""
    M = want["recv_x"].shape[0]
    if M == 0:
        return torch.empty(0, HT_H, dtype=torch.bfloat16)
    fused = _ht_experts(d, L, E)(want["recv_x"], want["recv_scales"], None,
                                 _ht_remap(want["recv_topk_idx"], d, L, E), None)
    return _weight_and_reduce(fused, want["recv_topk_weights"], apply_router_weight_on_input)


def _ll_reference_y(inputs, d, E, R, T_max, use_fp8, round_scale):
    """Rank d's combine input from its reference receive (rows past the count: 0, never read)."""
    L = E // R
    y = torch.zeros(L, R * T_max, LL_H, dtype=torch.bfloat16)
    for l, w in enumerate(ref.ll_dispatch(inputs, d, E, R, T_max, use_fp8, round_scale)):
        if w["count"]:
            y[l, :w["count"]] = (_dequant(w["x"], w["scales"] if use_fp8 else None) *
                                 _coef(d * L + l)).to(torch.bfloat16)
    return y


# ==== one MoE layer, checked =====================================================================

def _ht_layer(ctx, pf, inputs, E, model, finalize_async, what):
    """One MoE layer through DeepEPHTPrepareAndFinalize; every output checked."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    L = E // R
    _, _, fp8, _, on_input = model
    mine = inputs[r]
    ref_inputs = [dict(x=inp["x"], topk_idx=inp["topk_idx"],
                       topk_weights=inp["topk_weights"],
                       **({"scales": inp["scales"]} if fp8 else {})) for inp in inputs]
    ub = _dbo_current_ubatch_id()

    def on_prepared(prepared):
        raw = pf.raw[ub]
        want = ht._check_recv(ctx, ref_inputs, raw, E, 1, what)
        expert_x, expert_x_scale, meta, expert_ids, expert_weights = prepared
        assert expert_x is (raw[0][0] if fp8 else raw[0]), what
        assert expert_x_scale is (raw[0][1] if fp8 else None), what
        assert expert_weights is raw[2], what
        assert torch.equal(expert_ids.cpu(), _ht_remap(want["recv_topk_idx"], r, L, E)), what

    output = _moe_layer(pf, _ht_experts(r, L, E), mine["hidden"].to(dev),
                        mine["topk_weights"].to(dev), mine["topk_idx"].to(dev), E, on_input,
                        finalize_async, on_prepared)
    ys = [_ht_reference_y(ref.ht_dispatch(ref_inputs, d, E, R), d, L, E, on_input)
          for d in range(R)]
    want = ref.ht_combine(ref_inputs, ys, r, E, R)
    assert output.dtype == torch.bfloat16 and output.shape == mine["hidden"].shape, what
    assert torch.equal(output.cpu(), want), what + " (layer output)"


def _ll_layer(ctx, pf, inputs, E, model, finalize_async, what):
    """One MoE layer through DeepEPLLPrepareAndFinalize; every output checked."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    L = E // R
    _, _, use_fp8, ue8m0, on_input, _ = model
    mine = inputs[r]
    # What combine weighs with: the router's weights, or ones where they went in before.
    ref_inputs = [dict(x=inp["x"], topk_idx=inp["topk_idx"],
                       topk_weights=torch.ones_like(inp["topk_weights"]) if on_input else
                       inp["topk_weights"]) for inp in inputs]
    ub = _dbo_current_ubatch_id()

    def on_prepared(prepared):
        raw = pf.raw[ub]
        with _ll_hidden(LL_H):
            ll._check_dispatch(ctx, ref_inputs, raw, E, LL_T_MAX, use_fp8, ue8m0, ue8m0, what)
        expert_x, expert_x_scale, meta, expert_ids, expert_weights = prepared
        recv = raw[0][0] if use_fp8 else raw[0]
        assert expert_x.data_ptr() == recv.data_ptr() and expert_x.shape == recv.shape, what
        assert expert_x_scale is (raw[0][1] if use_fp8 else None), what
        assert meta.expert_num_tokens is raw[1] and meta.expert_num_tokens_cpu is None, what
        assert expert_ids is None and expert_weights is None, what

    output = _moe_layer(pf, _ll_experts(r, L), mine["hidden"].to(dev),
                        mine["topk_weights"].to(dev), mine["topk_idx"].to(dev), E, on_input,
                        finalize_async, on_prepared)
    ys = [_ll_reference_y(ref_inputs, d, E, R, LL_T_MAX, use_fp8, ue8m0) for d in range(R)]
    want = ref.ll_combine(ref_inputs, ys, r, E, R)
    assert output.dtype == torch.bfloat16 and output.shape == mine["hidden"].shape, what
    ll._assert_combined(output.cpu(), want, mine["topk_idx"], L, what + " (layer output)",
                        pf.buffer)


# ==== bodies =====================================================================================

def _ht_setup(ctx, deep_ep, model):
    """maybe_make_prepare_finalize for every MoE layer: get_handle({}) each time (one Buffer
    from the Cache), one DeepEPHTPrepareAndFinalize per layer."""
    R, r = ctx.world_size, ctx.rank
    E = _num_experts(R)
    L = E // R
    manager = _HtManager(deep_ep, _cpu_group(ctx), R, r)
    quant = _block_fp8_quantiser(model[3], ctx.device)[1] if model[2] else None
    pfs = [_VllmHt(deep_ep, manager.get_handle({}), R, r * L, quant) for _ in range(NUM_LAYERS)]
    buffer = pfs[0].buffer
    assert all(pf.buffer is buffer for pf in pfs)
    assert (buffer.low_latency_mode, buffer.num_qps_per_rank, buffer.explicitly_destroy) == \
        (False, 1, True)
    assert (buffer.num_nvl_bytes, buffer.num_rdma_bytes) == (BUFFER_SIZE_MB << 20, 0)
    return manager, pfs, E


def _ht_inputs(ctx, seed, salt, E, model, T_of, drop):
    R = ctx.world_size
    quant = _block_fp8_quantiser(model[3], ctx.device)[0] if model[2] else None
    return _layer_inputs(seed, salt, R, E, model[1], T_of, HT_H, drop, model[4], quant)


def _destroyed_raises(buffer, dev):
    with pytest.raises(epx.InvalidArgument, match="destroyed"):
        buffer.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64, device=dev), 16)


def body_ht(ctx, seed):
    """Steps x MoE layers of each HT model; layers alternate finalize_async (the modular
    kernel's) and finalize."""
    deep_ep = _import_deep_ep()
    R = ctx.world_size
    try:
        for mi, model in enumerate(HT_MODELS):
            manager, pfs, E = _ht_setup(ctx, deep_ep, model)
            for step in range(3 if mi == 0 else 2):  # step 2: the first model only (time)
                T_of = _tokens(seed + mi, step, R, 40)
                for layer in range(NUM_LAYERS):
                    what = (f"seed={seed} model={model[0]} step={step} layer={layer} "
                            f"T={[T_of(s) for s in range(R)]}")
                    inputs = _ht_inputs(ctx, seed, ("ht", mi, step, layer), E, model, T_of,
                                        0.1 if layer == 1 else 0.0)
                    _ht_layer(ctx, pfs[layer], inputs, E, model, layer % 2 == 0 or step == 2,
                              what)
            buffer = pfs[0].buffer
            manager.destroy()
            _destroyed_raises(buffer, ctx.device)
    finally:
        compat_deep_ep.Buffer.set_num_sms(DEEPEP_NUM_SMS)


def _ll_setup(ctx, deep_ep, model):
    R, r = ctx.world_size, ctx.rank
    E = _num_experts(R)
    L = E // R
    manager = _LlManager(deep_ep, _cpu_group(ctx), R, r, ctx.device, model[5])
    args = dict(max_num_tokens_per_dp_rank=LL_T_MAX, token_hidden_size=LL_H, num_ep_ranks=R,
                num_global_experts=E, num_local_experts=E // R)
    pfs = [_VllmLl(manager.get_handle(dict(args)), LL_T_MAX, R, model[2], model[3])
           for _ in range(NUM_LAYERS)]
    buffer = pfs[0].buffer
    assert all(pf.buffer is buffer for pf in pfs) and manager.buffer is buffer
    assert (buffer.low_latency_mode, buffer.num_qps_per_rank, buffer.explicitly_destroy,
            buffer.allow_nvlink_for_low_latency_mode, buffer.allow_mnnvl,
            buffer.enable_shrink) == (True, L, True, True, False, model[5])
    assert buffer.num_rdma_bytes == deep_ep.Buffer.get_low_latency_rdma_size_hint(
        LL_T_MAX, LL_H, R, E)
    assert manager.max_sms_used() == 0
    return manager, pfs, E


def _ll_inputs(ctx, seed, salt, E, model, T_of, drop):
    return _layer_inputs(seed, salt, ctx.world_size, E, model[1], T_of, LL_H, drop, model[4])


def body_ll(ctx, seed):
    """Steps x MoE layers of each LL model; layers alternate finalize_async (hooked combine)
    and finalize (plain combine); the fault-tolerance model queries the rank mask after every
    step and runs clean_buffers before a third step."""
    deep_ep = _import_deep_ep()
    R = ctx.world_size
    for mi, model in enumerate(LL_MODELS):
        manager, pfs, E = _ll_setup(ctx, deep_ep, model)
        for step in range(3 if model[5] else 2):  # step 2: after the fault-tolerance clean
            T_of = _tokens(seed + mi, step, R, LL_T_MAX)
            if model[5] and step == 2:
                manager.clean_buffers()  # the fault-tolerance retry's clean, then carry on
            for layer in range(NUM_LAYERS):
                what = (f"seed={seed} model={model[0]} step={step} layer={layer} "
                        f"T={[T_of(s) for s in range(R)]}")
                inputs = _ll_inputs(ctx, seed, ("ll", mi, step, layer), E, model, T_of,
                                    0.1 if layer == 1 else 0.0)
                _ll_layer(ctx, pfs[layer], inputs, E, model, layer % 2 == 0 or step == 2, what)
            if model[5]:
                assert not bool(manager.query_fault()), f"seed={seed} step={step}"
                assert manager.query_active_mask().cpu().tolist() == [0] * R
        buffer = pfs[0].buffer
        manager.destroy()
        with pytest.raises(epx.InvalidArgument, match="destroyed"):
            buffer.low_latency_dispatch(torch.zeros(1, LL_H, dtype=torch.bfloat16,
                                                    device=ctx.device),
                                        torch.zeros(1, 1, dtype=torch.int64, device=ctx.device),
                                        LL_T_MAX, E)


FAULT_TIMEOUT_S = 1.0  # the epx group's timeout in the fault-tolerance retry: what the fault costs


def body_ll_retry_after_fault(ctx, seed):
    """vLLM's fault-tolerance retry after a real fault (enable_fault_tolerance): one step of the
    fault-tolerance model on every rank; then the last rank stalls through a step, whose
    dispatch on the other ranks waits one group timeout for it and masks it (query_fault()
    true, the mask exactly that rank, no exception); then, after a barrier (the retry command
    reaches every worker), every rank runs the retry's clean_buffers (zero DeepEP's raw RDMA
    buffer, low_latency_clean_mask_buffer) and the next step on every rank is exact again, every
    output checked, with no rank masked and no fault seen."""
    deep_ep = _import_deep_ep()
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    model = LL_MODELS[0]
    assert model[5]  # the fault-tolerance model
    stalled = R - 1
    saved = os.environ.get("EPX_TIMEOUT_MS")
    os.environ["EPX_TIMEOUT_MS"] = str(int(FAULT_TIMEOUT_S * 1000))
    try:
        manager, pfs, E = _ll_setup(ctx, deep_ep, model)

        def step(n):
            T_of = _tokens(seed, n, R, LL_T_MAX)
            for layer in range(NUM_LAYERS):
                what = f"seed={seed} step={n} layer={layer} T={[T_of(s) for s in range(R)]}"
                inputs = _ll_inputs(ctx, seed, ("ft", n, layer), E, model, T_of, 0.0)
                _ll_layer(ctx, pfs[layer], inputs, E, model, layer % 2 == 0, what)
            assert not bool(manager.query_fault()), f"seed={seed} step={n}"
            assert manager.query_active_mask().cpu().tolist() == [0] * R

        step(0)  # creates the low-latency buffer (collectively) with the short timeout
    finally:
        if saved is None:
            del os.environ["EPX_TIMEOUT_MS"]
        else:
            os.environ["EPX_TIMEOUT_MS"] = saved
    buffer = manager.buffer
    if r != stalled:  # the fault: the other ranks' next call finds the stalled rank absent
        T = 3
        x = torch.ones(T, LL_H, dtype=torch.bfloat16, device=dev)
        topk = torch.arange(T * model[1], dtype=torch.int64).view(T, model[1]) % E
        t0 = time.monotonic()
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk.to(dev), LL_T_MAX, E,
                                                            use_fp8=False)
        buffer.low_latency_combine(recv, topk.to(dev), torch.ones(T, model[1], device=dev),
                                   handle)
        took = time.monotonic() - t0
        assert 0.9 * FAULT_TIMEOUT_S <= took < 2 * FAULT_TIMEOUT_S + 5, took
        assert bool(manager.query_fault()), f"seed={seed}: the stalled rank was not masked"
        assert manager.query_active_mask().cpu().tolist() == [int(p == stalled)
                                                              for p in range(R)]
    dist.barrier(group=ctx.group)  # the retry reaches every worker
    manager.clean_buffers()
    step(1)  # every rank again, exact
    step(2)
    manager.destroy()


@pytest.mark.parametrize("R", [2, 4, 8])
def test_vllm_ll_retry_after_fault(R):
    get_pool(R).run(body_ll_retry_after_fault, _seed())


def _split(T_of, u):
    """Micro-batch u's share of a step's tokens (vLLM splits a batch into two halves, both
    non-empty under DBO)."""
    def of(s):
        T = max(T_of(s), 2)
        return (T + 1) // 2 if u == 0 else T // 2
    return of


def body_ht_dbo(ctx, seed):
    """HT under dual-batch overlap, bf16 and block-fp8 models: steps with DBO
    (SMControlContextManager around them: set_num_sms(VLLM_DBO_COMM_SMS) on entry,
    set_num_sms(all SMs) on exit) and a step without (a batch too small to split, with the
    dummy and empty ranks), on one Buffer."""
    deep_ep = _import_deep_ep()
    R, dev = ctx.world_size, ctx.device
    try:
        for model in HT_MODELS[:2]:
            manager, pfs, E = _ht_setup(ctx, deep_ep, model)
            for step, dbo in enumerate((True, False, True)):
                T_of = _tokens(seed + step, 0 if dbo else 1, R, 40)
                if not dbo:
                    for layer in range(NUM_LAYERS):
                        inputs = _ht_inputs(ctx, seed, ("htdbo", model[0], step, layer, 0), E,
                                            model, T_of, 0.1)
                        _ht_layer(ctx, pfs[layer], inputs, E, model, True,
                                  f"seed={seed} model={model[0]} step={step} (no DBO) "
                                  f"layer={layer}")
                    continue
                manager.set_num_sms(DBO_COMM_SMS)  # SMControlContextManager.__enter__
                if R in AVAILABLE_RANK_CONFIGS:
                    assert deep_ep.Buffer.get_dispatch_config(R).num_sms == DBO_COMM_SMS

                def forward(u, model=model, step=step, T_of=T_of, pfs=pfs, E=E):
                    for layer in range(NUM_LAYERS):
                        what = (f"seed={seed} model={model[0]} step={step} ubatch={u} "
                                f"layer={layer}")
                        inputs = _ht_inputs(ctx, seed, ("htdbo", model[0], step, layer, u), E,
                                            model, _split(T_of, u), 0.1 if layer else 0.0)
                        _ht_layer(ctx, pfs[layer], inputs, E, model, True, what)

                _DualBatch(dev).run([lambda: forward(0), lambda: forward(1)])
                manager.set_num_sms(TOTAL_SMS)  # __exit__: capped back to DeepEP's 20
                assert deep_ep.Buffer.num_sms == DEEPEP_NUM_SMS
            manager.destroy()
    finally:
        compat_deep_ep.Buffer.set_num_sms(DEEPEP_NUM_SMS)


def body_ll_dbo(ctx, seed):
    """LL under dual-batch overlap: each micro-batch's dispatch hook runs in the other
    micro-batch (dbo_maybe_run_recv_hook), combines hooked; steps with and without DBO."""
    deep_ep = _import_deep_ep()
    R, dev = ctx.world_size, ctx.device
    model = LL_MODELS[1 + seed % 2]  # fp8, with or without UE8M0
    manager, pfs, E = _ll_setup(ctx, deep_ep, model)
    for step, dbo in enumerate((True, False, True)):
        T_of = _tokens(seed + step, 0 if dbo else 1, R, LL_T_MAX)
        if not dbo:
            for layer in range(NUM_LAYERS):
                inputs = _ll_inputs(ctx, seed, ("lldbo", step, layer, 0), E, model, T_of, 0.1)
                _ll_layer(ctx, pfs[layer], inputs, E, model, True,
                          f"seed={seed} model={model[0]} step={step} (no DBO) layer={layer}")
            continue

        def forward(u, step=step, T_of=T_of):
            for layer in range(NUM_LAYERS):
                what = f"seed={seed} model={model[0]} step={step} ubatch={u} layer={layer}"
                inputs = _ll_inputs(ctx, seed, ("lldbo", step, layer, u), E, model,
                                    _split(T_of, u), 0.1 if layer else 0.0)
                _ll_layer(ctx, pfs[layer], inputs, E, model, True, what)

        _DualBatch(dev).run([lambda: forward(0), lambda: forward(1)])
    manager.destroy()


# ==== tests ======================================================================================

@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def vpool(request):
    """The CPU pools: R = 1, 2, 4, 8."""
    return get_pool(request.param)


def test_vllm_ht_prepare_finalize(vpool):
    vpool.run(body_ht, _seed())


def test_vllm_ll_prepare_finalize(vpool):
    vpool.run(body_ll, _seed())


def test_vllm_ht_dual_batch_overlap(vpool):
    vpool.run(body_ht_dbo, _seed())


def test_vllm_ll_dual_batch_overlap(vpool):
    vpool.run(body_ll_dbo, _seed())


def body_inference_mode(ctx, seed, body):
    """vLLM's model runner serves under torch.inference_mode(): the whole sequence (the Buffer's
    lazy creation and its agreement exchanges included) inside it."""
    with torch.inference_mode():
        return body(ctx, seed)


@pytest.mark.parametrize("body", [body_ht, body_ll], ids=["ht", "ll"])
def test_vllm_inference_mode(vpool, body):
    vpool.run(body_inference_mode, _seed(), body)


# ---- GPU twins: the same bodies with CUDA tensors (NCCL pools, one GPU per rank; the Buffer
# gets a gloo group, as vLLM's cpu_group) ----------------------------------------------------

GPU_BODIES = [body_ht, body_ll, body_ht_dbo, body_ll_dbo]


@pytest.mark.gpu
@pytest.mark.parametrize("body", GPU_BODIES, ids=[b.__name__ for b in GPU_BODIES])
def test_gpu_vllm(body, gpu_pool):
    gpu_pool.run(body, _seed())
