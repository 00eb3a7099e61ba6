"""What the pipeline produced for one captured graph, as the backend keeps it (``backend.graphs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch.fx as fx

from ..inspection.memory_estimate import MemoryEstimate
from ..passes.lowering import Bucket
from ..passes.scheduling import Schedule


class PhaseResult(NamedTuple):
    """One phase's graph after our passes, its buckets ("unshard" / "reduce_grad" -> buckets),
    schedule and memory estimate."""

    graph: fx.GraphModule | None
    buckets: dict[str, list[Bucket]]
    schedule: Schedule | None
    memory: MemoryEstimate | None


@dataclass
class CompiledGraph:
    """The graphs the backend produced for one Dynamo graph, after its passes: per phase (inference
    is the forward phase) its graph, buckets, schedule and memory estimate (``forward``,
    ``forward_buckets``, ...; empty when not compiled), which :meth:`phase` reads at once."""

    index: int
    dynamo: fx.GraphModule
    forward: fx.GraphModule | None = None
    forward_buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    forward_schedule: Schedule | None = None
    forward_memory: MemoryEstimate | None = None
    backward: fx.GraphModule | None = None
    backward_buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    backward_schedule: Schedule | None = None
    backward_memory: MemoryEstimate | None = None
    inference: bool = False
    forward_output_roles: list[str] = field(default_factory=list)
    forward_output_storages: list[Any] = field(default_factory=list)  # storage keys, as the roles
    forward_param_bytes: int = 0
    compiler: str = ""
    fallbacks: list[dict[str, str]] = field(default_factory=list)  # passes that failed, per phase
    pass_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> pass -> s
    # Compile-time accounting (bench/compile_time.py): nodes each phase's passes received, seconds of our work.
    graph_nodes: dict[str, int] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # Inductor only (compilation/cache.py): "hit" (no passes ran, no graphs here), "miss", or "off: <why>".
    cache: str = ""
    cache_key: str | None = None
    # A graph that only read this parameter, run as Python (compilation/inputs.py: read_as_python).
    python_read: str | None = None

    def phase(self, kind: str) -> PhaseResult:
        """The four results of phase ``kind`` ("forward" or "backward")."""
        return PhaseResult(*(getattr(self, f"{kind}{part}") for part in ("", "_buckets", "_schedule", "_memory")))

    def set_phase(self, kind: str, result: PhaseResult) -> None:
        for part, value in zip(("", "_buckets", "_schedule", "_memory"), result):
            setattr(self, f"{kind}{part}", value)


@dataclass
class JointCapture:
    """A joint graph as AOTAutograd handed it to the partitioner, before our joint passes."""

    record: CompiledGraph
    joint: fx.GraphModule
    inputs: list[Any]
    kwargs: dict[str, Any]
    partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None  # under the capturing backend's policy
