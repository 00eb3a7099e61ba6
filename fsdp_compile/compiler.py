"""The compile pipeline, as a component: what happens to one graph Dynamo captured.

    capture (Dynamo) -> joint passes -> partition -> partition fix-ups -> graph passes -> inner compiler

:class:`Compiler` is the ``torch.compile`` backend behind :class:`fsdp_compile.FSDPBackend`:
Dynamo hands it each captured graph; AOTAutograd traces the joint forward/backward graph, our
joint passes turn the strategy's reshard policy into partitioner tags, the min-cut partitioner
splits it, the partition fix-ups repair what the partitioner leaves (saved RNG states), and the
graph passes lower markers to bucketed collectives and schedule them, before Inductor (or
``aot_eager``) compiles the result. The passes and their order are data
(``fsdp_compile.passes.pipeline.PIPELINE``); one runner dumps, times and falls back for every
stage. The planner runs this same component on fake tensors at another world size
(:meth:`Compiler.trace_for_planning`, :meth:`Compiler.replay_for_planning`).

The backend owns the sharding (options, topology, parameters); the compiler reads them and
records one :class:`CompiledGraph` per captured graph in ``backend.graphs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import gradient_check
from .agreement import CollectiveCall, collective_calls
from .compile_cache import (
    CacheState,
    cache_key,
    load_collectives,
    prepare_directory,
    save_collectives,
    user_pass_uuids,
)
from .inspection.dump import Dumper, graph_code, manifest_for
from .inspection.graphinfo import is_gathered
from .inspection.memory import (
    MemoryEstimate,
    estimate_memory,
    input_bytes,
    output_storage_keys,
    storage_lifetimes,
)
from .inspection.report import graph_summary
from .passes.bucketing import Bucket
from .passes.context import PassContext
from .passes.graph import ROLE_META, SAVED_STORAGE_META, copy_graph_module, is_collective
from .passes.pipeline import PassFailure, run_stage
from .passes.regions import PARAM_META, has_regions, inline_regions, is_region_body_joint, is_region_call
from .passes.scheduling import Schedule, ScheduleOptions
from .runtime.faults import reraise_named
from .runtime.markers import REDUCE_GRAD, UNSHARD, decode
from .sharding.groups import world_timeout
from .sharding.sharded_param import leaf_owner, sharded_name

if TYPE_CHECKING:
    from .backend import FSDPBackend

log = logging.getLogger("fsdp_compile")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class PhaseResult:
    """What our passes made of one phase's graph (forward, or backward)."""

    graph: fx.GraphModule | None = None  # after our passes (None: not compiled, or loaded from the cache)
    buckets: dict[str, list[Bucket]] = field(default_factory=dict)  # "unshard" / "reduce_grad" -> buckets
    schedule: Schedule | None = None
    memory: MemoryEstimate | None = None


def _phase_results() -> dict[str, PhaseResult]:
    return {"forward": PhaseResult(), "backward": PhaseResult()}


@dataclass
class CompiledGraph:
    """The graphs the backend produced for one Dynamo graph, after its passes.

    ``phases["forward"]`` / ``phases["backward"]`` hold each phase's graph, buckets, schedule
    and memory estimate (an inference graph is the forward phase); ``forward``,
    ``backward_memory`` and the like read them.
    """

    index: int
    dynamo: fx.GraphModule
    phases: dict[str, PhaseResult] = field(default_factory=_phase_results)
    inference: bool = False
    forward_output_roles: list[str] = field(default_factory=list)
    forward_output_storages: list[Any] = field(default_factory=list)  # storage keys, as the roles
    forward_param_bytes: int = 0
    compiler: str = ""
    fallbacks: list[dict[str, str]] = field(default_factory=list)  # passes that failed, per phase
    pass_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> pass -> s
    # For compile-time accounting (bench/compile_time.py): nodes each phase's passes received,
    # and seconds spent in the whole of our work per phase (passes, copies, memory estimate).
    graph_nodes: dict[str, int] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # Inductor only (see fsdp_compile.compile_cache): "hit" (loaded: no passes ran, so no
    # forward/backward graphs here), "miss" (compiled and stored), or "off: <why>".
    cache: str = ""
    cache_key: str | None = None

    forward = property(lambda self: self.phases["forward"].graph)
    backward = property(lambda self: self.phases["backward"].graph)
    forward_buckets = property(lambda self: self.phases["forward"].buckets)
    backward_buckets = property(lambda self: self.phases["backward"].buckets)
    forward_schedule = property(lambda self: self.phases["forward"].schedule)
    backward_schedule = property(lambda self: self.phases["backward"].schedule)
    forward_memory = property(lambda self: self.phases["forward"].memory)
    backward_memory = property(lambda self: self.phases["backward"].memory)


class Compiler:
    """Compiles the graphs Dynamo captures from a model ``backend`` sharded."""

    def __init__(self, backend: FSDPBackend) -> None:
        self.backend = backend
        cache_dir = backend.options.cache_dir
        self.cache_state = (prepare_directory(cache_dir) if cache_dir is not None
                            else CacheState(False, "no cache_dir= given"))
        self.cache_stats = {"hits": 0, "misses": 0, "off": 0}
        self._cache_warned = False
        self._dumper_instance: Dumper | None = None
        self._joint_captures: list[JointCapture] | None = None  # planning: joints seen by _partition
        tolerance = gradient_check.requested(backend.options.verify_gradients)
        self.gradient_check = gradient_check.GradientCheck(tolerance) if tolerance is not False else None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """Dynamo's backend entry: compile one captured graph (see the module docstring)."""
        self._check_inputs(gm, example_inputs)
        compiler = "eager" if _env_flag("FSDP_COMPILE_EAGER") else self.backend.options.compiler
        record = CompiledGraph(index=len(self.backend.graphs), dynamo=gm, compiler=compiler)
        self.backend.graphs.append(record)
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "dynamo.py", graph_code(gm))
        self.captured_passes(gm, example_inputs, record)
        if compiler == "eager":
            # The captured graph as Python: every marker runs the eager runtime, so a user can
            # step through it with pdb and print tensors.
            if inline_regions(gm):
                gm.recompile()
            self._write_summary(record)
            return self._guarded(gm.forward, record)
        # Compile the backward graph now, not at the first backward: the first run of the
        # forward checks both graphs' collectives against the other ranks.
        eager_backward = ({"force_non_lazy_backward_lowering": True}
                          if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering") else {})
        with torch._functorch.config.patch(**eager_backward), collector_paused():
            if compiler == "aot_eager":
                compiled = self._compile_aot_eager(gm, example_inputs, record)
            else:
                compiled = self._compile_inductor(gm, example_inputs, record)
        return self._guarded(compiled, record)

    def _guarded(self, compiled: Callable, record: CompiledGraph) -> Callable:
        """``compiled`` as Dynamo calls it: its collectives checked against the other ranks' on
        its first run (``verify=True``), its gradients against the eager runtime's on its first
        step (``verify_gradients``), and a failed collective reported as the forward of this
        graph having lost another rank."""
        verifier = self.backend.verifier if self.backend.options.verify else None
        check = self.gradient_check if record.compiler != "eager" else None
        timeout = self.backend.options.timeout or world_timeout()
        first_run = [True]

        def run(*args: Any) -> Any:
            replaced = self._refresh_leaves()
            if replaced is not None:
                return self._run_eagerly_once(record, compiled, args, replaced)
            if verifier is not None:
                if first_run[0]:
                    kind = "inference graph" if record.inference else "graph"
                    verifier.verify(f"{kind} {record.index} (forward and backward)", self._collectives(record))
                    first_run[0] = False
                verifier.calls += 1
            try:
                if check is not None and check.wants(record.index):
                    inputs = _flat_inputs(compiled, args)
                    names = [self._input_name(value, node) for value, node in
                             zip(inputs, (n for n in record.dynamo.graph.nodes if n.op == "placeholder"))]
                    return check.run(record.index, names, self._as_python(record), inputs, lambda: compiled(*args))
                return compiled(*args)
            except Exception as exc:
                reraise_named(exc, f"the forward of compiled graph {record.index}", timeout)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    def _refresh_leaves(self) -> dict[int, torch.Tensor] | None:
        """Bring the leaves that stand for the parameters in line with them (``requires_grad``
        toggled, storage replaced since the last call); None when nothing changed."""
        replaced: dict[int, torch.Tensor] = {}
        for shards in self.backend.local_shards:
            replaced.update(shards.refresh())
        return replaced if replaced else None

    def _run_eagerly_once(self, record: CompiledGraph, compiled: Callable, args: tuple[Any, ...],
                          replaced: dict[int, torch.Tensor]) -> Any:
        """This call through the eager runtime: the compiled graph was traced for leaves that
        no longer match their parameters (a parameter frozen or unfrozen since), so its autograd
        would be wrong for them. Dynamo's guards on the leaves compile a new graph next call."""
        flat = _flat_inputs(compiled, args)
        if _boxed(compiled, args):
            args[0].clear()  # a boxed call hands its inputs over
        flat = [replaced.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in flat]
        return self._as_python(record)(*flat)

    @staticmethod
    def _as_python(record: CompiledGraph) -> fx.GraphModule:
        """The captured graph as Python, every marker run by the eager runtime. Regions run only
        under AOTAutograd (their backward is traced on first use): a copy with them inlined is
        made once and kept as the record's graph."""
        if any(is_region_call(n) for n in record.dynamo.graph.nodes):
            record.dynamo = copy_graph_module(record.dynamo)
            inline_regions(record.dynamo)
            record.dynamo.recompile()
        return record.dynamo

    @staticmethod
    def _input_name(value: Any, node: fx.Node) -> str:
        name = sharded_name(value) if isinstance(value, torch.Tensor) else None
        return name or f"input {_parameter_name(node)}"

    def _collectives(self, record: CompiledGraph) -> list[CollectiveCall]:
        """What ``record`` issues, for the first-run agreement check. A graph loaded from the
        compile cache has no lowered graphs here: its sequence was kept beside the entry by the
        run that compiled it, so ranks that hit and ranks that missed compare alike."""
        if record.cache == "hit" and self.cache_state.directory is not None:
            kept = load_collectives(self.cache_state.directory, record.cache_key, record.dynamo.code)
            if kept is not None:
                return [CollectiveCall(**{**c, "params": tuple(c["params"])}) for c in kept]
        return collective_calls(record, self.backend.topology.group_roles())

    def _check_inputs(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, example_inputs):
            if not isinstance(value, nn.Parameter) or value in self.backend._owned:
                continue
            owner = leaf_owner(value)
            if owner is not None and owner in self.backend.local_shards:
                continue
            name = sharded_name(value) or _parameter_name(node)
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

    def _dumper(self) -> Dumper | None:
        root = self.backend.options.dump_dir or os.environ.get("FSDP_COMPILE_DUMP")
        if not root:
            return None
        if self._dumper_instance is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            manifest = manifest_for(self.backend.strategy.name, world, self._describe_options())
            self._dumper_instance = Dumper(root, rank, manifest)
        return self._dumper_instance

    def _describe_options(self) -> dict[str, Any]:
        o = self.backend.options
        return {"compiler": o.compiler, "bucket": self.backend.bucket_policy.describe(), "schedule": o.schedule,
                "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                "mixed_precision": repr(o.mixed_precision) if o.mixed_precision else None,
                "shard_size": self.backend.topology.shard_size if self.backend.topology else None,
                "replicate_size": self.backend.topology.replicate_size if self.backend.topology else None}

    def _write_summary(self, record: CompiledGraph) -> None:
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_summary(record.index, graph_summary(record, self.backend))

    def _fail(self, record: CompiledGraph, phase: str, failure: PassFailure) -> None:
        """A pass failed on a graph: raise under strict=True, else warn; the caller falls back."""
        where = f"graph {record.index} ({phase})"
        if self.backend.options.strict:
            raise RuntimeError(f"fsdp_compile: {failure} on {where}") from failure.__cause__
        message = (f"fsdp_compile: {failure} on {where}; running that graph with its FSDP markers "
                   "executed by the eager runtime (same results, no bucketing or scheduling). "
                   "Pass strict=True to raise instead.")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
        record.fallbacks.append({"phase": phase, "pass": failure.pass_name, "error": str(failure.__cause__)})

    def _partition(self, joint: fx.GraphModule, joint_inputs: Sequence[Any], record: CompiledGraph,
                   **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        # A region's body comes without inputs: AOTAutograd partitions it once for every call of
        # it, and it holds no markers, so nothing of ours applies to it.
        body = not joint_inputs and is_region_body_joint(joint.graph)
        if not body:
            if self._joint_captures is not None:
                self._joint_captures.append(
                    JointCapture(record, copy_graph_module(joint), list(joint_inputs), dict(kwargs)))
            self.joint_passes(joint, record)
        start = time.perf_counter()
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        record.stage_seconds["partition"] = record.stage_seconds.get("partition", 0.0) + time.perf_counter() - start
        partition_fixups(forward, backward, self.backend.options.disable_passes)
        if not body and self._joint_captures is not None:
            self._joint_captures[-1].partitioned = (copy_graph_module(forward), copy_graph_module(backward))
        return forward, backward

    def _pass_context(self, phase: str, decompositions: dict | None = None) -> PassContext:
        schedule = None
        if self.backend.options.schedule and phase not in ("joint", "partitioned"):
            kind = "backward" if phase == "backward" else "forward"
            schedule = ScheduleOptions(self.backend.options.prefetch, self.backend.options.max_inflight_bytes,
                                       self.backend.explicit_prefetch[kind])
        return PassContext(phase, bucket_policy=self.backend.bucket_policy, decompositions=decompositions,
                           schedule=schedule)

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
        ctx = PassContext("captured", params={fqn: info.unshard_args for fqn, info in self.backend.params.items()})
        try:
            _, results = run_stage(gm, "captured", ctx, disabled=self.backend.options.disable_passes)
        except PassFailure as failure:
            self._fail(record, "captured", failure)
            results = failure.results
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
                                   disabled=self.backend.options.disable_passes, rollback=False, regenerate=False)
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

    def graph_passes(self, gm: fx.GraphModule, phase: str, record: CompiledGraph,
                      decompositions: dict | None = None) -> fx.GraphModule:
        """Lower and schedule one graph; on a pass failure, keep it as it was (markers run eagerly)."""
        started = time.perf_counter()
        record.graph_nodes[phase] = len(gm.graph.nodes)
        if phase == "backward":
            self._tag_saved_inputs(gm, record.forward_output_roles, record.forward_output_storages)
        kind = "backward" if phase == "backward" else "forward"
        dumper = self._dumper()
        on_graph = None
        if dumper is not None:
            counter = itertools.count()

            def on_graph(step: str, g: fx.GraphModule) -> None:
                dumper.write_graph(record.index, f"{phase}/{next(counter):02d}_{step}.py", graph_code(g))
        try:
            gm, results = run_stage(gm, "graph", self._pass_context(phase, decompositions),
                                    disabled=self.backend.options.disable_passes,
                                    user_passes=self.backend.options.passes.get(kind, []), on_graph=on_graph)
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
        buckets = values.get("lower_markers") or {}
        schedule = values.get("schedule_collectives")
        timings = {r.name: r.seconds for r in results}
        record.phases[kind] = PhaseResult(snapshot, buckets, schedule, memory)
        record.pass_seconds[kind] = timings
        if phase != "backward":
            record.inference = phase == "inference"
            record.forward_output_roles = _output_roles(gm)
            record.forward_output_storages = output_storage_keys(lifetimes)
            record.forward_param_bytes = input_bytes(gm, "param")
        self._write_summary(record)
        record.stage_seconds[phase] = time.perf_counter() - started
        return gm

    @staticmethod
    def _tag_saved_inputs(gm: fx.GraphModule, forward_output_roles: list[str],
                          forward_output_storages: list[Any]) -> None:
        """Give the backward graph's saved inputs the roles and storage keys their forward
        outputs had.

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

    def _compile_aot_eager(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        timeout = self.backend.options.timeout or world_timeout()

        def compiler(phase: str):
            def compile_graph(g: fx.GraphModule, inputs: Sequence[Any]):
                run = self.graph_passes(g, phase, record).forward
                if phase != "backward":
                    return make_boxed_func(run)

                def backward(args: list) -> Any:
                    try:
                        return run(*args)
                    except Exception as exc:
                        reraise_named(exc, f"the backward of compiled graph {record.index}", timeout)

                backward._boxed_call = True  # type: ignore[attr-defined]
                return backward
            return compile_graph

        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=functools.partial(self._partition, record=record),
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table

        def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
            if kwargs.get("is_backward"):
                phase = "backward"
            else:
                phase = "inference" if kwargs.get("is_inference") else "forward"
            lowered = self.graph_passes(g, phase, record, select_decomp_table())
            scheduled = record.backward_schedule if phase == "backward" else record.forward_schedule
            if scheduled is None or not any(is_collective(n) for n in lowered.graph.nodes):
                return compile_fx_inner(lowered, inputs, **kwargs)
            # Inductor's peak-memory reordering (on by default) replaces the node order with
            # whichever topological sort it estimates lowest in memory: it moves each backward
            # all-gather to right before its wait and every reduce-scatter's wait to the end of
            # the graph, undoing the prefetch and the in-flight budget schedule_collectives set.
            # It runs after fusion, so without it the kernels, and the results, are the same. A
            # graph with no collective (world 1, NO_SHARD's forward), or one the scheduling pass
            # did not order (schedule=False, disabled, failed), has no order of ours to keep.
            with torch._inductor.config.patch(reorder_for_peak_memory=False):
                return compile_fx_inner(lowered, inputs, **kwargs)

        key, lookups, why_off = self.cache_key()
        joint_pass = _JointPass(self, record, torch._inductor.config.joint_custom_pre_pass, key)
        patches: dict[str, Any] = {"joint_custom_pre_pass": joint_pass}
        if hasattr(torch._inductor.config, "custom_partitioner_fn"):  # torch >= 2.12
            patches["custom_partitioner_fn"] = _Partitioner(torch._inductor.config.custom_partitioner_fn,
                                                            self.backend.options.disable_passes, key)
        if self.gradient_check is not None:
            patches["fallback_random"] = True  # random ops draw what the eager runtime draws
        if not self.cache_state.enabled and self.cache_state.directory is not None:
            patches["fx_graph_cache"] = False  # an unusable cache_dir: cold, nothing read or written
        # The AOTAutograd cache keys on the Dynamo graph and Inductor's configuration, where our
        # key travels as the uuid of the joint pass and partitioner above: a hit is exactly what
        # our passes would produce again. A key of None (a pass we cannot key) makes Inductor
        # bypass its caches.
        counts = torch._dynamo.utils.counters["aot_autograd"]
        hits, bypasses = counts["autograd_cache_hit"], counts["autograd_cache_bypass"]
        functorch_patches: dict[str, Any] = {"enable_autograd_cache": lookups}
        if any(is_region_call(n) for n in gm.graph.nodes):
            # Inductor lowers a region's backward body with the indices of the backward graph's
            # donated buffers (saved tensors it may overwrite), applied to the body's own inputs:
            # the body then writes its result over an input the caller still reads (the gradient
            # arriving from the next block). Upstream torch fixes this after 2.13 (pytorch#193960);
            # until then, graphs with regions donate nothing (see docs/design.md).
            functorch_patches["donated_buffer"] = False
        with torch._functorch.config.patch(**functorch_patches):
            compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
        if lookups and counts["autograd_cache_bypass"] > bypasses:
            lookups, why_off = False, "Inductor bypassed its cache for this graph (TORCH_LOGS=+aot_autograd says why)"
        if not lookups:
            record.cache = f"off: {why_off}"
            self.cache_stats["off"] += 1
        elif counts["autograd_cache_hit"] > hits:
            record.cache = "hit"
            self.cache_stats["hits"] += 1
        else:
            record.cache = "miss"
            self.cache_stats["misses"] += 1
            save_collectives(self.cache_state.directory, key, gm.code,
                             [dataclasses.asdict(c)
                              for c in collective_calls(record, self.backend.topology.group_roles())])
        record.cache_key = key
        return compiled

    def cache_key_parts(self) -> dict[str, Any]:
        """Everything our passes' result depends on besides the Dynamo graph (see
        :mod:`fsdp_compile.compile_cache`); the user's passes are keyed by their uuids."""
        o, topo = self.backend.options, self.backend.topology
        groups = {}
        for name, group in (("shard", topo and topo.shard_group), ("replicate", topo and topo.replicate_group)):
            groups[name] = dist.get_process_group_ranks(group) if group is not None else None
        policy = self.backend.bucket_policy
        # AOTAutograd keys a DTensor input by its global metadata only, so with uneven shards
        # ranks whose local shards differ would share an entry (a wrong graph, caught by a
        # size assertion at best): the rank and every local shard's metadata are part of ours.
        local = sorted((name, tuple(p.to_local().shape), tuple(p.to_local().stride()), str(p.dtype), str(p.device))
                       for p in self.backend._owned for name in [sharded_name(p) or ""])
        return {
            "strategy": self.backend.strategy.name,
            "compiler": o.compiler,
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "local_shards": local,
            "groups": groups,
            "bucket": {"kind": policy.kind, "max_bytes": policy.max_bytes, "describe": policy.describe()},
            "schedule": {"on": o.schedule, "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                         "explicit": self.backend.explicit_prefetch},
            "mixed_precision": repr(o.mixed_precision),
            "offload": repr(o.offload),
            "kernels": os.environ.get("FSDP_COMPILE_KERNELS", ""),
            "disable_passes": list(o.disable_passes),
            "region_copies": self.backend.region_copies(),
            "strict": o.strict,
        }

    def cache_key(self) -> tuple[str | None, bool, str]:
        """(key for Inductor's caches, None to bypass them; whether AOTAutograd's cache may be
        read; why it may not)."""
        state = self.cache_state
        if not state.enabled and state.directory is not None:
            return None, False, state.reason  # an unusable cache_dir: everything cold
        uuids, why = user_pass_uuids(self.backend.options.passes)
        # Inductor's FX graph cache keys on the graph our passes produced, so it stays right
        # whatever the key; AOTAutograd's keys on the graph before them and needs all of it.
        key = cache_key({**self.cache_key_parts(), "user_passes": uuids if uuids is not None else "unkeyed"})
        if not state.enabled:
            return key, False, state.reason
        if uuids is None:
            self._warn_cache_off(why)
            return key, False, why
        if self._dumper() is not None:
            # A hit would skip the passes, and with them the dump: compile (an entry stored
            # under the same key stays right for later runs without dumps).
            return key, False, "dumping graphs (dump_dir / FSDP_COMPILE_DUMP) needs the passes to run"
        return key, True, ""

    def _warn_cache_off(self, why: str) -> None:
        if not self._cache_warned:
            self._cache_warned = True
            warnings.warn(f"fsdp_compile: compile cache off: {why}", RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- planning seam
    # The planner (fsdp_compile/planning) runs this backend's own pipeline on fake tensors in a
    # fake world; these two methods are all it uses of the backend's internals.
    def trace_for_planning(
        self, fn: Callable, example_inputs: Sequence[Any], *, keep_joint: bool = False,
        dynamo_pass: Callable[[fx.GraphModule], None] | None = None, fake_mode: Any = None,
    ) -> tuple[list[CompiledGraph], list[JointCapture]]:
        """Run ``fn(*example_inputs)`` through ``torch.compile`` with this backend: Dynamo capture,
        AOTAutograd, the reshard policy, partitioning and our passes, backward included.

        Nothing is compiled for a device (the inner compiler is ``aot_eager``) and with fake
        inputs and a model sharded by ``_shard(materialize=False)`` nothing is allocated.
        ``dynamo_pass`` may rewrite each Dynamo graph first (the planner maps attention to the
        kernel the target device dispatches to). With ``keep_joint`` the joint graph of each
        Dynamo graph is kept, before our joint passes, for :meth:`replay_for_planning`.
        ``fake_mode``: the FakeTensorMode of fake inputs; the compiled graphs run under it, so
        tensors they create (``arange``) are fake too. Returns the records of the graphs
        compiled by this call and the joints.
        """
        if self.backend.options.compiler != "aot_eager":
            raise ValueError("planning traces with compiler='aot_eager' (nothing is compiled for a device)")
        start = len(self.backend.graphs)
        captures: list[JointCapture] = []
        self._joint_captures = captures if keep_joint else None

        def capture(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
            if dynamo_pass is not None:
                dynamo_pass(gm)
                gm.recompile()
            compiled = self(gm, inputs)
            if fake_mode is None:
                return compiled

            def run(*args: Any) -> Any:
                with fake_mode:
                    return compiled(*args)
            return run

        functorch_patches = {}
        if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
            functorch_patches["force_non_lazy_backward_lowering"] = True  # lower backward now, not at .backward()
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        dynamo_patches = {limit: 1 << 20, "accumulated_" + limit: 1 << 20, "automatic_dynamic_shapes": False}
        try:
            with torch._functorch.config.patch(**functorch_patches), torch._dynamo.config.patch(**dynamo_patches):
                output = torch.compile(fn, backend=capture)(*example_inputs)
                records = self.backend.graphs[start:]
                if any(r.backward is None and not r.inference for r in records):
                    # A torch whose AOTAutograd lowers backward lazily: run it (on fake tensors).
                    loss = [t for t in torch.utils._pytree.tree_leaves(output)
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    if loss:
                        torch.autograd.backward(loss, [torch.ones_like(t) for t in loss])
        finally:
            self._joint_captures = None
        return self.backend.graphs[start:], captures

    def replay_for_planning(
        self, capture: JointCapture, partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None,
    ) -> tuple[CompiledGraph, tuple[fx.GraphModule, fx.GraphModule]]:
        """What this backend's pipeline makes of a joint graph another backend captured.

        Valid when both sharded the same model with the same shard shapes, so the joint graphs
        differ only in the markers' arguments (groups, reshard flag, bucket unit): they are
        rewritten to this backend's, then partitioned under this backend's reshard policy (or
        ``partitioned`` reused, when the caller knows the policy is the same) and our passes
        run. Returns the record and the partitioned graphs, before our passes.
        """
        record = CompiledGraph(index=len(self.backend.graphs), dynamo=capture.record.dynamo, compiler="aot_eager")
        self.backend.graphs.append(record)
        if partitioned is None:
            from torch._guards import detect_fake_mode

            joint = copy_graph_module(capture.joint)
            self._rewrite_markers(joint.graph)
            # The partitioner may make fake tensors (RNG states of checkpointed regions) in the
            # fake mode AOTAutograd traced with, which is no longer active here.
            fake_mode = detect_fake_mode(capture.inputs)
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                partitioned = self._partition(joint, capture.inputs, record, **capture.kwargs)
        for phase, gm in zip(("forward", "backward"), partitioned):
            # Our passes rewrite the graph they are given in place, and the partitioned graphs
            # are shared between candidates: a copy carrying this backend's markers gets them.
            previous = self._rewrite_markers(gm.graph)
            try:
                mine = copy_graph_module(gm)
            finally:
                for node, args in previous.items():
                    node.args = args
            self.graph_passes(mine, phase, record)
        return record, partitioned

    def _rewrite_markers(self, graph: fx.Graph) -> dict[fx.Node, tuple]:
        """Give every marker of ``graph`` this backend's arguments for its parameter; returns
        the previous arguments by node."""
        previous = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in (UNSHARD, REDUCE_GRAD):
                continue
            marker = decode(node)
            previous[node] = node.args
            info = self.backend.params.get(marker.fqn)
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


def partition_fixups(forward: fx.GraphModule, backward: fx.GraphModule, disabled: Sequence[str] = ()) -> None:
    """The repairs a partitioned pair needs (stage "partitioned"). A failure is a real error:
    the pair would not run as partitioned. Needs nothing of a compilation but the disabled
    pass names, so Inductor's copy of its partitioner hook stays a plain object."""
    ctx = PassContext("partitioned", forward=forward)
    try:
        run_stage(backward, "partitioned", ctx, disabled=disabled, rollback=False, regenerate=False)
    except PassFailure as failure:
        raise failure.__cause__ from None


@dataclass
class JointCapture:
    """A joint graph as AOTAutograd handed it to the partitioner, before our joint passes."""

    record: CompiledGraph
    joint: fx.GraphModule
    inputs: list[Any]
    kwargs: dict[str, Any]
    partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None  # under the capturing backend's policy


class _JointPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Our joint-graph passes, run by Inductor's partition step before it partitions.

    A joint pass the user already configured still runs, after ours.
    """

    def __init__(self, compiler: Compiler, record: CompiledGraph,
                 user_pass: Callable[[fx.Graph], None] | None, key: str | None = None) -> None:
        self.compiler = compiler
        self.record = record
        self.user_pass = user_pass
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        self.compiler.joint_passes(graph.owning_module, self.record)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Any:
        return _uuid(self.key, self.user_pass)


def _uuid(key: str | None, user_pass: Any) -> Any:
    """Our key, plus the uuid of the user's pass we wrap; None (Inductor then bypasses its
    caches) when either is unknown."""
    if key is None:
        return None
    if user_pass is None:
        return key
    user_uuid = getattr(user_pass, "uuid", None)
    user_uuid = user_uuid() if callable(user_uuid) else None
    return None if user_uuid is None else (key, user_uuid)


class _Partitioner(getattr(torch._inductor.custom_graph_pass, "CustomPartitionerFn", object)):
    """Inductor's partitioner (or the user's) followed by the RNG-state reordering fix."""

    def __init__(self, user_partitioner: Callable[..., Any] | None, disabled: Sequence[str] = (),
                 key: str | None = None) -> None:
        self.user_partitioner = user_partitioner
        self.disabled = tuple(disabled)
        self.key = key

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        partition = self.user_partitioner or min_cut_rematerialization_partition
        forward, backward = partition(gm, joint_inputs, **kwargs)
        partition_fixups(forward, backward, self.disabled)
        return forward, backward

    def uuid(self) -> Any:
        return _uuid(self.key, self.user_partitioner)


def _boxed(compiled: Callable, args: tuple[Any, ...]) -> bool:
    """Whether ``compiled`` takes its inputs as one list it consumes (AOTAutograd's boxed calls)."""
    return getattr(compiled, "_boxed_call", False) and len(args) == 1 and isinstance(args[0], list)


def _flat_inputs(compiled: Callable, args: tuple[Any, ...]) -> list[Any]:
    return list(args[0]) if _boxed(compiled, args) else list(args)


def _is_size(node: fx.Node) -> bool:
    """A graph value that is a number (a SymInt size), not a tensor."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _output_roles(gm: fx.GraphModule) -> list[str]:
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


_SOURCE_KEY = re.compile(r"_(?:modules|parameters)\['([^']+)'\]")


def _parameter_name(node: fx.Node) -> str:
    """The dotted name of a parameter input, from the source Dynamo recorded for it."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return node.name
    name = source.name() if callable(source.name) else source.name
    keys = _SOURCE_KEY.findall(name)
    return ".".join(keys) if keys else name


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a graph compiles.

    Compiling allocates millions of long-lived objects (graphs, nodes, fake tensors); the
    automatic collector then walks the whole growing heap again and again: at 64 layers about
    16% of a compile, plain torch.compile's included. Paused, objects still die by reference
    count; cyclic garbage waits for the next automatic collection after the compile, one
    walk instead of many. The caller's collector state is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
