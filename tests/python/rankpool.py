"""A pool of R rank processes (torch.multiprocessing, spawn) joined by a torch.distributed group,
kept alive across tests so that each test pays for messages, not for process start-up.

    pool = RankPool(4)                  # gloo, CPU tensors, epx cpu backend
    outs = pool.run(body, arg1, ...)    # body(ctx, arg1, ...) on every rank; returns [out_r]

`body` must be a module-level function (it is pickled by reference). A rank that raises fails the
call with every rank's traceback; a call that does not finish within its deadline kills the pool
(the next call starts a fresh one), so a broken test fails instead of hanging.
"""

import gc
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

# Waits inside epx (cpu barriers) are bounded by this in the rank processes: short enough that a
# rank left alone in a collective fails the test quickly.
RANK_EPX_TIMEOUT_MS = 10000


class RankContext:
    """What a rank body gets: rank, world_size, group (the torch ProcessGroup), device."""

    def __init__(self, rank, world_size, group, device):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = device
        self.cache = {}  # per-pool scratch that bodies may reuse (e.g. a Buffer)

    def subgroup(self, size):
        """This rank's group when the world is split into groups of `size` consecutive ranks (an
        engine's EP groups beside data-parallel replicas); made once per pool and size, every
        rank creating every group in the same order, as torch.distributed requires."""
        import torch.distributed as dist
        key = ("subgroup", size)
        if key not in self.cache:
            groups = [dist.new_group(list(range(g, g + size)))
                      for g in range(0, self.world_size, size)]
            self.cache[key] = groups[self.rank // size]
        return self.cache[key]


def _worker(rank, world_size, init_file, backend, cmd_queue, result_queue):
    os.environ["EPX_TIMEOUT_MS"] = str(RANK_EPX_TIMEOUT_MS)
    collect_after_body = os.environ.get("EPX_TEST_GC") == "1"
    try:
        import torch
        import torch.distributed as dist
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        import epx  # noqa: F401  (import errors surface here, once)
        ctx = RankContext(rank, world_size, dist.group.WORLD, device)
        result_queue.put((rank, "ready", None))
    except BaseException:
        result_queue.put((rank, False, traceback.format_exc()))
        return
    while True:
        item = cmd_queue.get()
        if item is None:
            break
        call_id, fn, args = item
        try:
            out = fn(ctx, *args)
            result_queue.put((rank, call_id, True, out))
        except BaseException:
            result_queue.put((rank, call_id, False, traceback.format_exc()))
        if collect_after_body:
            gc.collect()  # diagnostic (EPX_TEST_GC=1): objects in cycles die before the next body
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class RankPool:
    def __init__(self, world_size, backend="gloo", start_timeout=180):
        self.world_size = world_size
        self.backend = backend
        self.start_timeout = start_timeout
        self.procs = []
        self.num_starts = 0
        self._call_id = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="epx-pytest-rdzv-")
        os.close(fd)
        os.unlink(self._init_file)
        self.cmd_queues = [ctx.Queue() for _ in range(self.world_size)]
        self.result_queue = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, self.world_size, self._init_file, self.backend,
                                        self.cmd_queues[r], self.result_queue))
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        self.num_starts += 1
        ready = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size:
            msg = self._get(deadline, "start")
            if msg[1] is False:
                self.close()
                raise RuntimeError(f"rank {msg[0]} failed to start:\n{msg[2]}")
            ready.add(msg[0])

    def _get(self, deadline, what):
        remaining = deadline - time.monotonic()
        dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
        try:
            return self.result_queue.get(timeout=max(0.1, min(remaining, 5.0)))
        except Exception:
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"ranks {dead} died" if dead else f"no answer within the deadline"
                raise TimeoutError(f"rank pool ({self.world_size} ranks): {what}: {why}")
            return self._get(deadline, what)

    def run(self, fn, *args, timeout=180):
        """Runs fn(ctx, *args) on every rank; returns the per-rank results in rank order."""
        if not self.procs:
            self._start()
        self._call_id += 1
        call_id = self._call_id
        for q in self.cmd_queues:
            q.put((call_id, fn, args))
        results, failures = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            msg = self._get(deadline, fn.__name__)
            if len(msg) != 4 or msg[1] != call_id:
                continue  # a late answer of an earlier, failed call
            rank, _, ok, out = msg
            (results if ok else failures)[rank] = out
        if failures:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            # The arguments (every body's first is its seed) name the failing case even where a
            # bare assert in the rank process carries no message.
            raise AssertionError(f"{fn.__name__}{tuple(args)!r} failed on ranks "
                                 f"{sorted(failures)}:\n{text}")
        return [results[r] for r in range(self.world_size)]

    def close(self):
        for q in getattr(self, "cmd_queues", []):
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        if getattr(self, "_init_file", None) and os.path.exists(self._init_file):
            os.unlink(self._init_file)
