"""A rank that dies or stops answering: the others raise an error that says what was waiting.

Gloo and NCCL already fail instead of hanging when a peer's connection closes or an operation
outlives the timeout, but their messages name a socket, not the step of the user's program:
:func:`reraise_named` raises a :class:`RankFailure` naming the operation this rank was in.
"""

from __future__ import annotations

import datetime
from typing import NoReturn

import torch.distributed as dist

# Words that the communication libraries put in the errors of a failed or timed-out peer.
_COMMUNICATION_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe",
                        "reset by peer", "closed by peer", "socket", "watchdog")


class RankFailure(RuntimeError):
    """Another rank exited or stopped answering while this one waited for it."""


def is_communication_failure(exc: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in message for word in _COMMUNICATION_WORDS)


def reraise_named(exc: BaseException, operation: str, timeout: datetime.timedelta | None) -> NoReturn:
    """Raise ``exc`` again: as a :class:`RankFailure` naming ``operation`` when it is a failure
    of communication with another rank, unchanged otherwise."""
    if isinstance(exc, RankFailure) or not is_communication_failure(exc):
        raise exc
    rank = dist.get_rank() if dist.is_initialized() else 0
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    limit = f" (group timeout {timeout.total_seconds():.0f}s)" if timeout is not None else ""
    raise RankFailure(f"fsdp_compile: {operation} on rank {rank} failed while waiting for the other ranks{limit}: "
                      f"{first_line}. Another rank has most likely exited or is stuck; its own log says why") from exc
