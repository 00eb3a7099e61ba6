"""Play a lowered, scheduled graph on two streams, and walk its memory along the same order.

Time: one compute stream runs the compute nodes in graph order; each link (intra-node, inter-node: separate resources,
so a hybrid step's reduce-scatter and all-reduce can overlap) runs its collectives in issue order, each from when it is
issued and the link is free. A ``wait_tensor`` blocks compute until its collective is done: that time is *exposed*
communication; with ``comm_overlap`` < 1 that share of the hidden time is added back. That is one rank's GPU timeline,
the others priced by symmetry; a host model (:mod:`.host_model`) adds to it through a
:class:`~.host_model.HostTimeline`, or plays every rank together (``played_step``).

Memory: live bytes by role after each node's allocations (:mod:`fsdp_compile.inspection.memory_estimate`), ints or sympy
expressions for graphs traced with symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from ..inspection.memory_estimate import ROLES, role_of, storage_lifetimes
from ..passes.graph import WAIT
from .cost import NodeCost, maximum
from .host_model import HostModel, HostTimeline


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
    # Of ``exposed_comm_seconds``: compute's time the backend's threads take (the rest is waits)
    backend_cpu_seconds: Any = 0.0

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline(
            self.seconds + other.seconds, self.compute_seconds + other.compute_seconds,
            self.comm_seconds + other.comm_seconds, self.exposed_comm_seconds + other.exposed_comm_seconds,
            self.flops + other.flops,
            {k: self.wire_bytes.get(k, 0) + other.wire_bytes.get(k, 0) for k in ("intra", "inter")},
            self.collectives + other.collectives, self.backend_cpu_seconds + other.backend_cpu_seconds)


# Events: ("compute", seconds) | ("issue", key, seconds, link, wire_bytes) | ("wait", key); a host model
# (:mod:`.host_model`) adds numbers to an issue and events of its own, which its hook plays.
Event = tuple


def simulate_events(events: Iterable[Event], comm_overlap: float = 1.0, flops: Any = 0,
                    host: HostModel | None = None, trace: list[dict] | None = None) -> Timeline:
    """Run ``events`` on the compute stream and the links (module docstring). ``host``: the cluster's host model, needed
    by events that carry its numbers. A collective never waited for is waited at the end. ``trace``: receives, per
    collective in issue order, when it was issued, started and ended on its link, and when its wait was reached and
    returned (``bench/exposure_trace.py``).
    """
    events = list(events)
    hook = host.timeline(events) if host is not None else None
    now = busy = comm = exposed = backend_cpu = 0.0  # now: the compute stream's clock
    comm_free: dict[str, Any] = {}  # link -> when it is next idle
    finish: dict[Any, Any] = {}
    traced: dict[Any, dict] = {}
    wire = {"intra": 0, "inter": 0}
    count = 0
    for event in events:
        kind = event[0]
        if kind == "compute":
            if hook is not None:
                hook.compute(now, event[1])
            now = now + event[1]
            busy = busy + event[1]
        elif kind == "issue":
            if hook is None and len(event) > 5:
                raise ValueError(f"event {event!r} carries a host model's numbers: simulate it with host=")
            _, key, seconds, link, wire_bytes = event[:5]
            ready = now if hook is None else hook.issue(now, event)
            start = maximum(ready, comm_free.get(link, 0.0))
            comm_free[link] = start + seconds
            finish[key] = comm_free[link]
            if trace is not None:
                traced[key] = {"key": key, "link": link, "seconds": seconds, "issued": now, "start": start,
                               "end": comm_free[link], "wait_called": None, "wait_returned": None}
                trace.append(traced[key])
            comm = comm + seconds
            wire[link] = wire[link] + wire_bytes
            count += 1
        elif kind == "wait":
            if event[1] in finish:
                now, exposed = _wait(event[1], finish.pop(event[1]), now, exposed, hook, traced.get(event[1]))
        elif hook is not None and kind in hook.events:  # compute's time the backend's threads take
            taken = hook.taken(now, event)
            now = now + taken
            backend_cpu = backend_cpu + taken
        else:
            raise ValueError(f"unknown event {event!r}" + (" (a host model's event: simulate it with host=)"
                                                           if hook is None else ""))
    for key, end in finish.items():
        now, exposed = _wait(key, end, now, exposed, hook, traced.get(key))
    hidden = comm - exposed
    penalty = (1.0 - comm_overlap) * hidden
    return Timeline(now + penalty, busy, comm, exposed + penalty + backend_cpu, flops, wire, count, backend_cpu)


def _wait(key: Any, link_end: Any, now: Any, exposed: Any, hook: HostTimeline | None,
          record: dict | None = None) -> tuple[Any, Any]:
    """The rank blocks until its link (and host) is done with ``key``: (clock, exposed) after."""
    end = link_end if hook is None else hook.done(key, link_end)
    later = maximum(now, end)
    if record is not None:
        record.update(wait_called=now, wait_returned=later)
    return later, exposed + (later - now)


def graph_events(costs: list[tuple[fx.Node, NodeCost]]) -> list[Event]:
    """The events of costed nodes in graph order; a collective's host costs (``NodeCost.host``) add their own around its
    issue."""
    events: list[Event] = []
    for node, cost in costs:
        if cost.kind == "compute":
            events.append(("compute", cost.seconds))
        elif cost.kind == "collective":
            issue = ("issue", node, cost.seconds, cost.link, cost.wire_bytes)
            events.extend(cost.host.events(issue) if cost.host is not None else (issue,))
        elif cost.kind == "wait":
            events.append(("wait", node.args[0]))
    return events


def simulate_graph(costs: list[tuple[fx.Node, NodeCost]], comm_overlap: float = 1.0,
                   host: HostModel | None = None, trace: list[dict] | None = None) -> Timeline:
    flops = sum((cost.flops for _, cost in costs if cost.flops), 0)
    return simulate_events(graph_events(costs), comm_overlap, flops, host, trace)


def memory_timeline(gm: fx.GraphModule, held: dict[str, Any] | None = None,
                    symbolic: bool = False, workspace: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Live bytes by role after each node's allocations, in graph order, with the lifetimes of
    :func:`fsdp_compile.inspection.memory_estimate.estimate_memory`. ``held``: bytes per role kept
    alive outside the graph. ``workspace``: ``Cluster.collective_workspace``, alive from each collective to its wait in
    the role of its result."""
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
    by_role: dict[str, Any] = {**dict.fromkeys(ROLES, 0), **(held or {})}
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
