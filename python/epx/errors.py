"""epx exceptions: one class per epx::ErrorCode (SPEC 5).

Every error the C++ core raises arrives as the class of its code, with the C++ message unchanged
("epx invalid_argument: ll_dispatch: argument 'x' has dtype f32, expected bf16"). The Python
layers raise the same classes for what they check themselves.
"""


class EpxError(RuntimeError):
    """Base class of every epx error. ``code`` is the stable lower-case code name."""

    code = "internal"


class InvalidArgument(EpxError, ValueError):
    """Bad shape, dtype, stride, device or value range; also a call out of order."""

    code = "invalid_argument"


class Unsupported(EpxError, NotImplementedError):
    """A valid request this build or backend cannot honour (the message names the option)."""

    code = "unsupported"


class OutOfCapacity(EpxError):
    """T > T_max, N > num_worst_tokens, T > runtime_max, or a buffer too small."""

    code = "out_of_capacity"


class Timeout(EpxError, TimeoutError):
    """A peer never arrived at a collective point within the group's timeout."""

    code = "timeout"


class CudaError(EpxError):
    """A CUDA runtime or driver call failed."""

    code = "cuda"


class NcclError(EpxError):
    """An NCCL call failed."""

    code = "nccl"


class InternalError(EpxError):
    """A bug in epx, or a peer that aborted the collective."""

    code = "internal"


# In epx::ErrorCode order (include/epx/error.h).
BY_CODE = (InvalidArgument, Unsupported, OutOfCapacity, Timeout, CudaError, NcclError,
           InternalError)


def _message(cls, op, text):
    return f"epx {cls.code}: {op}: {text}"


def invalid(op, text):
    """An InvalidArgument whose message reads like the C++ ones."""
    return InvalidArgument(_message(InvalidArgument, op, text))


def unsupported(op, text):
    return Unsupported(_message(Unsupported, op, text))


def out_of_capacity(op, text):
    return OutOfCapacity(_message(OutOfCapacity, op, text))


def check_int(op, name, value, minimum=0):
    """`value` if it is an int (not a bool) >= minimum, else an InvalidArgument naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise invalid(op, f"argument '{name}' is {value!r}, expected an int >= {minimum}")
    return value
