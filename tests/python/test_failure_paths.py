"""Issue 25, the failure paths through the Python package (cpu backend): invalid environment
variables and group options raise epx.InvalidArgument at group creation naming the variable, the
value and the range; absurd sizes are epx.OutOfCapacity before anything is mapped; a rank that
never arrives or is killed makes the survivors raise epx.Timeout and leaves no /dev/shm segment of
the group behind; fp8 x without its scales and wrong handle types are epx.InvalidArgument naming
the argument (never printing a tensor)."""

import math
import multiprocessing
import os
import signal
import uuid

import pytest
import torch

import epx
from epx import _epx
from epx.compat import deep_ep

TIMEOUT_RANGE = "expected an integer 1..86400000 (milliseconds; unset: 30000)"


class OneRank:
    """A communicator of one rank (Get_rank / Get_size / allgather) that remembers the group name
    epx picks, so a test can look for its segments in /dev/shm."""

    def __init__(self):
        self.names = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        self.names.append(obj)
        return [obj]


class NamedComm:
    """A communicator over a torch ProcessGroup that remembers the group name (rank 0's)."""

    def __init__(self, group):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.names = []

    def Get_rank(self):
        return self.dist.get_rank(self.group)

    def Get_size(self):
        return self.dist.get_world_size(self.group)

    def allgather(self, obj):
        out = [None] * self.Get_size()
        self.dist.all_gather_object(out, obj, group=self.group)
        self.names.append(out[0])
        return out


def shm_entries(name):
    """The /dev/shm entries of the epx group `name` ("<name>.ctl", "<name>.<seq>.<rank>")."""
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(name + "."))


def one_rank_group(**kw):
    comm = OneRank()
    return epx.Group.from_comm(comm, **kw), comm


# ---- A: environment variables and group options ---------------------------------------------

BAD_ENV = [
    ("EPX_TIMEOUT_MS", "abc", TIMEOUT_RANGE),
    ("EPX_TIMEOUT_MS", "-5", TIMEOUT_RANGE),
    ("EPX_TIMEOUT_MS", "0", TIMEOUT_RANGE),
    ("EPX_TIMEOUT_MS", "1500ms", TIMEOUT_RANGE),
    ("EPX_TIMEOUT_MS", "99999999999999999999999", TIMEOUT_RANGE),
    ("EPX_NUM_SMS", "-3", "expected an integer 0..1024 (0 or unset: auto)"),
    ("EPX_NUM_SMS", "1025", "expected an integer 0..1024"),
    ("EPX_PDL", "off", "expected 1 (programmatic dependent launch for the ht and ll kernels)"),
    ("EPX_ONE_GPU_SIDE_STREAMS", "yes", "expected 1"),
]


@pytest.mark.parametrize("name,value,expected", BAD_ENV,
                         ids=[f"{n}={v}" for n, v, _ in BAD_ENV])
def test_invalid_environment_raises_at_group_creation(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(epx.InvalidArgument) as info:
        one_rank_group()
    msg = str(info.value)
    assert f"Group::cpu_processes: environment variable {name} is '{value}'" in msg, msg
    assert expected in msg, msg
    # Explicit options do not hide it.
    with pytest.raises(epx.InvalidArgument, match=name):
        one_rank_group(timeout=2, num_sms=4)


def test_valid_environment_and_the_options_that_win(monkeypatch):
    monkeypatch.setenv("EPX_TIMEOUT_MS", "1500")
    assert one_rank_group()[0].timeout == 1.5
    assert one_rank_group(timeout=0.7)[0].timeout == 0.7
    monkeypatch.setenv("EPX_TIMEOUT_MS", "")  # empty counts as unset
    assert one_rank_group()[0].timeout == _epx.DEFAULT_TIMEOUT_MS / 1000
    monkeypatch.setenv("EPX_NUM_SMS", "24")
    assert one_rank_group()[0].num_sms == 24


@pytest.mark.parametrize("timeout", [0, -1, 0.0001, 86400.5, math.nan, math.inf, "abc", True])
def test_group_timeout_range_is_the_cpp_one(timeout):
    assert _epx.MAX_TIMEOUT_MS == 86400000
    with pytest.raises(epx.InvalidArgument) as info:
        one_rank_group(timeout=timeout)
    msg = str(info.value)
    assert "Group.from_comm: argument 'timeout' is" in msg, msg
    assert "expected 0.001..86400 s (None: EPX_TIMEOUT_MS, else 30 s)" in msg, msg


@pytest.mark.parametrize("num_sms", [-1, 1025, True, 1.5])
def test_group_num_sms_range_is_the_cpp_one(num_sms):
    assert _epx.MAX_NUM_SMS == 1024
    with pytest.raises(epx.InvalidArgument) as info:
        one_rank_group(num_sms=num_sms)
    assert "argument 'num_sms' is" in str(info.value)
    assert "expected an int 0..1024 (0: EPX_NUM_SMS, else auto)" in str(info.value)


def test_group_range_edges_are_accepted():
    g, _ = one_rank_group(timeout=86400, num_sms=1024)
    assert g.timeout == 86400 and g.num_sms == 1024
    g, _ = one_rank_group(timeout=0.001, num_sms=0)
    assert g.timeout == 0.001


def body_env_every_rank(ctx):
    old = os.environ.get("EPX_TIMEOUT_MS")
    os.environ["EPX_TIMEOUT_MS"] = "-5"
    try:
        with pytest.raises(epx.InvalidArgument,
                           match="environment variable EPX_TIMEOUT_MS is '-5'"):
            epx.Group.from_process_group(ctx.group)
    finally:
        if old is None:
            os.environ.pop("EPX_TIMEOUT_MS")
        else:
            os.environ["EPX_TIMEOUT_MS"] = old
    return True


def test_invalid_environment_raises_on_every_rank(pool2):
    assert pool2.run(body_env_every_rank) == [True, True]


# ---- D: absurd sizes -------------------------------------------------------------------------

def test_absurd_sizes_are_out_of_capacity_before_mapping():
    g, comm = one_rank_group(timeout=5)
    name = comm.names[0]
    limit = "more than the 1099511627776 bytes (1 TiB) one allocation may take"
    with pytest.raises(epx.OutOfCapacity) as info:
        epx.Buffer(g, hidden=128, top_k=2, num_experts=2, max_tokens_per_rank=2 ** 40)
    msg = str(info.value)
    assert "Buffer: shape.max_tokens_per_rank = 1099511627776 and shape.hidden = 128" in msg
    assert " bytes of symmetric memory per rank for ht on 1 rank (cpu backend)" in msg
    assert limit in msg
    with pytest.raises(epx.OutOfCapacity, match="shape.hidden = 4611686018427387904 .* need "
                                                "more than 2\\^64 bytes"):
        epx.Buffer(g, hidden=2 ** 62, top_k=2, num_experts=2, max_tokens_per_rank=4)
    with pytest.raises(epx.OutOfCapacity, match="shape.num_experts = 1048576 need .* for ll"):
        epx.Buffer(g, hidden=7168, top_k=8, num_experts=2 ** 20, max_tokens_per_rank=4096,
                   enable_ht=False, enable_ll=True)
    with pytest.raises(epx.OutOfCapacity, match="A2a: shape.max_tokens_per_rank = 1099511627776"):
        epx.A2a(g, 2 ** 40, 2, 2, [512], 512)
    with pytest.raises(epx.OutOfCapacity, match="Buffer::bytes_needed: "):
        epx.Buffer.bytes_needed("ht", 128, 2, 2, 2 ** 40, 1)
    with pytest.raises(epx.OutOfCapacity, match="A2a::workspace_bytes: "):
        epx.A2a.workspace_bytes(2 ** 40, 2, 2, [512], 512, 1)
    assert shm_entries(name) == []
    # The group is still usable: nothing collective was started.
    b = epx.Buffer(g, hidden=128, top_k=2, num_experts=2, max_tokens_per_rank=4)
    assert b.bytes_allocated > 0
    del b
    assert shm_entries(name) == []


# ---- D: a rank that never arrives (rank pool) ------------------------------------------------

def body_never_arrives(ctx, what):
    comm = NamedComm(ctx.group)
    g = epx.Group.from_comm(comm, timeout=1.0)
    name = comm.names[0]
    if ctx.rank == 0:
        with pytest.raises(epx.Timeout, match=r"ranks \[1\]"):
            if what == "buffer":
                epx.Buffer(g, hidden=256, top_k=2, num_experts=4, max_tokens_per_rank=8)
            elif what == "ll":
                epx.Buffer(g, hidden=256, top_k=2, num_experts=4, max_tokens_per_rank=8,
                           enable_ht=False, enable_ll=True)
            else:
                epx.A2a(g, 8, 2, 4, [512], 512)
    return name


@pytest.mark.parametrize("what", ["buffer", "ll", "a2a"])
def test_rank_that_never_arrives_leaves_no_segment(pool2, what):
    names = pool2.run(body_never_arrives, what)
    assert names[0] == names[1]
    assert shm_entries(names[0]) == []


# ---- D: killed ranks (their own processes: a pool rank must not die) -------------------------

def _killed_worker(rank, name, case, barrier, results):
    import epx as ep

    class Fixed:
        def Get_rank(self):
            return rank

        def Get_size(self):
            return 2

        def allgather(self, obj):
            return [name, name]

    try:
        barrier.wait(60)  # both imported: the group's short timeout covers only the join
        g = ep.Group.from_comm(Fixed(), timeout=1.0)
        if rank == 1 and case == "first":
            os.kill(os.getpid(), signal.SIGKILL)
        if case == "first":
            seen = []
            for make in (
                    lambda: ep.Buffer(g, hidden=256, top_k=2, num_experts=4,
                                      max_tokens_per_rank=8),
                    lambda: ep.Buffer(g, hidden=256, top_k=2, num_experts=4,
                                      max_tokens_per_rank=8, enable_ht=False, enable_ll=True),
                    lambda: ep.A2a(g, 8, 2, 4, [512], 512)):
                try:
                    make()
                    seen.append("no error")
                except ep.EpxError as e:
                    seen.append(f"{type(e).__name__}: {e}")
            results.put((rank, seen))
            return
        buf = ep.Buffer(g, hidden=256, top_k=2, num_experts=4, max_tokens_per_rank=8)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.zeros(4, 256, dtype=torch.bfloat16)
        idx = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]])
        try:
            buf.ht_dispatch(x, idx)
            seen = ["no error"]
        except ep.EpxError as e:
            seen = [f"{type(e).__name__}: {e}"]
        del buf
        results.put((rank, seen))
    except BaseException as e:  # noqa: BLE001 (reported to the test)
        results.put((rank, [f"worker failed: {type(e).__name__}: {e}"]))


@pytest.mark.parametrize("case", ["first", "after_buffer"])
def test_killed_rank_raises_timeout_and_leaves_no_segment(case):
    ctx = multiprocessing.get_context("spawn")
    name = f"epx-test-kill-{uuid.uuid4().hex}"
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_killed_worker, args=(r, name, case, barrier, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        rank, seen = results.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert rank == 0, seen
    assert procs[1].exitcode == -signal.SIGKILL
    assert seen and all(s.startswith("Timeout: ") and "ranks [1]" in s for s in seen), seen
    assert shm_entries(name) == []


# ---- C: messages -------------------------------------------------------------------------------

def _fp8_like(T, H):
    """An fp8 x as this torch holds it (float8_e4m3fn, or uint8 on torch 1.13), and uint8."""
    out = [torch.zeros(T, H, dtype=torch.uint8)]
    if epx.fp8_dtype is not torch.uint8:
        out.append(torch.zeros(T, H).to(epx.fp8_dtype))
    return out


def test_fp8_x_without_scales_names_the_scales():
    g, _ = one_rank_group(timeout=5)
    buf = epx.Buffer(g, hidden=256, top_k=2, num_experts=2, max_tokens_per_rank=8,
                     enable_ll=True)
    idx = torch.tensor([[0, 1], [1, 0], [0, -1], [1, -1]])
    for x in _fp8_like(4, 256):
        with pytest.raises(epx.InvalidArgument) as info:
            buf.ht_dispatch(x, idx)
        msg = str(info.value)
        assert f"ht_dispatch: argument 'x' has dtype {x.dtype}" in msg, msg
        assert "but no scales were given: fp8 x needs its scales, argument 'x_scales' [4, 2] " \
               "float32 (or [4, 1] int32, UE8M0 packed)" in msg, msg
        assert "dtype u8" not in msg
        with pytest.raises(epx.InvalidArgument, match="ll_dispatch: argument 'x' has dtype .*, "
                                                      "expected bfloat16: ll dispatch quantises"):
            buf.ll_dispatch(x, idx)
    # With the scales the uint8 / fp8 x is fp8: no error about scales.
    x = _fp8_like(4, 256)[-1]
    res = buf.ht_dispatch(x, idx, x_scales=torch.ones(4, 2))
    assert res.recv_x.shape[1] == 256


def test_deep_ep_fp8_x_without_scales_names_the_tuple():
    buf = deep_ep.Buffer(None, comm=OneRank())
    for x in _fp8_like(4, 256):
        with pytest.raises(epx.InvalidArgument) as info:
            buf.dispatch(x, topk_idx=torch.zeros(4, 2, dtype=torch.int64),
                         num_tokens_per_expert=torch.zeros(2, dtype=torch.int32))
        msg = str(info.value)
        assert f"epx invalid_argument: dispatch: argument 'x' has dtype {x.dtype}" in msg, msg
        assert "fp8 x needs its scales, passed as x = (x, x_scales) with x_scales [4, 2] " \
               "float32" in msg, msg
    ll = deep_ep.Buffer(None, low_latency_mode=True, comm=OneRank())
    with pytest.raises(epx.InvalidArgument, match="low_latency_dispatch: argument 'x' has dtype "
                                                  "torch.uint8, expected torch.bfloat16"):
        ll.low_latency_dispatch(torch.zeros(4, 256, dtype=torch.uint8),
                                torch.zeros(4, 2, dtype=torch.int64), 8, 2)


def test_wrong_handle_types_name_the_argument_without_printing_tensors():
    g, _ = one_rank_group(timeout=5)
    buf = epx.Buffer(g, hidden=256, top_k=2, num_experts=2, max_tokens_per_rank=8,
                     enable_ll=True)
    x = torch.full((4, 256), 1.25, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 0], [0, -1], [1, -1]])
    w = torch.full((4, 2), 0.5)
    ht = buf.ht_dispatch(x, idx, w)
    ll = buf.ll_dispatch(x, idx, use_fp8=False)
    big = torch.full((64, 64), 12345.0)  # its repr would print 12345.
    y = ht.recv_x
    ly = torch.zeros(ll.recv_x.shape, dtype=torch.bfloat16)
    ht_want = "argument 'handle' is a torch.Tensor, expected an epx HtHandle (the handle " \
              "ht_dispatch returned)"
    ll_want = "argument 'handle' is a torch.Tensor, expected an epx LlHandle (the handle " \
              "ll_dispatch returned)"
    calls = [
        ("ht_dispatch", ht_want + " or None", lambda h: buf.ht_dispatch(x, handle=h)),
        ("ht_combine", ht_want, lambda h: buf.ht_combine(y, h)),
        ("ht_combine_buffer", ht_want, lambda h: buf.ht_combine_buffer(h)),
        ("ll_combine", ll_want, lambda h: buf.ll_combine(ly, idx, w, h)),
        ("ll_next_combine_buffer", ll_want, lambda h: buf.ll_next_combine_buffer(h)),
        ("ht_combine", ht_want, lambda h: buf._native.ht_combine(y, h, None, None, None, 0)),
        ("ll_combine", ll_want,
         lambda h: buf._native.ll_combine(ly, idx, w, h, False, False, None, 0)),
    ]
    for op, want, call in calls:
        with pytest.raises(epx.InvalidArgument) as info:
            call(big)
        msg = str(info.value)
        assert msg.startswith(f"epx invalid_argument: {op}: {want}"), msg
        assert "12345" not in msg and "tensor(" not in msg, msg
    # The other kind of handle, and None where a handle is required.
    with pytest.raises(epx.InvalidArgument, match="ht_combine: argument 'handle' is a "
                                                  "epx._epx.LlHandle, expected an epx HtHandle"):
        buf.ht_combine(y, ll.handle)
    with pytest.raises(epx.InvalidArgument, match="ll_combine: argument 'handle' is None"):
        buf.ll_combine(ly, idx, w, None)
    # deep_ep's combine names its handle the same way.
    dbuf = deep_ep.Buffer(None, comm=OneRank())
    with pytest.raises(epx.InvalidArgument) as info:
        dbuf.combine(torch.zeros(4, 256, dtype=torch.bfloat16), big)
    assert "combine: argument 'handle' is a Tensor" in str(info.value)
    assert "12345" not in str(info.value)


# ---- out-of-step ranks (docs/semantics.md §4.3) -------------------------------------------------

def body_straggler_then_reset(ctx, mode):
    """Rank 1 comes 2.5 timeouts late to the dispatch: rank 0 raises Timeout, its next call is
    refused with OutOfStep at once, its reset right away meets rank 1 (which times out of the
    old call first); after the reset a dispatch in step returns the exact rows on both ranks."""
    import time
    import torch.distributed as dist
    g = epx.Group.from_comm(NamedComm(ctx.group), timeout=0.4)
    ll = mode == "ll"
    buf = epx.Buffer(g, hidden=128, top_k=2, num_experts=4, max_tokens_per_rank=4,
                     enable_ht=not ll, enable_ll=ll)
    x = torch.full((4, 128), float(ctx.rank + 1), dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]])

    def dispatch():
        if ll:
            r = buf.ll_dispatch(x, idx, use_fp8=False)
            return r.recv_count.tolist(), r.recv_x[:, :4].float()
        return buf.ht_dispatch(x, idx).recv_x.float().sum().item()

    seen = []
    if ctx.rank == 1:
        time.sleep(1.0)
    try:
        dispatch()
        seen.append("ok")
    except epx.EpxError as e:
        seen.append(type(e).__name__)
        if isinstance(e, epx.Timeout):
            t0 = time.monotonic()
            with pytest.raises(epx.OutOfStep, match="refused"):
                dispatch()
            assert time.monotonic() - t0 < 0.2
        try:
            buf.reset()
            seen.append("reset")
        except epx.Timeout:
            seen.append("reset Timeout")
    dist.barrier(ctx.group)
    buf.reset()  # every rank, together
    got = dispatch()
    # Each rank receives the same rows from both ranks: 1s from rank 0, 2s from rank 1.
    if ll:
        # Each local expert: two tokens from each source, rank 0's rows first.
        counts, rows = got
        assert counts == [4, 4], counts
        want = torch.tensor([1.0, 1.0, 2.0, 2.0]).view(1, 4, 1).expand(2, 4, 128)
        assert torch.equal(rows, want), rows[:, :, 0]
    else:
        assert got == 128 * 3.0 * 3, got  # 3 tokens from each rank (its 2 experts' tokens)
    return seen


@pytest.mark.parametrize("mode", ["ht", "ll"])
def test_straggler_timeout_refusal_and_reset(pool2, mode):
    seen = pool2.run(body_straggler_then_reset, mode)
    assert seen[0][0] == "Timeout", seen
    assert seen[1][0] in ("ok", "Timeout"), seen
    assert "reset" in seen[0] or "reset Timeout" in seen[0], seen


def test_out_of_step_is_its_own_class():
    assert issubclass(epx.OutOfStep, epx.EpxError)
    assert epx.OutOfStep.code == "out_of_step"
    assert _epx.error_code_names[-1] == "out_of_step"
