"""Private to :mod:`epx.compat.deep_ep` (import the names from there): DeepEP's ``Config``,
``EventHandle`` (also the event the drop-in's ``async_finish`` records) and ``EventOverlap``."""

import torch

from .. import errors


def _align(n, a=128):
    return (n + a - 1) // a * a


class Config:
    """Tuning of a normal-mode call. epx keeps ``num_sms`` (SMs the kernels use) and accepts the
    chunk sizes, checked as DeepEP checks them, which its kernels do not use: DeepEP streams
    tokens through ring buffers of num_max_*_chunked_recv_tokens in chunks of
    num_max_*_chunked_send_tokens (nvl: within a node, rdma: between nodes); epx moves each
    node's tokens over the rail in one chunk of the buffer's token capacity (docs/design.md
    §13)."""

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        op = "Config"
        # As DeepEP's Config: num_sms >= 0 here; the call that uses it needs an even number of at
        # least 2 (deep_ep.py _config_sms).
        self.num_sms = errors.check_int(op, "num_sms", num_sms, 0)
        self.num_max_nvl_chunked_send_tokens = errors.check_int(
            op, "num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        self.num_max_nvl_chunked_recv_tokens = errors.check_int(
            op, "num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1)
        self.num_max_rdma_chunked_send_tokens = errors.check_int(
            op, "num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        self.num_max_rdma_chunked_recv_tokens = errors.check_int(
            op, "num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1)
        # DeepEP's own checks (csrc/config.hpp): a send chunk smaller than the receive ring, and
        # the RDMA ring (rounded up to whole send chunks) at least two send chunks.
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        if nvl_send >= nvl_recv:
            raise errors.invalid(op, f"argument 'num_max_nvl_chunked_send_tokens' is {nvl_send},"
                                 f" expected less than num_max_nvl_chunked_recv_tokens "
                                 f"({nvl_recv})")
        rdma_send = num_max_rdma_chunked_send_tokens
        rdma_recv = _align(num_max_rdma_chunked_recv_tokens, rdma_send)
        if rdma_send > rdma_recv // 2:
            raise errors.invalid(op, f"argument 'num_max_rdma_chunked_send_tokens' is "
                                 f"{rdma_send}, expected at most half of "
                                 f"num_max_rdma_chunked_recv_tokens rounded up to a multiple of "
                                 f"it ({rdma_recv})")
        self.num_max_rdma_chunked_recv_tokens = rdma_recv  # kept rounded up, as DeepEP keeps it

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """A sizing hint in bytes (a multiple of 128) for Buffer(num_nvl_bytes=...): one chunk
        of num_max_nvl_chunked_recv_tokens rows of hidden_bytes per rank and SM pair. epx sizes
        its buffers itself, so the value only has to be accepted back."""
        errors.check_int("Config.get_nvl_buffer_size_hint", "hidden_bytes", hidden_bytes, 1)
        errors.check_int("Config.get_nvl_buffer_size_hint", "num_ranks", num_ranks, 1)
        rows = self.num_max_nvl_chunked_recv_tokens * num_ranks * max(self.num_sms // 2, 1)
        return _align(rows * (hidden_bytes + 64))

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """0: epx sizes its memory across nodes (the rail's chunks) from the calls' shapes, so
        Buffer(num_rdma_bytes=) has nothing to ask for."""
        errors.check_int("Config.get_rdma_buffer_size_hint", "hidden_bytes", hidden_bytes, 1)
        errors.check_int("Config.get_rdma_buffer_size_hint", "num_ranks", num_ranks, 1)
        return 0

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens="
                f"{self.num_max_nvl_chunked_send_tokens}, num_max_nvl_chunked_recv_tokens="
                f"{self.num_max_nvl_chunked_recv_tokens}, num_max_rdma_chunked_send_tokens="
                f"{self.num_max_rdma_chunked_send_tokens}, num_max_rdma_chunked_recv_tokens="
                f"{self.num_max_rdma_chunked_recv_tokens})")


class EventHandle:
    """DeepEP's ``EventHandle`` (``deep_ep``, ``deep_ep.utils``, ``deep_ep.buffer``; training
    frameworks such as Megatron-LM and torchtitan pass ``EventOverlap(EventHandle())`` as
    ``previous_event``): records an event on the current CUDA stream when made;
    ``current_stream_wait()`` makes the current stream wait for it. Where CUDA is not in use (the
    cpu backend, whose ops are synchronous) there is nothing to record: it holds no event and the
    wait returns at once."""

    def __init__(self):
        self.event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """An event (or None) plus tensors kept alive until it completes. ``with`` waits on exit.
    DeepEP 2.x's additions to its legacy class are honoured too: ``current_stream_wait(
    release_handle=True)`` drops the event after the wait, ``register_hook_after_wait(hook)`` runs
    ``hook()`` once, after the next wait, and ``with event(release_handle=True):`` waits and then
    drops it on exit."""

    # Class defaults, set on an instance only when used (the ops make one per call).
    hook_after_wait = None
    _release_handle_by_call = False

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle=False):
        """Makes the current stream wait for the event (nothing to wait for on CPU), then runs the
        registered hook (once) and, with ``release_handle``, drops the event."""
        if self.event is not None:
            self.event.current_stream_wait()
        hook = self.hook_after_wait
        if hook is not None:
            self.hook_after_wait = None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait):
        """``hook_after_wait()`` runs once, after the next ``current_stream_wait`` (or ``with``
        exit); one hook at a time, as DeepEP 2.x allows."""
        op = "EventOverlap.register_hook_after_wait"
        if not callable(hook_after_wait):
            raise errors.invalid(op, f"argument 'hook_after_wait' is "
                                 f"{type(hook_after_wait).__name__}, expected a callable")
        if self.hook_after_wait is not None:
            raise errors.invalid(op, "a hook is already registered on this EventOverlap, expected "
                                 "none until the next current_stream_wait()")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle=False):
        """``with event(release_handle=True):``: the same object, dropping its event on exit."""
        self._release_handle_by_call = bool(release_handle)
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        release = self._release_handle_by_call
        if release:
            self._release_handle_by_call = False
        self.current_stream_wait(release_handle=release)
