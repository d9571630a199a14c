"""epx groups over torch.distributed (docs/design.md §2, §5).

A Group is created collectively by every rank of a torch ProcessGroup (or of any object with
``Get_rank()``, ``Get_size()`` and ``allgather(obj)``, FlashInfer's CommBackend interface):

* cpu backend (tensors on CPU): rank 0 picks a unique name (a UUID), every rank learns it through
  the group, and every rank calls ``Group::cpu_processes`` -- the ranks then exchange data over
  POSIX shared memory, not through the ProcessGroup.
* cuda backend (tensors on a GPU): an NCCL ProcessGroup lends its communicator
  (``Group::cuda_from_comm``); any other group bootstraps a dedicated NCCL communicator from an
  ncclUniqueId that rank 0 creates and the group broadcasts. A build without CUDA raises
  ``Unsupported`` saying so.
"""

import datetime
import math
import operator
import uuid

import torch
import torch.distributed as dist

from . import _epx, errors


def _timeout_ms(timeout, op="Group"):
    """`timeout` (seconds or timedelta; None: the default) as the milliseconds C++ takes.

    The range is the C++ one (GroupOptions::timeout, EPX_TIMEOUT_MS): 1 ms .. MAX_TIMEOUT_MS.
    """
    if timeout is None:
        return 0  # epx default: EPX_TIMEOUT_MS or 30 s
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    max_s = _epx.MAX_TIMEOUT_MS / 1000
    expected = f"expected 0.001..{max_s:g} s (None: EPX_TIMEOUT_MS, else 30 s)"
    if isinstance(timeout, bool):
        raise errors.invalid(op, f"argument 'timeout' is {timeout!r}, {expected}")
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise errors.invalid(op, f"argument 'timeout' is {timeout!r}, {expected}") from None
    ms = int(round(seconds * 1000)) if math.isfinite(seconds) else 0
    if ms < 1 or ms > _epx.MAX_TIMEOUT_MS:
        raise errors.invalid(op, f"argument 'timeout' is {timeout!r} s, {expected}")
    return ms


def _num_sms(num_sms, op="Group"):
    """`num_sms` (an int, or anything with __index__) checked against the C++ range
    (GroupOptions::num_sms, EPX_NUM_SMS)."""
    try:
        n = None if isinstance(num_sms, bool) else operator.index(num_sms)
    except TypeError:
        n = None
    if n is None or n < 0 or n > _epx.MAX_NUM_SMS:
        raise errors.invalid(op, f"argument 'num_sms' is {num_sms!r}, expected an int "
                                 f"0..{_epx.MAX_NUM_SMS} (0: EPX_NUM_SMS, else auto)")
    return n


def _ranks_per_node(ranks_per_node, op="Group"):
    """`ranks_per_node` (an int >= 0, or anything with __index__; GroupOptions::ranks_per_node).
    That it divides the group size is checked by C++ at group creation."""
    try:
        n = None if isinstance(ranks_per_node, bool) else operator.index(ranks_per_node)
    except TypeError:
        n = None
    if n is None or n < 0:
        raise errors.invalid(op, f"argument 'ranks_per_node' is {ranks_per_node!r}, expected an "
                                 "int >= 0 dividing the group size (0: every rank on one node)")
    return n


def _as_device(device):
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise errors.invalid("Group", f"argument 'device' is {device}, expected cpu or cuda")
    return device


class _ProcessGroupComm:
    """Get_rank / Get_size / allgather over a torch ProcessGroup."""

    def __init__(self, pg):
        self.pg = pg

    def Get_rank(self):
        return dist.get_rank(self.pg)

    def Get_size(self):
        return dist.get_world_size(self.pg)

    def allgather(self, obj):
        out = [None] * self.Get_size()
        # Outside any torch.inference_mode() of the caller: all_gather_object's tensors are
        # written by gloo's worker thread, where inference tensors may not be updated.
        with torch.inference_mode(False):
            dist.all_gather_object(out, obj, group=self.pg)
        return out


def _pg_backend(pg):
    try:
        return str(dist.get_backend(pg)).lower()
    except Exception:  # not a registered group (a custom object): treat as non-NCCL
        return ""


def _nccl_comm_ptr(pg, device):
    """The ncclComm_t PyTorch's ProcessGroupNCCL holds for `device` (0 when not exposed)."""
    backend = pg
    if hasattr(pg, "_get_backend"):
        try:
            backend = pg._get_backend(device)
        except Exception:
            backend = pg
    getter = getattr(backend, "_comm_ptr", None)
    if getter is None:
        return 0
    ptr = getter()
    if not ptr:
        # Communicators are created lazily: one collective on the device creates it.
        dist.all_reduce(torch.zeros(1, device=device), group=pg)
        torch.cuda.synchronize(device)
        ptr = getter()
    return int(ptr or 0)


class Group:
    """An EP group: rank, size, backend ('cpu' or 'cuda'), and the wait bound ``timeout`` (s)."""

    def __init__(self, native):
        self._native = native

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def from_process_group(group=None, device=None, timeout=None, num_sms=0, ranks_per_node=0):
        """Collective over `group` (default: the default ProcessGroup).

        `device`: 'cpu' (cpu backend) or a CUDA device (cuda backend). Default: cuda on the
        current device for an NCCL group, cpu otherwise. `timeout` (seconds or timedelta,
        0.001 .. 86400 s; None: EPX_TIMEOUT_MS, else 30 s) bounds every wait for a peer;
        `num_sms` (0 .. 1024; 0: EPX_NUM_SMS, else auto) caps the SMs of the cuda kernels. The
        ranges are the C++ ones (GroupOptions) and the environment's; anything outside them, or
        an invalid EPX_* environment variable, raises InvalidArgument. `ranks_per_node` (0: every
        rank on one node, else a divisor of the group size, the same on every rank): the ranks
        form nodes of that many consecutive ranks, and ht / ll run hierarchically across them
        (docs/design.md §13; cpu backend only, the cuda backend raises Unsupported for more than
        one node).
        """
        op = "Group.from_process_group"
        timeout_ms, num_sms = _timeout_ms(timeout, op), _num_sms(num_sms, op)
        ranks_per_node = _ranks_per_node(ranks_per_node, op)
        if group is None:
            if not dist.is_initialized():
                raise errors.invalid("Group.from_process_group",
                                     "no group given and torch.distributed is not initialised")
            group = dist.group.WORLD
        device = _as_device(device)
        backend = _pg_backend(group)
        if device is None:
            device = _as_device("cuda") if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda" and backend == "nccl":
            if not _epx.built_with_cuda:
                raise errors.unsupported(
                    "Group.from_process_group",
                    "an NCCL process group drives the cuda backend, but epx was built without "
                    "CUDA (EPX_WITH_CUDA=OFF); use a gloo group and CPU tensors for the cpu "
                    "backend")
            ptr = _nccl_comm_ptr(group, device)
            if ptr:
                return Group(_epx.Group.cuda_from_comm(ptr, device.index, timeout_ms, num_sms,
                                                       ranks_per_node))
        return Group.from_comm(_ProcessGroupComm(group), device, timeout, num_sms, ranks_per_node)

    @staticmethod
    def from_comm(comm, device="cpu", timeout=None, num_sms=0, ranks_per_node=0):
        """Collective over `comm`, anything with Get_rank(), Get_size() and allgather(obj)
        (FlashInfer's CommBackend, mpi4py's communicators)."""
        op = "Group.from_comm"
        ms, num_sms = _timeout_ms(timeout, op), _num_sms(num_sms, op)
        ranks_per_node = _ranks_per_node(ranks_per_node, op)
        device = _as_device(device) or torch.device("cpu")
        rank, size = int(comm.Get_rank()), int(comm.Get_size())
        if device.type == "cpu":
            name = f"epx-{uuid.uuid4().hex}" if rank == 0 else None
            name = comm.allgather(name)[0]
            return Group(_epx.Group.cpu_processes(rank, size, name, ms, num_sms, ranks_per_node))
        if not _epx.built_with_cuda:
            raise errors.unsupported(
                "Group.from_comm", f"device {device} needs the cuda backend, but epx was built "
                "without CUDA (EPX_WITH_CUDA=OFF); use CPU tensors for the cpu backend")
        uid = _epx.new_unique_id() if rank == 0 else None
        uid = comm.allgather(uid)[0]
        return Group(_epx.Group.cuda(rank, size, uid, device.index, ms, num_sms, ranks_per_node))

    @staticmethod
    def cuda_from_comm(nccl_comm, device, timeout=None, num_sms=0, ranks_per_node=0):
        """Adopts an existing ncclComm_t (an int pointer); epx does not destroy it."""
        op = "Group.cuda_from_comm"
        ms, num_sms = _timeout_ms(timeout, op), _num_sms(num_sms, op)
        ranks_per_node = _ranks_per_node(ranks_per_node, op)
        return Group(_epx.Group.cuda_from_comm(int(nccl_comm), int(device), ms, num_sms,
                                               ranks_per_node))

    # ---- properties --------------------------------------------------------------------------
    @property
    def rank(self):
        return self._native.rank

    @property
    def size(self):
        return self._native.size

    @property
    def backend(self):
        return self._native.backend

    @property
    def timeout(self):
        return self._native.timeout_ms / 1000.0

    @property
    def num_sms(self):
        return self._native.num_sms

    @property
    def ranks_per_node(self):
        """Ranks per node (resolved: the size for one node)."""
        return self._native.ranks_per_node

    @property
    def num_nodes(self):
        return self._native.num_nodes

    def barrier(self):
        """Host barrier over the group, bounded by the timeout (cpu backend)."""
        self._native.barrier()

    def agree(self, op, values, extra=()):
        """Collective: every rank passes the same ``values`` ((name, int) pairs, bools shown as
        true/false), else every rank raises InvalidArgument naming each differing one with every
        rank's value ("<op>: <name> differs across ranks: rank 0 has 8, rank 1 has 16; expected
        the same on every rank"). One small exchange through the group. ``extra`` ints need not
        agree: returns every rank's, as a list per rank."""
        return self._native.agree(str(op), [(str(n), v) for n, v in values],
                                  [int(v) for v in extra])

    def __repr__(self):
        return (f"epx.Group(rank={self.rank}, size={self.size}, backend={self.backend!r}, "
                f"timeout={self.timeout:g}s)")
