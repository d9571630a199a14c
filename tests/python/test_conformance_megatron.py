"""Conformance tier: NVIDIA Megatron-LM's DeepEP integration, replayed on epx's drop-in.

Megatron-LM (megatron/core/transformer/moe, read at d98e8a6) reaches DeepEP through two files,
replayed here call for call and keyword for keyword (in this file's own code) on the rank pools
of conftest.py (cpu backend over gloo, R = 1, 2, 4, 8; the `gpu` twins at the bottom run the same
bodies with CUDA tensors over NCCL):

  * fused_a2a.py: the import block (``from deep_ep import Buffer`` and ``from deep_ep.utils import
    EventHandle, EventOverlap``, here through the shim directory of the README's one-step opt-in);
    get_hidden_bytes; get_buffer (the byte sizes as the max of Config.get_nvl_buffer_size_hint /
    get_rdma_buffer_size_hint over Buffer.get_dispatch_config / get_combine_config(group.size()),
    a new ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` when there is none, or its ``group``
    differs, or its ``num_nvl_bytes`` / ``num_rdma_bytes`` are smaller than asked); FusedDispatch
    (get_dispatch_layout(topk_idx, num_experts, previous_event=, async_finish=,
    allocate_on_comm_stream=), then dispatch(x, topk_idx=, topk_weights=, num_tokens_per_rank=,
    num_tokens_per_rdma_rank=, is_token_in_rank=, num_tokens_per_expert=, previous_event=,
    async_finish=, allocate_on_comm_stream=), torch.tensor of the per-expert list; its backward a
    combine(grad, handle, topk_weights=grad_probs.float(), previous_event=, async_finish=,
    allocate_on_comm_stream=)); FusedCombine (combine(x, handle=, async_finish=, previous_event=,
    allocate_on_comm_stream=); its backward the cached dispatch(grad, handle=, previous_event=,
    async_finish=, allocate_on_comm_stream=)); ``EventOverlap(EventHandle())`` as previous_event
    and ``current_stream_wait()`` on the returned events whenever async_finish is set;
    set_deepep_num_sms -> Buffer.set_num_sms.
  * token_dispatcher.py: MoEFlexTokenDispatcher (dispatch_preprocess with _initialize_metadata's
    routing map / probs expanded over TP x EP, token_dispatch / token_combine with the MoE layer's
    async_finish=True, allocate_on_comm_stream=True, combine_postprocess's view back) and
    _DeepepManager (set_deepep_num_sms(moe_flex_dispatcher_num_sms or 20) at construction;
    setup_metadata's top-k of the probs, -1 where a probability is 0 with a capacity factor; probs
    made float32; tokens_per_expert from the dispatch; _indices_to_multihot and the unfused permute
    of moe_utils.py with num_out_tokens = tokens_per_expert.sum(), the unfused unpermute; fp64
    router probs after permute). The manager's own defaults (async_finish=False) run too.

Every output is compared with reference.py bit for bit: the dispatch's outputs (test_deep_ep_ht's
_check_recv), the tokens per expert against the received routing (Megatron's permute trusts them),
the layer's output, and the gradients through torch.autograd: dispatch's backward is a combine of
the gradient (docs/semantics.md §1.6: float32 sum over the ranks, one rounding; the weights'
gradient the float32 sum of the returned rows), combine's backward a cached dispatch (§1.5). The
local parts (router, permute, experts, unpermute) run on the CPU in plain torch, the same code for
the replay and for the reference, so every expectation is exact on both tiers. Inputs are fresh
random per call (the seed is in every failure message).

Not replayed: HybridEP (deep_ep.HybridEPBuffer, a separate DeepEP branch's API) and NCCL EP
(TransformerEngine), which fused_a2a.py also wraps; Megatron's fused permute kernels (TE) and CUDA
graph capture of the flex dispatcher (its DeepEP path is documented as not graph-safe).
"""

import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import epx
import epx.compat.deep_ep as epx_deep_ep
import epx.compat.shim as shim
import reference as ref
import test_deep_ep_ht as ht
from conftest import deep_ep_shim_on_path, get_pool, gpu_skip_reason

# ---- fused_a2a.py's import block, through the shim (README: the one-step opt-in) ---------------

with deep_ep_shim_on_path():
    import deep_ep  # the shim: epx's drop-in under DeepEP's name
    import deep_ep.utils
    try:
        from deep_ep import Buffer
        from deep_ep.utils import EventHandle, EventOverlap
        IMPORT_ERROR = None
    except ImportError as e:  # Megatron then sets HAVE_DEEP_EP = False
        IMPORT_ERROR = e
        Buffer, EventOverlap, EventHandle = deep_ep.Buffer, deep_ep.utils.EventOverlap, None

H = 256  # == ht.H (its checks are reused)
assert H == ht.H
K = 2    # moe_router_topk


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _event_handle():
    """EventHandle(), as fused_a2a.py constructs it whenever async_finish is set."""
    if EventHandle is None:
        raise AssertionError(
            "Megatron's `from deep_ep.utils import EventHandle, EventOverlap` fails on the shim "
            f"({IMPORT_ERROR}): Megatron then treats DeepEP as absent, and every async_finish=True "
            "call constructs EventOverlap(EventHandle())")
    return EventHandle()


# ---- fused_a2a.py, replayed ----------------------------------------------------------------------

class _MegatronBuffers:
    """fused_a2a.py's module state (the global `_buffer`) and get_buffer's reallocation rule;
    counts the Buffers it makes."""

    def __init__(self):
        self.buffer = None
        self.made = []

    @staticmethod
    def hidden_bytes(x):
        """get_hidden_bytes: hidden size times the element size, at least 2 bytes."""
        return x.size(1) * max(x.element_size(), 2)

    @staticmethod
    def wanted_bytes(group, hidden_bytes):
        """(num_nvl_bytes, num_rdma_bytes) get_buffer asks for: the larger hint of the dispatch and
        the combine configs of the group's size."""
        n = group.size()
        configs = [Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)]
        nvl = max([0] + [c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in configs])
        rdma = max([0] + [c.get_rdma_buffer_size_hint(hidden_bytes, n) for c in configs])
        return nvl, rdma

    def get(self, group, hidden_bytes):
        nvl, rdma = self.wanted_bytes(group, hidden_bytes)
        b = self.buffer
        if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
            b = self.buffer = Buffer(group, nvl, rdma)  # positional, as get_buffer
            self.made.append(b)
        return b


_STATE = _MegatronBuffers()
_TRACE = []  # what the drop-in returned to the replayed Functions, for the checks


def _set_deepep_num_sms(num_sms):
    """fused_a2a.set_deepep_num_sms."""
    Buffer.set_num_sms(num_sms)


class _FusedDispatch(torch.autograd.Function):
    """fused_a2a.FusedDispatch."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        previous_event = EventOverlap(_event_handle()) if async_finish else None
        buffer = _STATE.get(group, _STATE.hidden_bytes(x))
        per_rank, per_rdma_rank, per_expert, in_rank, event = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        out = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs,
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_indices, recv_probs, per_expert_list, handle, after = out
        if async_finish:
            after.current_stream_wait()
        _TRACE.append(("dispatch", buffer, (per_rank, per_rdma_rank, per_expert, in_rank), out))
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return recv_x, recv_indices, recv_probs, torch.tensor(per_expert_list), handle

    @staticmethod
    def backward(ctx, grad_x, grad_indices, grad_probs, grad_per_expert, grad_handle):
        buffer = _STATE.get(ctx.group, _STATE.hidden_bytes(grad_x))
        previous_event = EventOverlap(_event_handle()) if ctx.async_finish else None
        out_x, out_probs, after = buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_probs.float(),
            previous_event=previous_event, async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after.current_stream_wait()
        _TRACE.append(("dispatch.backward", buffer, ctx.handle, (out_x, out_probs)))
        return out_x, None, out_probs, None, None, None, None


class _FusedCombine(torch.autograd.Function):
    """fused_a2a.FusedCombine."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        previous_event = EventOverlap(_event_handle()) if async_finish else None
        buffer = _STATE.get(group, _STATE.hidden_bytes(x))
        combined, combined_w, after = buffer.combine(
            x, handle=handle, async_finish=async_finish, previous_event=previous_event,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        _TRACE.append(("combine", buffer, handle, (combined, combined_w)))
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return combined, None

    @staticmethod
    def backward(ctx, grad_combined, grad_none=None):
        previous_event = EventOverlap(_event_handle()) if ctx.async_finish else None
        buffer = _STATE.get(ctx.group, _STATE.hidden_bytes(grad_combined))
        out = buffer.dispatch(grad_combined.contiguous(), handle=ctx.handle,
                              previous_event=previous_event, async_finish=ctx.async_finish,
                              allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            out[5].current_stream_wait()
        _TRACE.append(("combine.backward", buffer, ctx.handle, out))
        return out[0], None, None, None, None


# ---- token_dispatcher.py / moe_utils.py, replayed (local parts: CPU, plain torch) ----------------

def _router(scores, top_k, drop):
    """A top-k softmax router as Megatron's hands it to the dispatcher: probs [T, E] (zero where
    not routed) and routing_map [T, E] bool. `drop` (bool [T, E] or None) drops routed entries as
    a capacity factor does (routing map off, probability 0)."""
    p = torch.softmax(scores, dim=-1)
    vals, idx = torch.topk(p, top_k, dim=-1)
    probs = torch.zeros_like(p).scatter(1, idx, vals)
    routing_map = torch.zeros_like(p, dtype=torch.bool).scatter(1, idx, True)
    if drop is not None:
        routing_map = routing_map & ~drop
        probs = probs.masked_fill(drop, 0.0)
    return probs, routing_map


def _initialize_metadata(routing_map, probs, tp, ep, num_local_experts):
    """MoEFlexTokenDispatcher._initialize_metadata: [T, E] -> [T, tp*ep, L], each EP rank's
    columns repeated for the TP ranks of its group (which receive the same tokens)."""
    T = routing_map.shape[0]

    def spread(t):
        return t.reshape(T, ep, 1, num_local_experts).expand(-1, -1, tp, -1).reshape(
            T, tp * ep, num_local_experts).contiguous()
    return spread(routing_map), spread(probs)


def _indices_to_multihot(indices, probs, num_local_experts, dtype=torch.float):
    """_DeepepManager._indices_to_multihot: received (indices [N, K] local or -1, probs [N, K])
    -> (routing map [N, L] bool, probs [N, L] float32). torchtitan's deepep.py has the same code
    with the probs [N, L] in the received probs' dtype (`dtype`; its replay calls this one)."""
    n = indices.shape[0]
    multihot = torch.zeros(n, num_local_experts, dtype=torch.long)
    multihot_probs = torch.zeros(n, num_local_experts, dtype=dtype)
    valid = indices != -1
    rows = torch.arange(n).repeat_interleave(valid.sum(dim=1))
    cols = indices[valid]
    multihot[rows, cols] = 1
    multihot_probs[rows, cols] = probs[valid]
    return multihot.bool(), multihot_probs


def _permute(tokens, routing_map, probs, num_out_tokens):
    """moe_utils.permute, unfused, dropless: rows grouped by expert (token order inside), the
    first num_out_tokens nonzeros of the expert-major map."""
    n = tokens.shape[0]
    by_expert = routing_map.bool().T.contiguous()
    order = by_expert.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = order % n
    permuted_probs = probs.T.contiguous().reshape(-1)[order]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _unpermute(tokens, sorted_indices, restore_shape):
    """moe_utils.unpermute, unfused, without probs: scatter-add of the rows back to their tokens
    in the rows' dtype."""
    out = torch.zeros(restore_shape, dtype=tokens.dtype)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, restore_shape[1]), tokens)
    return out


def _experts(tokens, tokens_per_expert, probs, weights):
    """A stand-in for the grouped MLP: expert l scales its rows by weights[l] (bf16 [H]), the
    routing probability applied in float32 (as Megatron's experts apply permuted_probs)."""
    parts = torch.split(tokens, [int(c) for c in tokens_per_expert])
    hidden = torch.cat([p * weights[l] for l, p in enumerate(parts)]) if parts else tokens
    return (hidden.float() * probs.unsqueeze(-1)).to(tokens.dtype)


class _Manager:
    """token_dispatcher._DeepepManager over `group` (Megatron's TP x EP group), with a
    MoEFlexTokenDispatcher's pre/post-processing around it (`preprocess`, `postprocess`)."""

    def __init__(self, group, num_local_experts, router_topk, num_experts, num_sms=None,
                 capacity_factor=None, router_dtype="fp32", device="cpu", build=True):
        self.group, self.L, self.router_topk = group, num_local_experts, router_topk
        self.num_experts, self.capacity_factor = num_experts, capacity_factor
        self.router_dtype, self.device = router_dtype, device
        self.handle = None
        if build:  # (build=False: the reference's copy of the routing code only)
            _set_deepep_num_sms(num_sms if num_sms is not None else 20)

    # MoEFlexTokenDispatcher.dispatch_preprocess + setup_metadata
    def preprocess(self, hidden_states, routing_map, probs, tp, ep):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        routing_map, probs = _initialize_metadata(routing_map, probs, tp, ep, self.L)
        T = routing_map.shape[0]
        probs = probs.reshape(T, self.num_experts)
        self.token_probs, self.token_indices = torch.topk(probs, self.router_topk, dim=-1)
        if self.capacity_factor is not None:
            self.token_indices = self.token_indices.masked_fill(self.token_probs == 0, -1)
        return hidden_states

    def dispatch(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        if self.token_probs.dtype != torch.float32:
            self.token_probs = self.token_probs.float()
        dev = self.device
        recv_x, recv_indices, recv_probs, tokens_per_expert, handle = _FusedDispatch.apply(
            hidden_states.contiguous().to(dev), self.token_indices.to(dev),
            self.token_probs.to(dev), self.num_experts, self.group, async_finish,
            allocate_on_comm_stream)
        self.handle, self.tokens_per_expert = handle, tokens_per_expert
        self.dispatched_indices, self.dispatched_probs = recv_indices.cpu(), recv_probs.cpu()
        return recv_x.cpu()

    def permuted(self, hidden_states):
        """get_permuted_hidden_states_by_experts -> (tokens, permuted probs)."""
        self.routing_map, probs = _indices_to_multihot(self.dispatched_indices,
                                                       self.dispatched_probs, self.L)
        self.restore_shape = hidden_states.shape
        out, permuted_probs, self.sorted_indices = _permute(
            hidden_states, self.routing_map, probs, int(self.tokens_per_expert.sum().item()))
        if self.router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return out, permuted_probs

    def restored(self, hidden_states):
        """get_restored_hidden_states_by_experts."""
        return _unpermute(hidden_states, self.sorted_indices, self.restore_shape)

    def combine(self, hidden_states, async_finish=False, allocate_on_comm_stream=False):
        out, _ = _FusedCombine.apply(hidden_states.to(self.device), self.group, self.handle,
                                     async_finish, allocate_on_comm_stream)
        self.handle = None
        self.dispatched_indices = self.dispatched_probs = None
        return out.cpu()

    def postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


# ---- one MoE layer: inputs, the replay, the reference --------------------------------------------

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


class _Layer:
    """One MoE layer call (one microbatch) on every rank of a group of R ranks, as
    MoEFlexTokenDispatcher drives it: `forward` (the replay, this rank), `backward` (autograd),
    `check_*` against the reference computed from every rank's regenerated inputs."""

    def __init__(self, ctx, group, R, r, seed, hidden, num_experts, tp=1, capacity=False,
                 router_dtype="fp32", async_finish=True, allocate_on_comm_stream=True,
                 num_sms=None, tokens=lambda s: 4 + 3 * s, batch=2):
        assert R % tp == 0 and num_experts % (R // tp) == 0
        self.ctx, self.group, self.R, self.r, self.seed = ctx, group, R, r, seed
        self.Hd, self.E, self.tp, self.ep = hidden, num_experts, tp, R // tp
        self.Ew = tp * num_experts          # the dispatcher's num_experts (TP x EP columns)
        self.L = num_experts // self.ep     # num_local_experts
        self.Kw = tp * K                    # the dispatcher's router_topk
        self.capacity, self.router_dtype = capacity, router_dtype
        self.async_finish, self.allocate = async_finish, allocate_on_comm_stream
        self.num_sms, self.tokens, self.batch = num_sms, tokens, batch
        self.view = SimpleNamespace(world_size=R, rank=r, device=ctx.device)  # the group's
        self.what = (f"seed={seed} R={R} rank={r} H={hidden} E={num_experts} tp={tp} "
                     f"capacity={capacity} router={router_dtype} async_finish={async_finish}")

    # Inputs of rank s (global seed, group-local index s): x [S, B, H], router scores, a drop
    # mask, the expert weights of rank s, the gradient of the layer's output.
    def inputs(self, s):
        g = ref.generator(self.seed, s, self.Hd)
        S = self.tokens(s)
        x = ref.rand_bf16((S, self.batch, self.Hd), g)
        scores = torch.randn(S * self.batch, self.E, generator=g).to(
            _ROUTER_DTYPES[self.router_dtype])
        drop = (torch.rand(S * self.batch, self.E, generator=g) < 0.3) if self.capacity else None
        weights = ref.rand_bf16((self.L, self.Hd), g, scale=0.5)
        grad_out = ref.rand_bf16((S, self.batch, self.Hd), g)
        return dict(x=x, scores=scores, drop=drop, weights=weights, grad_out=grad_out)

    def _manager(self, build=True):
        return _Manager(self.group, self.L, self.Kw, self.Ew, num_sms=self.num_sms,
                        capacity_factor=1.0 if self.capacity else None,
                        router_dtype=self.router_dtype, device=self.ctx.device, build=build)

    def _route(self, inp, manager):
        """Router + dispatch_preprocess on leaves x and scores (requires_grad)."""
        x = inp["x"].clone().requires_grad_(True)
        scores = inp["scores"].clone().requires_grad_(True)
        probs, routing_map = _router(scores, K, inp["drop"])
        hidden = manager.preprocess(x, routing_map, probs, self.tp, self.ep)
        return x, scores, hidden

    # ---- the replay (this rank)
    def forward(self):
        mine = self.inputs(self.r)
        self.mine = mine
        self.manager = m = self._manager()
        self.x, self.scores, hidden = self._route(mine, m)
        recv = m.dispatch(hidden, async_finish=self.async_finish,
                          allocate_on_comm_stream=self.allocate)
        self.dispatch_raw = _TRACE[-1]
        permuted, permuted_probs = m.permuted(recv)
        self.tokens_per_expert = m.tokens_per_expert
        self.multihot_counts = m.routing_map.sum(dim=0)
        expert_out = _experts(permuted, m.tokens_per_expert, permuted_probs, mine["weights"])
        restored = m.restored(expert_out)
        out = m.combine(restored, async_finish=self.async_finish,
                        allocate_on_comm_stream=self.allocate)
        self.combine_raw = _TRACE[-1]
        self.out = m.postprocess(out)
        return self.out

    def backward(self):
        n = len(_TRACE)
        torch.autograd.backward([self.out], [self.mine["grad_out"]])
        ops = [t[0] for t in _TRACE[n:]]
        assert ops == ["combine.backward", "dispatch.backward"], (self.what, ops)
        self.combine_bwd_raw, self.dispatch_bwd_raw = _TRACE[n], _TRACE[n + 1]

    # ---- the reference (every rank's inputs regenerated; no epx)
    def reference(self):
        R, r = self.R, self.r
        inputs, metas = [], []
        for s in range(R):
            inp = self.inputs(s)
            man = self._manager(build=False)  # the same routing code, no set_deepep_num_sms
            x, scores, hidden = self._route(inp, man)
            probs = man.token_probs.float()
            inputs.append(dict(x=hidden.detach(), topk_idx=man.token_indices,
                               topk_weights=probs.detach()))
            metas.append(dict(inp=inp, scores=scores, probs=probs))
        self.ref_inputs = inputs
        # Forward: dispatch (reference), the same local pipeline per rank d, combine (reference).
        ys, legs = [], []
        for d in range(R):
            want = ref.ht_dispatch(inputs, d, self.Ew, R)
            rx = want["recv_x"].clone().requires_grad_(True)
            rw = want["recv_topk_weights"].clone().requires_grad_(True)
            tpe = torch.tensor(want["num_recv_tokens_per_expert"])
            routing_map, probs = _indices_to_multihot(want["recv_topk_idx"], rw, self.L)
            permuted, pprobs, sorted_indices = _permute(rx, routing_map, probs, int(tpe.sum()))
            if self.router_dtype == "fp64":
                pprobs = pprobs.to(torch.float64)
            eo = _experts(permuted, tpe, pprobs, metas[d]["inp"]["weights"])
            y = _unpermute(eo, sorted_indices, rx.shape)
            ys.append(y)
            legs.append(dict(want=want, rx=rx, rw=rw, tpe=tpe, multihot=routing_map.sum(dim=0)))
        self.legs = legs
        self.ref_ys = [y.detach() for y in ys]
        self.ref_out = ref.ht_combine(inputs, self.ref_ys, r, self.Ew, R)
        # Backward: the combine's gradient is a cached dispatch of the output gradients...
        grads = [dict(x=metas[s]["inp"]["grad_out"].reshape(-1, self.Hd),
                      topk_idx=inputs[s]["topk_idx"]) for s in range(R)]
        gxs, gws = [], []
        for d in range(R):
            gy = ref.ht_dispatch(grads, d, self.Ew, R)["recv_x"]
            legs[d]["gy"] = gy
            gx, gw = torch.autograd.grad(ys[d], (legs[d]["rx"], legs[d]["rw"]), gy)
            gxs.append(gx)
            gws.append(gw)
        # ...and the dispatch's gradient a combine: x's rows summed over the ranks, the weights'
        # rows too (float32, ranks ascending, docs/semantics.md §1.6).
        self.ref_gy = legs[r]["gy"]
        self.ref_gxs, self.ref_gws = gxs, gws
        self.ref_grad_x = ref.ht_combine(inputs, gxs, r, self.Ew, R)
        self.ref_grad_probs = _combined_weights(inputs, gws, r, self.Ew, R)
        self.ref_grad_scores = torch.autograd.grad(metas[r]["probs"], metas[r]["scores"],
                                                   self.ref_grad_probs)[0]

    # ---- the checks
    def check_forward(self):
        what, r, R = self.what, self.r, self.R
        kind, buffer, layout, raw = self.dispatch_raw
        assert kind == "dispatch", what
        ht._check_recv(self.view, self.ref_inputs, raw, self.Ew, 1, what)
        per_rank, per_rdma_rank, per_expert, in_rank = layout
        want_rank, want_expert, want_in_rank = ref.ht_layout(self.ref_inputs[r]["topk_idx"],
                                                             self.Ew, R)
        assert per_rdma_rank is None, what  # one node
        assert torch.equal(per_rank.cpu(), want_rank), what
        assert torch.equal(per_expert.cpu(), want_expert), what
        assert torch.equal(in_rank.cpu(), want_in_rank), what
        leg = self.legs[r]
        # tokens_per_expert: torch.tensor of the list (int64, CPU), equal to what was received
        # per local expert, which Megatron's permute relies on (num_out_tokens = its sum).
        tpe = self.tokens_per_expert
        assert torch.equal(tpe, leg["tpe"]), what
        assert torch.equal(tpe, self.multihot_counts), what
        kind, _, handle, (combined, combined_w) = self.combine_raw
        assert kind == "combine" and combined_w is None, what
        assert torch.equal(self.out.reshape(-1, self.Hd), self.ref_out), what + " layer output"

    def check_backward(self):
        what = self.what
        _, _, handle, out = self.combine_bwd_raw
        assert handle is self.dispatch_raw[3][4], what
        assert out[1:5] == (None, None, None, None), what
        assert torch.equal(out[0].cpu(), self.ref_gy), what + " combine backward (cached dispatch)"
        _, _, handle, (gx, gw) = self.dispatch_bwd_raw
        assert torch.equal(gx.cpu(), self.ref_grad_x), what + " dispatch backward (combine)"
        assert gw.dtype == torch.float32, what
        assert torch.equal(gw.cpu(), self.ref_grad_probs), what + " dispatch backward (weights)"
        assert torch.equal(self.x.grad, self.ref_grad_x.view(self.x.shape)), what + " x.grad"
        assert torch.equal(self.scores.grad, self.ref_grad_scores), what + " scores.grad"


def _combined_weights(inputs, ws, rank, E, R):
    """combined_topk_weights of `rank` (docs/semantics.md §1.6): per token, the float32 sum over
    the ranks d it went to, ascending from 0.0f, of the row rank d passed for it."""
    idx = inputs[rank]["topk_idx"]
    acc = torch.zeros(idx.shape[0], ws[0].shape[1], dtype=torch.float32)
    for d in range(R):
        before = sum(int(ref.goes_to(inputs[s]["topk_idx"], d, E, R).sum()) for s in range(rank))
        sel = ref.goes_to(idx, d, E, R).nonzero().flatten()
        acc[sel] = ref.f32_add(acc[sel], ws[d][before:before + len(sel)].to(torch.float32))
    return acc


def _reset():
    """A fresh process's fused_a2a.py state (no buffer yet), DeepEP's default SM budget."""
    _STATE.buffer = None
    _STATE.made = []
    del _TRACE[:]
    Buffer.set_num_sms(20)


def _run_layer(layer):
    layer.forward()
    layer.reference()
    layer.check_forward()
    layer.backward()
    layer.check_backward()
    return layer


# ---- bodies -------------------------------------------------------------------------------------

def _variants(R):
    """(tp, capacity, router dtype): TP x EP spreading where R is even, token drops with a
    capacity factor (-1 slots, tokens that go nowhere), float32 / float64 / bf16 router probs."""
    out = [(1, False, "fp32"), (1, True, "fp64"), (1, False, "bf16")]
    if R % 2 == 0:
        out += [(2, False, "fp32"), (2, True, "fp32")]
    return out


def body_training_step(ctx, seed, async_finish):
    """One MoE layer, forward and backward, per variant, as MoEFlexTokenDispatcher runs it
    (async_finish=True, allocate_on_comm_stream=True: the MoE layer's call) or as the manager's
    defaults do (False, False). get_buffer makes one Buffer for the whole run."""
    R, r = ctx.world_size, ctx.rank
    _reset()
    try:
        for i, (tp, capacity, router) in enumerate(_variants(R)):
            E = 2 * (R // tp) if i % 2 else 4 * (R // tp)
            _run_layer(_Layer(ctx, ctx.group, R, r, seed + i, H, E, tp=tp, capacity=capacity,
                              router_dtype=router, async_finish=async_finish,
                              allocate_on_comm_stream=async_finish))
        assert len(_STATE.made) == 1, (seed, len(_STATE.made))
        b = _STATE.made[0]
        assert b.group is ctx.group and b.rank == r and b.group_size == R
        assert (b.num_nvl_bytes, b.num_rdma_bytes) == _STATE.wanted_bytes(ctx.group, H * 2)
    finally:
        _reset()


def body_buffer_reuse(ctx, seed, async_finish):
    """get_buffer's reallocation across layers of different hidden sizes and SM budgets, with
    microbatches interleaved as a pipeline schedule runs them (forwards of several layers and
    microbatches before their backwards): a backward then runs on a newer Buffer than the one
    whose handle it holds (get_buffer returns the current one), and handles of one buffer stay
    in use across later dispatches. set_deepep_num_sms / Buffer.set_num_sms in between."""
    R, r = ctx.world_size, ctx.rank
    _reset()
    try:
        E = 2 * R
        made = lambda: len(_STATE.made)  # noqa: E731

        def layer(i, hidden, tokens=lambda s: 3 + 2 * s, num_sms=None):
            return _Layer(ctx, ctx.group, R, r, seed + i, hidden, E, async_finish=async_finish,
                          allocate_on_comm_stream=async_finish, tokens=tokens, num_sms=num_sms)

        # Layer 0 has H = 128, layer 1 H = 256; l<layer>_<microbatch>.
        l0_0 = layer(0, 128)
        l0_0.forward()
        assert made() == 1 and Buffer.num_sms == 20, seed
        buf1 = _STATE.buffer
        assert (buf1.num_nvl_bytes, buf1.num_rdma_bytes) == _STATE.wanted_bytes(ctx.group, 256)
        l1_0 = layer(1, 256)
        l1_0.forward()
        assert made() == 2 and _STATE.buffer is not buf1, seed  # larger hint: a new Buffer
        buf2 = _STATE.buffer
        l0_1 = layer(2, 128, tokens=lambda s: 20 + s)  # more tokens: epx's own buffer grows
        l0_1.forward()
        assert made() == 2 and _STATE.buffer is buf2, seed  # large enough: kept
        for lay in (l1_0, l0_0, l0_1):
            lay.reference()
            lay.check_forward()
        # Backward of microbatch 0, layer 1 then layer 0: layer 0's handle is buf1's, while
        # get_buffer hands its backward buf2.
        l1_0.backward()
        l1_0.check_backward()
        l0_0.backward()
        assert l0_0.combine_bwd_raw[1] is buf2 and l0_0.dispatch_raw[1] is buf1, seed
        l0_0.check_backward()

        # Another SM budget (layers of a dispatcher built with moe_flex_dispatcher_num_sms=24,
        # whose construction calls set_deepep_num_sms(24)): the hints grow, the next get_buffer
        # of the larger hidden size reallocates.
        l1_1 = layer(3, 256, num_sms=24)
        l1_1.forward()
        assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(R).num_sms == 24
        assert Buffer.get_combine_config(R).num_sms == 24
        assert made() == 3 and _STATE.buffer is not buf2, seed
        buf3 = _STATE.buffer
        assert (buf3.num_nvl_bytes, buf3.num_rdma_bytes) == _STATE.wanted_bytes(ctx.group, 512)
        l0_2 = layer(4, 128, num_sms=24)
        l0_2.forward()
        assert made() == 3, seed
        for lay in (l1_1, l0_2):
            lay.reference()
            lay.check_forward()
        # Backwards out of order: l0_1 (buf2's handle, after l1_1's and l0_2's dispatches on
        # buf3), then l0_2, then l1_1.
        for lay in (l0_1, l0_2, l1_1):
            lay.backward()
            lay.check_backward()
        # Back to 20 SMs: smaller hints, the current Buffer serves.
        l0_3 = _run_layer(layer(5, 128))
        assert Buffer.num_sms == 20 and made() == 3 and l0_3.dispatch_raw[1] is buf3, seed
    finally:
        _reset()


def body_ep_subgroups(ctx, seed, size, async_finish):
    """The flex dispatcher's group is the TP x EP group, a subgroup of the world (data-parallel
    replicas beside it): concurrent layers in disjoint subgroups, get_buffer's group rule (a
    Buffer per group), exact results per subgroup."""
    R, r = ctx.world_size, ctx.rank
    group = ctx.subgroup(size)  # Megatron's TP x EP group
    sub_r = dist.get_rank(group)
    assert group.size() == size and sub_r == r % size
    _reset()
    try:
        first = r // size  # each subgroup its own seed: different data in each
        for i, (tp, capacity, router) in enumerate(_variants(size)[:3]):
            _run_layer(_Layer(ctx, group, size, sub_r, seed + 100 * first + i, H, 2 * size,
                              tp=tp, capacity=capacity, router_dtype=router,
                              async_finish=async_finish, allocate_on_comm_stream=async_finish))
        assert len(_STATE.made) == 1 and _STATE.buffer.group is group
        assert (_STATE.buffer.rank, _STATE.buffer.group_size) == (sub_r, size)
        # The world group next: get_buffer's `group` rule makes a new Buffer for it.
        _run_layer(_Layer(ctx, ctx.group, R, r, seed + 7, H, 2 * R, async_finish=async_finish,
                          allocate_on_comm_stream=async_finish))
        assert len(_STATE.made) == 2 and _STATE.buffer.group is ctx.group
    finally:
        _reset()


# ---- tests --------------------------------------------------------------------------------------

def test_megatron_import_block():
    """fused_a2a.py's `from deep_ep import Buffer` and `from deep_ep.utils import EventHandle,
    EventOverlap` resolve, through the shim, to epx's drop-in; EventHandle() (Megatron's
    previous_event whenever async_finish is set) constructs and waits without CUDA."""
    assert deep_ep.__file__.startswith(shim.DIRECTORY), deep_ep.__file__
    assert deep_ep.Buffer is epx_deep_ep.Buffer
    assert IMPORT_ERROR is None, (
        f"Megatron's import block fails on the shim: {IMPORT_ERROR} (Megatron then sets "
        "HAVE_DEEP_EP = False and its DeepEP dispatcher raises 'DeepEP is not installed')")
    assert Buffer is epx_deep_ep.Buffer and EventOverlap is epx_deep_ep.EventOverlap
    ev = EventOverlap(EventHandle())
    ev.current_stream_wait()
    ev.event.current_stream_wait()
    with ev:
        pass


def test_set_deepep_num_sms_and_hints():
    """set_deepep_num_sms -> Buffer.set_num_sms -> get_dispatch_config / get_combine_config, and
    the hints get_buffer turns into byte sizes (larger for more SMs and larger rows)."""
    try:
        for n in (20, 24, 32, 2):
            _set_deepep_num_sms(n)
            assert Buffer.num_sms == n
            for R in (1, 2, 4, 8):
                for c in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
                    assert c.num_sms == n
                    assert c.get_rdma_buffer_size_hint(H * 2, R) == 0
                    small, big = (c.get_nvl_buffer_size_hint(b, R) for b in (256, 512))
                    assert 0 < small < big and small % 128 == 0, (n, R, small, big)
        _set_deepep_num_sms(20)
        low = Buffer.get_dispatch_config(8).get_nvl_buffer_size_hint(512, 8)
        _set_deepep_num_sms(24)
        assert Buffer.get_dispatch_config(8).get_nvl_buffer_size_hint(512, 8) > low
        with pytest.raises(epx.InvalidArgument, match="even"):
            _set_deepep_num_sms(25)
    finally:
        Buffer.set_num_sms(20)


@pytest.fixture(params=[1, 2, 4, 8], ids=lambda r: f"R{r}")
def mpool(request):
    """The CPU pools: R = 1, 2, 4, 8 (Megatron asserts TP x EP > 1 in MoEFlexTokenDispatcher; the
    fused_a2a.py layer itself runs at R = 1, and so does this replay)."""
    return get_pool(request.param)


ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async_finish")]


@pytest.mark.parametrize("async_finish", ASYNC)
def test_training_step(mpool, async_finish):
    mpool.run(body_training_step, _seed(), async_finish)


@pytest.mark.parametrize("async_finish", ASYNC)
def test_buffer_reuse_across_hidden_sizes(mpool, async_finish):
    mpool.run(body_buffer_reuse, _seed(), async_finish)


@pytest.mark.parametrize("R,size", [(4, 2), (8, 4)])
@pytest.mark.parametrize("async_finish", ASYNC)
def test_ep_subgroups(R, size, async_finish):
    get_pool(R).run(body_ep_subgroups, _seed(), size, async_finish)


# ---- GPU twins: the same bodies with CUDA tensors over NCCL, R = 1, 2, 4, 8 where there are
# ---- that many GPUs ------------------------------------------------------------------------------

GPU_BODIES = [(body_training_step, (True,)), (body_training_step, (False,)),
              (body_buffer_reuse, (True,))]


@pytest.mark.gpu
@pytest.mark.parametrize("body,args", GPU_BODIES, ids=[
    b.__name__ + "".join(f"-{a}" for a in args) for b, args in GPU_BODIES])
def test_gpu_megatron(gpu_pool, body, args):
    gpu_pool.run(body, _seed(), *args)


@pytest.mark.gpu
def test_gpu_megatron_ep_subgroups():
    reason = gpu_skip_reason(4)
    if reason:
        pytest.skip(reason)
    get_pool(4, "nccl").run(body_ep_subgroups, _seed(), 2, True)
