"""Every rank's step played together, where a machine's ranks outnumber its cores.

:mod:`.simulate` plays one rank's timeline and prices the others by symmetry: compute stretched
by the rank's share of a core, every wait blocking as if all ranks waited at once (lockstep).
Ranks that time-slice a machine's cores are not in lockstep. The scheduler serves them unevenly,
so they drift apart between the collectives that tie them: in a gpt_small step at world 4 on 2
cores the ranks issued the same collective a median of up to 30 ms apart under FULL_SHARD and
up to 94 ms apart under HYBRID_SHARD (the issue times in
``bench/results/exposure_trace_*_ranks.json``). While one rank waits another computes on its
core, so a wait in the middle of a step costs the machine less than its length, while a wait
every rank reaches with nothing left to compute (the end of backward) costs all of it. Lockstep
over-priced the first and under-priced the second.

This plays every rank of the world: each runs the same events (:func:`..simulate.graph_events`,
a graph's unwaited collectives waited at its end, then the step's work outside the graphs) on
its machine's cores, which the ranks that can run share in proportion to weights the scheduler
redraws every quantum (log-normal, one scale), no rank above one core. Compute is priced at the
share of a core a rank gets while all its machine's ranks compute, so fewer runnable ranks run
faster. A collective's link starts when this rank issues it and its link is free (the
emulated network's model); the backend's own work (``NodeCost.backend_seconds``) starts once
the group's last rank has issued it and the group's previous one is done; a wait returns when
both are done. The quantum is set so that ranks computing side by side drift apart as far as
the machine measured (``HostCPU.rank_drift``), and the step is the slowest rank's, averaged
over a fixed set of draws (the plan stays deterministic). This replaces lockstep's stand-ins
for the same effects: the skew to the group's last rank (``HostCPU.rank_skew``) and the
backend's share of the cores (``HostCPU.backend_share``).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import sympy

from fsdp_compile.planning.simulate import Event, graph_events

from .timeline import symbolic_events

if TYPE_CHECKING:
    from torch import fx

    from fsdp_compile.planning.cost import NodeCost

# The scheduler's weights are log-normal with this scale; the quantum carries the machine's drift.
WEIGHT_SCALE = 1.0
DRAWS = 12  # steps averaged per prediction
_REFERENCE_QUANTUM = 0.01
REFERENCE_SPAN = 0.2  # seconds of compute in the drift calibration (Cluster.measure's)
_REFERENCE_ROUNDS = 400


def partition(ranks0: Sequence[int], world: int) -> list[tuple[int, ...]] | None:
    """Every rank's group for a collective whose group on rank 0 is ``ranks0``: consecutive
    blocks or a stride, as device meshes lay groups out; None for any other shape."""
    ranks0 = sorted(ranks0)
    k = len(ranks0)
    if k == 0 or ranks0[0] != 0 or world % k:
        return None
    stride = ranks0[1] - ranks0[0] if k > 1 else 1
    if any(b - a != stride for a, b in itertools.pairwise(ranks0)) or (k * stride) > world or world % (k * stride):
        return None
    groups = []
    for base in range(0, world, k * stride):
        for offset in range(stride):
            groups.append(tuple(base + offset + j * stride for j in range(k)))
    return groups


def shares(running: Sequence[int], weights: Sequence[float] | dict[int, float], cores: int) -> dict[int, float]:
    """The cores split over ``running`` ranks in proportion to their weights, none above one core."""
    if len(running) <= cores:
        return {r: 1.0 for r in running}
    out: dict[int, float] = {}
    left, capacity = list(running), float(cores)
    while left:
        total = sum(weights[r] for r in left)
        full = [r for r in left if capacity * weights[r] / total >= 1.0]
        if not full:
            out.update({r: capacity * weights[r] / total for r in left})
            break
        for r in full:
            out[r] = 1.0
            left.remove(r)
            capacity -= 1.0
    return out


class _Machines:
    """The scheduler's weights per machine, redrawn every quantum (each machine at its own phase)."""

    def __init__(self, machines: int, per_machine: int, quantum: float, rng: random.Random) -> None:
        self.per_machine, self.quantum, self.rng = per_machine, quantum, rng
        self.weights = [self._draw() for _ in range(machines)]
        self.next = [rng.random() * quantum for _ in range(machines)]

    def _draw(self) -> list[float]:
        return [math.exp(WEIGHT_SCALE * self.rng.gauss(0.0, 1.0)) for _ in range(self.per_machine)]

    def advance(self, now: float) -> None:
        for m, due in enumerate(self.next):
            if now >= due - 1e-12:
                self.weights[m] = self._draw()
                self.next[m] = due + self.quantum * math.ceil((now - due + 1e-12) / self.quantum)


def _play(program: list[Event], groups: dict[Any, list[tuple[int, ...]]], world: int, per_machine: int,
          cores: int, quantum: float, rng: random.Random) -> list[float]:
    """One draw: when each rank finishes ``program``."""
    speedup = per_machine / cores  # calibrated seconds per second on a core of one's own
    machines = _Machines(math.ceil(world / per_machine), per_machine, quantum, rng)
    pc = [0] * world
    left: list[float | None] = [None] * world  # compute seconds left in the current event
    blocked: list[Any] = [None] * world  # the collective a rank waits for
    outstanding: list[dict[Any, tuple[int, ...]]] = [{} for _ in range(world)]
    link_free: list[dict[str, float]] = [{} for _ in range(world)]
    link_end: list[dict[Any, float]] = [{} for _ in range(world)]
    issued: dict[tuple[Any, tuple[int, ...]], int] = {}
    backend_end: dict[tuple[Any, tuple[int, ...]], float] = {}
    backend_free: dict[tuple[int, ...], float] = {}
    done: list[float | None] = [None] * world
    group_of = {key: {r: g for g in parts for r in g} for key, parts in groups.items()}
    now = 0.0

    def released(r: int) -> bool:
        key = blocked[r]
        end = backend_end.get((key, outstanding[r][key]))
        if end is None or now < max(end, link_end[r][key]) - 1e-12:
            return False
        del outstanding[r][key]
        blocked[r] = None
        return True

    while True:
        machines.advance(now)
        moved = True
        while moved:
            moved = False
            for r in range(world):
                if blocked[r] is not None and released(r):
                    moved = True
                while done[r] is None and left[r] is None and blocked[r] is None:
                    moved = True
                    if pc[r] == len(program):
                        done[r] = now
                        break
                    event = program[pc[r]]
                    kind = event[0]
                    if kind in ("compute", "backend_cpu"):
                        if event[1] > 0:
                            left[r] = event[1]
                    elif kind == "issue":
                        _, key, seconds, link, *_rest = event
                        backend_seconds = event[6] if len(event) > 6 else seconds
                        start = max(now, link_free[r].get(link, 0.0))
                        link_free[r][link] = link_end[r][key] = start + seconds
                        group = group_of[key][r]
                        outstanding[r][key] = group
                        issued[(key, group)] = issued.get((key, group), 0) + 1
                        if issued[(key, group)] == len(group):  # the group's last rank: the backend starts
                            begin = max(now, backend_free.get(group, 0.0))
                            backend_end[(key, group)] = backend_free[group] = begin + backend_seconds
                    elif kind == "wait":
                        if event[1] in outstanding[r]:
                            blocked[r] = event[1]
                            if not released(r):
                                break
                    elif kind == "wait_all":
                        if outstanding[r]:
                            blocked[r] = next(iter(outstanding[r]))
                            if not released(r):
                                break
                            continue  # the next outstanding one, same event
                    else:
                        raise ValueError(f"unknown event {event!r}")
                    pc[r] += 1
        if all(d is not None for d in done):
            return done
        rates: dict[int, float] = {}
        for m in range(len(machines.weights)):
            ranks = range(m * per_machine, min(world, (m + 1) * per_machine))
            running = [r for r in ranks if left[r] is not None]
            weights = {r: machines.weights[m][r - m * per_machine] for r in running}
            for r, share in shares(running, weights, cores).items():
                rates[r] = share * speedup
        step = min(machines.next) - now
        for r, rate in rates.items():
            step = min(step, left[r] / rate)
        for r in range(world):
            key = blocked[r]
            if key is not None:
                end = backend_end.get((key, outstanding[r][key]))
                if end is not None:
                    step = min(step, max(end, link_end[r][key]) - now)
        if not rates and all(backend_end.get((key, outstanding[r][key])) is None
                             for r, key in enumerate(blocked) if key is not None):
            raise RuntimeError("shared_step: every rank waits for a collective some rank of its group never issues")
        step = max(step, 0.0)
        for r, rate in rates.items():
            left[r] -= rate * step
            if left[r] <= 1e-12:
                left[r] = None
        now += step


def shared_step(graphs: Sequence[Sequence[Event]], groups: dict[Any, list[tuple[int, ...]]], *, world: int,
                per_machine: int, cores: int, drift: float, tail_seconds: float = 0.0,
                draws: int = DRAWS) -> float:
    """Seconds of a step whose graphs' events (:func:`..simulate.graph_events`, one list per graph
    in run order) every one of ``world`` ranks runs, ``per_machine`` of them on each machine's
    ``cores``, then ``tail_seconds`` of compute outside the graphs: the slowest rank's finish,
    averaged over ``draws`` fixed draws of the scheduler. ``groups`` maps each collective's key
    to every rank's group (:func:`partition`); ``drift`` is ``HostCPU.rank_drift``."""
    if cores >= per_machine:
        raise ValueError(f"cores={cores} for {per_machine} ranks per machine: every rank has a core of its "
                         "own, where lockstep (simulate_events) is exact")
    program: list[Event] = []
    for events in graphs:
        program.extend(events)
        program.append(("wait_all",))
    if tail_seconds:
        program.append(("compute", tail_seconds))
    q = quantum(drift, per_machine, cores)
    return statistics.fmean(max(_play(program, groups, world, per_machine, cores, q, random.Random(seed)))
                            for seed in range(draws))


def spread(span: float, quantum_seconds: float, per_machine: int, cores: int, rounds: int = _REFERENCE_ROUNDS,
           seed: int = 0) -> float:
    """What ``Cluster.measure()`` reads as the drift, played here: one machine's ranks compute
    ``span`` seconds side by side, over and over; the median over rounds of their finish times'
    standard deviation, over the square root of ``span``."""
    rng = random.Random(seed)
    deviations = [statistics.pstdev(_play([("compute", span)], {}, per_machine, per_machine, cores,
                                          quantum_seconds, rng)) for _ in range(rounds)]
    return statistics.median(deviations) / math.sqrt(span)


@cache
def _spread_at_reference(per_machine: int, cores: int) -> float:
    return spread(REFERENCE_SPAN, _REFERENCE_QUANTUM, per_machine, cores)


def quantum(drift: float, per_machine: int, cores: int) -> float:
    """The scheduler's quantum at which ``per_machine`` ranks on ``cores`` drift apart by
    ``drift`` (seconds of standard deviation per square root of a second of compute): the
    spread grows as the square root of the quantum."""
    if drift <= 0:
        raise ValueError(f"drift={drift!r} must be positive (HostCPU.rank_drift, measured where ranks share cores)")
    return _REFERENCE_QUANTUM * (drift / _spread_at_reference(per_machine, cores)) ** 2


def planned_step(graph_costs: Sequence[list[tuple[fx.Node, NodeCost]]], core_sharing: tuple[int, int],
                 drift: float, tail_seconds: Any) -> float | None:
    """The step of ``graph_costs`` (one rank's costed graphs, in run order, then
    ``tail_seconds`` outside them) played on every rank of the current world sharing each
    machine's cores (``core_sharing``: its ranks and cores; :func:`shared_step`); None where
    lockstep stands: every rank has a core, sizes are symbolic, or a group is laid out other
    than as consecutive blocks or a stride."""
    import torch.distributed as dist

    from fsdp_compile.planning.cost import group_ranks

    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    per_machine, cores = min(core_sharing[0], world), core_sharing[1]
    if per_machine <= cores:
        return None
    if isinstance(tail_seconds, sympy.Basic):
        return None
    graphs, groups, names = [], {}, {}
    for costs in graph_costs:
        events = graph_events(costs)
        if symbolic_events(events):
            return None
        for node, cost in costs:
            if cost.kind == "collective":
                parts = partition(group_ranks(node.args[-1], names), world)
                if parts is None:
                    return None
                groups[node] = parts
        graphs.append(events)
    return shared_step(graphs, groups, world=world, per_machine=per_machine, cores=cores, drift=drift,
                       tail_seconds=float(tail_seconds))
