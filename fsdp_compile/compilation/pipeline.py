"""The compile pipeline, in the order a captured graph goes through it.

    Dynamo's graph -> captured stage -> AOTAutograd's joint graph -> joint stage -> partition
                   -> partition fix-ups -> graph stage (each forward / backward graph) -> inner compiler

:class:`Compiler` is the ``torch.compile`` backend behind :class:`fsdp_compile.FSDPBackend`; its
methods come in that order (docs/design.md describes each stage). ``aot_eager`` and Inductor run
the same stages, handed to them as one :class:`~.inner_compilers.Stages`. Tracing without code
generation has one door: :meth:`Compiler.trace` (a whole step on fake tensors, for the planner),
:meth:`Compiler.replay` (a joint graph another backend traced, with this backend's markers) and
:meth:`Compiler.trace_step` (one captured graph's step, which ``memory_budget=`` reads).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx

from ..api import BackendOptions, env_flag
from ..checks.agreement import collective_calls
from ..checks.gradients import GradientCheck, requested
from ..inspection.dump import graph_code
from ..inspection.memory_estimate import estimate_memory, input_bytes, output_storage_keys, storage_lifetimes
from ..passes.context import PassContext
from ..passes.graph import copy_graph_module
from ..passes.regions import PARAM_META, has_regions, inline_regions, is_region_body_joint
from ..passes.scheduling import ScheduleOptions
from ..passes.stages import PassFailure, fix_partition, run_stage
from ..runtime.markers import REDUCE_GRAD, UNSHARD, decode
from ..sharding.backend_state import ShardingState
from ..sharding.sharded_param import ShardedParamInfo, sharded_name
from .cache import CacheLookup, CacheState, compile_cache_key, prepare_directory, record_outcome, user_pass_uuids
from .guard import StepGuard
from .inner_compilers import Stages, backward_now, collector_paused, compile_aot_eager, compile_inductor
from .inputs import check_inputs, lone_read, read_as_python
from .records import CompiledGraph, JointCapture, PhaseResult
from .roles import output_roles, tag_saved_inputs
from .stage_log import StageLog
from .tracing import own_tracing_context, run_traced


class ReshardBudget(Protocol):
    """``memory_budget=`` as the backend hands it in (``planning.budget.MemoryBudget``, which prices
    settings with the planner's cost model): ``decide`` returns each unit's setting (with
    ``reshard_to``: unit -> ranks) from the step ``trace()`` returns, alike on every rank."""

    def decide(self, trace: Callable[[], CompiledGraph], state: ShardingState) -> Any:
        ...

    def check_compiled(self, record: CompiledGraph, state: ShardingState) -> None:
        ...


class Compiler:
    """Compiles the graphs Dynamo captures from models sharded into ``state``."""

    def __init__(self, options: BackendOptions, state: ShardingState, graphs: list[CompiledGraph],
                 budget: ReshardBudget | None = None) -> None:
        self._options = options
        self.state = state
        self.graphs = graphs
        self.budget = budget
        cache_dir = options.cache_dir
        self.cache_state = (prepare_directory(cache_dir) if cache_dir is not None
                            else CacheState(False, "no cache_dir= given"))
        self.cache_stats = {"hits": 0, "misses": 0, "off": 0}
        self._cache_warned = False
        self.log = StageLog(options, state)
        self._captures: list[JointCapture] | None = None  # trace(keep_joint=True): joints as partitioned
        tolerance = requested(options.verify_gradients)
        self.gradient_check = GradientCheck(tolerance) if tolerance is not False else None
        self.guard = StepGuard(options, state, self.cache_state, self.gradient_check)

    @property
    def options(self) -> BackendOptions:
        return self._options

    @options.setter
    def options(self, options: BackendOptions) -> None:  # strategy="auto" applies its plan
        self._options = self.log.options = options

    # ---------------------------------------------------------------- Dynamo's graph
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        check_inputs(self.state, gm, example_inputs)
        compiler = "eager" if env_flag("FSDP_COMPILE_EAGER") else self.options.compiler
        record = CompiledGraph(index=len(self.graphs), dynamo=gm, compiler=compiler)
        self.graphs.append(record)
        read = lone_read(gm)
        if read is not None:
            run = read_as_python(self.state, record, read, example_inputs)
            self.log.write_summary(record)
            return run
        self.log.write_graph(record, "dynamo.py", lambda: graph_code(gm))
        self.captured_stage(gm, example_inputs, record)
        self._choose_reshard(gm, example_inputs)
        if compiler == "eager":
            # The captured graph as Python (markers run the eager runtime): a user can step through it.
            if inline_regions(gm):
                gm.recompile()
            self.log.write_summary(record)
            return self.guard.wrap(gm.forward, record)
        compiled = self._inner_compile(gm, example_inputs, record, compiler)
        if self.budget is not None and self.state.reshard_choice is not None:
            self.budget.check_compiled(record, self.state)
        return self.guard.wrap(compiled, record)

    def captured_stage(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph) -> None:
        """Compile regions' markers move to their call sites (passes/regions.py); on a failure the
        graph stays as captured and they run inside the regions through the eager runtime."""
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
            self.log.fail(record, "captured", failure)
            results = failure.results
        for inlined in ctx.results.get("inline_mutating_regions") or ():
            self.state.region_fallback.inlined_by_pass(
                inlined.block_class, f"in a graph that trains, they update an input in place ({inlined.written}: "
                "a buffer such as BatchNorm's running statistics), which AOTAutograd cannot differentiate "
                "through a region")
        record.pass_seconds["captured"] = {r.name: r.seconds for r in results}
        self.log.write_graph(record, "captured.py", lambda: graph_code(gm))
        record.stage_seconds["captured"] = time.perf_counter() - started

    def _choose_reshard(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        """``memory_budget=``: each unit's setting, chosen at the first graph that gathers from its
        step under the strategy's own setting; every joint stage from then on applies it."""
        if self.budget is None or self.state.reshard_choice is not None:
            return
        if not any(n.op == "call_function" and n.target in (UNSHARD, UNSHARD.overloadpacket) for n in gm.graph.nodes):
            return
        choice = self.budget.decide(lambda: self.trace_step(gm, example_inputs), self.state)
        self.state.reshard_choice = choice
        self.state.reshard_to.update(choice.reshard_to)

    # ---------------------------------------------------------------- inside the inner compiler
    def _inner_compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph,
                       compiler: str) -> Callable:
        """AOTAutograd and the stages below, inside ``aot_eager`` or Inductor."""
        stages = self._stages(record)
        with backward_now(), collector_paused():
            if compiler == "aot_eager":
                return compile_aot_eager(gm, example_inputs, stages, self.guard.timeout)
            key, lookups, why = self.cache_key()
            usable = self.cache_state.enabled or self.cache_state.directory is None
            compiled, outcome = compile_inductor(gm, example_inputs, stages, CacheLookup(key, lookups, why, usable),
                                                 fallback_random=self.gradient_check is not None)
        record_outcome(record, outcome, key, self.cache_stats, self.cache_state.directory, gm.code,
                       lambda: collective_calls(record, self.state.group_roles()))
        return compiled

    def _stages(self, record: CompiledGraph) -> Stages:
        return Stages(record,
                      joint=lambda joint: self.joint_stage(joint, record),
                      partition=lambda joint, inputs, **kwargs: self.partition_stage(joint, inputs, record, **kwargs),
                      graph=lambda gm, phase, decompositions: self.graph_stage(gm, phase, record, decompositions),
                      disabled=tuple(self.options.disable_passes))

    def joint_stage(self, joint: fx.GraphModule, record: CompiledGraph) -> None:
        """The reshard policy as partitioner tags, in place. Each step leaves a valid graph, so a
        failure stops there: the partitioner's defaults for the rest change memory, not results."""
        started = time.perf_counter()
        graph = joint.graph
        if is_region_body_joint(graph):  # Inductor runs its joint passes on region bodies too
            return
        if self._captures is not None:  # trace(keep_joint=True): the joint as AOTAutograd made it
            self._captures.append(JointCapture(record, copy_graph_module(joint), [], {}))
        record.graph_nodes["joint"] = len(graph.nodes)
        self.log.write_graph(record, "joint_before.py", lambda: graph_code(graph))
        try:
            _, results = run_stage(joint, "joint", pass_context(self.options, self.state, "joint"),
                                   disabled=self.options.disable_passes, rollback=False, regenerate=False)
        except PassFailure as failure:
            self.log.fail(record, "joint", failure)
            record.pass_seconds.setdefault("joint", {}).update({r.name: r.seconds for r in failure.results})
            return
        record.pass_seconds.setdefault("joint", {}).update({r.name: r.seconds for r in results})
        self.log.write_graph(record, "joint_after.py", lambda: graph_code(graph, tags=True))
        record.stage_seconds["joint"] = time.perf_counter() - started

    def partition_stage(self, joint: fx.GraphModule, joint_inputs: Sequence[Any], record: CompiledGraph,
                        **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The min-cut partitioner, then the partition fix-ups (under Inductor, its partitioner
        hook runs the same fix-ups after Inductor's partitioner)."""
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        start = time.perf_counter()
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        record.stage_seconds["partition"] = record.stage_seconds.get("partition", 0.0) + time.perf_counter() - start
        fix_partition(forward, backward, self.options.disable_passes)
        # A region's body comes without inputs: AOTAutograd partitions it once for every call of
        # it, and it holds no markers; the joint stage captured nothing of it.
        body = not joint_inputs and is_region_body_joint(joint.graph)
        if self._captures and not body and self._captures[-1].record is record and not self._captures[-1].inputs:
            capture = self._captures[-1]
            capture.inputs, capture.kwargs = list(joint_inputs), dict(kwargs)
            capture.partitioned = (copy_graph_module(forward), copy_graph_module(backward))
        return forward, backward

    def graph_stage(self, gm: fx.GraphModule, phase: str, record: CompiledGraph,
                     decompositions: dict | None = None) -> fx.GraphModule:
        """Lower and schedule one graph; on a pass failure, keep it as it was (markers run eagerly)."""
        started = time.perf_counter()
        record.graph_nodes[phase] = len(gm.graph.nodes)
        if phase == "backward":
            tag_saved_inputs(gm, record.forward_output_roles, record.forward_output_storages)
        kind = "backward" if phase == "backward" else "forward"
        on_graph = None
        if self.log.dumper() is not None:
            counter = itertools.count()

            def on_graph(step: str, g: fx.GraphModule) -> None:
                self.log.write_graph(record, f"{phase}/{next(counter):02d}_{step}.py", lambda: graph_code(g))
        try:
            gm, results = run_stage(gm, "graph", pass_context(self.options, self.state, phase, decompositions),
                                    disabled=self.options.disable_passes,
                                    user_passes=self.options.passes.get(kind, []), on_graph=on_graph)
        except PassFailure as failure:
            self.log.fail(record, phase, failure)
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
        self.log.write_summary(record)
        record.stage_seconds[phase] = time.perf_counter() - started
        return gm

    def cache_key(self) -> tuple[str | None, bool, str]:
        """:func:`~.cache.compile_cache_key` for this compiler, warning once when a pass turns it off."""
        key, lookups, why = compile_cache_key(self.cache_state, self.options, self.state,
                                              dumping=self.log.dumper() is not None)
        if self.cache_state.enabled and user_pass_uuids(self.options.passes)[0] is None and not self._cache_warned:
            self._cache_warned = True
            warnings.warn(f"fsdp_compile: compile cache off: {why}", RuntimeWarning, stacklevel=4)
        return key, lookups, why

    # ---------------------------------------------------------------- the tracing door
    def trace(self, fn: Callable, example_inputs: Sequence[Any], *, keep_joint: bool = False,
              dynamo_pass: Callable[[fx.GraphModule], None] | None = None,
              fake_mode: Any = None) -> tuple[list[CompiledGraph], list[JointCapture]]:
        """Run ``fn(*example_inputs)`` through ``torch.compile`` with this (``aot_eager``) compiler,
        backward included: the records of the graphs compiled and (``keep_joint``) their joint
        graphs before our joint passes, for :meth:`replay`. With fake inputs (``fake_mode``) and a
        model sharded with ``materialize=False`` nothing is allocated; ``dynamo_pass`` may rewrite
        each Dynamo graph first."""
        if self.options.compiler != "aot_eager":
            raise ValueError("planning traces with compiler='aot_eager' (nothing is compiled for a device)")
        start = len(self.graphs)
        captures: list[JointCapture] = []
        self._captures = captures if keep_joint else None
        try:
            run_traced(self, fn, example_inputs, lambda: self.graphs[start:], dynamo_pass=dynamo_pass,
                       fake_mode=fake_mode)
        finally:
            self._captures = None
        return self.graphs[start:], captures

    def replay(
        self, capture: JointCapture, partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None,
    ) -> tuple[CompiledGraph, tuple[fx.GraphModule, fx.GraphModule]]:
        """What this pipeline makes of a joint graph another backend captured with the same shard
        shapes (so only the markers' arguments differ, and are rewritten to this backend's);
        ``partitioned`` is reused where the caller knows the reshard policy is the same. Returns
        the record and the partitioned graphs, before our passes."""
        record = CompiledGraph(index=len(self.graphs), dynamo=capture.record.dynamo, compiler="aot_eager")
        self.graphs.append(record)
        if partitioned is None:
            from torch._guards import detect_fake_mode

            joint = copy_graph_module(capture.joint)
            rewrite_markers(self.state.params, joint.graph)
            # The partitioner may make fake tensors (RNG states of checkpointed regions) in the
            # fake mode AOTAutograd traced with, which is no longer active here.
            fake_mode = detect_fake_mode(capture.inputs)
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                self.joint_stage(joint, record)
                partitioned = self.partition_stage(joint, capture.inputs, record, **capture.kwargs)
        for phase, gm in zip(("forward", "backward"), partitioned):
            # Our passes rewrite the graph they are given in place, and the partitioned graphs
            # are shared between candidates: a copy carrying this backend's markers gets them.
            previous = rewrite_markers(self.state.params, gm.graph)
            try:
                mine = copy_graph_module(gm)
            finally:
                for node, args in previous.items():
                    node.args = args
            self.graph_stage(mine, phase, record)
        return record, partitioned

    def trace_step(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph:
        """This captured graph's forward and backward under the current reshard policy, through our
        passes, without code generation, dumps or a record, in a tracing context of its own."""
        record = CompiledGraph(index=-1, dynamo=gm, compiler="aot_eager")
        self.log.quiet = True
        try:
            with own_tracing_context(), backward_now(), collector_paused():
                compile_aot_eager(gm, example_inputs, self._stages(record), self.guard.timeout)
        finally:
            self.log.quiet = False
        return record


def pass_context(options: BackendOptions, state: ShardingState, phase: str,
                 decompositions: dict | None = None) -> PassContext:
    """What ``phase``'s passes are told: the bucket policy, the schedule options (graph stage,
    with schedule=True), the units' reshard choice (joint stage, under memory_budget=)."""
    schedule = None
    if options.schedule and phase not in ("joint", "partitioned"):
        kind = "backward" if phase == "backward" else "forward"
        schedule = ScheduleOptions(options.prefetch, options.max_inflight_bytes, state.explicit_prefetch[kind])
    reshard = None
    choice = state.reshard_choice
    if phase == "joint" and choice is not None:
        groups = {n: g.group_name for n, g in state.reshard_groups.groups().items()}
        reshard = {unit: (ranks, groups.get(ranks, "")) for unit, ranks in choice.reshard_to.items()}
    return PassContext(phase, bucket_policy=options.bucket_policy, decompositions=decompositions,
                       schedule=schedule, reshard=reshard)


def rewrite_markers(params: dict[str, ShardedParamInfo], graph: fx.Graph) -> dict[fx.Node, tuple]:
    """Give every marker of ``graph`` this backend's arguments for its parameter (backends that
    shard the same model with the same shard shapes trace the same joint graph but for them);
    returns the previous arguments by node."""
    previous = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (UNSHARD, REDUCE_GRAD):
            continue
        marker = decode(node)
        previous[node] = node.args
        info = params.get(marker.fqn)
        if info is None:
            raise ValueError(f"replaying a graph of parameter {marker.fqn!r}, which this backend did not shard")
        if node.target is UNSHARD:
            node.args = (marker.input, *info.unshard_args)
        else:
            node.args = (marker.input, info.fqn, info.unit, marker.rows, marker.grad_dtype, *info.comm.op_args())
        if decode(node).spec.shard_size != marker.spec.shard_size:
            raise ValueError(f"replaying a graph sharded over {marker.spec.shard_size} ranks with a backend "
                             f"that shards over {info.comm.shard_size}: trace this layout instead")
    return previous
