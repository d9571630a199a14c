"""Conformance tier: PyTorch torchtitan's DeepEP integration, replayed on epx's drop-in.

torchtitan (github.com/pytorch/torchtitan, read at b5bcd76) reached DeepEP's V1 Buffer from
36a4b69 (#2107, December 2025) until 756213e (#3808, June 2026), which moved it to DeepEP v2's
ElasticBuffer (an API epx does not offer; not replayed). Three states of that V1 integration and
an unmerged PR's variant are replayed here call for call and keyword for keyword (in this file's
own code), as "flavors", on the rank pools of conftest.py (cpu backend over gloo, R = 1, 2, 4, 8;
the `gpu` twins at the bottom run the same bodies with CUDA tensors over NCCL):

  * "2025-12" (36a4b69): torchtitan/distributed/deepep/deepep.py's import block (``from deep_ep
    import Buffer`` + ``from deep_ep.utils import EventHandle, EventOverlap``, here through the
    shim directory); get_hidden_bytes; get_buffer (num_nvl_bytes / num_rdma_bytes the max of
    Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint over Buffer.get_dispatch_config /
    get_combine_config(group.size()); a new positional ``Buffer(group, num_nvl_bytes,
    num_rdma_bytes)`` when there is none or its ``group`` differs or its byte sizes are smaller);
    dispatch_tokens (topk_idx masked to -1 where the score is 0, float32 scores,
    ``get_dispatch_layout(topk_idx=, num_experts=)``, the ``deepep::dispatch`` op:
    ``dispatch(x=, topk_idx=, topk_weights=, num_tokens_per_rank=, num_tokens_per_rdma_rank=,
    is_token_in_rank=, num_tokens_per_expert=, previous_event=EventOverlap(EventHandle()),
    async_finish=True, allocate_on_comm_stream=True)``, ``current_stream_wait()`` on its event, the
    handle cached under a CPU int64 id, the per-expert list as an int32 CPU tensor); the
    multihot permutation (_indices_to_multihot, _permute_tokens by masked_select, tokens per
    expert from the routing map); score_before_experts; combine_tokens (the ``deepep::combine``
    op: ``combine(x=, handle=, previous_event=, async_finish=True, allocate_on_comm_stream=True)``
    and an immediate wait); the registered autograd: dispatch's backward a
    ``combine(x=grad, handle=, topk_weights=grad_scores.float(), previous_event=,
    async_finish=True, allocate_on_comm_stream=True)`` whose outputs are cast to x's dtype (so the
    scores' gradient is rounded to bf16), combine's backward the cached ``dispatch(x=grad,
    topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
    is_token_in_rank=None, num_tokens_per_expert=None, handle=, previous_event=, async_finish=True,
    allocate_on_comm_stream=True)``; the handle cache's life cycle of that version. Driven by
    models/moe/moe_deepep.py's DeepEPMoE.forward and expert_parallel.py's DeepEPExpertParallel
    (_token_dispatch / _token_combine around GroupedExperts).
  * "2026-02" (e215f4f .. 09ea7d8^): the same calls with the argsort permutation
    (_permute_tokens / _unpermute_tokens), tokens per expert from the dispatch's list, the handle
    saved by dispatch's setup_context and popped by combine's, the inference-mode pop in the
    combine op, and the deferred combine wait (the op keeps the EventOverlap; DeepEPMoE.forward
    runs the shared experts, then sync_combine()). score_before_experts True and False (per
    layer here).
  * "2026-06" (b5852826 .. 756213e^): models/common/token_dispatcher.py's DeepEPTokenDispatcher
    (num_local_experts = num_experts // group.size(), scores applied after the experts in
    combine_tokens, sync_combine in MoE.forward when sp_size == 1) and deepep.py's import block
    of that time, ``from deep_ep import Buffer, EventHandle, EventOverlap`` (DeepEP >= 2.0 keeps
    the V1 Buffer as deep_ep.Buffer and exports both event names at the top level, README; its
    deep_ep.utils no longer has EventOverlap).
  * "pr2500" (torchtitan PR #2500's branch, unmerged, which carries
    torchtitan/distributed/deepep/README.md): deepep/fused_a2a.py (FusedDispatch /
    FusedCombine: get_buffer inside, ``get_dispatch_layout(topk_idx, num_experts,
    previous_event=, async_finish=, allocate_on_comm_stream=)``, ``dispatch(x, topk_idx=, ...,
    previous_event=<the layout's event>, async_finish=, allocate_on_comm_stream=,
    num_worst_tokens=0)``, tokens per expert as ``torch.tensor(list, device=x.device)``, the
    backward combine with ``topk_weights=grad.float()`` returned in float32, the cached dispatch
    in combine's backward, set_deepep_num_sms -> ``Buffer.set_num_sms(128)``, and on GPU the
    optional _sync_comm_stream through ``get_comm_stream()``) driven by deepep/utils.py's
    DeepEPTokenDispatcher / PrimusTurboDeepepManager as its unit tests drive it (its tuned
    ``Config(128, 18, 512, 8, 128)`` / ``Config(128, 16, 256, 8, 128)``, made and kept, never
    passed; the multihot permutation padded to ALIGNMENT_M = 8 rows per expert).

The model around them: a stack of MoE blocks (h + moe(h), two layers), each with
TokenChoiceTopKRouter's routing (float32 gate; sigmoid; softmax with route_norm and route_scale,
whose exact-zero scores on spiky tokens exercise the -1 masking; debug_force_load_balance's
round-robin, the README's moe_force_load_balance; an expert_bias that leaves the last rank
without received tokens at R >= 4), GroupedExperts in bf16 (its for-loop form,
use_grouped_mm=False: torch._grouped_mm is torch 2.x / CUDA only; the same per-expert products)
and shared experts, fp32 master weights cast to bf16 as FSDP's mixed precision does. Runs:
two training steps with sign-SGD updates between them, uneven token counts, the second step
with a rank that has no tokens (R > 1; nothing in torchtitan forbids it), per flavor; the
documented inference path (a forward under torch.inference_mode() on a Buffer born there, a
training step, another inference forward); every block under full activation checkpointing
(torch.utils.checkpoint, non-reentrant, as torchtitan's full AC), which re-runs each block's
dispatch and combine inside the backward; EP subgroups of the world (torchtitan's EP mesh), then
the world, then get_buffer's reallocation rule for wider rows.

Two of these runs guard behaviour semantics.md §9 states: the 2026-06 import block needs
EventHandle at the top level of the shim's ``deep_ep``, and torch.inference_mode() needs the
drop-in's own exchanges over gloo (its agreement all-gather, the Group's creation) to run outside
inference mode.
"""

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

import epx.compat.deep_ep as epx_deep_ep
import epx.compat.shim as shim
import reference as ref
import test_conformance_megatron as megatron
import test_deep_ep_ht as ht
from conftest import deep_ep_shim_on_path, get_pool, gpu_skip_reason

# ---- deepep.py's import blocks, through the shim (README: the one-step opt-in) -----------------

with deep_ep_shim_on_path():
    import deep_ep  # the shim: epx's drop-in under DeepEP's name
    import deep_ep.utils
    try:  # 36a4b69 .. b5852826^: Buffer from deep_ep, the events from deep_ep.utils
        from deep_ep import Buffer
        from deep_ep.utils import EventHandle, EventOverlap
        UTILS_IMPORT_ERROR = None
    except ImportError as e:
        UTILS_IMPORT_ERROR = e
        Buffer, EventHandle, EventOverlap = deep_ep.Buffer, None, deep_ep.EventOverlap
    try:  # b5852826 (#3414, "Fix imports for latest DeepEP") .. 756213e^
        from deep_ep import Buffer as TopBuffer, EventHandle as TopEventHandle, \
            EventOverlap as TopEventOverlap
        TOP_IMPORT_ERROR = None
    except ImportError as e:
        TOP_IMPORT_ERROR = e
        TopBuffer = TopEventHandle = TopEventOverlap = None
    from deep_ep import Config as DeepEPConfig  # deepep/utils.py of PR #2500

D = 128          # model dim (hidden): get_hidden_bytes = 256
F_EXPERT = 32    # moe_inter_dim
F_SHARED = 32    # shared expert's hidden dim
K = 3            # top_k
B = 2            # local batch
NUM_LAYERS = 2
LR = 2.0 ** -6
ALIGNMENT_M = 8  # PR #2500's fused_indices_converter.ALIGNMENT_M
PR_NUM_SMS = 128  # PR #2500's DeepEPTokenDispatcher.turbo_deepep_num_cus
PR_DISPATCH_TUNED = (18, 512, 8, 128)
PR_COMBINE_TUNED = (16, 256, 8, 128)
VARIANTS = ("sigmoid", "softmax", "balanced", "biased")


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _num_experts(R):
    return max(4, 2 * R)


FLAVORS = {
    "2025-12": SimpleNamespace(name="2025-12", imports="utils", comm="ops", permute="multihot",
                               cache="2025-12", deferred=False, sbe=(False, True)),
    "2026-02": SimpleNamespace(name="2026-02", imports="utils", comm="ops", permute="argsort",
                               cache="2026", deferred=True, sbe=(True, False)),
    "2026-06": SimpleNamespace(name="2026-06", imports="top", comm="ops", permute="argsort",
                               cache="2026", deferred=True, sbe=(False, False)),
    "pr2500": SimpleNamespace(name="pr2500", imports="utils", comm="fused_a2a",
                              permute="padded", cache=None, deferred=False, sbe=(True, True)),
}


def _import_names(form):
    """(Buffer, EventHandle, EventOverlap) as the flavor's import block binds them."""
    if form == "top":
        if TOP_IMPORT_ERROR is not None:
            raise AssertionError(
                "torchtitan's deepep.py (b5852826 .. 756213e^) does `from deep_ep import Buffer, "
                "EventHandle, EventOverlap` (DeepEP >= 2.0's top-level names; deep_ep.utils there "
                f"has no EventOverlap); on epx's shim it fails: {TOP_IMPORT_ERROR!r}; torchtitan "
                "then raises 'DeepEP is required for this module'")
        return TopBuffer, TopEventHandle, TopEventOverlap
    if UTILS_IMPORT_ERROR is not None:
        raise AssertionError(f"`from deep_ep.utils import EventHandle, EventOverlap` fails on the "
                             f"shim: {UTILS_IMPORT_ERROR!r}")
    return Buffer, EventHandle, EventOverlap


# ---- the local parts (plain torch, CPU): one copy for the replay and the reference ---------------

def _router(x, gate, variant, num_experts, num_ranks):
    """TokenChoiceTopKRouter.forward: float32 gate (its autocast), score_func, expert_bias (for the
    choice only), topk (sorted=False), gather; 'softmax' with route_norm and route_scale 2.5;
    'balanced' = _debug_force_load_balance; 'biased': an expert_bias (aux-loss-free load
    balancing's buffer) of -2 on the last rank's experts, which then receives nothing where
    top_k <= the other ranks' experts. -> (top_scores float32 [T, K], indices int64 [T, K])."""
    scores = F.linear(x.float(), gate)
    scores = F.softmax(scores, dim=1) if variant == "softmax" else torch.sigmoid(scores)
    scores_for_choice = scores
    if variant == "biased":
        expert_bias = torch.zeros(num_experts, dtype=torch.float32)
        expert_bias[num_experts - num_experts // num_ranks:] = -2.0
        scores_for_choice = scores + expert_bias
    _, sel = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)
    top = scores.gather(dim=1, index=sel)
    if variant == "balanced":
        T = scores.size(0)
        sel = torch.arange(T * K, dtype=torch.int64).reshape(T, K) % num_experts
        top = scores.gather(dim=1, index=sel)
    if variant == "softmax":
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * 2.5
    return top, sel


def _titan_routing(sel, top):
    """deepep.py dispatch_tokens' preparation: contiguous, -1 where the score is 0, float32."""
    sel, top = sel.contiguous(), top.contiguous()
    sel = sel.masked_fill(top == 0, -1)
    if top.dtype != torch.float32:
        top = top.float()
    return sel, top


def _indices_to_multihot(indices, scores, num_local_experts):
    """deepep.py (36a4b69) / PR #2500 fused_indices_to_multihot: received (local idx or -1,
    scores) [N, K] -> (routing map bool [N, L], scores [N, L] of the scores' dtype): Megatron-LM's
    _indices_to_multihot, which the Megatron replay has."""
    return megatron._indices_to_multihot(indices, scores, num_local_experts, scores.dtype)


def _permute_multihot(tokens, routing_map, scores):
    """deepep.py (36a4b69) _permute_tokens: expert-major, token order inside each expert."""
    n, L = tokens.shape[0], routing_map.shape[1]
    by_expert = routing_map.bool().T.contiguous()
    token_ids = torch.arange(n).unsqueeze(0).expand(L, -1)
    sorted_indices = token_ids.masked_select(by_expert)
    return (tokens.index_select(0, sorted_indices),
            scores.T.contiguous().masked_select(by_expert), sorted_indices)


def _permute_argsort(hidden, indices, scores):
    """deepep.py (Jan 2026 on) _permute_tokens: valid (token, k) pairs stably sorted by expert."""
    mask = indices != -1
    order = torch.argsort(indices[mask], stable=True)
    permuted_indices = torch.arange(len(hidden)).repeat_interleave(mask.sum(dim=1))[order]
    return hidden.index_select(0, permuted_indices), scores[mask][order], permuted_indices


def _unpermute(permuted, indices, num_tokens):
    """deepep.py _unpermute_tokens: scatter_add in the rows' dtype."""
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=permuted.dtype)
    out.scatter_add_(0, indices.unsqueeze(1).expand(-1, permuted.shape[1]), permuted)
    return out


def _permute_padded(hidden, indices, scores, num_local_experts):
    """PR #2500 PrimusTurboDeepepManager.get_permuted_hidden_states_by_experts: multihot, then
    the plain permutation where every expert has ALIGNMENT_M rows or more, else every expert's
    segment padded (at least ALIGNMENT_M, a multiple of it) with rows of a zero token appended
    after the received ones.
    -> (tokens, tokens_per_expert int32, probs, reversed mapping, padded)."""
    routing_map, probs = _indices_to_multihot(indices, scores, num_local_experts)
    n = hidden.shape[0]
    counts = routing_map.sum(dim=0)
    by_expert = routing_map.bool().T.contiguous()
    token_ids = torch.arange(n).unsqueeze(0).expand(num_local_experts, -1)
    real_indices = token_ids.masked_select(by_expert)
    real_probs = probs.T.contiguous().masked_select(by_expert)
    if int(counts.min()) >= ALIGNMENT_M:
        return (hidden.index_select(0, real_indices), counts.to(torch.int32), real_probs,
                real_indices, False)
    sizes = ((counts.clamp(min=ALIGNMENT_M) + ALIGNMENT_M - 1) // ALIGNMENT_M * ALIGNMENT_M)
    sizes = sizes.to(torch.int32)
    ends = torch.cumsum(sizes, dim=0).to(torch.int32)
    starts = ends - sizes
    owner = torch.repeat_interleave(torch.arange(num_local_experts), counts.long())
    first = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts.long(), 0)[:-1]])
    slot = starts[owner] + (torch.arange(len(owner)) - first[owner])
    total = int(ends[-1])
    mapping = torch.full((total,), n, dtype=torch.long).scatter(0, slot, real_indices)
    padded_probs = torch.zeros(total, dtype=probs.dtype).scatter(0, slot, real_probs)
    with_zero = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    return with_zero.index_select(0, mapping), sizes, padded_probs, mapping, True


def _experts(p, x, num_tokens_per_expert):
    """GroupedExperts.forward, use_grouped_mm=False (_run_experts_for_loop), bf16 weights."""
    w1, w2, w3 = (w.to(torch.bfloat16) for w in (p.w1, p.w2, p.w3))
    parts = torch.split(x, num_tokens_per_expert.tolist(), dim=0)
    outs = []
    for e, xe in enumerate(parts):  # SwiGLU per local expert, rows in expert order
        gated = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
        outs.append(gated @ w2[e].t())
    return torch.cat(outs, dim=0)


def _shared(p, x):
    """FeedForward (shared experts): w2(silu(w1(x)) * w3(x)) in bf16."""
    w1, w2, w3 = (w.to(torch.bfloat16) for w in (p.sw1, p.sw2, p.sw3))
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _scaled(hidden, scores):
    """hidden * scores.to(hidden.dtype).reshape(-1, 1): torchtitan's score application."""
    return hidden * scores.to(hidden.dtype).reshape(-1, 1)


def _after_dispatch(cfg, recv_x, recv_idx, recv_scores, num_tokens_per_expert, L, sbe):
    """What dispatch_tokens does with the dispatch's outputs (the PR: dispatch_postprocess and
    its score_before_experts): -> state (hidden for the experts, counts, what combine needs)."""
    s = SimpleNamespace(num_recv_tokens=recv_x.shape[0], padded=False)
    if cfg.permute == "multihot":
        routing_map, multihot = _indices_to_multihot(recv_idx, recv_scores, L)
        hidden, scores, s.indices = _permute_multihot(recv_x, routing_map, multihot)
        s.tokens_per_expert = routing_map.sum(dim=0).to(torch.int32)
    elif cfg.permute == "argsort":
        hidden, scores, s.indices = _permute_argsort(recv_x, recv_idx, recv_scores)
        s.tokens_per_expert = num_tokens_per_expert
    else:
        hidden, s.tokens_per_expert, scores, s.indices, s.padded = _permute_padded(
            recv_x, recv_idx, recv_scores, L)
    if sbe:
        hidden, s.scores = _scaled(hidden, scores), None
    else:
        s.scores = scores
    s.hidden = hidden
    return s


def _before_combine(state, hidden):
    """combine_tokens' local part (the PR: combine_preprocess)."""
    if state.scores is not None:
        hidden = _scaled(hidden, state.scores)
    if state.padded:
        return _unpermute(hidden, state.indices, state.num_recv_tokens + 1)[:-1]
    return _unpermute(hidden, state.indices, state.num_recv_tokens)


# ---- deepep.py, replayed: its module state, functions and registered ops -----------------------

class _DeepEPModule:
    """torchtitan/distributed/deepep/deepep.py (or the PR's fused_a2a.py) of one flavor in one
    process: the globals (_buffer, _handle_cache, the id counter, _pending_combine_event) and the
    functions; records what the drop-in returned (`trace`) and the Buffers it made (`made`)."""

    def __init__(self, flavor, device):
        self.cfg = FLAVORS[flavor]
        self.Buffer, self.EventHandle, self.EventOverlap = _import_names(self.cfg.imports)
        self.device = device
        self.buffer = None
        self.handle_cache = {}
        self.counter = 0
        self.pending = None
        self.deferred_out = None
        self.made = []
        self.trace = []

    def dev(self, t):
        return t.to(self.device)

    @staticmethod
    def get_hidden_bytes(x):
        return x.size(1) * max(x.element_size(), 2)

    def wanted_bytes(self, group, hidden_bytes):
        n = group.size()
        nvl = rdma = 0
        for config in (self.Buffer.get_dispatch_config(n), self.Buffer.get_combine_config(n)):
            nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, n), nvl)
            rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, n), rdma)
        return nvl, rdma

    def get_buffer(self, group, hidden_bytes):
        nvl, rdma = self.wanted_bytes(group, hidden_bytes)
        b = self.buffer
        if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            b = self.buffer = self.Buffer(group, nvl, rdma)
            self.made.append(b)
        return b

    def next_handle_id(self):
        self.counter += 1
        return torch.tensor([self.counter], dtype=torch.int64, device="cpu")

    def event(self):
        return self.EventOverlap(self.EventHandle())

    # deepep::dispatch: the op's body, setup_context, backward
    def dispatch_impl(self, x, topk_idx, topk_weights, per_rank, per_rdma_rank, in_rank,
                      per_expert):
        buffer = self.buffer
        assert buffer is not None, "Buffer must be initialized before dispatch"
        out = buffer.dispatch(
            x=x, topk_idx=topk_idx, topk_weights=topk_weights.to(torch.float32),
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=self.event(), async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_indices, recv_scores, per_expert_list, handle, after_event = out
        after_event.current_stream_wait()
        handle_id = self.next_handle_id()
        self.handle_cache[handle_id.item()] = handle
        num = torch.tensor(per_expert_list, dtype=torch.int32, device="cpu")
        self.trace.append(("dispatch", buffer, out, handle_id))
        return recv_x, recv_indices, recv_scores, num, handle_id

    def dispatch_setup(self, ctx, x, handle_id):
        ctx.input_dtype = x.dtype
        if self.cfg.cache == "2025-12":
            ctx.cache_id_int = handle_id.item()
        else:
            ctx.saved_handle = self.handle_cache.get(handle_id.item())

    def dispatch_backward(self, ctx, grad_recv_x, grad_recv_indices, grad_recv_scores, grad_num,
                          grad_handle_id):
        if grad_recv_x is None:
            return (None,) * 7
        if self.cfg.cache == "2025-12":
            handle = self.handle_cache.get(ctx.cache_id_int)
        else:
            handle = ctx.saved_handle
        assert handle is not None
        grad_x, grad_scores, after_event = self.buffer.combine(
            x=grad_recv_x, handle=handle,
            topk_weights=grad_recv_scores.float() if grad_recv_scores is not None else None,
            previous_event=self.event(), async_finish=True, allocate_on_comm_stream=True)
        after_event.current_stream_wait()
        if self.cfg.cache == "2025-12":
            self.handle_cache.pop(ctx.cache_id_int, None)
        self.trace.append(("dispatch.backward", self.buffer, handle, (grad_x, grad_scores)))
        grad_x = grad_x.to(ctx.input_dtype)
        grad_w = grad_scores.to(ctx.input_dtype) if grad_scores is not None else None
        return grad_x, None, grad_w, None, None, None, None

    # deepep::combine
    def combine_impl(self, x, handle_id):
        buffer = self.buffer
        assert buffer is not None, "Buffer must be initialized before combine"
        if self.cfg.cache == "2026" and torch.is_inference_mode_enabled():
            handle = self.handle_cache.pop(handle_id.item(), None)
        else:
            handle = self.handle_cache.get(handle_id.item())
        assert handle is not None, f"Handle not found for handle_id={handle_id.item()}"
        out = buffer.combine(x=x, handle=handle, previous_event=self.event(), async_finish=True,
                             allocate_on_comm_stream=True)
        combined, _, after_event = out
        if self.cfg.deferred:
            self.pending = after_event  # sync_combine() waits, after the shared experts
        else:
            after_event.current_stream_wait()
        self.trace.append(("combine", buffer, handle, out))
        return combined

    def combine_setup(self, ctx, handle_id):
        if self.cfg.cache == "2025-12":
            ctx.cache_id_int = handle_id.item()
            ctx.saved_handle = self.handle_cache.get(ctx.cache_id_int)
        else:
            ctx.saved_handle = self.handle_cache.pop(handle_id.item(), None)

    def combine_backward(self, ctx, grad_combined):
        handle = ctx.saved_handle
        assert handle is not None, "Handle not found in combine backward"
        out = self.buffer.dispatch(
            x=grad_combined, topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
            num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
            handle=handle, previous_event=self.event(), async_finish=True,
            allocate_on_comm_stream=True)
        out[5].current_stream_wait()
        self.trace.append(("combine.backward", self.buffer, handle, out))
        return out[0], None

    def sync_combine(self):
        if self.pending is not None:
            self.pending.current_stream_wait()
            self.pending = None
        if self.deferred_out is not None:  # the combine op's output, read after the wait
            out, host = self.deferred_out
            with torch.no_grad():
                host.copy_(out)
            self.deferred_out = None

    # dispatch_tokens / combine_tokens (the local parts on the CPU; the collectives on the device)
    def dispatch_tokens(self, hidden_states, sel, top, L, num_experts, group, sbe, log):
        sel, top = _titan_routing(sel, top)
        with contextlib.nullcontext():  # _disable_current_modes() (torch 2.x SAC)
            buffer = self.get_buffer(group, self.get_hidden_bytes(hidden_states))
            layout = buffer.get_dispatch_layout(topk_idx=self.dev(sel), num_experts=num_experts)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = layout
        log.update(layout=layout, topk_idx=sel, topk_weights=top.detach())
        recv_x, recv_idx, recv_scores, num, handle_id = _call_op(
            _DispatchOp, hidden_states, sel, top, per_rank, per_rdma_rank, in_rank, per_expert)
        log.update(dispatch=self.trace[-1], num=num, handle_id=handle_id)
        state = _after_dispatch(self.cfg, recv_x, recv_idx, recv_scores, num, L, sbe)
        state.handle_id = handle_id
        log["state"] = state
        return state.hidden, state.tokens_per_expert, state

    def combine_tokens(self, hidden_states, state, log):
        hidden_states = _before_combine(state, hidden_states)
        out = _call_op(_CombineOp, hidden_states, state.handle_id)
        log["combine"] = self.trace[-1]
        return out  # deferred: filled by sync_combine()


_MOD = None  # the current process's replayed deepep.py (set by each body)


def _call_op(fn, *args):
    """Calling a torch.library op with a registered autograd formula: setup_context and the
    backward only where grad mode is on and some input requires grad."""
    setup = torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    return fn.apply(*args, setup)


def _to_host(ts):
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in ts)


def _to_dev(ts):
    return tuple(_MOD.dev(t) if isinstance(t, torch.Tensor) else t for t in ts)


# The replayed ops take and return the model's CPU tensors and move them to the device and back
# inside (torchtitan's ops see CUDA tensors throughout). So every autograd node of the replay is a
# CPU node, run by the thread that calls backward in the reference's order: a node whose incoming
# gradient is a CUDA tensor runs on the autograd engine's device thread, beside the CPU thread, and
# the bf16 sums of a tensor's gradients (h's: the residual, the router, the shared experts, the
# dispatch's backward) would then add in whichever order they arrive.

class _DispatchOp(torch.autograd.Function):
    """torch.ops.deepep.dispatch with its register_autograd (replayed, see the docstring)."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, per_rank, per_rdma_rank, in_rank, per_expert,
                setup):
        out = _MOD.dispatch_impl(*_to_dev((x, topk_idx, topk_weights)), per_rank, per_rdma_rank,
                                 in_rank, per_expert)
        if setup:
            _MOD.dispatch_setup(ctx, x, out[4])
        return _to_host(out)

    @staticmethod
    def backward(ctx, *grads):
        return _to_host(_MOD.dispatch_backward(ctx, *_to_dev(grads))) + (None,)


class _CombineOp(torch.autograd.Function):
    """torch.ops.deepep.combine with its register_autograd (replayed). With the deferred wait the
    output is read after sync_combine(): the op returns a CPU tensor that sync_combine() fills."""

    @staticmethod
    def forward(ctx, x, handle_id, setup):
        m = _MOD
        out = m.combine_impl(m.dev(x), handle_id)
        if setup:
            m.combine_setup(ctx, handle_id)
        if m.cfg.deferred:
            m.deferred_out = (out, torch.empty(out.shape, dtype=out.dtype))
            return m.deferred_out[1]
        return out.cpu()

    @staticmethod
    def backward(ctx, grad):
        return _to_host(_MOD.combine_backward(ctx, _MOD.dev(grad))) + (None,)


# ---- PR #2500: fused_a2a.py and deepep/utils.py's dispatcher, replayed ------------------------

def _sync_comm_stream(buffer):
    """fused_a2a._sync_comm_stream (GPU only: CUDA events on get_comm_stream())."""
    comm_stream = buffer.get_comm_stream()
    event = torch.cuda.Event()
    event.record(comm_stream)
    torch.cuda.current_stream().wait_event(event)
    torch.cuda.synchronize()


def _after_op(buffer, event, async_finish, sync_comm_stream):
    """What fused_a2a.py does after each of its four calls: wait on the returned event when
    async_finish, then _sync_comm_stream when asked."""
    if async_finish:
        event.current_stream_wait()
    if sync_comm_stream:
        _sync_comm_stream(buffer)


class _FusedDispatch(torch.autograd.Function):
    """fused_a2a.FusedDispatch (PR #2500)."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False, use_cuda_num_token_per_expert=False,
                num_worst_tokens=0, sync_comm_stream=False):
        m = _MOD
        x, token_indices, token_probs = _to_dev((x, token_indices, token_probs))
        previous_event = m.event() if async_finish else None
        buffer = m.get_buffer(group, m.get_hidden_bytes(x))
        layout = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        per_rank, per_rdma_rank, per_expert, in_rank, event = layout
        m.trace.append(("layout", buffer, layout))
        out = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream, num_worst_tokens=num_worst_tokens)
        recv_x, recv_indices, recv_probs, per_expert_list, handle, after = out
        _after_op(buffer, after, async_finish, sync_comm_stream)
        m.trace.append(("dispatch", buffer, out, None))
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        ctx.sync_comm_stream = sync_comm_stream
        tokens_per_expert = torch.tensor(per_expert_list, device=x.device)
        return recv_x.cpu(), recv_indices.cpu(), recv_probs.cpu(), tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_indices, grad_probs, grad_tokens_per_expert,
                 grad_handle):
        m = _MOD
        grad_output, grad_probs = _to_dev((grad_output, grad_probs))
        buffer = m.get_buffer(ctx.group, m.get_hidden_bytes(grad_output))
        previous_event = m.event() if ctx.async_finish else None
        grad_x, grad_token_probs, after = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
            previous_event=previous_event, async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        _after_op(buffer, after, ctx.async_finish, ctx.sync_comm_stream)
        m.trace.append(("dispatch.backward", buffer, ctx.handle, (grad_x, grad_token_probs)))
        return grad_x.cpu(), None, grad_token_probs.cpu(), None, None, None, None, None, None, None


class _FusedCombine(torch.autograd.Function):
    """fused_a2a.FusedCombine (PR #2500)."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False,
                sync_comm_stream=False):
        m = _MOD
        x = m.dev(x)
        previous_event = m.event() if async_finish else None
        buffer = m.get_buffer(group, m.get_hidden_bytes(x))
        out = buffer.combine(x, handle=handle, async_finish=async_finish,
                             previous_event=previous_event,
                             allocate_on_comm_stream=allocate_on_comm_stream)
        combined_x, _, after = out
        _after_op(buffer, after, async_finish, sync_comm_stream)
        m.trace.append(("combine", buffer, handle, out))
        ctx.handle, ctx.group = handle, group
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        ctx.sync_comm_stream = sync_comm_stream
        return combined_x.cpu(), None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        m = _MOD
        grad_output = m.dev(grad_output)
        previous_event = m.event() if ctx.async_finish else None
        buffer = m.get_buffer(ctx.group, m.get_hidden_bytes(grad_output))
        out = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                              previous_event=previous_event, async_finish=ctx.async_finish,
                              allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        _after_op(buffer, out[5], ctx.async_finish, ctx.sync_comm_stream)
        m.trace.append(("combine.backward", buffer, ctx.handle, out))
        return out[0].cpu(), None, None, None, None, None


class _PrDispatcher:
    """PR #2500 deepep/utils.py: DeepEPTokenDispatcher (tp_size 1) with its
    PrimusTurboDeepepManager (capacity_factor None, use_cuda_num_token_per_expert=False,
    sync_free_moe=False, num_worst_tokens=0, the tuned configs)."""

    cuda_dtoh_stream = None

    def __init__(self, m, topk, num_experts):
        m.Buffer.set_num_sms(PR_NUM_SMS)  # set_deepep_num_sms(turbo_deepep_num_cus)
        self.router_topk, self.num_experts = topk, num_experts
        self.dispatch_config = DeepEPConfig(PR_NUM_SMS, *PR_DISPATCH_TUNED)
        self.combine_config = DeepEPConfig(PR_NUM_SMS, *PR_COMBINE_TUNED)
        self.sync_comm_stream = m.device.type == "cuda"  # deepep.sync_comm_stream (CUDA only)
        if m.device.type == "cuda" and _PrDispatcher.cuda_dtoh_stream is None:
            _PrDispatcher.cuda_dtoh_stream = torch.cuda.Stream()
        self.m = m

    def dispatch_preprocess(self, top_scores, selected_indices):
        self.token_probs = top_scores.view(-1, self.router_topk)
        self.token_indices = selected_indices.view(-1, self.router_topk)

    def token_dispatch(self, hidden_states, group, async_finish=True,
                       allocate_on_comm_stream=True):
        self.num_local_experts = self.num_experts // dist.get_world_size(group)
        if self.token_probs.dtype != torch.float32:
            self.token_probs = self.token_probs.float()
        m = self.m
        recv_x, indices, probs, tokens_per_expert, handle = _FusedDispatch.apply(
            hidden_states.contiguous(), self.token_indices, self.token_probs, self.num_experts,
            group, async_finish, allocate_on_comm_stream, False, 0, self.sync_comm_stream)
        self.handle, self.tokens_per_expert = handle, tokens_per_expert
        self.dispatched_indices, self.dispatched_probs = indices, probs
        num_recv_tokens = torch.sum(tokens_per_expert)
        if num_recv_tokens.device.type != "cpu":  # the manager's async device-to-host copy
            s = _PrDispatcher.cuda_dtoh_stream
            s.wait_stream(torch.cuda.current_stream())
            num_recv_tokens.record_stream(s)
            with torch.cuda.stream(s):
                self.num_recv_tokens = torch.empty_like(num_recv_tokens, device="cpu",
                                                        pin_memory=True)
                self.num_recv_tokens.copy_(num_recv_tokens, non_blocking=True)
            s.synchronize()  # maybe_cpu_sync
        else:
            self.num_recv_tokens = num_recv_tokens
        return recv_x

    def token_combine(self, hidden_states, group, async_finish=True,
                      allocate_on_comm_stream=True):
        out, _ = _FusedCombine.apply(hidden_states, group, self.handle, async_finish,
                                     allocate_on_comm_stream, self.sync_comm_stream)
        self.handle = self.tokens_per_expert = self.dispatched_indices = None
        self.dispatched_probs = self.num_recv_tokens = None
        return out


# ---- the model: MoE blocks as DeepEPMoE / MoE.forward drive the dispatch ----------------------

def _make_params(seed, R, E, layer, s):
    """Layer `layer`'s parameters on rank s (fp32 masters): the router gate, the shared experts
    (replicated: the same on every rank) and rank s's shard of the routed experts."""
    L = E // R
    g = ref.generator(seed, "replicated", layer)
    gate = torch.randn(E, D, generator=g) * D ** -0.5
    sw1 = torch.randn(F_SHARED, D, generator=g) * D ** -0.5
    sw2 = torch.randn(D, F_SHARED, generator=g) * F_SHARED ** -0.5
    sw3 = torch.randn(F_SHARED, D, generator=g) * D ** -0.5
    g = ref.generator(seed, "experts", layer, s)
    w1 = torch.randn(L, F_EXPERT, D, generator=g) * D ** -0.5
    w2 = torch.randn(L, D, F_EXPERT, generator=g) * F_EXPERT ** -0.5
    w3 = torch.randn(L, F_EXPERT, D, generator=g) * D ** -0.5
    return SimpleNamespace(gate=gate, w1=w1, w2=w2, w3=w3, sw1=sw1, sw2=sw2, sw3=sw3)


PARAM_NAMES = ("gate", "w1", "w2", "w3", "sw1", "sw2", "sw3")


def _leaves(p):
    return SimpleNamespace(**{n: getattr(p, n).clone().requires_grad_(True)
                              for n in PARAM_NAMES})


def _seq_len(R, s, step):
    """Uneven sequence lengths; step 2 leaves the last rank without tokens (R > 1)."""
    if step == 2 and R > 1 and s == R - 1:
        return 0
    return 1 + (3 * s + 2 * step + 1) % 5


def _step_inputs(seed, R, s, step):
    """Rank s's input x [B, S, D] (every fourth token spiky: its softmax scores underflow to
    exact zeros, which dispatch_tokens masks to -1) and the output gradient."""
    g = ref.generator(seed, "step", step, s)
    S = _seq_len(R, s, step)
    x = torch.randn(B, S, D, generator=g)
    spiky = (torch.arange(B * S) % 4 == 1).reshape(B, S)
    x[spiky] *= 600.0
    return x.to(torch.bfloat16), ref.rand_bf16((B, S, D), g)


def _layer_setup(cfg, layer, step):
    return VARIANTS[(layer + 2 * step) % len(VARIANTS)], cfg.sbe[layer % len(cfg.sbe)]


def _replay_moe(m, cfg, x_BLD, p, layer, step, group, num_experts, log):
    """One MoE block's moe(h) on this rank: DeepEPMoE.forward / MoE.forward with the
    DeepEPExpertParallel hooks (or DeepEPTokenDispatcher; the PR's dispatcher)."""
    variant, sbe = _layer_setup(cfg, layer, step)
    bs, slen, dim = x_BLD.shape
    x = x_BLD.view(-1, dim)
    top, sel = _router(x, p.gate, variant, num_experts, group.size())
    if cfg.comm == "ops":
        if cfg.name == "2026-06":  # DeepEPTokenDispatcher.dispatch
            L = num_experts // group.size()
        else:  # DeepEPExpertParallel._token_dispatch: the local shard of w1
            L = p.w1.shape[0]
        hidden, tokens_per_expert, state = m.dispatch_tokens(x, sel, top, L, num_experts, group,
                                                             sbe, log)
        routed = _experts(p, hidden, tokens_per_expert)
        routed = m.combine_tokens(routed, state, log)
    else:
        disp = m.pr_dispatcher
        disp.dispatch_preprocess(top, sel)
        log.update(topk_idx=disp.token_indices, topk_weights=disp.token_probs.detach())
        n = len(m.trace)
        recv_x = disp.token_dispatch(x, group)
        log.update(layout=m.trace[n][2], dispatch=m.trace[n + 1], num=disp.tokens_per_expert)
        state = _after_dispatch(cfg, recv_x, disp.dispatched_indices, disp.dispatched_probs,
                                None, disp.num_local_experts, sbe)
        log["state"] = state
        routed = _experts(p, state.hidden, state.tokens_per_expert)
        routed = disp.token_combine(_before_combine(state, routed), group)
        log["combine"] = m.trace[-1]
    out = _shared(p, x)
    if cfg.deferred:
        m.sync_combine()
    return (out + routed).reshape(bs, slen, dim)


# ---- the reference: every rank's model, reference.py's collectives inside autograd -------------

def _combined_weights(inputs, ws, rank, E, R):
    """combined_topk_weights of `rank` (docs/semantics.md §1.6): per token, the float32 sum from
    0.0f over the ranks d it went to, ascending, of the row rank d passed for it."""
    idx = inputs[rank]["topk_idx"]
    acc = torch.zeros(idx.shape[0], idx.shape[1], dtype=torch.float32)
    for d in range(R):
        before = sum(int(ref.goes_to(inputs[s]["topk_idx"], d, E, R).sum()) for s in range(rank))
        sel = ref.goes_to(idx, d, E, R).nonzero().flatten()
        acc[sel] = ref.f32_add(acc[sel], ws[d][before:before + len(sel)].to(torch.float32))
    return acc


class _RefDispatch(torch.autograd.Function):
    """Every rank's dispatch (reference.ht_dispatch); backward: every rank's combine of the rows'
    gradients and of the weights' gradients (§1.6), cast as the flavor's backward casts them."""

    @staticmethod
    def forward(ctx, rec, *xw):
        R, E = rec["R"], rec["E"]
        inputs = [dict(x=xw[s], topk_idx=rec["topk_idx"][s], topk_weights=xw[R + s])
                  for s in range(R)]
        rec["inputs"] = inputs
        rec["wants"] = [ref.ht_dispatch(inputs, d, E, R) for d in range(R)]
        ctx.rec = rec
        return tuple(w["recv_x"] for w in rec["wants"]) + tuple(
            w["recv_topk_weights"] for w in rec["wants"])

    @staticmethod
    def backward(ctx, *grads):
        rec = ctx.rec
        R, E, inputs = rec["R"], rec["E"], rec["inputs"]
        gys, gws = grads[:R], grads[R:]
        rec["grad_x"] = [ref.ht_combine(inputs, gys, s, E, R) for s in range(R)]
        rec["grad_w"] = [_combined_weights(inputs, gws, s, E, R) for s in range(R)]
        cast = rec["grad_w_dtype"]  # deepep.py: grad_scores.to(x.dtype); fused_a2a: float32
        return (None,) + tuple(rec["grad_x"]) + tuple(
            w.to(cast).to(torch.float32) for w in rec["grad_w"])


class _RefCombine(torch.autograd.Function):
    """Every rank's combine (reference.ht_combine); backward: every rank's cached dispatch of the
    output gradients (§1.5)."""

    @staticmethod
    def forward(ctx, rec, *ys):
        R, E = rec["R"], rec["E"]
        rec["outs"] = [ref.ht_combine(rec["inputs"], ys, s, E, R) for s in range(R)]
        ctx.rec = rec
        return tuple(rec["outs"])

    @staticmethod
    def backward(ctx, *grads):
        rec = ctx.rec
        R, E = rec["R"], rec["E"]
        grads_in = [dict(x=grads[s], topk_idx=rec["inputs"][s]["topk_idx"]) for s in range(R)]
        rec["grad_y"] = [ref.ht_dispatch(grads_in, d, E, R)["recv_x"] for d in range(R)]
        return (None,) + tuple(rec["grad_y"])


def _ref_moe_all(cfg, hs, params, layer, step, R, E):
    """moe(h) of every rank (lists over the ranks), and the layer's record."""
    variant, sbe = _layer_setup(cfg, layer, step)
    L = E // R
    rec = dict(R=R, E=E, topk_idx=[], grad_w_dtype=torch.bfloat16 if cfg.comm == "ops"
               else torch.float32)
    xs, tops = [], []
    for s in range(R):
        x = hs[s].view(-1, D)
        top, sel = _router(x, params[s].gate, variant, E, R)
        if cfg.comm == "ops":
            sel, top = _titan_routing(sel, top)
        else:
            sel, top = sel.view(-1, K), top.view(-1, K).float()
        xs.append(x)
        tops.append(top)
        rec["topk_idx"].append(sel)
    recv = _RefDispatch.apply(rec, *xs, *tops)
    ys, rec["states"] = [], []
    for d in range(R):
        want = rec["wants"][d]
        num = torch.tensor(want["num_recv_tokens_per_expert"], dtype=torch.int32)
        state = _after_dispatch(cfg, recv[d], want["recv_topk_idx"], recv[R + d], num, L, sbe)
        rec["states"].append(state)
        ys.append(_before_combine(state, _experts(params[d], state.hidden,
                                                  state.tokens_per_expert)))
    outs = _RefCombine.apply(rec, *ys)
    moe = [(_shared(params[s], xs[s]) + outs[s]).reshape(hs[s].shape) for s in range(R)]
    return moe, rec


# ---- a run: replay and reference side by side, checks -------------------------------------------

class _Run:
    """One torchtitan training run on a group of R ranks (this rank r): the replayed model and
    the reference of every rank, stepped in lockstep."""

    def __init__(self, ctx, group, R, r, seed, flavor, ac=False):
        self.ctx, self.group, self.R, self.r = ctx, group, R, r
        self.seed, self.cfg, self.ac = seed, FLAVORS[flavor], ac
        self.E = _num_experts(R)
        self.view = SimpleNamespace(world_size=R, rank=r, device=ctx.device)
        init = [[_make_params(seed, R, self.E, l, s) for s in range(R)]
                for l in range(NUM_LAYERS)]
        self.params = [_leaves(init[l][r]) for l in range(NUM_LAYERS)]
        self.ref_params = [[_leaves(init[l][s]) for s in range(R)] for l in range(NUM_LAYERS)]

    def what(self, step, layer=None):
        w = (f"seed={self.seed} R={self.R} rank={self.r} flavor={self.cfg.name} ac={self.ac} "
             f"step={step} T={[B * _seq_len(self.R, s, step) for s in range(self.R)]}")
        if layer is not None:
            variant, sbe = _layer_setup(self.cfg, layer, step)
            w += f" layer={layer} router={variant} score_before_experts={sbe}"
        return w

    # ---- replay
    def forward(self, step, train):
        m, cfg = _MOD, self.cfg
        x, grad_out = _step_inputs(self.seed, self.R, self.r, step)
        self.x = x.clone().requires_grad_(train)
        self.grad_out = grad_out
        self.logs = []
        h = self.x
        for l in range(NUM_LAYERS):
            log = {}
            self.logs.append(log)

            def block(hh, l=l, log=log):
                return hh + _replay_moe(m, cfg, hh, self.params[l], l, step, self.group,
                                        self.E, log)
            if self.ac and train:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
            log["out"] = h.detach().clone()
        self.out = h
        return h

    def backward(self):
        n = len(_MOD.trace)
        torch.autograd.backward([self.out], [self.grad_out])
        self.bwd = _MOD.trace[n:]

    # ---- reference
    def reference(self, step, train):
        R = self.R
        hs, self.ref_x = [], []
        for s in range(R):
            x, _ = _step_inputs(self.seed, R, s, step)
            x = x.clone().requires_grad_(train)
            self.ref_x.append(x)
            hs.append(x)
        self.recs, self.ref_outs = [], []
        with contextlib.nullcontext() if train else torch.no_grad():
            for l in range(NUM_LAYERS):
                moe, rec = _ref_moe_all(self.cfg, hs, [self.ref_params[l][s] for s in range(R)],
                                        l, step, R, self.E)
                hs = [hs[s] + moe[s] for s in range(R)]
                self.recs.append(rec)
                self.ref_outs.append([h.detach() for h in hs])
            if train:
                grads = [_step_inputs(self.seed, R, s, step)[1] for s in range(R)]
                torch.autograd.backward(hs, grads)
        # NaN would compare unequal to itself: the model must stay finite for the checks to mean
        # anything (a property of the test's data, not of epx).
        finite = [h for outs in self.ref_outs for h in outs] + (
            [x.grad for x in self.ref_x] + [getattr(p, n).grad for ps in self.ref_params
                                            for p in ps for n in PARAM_NAMES] if train else [])
        assert all(bool(torch.isfinite(t.float()).all()) for t in finite), (
            self.what(step) + " the reference is not finite")

    # ---- checks
    def check_forward(self, step):
        R, r, E = self.R, self.r, self.E
        for l in range(NUM_LAYERS):
            what = self.what(step, l)
            log, rec = self.logs[l], self.recs[l]
            assert torch.equal(log["topk_idx"], rec["topk_idx"][r]), what + " routing"
            per_rank, per_rdma_rank, per_expert, in_rank, event = log["layout"]
            want_rank, want_expert, want_in_rank = ref.ht_layout(rec["topk_idx"][r], E, R)
            assert per_rdma_rank is None, what  # one node
            assert torch.equal(per_rank.cpu(), want_rank), what + " num_tokens_per_rank"
            assert torch.equal(per_expert.cpu(), want_expert), what + " num_tokens_per_expert"
            assert torch.equal(in_rank.cpu(), want_in_rank), what + " is_token_in_rank"
            assert isinstance(event, epx_deep_ep.EventOverlap), what
            kind, buffer, raw, handle_id = log["dispatch"]
            assert kind == "dispatch" and buffer is _MOD.buffer, what
            ht._check_recv(self.view, rec["inputs"], raw, E, 1, what + " dispatch")
            if self.cfg.permute == "multihot":  # its counts, from the map, match the list
                assert log["state"].tokens_per_expert.tolist() == raw[3], what
            state, want_state = log["state"], rec["states"][r]
            assert torch.equal(state.tokens_per_expert, want_state.tokens_per_expert), \
                what + " tokens per expert"
            assert int(state.tokens_per_expert.sum()) == state.hidden.shape[0], what
            assert torch.equal(state.indices, want_state.indices), what + " permutation"
            assert torch.equal(state.hidden, want_state.hidden), what + " permuted tokens"
            kind, buffer, handle, (combined, combined_w, event) = log["combine"]
            assert kind == "combine" and handle is raw[4] and combined_w is None, what
            assert isinstance(event, epx_deep_ep.EventOverlap), what
            assert torch.equal(combined.cpu(), rec["outs"][r]), what + " combine"
            assert torch.equal(log["out"], self.ref_outs[l][r]), what + " block output"

    def check_backward(self, step):
        r, what = self.r, self.what(step)
        ops = [t[0] for t in self.bwd]
        if self.ac:  # each block's forward again (its dispatch and combine), then its backward
            per_layer = ["dispatch", "combine", "combine.backward", "dispatch.backward"]
            if self.cfg.comm != "ops":
                per_layer = ["layout"] + per_layer
        else:
            per_layer = ["combine.backward", "dispatch.backward"]
        assert ops == per_layer * NUM_LAYERS, (what, ops)
        handles = {id(log["dispatch"][2][4]): l for l, log in enumerate(self.logs)}
        rows = [t for t in self.bwd if t[0] in ("combine.backward", "dispatch.backward")]
        layers = list(range(NUM_LAYERS))[::-1]
        for i, (kind, buffer, handle, out) in enumerate(rows):
            l = layers[i // 2]
            what_l = self.what(step, l)
            rec = self.recs[l]
            if not self.ac:
                assert handles.get(id(handle)) == l, what_l + " the handle of the layer's dispatch"
            if kind == "combine.backward":
                assert len(out) == 6 and out[1:5] == (None, None, None, None), what_l
                assert torch.equal(out[0].cpu(), rec["grad_y"][r]), \
                    what_l + " combine backward (cached dispatch)"
            else:
                grad_x, grad_w = out
                assert torch.equal(grad_x.cpu(), rec["grad_x"][r]), \
                    what_l + " dispatch backward (combine)"
                assert grad_w.dtype == torch.float32, what_l
                assert torch.equal(grad_w.cpu(), rec["grad_w"][r]), \
                    what_l + " dispatch backward (combined weights)"
        assert torch.equal(self.x.grad, self.ref_x[r].grad), what + " x.grad"
        for l in range(NUM_LAYERS):
            for name in PARAM_NAMES:
                got = getattr(self.params[l], name).grad
                want = getattr(self.ref_params[l][r], name).grad
                assert got is not None and torch.equal(got, want), \
                    self.what(step, l) + f" {name}.grad"

    def sgd(self):
        with torch.no_grad():
            for ps in [self.params] + [[self.ref_params[l][s] for l in range(NUM_LAYERS)]
                                       for s in range(self.R)]:
                for p in ps:
                    for name in PARAM_NAMES:
                        t = getattr(p, name)
                        t -= LR * torch.sign(t.grad)  # bounded steps: the spiky tokens'
                        t.grad = None                   # gradients are huge

    def run(self, steps):
        """Step 0 is a forward under torch.inference_mode() (never under AC), the others are
        training steps."""
        for step in steps:
            train = step > 0
            with contextlib.nullcontext() if train else torch.inference_mode():
                self.forward(step, train)
            self.reference(step, train)
            self.check_forward(step)
            if train:
                self.backward()
                self.check_backward(step)
                self.sgd()
            self.check_cache(step, train)

    def check_cache(self, step, train):
        """The handle cache after a step is empty (2026: combine's setup_context pops, and the
        combine op itself in inference mode; 2025-12: dispatch's backward pops) and no combine
        event is pending, except after a training step under activation checkpointing: torch's
        non-reentrant checkpoint (torch >= 2.1) stops recomputing a block once its saved tensors
        are rebuilt, after the shared experts and before DeepEPMoE.forward's sync_combine(), so
        the recomputed combine's event stays pending as torchtitan's _pending_combine_event does
        (the next forward's combine replaces it)."""
        m = _MOD
        if self.ac and train and m.cfg.deferred:
            m.pending = m.deferred_out = None
        assert m.pending is None and m.deferred_out is None, self.what(step)
        if m.cfg.cache is not None:
            assert m.handle_cache == {}, (self.what(step), sorted(m.handle_cache))


def _start(flavor, device):
    global _MOD
    m = _MOD = _DeepEPModule(flavor, device)
    Buffer.set_num_sms(20)
    if m.cfg.comm == "fused_a2a":
        m.pr_dispatcher = _PrDispatcher(m, K, None)
    return m


def _finish():
    global _MOD
    _MOD = None
    Buffer.set_num_sms(20)


# ---- bodies -------------------------------------------------------------------------------------

def body_training(ctx, seed, flavor, ac=False, steps=(1, 2)):
    """Two MoE blocks, steps as the flavor's torchtitan drives DeepEP (default: two training
    steps, the second with an empty rank); get_buffer makes one Buffer for the run."""
    R, r = ctx.world_size, ctx.rank
    m = _start(flavor, ctx.device)
    try:
        run = _Run(ctx, ctx.group, R, r, seed, flavor, ac)
        if m.cfg.comm == "fused_a2a":
            m.pr_dispatcher.num_experts = run.E
        run.run(steps)
        assert len(m.made) == 1, (seed, len(m.made))
        b = m.made[0]
        assert b.group is ctx.group and b.rank == r and b.group_size == R
        assert (b.num_nvl_bytes, b.num_rdma_bytes) == m.wanted_bytes(ctx.group, 2 * D)
        assert b.num_rdma_bytes == 0  # one node
        if m.cfg.comm == "fused_a2a":
            assert Buffer.num_sms == PR_NUM_SMS, seed
    finally:
        _finish()


def body_ep_subgroups(ctx, seed, size):
    """EP groups smaller than the world (data-parallel replicas beside them): a training step on
    each subgroup concurrently, then a layer on the world group, for which get_buffer's group
    rule makes a second Buffer; a larger hidden size (a model with a wider dim) a third."""
    group = ctx.subgroup(size)  # torchtitan's EP mesh dimension
    sub_r = dist.get_rank(group)
    assert group.size() == size and sub_r == ctx.rank % size
    m = _start("2026-02", ctx.device)
    try:
        sub_seed = seed + 1000 * (ctx.rank // size)  # different data in each subgroup
        _Run(ctx, group, size, sub_r, sub_seed, "2026-02").run(steps=(1,))
        assert len(m.made) == 1 and m.buffer.group is group
        assert (m.buffer.rank, m.buffer.group_size) == (sub_r, size)
        _Run(ctx, ctx.group, ctx.world_size, ctx.rank, seed + 1, "2026-02").run(steps=(1,))
        assert len(m.made) == 2 and m.buffer.group is ctx.group
        first = m.buffer
        # get_buffer's size rule: wider rows ask for more bytes (a new Buffer), narrower ones
        # are served by it.
        wide = torch.zeros(3, 2 * D, dtype=torch.bfloat16)
        assert m.get_buffer(ctx.group, m.get_hidden_bytes(wide)) is not first
        assert len(m.made) == 3
        narrow = torch.zeros(3, D // 2, dtype=torch.float32)  # 4-byte elements: D * 2 bytes
        assert m.get_buffer(ctx.group, m.get_hidden_bytes(narrow)) is m.made[2]
        assert len(m.made) == 3
    finally:
        _finish()


# ---- tests --------------------------------------------------------------------------------------

def test_import_block_deep_ep_utils():
    """deepep.py at 36a4b69 .. b5852826^ (and the PR's fused_a2a.py): ``from deep_ep import
    Buffer`` and ``from deep_ep.utils import EventHandle, EventOverlap``, through the shim."""
    assert deep_ep.__file__.startswith(shim.DIRECTORY), deep_ep.__file__
    assert UTILS_IMPORT_ERROR is None, UTILS_IMPORT_ERROR
    assert Buffer is epx_deep_ep.Buffer and EventOverlap is epx_deep_ep.EventOverlap
    ev = EventOverlap(EventHandle())  # previous_event of every torchtitan call
    ev.current_stream_wait()
    assert DeepEPConfig is epx_deep_ep.Config


def test_import_block_top_level():
    """deepep.py at b5852826 (#3414) .. 756213e^: ``from deep_ep import Buffer, EventHandle,
    EventOverlap`` — DeepEP 2.x's deep_ep/__init__.py exports EventHandle and EventOverlap at the
    top level next to the legacy V1 Buffer (and its deep_ep.utils no longer has EventOverlap,
    hence torchtitan's change). On failure torchtitan raises 'DeepEP is required'."""
    assert TOP_IMPORT_ERROR is None, (
        f"torchtitan's import block fails on epx's deep_ep shim: {TOP_IMPORT_ERROR!r}")
    assert TopBuffer is epx_deep_ep.Buffer and TopEventOverlap is epx_deep_ep.EventOverlap
    assert TopEventHandle is EventHandle
    TopEventOverlap(TopEventHandle()).current_stream_wait()


def test_get_buffer_sizing():
    """get_buffer's byte sizes, as torchtitan computes them, for R = 1, 2, 4, 8: get_hidden_bytes
    (at least 2 bytes an element), the hints of the dispatch / combine configs (no RDMA bytes on
    one node), larger for wider rows and for the PR's set_deepep_num_sms(128); the PR's tuned
    Configs are accepted."""
    m = _DeepEPModule("2026-02", torch.device("cpu"))
    try:
        assert m.get_hidden_bytes(torch.zeros(2, D, dtype=torch.bfloat16)) == 2 * D
        assert m.get_hidden_bytes(torch.zeros(2, D, dtype=torch.uint8)) == 2 * D
        assert m.get_hidden_bytes(torch.zeros(2, D, dtype=torch.float32)) == 4 * D
        for R in (1, 2, 4, 8):
            group = SimpleNamespace(size=lambda R=R: R)
            nvl, rdma = m.wanted_bytes(group, 2 * D)
            assert rdma == 0 and nvl > 0 and nvl % 128 == 0, (R, nvl)
            assert m.wanted_bytes(group, 4 * D)[0] > nvl
            Buffer.set_num_sms(PR_NUM_SMS)
            assert m.wanted_bytes(group, 2 * D)[0] > nvl, R
            Buffer.set_num_sms(20)
        for tuned in (PR_DISPATCH_TUNED, PR_COMBINE_TUNED):
            c = DeepEPConfig(PR_NUM_SMS, *tuned)
            assert (c.num_sms, c.num_max_nvl_chunked_send_tokens,
                    c.num_max_nvl_chunked_recv_tokens, c.num_max_rdma_chunked_send_tokens,
                    c.num_max_rdma_chunked_recv_tokens) == (PR_NUM_SMS,) + tuned
    finally:
        Buffer.set_num_sms(20)


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def tpool(request):
    """The CPU pools, R = 1, 2, 4, 8 (torchtitan's EP degree 1 skips DeepEP; its deepep.py runs
    at any group size, and so does this replay)."""
    return get_pool(request.param)


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_training(tpool, flavor):
    tpool.run(body_training, _seed(), flavor)


def test_full_activation_checkpointing(tpool):
    tpool.run(body_training, _seed(), "2026-02", True)


INFERENCE_STEPS = (0, 1, 0)  # inference on a fresh Buffer, a training step, inference again


def test_inference_mode(tpool):
    """deepep.py's documented inference path (torch.inference_mode(): the combine op pops the
    handle itself): a forward with the Buffer born under inference mode, a training step on it,
    and another inference forward."""
    tpool.run(body_training, _seed(), "2026-02", False, INFERENCE_STEPS)


@pytest.mark.parametrize("R,size", [(4, 2), (8, 4)])
def test_ep_subgroups(R, size):
    get_pool(R).run(body_ep_subgroups, _seed(), size)


# ---- GPU twins: the same bodies with CUDA tensors over NCCL, R = 1, 2, 4, 8 where there are
# ---- that many GPUs ------------------------------------------------------------------------------

GPU_RUNS = [pytest.param(f, False, (1, 2), id=f) for f in FLAVORS] + [
    pytest.param("2026-02", True, (1, 2), id="2026-02-full-ac"),
    pytest.param("2026-02", False, INFERENCE_STEPS, id="2026-02-inference")]


@pytest.mark.gpu
@pytest.mark.parametrize("flavor,ac,steps", GPU_RUNS)
def test_gpu_torchtitan(gpu_pool, flavor, ac, steps):
    gpu_pool.run(body_training, _seed(), flavor, ac, steps)


@pytest.mark.gpu
def test_gpu_torchtitan_ep_subgroups():
    reason = gpu_skip_reason(4)
    if reason:
        pytest.skip(reason)
    get_pool(4, "nccl").run(body_ep_subgroups, _seed(), 2)
