"""The pipeline declared as data, and the one runner every stage goes through.

:func:`run_stage` runs a stage's passes (``PIPELINE``'s less ``disable_passes=``, then the user's
``passes=``) on one graph, timing, dumping and recording each. A pass rewrites ``gm`` in place and may
return a value or a replacement GraphModule. A ``ConfigError`` passes through; any other error becomes
a ``PassFailure``, the graph restored from a copy so the caller can still run it.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ..errors import ConfigError
from .context import STAGES, GraphPass, PassContext
from .inflight import check_inflight_buffers_pass
from .lowering import lower_markers_pass
from .region_outputs import unalias_region_outputs
from .regions import (
    hoist_region_markers_pass,
    inline_mutating_regions,
    inline_reordering_regions_pass,
    route_region_inputs_pass,
)
from .rng_state_order import order_rng_states_pass
from .save_or_regather import apply_reshard_choice_pass, elide_trivial_unshard_pass, tag_reshard_policy_pass
from .scheduling import schedule_collectives_pass

Pass = tuple[str, Callable[[fx.GraphModule], Any]]

PIPELINE: tuple[GraphPass, ...] = (
    GraphPass("hoist_region_markers", hoist_region_markers_pass, "captured"),
    GraphPass("inline_mutating_regions", inline_mutating_regions, "captured"),
    GraphPass("inline_reordering_regions", inline_reordering_regions_pass, "captured"),
    GraphPass("route_region_inputs", route_region_inputs_pass, "joint"),
    GraphPass("elide_trivial_unshard", elide_trivial_unshard_pass, "joint"),
    GraphPass("apply_reshard_choice", apply_reshard_choice_pass, "joint", when=lambda ctx: ctx.reshard is not None),
    GraphPass("tag_reshard_policy", tag_reshard_policy_pass, "joint"),
    GraphPass("order_rng_states", order_rng_states_pass, "partitioned"),
    GraphPass("unalias_region_outputs", unalias_region_outputs, "graph"),
    GraphPass("elide_trivial_unshard", elide_trivial_unshard_pass, "graph"),
    GraphPass("lower_markers", lower_markers_pass, "graph"),
    GraphPass("schedule_collectives", schedule_collectives_pass, "graph", when=lambda ctx: ctx.schedule is not None),
    GraphPass("check_inflight_buffers", check_inflight_buffers_pass, "graph"),
)


def stage_passes(stage: str, ctx: PassContext, disabled: Collection[str] = ()) -> list[GraphPass]:
    """The passes of ``stage`` that apply to ``ctx``, in pipeline order."""
    if stage not in STAGES:  # a misspelt stage would otherwise run no pass at all
        raise ValueError(f"stage {stage!r} is not a pipeline stage; use one of {', '.join(STAGES)}")
    return [p for p in PIPELINE if p.stage == stage and p.name not in disabled and p.when(ctx)]


def run_stage(gm: fx.GraphModule, stage: str, ctx: PassContext, *, disabled: Collection[str] = (),
              user_passes: Sequence[Callable[[fx.GraphModule], Any]] = (),
              on_graph: Callable[[str, fx.GraphModule], None] | None = None, rollback: bool = True,
              regenerate: bool = True) -> tuple[fx.GraphModule, list[PassResult]]:
    """Run ``stage``'s passes on ``gm``, then ``user_passes`` (``gm`` only). ``rollback=False``: a
    failure leaves the graph as far as it got; ``regenerate=False``: no code regeneration at the end."""
    # Ours rewrite the graph only (never run or read its code); user passes may run the module.
    passes: list[Pass] = [(p.name, functools.partial(p.fn, ctx=ctx)) for p in stage_passes(stage, ctx, disabled)]
    graph_only = {fn for _, fn in passes}
    passes += [(getattr(fn, "__name__", "user_pass"), fn) for fn in user_passes]
    return run_passes(gm, passes, on_graph, graph_only=graph_only, rollback=rollback, results=ctx.results,
                      regenerate=regenerate)


def fix_partition(forward: fx.GraphModule, backward: fx.GraphModule, disabled: Collection[str] = ()) -> None:
    """The repairs a partitioned pair needs, whoever partitioned it, raised as is (no graph to fall back
    to). Takes only names, so Inductor's partitioner hook that calls it stays cache-keyable."""
    ctx = PassContext("partitioned", forward=forward)
    try:
        run_stage(backward, "partitioned", ctx, disabled=disabled, rollback=False, regenerate=False)
    except PassFailure as failure:
        raise failure.__cause__ from None


@dataclass
class PassResult:
    name: str
    seconds: float
    value: Any = None


class PassFailure(RuntimeError):
    """A pass raised; ``pass_name`` says which, ``__cause__`` holds its error."""

    def __init__(self, pass_name: str, error: BaseException) -> None:
        super().__init__(f"pass {pass_name!r} failed: {type(error).__name__}: {error}")
        self.pass_name = pass_name
        self.results: list[PassResult] = []  # the passes that ran before it (set by run_passes)


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass],
               on_graph: Callable[[str, fx.GraphModule], None] | None = None,
               graph_only: Collection[Callable[[fx.GraphModule], Any]] = (), rollback: bool = True,
               results: dict[str, Any] | None = None,
               regenerate: bool = True) -> tuple[fx.GraphModule, list[PassResult]]:
    """Apply ``passes`` to ``gm``; ``on_graph(step, graph)`` sees it before and after each. Code is
    regenerated only before a pass not in ``graph_only`` (which may run ``gm``) and at the end."""
    backup = copy.deepcopy(gm.graph) if rollback else None
    work = gm
    stale = False
    if on_graph is not None:
        on_graph("partitioned", work)
    shared = results
    results = []
    try:
        for name, fn in passes:
            start = time.perf_counter()
            try:
                if stale and fn not in graph_only:
                    work.recompile()
                    stale = False
                value = fn(work)
                if isinstance(value, fx.GraphModule):
                    work, value = value, None
                stale = True
            except ConfigError:
                raise
            except Exception as exc:
                raise PassFailure(name, exc) from exc
            results.append(PassResult(name, time.perf_counter() - start, value))
            if shared is not None:
                shared[name] = value
            if on_graph is not None:
                on_graph(name, work)
        if stale and regenerate:
            work.recompile()
    except BaseException as exc:
        if backup is not None:
            gm.graph = backup  # recompiles gm with the graph it came with
        if isinstance(exc, PassFailure):
            exc.results = results  # what ran before the failure (kept when there is no rollback)
        raise
    return work, results
