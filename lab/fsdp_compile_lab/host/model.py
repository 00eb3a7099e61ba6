"""The host-CPU model's numbers (:class:`HostCPU`) and what they add to a node's cost.

A GPU step's time is its kernels' and its links' (:mod:`..cost`, :mod:`..simulate`). Where the
ranks compute on CPU cores and communicate through gloo, the host adds to that: each operator
of a graph run as Python is a call (``op_overhead``); a whole graph runs slower than its
operators timed alone (``compute_scale``); the backend's own copies run at their own measured
rates (``copy_kernels``); starting a collective takes the issuing thread's time
(``collective_issue``); gloo's threads take CPU from compute (``collective_cpu``) and work at a
share of a core while the rank computes (``backend_share``, at gloo's own fits where the links
are slower than it: ``backend_collectives``); and ranks that time-slice the cores reach each
collective unevenly (``rank_skew`` in lockstep; ``core_sharing`` and ``rank_drift``, where every
rank is played together: :mod:`.shared_cores`). Every number is measured by
``Cluster.measure(host=HostCPU)`` on a CPU (:meth:`HostCPU.calibrate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fsdp_compile.passes.graph import COPY_KERNELS as COPY_KERNEL_OPS
from fsdp_compile.passes.graph import COPY_OUT
from fsdp_compile.planning.cluster_numbers import _fits_json
from fsdp_compile.planning.vocabulary import (
    COLLECTIVE_KINDS,
    COPY_KERNELS,
    ClusterError,
    MeasuredCollective,
    fit_problems,
    line_problems,
    number_problems,
)

from ..calibration.cores import beside_compute, in_turns

if TYPE_CHECKING:
    from torch import fx

    from fsdp_compile.planning.cluster import Cluster
    from fsdp_compile.planning.cost import NodeCost
    from fsdp_compile.planning.host_model import HostCalibration
    from fsdp_compile.planning.simulate import Event

    from .timeline import HostTimeline

# Shape queries run no operator, even where a graph runs as Python.
_SIZE_QUERIES = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}

NO_SHARING = (1.0, 1.0)
# The numbers written as JSON beside a cluster's: (fixed, per unit) lines, and ring fits.
_LINES = ("copy_kernels", "collective_issue", "collective_cpu")
_FITS = ("backend_collectives", "backend_inter_collectives")


@dataclass(frozen=True)
class CollectiveOnHost:
    """What the host adds to one collective: the issuing thread's time before it starts, the
    backend threads' CPU taken from compute after, how long after this rank's issue the
    group's last rank issues it, and the backend's own time on it at full speed."""

    issue_seconds: Any = 0.0
    cpu_seconds: Any = 0.0
    skew_seconds: Any = 0.0
    backend_seconds: Any = 0.0

    def events(self, issue: Event) -> list[Event]:
        """The simulator's events for the collective whose plain ``issue`` event is given: the
        issuing thread's work first, the issue carrying the skew and the backend's time, then the
        backend threads' CPU (:class:`.timeline.HostTimeline` plays them)."""
        events: list[Event] = []
        if self.issue_seconds:
            events.append(("compute", self.issue_seconds))
        events.append((*issue, self.skew_seconds, self.backend_seconds))
        if self.cpu_seconds:
            events.append(("backend_cpu", self.cpu_seconds))
        return events


@dataclass(frozen=True)
class HostCPU:
    """What ranks on CPU cores and a CPU communication backend (gloo) add to a step; ``Cluster.host``.

    ``op_overhead``: seconds per operator beyond its roofline time (each operator of an
    ``aot_eager`` graph is a Python call). ``compute_scale`` multiplies every compute node priced
    by roofline: measured over priced for a reference transformer step's graphs
    (:mod:`..calibration.reference`). ``copy_kernels`` maps the backend's bucket copies
    (``copy_in``, ``copy_out``, ``chunk_cat``) to a measured ``(seconds per parameter, seconds
    per byte moved)``; without one a copy is priced as a memory-bound operator.
    ``collective_issue`` maps a collective kind to ``(seconds, seconds per buffer byte)`` the
    issuing thread spends before the collective starts (gloo's checks and its copy of a
    reduction's input). ``collective_cpu`` maps a kind to ``(seconds, seconds per wire byte)`` of
    CPU the backend's own threads spend on it, taken from compute where ranks fill the cores.
    ``backend_collectives`` / ``backend_inter_collectives``: gloo's own ring fits where the
    links are slower than it (an :class:`~fsdp_compile.EmulatedNetwork`, timed on unlimited
    links); empty where the links' fits are gloo's own (plain gloo). ``backend_share``: how fast
    gloo's own work progresses, relative to its fit, while the rank computes and while it is
    blocked in a wait (:mod:`.timeline`). ``rank_skew``: seconds a collective waits for its
    group's last rank where ranks time-slice the cores, in lockstep. ``core_sharing``:
    ``(ranks, cores)`` of each machine whose ranks outnumber its cores, None where every rank
    has a core; with ``rank_drift`` (how far such ranks drift apart computing side by side,
    seconds of standard deviation per square root of a second), a step is played on every rank
    together (:mod:`.shared_cores`), which replaces ``rank_skew`` and ``backend_share``.
    The defaults add nothing.
    """

    op_overhead: float = 0.0
    compute_scale: float = 1.0
    copy_kernels: dict[str, tuple[float, float]] = field(default_factory=dict)
    collective_issue: dict[str, tuple[float, float]] = field(default_factory=dict)
    collective_cpu: dict[str, tuple[float, float]] = field(default_factory=dict)
    backend_collectives: dict[str, MeasuredCollective] = field(default_factory=dict)
    backend_inter_collectives: dict[str, MeasuredCollective] = field(default_factory=dict)
    backend_share: tuple[float, float] = NO_SHARING
    rank_skew: float = 0.0
    core_sharing: tuple[int, int] | None = None
    rank_drift: float = 0.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ClusterError("host CPU model: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these numbers, each named."""
        problems = [*number_problems("op_overhead", self.op_overhead, positive=False),
                    *number_problems("compute_scale", self.compute_scale),
                    *number_problems("rank_skew", self.rank_skew, positive=False),
                    *number_problems("rank_drift", self.rank_drift, positive=False)]
        sharing = self.core_sharing
        if sharing is not None and (not isinstance(sharing, tuple) or len(sharing) != 2
                                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                               for v in sharing)
                                    or sharing[0] <= sharing[1]):
            problems.append(f"core_sharing={sharing!r} must be (ranks, cores) of a machine with more ranks than "
                            "cores, or None where every rank has a core")
        if (not isinstance(self.backend_share, tuple) or len(self.backend_share) != 2
                or not all(isinstance(v, (int, float)) and 0 < v <= 1 for v in self.backend_share)):
            problems.append(f"backend_share={self.backend_share!r} must be (share while computing, share while "
                            "waiting), each > 0 and <= 1")
        problems += fit_problems("backend_collectives", self.backend_collectives)
        problems += fit_problems("backend_inter_collectives", self.backend_inter_collectives)
        problems += line_problems("copy_kernels", self.copy_kernels, "seconds per parameter", COPY_KERNELS)
        problems += line_problems("collective_issue", self.collective_issue, "seconds", COLLECTIVE_KINDS)
        problems += line_problems("collective_cpu", self.collective_cpu, "seconds", COLLECTIVE_KINDS)
        return problems

    def replace(self, **changes: Any) -> HostCPU:
        """A copy with some numbers changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def unlimited_links(self, cluster: Cluster) -> Cluster:
        """``cluster`` (whose host this is) with its links at gloo's own speed, as on an emulated
        network's links made unlimited (``compare --exposed``):
        :func:`..calibration.calibrate.backend_links`."""
        from ..calibration.calibrate import backend_links

        return backend_links(cluster)

    # ------------------------------------------------------------------ measuring, and as JSON
    compute_in_turns = staticmethod(in_turns)  # the calibrations in turns where ranks outnumber the cores
    beside_collectives = staticmethod(beside_compute)  # compute beside timed collectives where ranks fill the cores

    def beside_steps(self, model: torch.nn.Module, batch: tuple, loss_fn: Any) -> Any:
        """On a CPU, the model's own step and the calibration's optimizer and runtime workloads,
        timed after each of ``compare``'s steps (:class:`..calibration.beside_steps.BesideSteps`)."""
        from ..calibration.beside_steps import BesideSteps, model_reference_step

        if torch.cuda.is_available():  # compare runs on the GPUs, where the CPU runs ahead
            return None
        inputs, targets = batch
        return BesideSteps(None, torch.device("cpu"), reference=model_reference_step(model, inputs, targets, loss_fn))

    @classmethod
    def calibrate(cls, cluster: Cluster, calibration: HostCalibration) -> HostCPU:
        """The host measured on this machine (``Cluster.measure(host=HostCPU)``), for ``cluster``
        (the device's numbers): :mod:`..calibration.calibrate` runs each calibration."""
        from ..calibration.calibrate import host_numbers, measured_compute_scale

        host = cls(**host_numbers(cluster, calibration))
        if calibration.device.type != "cpu":
            return host
        return host.replace(compute_scale=measured_compute_scale(dataclasses.replace(cluster, host=host), calibration))

    def numbers(self) -> dict[str, Any]:
        """Every number, JSON-ready (:meth:`from_numbers` reads them back)."""
        return {"op_overhead": self.op_overhead, "compute_scale": self.compute_scale, "rank_skew": self.rank_skew,
                "core_sharing": list(self.core_sharing) if self.core_sharing else None,
                "rank_drift": self.rank_drift, "backend_share": list(self.backend_share),
                **{name: getattr(self, name) for name in _LINES},
                **{name: _fits_json(getattr(self, name)) for name in _FITS}}

    @classmethod
    def from_numbers(cls, numbers: dict[str, Any]) -> HostCPU | None:
        """The host :meth:`numbers` wrote, from a cluster's numbers; None where they hold none (no
        ``op_overhead``: every file measured on a CPU has one). Files written before
        ``backend_share`` was measured plan without it, and those written before ``core_sharing``
        and ``rank_drift`` were measured plan in lockstep."""
        if "op_overhead" not in numbers:
            return None
        return cls(op_overhead=numbers["op_overhead"], compute_scale=numbers["compute_scale"],
                   rank_skew=numbers.get("rank_skew", 0.0),
                   core_sharing=tuple(numbers["core_sharing"]) if numbers.get("core_sharing") else None,
                   rank_drift=numbers.get("rank_drift", 0.0),
                   backend_share=tuple(numbers.get("backend_share", NO_SHARING)),
                   **{name: {k: tuple(v) for k, v in numbers.get(name, {}).items()} for name in _LINES},
                   **{name: {k: MeasuredCollective(v["step_latency"], v["bandwidth"], v["group_size"])
                             for k, v in (numbers.get(name) or {}).items()} for name in _FITS})

    # ------------------------------------------------------------------ node costs (:mod:`..cost`)
    def free_node(self, target: Any) -> NodeCost:
        """A node that runs no kernel (a view): where graphs run as Python it is still an
        operator call, so it costs the per-operator overhead (getitem and size queries do not)."""
        from fsdp_compile.planning.cost import NodeCost

        if self.op_overhead and isinstance(target, torch._ops.OpOverload) and target not in _SIZE_QUERIES:
            return NodeCost("compute", self.op_overhead * self.compute_scale)
        return NodeCost("free")

    def compute_node(self, roofline: NodeCost, target: Any, args: Any, out: Any) -> NodeCost:
        """A compute node priced by roofline (``roofline``), on this host: a bucket copy at its own
        measured rate, every other node with the operator's call and times ``compute_scale``."""
        from fsdp_compile.planning.cost import NodeCost

        fit = self.copy_kernels.get(COPY_KERNEL_OPS.get(target))
        if fit is not None:  # timed as the real op: unscaled
            per_param, per_byte = fit
            per_parameter = out if target is COPY_OUT else args[0]  # one tensor per parameter
            parameters = len(per_parameter) if isinstance(per_parameter, (list, tuple)) else 1
            return NodeCost("compute", parameters * per_param + roofline.bytes * per_byte + self.op_overhead,
                            bytes=roofline.bytes)
        return dataclasses.replace(roofline, seconds=(roofline.seconds + self.op_overhead) * self.compute_scale)

    def fused_casts(self, fused: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
        """None: on a CPU float8 is emulated op by op, and each op is priced as measured."""
        return {}

    def operator_calls(self, count: Any) -> Any:
        """Seconds of ``count`` operator calls beyond their roofline time (a foreach optimizer's)."""
        return count * self.op_overhead

    def collective(self, cost: NodeCost, kind: str, buffer_bytes: Any, steps: int, measured: bool,
                   device_type: str) -> NodeCost:
        """``cost`` (a collective of ``steps`` ring steps, priced on its link) with what this host adds
        (:class:`CollectiveOnHost`). ``measured``: whether the link's price is a measured fit, whose
        time is gloo's own on plain gloo; where the links are slower than gloo (an emulated
        network), gloo's own fit on the link (``backend_collectives``) gives its time instead."""
        issue_fixed, issue_per_byte = self.collective_issue.get(kind, (0.0, 0.0))
        cpu_fixed, cpu_per_byte = self.collective_cpu.get(kind, (0.0, 0.0))
        backend = 0.0
        if measured and device_type == "cpu":
            own = (self.backend_inter_collectives.get(kind) if cost.link == "inter" else None) or \
                self.backend_collectives.get(kind)
            backend = cost.seconds if own is None else steps * own.step_latency + cost.wire_bytes / own.bandwidth
        extra = CollectiveOnHost(issue_seconds=issue_fixed + issue_per_byte * buffer_bytes,
                                 cpu_seconds=cpu_fixed + cpu_per_byte * cost.wire_bytes,
                                 skew_seconds=self.rank_skew, backend_seconds=backend)
        return dataclasses.replace(cost, host=extra)

    # ------------------------------------------------------------------ the step (:mod:`..simulate`, :mod:`..plan`)
    def timeline(self, events: Sequence[Event]) -> HostTimeline:
        """The hook :func:`..simulate.simulate_events` plays ``events`` with on one rank."""
        from .timeline import HostTimeline, symbolic_events

        # A processor-shared queue has no closed form: expressions are simulated without it.
        queue = tuple(self.backend_share) != NO_SHARING and not symbolic_events(events)
        return HostTimeline(self.backend_share if queue else None)

    def closed_form(self) -> HostCPU:
        """This host without what has no closed form (gloo's share of the cores, a queue): what a
        step whose sizes are expressions is simulated with."""
        return self.replace(backend_share=NO_SHARING)

    def played_step(self, graph_costs: Sequence[list[tuple[fx.Node, NodeCost]]], tail_seconds: Any) -> float | None:
        """The step played on every rank where ranks outnumber their machine's cores
        (:func:`.shared_cores.planned_step`); None where one rank's timeline (lockstep) stands."""
        if self.core_sharing is None or self.rank_drift <= 0:
            return None
        from .shared_cores import planned_step

        return planned_step(graph_costs, self.core_sharing, self.rank_drift, tail_seconds)


HOST_NUMBERS = tuple(f.name for f in dataclasses.fields(HostCPU))
