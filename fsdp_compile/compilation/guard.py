"""The per-call guard around every compiled graph: what runs at each step besides the graph.

* the parameters' leaves are brought in line with them; a step whose leaves changed runs once
  through the eager runtime (the compiled autograd was traced for the old ones);
* on its first run, the graph's collectives are compared with every other rank's (``verify=``);
* on its first step, its gradients are compared with the eager runtime's (``verify_gradients=``);
* a collective that fails because another rank died names this graph (:mod:`..runtime.faults`).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..api import BackendOptions
from ..checks.agreement import CollectiveCall, collective_calls
from ..checks.gradients import GradientCheck
from ..passes.graph import copy_graph_module
from ..passes.regions import inline_regions, is_region_call
from ..runtime.faults import reraise_named
from ..sharding.backend_state import ShardingState
from ..sharding.groups import world_timeout
from ..sharding.sharded_param import sharded_name
from .cache import CacheState, load_collectives
from .records import CompiledGraph


def boxed(compiled: Callable, args: tuple[Any, ...]) -> bool:
    """Whether ``compiled`` takes its inputs as one list it consumes (AOTAutograd's boxed calls)."""
    return getattr(compiled, "_boxed_call", False) and len(args) == 1 and isinstance(args[0], list)


def flat_inputs(compiled: Callable, args: tuple[Any, ...]) -> list[Any]:
    return list(args[0]) if boxed(compiled, args) else list(args)


def as_python(record: CompiledGraph) -> fx.GraphModule:
    """The captured graph as Python, markers run by the eager runtime; regions (which run only
    under AOTAutograd) inlined into a copy kept as the record's graph."""
    if any(is_region_call(n) for n in record.dynamo.graph.nodes):
        record.dynamo = copy_graph_module(record.dynamo)
        inline_regions(record.dynamo)
        record.dynamo.recompile()
    return record.dynamo


def parameter_name(node: fx.Node) -> str:
    """The dotted name of a parameter input, from the source Dynamo recorded for it."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return node.name
    name = source.name() if callable(source.name) else source.name
    keys = re.findall(r"_(?:modules|parameters)\['([^']+)'\]", name)
    return ".".join(keys) if keys else name


class StepGuard:
    """Wraps each compiled graph of one backend."""

    def __init__(self, options: BackendOptions, state: ShardingState, cache_state: CacheState,
                 gradient_check: GradientCheck | None) -> None:
        self.options = options
        self.state = state
        self.cache_state = cache_state
        self.gradient_check = gradient_check

    @property
    def timeout(self) -> datetime.timedelta:
        return self.options.timeout or world_timeout()

    def wrap(self, compiled: Callable, record: CompiledGraph) -> Callable:
        verifier = self.state.verifier if self.options.verify else None
        check = self.gradient_check if record.compiler != "eager" else None
        timeout = self.timeout
        first_run = [True]

        def run(*args: Any) -> Any:
            self.state.region_fallback.graph_runs += 1
            replaced = self.refresh_leaves()
            if replaced is not None:
                return self.run_eagerly_once(record, compiled, args, replaced)
            if verifier is not None:
                if first_run[0]:
                    kind = "inference graph" if record.inference else "graph"
                    verifier.verify(f"{kind} {record.index} (forward and backward)", self.collectives(record))
                    first_run[0] = False
                verifier.calls += 1
            try:
                if check is not None and check.wants(record.index):
                    inputs = flat_inputs(compiled, args)
                    placeholders = (n for n in record.dynamo.graph.nodes if n.op == "placeholder")
                    names = [self.input_name(value, node) for value, node in zip(inputs, placeholders)]
                    return check.run(record.index, names, as_python(record), inputs, lambda: compiled(*args))
                return compiled(*args)
            except Exception as exc:
                reraise_named(exc, f"the forward of compiled graph {record.index}", timeout)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    def refresh_leaves(self) -> dict[int, torch.Tensor] | None:
        """Bring the parameters' leaves in line with them: the replaced ones, None when none changed."""
        replaced: dict[int, torch.Tensor] = {}
        for shards in self.state.local_shards:
            replaced.update(shards.refresh())
        return replaced if replaced else None

    def run_eagerly_once(self, record: CompiledGraph, compiled: Callable, args: tuple[Any, ...],
                         replaced: dict[int, torch.Tensor]) -> Any:
        """This call through the eager runtime, as the graph's autograd was traced for the old leaves
        (Dynamo's guards on them compile a new graph next call)."""
        flat = flat_inputs(compiled, args)
        if boxed(compiled, args):
            args[0].clear()  # a boxed call hands its inputs over
        flat = [replaced.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in flat]
        return as_python(record)(*flat)

    @staticmethod
    def input_name(value: Any, node: fx.Node) -> str:
        name = sharded_name(value) if isinstance(value, torch.Tensor) else None
        return name or f"input {parameter_name(node)}"

    def collectives(self, record: CompiledGraph) -> list[CollectiveCall]:
        """What ``record`` issues; a cache hit has no lowered graphs here, so the sequence the
        compiling run kept beside the entry (ranks that hit and that missed compare alike)."""
        if record.cache == "hit" and self.cache_state.directory is not None:
            kept = load_collectives(self.cache_state.directory, record.cache_key, record.dynamo.code)
            if kept is not None:
                return [CollectiveCall(**{**c, "params": tuple(c["params"])}) for c in kept]
        return collective_calls(record, self.state.group_roles())
