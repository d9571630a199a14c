"""The overlapped ll combine (docs/semantics.md §2.7) through Python: epx.Buffer.ll_combine
(overlap=epx.LlCombineOverlap), epx.Dispatcher.combine_a(overlap=...) and
epx.compat.deep_ep's low_latency_combine in both forks' forms (comp_signal and src_signals).

A stand-in GEMM stores y block by block in a seeded random order and raises each block's signal
after it: on CPU a thread of the rank process (the combine releases the GIL and waits with atomic
loads), on a GPU torch kernels on the main stream with torch.cuda._sleep delays while the
combine runs on a side stream. y is poisoned (NaN) first, so a block read before its signal
shows. Every result is compared bit for bit with reference.ll_combine and the plain combine.
The bodies run on the cpu tier here and on one GPU per rank in test_gpu.py (marked gpu).
"""

import random
import threading
import time

import pytest
import torch

import epx
import epx.compat.deep_ep as deep_ep
import reference as ref

H = 256
K = 4
T_MAX = 12
POISON = float("nan")


def _seed():
    return random.SystemRandom().randrange(1 << 30)


def _inputs(seed, R, E, kind):
    out = []
    for s in range(R):
        g = ref.generator(seed, s)
        T = 0 if (seed + s) % 5 == 0 else 3 + (seed + s) % (T_MAX - 2)
        out.append(dict(x=ref.rand_bf16((T, H), g, scale=3.0),
                        topk_idx=ref.routing(kind, T, K, E, R, g),
                        topk_weights=ref.rand_weights(T, K, g)))
    return out


def _parts(counts, RT, block_rows, parts, seed):
    """The stand-in GEMM's parts (signal, l, rows, columns) in a seeded random order: per signal
    `parts` slices (columns with blocks, rows per expert), each followed by one add of 1."""
    blocks = -(-RT // block_rows) if block_rows else 1
    out = []
    for l, n in enumerate(counts):
        block = block_rows or n
        b = 0
        while b * block < n:
            r0, r1 = b * block, min(n, (b + 1) * block)
            for i in range(parts):
                if block_rows:
                    tile = -(-H // 8 // parts) * 8
                    rows, cols = (r0, r1), (min(H, i * tile), min(H, (i + 1) * tile))
                else:
                    step = -(-(r1 - r0) // parts)
                    rows, cols = (min(r1, r0 + i * step), min(r1, r0 + (i + 1) * step)), (0, H)
                out.append((l * blocks + b, l, rows, cols))
            b += 1
    random.Random(seed).shuffle(out)
    return out, blocks


class _Gemm:
    """Writes `src` into `dst` part by part and raises the signals: a thread on CPU, kernels on
    the current (main) stream on a GPU. start() before the combine, join() after it."""

    def __init__(self, parts, src, dst, signals, seed):
        self.parts, self.src, self.dst, self.signals = parts, src, dst, signals
        self.rng = random.Random(seed)
        self.thread = None

    def _run(self):
        for sig, l, (r0, r1), (c0, c1) in self.parts:
            if self.dst.is_cuda:
                torch.cuda._sleep(self.rng.randrange(1, 20000))
            else:
                time.sleep(self.rng.random() * 2e-4)
            self.dst[l, r0:r1, c0:c1] = self.src[l, r0:r1, c0:c1]
            self.signals[sig] += 1

    def start(self):
        if self.dst.is_cuda:
            self._run()  # enqueued on the current stream; the combine runs on another one
        else:
            self.thread = threading.Thread(target=self._run)
            self.thread.start()

    def join(self):
        if self.thread is not None:
            self.thread.join()


def _overlapped(ctx, dst, src, counts, RT, block_rows, parts, seed, combine):
    """Runs `combine(signals)` (which returns the output, its hook already run) overlapped with
    the stand-in GEMM writing src into dst; on a GPU the combine on a side stream."""
    plan, blocks = _parts(counts, RT, block_rows, parts, seed)
    L = len(counts)
    signals = torch.zeros(L * blocks, dtype=torch.int32, device=ctx.device)
    dst.fill_(POISON)
    gemm = _Gemm(plan, src.to(ctx.device), dst, signals, seed)
    if not dst.is_cuda:
        gemm.start()
        try:
            return combine(signals)
        finally:
            gemm.join()
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)  # the dispatch and the poisoning, not the GEMM
    gemm.start()
    with torch.cuda.stream(side):
        out = combine(signals)
    main.wait_stream(side)
    return out


def body_native(ctx, seed):
    """epx.Buffer.ll_combine(overlap=...): both forms, hook or not, copy and zero_copy, empty
    experts (skewed and all-to-one routings), T = 0 on some ranks."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L, RT = E // R, R * T_MAX
    group = epx.Group.from_process_group(ctx.group)
    buf = epx.Buffer(group, H, K, E, T_MAX, enable_ht=False, enable_ll=True)
    for i, (kind, block_rows, parts, hook, zero_copy) in enumerate(
            [("uniform", 4, 3, False, False), ("skewed", 0, 2, True, False),
             ("all_to_one", 5, 1, True, True), ("duplicates", 0, 1, False, True),
             ("uniform", RT, 2, True, False)]):
        s = seed + i
        what = f"seed={s} {kind} block_rows={block_rows} parts={parts} hook={hook} zc={zero_copy}"
        inputs = _inputs(s, R, E, kind)
        mine = inputs[r]
        idx, w = mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
        d = buf.ll_dispatch(mine["x"].to(dev), idx, use_fp8=False)
        counts = d.recv_count.cpu().tolist()
        ys = [ref.rand_bf16((L, RT, H), ref.generator(s, dd, "y")) for dd in range(R)]
        want = ref.ll_combine(inputs, ys, r, E, R)
        plain = buf.ll_combine(ys[r].to(dev), idx, w, d.handle).out

        def combine(signals):
            y = buf.ll_next_combine_buffer(d.handle) if zero_copy else y_given
            ov = epx.LlCombineOverlap(signals, block_rows, parts, 2 if i % 2 else 0,
                                      d.recv_count if i % 2 else None)
            res = buf.ll_combine(y, idx, w, d.handle, zero_copy=zero_copy,
                                 return_recv_hook=hook, overlap=ov)
            if hook:
                res.hook()
            return res.out

        y_given = torch.empty(L, RT, H, dtype=torch.bfloat16, device=dev)
        dst = buf.ll_next_combine_buffer(d.handle) if zero_copy else y_given
        out = _overlapped(ctx, dst, ys[r], counts, RT, block_rows, parts, s, combine)
        assert torch.equal(out.cpu(), want), what
        assert torch.equal(out.cpu(), plain.cpu()), what


def body_dispatcher(ctx, seed):
    """epx.Dispatcher (ll, hooks): combine_a(y, overlap=...) on the side stream, combine_b."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L, RT = E // R, R * T_MAX
    d = epx.Dispatcher(ctx.group, num_experts=E, hidden=H, top_k=K, max_tokens_per_rank=T_MAX,
                       mode="low_latency", quant="bf16")
    inputs = _inputs(seed, R, E, "uniform")
    mine = inputs[r]
    out = d.dispatch(mine["x"].to(dev), mine["topk_idx"].to(dev), mine["topk_weights"].to(dev),
                     forward_mode="decode")
    counts = out.masked_m.cpu().tolist()
    ys = [ref.rand_bf16((L, RT, H), ref.generator(seed, dd, "y")) for dd in range(R)]
    y = torch.empty(L, RT, H, dtype=torch.bfloat16, device=dev)

    def combine(signals):
        d.combine_a(y, overlap=epx.LlCombineOverlap(signals, 8, 2))
        return d.combine_b()

    res = _overlapped(ctx, y, ys[r], counts, RT, 8, 2, seed, combine)
    assert torch.equal(res.cpu(), ref.ll_combine(inputs, ys, r, E, R))


def body_compat(ctx, seed):
    """deep_ep.Buffer.low_latency_combine(overlap=True, ...) as sglang calls it: Hopper
    (comp_signal, block_m, threshold, num_sms, packed_recv_count) and Blackwell (src_signals,
    src_signal_expect_value), hook or not; overlap=False ignores the fork keywords."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 4 * R
    L, RT = E // R, R * T_MAX
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    for i, (form, hook) in enumerate([("hopper", True), ("blackwell", True), ("hopper", False),
                                      ("blackwell", False)]):
        s = seed + i
        inputs = _inputs(s, R, E, "uniform")
        mine = inputs[r]
        idx, w = mine["topk_idx"].to(dev), mine["topk_weights"].to(dev)
        _, count, handle, _, _ = buf.low_latency_dispatch(mine["x"].to(dev), idx, T_MAX, E,
                                                          use_fp8=False)
        ys = [ref.rand_bf16((L, RT, H), ref.generator(s, dd, "y")) for dd in range(R)]
        want = ref.ll_combine(inputs, ys, r, E, R)
        # overlap=False: the fork keywords are ignored (junk included), as in the forks.
        plain, _, _ = buf.low_latency_combine(ys[r].to(dev), idx, w, handle, comp_signal="junk",
                                              block_m=0, src_signals=3)
        assert torch.equal(plain.cpu(), want), (form, s)
        y = torch.empty(L, RT, H, dtype=torch.bfloat16, device=dev)
        block_rows, parts = (8, 3) if form == "hopper" else (0, 2)

        def combine(signals):
            if form == "hopper":
                kw = dict(packed_recv_count=count, comp_signal=signals, block_m=block_rows,
                          threshold=parts, num_sms=2)
            else:
                kw = dict(src_signals=signals, src_signal_expect_value=parts)
            out, _, hk = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook,
                                                 overlap=True, **kw)
            if hook:
                hk()
            return out

        out = _overlapped(ctx, y, ys[r], count.cpu().tolist(), RT, block_rows, parts, s, combine)
        assert torch.equal(out.cpu(), want), (form, hook, s)


def body_compat_errors(ctx, seed):
    """The fork keywords' checks, raised before anything is sent (every rank alike)."""
    R, r, dev = ctx.world_size, ctx.rank, ctx.device
    E = 2 * R
    L = E // R
    buf = deep_ep.Buffer(ctx.group, low_latency_mode=True)
    inp = _inputs(seed, R, E, "uniform")[r]
    idx, w = inp["topk_idx"].to(dev), inp["topk_weights"].to(dev)
    _, count, handle, _, _ = buf.low_latency_dispatch(inp["x"].to(dev), idx, T_MAX, E,
                                                      use_fp8=False)
    y = torch.zeros(L, R * T_MAX, H, dtype=torch.bfloat16, device=dev)
    sig = torch.ones(64 * L, dtype=torch.int32, device=dev)
    cases = [
        (epx.InvalidArgument, "exactly one of 'comp_signal'",
         dict(overlap=True, comp_signal=sig, src_signals=sig, threshold=1)),
        (epx.InvalidArgument, "neither", dict(overlap=True)),
        (epx.InvalidArgument, "'block_m'", dict(overlap=True, comp_signal=sig, block_m=0,
                                                threshold=1)),
        (epx.InvalidArgument, "'threshold'", dict(overlap=True, comp_signal=sig)),
        (epx.InvalidArgument, "'num_sms'", dict(overlap=True, comp_signal=sig, threshold=1,
                                                num_sms=0)),
        (epx.InvalidArgument, "'comp_signal' is a tensor of 1 elements",
         dict(overlap=True, comp_signal=sig[:1], threshold=1, block_m=1)),
        (epx.InvalidArgument, "'src_signals' is a tensor of 0 elements",
         dict(overlap=True, src_signals=sig[:0], src_signal_expect_value=1)),
        (epx.InvalidArgument, "'src_signal_expect_value'",
         dict(overlap=True, src_signals=sig)),
        (epx.InvalidArgument, "'overlap.signals'",
         dict(overlap=True, src_signals=sig.to(torch.int64), src_signal_expect_value=1)),
        (epx.Unsupported, "'use_logfmt'",
         dict(overlap=True, src_signals=sig, src_signal_expect_value=1, use_logfmt=True)),
    ]
    for cls, needle, kw in cases:
        with pytest.raises(cls) as info:
            buf.low_latency_combine(y, idx, w, handle, **kw)
        assert needle in str(info.value), (needle, str(info.value))
    with pytest.raises(epx.InvalidArgument, match="expected epx.LlCombineOverlap"):
        buf._ll.ll_combine(y, idx, w, handle._handle, overlap=(sig, 1))
    # Still in step: a plain combine completes on every rank.
    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
    assert out.shape == (inp["x"].shape[0], H)


@pytest.mark.parametrize("body", [body_native, body_dispatcher, body_compat, body_compat_errors],
                         ids=lambda b: b.__name__)
def test_ll_overlap_cpu(pool, body):
    pool.run(body, _seed())
