"""epx exceptions: one class per epx::ErrorCode (docs/semantics.md §4).

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


class OutOfStep(EpxError):
    """Ranks at different collective calls, or an object that refuses operations after a Timeout
    until every rank called its reset (``Buffer.reset`` / ``ll_clean``, ``Dispatcher.reset``)."""

    code = "out_of_step"


# In epx::ErrorCode order (include/epx/error.h).
BY_CODE = (InvalidArgument, Unsupported, OutOfCapacity, Timeout, CudaError, NcclError,
           InternalError, OutOfStep)


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


def per_rank_values(values):
    """"rank 0 has 256, rank 1 has 512"; ranks with the same value together, values in the order
    of their first rank ("ranks 0, 2 have 8, rank 1 has 16"; runs as "0-3"), as the C++ core
    writes them (src/core/agree.h)."""
    def ranks_text(ranks):
        parts, i = [], 0
        while i < len(ranks):
            j = i
            while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
                j += 1
            if j >= i + 2:
                parts.append(f"{ranks[i]}-{ranks[j]}")
            else:
                parts.extend(str(r) for r in ranks[i:j + 1])
            i = j + 1
        return ", ".join(parts)

    def show(v):
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    out = []
    for v in dict.fromkeys(values):
        ranks = [p for p, w in enumerate(values) if w == v]
        many = len(ranks) > 1
        out.append(f"{'ranks' if many else 'rank'} {ranks_text(ranks)} "
                   f"{'have' if many else 'has'} {show(v)}")
    return ", ".join(out)


def check_agreement(op, fields):
    """Raises InvalidArgument naming every (name, per-rank values) of `fields` whose values
    differ across ranks, in the C++ core's words (docs/semantics.md §4.2)."""
    parts = [f"{name} differs across ranks: {per_rank_values(values)}"
             for name, values in fields if len(set(values)) > 1]
    if parts:
        raise invalid(op, "; ".join(parts) + "; expected the same on every rank")
