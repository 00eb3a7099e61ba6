"""Every pass is ``fn(gm, ctx) -> result``: its stage's graph module, that graph's :class:`PassContext`;
the runner keeps the result under the pass's name."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .. import api

# The stages, in order: Dynamo's graph, the joint graph, the partitioned pair, each graph.
STAGES = ("captured", "joint", "partitioned", "graph")


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
    # stage "joint", under memory_budget=: unit -> (ranks it reshards to, their group or "")
    reshard: dict[str, tuple[int, str]] | None = None


@dataclass(frozen=True)
class GraphPass:
    """One pass of ``stages.PIPELINE``; ``when``: whether it applies to a context."""

    name: str
    fn: Callable[[fx.GraphModule, PassContext], Any]
    stage: str
    when: Callable[[PassContext], bool] = lambda ctx: True


def __getattr__(name: str) -> Any:
    if name == "OPTIONAL_PASSES":
        warnings.warn("fsdp_compile.passes.context.OPTIONAL_PASSES moved: use fsdp_compile.api.OPTIONAL_PASSES",
                      DeprecationWarning, stacklevel=2)
        return api.OPTIONAL_PASSES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
