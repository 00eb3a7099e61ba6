"""The compile pipeline's stages, for one graph Dynamo captured.

    capture (Dynamo) -> captured passes -> joint passes -> partition -> partition fix-ups
                     -> graph passes -> inner compiler

:class:`Compiler` is the ``torch.compile`` backend behind :class:`fsdp_compile.FSDPBackend`:
Dynamo hands it each captured graph; the captured passes move compile regions' markers to
their call sites; AOTAutograd traces the joint forward/backward graph, our joint passes turn
the strategy's reshard policy into partitioner tags, the min-cut partitioner splits it, the
partition fix-ups repair what the partitioner leaves (saved RNG states), and the graph passes
lower markers to bucketed collectives and schedule them, before Inductor (or ``aot_eager``)
compiles the result (:mod:`.inner`). The passes and their order are data
(``fsdp_compile.passes.pipeline.PIPELINE``); one runner dumps, times and falls back for every
stage. Every compiled graph runs behind a :class:`~.guard.StepGuard`. The planner runs this
same component on fake tensors (:mod:`.planning_seam`).

The compiler is given what it reads explicitly: the backend's options, the
:class:`~fsdp_compile.sharding.backend_state.ShardingState` its ``shard()`` calls fill in, and
the list it records one :class:`~.records.CompiledGraph` per captured graph in.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..api import BackendOptions, env_flag
from ..checks.gradients import GradientCheck, requested
from ..inspection.dump import Dumper, graph_code, manifest_for
from ..inspection.graphinfo import is_gathered
from ..inspection.memory import estimate_memory, input_bytes, output_storage_keys, storage_lifetimes
from ..inspection.report import graph_summary
from ..passes.context import PassContext
from ..passes.graph import ROLE_META, SAVED_STORAGE_META, copy_graph_module
from ..passes.pipeline import PassFailure, run_stage
from ..passes.regions import PARAM_META, has_regions, inline_regions, is_region_body_joint
from ..passes.scheduling import ScheduleOptions
from ..runtime.markers import UNSHARD
from ..sharding.backend_state import ShardingState
from ..sharding.sharded_class import gathered_parameter
from ..sharding.sharded_param import leaf_owner, sharded_name
from . import planning_seam, reshard_choice
from .cache import CacheState, compile_cache_key, prepare_directory, user_pass_uuids
from .guard import StepGuard, parameter_name
from .inner import backward_now, collector_paused, compile_aot_eager, compile_inductor, partition_fixups
from .records import CompiledGraph, JointCapture, PhaseResult

log = logging.getLogger("fsdp_compile")


class StrictFallbackError(RuntimeError):
    """``strict=True`` (or ``FSDP_COMPILE_STRICT=1``): a pass failed on a graph, which would
    otherwise have run its markers through the eager runtime."""


class Compiler:
    """Compiles the graphs Dynamo captures from models sharded into ``state``."""

    def __init__(self, options: BackendOptions, state: ShardingState, graphs: list[CompiledGraph]) -> None:
        self.options = options
        self.state = state
        self.graphs = graphs
        cache_dir = options.cache_dir
        self.cache_state = (prepare_directory(cache_dir) if cache_dir is not None
                            else CacheState(False, "no cache_dir= given"))
        self.cache_stats = {"hits": 0, "misses": 0, "off": 0}
        self._cache_warned = False
        self._dumper_instance: Dumper | None = None
        self.joint_captures: list[JointCapture] | None = None  # planning: joints seen by partition()
        tolerance = requested(options.verify_gradients)
        self.gradient_check = GradientCheck(tolerance) if tolerance is not False else None
        self.guard = StepGuard(options, state, self.cache_state, self.gradient_check)
        self.quiet = False  # set while reshard_choice traces the strategy's step for memory_budget=: no dumps

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """Dynamo's backend entry: compile one captured graph (see the module docstring)."""
        self._check_inputs(gm, example_inputs)
        compiler = "eager" if env_flag("FSDP_COMPILE_EAGER") else self.options.compiler
        record = CompiledGraph(index=len(self.graphs), dynamo=gm, compiler=compiler)
        self.graphs.append(record)
        read = lone_read(gm)
        if read is not None:
            return self._python_read(record, read, example_inputs)
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "dynamo.py", graph_code(gm))
        self.captured_passes(gm, example_inputs, record)
        gathers = any(n.op == "call_function" and n.target in (UNSHARD, UNSHARD.overloadpacket) for n in gm.graph.nodes)
        if self.options.memory_budget is not None and self.state.reshard_choice is None and gathers:
            reshard_choice.choose_under_budget(self, gm, example_inputs)
        if compiler == "eager":
            # The captured graph as Python: every marker runs the eager runtime, so a user can
            # step through it with pdb and print tensors.
            if inline_regions(gm):
                gm.recompile()
            self._write_summary(record)
            return self.guard.wrap(gm.forward, record)
        inner = compile_aot_eager if compiler == "aot_eager" else compile_inductor
        with backward_now(), collector_paused():
            compiled = inner(self, gm, example_inputs, record)
        reshard_choice.check_compiled_peak(self, record)
        return self.guard.wrap(compiled, record)

    def _python_read(self, record: CompiledGraph, read: fx.Node, example_inputs: Sequence[Any]) -> Callable:
        """A graph that is nothing but one parameter read: Dynamo compiled the read as a frame of
        its own, called from code it runs as Python (after a graph break). It runs as Python
        too, as that code's other reads do, so that it gathers with its bucket
        (sharding/eager_buckets.py) instead of as a bucket of one."""
        fqn, *_ = read.args[1:]
        placeholders = [n for n in record.dynamo.graph.nodes if n.op == "placeholder"]
        leaf = example_inputs[placeholders.index(read.args[0])]
        shards = next(s for s in self.state.local_shards if s.leaves.get(fqn) is leaf)
        marker_args = shards.read_args[fqn]
        record.python_read = fqn
        fallback = self.state.region_fallback

        def run(*args: Any) -> tuple[torch.Tensor]:
            fallback.graph_runs += 1
            return (gathered_parameter(fqn, marker_args, shards),)

        self._write_summary(record)
        return run

    def _check_inputs(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, example_inputs):
            if not isinstance(value, nn.Parameter) or self.state.owns(value):
                continue
            owner = leaf_owner(value)
            if owner is not None and owner in self.state.local_shards:
                continue
            name = sharded_name(value) or parameter_name(node)
            if isinstance(value, DTensor) or owner is not None:
                what = "a DTensor" if isinstance(value, DTensor) else "the shard of a parameter"
                raise RuntimeError(
                    f"parameter {name!r} is {what} that this backend did not shard; compile a "
                    "model with the backend whose shard() sharded it"
                )
            raise RuntimeError(
                f"parameter {name!r} is not sharded: call backend.shard(model) before "
                "torch.compile(model, backend=backend) (or use fsdp_compile.compile(model, ...))"
            )

    # ---------------------------------------------------------------- dumps and failures
    def _dumper(self) -> Dumper | None:
        root = self.options.dump_dir or os.environ.get("FSDP_COMPILE_DUMP")
        if not root or self.quiet:
            return None
        if self._dumper_instance is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            manifest = manifest_for(self.options.strategy.name, world, self._describe_options())
            self._dumper_instance = Dumper(root, rank, manifest)
        return self._dumper_instance

    def _describe_options(self) -> dict[str, Any]:
        o, topo = self.options, self.state.topology
        return {"compiler": o.compiler, "bucket": o.bucket_policy.describe(), "schedule": o.schedule,
                "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                "mixed_precision": repr(o.mixed_precision) if o.mixed_precision else None,
                "shard_size": topo.shard_size if topo else None,
                "replicate_size": topo.replicate_size if topo else None}

    def _write_summary(self, record: CompiledGraph) -> None:
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_summary(record.index, graph_summary(record, self.options.strategy, self.state))

    def _fail(self, record: CompiledGraph, phase: str, failure: PassFailure) -> None:
        """A pass failed on a graph: raise under strict=True, else warn; the caller falls back."""
        where = f"graph {record.index} ({phase})"
        if self.options.strict:
            raise StrictFallbackError(f"fsdp_compile: {failure} on {where}") from failure.__cause__
        message = (f"fsdp_compile: {failure} on {where}; running that graph with its FSDP markers "
                   "executed by the eager runtime (same results, no bucketing or scheduling). "
                   "Pass strict=True to raise instead.")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
        record.fallbacks.append({"phase": phase, "pass": failure.pass_name, "error": str(failure.__cause__)})

    # ---------------------------------------------------------------- stages
    def _pass_context(self, phase: str, decompositions: dict | None = None) -> PassContext:
        schedule = None
        if self.options.schedule and phase not in ("joint", "partitioned"):
            kind = "backward" if phase == "backward" else "forward"
            schedule = ScheduleOptions(self.options.prefetch, self.options.max_inflight_bytes,
                                       self.state.explicit_prefetch[kind])
        reshard = None
        choice = self.state.reshard_choice
        if phase == "joint" and choice is not None:
            groups = {n: g.group_name for n, g in self.state.reshard_groups.groups().items()}
            reshard = {unit: (ranks, groups.get(ranks, "")) for unit, ranks in choice.reshard_to.items()}
        return PassContext(phase, bucket_policy=self.options.bucket_policy, decompositions=decompositions,
                           schedule=schedule, reshard=reshard)

    def captured_passes(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph) -> None:
        """The graph Dynamo captured, before AOTAutograd: compile regions' markers move to their
        call sites (see passes/regions.py). Without regions there is nothing to do. On a
        failure the graph stays as captured: the markers then run inside the regions through
        the eager runtime (same results, no bucketing for them)."""
        if not has_regions(gm.graph):
            return
        started = time.perf_counter()
        record.graph_nodes["captured"] = len(gm.graph.nodes)
        for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
            name = sharded_name(value) if isinstance(value, torch.Tensor) else None
            if name is not None:
                node.meta[PARAM_META] = name
        ctx = PassContext("captured", params={fqn: info.unshard_args for fqn, info in self.state.params.items()})
        try:
            _, results = run_stage(gm, "captured", ctx, disabled=self.options.disable_passes)
        except PassFailure as failure:
            self._fail(record, "captured", failure)
            results = failure.results
        for inlined in ctx.results.get("inline_mutating_regions") or ():
            self.state.region_fallback.inlined_by_pass(
                inlined.block_class, f"in a graph that trains, they update an input in place ({inlined.written}: "
                "a buffer such as BatchNorm's running statistics), which AOTAutograd cannot differentiate "
                "through a region")
        record.pass_seconds["captured"] = {r.name: r.seconds for r in results}
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "captured.py", graph_code(gm))
        record.stage_seconds["captured"] = time.perf_counter() - started

    def joint_passes(self, joint: fx.GraphModule, record: CompiledGraph) -> None:
        """The reshard policy as partitioner tags, in place (the partitioner holds the graph).

        Each step leaves a valid graph (a marker replaced, or tags set), so a failure stops
        there: the partitioner then makes its default choices for the rest, a memory
        difference only, with the same results.
        """
        started = time.perf_counter()
        graph = joint.graph
        if is_region_body_joint(graph):  # Inductor runs its joint passes on region bodies too
            return
        record.graph_nodes["joint"] = len(graph.nodes)
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "joint_before.py", graph_code(graph))
        try:
            _, results = run_stage(joint, "joint", self._pass_context("joint"),
                                   disabled=self.options.disable_passes, rollback=False, regenerate=False)
        except PassFailure as failure:
            self._fail(record, "joint", failure)
            results, failed = failure.results, True
        else:
            failed = False
        record.pass_seconds.setdefault("joint", {}).update({r.name: r.seconds for r in results})
        if failed:
            return
        if dumper is not None:
            dumper.write_graph(record.index, "joint_after.py", graph_code(graph, tags=True))
        record.stage_seconds["joint"] = time.perf_counter() - started

    def partition(self, joint: fx.GraphModule, joint_inputs: Sequence[Any], record: CompiledGraph, **kwargs: Any):
        """AOTAutograd's partition function: joint passes, the min-cut partitioner, fix-ups."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        # A region's body comes without inputs: AOTAutograd partitions it once for every call of
        # it, and it holds no markers, so nothing of ours applies to it.
        body = not joint_inputs and is_region_body_joint(joint.graph)
        if not body:
            if self.joint_captures is not None:
                self.joint_captures.append(
                    JointCapture(record, copy_graph_module(joint), list(joint_inputs), dict(kwargs)))
            self.joint_passes(joint, record)
        start = time.perf_counter()
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        record.stage_seconds["partition"] = record.stage_seconds.get("partition", 0.0) + time.perf_counter() - start
        partition_fixups(forward, backward, self.options.disable_passes)
        if not body and self.joint_captures is not None:
            self.joint_captures[-1].partitioned = (copy_graph_module(forward), copy_graph_module(backward))
        return forward, backward

    def graph_passes(self, gm: fx.GraphModule, phase: str, record: CompiledGraph,
                     decompositions: dict | None = None) -> fx.GraphModule:
        """Lower and schedule one graph; on a pass failure, keep it as it was (markers run eagerly)."""
        started = time.perf_counter()
        record.graph_nodes[phase] = len(gm.graph.nodes)
        if phase == "backward":
            tag_saved_inputs(gm, record.forward_output_roles, record.forward_output_storages)
        kind = "backward" if phase == "backward" else "forward"
        dumper = self._dumper()
        on_graph = None
        if dumper is not None:
            counter = itertools.count()

            def on_graph(step: str, g: fx.GraphModule) -> None:
                dumper.write_graph(record.index, f"{phase}/{next(counter):02d}_{step}.py", graph_code(g))
        try:
            gm, results = run_stage(gm, "graph", self._pass_context(phase, decompositions),
                                    disabled=self.options.disable_passes,
                                    user_passes=self.options.passes.get(kind, []), on_graph=on_graph)
        except PassFailure as failure:
            self._fail(record, phase, failure)
            results = []
        values = {r.name: r.value for r in results}
        held = None
        if phase == "backward":
            # The caller keeps every parameter resident; backward only receives some of them.
            held = {"param": max(0, record.forward_param_bytes - input_bytes(gm, "param"))}
        lifetimes = storage_lifetimes(gm)  # the estimate's, and the saved inputs' keys below
        memory = estimate_memory(gm, held, lifetimes)
        snapshot = gm if record.compiler == "aot_eager" else copy_graph_module(gm)
        record.set_phase(kind, PhaseResult(snapshot, values.get("lower_markers") or {},
                                           values.get("schedule_collectives"), memory))
        record.pass_seconds[kind] = {r.name: r.seconds for r in results}
        if phase != "backward":
            record.inference = phase == "inference"
            record.forward_output_roles = output_roles(gm)
            record.forward_output_storages = output_storage_keys(lifetimes)
            record.forward_param_bytes = input_bytes(gm, "param")
        self._write_summary(record)
        record.stage_seconds[phase] = time.perf_counter() - started
        return gm

    # ---------------------------------------------------------------- cache and planning
    def cache_key(self) -> tuple[str | None, bool, str]:
        """(key for Inductor's caches, None to bypass them; whether AOTAutograd's cache may be
        read; why it may not): see :func:`~.cache.compile_cache_key`."""
        key, lookups, why = compile_cache_key(self.cache_state, self.options, self.state,
                                              dumping=self._dumper() is not None)
        if self.cache_state.enabled and user_pass_uuids(self.options.passes)[0] is None and not self._cache_warned:
            self._cache_warned = True
            warnings.warn(f"fsdp_compile: compile cache off: {why}", RuntimeWarning, stacklevel=4)
        return key, lookups, why

    def trace_for_planning(self, *args: Any, **kwargs: Any) -> tuple[list[CompiledGraph], list[JointCapture]]:
        """See :func:`.planning_seam.trace_for_planning`."""
        return planning_seam.trace_for_planning(self, *args, **kwargs)

    def replay_for_planning(self, *args: Any, **kwargs: Any) -> tuple[CompiledGraph, tuple[fx.GraphModule, ...]]:
        """See :func:`.planning_seam.replay_for_planning`."""
        return planning_seam.replay_for_planning(self, *args, **kwargs)


def lone_read(gm: fx.GraphModule) -> fx.Node | None:
    """The read, when a captured graph does nothing but read one sharded parameter (an
    ``unshard`` marker on an input, returned as the graph's only output); else None."""
    nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
    if len(nodes) != 2 or nodes[0].op != "call_function" or nodes[0].target not in (UNSHARD, UNSHARD.overloadpacket):
        return None
    marker, output = nodes
    returned = output.args[0]
    if not (isinstance(returned, (tuple, list)) and list(returned) == [marker]) and returned is not marker:
        return None
    return marker if marker.args[0].op == "placeholder" else None


def tag_saved_inputs(gm: fx.GraphModule, forward_output_roles: list[str], forward_output_storages: list[Any]) -> None:
    """Give the backward graph's saved inputs the roles and storage keys their forward outputs had.

    AOTAutograd passes the tensors forward saved, in order, as the backward graph's inputs
    (the gradients of the outputs, ``tangents_*``, come last). Saved sizes (SymInts, with a
    dynamic dimension) are the forward's last outputs but the backward's first inputs, so
    tensors are matched with tensors only.
    """
    saved = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
             and not _is_size(n)]
    storages = list(forward_output_storages) + [None] * (len(forward_output_roles) - len(forward_output_storages))
    tensors = [(role, key) for role, key in zip(forward_output_roles, storages) if role != "other"]
    if saved and len(saved) <= len(tensors):
        for node, (role, key) in zip(saved, tensors[-len(saved):]):
            node.meta[ROLE_META] = role
            if key is not None:
                node.meta[SAVED_STORAGE_META] = key


def _is_size(node: fx.Node) -> bool:
    """A graph value that is a number (a SymInt size), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def output_roles(gm: fx.GraphModule) -> list[str]:
    """What each output of a forward graph is: "gathered" (a full parameter), the role our passes
    tagged it with, "activation", or "other" (not a tensor)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    roles = []
    for value in output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]:
        if not isinstance(value, fx.Node) or _is_size(value):
            roles.append("other")
        elif is_gathered(value):
            roles.append("gathered")
        else:
            roles.append(value.meta.get(ROLE_META, "activation"))
    return roles
