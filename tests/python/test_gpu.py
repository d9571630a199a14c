"""GPU tier: the same rank bodies as the CPU tier, on one GPU per rank over an NCCL group (epx's
cuda backend). Collected everywhere; skipped with the reason where there is no GPU or epx was
built without CUDA (conftest.py)."""

import random

import pytest
import torch

import epx
import test_deep_ep_ht as ht
import test_deep_ep_ll as ll
import test_epx
import test_flashinfer as a2a
import test_ll_overlap as overlap
import test_nvfp4 as nvfp4
from conftest import gpu_skip_reason

pytestmark = pytest.mark.gpu


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def body_group(ctx, seed):
    g = epx.Group.from_process_group(ctx.group)
    assert (g.rank, g.size, g.backend) == (ctx.rank, ctx.world_size, "cuda")


def test_gpu_group_from_nccl(gpu_pool):
    gpu_pool.run(body_group, _seed())


@pytest.mark.parametrize("body", [ht.body_ht_layout, ht.body_ht_roundtrip, ht.body_ht_worst_case,
                                  ht.body_ht_growth_and_events, ht.body_ht_errors],
                         ids=lambda b: b.__name__)
def test_gpu_deep_ep_normal(gpu_pool, body):
    gpu_pool.run(body, _seed())


@pytest.mark.parametrize("body", [ll.body_ll_roundtrip, ll.body_ll_hook_zero_copy_out,
                                  ll.body_ll_staggered_destroy, ll.body_ll_wait_stats,
                                  ll.body_ll_logfmt],
                         ids=lambda b: b.__name__)
def test_gpu_deep_ep_low_latency(gpu_pool, body):
    gpu_pool.run(body, _seed())


@pytest.mark.parametrize("body", [nvfp4.body_native_nvfp4, nvfp4.body_deep_ep_nvfp4],
                         ids=lambda b: b.__name__)
def test_gpu_ll_nvfp4(gpu_pool, body):
    """NVFP4 ll dispatch (epx.Buffer and the DeepEP drop-in) on the cuda backend, every valid
    byte and scale against reference.py (test_nvfp4.py)."""
    gpu_pool.run(body, _seed())


@pytest.mark.parametrize("hooked", [False, True], ids=["fused", "hooks_zero_copy"])
def test_gpu_deep_ep_low_latency_graph(gpu_pool, hooked):
    """epx.compat.deep_ep's low-latency calls captured with torch.cuda.graph and replayed on new
    inputs, every replay checked (test_deep_ep_ll.body_ll_graph)."""
    assert gpu_pool.run(ll.body_ll_graph, _seed(), hooked) == [20] * gpu_pool.world_size


@pytest.mark.parametrize("body", [overlap.body_native, overlap.body_dispatcher,
                                  overlap.body_compat, overlap.body_compat_errors],
                         ids=lambda b: b.__name__)
def test_gpu_ll_overlap(gpu_pool, body):
    """The overlapped ll combine through Python on the cuda backend: the stand-in GEMM on the
    main stream, the combine on a side stream (test_ll_overlap.py)."""
    gpu_pool.run(body, _seed())


def test_gpu_deep_ep_normal_graph(gpu_pool):
    """epx.compat.deep_ep's worst-case normal-mode dispatch + combine captured with
    torch.cuda.graph and replayed on new inputs, every replay checked
    (test_deep_ep_ht.body_ht_graph)."""
    assert gpu_pool.run(ht.body_ht_graph, _seed()) == [20] * gpu_pool.world_size


def test_gpu_ht_zero_copy(gpu_pool):
    gpu_pool.run(test_epx.body_native_ht_zero_copy, _seed())


def test_gpu_flashinfer_a2a(gpu_pool):
    gpu_pool.run(a2a.body_a2a_roundtrip, _seed())


def test_gpu_flashinfer_f16_combine(gpu_pool):
    """float16 payloads: the f32 sum rounded once to float16 (overflow to +-inf, subnormals,
    NaN), bit for bit with torch's rounding (test_flashinfer.body_a2a_f16_combine)."""
    gpu_pool.run(a2a.body_a2a_f16_combine, _seed())


def test_gpu_flashinfer_shared_workspace(gpu_pool):
    """MoeAlltoAll objects of one workspace share epx's group and A2a; one A2a per payload list
    (test_flashinfer.body_a2a_shared_workspace)."""
    gpu_pool.run(a2a.body_a2a_shared_workspace, _seed())


def test_gpu_flashinfer_any_dtype(gpu_pool):
    """Payloads of any dtype travel as their bytes (test_flashinfer.body_a2a_any_dtype)."""
    gpu_pool.run(a2a.body_a2a_any_dtype, _seed())


def test_gpu_flashinfer_sized_workspace(gpu_pool):
    """moe_a2a_get_workspace_size_per_rank's size on the cuda layout holds odd-sized payloads and
    the combine (test_flashinfer.body_a2a_sized_workspace)."""
    gpu_pool.run(a2a.body_a2a_sized_workspace, _seed())


@pytest.mark.parametrize("in_ws", [False, True], ids=["copied", "payload_in_workspace"])
def test_gpu_flashinfer_a2a_graph(gpu_pool, in_ws):
    """epx.compat.flashinfer's MoeAlltoAll dispatch + combine captured with torch.cuda.graph and
    replayed on new inputs, every replay checked (test_flashinfer.body_a2a_graph)."""
    assert gpu_pool.run(a2a.body_a2a_graph, _seed(), in_ws) == [20] * gpu_pool.world_size


def test_gpu_tensor_bridge():
    """CUDA tensors cross as device views on the current stream; outputs come from the caching
    allocator (torch.cuda.memory_allocated grows by the output sizes)."""
    reason = gpu_skip_reason(1)
    if reason:
        pytest.skip(reason)
    from epx import _torch
    x = torch.zeros(4, 8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert _torch.stream_of(x) == s.cuda_stream
    assert _torch.device_key(x) == f"cuda:{torch.cuda.current_device()}"
