"""The torch bridge's ATen path (epx._epx_torch, docs/design.md §12) against the attribute path.

Checked: the module is loaded wherever CMake built it (a skip only where CMake skipped it, with
CMake's reason); every ht, ll and a2a op (epx.Buffer, epx.A2a, epx.Dispatcher, the DeepEP drop-in)
returns the same outputs, every element, dtype, shape, strides, storage offset, device and
requires_grad, with the path on and off (toggled on every rank in turn through the test hook
_epx._set_torch_aten, same inputs); input views of plain and unusual tensors (non-contiguous,
storage offset, expanded, zero-size, 0-dim, neg / conj bits, subclasses, wrong dtype, wrong
device, sparse, nested, too many dims, non-tensors) read the same or raise the same error, and
the ATen path handles exactly the plain ones; outputs the allocator makes are the same tensors,
under inference mode too, and the same error for an impossible size; _epx._alloc_stats counts
both; EPX_TORCH_BRIDGE=0, a bad value, a module that does not import and a module built for
another torch fall back (subprocesses) with one logged reason and no warning.
"""

import gc
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref
from conftest import get_pool
from epx import _epx, _torch


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _require_built():
    """Skips, with CMake's reason, where CMake did not build epx._epx_torch."""
    if not _epx.torch_aten_built:
        pytest.skip(f"CMake did not build epx._epx_torch: {_epx.torch_aten_note}")


def _require_aten():
    """Skips where the ATen path cannot be compared: CMake did not build it (its reason), or
    this environment turned it off (test_aten_loaded_where_built checks that case)."""
    _require_built()
    status = _torch.aten_status()
    if not status.active and os.environ.get("EPX_TORCH_BRIDGE") == "0":
        pytest.skip("EPX_TORCH_BRIDGE=0 in this environment")
    assert status.active, status.reason


def _with_aten(on, fn):
    was = _epx._set_torch_aten(on)
    try:
        assert _epx._torch_aten_active() == on
        return fn()
    finally:
        _epx._set_torch_aten(was)


def _snap(obj, ll_rows=None):
    """Everything observable of a result, tensors as bytes (a later call may overwrite a
    workspace view, so a snapshot is taken before the next op). ll_rows = (recv_count, R*T_max):
    rows past recv_count[l] of any [L, R*T_max, ...] tensor are undefined (docs/semantics.md
    §2.1: two allocations hold different bytes there) and read as zero."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        data = t.contiguous()
        if ll_rows is not None and t.dim() >= 2 and tuple(t.shape[:2]) == (len(ll_rows[0]),
                                                                          ll_rows[1]):
            data = data.clone()
            for l, n in enumerate(ll_rows[0]):
                data[l, n:] = 0
        data = data.reshape(-1)
        data = data if data.dtype == torch.uint8 else data.view(torch.uint8)
        return ("tensor", type(obj).__name__, str(t.dtype), tuple(t.shape), t.stride(),
                t.storage_offset(), str(t.device), obj.requires_grad, t.is_inference(),
                data.cpu().numpy().tobytes())
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_snap(o, ll_rows) for o in obj))
    if isinstance(obj, dict):
        return tuple((k, _snap(v, ll_rows)) for k, v in sorted(obj.items()))
    if isinstance(obj, (_epx.HtHandle, _epx.LlHandle)):
        names = sorted(n for n in dir(obj) if not n.startswith("_"))
        return (type(obj).__name__, tuple((n, _snap(getattr(obj, n), ll_rows)) for n in names))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return ("object", type(obj).__name__)  # hooks, EventOverlap, DeepEP's handle objects


def _on_and_off(run):
    """run() (a list of snapshots) with the ATen path on, then off: every rank does the same
    calls in the same order."""
    return _with_aten(True, run), _with_aten(False, run)


# ---- the module is there where CMake built it ---------------------------------------------------

def test_aten_loaded_where_built():
    _require_built()
    assert _epx.torch_aten_note == ""
    status = _torch.aten_status()
    if os.environ.get("EPX_TORCH_BRIDGE") == "0":
        assert status == (False, "EPX_TORCH_BRIDGE=0")
        return
    assert status == (True, ""), status.reason
    from epx import _epx_torch
    assert _epx_torch.torch_version == torch.__version__
    was = _epx._set_torch_aten(False)
    assert was and _torch.aten_status() == (False, "turned off by _epx._set_torch_aten(False)")
    _epx._set_torch_aten(True)
    assert _torch.aten_status().active


# ---- every op: the same outputs with the ATen path on and off -----------------------------------

def body_ht(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    H, K, E, T = 256, 3, 4 * R, 10
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, hidden=H, top_k=K, num_experts=E, max_tokens_per_rank=T)
    g = ref.generator(seed, r)
    # x with a storage offset; fp8 x as e4m3 bits (uint8 where torch has no fp8)
    x = torch.cat([ref.rand_bf16((1, H), g), ref.rand_bf16((T, H), g)])[1:]
    x2 = ref.rand_bf16((T, H), g)
    xq = ref.rand_fp8_bits((T, H), g).view(epx.fp8_dtype)
    scales = torch.rand(T, H // 128, generator=g) + 0.5
    idx = ref.routing("skewed", T, K, E, R, g)
    w = ref.rand_weights(T, K, g)
    bias0, bias1 = ref.rand_bf16((T, H), g), ref.rand_bf16((T, H), g)

    def run():
        out = [_snap(buf.ht_layout(idx))]
        d = buf.ht_dispatch(x, idx, w, expert_alignment=4)
        out.append(_snap(d))
        y = (d.recv_x.float() * 0.5).to(torch.bfloat16)
        out.append(_snap(buf.ht_combine(y, d.handle, d.recv_topk_weights, bias0, bias1)))
        out.append(_snap(buf.ht_dispatch(x2, handle=d.handle)))
        out.append(_snap(buf.ht_dispatch(xq, idx, w, x_scales=scales, num_worst_tokens=R * T)))
        z = buf.ht_dispatch(x, idx, zero_copy=True)
        out.append(_snap(z))
        view = buf.ht_combine_buffer(z.handle)
        view.copy_(z.recv_x)
        out.append(_snap(view))
        out.append(_snap(buf.ht_combine(view, z.handle, zero_copy=True)))
        return out

    on, off = _on_and_off(run)
    assert on == off


def _storage(t):
    """The address of t's storage (its allocation)."""
    return getattr(t, "untyped_storage", t.storage)().data_ptr()


def _ll_setup(ctx, seed):
    """A rank's ll buffer and its tokens on the rank's device: (H, K, E, T_max, T), the buffer,
    the generator, x [T, H] and topk_idx [T, K] (made in that order)."""
    R = ctx.world_size
    H, K, E, T_max, T = 256, 3, 2 * R, 8, 6
    buf = epx.Buffer(epx.Group.from_process_group(ctx.group), hidden=H, top_k=K, num_experts=E,
                     max_tokens_per_rank=T_max, enable_ht=False, enable_ll=True)
    g = ref.generator(seed, ctx.rank)
    x = ref.rand_bf16((T, H), g).to(ctx.device)
    idx = ref.routing("uniform", T, K, E, R, g).to(ctx.device)
    return (H, K, E, T_max, T), buf, g, x, idx


def body_ll(ctx, seed):
    R = ctx.world_size
    (H, K, E, T_max, T), buf, g, x, idx = _ll_setup(ctx, seed)
    w = ref.rand_weights(T, K, g)
    y = ref.rand_bf16((E // R, R * T_max, H), g)

    def run():
        out = []
        for fp8, round_scale, ue8m0, hook in ((False, False, False, False),
                                              (True, False, False, False),
                                              (True, True, True, True)):
            stats = torch.zeros(E // R, dtype=torch.int32)
            wait = torch.zeros(R, dtype=torch.int64)
            d = buf.ll_dispatch(x, idx, use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0,
                                return_recv_hook=hook, cumulative_local_expert_recv_stats=stats,
                                dispatch_wait_recv_cost_stats=wait)
            if hook:
                d.hook()
            rows = (d.recv_count.tolist(), R * T_max)
            out += [_snap(d, rows), _snap(stats), (wait.dtype, wait.shape)]  # waits: ns
            res = torch.full((T, H), 7.0, dtype=torch.bfloat16) if fp8 else None
            c = buf.ll_combine(y, idx, w, d.handle, return_recv_hook=hook, out=res,
                               combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int64))
            if hook:
                c.hook()
            out.append(_snap(c.out))
            d = buf.ll_dispatch(x, idx, use_fp8=fp8)
            out.append(_snap(d, (d.recv_count.tolist(), R * T_max)))
            view = buf.ll_next_combine_buffer(d.handle)
            view.copy_(y)
            out.append(_snap(view))
            out.append(_snap(buf.ll_combine(view, idx, w, d.handle, zero_copy=True)))
        return out

    on, off = _on_and_off(run)
    assert on == off
    # The handle's src_info and layout_range, two tensors in one allocation (to_torch's view
    # branch: int32 at an offset, int64 reshaped), eagerly and under inference_mode: the same
    # metadata, storage and bytes both ways. The attribute path makes them autograd views of the
    # block (eagerly: inference_mode records no view base); the ATen path makes plain tensors on
    # its storage (view_of: no _base), which need no more (their dtypes take no gradient).
    for inference in (False, True):
        with torch.inference_mode(inference):
            h = buf.ll_dispatch(x, idx, use_fp8=False).handle
            got = []
            for aten in (True, False):
                views = _with_aten(aten, lambda: (h.src_info, h.layout_range))
                for v in views:
                    if aten or inference:
                        assert v._base is None
                    else:
                        assert v._base.data_ptr() == views[1].data_ptr()
                    assert v.is_inference() == inference
                got.append([(_meta(v), v.data_ptr(), _storage(v), _snap(v)) for v in views])
            assert got[0] == got[1]
            assert got[0][0][0][1] == torch.int32 and got[0][1][0][1] == torch.int64
    # Two allocations per dispatch whatever the format (core/buffer_impl.h): recv_x with its
    # scales, the handle's block with recv_count; each tensor on its block's storage, both paths.
    for fmt in ({"use_fp8": False}, {"use_fp8": True},
                {"use_fp8": True, "round_scale": True, "use_ue8m0": True},
                {"use_fp8": False, "use_nvfp4": True, "x_global_scale": 300.0}):
        for aten in (True, False):
            _epx._alloc_stats(True)
            d = _with_aten(aten, lambda: buf.ll_dispatch(x, idx, **fmt))
            assert _epx._alloc_stats(True)[0] == 2, (fmt, aten)
            assert (_storage(d.recv_count) == _storage(d.handle.src_info) ==
                    _storage(d.handle.layout_range) != _storage(d.recv_x)), (fmt, aten)
            assert (d.recv_count.data_ptr() - _storage(d.recv_count)) % 128 == 0
            assert d.recv_scales is None or (
                _storage(d.recv_scales) == _storage(d.recv_x) and
                (d.recv_scales.data_ptr() - _storage(d.recv_x)) % 128 == 0)


def body_a2a(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    H, K, E, M, T = 64, 2, 2 * R, 6, 5
    group = epx.Group.from_process_group(ctx.group)
    a2a = epx.A2a(group, max_tokens_per_rank=M, top_k=K, num_experts=E,
                  payload_bytes_per_token=[H * 2, K * 4, K * 4], combine_bytes_per_token=H * 2)
    g = ref.generator(seed, r)
    idx = ref.routing("uniform", T, K, E, R, g).to(torch.int32)
    payloads = [ref.rand_bf16((T, H), g), idx, ref.rand_weights(T, K, g)]
    y = ref.rand_bf16((R, M, H), g)

    def run():
        out = [_snap(a2a.dispatch(idx, payloads, M))]
        out.append(_snap(a2a.combine(y, M)))
        out.append(_snap(a2a.dispatch(idx, payloads, T, invalid_expert_id=-1,
                                      expert_id_payload_index=1)))
        view = a2a.combine_payload_view(T, H, torch.bfloat16)
        view.copy_(y[:, :T])
        out.append(_snap(view))
        out.append(_snap(a2a.combine(view, T, payload_in_workspace=True)))
        return out

    on, off = _on_and_off(run)
    assert on == off


def body_dispatcher(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    H, K, E, T_max = 256, 3, 2 * R, 8
    g = ref.generator(seed, r)
    x = ref.rand_bf16((T_max - r % 2, H), g)
    idx = ref.routing("uniform", x.shape[0], K, E, R, g)
    w = ref.rand_weights(x.shape[0], K, g)
    out = []
    for backend, mode, quant in (("deepep", "normal", "bf16"), ("deepep", "normal", "fp8"),
                                 ("deepep", "low_latency", "fp8"), ("a2a", "normal", "bf16"),
                                 ("a2a", "normal", "nvfp4")):
        d = epx.Dispatcher(ctx.group, num_experts=E, hidden=H, top_k=K,
                           max_tokens_per_rank=T_max, backend=backend, mode=mode, quant=quant)

        def run():
            o = d.dispatch(x, idx, w, global_scale=224.0 if quant == "nvfp4" else None)
            y = ref.rand_bf16(tuple(o.x.shape[:-1]) + (H,), ref.generator(seed, r, "y"))
            rows = None if o.masked_m is None else (o.masked_m.tolist(), R * T_max)
            # moe_output_view is where the experts write (its bytes: an earlier combine's)
            view = o.moe_output_view
            meta = None if view is None else (view.dtype, view.shape, view.stride(), view.device)
            return [_snap(o._replace(moe_output_view=None), rows), meta, _snap(d.combine(y))]

        on, off = _on_and_off(run)
        assert on == off, (backend, mode, quant)
        out.append((backend, mode, quant))
    return out


def body_deep_ep(ctx, seed):
    R, r = ctx.world_size, ctx.rank
    H, K, E, T_max, T = 256, 3, 2 * R, 8, 6
    g = ref.generator(seed, r)
    x = ref.rand_bf16((T, H), g)
    idx = ref.routing("uniform", T, K, E, R, g)
    w = ref.rand_weights(T, K, g)
    y = ref.rand_bf16((E // R, R * T_max, H), g)
    ll = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    ht = deep_ep.Buffer(ctx.group)

    def run():
        stats = torch.zeros(E // R, dtype=torch.int32)
        d = ll.low_latency_dispatch(x, idx, T_max, E, cumulative_local_expert_recv_stats=stats,
                                    use_fp8=True)
        out = [_snap(d, (d[1].tolist(), R * T_max)), _snap(stats)]
        out.append(_snap(ll.low_latency_combine(y, idx, w, d[2])))
        layout = ht.get_dispatch_layout(idx, E)
        out.append(_snap(layout))
        recv = ht.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                           num_tokens_per_expert=layout[2], topk_idx=idx, topk_weights=w)
        out.append(_snap(recv))
        out.append(_snap(ht.combine(recv[0], recv[4], topk_weights=recv[2])))
        return out

    on, off = _on_and_off(run)
    assert on == off


def body_ll_views(ctx, seed):
    """The ll dispatch's outputs that view_of makes (fp8 recv_x, recv_count, src_info,
    layout_range, in their two blocks) on the rank's device, both paths, eagerly and under
    inference_mode: the same metadata, storage and bytes; the ATen path's have no _base. Kept
    alive by nothing but themselves, they still hold their values."""
    R = ctx.world_size
    (_, _, _, T_max, _), buf, _, x, idx = _ll_setup(ctx, seed)
    for inference in (False, True):
        with torch.inference_mode(inference):
            got = []
            for aten in (True, False):
                d = _with_aten(aten, lambda: buf.ll_dispatch(x, idx, use_fp8=True))
                rows = (d.recv_count.tolist(), R * T_max)
                views = _with_aten(aten, lambda: (d.recv_x, d.recv_count, d.handle.src_info,
                                                  d.handle.layout_range))
                for v in views:
                    assert v.device == ctx.device and v.is_inference() == inference
                    if aten:
                        assert v._base is None
                assert _storage(views[1]) == _storage(views[2]) == _storage(views[3])
                got.append([(_meta(v)[1:], v.data_ptr() - _storage(v), _snap(v, rows))
                            for v in views])
            assert got[0] == got[1]
    # A tensor view_of made keeps its block alive: the values stay once the dispatch's results
    # are gone and new blocks of the same size were handed out.
    d = buf.ll_dispatch(x, idx, use_fp8=True)
    kept = [d.recv_x, d.recv_count, d.handle.src_info, d.handle.layout_range]
    rows = (d.recv_count.tolist(), R * T_max)
    want = [_snap(t, rows) for t in kept]
    del d
    gc.collect()
    # Other values and another routing, so the new blocks' bytes differ from the kept ones.
    junk = [buf.ll_dispatch((x.float() + 1 + i).to(x.dtype), torch.roll(idx, 1 + i, 0),
                            use_fp8=True) for i in range(3)]
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    assert [_snap(t, rows) for t in kept] == want
    del junk
    return True


@pytest.mark.parametrize("R", [1, 2, 4], ids=lambda r: f"R{r}")
def test_ll_views_same_on_and_off(R):
    _require_aten()
    assert get_pool(R).run(body_ll_views, _seed()) == [True] * R


@pytest.mark.gpu  # skipped with the reason where there is no GPU (conftest.py)
def test_ll_views_cuda_same_on_and_off(gpu_pool):
    _require_aten()
    assert gpu_pool.run(body_ll_views, _seed()) == [True] * gpu_pool.world_size


@pytest.mark.parametrize("body", [body_ht, body_ll, body_a2a, body_dispatcher, body_deep_ep],
                         ids=lambda b: b.__name__[5:])
@pytest.mark.parametrize("R", [1, 2, 4], ids=lambda r: f"R{r}")
def test_ops_same_on_and_off(body, R):
    _require_aten()
    get_pool(R).run(body, _seed())


# ---- input views: the same reads and errors; the ATen path handles the plain ones ---------------

class _Sub(torch.Tensor):
    pass


class _Lying(torch.Tensor):
    """A subclass whose data_ptr differs from its storage's: the attribute path must see it."""

    def data_ptr(self):
        return 4096


def _plain():
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


_FP8 = torch.float8_e4m3fn if _torch.HAS_FP8 else torch.uint8
# name -> (tensor maker, whether the ATen path reads it itself)
_VIEW_CASES = {
    "contiguous": (_plain, True),
    "bf16": (lambda: torch.zeros(2, 3, 4, dtype=torch.bfloat16), True),
    "f16": (lambda: torch.zeros(5, dtype=torch.float16), True),
    "fp8": (lambda: torch.zeros(3, 8, dtype=_FP8), True),
    "i32": (lambda: torch.zeros(3, 2, dtype=torch.int32), True),
    "i64": (lambda: torch.zeros(3, 2, dtype=torch.int64), True),
    "u8": (lambda: torch.zeros(3, 2, dtype=torch.uint8), True),
    "bool": (lambda: torch.zeros(3, 2, dtype=torch.bool), True),
    "transposed": (lambda: _plain().t(), True),
    "strided_slice": (lambda: _plain()[:, ::2], True),
    "storage_offset": (lambda: _plain()[1:, 2:], True),
    "expanded": (lambda: torch.zeros(1, 6).expand(4, 6), True),
    "channels_last": (lambda: torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
                      True),
    "zero_size": (lambda: torch.empty(0, 5), True),
    "zero_size_inner": (lambda: torch.empty(3, 0), True),
    "zero_dim": (lambda: torch.tensor(2.5), True),
    "six_dims": (lambda: torch.zeros(1, 2, 1, 2, 1, 2), True),
    "seven_dims": (lambda: torch.zeros(1, 2, 1, 2, 1, 2, 1), False),
    "requires_grad": (lambda: torch.zeros(3, requires_grad=True), True),
    "non_leaf": (lambda: torch.zeros(3, requires_grad=True) * 2, True),
    "parameter": (lambda: torch.nn.Parameter(torch.zeros(3)), True),
    "inference": (lambda: _inference_tensor(), True),
    "named": (lambda: torch.zeros(2, 3, names=("a", "b")), True),
    "subclass": (lambda: _plain().as_subclass(_Sub), False),
    "subclass_data_ptr": (lambda: _plain().as_subclass(_Lying), False),
    "neg_bit": (lambda: torch._neg_view(_plain()), False),
    "conj_bit": (lambda: torch.zeros(3, dtype=torch.complex64).conj(), False),
    "zerotensor": (lambda: torch._efficientzerotensor(3), False),
    "float64": (lambda: torch.zeros(3, dtype=torch.float64), False),
    "int16": (lambda: torch.zeros(3, dtype=torch.int16), False),
    "int8": (lambda: torch.zeros(3, dtype=torch.int8), False),
    "complex64": (lambda: torch.zeros(3, dtype=torch.complex64), False),
    "quantized": (lambda: torch.quantize_per_tensor(_plain(), 0.1, 0, torch.quint8), False),
    "meta": (lambda: torch.empty(3, 4, device="meta"), False),
    "sparse": (lambda: _plain().to_sparse(), False),
    "nested": (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), False),
    "none": (lambda: None, False),
    "int": (lambda: 3, False),
    "list": (lambda: [1.0, 2.0], False),
    "numpy": (lambda: _plain().numpy(), False),
}


def _inference_tensor():
    with torch.inference_mode():
        return torch.zeros(3, 4)


def _read(obj):
    try:
        return ("ok", _epx._tensor_view(obj, "view test: argument 't'"))
    except Exception as e:  # noqa: BLE001 - the exact exception is what is compared
        return ("raises", type(e), str(e))


@pytest.mark.parametrize("name", list(_VIEW_CASES))
def test_view_same_as_attribute_path(name):
    _require_aten()
    make, handled = _VIEW_CASES[name]
    try:
        t = make()
    except (AttributeError, RuntimeError, TypeError) as e:
        pytest.skip(f"this torch {torch.__version__} cannot make it: {e}")
    on, off = _with_aten(True, lambda: _read(t)), _with_aten(False, lambda: _read(t))
    assert on == off
    aten = _with_aten(True, lambda: _epx._aten_view(t))
    assert (aten is not None) == handled, aten
    if handled:
        assert on == ("ok", aten) and aten[0] == t.data_ptr()
    if name == "subclass_data_ptr":
        assert on[0] == "ok" and on[1][0] == 4096  # the override, as before the ATen path


@pytest.mark.gpu
def test_view_cuda_same_as_attribute_path():
    _require_aten()
    for index in range(min(torch.cuda.device_count(), 2)):
        for t in (torch.zeros(3, 4, device=f"cuda:{index}"),
                  torch.zeros(4, 6, device=f"cuda:{index}", dtype=torch.bfloat16)[1:, ::2]):
            on, off = _with_aten(True, lambda: _read(t)), _with_aten(False, lambda: _read(t))
            assert on == off and on[1][4] == f"cuda:{index}"
            assert _with_aten(True, lambda: _epx._aten_view(t)) == on[1]


# ---- outputs: the same tensors from at::empty as from new_empty ---------------------------------

def _meta(t):
    return (type(t), t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), str(t.device),
            t.requires_grad, t.is_leaf, t.is_contiguous(), t.is_inference(), t.grad_fn)


@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3), (1, 2, 3, 4, 5, 6)],
                         ids=str)
def test_allocation_same_on_and_off(shape):
    _require_aten()
    devices = [-1] + ([0] if torch.cuda.is_available() and epx.built_with_cuda else [])
    for device in devices:
        for code in range(len(_epx.dtype_names)):
            made = [_with_aten(on, lambda: _epx._torch_empty(code, list(shape), device))
                    for on in (True, False)]
            assert _meta(made[0]) == _meta(made[1]), (_epx.dtype_names[code], device)
            assert made[0].dtype == _torch.DTYPE_OF[code]
            with torch.inference_mode():
                inf = [_with_aten(on, lambda: _epx._torch_empty(code, list(shape), device))
                       for on in (True, False)]
            assert _meta(inf[0]) == _meta(inf[1]) and inf[0].is_inference()


def test_allocation_error_same_on_and_off():
    _require_aten()

    def huge():
        try:
            _epx._torch_empty(2, [1 << 50], -1)  # f32, 4 PiB
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e), str(e)
        return None

    on, off = _with_aten(True, huge), _with_aten(False, huge)
    assert on is not None and on == off


def test_alloc_stats_count_both_paths():
    _require_aten()
    for on in (True, False):
        _epx._alloc_stats(True)
        _with_aten(on, lambda: [_epx._torch_empty(0, [4, 8], -1) for _ in range(5)])
        calls, ns = _epx._alloc_stats(True)
        assert calls == 5 and ns > 0, on


# ---- the switch and the fallbacks (fresh interpreters) ------------------------------------------

_PROBE = textwrap.dedent("""
    import logging, sys, warnings
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("epx").addHandler(Keep())
    logging.getLogger("epx").setLevel(logging.INFO)
    {setup}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, epx
        from epx import _epx, _torch
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, 1:]
        assert _epx._tensor_view(t, "t")[2:] == ((2, 2), (3, 1), "cpu")
        assert _epx._torch_empty(0, [2, 3], -1).shape == (2, 3)
    status = _torch.aten_status()
    print(repr((status.active, status.reason, records,
                [str(w.message) for w in caught if "epx" in str(w.filename)])))
""")


def _probe(setup="", env=None):
    full = dict(os.environ)
    full.pop("EPX_TORCH_BRIDGE", None)
    full.update(env or {})
    code = _PROBE.format(setup=setup)
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_switch_off_and_on():
    _require_built()
    assert _probe(env={"EPX_TORCH_BRIDGE": "0"}) == (
        False, "EPX_TORCH_BRIDGE=0", ["epx: the torch bridge's ATen path is off: "
                                      "EPX_TORCH_BRIDGE=0"], [])
    assert _probe(env={"EPX_TORCH_BRIDGE": "1"}) == (True, "", [], [])
    assert _probe() == (True, "", [], [])


def test_switch_bad_value():
    active, reason, records, warned = _probe(env={"EPX_TORCH_BRIDGE": "yes"})
    assert not active and len(records) == 1 and not warned
    if _epx.torch_aten_built:
        assert "environment variable EPX_TORCH_BRIDGE is 'yes'" in reason
    # Creating a group names the variable, as for every EPX_* variable.
    code = ("import epx, uuid\nfrom epx import _epx\n"
            "try:\n    _epx.Group.cpu_threads(0, 1, uuid.uuid4().hex)\n"
            "except epx.InvalidArgument as e:\n    print(e)\n")
    env = dict(os.environ, EPX_TORCH_BRIDGE="yes")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "environment variable EPX_TORCH_BRIDGE is 'yes'" in out.stdout, out.stderr


@pytest.mark.parametrize("setup,expect", [
    ("sys.modules['epx._epx_torch'] = None", "epx._epx_torch does not import ("),
    ("import types; m = types.ModuleType('epx._epx_torch'); m.torch_version = '0.0-other'; "
     "sys.modules['epx._epx_torch'] = m", "epx._epx_torch was built against torch 0.0-other"),
], ids=["import_fails", "other_torch"])
def test_fallback_when_the_module_does_not_load(setup, expect):
    _require_built()
    active, reason, records, warned = _probe(setup=setup)
    assert not active and reason.startswith(expect), reason
    assert records == [f"epx: the torch bridge's ATen path is off: {reason}"] and not warned
