"""The planner's one extension point: a host model (``Cluster(host=...)``).

The cost model (:mod:`.cost`) and simulator (:mod:`.simulate`) are a GPU's. Where the device is not (ranks computing on
CPU cores that a backend's threads share), a host model says what it adds, at one hook each: a node's cost, a
collective's part of one rank's timeline, a whole step where one rank's timeline does not stand for it, and how the
calibrations run. GPUs and the presets carry none, and the package ships none: the repository's lab (``lab/``, not
installed) has the CPU one. Its class, given to ``Cluster.measure(host=...)``, calibrates it after the device's numbers;
its numbers are written as JSON beside the cluster's (:mod:`.cluster_numbers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import fx

    from .cluster import Cluster
    from .cost import NodeCost

# Events: see :mod:`.simulate`; a host model adds numbers to an issue and events of its own.
Event = tuple


@dataclass(frozen=True)
class HostCalibration:
    """What :meth:`HostModel.calibrate` is handed: the group, this rank's groups on each link (inter-node: None on one
    node), the device, the collectives' sizes, the repeats, and the network model the group's links run on (or None)."""

    group: Any
    link_groups: tuple[Any, Any]
    device: torch.device
    sizes: tuple[int, ...]
    repeats: int
    network: Any = None


class HostTimeline(Protocol):
    """A host model's part of one rank's timeline, asked at each compute, issue and wait, and playing the events of its
    own kinds (``events``)."""

    events: frozenset[str]

    def compute(self, now: Any, seconds: Any) -> None:
        """The rank computes from ``now`` for ``seconds``."""

    def issue(self, now: Any, event: Event) -> Any:
        """When the link may start the collective this rank issues at ``now``."""

    def done(self, key: Any, link_end: Any) -> Any:
        """When the rank's wait for ``key``, whose link is done at ``link_end``, returns."""

    def taken(self, now: Any, event: Event) -> Any:
        """Compute's seconds one of its own events takes from ``now``."""


class BesideSteps(Protocol):
    """What ``compare`` times after every timed step (:func:`.compare.measure_strategy`), so that each strategy is
    planned at the speed the machine had while its steps ran."""

    reference: Callable[[], None] | None  # a reference step, timed on the compute clock
    cpu_share: float  # each rank's share of a core: the plan's backend CPU in the step's split

    def reset(self) -> None: ...

    def sample(self) -> None: ...

    def fits(self) -> dict[str, Any] | None:
        """The numbers timed beside the steps so far as the :class:`Cluster` fields they replace."""

    def numbers(self, measured: Any, cluster: Cluster) -> dict[str, Any]:
        """What :func:`.compare.beside_steps` plans one strategy with, from its ``Measured``."""


@runtime_checkable
class HostModel(Protocol):
    """What the planner asks of ``Cluster.host``; without one, each hook's answer is the GPU's."""

    def replace(self, **changes: Any) -> HostModel:
        """A copy with some numbers changed (validated again): ``Cluster.with_host``."""

    def free_node(self, target: Any) -> NodeCost:
        """The cost of a node that runs no kernel (a view)."""

    def compute_node(self, roofline: NodeCost, target: Any, args: Any, out: Any) -> NodeCost:
        """The cost of a compute node that the roofline prices at ``roofline``."""

    def operator_calls(self, count: Any) -> Any:
        """Seconds of ``count`` operator calls beyond their roofline time."""

    def collective(self, cost: NodeCost, kind: str, buffer_bytes: Any, steps: int, measured: bool,
                   device_type: str) -> NodeCost:
        """``cost`` (``steps`` ring steps on its link; ``measured``: at a measured fit) with what the host adds in its
        ``host`` field, whose ``events(issue)`` gives the simulator's events."""

    def timeline(self, events: Sequence[Event]) -> HostTimeline:
        """The timeline one rank plays ``events`` on (:func:`.simulate.simulate_events`)."""

    def fused_casts(self, fused: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
        """Which of the float8 casts Inductor fuses into kernels (:func:`.cost.float8_cast_kernels`) run fused on this
        host; the others are priced op by op."""

    def beside_steps(self, model: torch.nn.Module, batch: tuple, loss_fn: Any) -> BesideSteps | None:
        """What ``compare`` times beside each strategy's steps of ``model`` (one ``(inputs, targets)`` of this rank,
        ``loss_fn(output, targets)``), or None."""

    def closed_form(self) -> HostModel:
        """This host without what has no closed form: what a step of symbolic sizes is simulated with."""

    def played_step(self, graph_costs: Sequence[list[tuple[fx.Node, NodeCost]]], tail_seconds: Any) -> float | None:
        """The step played on every rank together, or None where one rank's timeline stands."""

    def numbers(self) -> dict[str, Any]:
        """Every number, JSON-ready, written beside the cluster's (:func:`.cluster_numbers.cluster_numbers`)."""

    @classmethod
    def from_numbers(cls, numbers: dict[str, Any]) -> HostModel | None:
        """The model :meth:`numbers` wrote, read from a cluster's numbers; None where they hold none."""

    @classmethod
    def compute_in_turns(cls, calibrate: Callable[[float], Any], group: Any, device: torch.device) -> Any:
        """This rank's result of ``calibrate(share)`` (a compute calibration, ``share`` the rank's share of a core its
        thread-clock timings are stretched by), run on every rank of ``group``."""

    @classmethod
    def beside_collectives(cls, device: torch.device) -> AbstractContextManager[None]:
        """What runs beside each timed burst of collectives (such as compute that holds the cores)."""

    @classmethod
    def calibrate(cls, cluster: Cluster, calibration: HostCalibration) -> HostModel:
        """The model measured on every rank of ``calibration.group`` (all return the same), for ``cluster`` (the
        device's numbers)."""
