"""Play a lowered, scheduled graph on two streams, and walk its memory along the same order.

Time: one compute stream runs the graph's compute nodes in graph order; each link (intra-node,
inter-node) runs its collectives in the order they are issued, each starting when it is issued
(the compute stream reaches it) and the link's previous collective is done. The links are
separate resources (NVLink and the NIC; FSDP2 runs a hybrid strategy's all-reduce across nodes
on a stream of its own, and the emulated network gives each rank one link of each kind), so a
hybrid step's reduce-scatter in the node and all-reduce across nodes can overlap. A ``wait_tensor`` blocks the
compute stream until its collective has finished: the time it blocks is *exposed*
communication. Collective time spent while compute runs is *hidden*; on a device where
communication takes time from compute (``comm_overlap`` < 1), that share of the hidden time is
added back. On a CPU whose ranks fill the cores, the backend's own threads (gloo's) take their
CPU seconds (``NodeCost.cpu_seconds``) from the compute that follows the collective's issue,
whether or not the collective is later waited for: gloo works as soon as its data is in flight,
while this rank and its peer compute (at world 2 on 2 cores, a FULL_SHARD step's compute thread
waited for a core about as long as gloo's threads ran, 23 against 26 ms). Where the link is the
bottleneck, the wait absorbs that time; where compute is, it adds in full. It counts as
exposed communication.

There the backend's own work on a collective also runs slower while the rank computes than while
it waits (``Cluster.backend_share``): each collective carries the backend's own time at full
speed (``NodeCost.backend_seconds``: gloo's fit, timed on unlimited links where the links are an
emulated network's), this rank's backend works through its collectives one at a time in issue
order, and a collective completes when both its link and the backend are done with it. A wait
for a collective the link has finished but the backend has not is exposed as any wait is. On
plain gloo, whose link is the backend, that makes a collective issued under compute take longer
than its fit; on an emulated link slower than gloo it only matters where gloo's share falls
behind the link. Checked against ``bench/plan_emulated.py`` (``docs/planning.md``).
Expressions (symbolic sizes) are simulated without it: a processor-shared queue has no closed form.

This is one rank's timeline, the others priced by symmetry (lockstep). Where a machine's ranks
outnumber its cores they are not in lockstep, and :func:`~fsdp_compile.planning.plan.plan`
plays every rank together instead (:mod:`.shared_cores`).

Memory: live bytes by role after each node's allocations (see :mod:`fsdp_compile.inspection.memory`),
as ints or sympy expressions for graphs traced with symbolic sizes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import sympy
from torch import fx

from ..inspection.memory import ROLES, role_of, storage_lifetimes
from ..passes.graph import WAIT
from .cost import NodeCost, maximum


@dataclass
class Timeline:
    """What one graph (or a step) costs on the two streams."""

    seconds: Any = 0.0
    compute_seconds: Any = 0.0
    comm_seconds: Any = 0.0
    exposed_comm_seconds: Any = 0.0
    flops: Any = 0
    wire_bytes: dict[str, Any] = field(default_factory=lambda: {"intra": 0, "inter": 0})
    collectives: int = 0
    # Of ``exposed_comm_seconds``: compute's time the backend's threads take (the rest is waits),
    # so a measured step's split of its main thread (waiting for a core, blocked) has a referee.
    backend_cpu_seconds: Any = 0.0

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline(
            self.seconds + other.seconds, self.compute_seconds + other.compute_seconds,
            self.comm_seconds + other.comm_seconds, self.exposed_comm_seconds + other.exposed_comm_seconds,
            self.flops + other.flops,
            {k: self.wire_bytes.get(k, 0) + other.wire_bytes.get(k, 0) for k in ("intra", "inter")},
            self.collectives + other.collectives, self.backend_cpu_seconds + other.backend_cpu_seconds)


# Events: ("compute", seconds) | ("issue", key, seconds, link, wire_bytes[, skew[, backend_seconds]])
#         | ("wait", key) | ("backend_cpu", seconds): compute's time a communication backend's threads take
Event = tuple

NO_SHARING = (1.0, 1.0)


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


def symbolic_events(events: list[Event]) -> bool:
    """Whether any of ``events``' numbers is an expression (a graph traced with symbolic sizes)."""
    return any(isinstance(x, sympy.Basic) for event in events for x in event[1:])


def simulate_events(events: Iterable[Event], comm_overlap: float = 1.0, flops: Any = 0,
                    backend_share: tuple[float, float] = NO_SHARING, trace: list[dict] | None = None) -> Timeline:
    """Run ``events`` on one compute and one communication stream (see the module docstring).

    ``backend_share``: how fast the backend's own work progresses while the rank computes and
    while it waits (``Cluster.backend_share``; full speed: the link alone sets each collective's end).
    A collective never waited for is waited at the end (a graph's results are complete
    when it returns). ``trace``: a list that receives, per collective in issue order, when it
    was issued, started and ended on its link, and when its wait was reached and returned
    (seconds from the events' start), to hold against a measured step's
    (``bench/exposure_trace.py``).
    """
    events = list(events)
    backend = None
    if tuple(backend_share) != NO_SHARING and not symbolic_events(events):
        backend = BackendQueue(backend_share)
    now = 0.0  # the compute stream's clock
    comm_free: dict[str, Any] = {}  # link -> when it is next idle
    busy = 0.0
    comm = 0.0
    exposed = 0.0
    finish: dict[Any, Any] = {}
    traced: dict[Any, dict] = {}
    wire = {"intra": 0, "inter": 0}
    count = 0
    backend_cpu = 0.0
    for event in events:
        kind = event[0]
        if kind == "compute":
            if backend is not None:
                backend.run(now + event[1], backend.computing)
            now = now + event[1]
            busy = busy + event[1]
        elif kind == "issue":
            _, key, seconds, link, wire_bytes, *extra = event
            skew = extra[0] if extra else 0.0
            # it starts once the group's last rank has issued it (``skew`` after this one) and the link is free
            start = maximum(now + skew, comm_free.get(link, 0.0))
            if backend is not None:
                backend.add(key, now + skew, extra[1] if len(extra) > 1 else seconds)
            comm_free[link] = start + seconds
            finish[key] = comm_free[link]
            if trace is not None:
                traced[key] = {"key": key, "link": link, "seconds": seconds, "issued": now, "start": start,
                               "end": comm_free[link], "wait_called": None, "wait_returned": None}
                trace.append(traced[key])
            comm = comm + seconds
            wire[link] = wire[link] + wire_bytes
            count += 1
        elif kind == "backend_cpu":  # compute's time taken by the backend's threads
            if backend is not None:
                backend.run(now + event[1], backend.computing)
            now = now + event[1]
            backend_cpu = backend_cpu + event[1]
        elif kind == "wait":
            if event[1] in finish:
                now, exposed = _wait(event[1], finish.pop(event[1]), now, exposed, backend, traced.get(event[1]))
        else:
            raise ValueError(f"unknown event {event!r}")
    for key, end in finish.items():
        now, exposed = _wait(key, end, now, exposed, backend, traced.get(key))
    hidden = comm - exposed
    penalty = (1.0 - comm_overlap) * hidden
    return Timeline(now + penalty, busy, comm, exposed + penalty + backend_cpu, flops, wire, count, backend_cpu)


def _wait(key: Any, link_end: Any, now: Any, exposed: Any, backend: BackendQueue | None,
          record: dict | None = None) -> tuple[Any, Any]:
    """The rank blocks until its link, and its backend (if modelled), are done with ``key``:
    (its clock after, exposed communication after). ``record``: the collective's trace entry."""
    end = link_end
    if backend is not None:
        end = max(end, backend.finished(key))
        backend.run(end, backend.waiting)  # the backend goes on with the next while the rank waits
    later = maximum(now, end)
    if record is not None:
        record.update(wait_called=now, wait_returned=later)
    return later, exposed + (later - now)


def graph_events(costs: list[tuple[fx.Node, NodeCost]]) -> list[Event]:
    events: list[Event] = []
    for node, cost in costs:
        if cost.kind == "compute":
            events.append(("compute", cost.seconds))
        elif cost.kind == "collective":
            if cost.issue_seconds:
                events.append(("compute", cost.issue_seconds))  # the issuing thread's work comes first
            events.append(("issue", node, cost.seconds, cost.link, cost.wire_bytes, cost.skew_seconds,
                           cost.backend_seconds))
            if cost.cpu_seconds:
                events.append(("backend_cpu", cost.cpu_seconds))
        elif cost.kind == "wait":
            events.append(("wait", node.args[0]))
    return events


def simulate_graph(costs: list[tuple[fx.Node, NodeCost]], comm_overlap: float = 1.0,
                   backend_share: tuple[float, float] = NO_SHARING, trace: list[dict] | None = None) -> Timeline:
    flops = 0
    for _, cost in costs:
        if cost.flops:
            flops = flops + cost.flops
    return simulate_events(graph_events(costs), comm_overlap, flops, backend_share, trace)


def memory_timeline(gm: fx.GraphModule, held: dict[str, Any] | None = None,
                    symbolic: bool = False, workspace: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Live bytes by role after each node's allocations, in graph order.

    Same lifetimes as :func:`fsdp_compile.inspection.memory.estimate_memory` (inputs live throughout,
    outputs from their node to their last use); ``held`` adds bytes per role the caller keeps
    alive without passing them in. ``workspace`` maps a collective kind to the bytes the
    communication backend allocates per byte of the collective's buffer, alive from the
    collective to its wait (``Cluster.collective_workspace``), counted in the role of the
    collective's result.
    """
    life = storage_lifetimes(gm, symbolic)
    workspace_at: dict[int, list] = {}
    if workspace:
        from .cost import ALL_GATHER, COLLECTIVE_KIND, tensor_bytes

        index = {n: i for i, n in enumerate(life.nodes)}
        for node in life.nodes:
            kind = COLLECTIVE_KIND.get(node.target) if node.op == "call_function" else None
            share = workspace.get(kind, 0.0) if kind else 0.0
            if not share:
                continue
            buffer = node.meta["val"] if node.target is ALL_GATHER else node.args[0].meta["val"]
            nbytes = tensor_bytes(buffer, symbolic) * share
            waits = [index[u] for u in node.users if u.target is WAIT]
            end = max(waits) if waits else len(life.nodes) - 1
            role = role_of(node)
            for i in range(index[node], end + 1):
                workspace_at.setdefault(i, []).append((role, nbytes))
    allocs: dict[int, list] = {}
    frees: dict[int, list] = {}
    for key in life.size:
        allocs.setdefault(life.born[key], []).append(key)
        frees.setdefault(life.last_use[key], []).append(key)
    by_role: dict[str, Any] = dict.fromkeys(ROLES, 0)
    for role, extra in (held or {}).items():
        by_role[role] = by_role[role] + extra
    timeline = []
    for i in range(len(life.nodes)):
        for key in allocs.get(i, []):
            by_role[life.role[key]] = by_role[life.role[key]] + life.size[key]
        live = dict(by_role)
        for role, nbytes in workspace_at.get(i, []):
            live[role] = live[role] + nbytes
        timeline.append(live)
        for key in frees.get(i, []):
            by_role[life.role[key]] = by_role[life.role[key]] - life.size[key]
    return timeline
