"""The host's part of one rank's timeline: the hook :func:`..simulate.simulate_events` is given.

On a CPU whose ranks fill the cores, gloo's threads take their CPU seconds
(``CollectiveOnHost.cpu_seconds``, a ``("backend_cpu", seconds)`` event) from the compute that
follows the collective's issue, whether or not the collective is later waited for: gloo works
as soon as its data is in flight, while this rank and its peer compute (at world 2 on 2 cores, a
FULL_SHARD step's compute thread waited for a core about as long as gloo's threads ran, 23
against 26 ms). Where the link is the bottleneck, the wait absorbs that time; where compute is,
it adds in full. It counts as exposed communication.

There the backend's own work on a collective also runs slower while the rank computes than while
it waits (``HostCPU.backend_share``): each collective carries the backend's own time at full
speed (``CollectiveOnHost.backend_seconds``: gloo's fit, timed on unlimited links where the links
are an emulated network's), this rank's backend works through its collectives one at a time in
issue order (:class:`BackendQueue`), and a collective completes when both its link and the
backend are done with it. A wait for a collective the link has finished but the backend has not
is exposed as any wait is. On plain gloo, whose link is the backend, that makes a collective
issued under compute take longer than its fit; on an emulated link slower than gloo it only
matters where gloo's share falls behind the link. Checked against ``bench/plan_emulated.py``
(``docs/planning.md``). Each collective also starts ``CollectiveOnHost.skew_seconds`` after this
rank issues it, when the group's last rank reaches it (the link does not wait: a collective
queued behind a busy link loses nothing to it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import sympy

from fsdp_compile.planning.simulate import Event

# A host event the two streams have no kind for: compute's time a backend's threads take.
BACKEND_CPU = "backend_cpu"


def symbolic_events(events: Sequence[Event]) -> bool:
    """Whether any of ``events``' numbers is an expression (a graph traced with symbolic sizes)."""
    return any(isinstance(x, sympy.Basic) for event in events for x in event[1:])


class BackendQueue:
    """This rank's communication backend working through its collectives one at a time, in
    issue order, at a share of its full speed that depends on what the rank is doing (computing
    or blocked in a wait). ``clock`` is the rank's time up to which the queue has run."""

    def __init__(self, share: tuple[float, float]) -> None:
        self.computing, self.waiting = share
        self.clock = 0.0
        self.queue: deque[list] = deque()  # [key, when it can start, full-speed seconds left]
        self.done: dict[Any, float] = {}

    def add(self, key: Any, ready: float, seconds: float) -> None:
        if seconds > 0:
            self.queue.append([key, ready, seconds])
        else:
            self.done[key] = ready

    def run(self, until: float, share: float, key: Any = None) -> None:
        """Work at ``share`` until the rank's clock reaches ``until`` (or, with ``key``, until
        that collective is done, however long it takes)."""
        while self.queue and (key is not None or self.clock < until):
            head = self.queue[0]
            if head[1] > self.clock:  # its group's last rank has not issued it yet
                if key is None and head[1] >= until:
                    break
                self.clock = head[1]
                continue
            finish = self.clock + head[2] / share
            if key is None and finish > until:
                head[2] -= (until - self.clock) * share
                break
            self.clock = finish
            self.done[head[0]] = finish
            self.queue.popleft()
            if head[0] == key:
                return
        if key is None:
            self.clock = max(self.clock, until)

    def finished(self, key: Any) -> float:
        """When the backend is done with ``key``, the rank blocked until then."""
        if key not in self.done:
            self.run(self.clock, self.waiting, key)
        return self.done.pop(key)


class HostTimeline:
    """What the host adds while :func:`..simulate.simulate_events` plays one rank's events:
    the skew before each collective starts, gloo's CPU taken from compute (``backend_cpu``
    events) and, with ``share`` (``HostCPU.backend_share``), gloo's own work queued at that
    share of its speed."""

    events = frozenset({BACKEND_CPU})

    def __init__(self, share: tuple[float, float] | None) -> None:
        self.backend = BackendQueue(share) if share is not None else None

    def compute(self, now: Any, seconds: Any) -> None:
        """The rank computes from ``now`` for ``seconds``."""
        if self.backend is not None:
            self.backend.run(now + seconds, self.backend.computing)

    def issue(self, now: Any, event: Event) -> Any:
        """The rank issues the collective of ``event`` at ``now``: when its link may start it
        (once the group's last rank has issued it)."""
        _, key, seconds, _link, _wire, *extra = event
        skew = extra[0] if extra else 0.0
        if self.backend is not None:
            self.backend.add(key, now + skew, extra[1] if len(extra) > 1 else seconds)
        return now + skew

    def done(self, key: Any, link_end: Any) -> Any:
        """When the rank's wait for ``key``, whose link is done at ``link_end``, returns."""
        if self.backend is None:
            return link_end
        end = max(link_end, self.backend.finished(key))
        self.backend.run(end, self.backend.waiting)  # the backend goes on with the next while the rank waits
        return end

    def taken(self, now: Any, event: Event) -> Any:
        """Compute's seconds that a host event (``backend_cpu``) takes from ``now``."""
        self.compute(now, event[1])
        return event[1]
