"""What every pass receives besides its graph, and how a pass is declared.

One signature for every pass of the pipeline: ``fn(gm, ctx) -> result``. ``gm`` is the graph
module the stage works on (the joint graph, the partitioned backward graph, or a forward /
backward graph), ``ctx`` the :class:`PassContext` of that graph; the result (buckets, a
schedule, a count) is kept by the runner under the pass's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

# The stages of the pipeline, in order: the graph Dynamo captured (before AOTAutograd), the
# joint graph before partitioning, the pair of partitioned graphs (fix-ups that must see
# both), then each forward / backward graph.
STAGES = ("captured", "joint", "partitioned", "graph")
# Passes a user may switch off by name (backend(disable_passes=...)); the partition fix-up that
# orders saved RNG states is a correctness repair, not an optimization, and always runs, and so
# do the captured graph's region passes (backend(regions=False) compiles without regions).
OPTIONAL_PASSES = ("route_region_inputs", "elide_trivial_unshard", "tag_reshard_policy",
                   "lower_markers", "schedule_collectives")


@dataclass
class PassContext:
    """Options and facts a pass may read; one per graph the pipeline works on."""

    phase: str  # "captured", "joint", "partitioned", "forward", "inference" or "backward"
    bucket_policy: Any = None  # bucketing.Policy
    decompositions: dict | None = None  # the table the graph was traced with (Inductor's, or None)
    schedule: Any = None  # scheduling.ScheduleOptions; None when scheduling is off
    forward: fx.GraphModule | None = None  # stage "partitioned": the forward graph (gm is the backward)
    results: dict[str, Any] = field(default_factory=dict)  # earlier passes' results, by name
    params: dict[str, tuple] | None = None  # stage "captured": parameter name -> its marker's arguments
    # stage "joint", under memory_budget=: unit -> (ranks it reshards to after forward, the
    # group of that many ranks, or "" for none)
    reshard: dict[str, tuple[int, str]] | None = None


@dataclass(frozen=True)
class GraphPass:
    """One pass of the pipeline, declared as data (see passes/pipeline.py: ``PIPELINE``).

    ``graph_only``: the pass rewrites ``gm.graph`` and never runs or reads ``gm``'s generated
    code, so the runner regenerates code once at the end instead of after it (user passes may
    run the module and are not graph-only). ``when``: whether the pass applies to a context
    (scheduling only when enabled, some passes only to some phases).
    """

    name: str
    fn: Callable[[fx.GraphModule, PassContext], Any]
    stage: str
    graph_only: bool = True
    when: Callable[[PassContext], bool] = lambda ctx: True
