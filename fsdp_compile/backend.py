"""The Dynamo backend: shard a model, then compile graphs that carry FSDP markers.

Pipeline for one Dynamo graph (compiled mode):

1. Check every parameter input is a shard this package made (else: call ``shard`` first).
2. AOTAutograd traces the joint forward/backward graph; the ``unshard`` markers' autograd
   formula puts ``reduce_grad`` markers into its backward half.
3. Joint passes (before the partitioner) decide what is kept for backward: the strategy's
   reshard policy as recompute tags.
4. The min-cut partitioner splits forward and backward; graph passes run on each half.
5. The inner compiler (Inductor, or ``aot_eager`` which runs the graph as Python) compiles them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import hashlib
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from . import ops  # noqa: F401  (registers the marker ops)
from .bucket_advice import oversized_bucket
from .agreement import CollectiveCall, GraphVerifier, agree_on_sharding, collective_calls
from .faults import reraise_named
from .compile_cache import (CacheState, cache_key, load_collectives, prepare_directory, save_collectives,
                            user_pass_uuids)
from .errors import ConfigError
from .grad_sync import GradientSync
from .groups import Topology, current_device, resolve_topology, world_timeout
from .offload import CPUOffload
from .mixed_precision import MixedPrecision
from .passes.bucketing import Bucket, BucketPolicy, parse_policy
from .dump import Dumper, graph_code, manifest_for
from .graphinfo import is_gathered
from .report import graph_summary, render_report
from .memory import MemoryEstimate, estimate_memory, input_bytes
from .passes.bucketing import ROOT_UNIT, unit_modules, unit_of
from .passes.graph import ROLE_META
from .passes.lowering import lower_markers
from .passes.pipeline import PassFailure, copy_graph_module, run_passes
from .passes.reshard import elide_trivial_unshard, tag_reshard_policy
from .passes.rng_state_order import order_rng_states_before_opaque
from .passes.scheduling import Schedule, ScheduleOptions, schedule_collectives
from .sharding import ShardedParamInfo, is_sharded, shard_module, sharded_name
from .strategy import ShardingStrategy

COMPILERS = ("inductor", "aot_eager", "eager")
log = logging.getLogger("fsdp_compile")
# shard() calls per mesh on this process: the agreement key of the n-th call is the same on every rank.
_SHARD_CALLS: dict[str, int] = {}


def _unique_parameters(model: nn.Module):
    """(module name, local name, parameter) for each distinct parameter, at its first owner."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield module_name, name, param


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@dataclass
class CompiledGraph:
    """The graphs the backend produced for one Dynamo graph, after its passes."""

    index: int
    dynamo: fx.GraphModule
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    inference: bool = False
    forward_buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    backward_buckets: dict[str, list[Bucket]] = field(default_factory=dict)
    forward_schedule: Schedule | None = None
    backward_schedule: Schedule | None = None
    forward_memory: MemoryEstimate | None = None
    backward_memory: MemoryEstimate | None = None
    forward_output_roles: list[str] = field(default_factory=list)
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


@dataclass
class _Options:
    strategy: ShardingStrategy
    compiler: str
    mesh: DeviceMesh | None
    process_groups: Any
    shard_size: int | None
    timeout: datetime.timedelta | None
    bucket: Any
    mixed_precision: MixedPrecision | None
    schedule: bool
    prefetch: int
    max_inflight_bytes: int | None
    forward_prefetch: Any
    backward_prefetch: Any
    dump_dir: str | None
    strict: bool
    passes: dict[str, list[Callable]]
    offload: CPUOffload | None
    verify: bool
    cache_dir: str | None = None


class FSDPBackend:
    """A ``torch.compile`` backend that trains a sharded model with FSDP semantics.

    Use :meth:`shard` on the model first (parameters become DTensor shards, so build the
    optimizer afterwards), then ``torch.compile(model, backend=this)``. A sharded model also
    runs without ``torch.compile`` (the eager runtime), with the same results.

    Options: ``compiler`` ("inductor", "aot_eager" or "eager"); ``mesh`` / ``process_groups`` /
    ``shard_size`` / ``timeout`` (see :func:`fsdp_compile.groups.resolve_topology`);
    ``bucket`` (see :mod:`fsdp_compile.passes.bucketing`); ``mixed_precision``
    (:class:`fsdp_compile.MixedPrecision`); ``schedule`` (overlap collectives with compute),
    ``prefetch``, ``max_inflight_bytes``, ``forward_prefetch`` / ``backward_prefetch``
    (``{unit: [units to gather when it starts]}``, units by name or module) (see
    :mod:`fsdp_compile.passes.scheduling`); ``dump_dir`` (or ``FSDP_COMPILE_DUMP``): write
    every graph before and after each pass plus a JSON summary (see :mod:`fsdp_compile.dump`);
    ``strict``: raise when a pass fails instead of running that graph through the eager
    runtime; ``passes``: extra passes ``{"forward" | "backward": [fn(GraphModule)]}`` run after
    ours; ``offload``: :class:`fsdp_compile.CPUOffload` keeps shards, gradients and the
    optimizer step in host memory; ``verify`` (default True): check at ``shard()`` and on the
    first run of every compiled graph that all ranks will communicate alike, and raise a named
    error on every rank otherwise (see :mod:`fsdp_compile.agreement`). ``cache_dir``: under
    Inductor, a process that
    compiles what an earlier one compiled with the same directory loads it from there (warm
    restarts; see :mod:`fsdp_compile.compile_cache`). ``FSDP_COMPILE_EAGER=1`` runs every
    captured graph through the eager runtime.

    ``strategy="auto"`` plans at :meth:`shard` time for this job's world, topology and device
    memory and applies the fastest configuration that fits (strategy, bucket policy, prefetch
    depth); it takes ``example_inputs`` (one rank's inputs), ``loss_fn``, ``cluster`` (default:
    the GPU's preset, or ``Cluster.measure()`` on a CPU), ``memory_budget`` (bytes per device;
    needed on a CPU) and ``plan_options`` (passed to :func:`fsdp_compile.plan`); the plan is
    ``backend.plan``. See the README's "Choosing a strategy".

    Training-loop controls: :meth:`no_sync` / :meth:`set_requires_gradient_sync` (gradient
    accumulation without communication); see also :mod:`fsdp_compile.checkpoint` and
    :func:`fsdp_compile.clip_grad_norm_`.
    """

    def __init__(
        self,
        strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        *,
        compiler: str = "inductor",
        mesh: DeviceMesh | None = None,
        process_groups: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
        shard_size: int | None = None,
        timeout: datetime.timedelta | None = None,
        bucket: BucketPolicy = "module",
        mixed_precision: MixedPrecision | None = None,
        schedule: bool = True,
        prefetch: int = 1,
        max_inflight_bytes: int | None = None,
        forward_prefetch: dict | None = None,
        backward_prefetch: dict | None = None,
        dump_dir: str | os.PathLike | None = None,
        strict: bool = False,
        passes: dict[str, Sequence[Callable[[fx.GraphModule], Any]]] | None = None,
        offload: CPUOffload | None = None,
        verify: bool = True,
        cache_dir: str | os.PathLike | None = None,
        example_inputs: Any = None,
        loss_fn: Callable[[Any], Any] | None = None,
        cluster: Any = None,
        memory_budget: float | None = None,
        plan_options: dict[str, Any] | None = None,
    ) -> None:
        auto = isinstance(strategy, str) and strategy.strip().lower() == "auto"
        self._auto = None
        if auto:
            from .planning.auto import AutoRequest

            if mesh is not None or process_groups is not None or shard_size is not None:
                raise ValueError("strategy='auto' chooses the layout itself; drop mesh=, process_groups= and shard_size=")
            if forward_prefetch is not None or backward_prefetch is not None or offload is not None:
                raise ValueError("strategy='auto' plans without forward_prefetch=, backward_prefetch= or offload=")
            self._auto = AutoRequest(example_inputs, loss_fn, cluster, memory_budget, plan_options=dict(plan_options or {}))
            strategy = ShardingStrategy.FULL_SHARD  # replaced by the plan's choice in shard()
        elif any(v is not None for v in (example_inputs, loss_fn, cluster, memory_budget, plan_options)):
            raise ValueError("example_inputs=, loss_fn=, cluster=, memory_budget= and plan_options= are for "
                             "strategy='auto'; to plan by hand call fsdp_compile.plan()")
        strategy = ShardingStrategy.parse(strategy)
        policy = parse_policy(bucket)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                f"mixed_precision= must be an fsdp_compile.MixedPrecision, got {type(mixed_precision).__name__}"
            )
        if compiler not in COMPILERS:
            raise ValueError(f"compiler={compiler!r} is not supported; use one of: {', '.join(COMPILERS)}")
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh= must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout= must be a datetime.timedelta, got {type(timeout).__name__}")
        if mesh is not None and process_groups is not None:
            raise ValueError("pass either mesh= or process_groups=, not both")
        if shard_size is not None and not strategy.is_hybrid:
            raise ValueError(
                f"shard_size= only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {strategy.name}"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (0 disables prefetching)")
        if max_inflight_bytes is not None and (
                isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int)
                or max_inflight_bytes <= 0):
            raise ValueError(f"max_inflight_bytes={max_inflight_bytes!r} must be a positive int (bytes) or None")
        for name, order in (("forward_prefetch", forward_prefetch), ("backward_prefetch", backward_prefetch)):
            if order is not None and not isinstance(order, dict):
                raise TypeError(f"{name}= takes a dict {{unit: [units to prefetch]}}, got {type(order).__name__}")
            if order is not None and not policy.uses_units:
                raise ValueError(f"{name}= names bucket units, which bucket={policy.describe()} does not have")
        if offload is not None and not isinstance(offload, CPUOffload):
            raise TypeError(f"offload= must be an fsdp_compile.CPUOffload, got {type(offload).__name__}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify= takes a bool, got {type(verify).__name__}")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir= takes a directory path, got {type(cache_dir).__name__}")
        passes = dict(passes or {})
        for phase, fns in passes.items():
            if phase not in ("forward", "backward"):
                raise ValueError(f"passes= takes the phases 'forward' and 'backward', not {phase!r}")
            if not all(callable(fn) for fn in fns):
                raise TypeError(f"passes[{phase!r}] must hold callables GraphModule -> GraphModule | None")
            passes[phase] = list(fns)
        self.options = _Options(strategy, compiler, mesh, process_groups, shard_size, timeout,
                                bucket, mixed_precision, schedule, prefetch, max_inflight_bytes,
                                forward_prefetch, backward_prefetch,
                                os.fspath(dump_dir) if dump_dir is not None else None, strict, passes,
                                offload, verify, os.fspath(cache_dir) if cache_dir is not None else None)
        self.cache_state = (prepare_directory(cache_dir) if cache_dir is not None
                            else CacheState(False, "no cache_dir= given"))
        self.cache_stats = {"hits": 0, "misses": 0, "off": 0}
        self._cache_warned = False
        self._dumper_instance: Dumper | None = None
        self.bucket_policy = policy
        self.units: set[str] = {ROOT_UNIT}
        self.explicit_prefetch: dict[str, dict[str, list[str]]] = {"forward": {}, "backward": {}}
        self.topology: Topology | None = None
        self.params: dict[str, ShardedParamInfo] = {}
        self.graphs: list[CompiledGraph] = []
        self._owned = WeakIdKeyDictionary()  # sharded parameter -> its info
        self.gradient_sync = GradientSync()
        self.init_peak_bytes: int | None = None  # meta-device init: most full parameter bytes held
        # Buckets over half of a model's parameters under a resharding strategy, by label: what
        # the report marks (see bucket_advice.py).
        self.oversized_buckets: dict[str, dict[str, Any]] = {}
        self._warned_oversized = False
        self.verifier: GraphVerifier | None = None
        self._joint_captures: list[JointCapture] | None = None  # planning: joints seen by _partition
        self.plan = None  # strategy="auto": the fsdp_compile.Plan the choice came from

    @property
    def strategy(self) -> ShardingStrategy:
        return self.options.strategy

    def __repr__(self) -> str:
        strategy = "auto" if self._auto is not None and self.plan is None else self.strategy.name
        return f"fsdp_compile.backend(strategy={strategy!r}, compiler={self.options.compiler!r})"

    # ---------------------------------------------------------------- sharding
    def shard(self, model: nn.Module, *, init_fn: Callable[[nn.Module], None] | None = None,
              device: torch.device | str | None = None) -> nn.Module:
        """Shard ``model``'s parameters in place over this backend's groups; returns ``model``.

        A model built on the meta device is materialized on ``device`` (default: the current
        accelerator, else the CPU) one bucket unit at a time, each module initialized by
        ``init_fn(module)`` or its own ``reset_parameters()`` in post-order (as
        ``model.apply``), and sharded as soon as its unit is done: no rank holds the whole
        model, and the values equal the unsharded initialization with the same seed.
        """
        return self._shard(model, init_fn=init_fn, device=device, materialize=True)

    def _shard(self, model: nn.Module, *, init_fn: Callable[[nn.Module], None] | None = None,
               device: torch.device | str | None = None, materialize: bool = True) -> nn.Module:
        """``shard``; with ``materialize=False`` (the planner's case) a meta-device model keeps
        meta shards: every shape, group and marker is what a real run gets, no byte is allocated."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"shard() takes an nn.Module, got {type(model).__name__}")
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise TypeError(
                "shard() got a model that torch.compile already wrapped; shard the plain module "
                "first, then compile it: torch.compile(backend.shard(model), backend=backend)"
            )
        if is_sharded(model):
            raise ValueError(
                "this model is already sharded (by fsdp_compile); shard a model once and reuse "
                "the backend that sharded it"
            )
        if self._auto is not None and self.plan is None:
            self._choose_strategy(model)
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn= must be a callable taking a module, got {type(init_fn).__name__}")
        init_device = torch.device(device) if device is not None else None
        device_type = self._device_type(model, init_device)
        if self.topology is None:
            self.topology = resolve_topology(
                self.strategy,
                device_type,
                mesh=self.options.mesh,
                process_groups=self.options.process_groups,
                shard_size=self.options.shard_size,
                timeout=self.options.timeout,
            )
        elif self.topology.mesh.device_type != device_type:
            raise ValueError(
                f"this backend shards over a {self.topology.mesh.device_type!r} mesh but the model's "
                f"parameters are on {device_type!r}; use one backend per device type"
            )
        if self.options.verify:
            self._agree_on_sharding(model)
        result = shard_module(model, self.topology, self.bucket_policy, self.options.mixed_precision,
                              sync=self.gradient_sync, offload=self.options.offload, init_fn=init_fn,
                              init_device=init_device or current_device(self.topology.mesh.device_type),
                              materialize=materialize)
        infos = result.infos
        if result.peak_full_bytes is not None:
            self.init_peak_bytes = max(self.init_peak_bytes or 0, result.peak_full_bytes)
        self.units.update(info.unit for info in infos.values())
        self._check_bucket_sizes(model, infos)
        self._resolve_prefetch_orders(model)
        self.params.update(infos)
        for param in model.parameters():
            self._owned[param] = True
        return model

    def _check_bucket_sizes(self, model: nn.Module, infos: dict[str, ShardedParamInfo]) -> None:
        """Flag a bucket unit with more than half of the parameters where it defeats sharding:
        gathered whole, freed, gathered again (FULL_SHARD, HYBRID_SHARD over a shard group of 2+).
        Warns once per backend, on rank 0; the report marks the bucket on every rank."""
        if not (self.bucket_policy.uses_units and self.strategy.reshard_after_forward
                and self.topology.shard_size > 1):
            return
        params = dict(model.named_parameters())
        itemsize = {fqn: (info.comm.param_dtype or params[fqn].dtype).itemsize for fqn, info in infos.items()}
        found = oversized_bucket(model, {fqn: info.unit for fqn, info in infos.items()}, itemsize,
                                 self.bucket_policy)
        if found is None:
            return
        self.oversized_buckets[found.label] = {"share": found.share, "advice": found.advice}
        if self._warned_oversized or (dist.is_initialized() and dist.get_rank() != 0):
            return
        self._warned_oversized = True
        message = found.message(self.strategy.name)
        warnings.warn(message, UserWarning, stacklevel=3)
        log.warning(message)

    def _agree_on_sharding(self, model: nn.Module) -> None:
        """Every rank of the mesh must shard the same model with the same options (one exchange
        through the rendezvous store; a mismatch raises on every rank before anything is sharded)."""
        topo = self.topology
        ranks = [int(r) for r in topo.mesh.mesh.flatten().tolist()]
        timeout = self.options.timeout or world_timeout()
        mesh_key = hashlib.sha256(repr(ranks).encode()).hexdigest()[:12]
        count = _SHARD_CALLS[mesh_key] = _SHARD_CALLS.get(mesh_key, 0) + 1
        key = f"{mesh_key}/{count}"
        agree_on_sharding(self._sharding_items(model), ranks, timeout, key)
        if self.verifier is None:
            self.verifier = GraphVerifier(key, ranks, timeout)

    def _group_roles(self) -> dict[str, str]:
        topo = self.topology
        return {topo.shard_group_name: f"shard group ({topo.shard_size} ranks)",
                topo.replicate_group_name: f"replicate group ({topo.replicate_size} ranks)"}

    def _sharding_items(self, model: nn.Module) -> list[tuple[str, Any]]:
        """What must be equal on every rank for the ranks to communicate alike, in a fixed order."""
        from . import __version__

        o, topo = self.options, self.topology
        items: list[tuple[str, Any]] = [
            ("the fsdp_compile version", __version__),
            ("the torch version", torch.__version__),
            ("strategy=", self.strategy.name),
            ("compiler=", o.compiler),
            ("bucket=", self.bucket_policy.describe()),
            ("mixed_precision=", repr(o.mixed_precision)),
            ("offload=", repr(o.offload)),
            ("schedule=", o.schedule),
            ("prefetch=", o.prefetch),
            ("max_inflight_bytes=", o.max_inflight_bytes),
            ("the world size", dist.get_world_size()),
            ("the mesh (replicate x shard ranks)", topo.mesh.mesh.tolist()),
        ]
        units = unit_modules(model, self.bucket_policy)
        for module_name, name, param in _unique_parameters(model):
            fqn = f"{module_name}.{name}" if module_name else name
            items.append((f"parameter {fqn!r} (shape, dtype, requires_grad, bucket unit)",
                          [list(param.shape), str(param.dtype).replace("torch.", ""), param.requires_grad,
                           unit_of(module_name, units) or "<root>"]))
        # After the parameters: a missing or extra parameter is named before the count differs.
        items.append(("the number of parameters", sum(1 for _ in _unique_parameters(model))))
        return items
    def _choose_strategy(self, model: nn.Module) -> None:
        """strategy='auto': plan for this world (rank 0 plans, every rank gets the choice)."""
        from .planning.auto import candidate_options, choose

        device_type = self._device_type(model)
        self.plan, row = choose(model, self._auto, self.options.mixed_precision, device_type)
        chosen = candidate_options(self.plan, row)
        strategy = ShardingStrategy.parse(chosen["strategy"])
        shard_size = self.plan.cluster.devices_per_node if strategy.is_hybrid else None
        self.options = dataclasses.replace(self.options, strategy=strategy, bucket=chosen["bucket"],
                                           prefetch=chosen["prefetch"], shard_size=shard_size)
        self.bucket_policy = parse_policy(chosen["bucket"])

    def summaries(self) -> list[dict[str, Any]]:
        """One JSON-able summary per graph compiled so far on this rank (see report.py)."""
        return [graph_summary(record, self) for record in self.graphs]

    def report(self) -> str:
        """Buckets, collectives and bytes per step against the theory, memory estimate and
        schedule of every graph compiled so far on this rank: the same report as
        ``python -m fsdp_compile inspect DUMP_DIR``, without files."""
        return render_report(self.summaries())

    def _resolve_prefetch_orders(self, model: nn.Module) -> None:
        """Turn forward_prefetch / backward_prefetch into bucket names; reject unknown units."""
        names = {module: name for name, module in model.named_modules()}
        labels = {unit: unit or "<root>" for unit in self.units}

        def label(item: Any, option: str) -> str:
            unit = names.get(item) if isinstance(item, nn.Module) else item
            if unit == "<root>":
                unit = ROOT_UNIT
            if not isinstance(unit, str) or unit not in self.units:
                shown = unit if isinstance(unit, str) else type(item).__name__
                known = ", ".join(sorted(labels.values()))
                raise ValueError(
                    f"{option}= names {shown!r}, which is not a bucket unit of the sharded model; "
                    f"units are: {known}"
                )
            return labels[unit]

        for phase, option in (("forward", "forward_prefetch"), ("backward", "backward_prefetch")):
            order = getattr(self.options, option)
            for trigger, targets in (order or {}).items():
                if isinstance(targets, (str, nn.Module)):
                    targets = [targets]
                self.explicit_prefetch[phase][label(trigger, option)] = [label(t, option) for t in targets]

    @staticmethod
    def _device_type(model: nn.Module, init_device: torch.device | None = None) -> str:
        types = {p.device.type for p in model.parameters()}
        types.discard("meta")
        if init_device is not None:
            types.add(init_device.type)
        if len(types) > 1:
            raise ValueError(
                f"the model's parameters are on several device types {sorted(types)}; move the "
                "model to one device before sharding"
            )
        if types:
            return types.pop()
        return "cuda" if torch.cuda.is_available() else "cpu"

    # ---------------------------------------------------------------- gradient sync
    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """Whether backward reduces gradients (default True), for every model this backend sharded.

        With False, backward communicates nothing and sums full, unreduced gradients locally
        (FSDP's ``no_sync``); the first backward after turning it back on adds its own and
        reduces them all into ``param.grad``. A compiled model gets one extra graph for this.
        """
        if not self.params:
            raise RuntimeError("set_requires_gradient_sync() before backend.shard(model): shard the model first")
        if self.options.offload is not None and not requires_sync:
            raise ConfigError(
                "gradient accumulation without sync keeps full-size gradients on the compute device, "
                "which CPU offload exists to avoid; accumulate with sync on instead (backward adds "
                "each micro-batch's reduced shard gradients into param.grad in host memory)"
            )
        self.gradient_sync.set_requires_sync(requires_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager: gradient accumulation without communication (see
        :meth:`set_requires_gradient_sync`). Run the last micro-batch's backward outside it."""
        previous = self.gradient_sync.requires_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.gradient_sync.set_requires_sync(previous)

    def reduce_accumulated_gradients(self) -> None:
        """Reduce gradients accumulated under :meth:`no_sync` into ``param.grad`` now.

        Only needed when an accumulation window ends without a backward outside ``no_sync``
        (that backward reduces them itself)."""
        if self.gradient_sync.accumulating:
            self.gradient_sync.reduce_accumulated()

    # ---------------------------------------------------------------- compiling
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self._check_inputs(gm, example_inputs)
        compiler = "eager" if _env_flag("FSDP_COMPILE_EAGER") else self.options.compiler
        record = CompiledGraph(index=len(self.graphs), dynamo=gm, compiler=compiler)
        self.graphs.append(record)
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "dynamo.py", graph_code(gm))
        if compiler == "eager":
            # The captured graph as Python: every marker runs the eager runtime, so a user can
            # step through it with pdb and print tensors.
            self._write_summary(record)
            return self._guarded(gm.forward, record)
        # Compile the backward graph now, not at the first backward: the first run of the
        # forward checks both graphs' collectives against the other ranks.
        eager_backward = ({"force_non_lazy_backward_lowering": True}
                          if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering") else {})
        with torch._functorch.config.patch(**eager_backward):
            if compiler == "aot_eager":
                compiled = self._compile_aot_eager(gm, example_inputs, record)
            else:
                compiled = self._compile_inductor(gm, example_inputs, record)
        return self._guarded(compiled, record)

    def _guarded(self, compiled: Callable, record: CompiledGraph) -> Callable:
        """``compiled`` as Dynamo calls it: its collectives checked against the other ranks' on
        its first run (``verify=True``), and a failed collective reported as the forward of this
        graph having lost another rank."""
        verifier = self.verifier if self.options.verify else None
        timeout = self.options.timeout or world_timeout()
        first_run = [True]

        def run(*args: Any) -> Any:
            if verifier is not None:
                if first_run[0]:
                    kind = "inference graph" if record.inference else "graph"
                    verifier.verify(f"{kind} {record.index} (forward and backward)", self._collectives(record))
                    first_run[0] = False
                verifier.calls += 1
            try:
                return compiled(*args)
            except Exception as exc:
                reraise_named(exc, f"the forward of compiled graph {record.index}", timeout)

        run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return run

    def _collectives(self, record: CompiledGraph) -> list[CollectiveCall]:
        """What ``record`` issues, for the first-run agreement check. A graph loaded from the
        compile cache has no lowered graphs here: its sequence was kept beside the entry by the
        run that compiled it, so ranks that hit and ranks that missed compare alike."""
        if record.cache == "hit" and self.cache_state.directory is not None:
            kept = load_collectives(self.cache_state.directory, record.cache_key, record.dynamo.code)
            if kept is not None:
                return [CollectiveCall(**{**c, "params": tuple(c["params"])}) for c in kept]
        return collective_calls(record, self._group_roles())

    def _check_inputs(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, example_inputs):
            if not isinstance(value, nn.Parameter) or value in self._owned:
                continue
            name = sharded_name(value) or _parameter_name(node)
            if isinstance(value, DTensor):
                raise RuntimeError(
                    f"parameter {name!r} is a DTensor that this backend did not shard; compile a "
                    "model with the backend whose shard() sharded it"
                )
            raise RuntimeError(
                f"parameter {name!r} is not sharded: call backend.shard(model) before "
                "torch.compile(model, backend=backend) (or use fsdp_compile.compile(model, ...))"
            )

    def _dumper(self) -> Dumper | None:
        root = self.options.dump_dir or os.environ.get("FSDP_COMPILE_DUMP")
        if not root:
            return None
        if self._dumper_instance is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            manifest = manifest_for(self.strategy.name, world, self._describe_options())
            self._dumper_instance = Dumper(root, rank, manifest)
        return self._dumper_instance

    def _describe_options(self) -> dict[str, Any]:
        o = self.options
        return {"compiler": o.compiler, "bucket": self.bucket_policy.describe(), "schedule": o.schedule,
                "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                "mixed_precision": repr(o.mixed_precision) if o.mixed_precision else None,
                "shard_size": self.topology.shard_size if self.topology else None,
                "replicate_size": self.topology.replicate_size if self.topology else None}

    def _write_summary(self, record: CompiledGraph) -> None:
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_summary(record.index, graph_summary(record, self))

    def _fail(self, record: CompiledGraph, phase: str, failure: PassFailure) -> None:
        """A pass failed on a graph: raise under strict=True, else warn; the caller falls back."""
        where = f"graph {record.index} ({phase})"
        if self.options.strict:
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

        if self._joint_captures is not None:
            self._joint_captures.append(JointCapture(record, copy_graph_module(joint), list(joint_inputs), dict(kwargs)))
        self._joint_passes(joint.graph, record)
        start = time.perf_counter()
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        record.stage_seconds["partition"] = time.perf_counter() - start
        order_rng_states_before_opaque(forward, backward)
        if self._joint_captures is not None:
            self._joint_captures[-1].partitioned = (copy_graph_module(forward), copy_graph_module(backward))
        return forward, backward

    def _joint_passes(self, graph: fx.Graph, record: CompiledGraph) -> None:
        """The reshard policy as partitioner tags, in place (the partitioner holds ``graph``).

        Each step leaves a valid graph (a marker replaced, or tags set), so a failure stops
        there: the partitioner then makes its default choices for the rest, a memory
        difference only, with the same results.
        """
        started = time.perf_counter()
        record.graph_nodes["joint"] = len(graph.nodes)
        dumper = self._dumper()
        if dumper is not None:
            dumper.write_graph(record.index, "joint_before.py", graph_code(graph))
        timings = record.pass_seconds.setdefault("joint", {})
        for name, fn in (("elide_trivial_unshard", elide_trivial_unshard), ("tag_reshard_policy", tag_reshard_policy)):
            start = time.perf_counter()
            try:
                fn(graph)
            except Exception as exc:
                failure = PassFailure(name, exc)
                failure.__cause__ = exc
                self._fail(record, "joint", failure)
                return
            timings[name] = time.perf_counter() - start
        if dumper is not None:
            dumper.write_graph(record.index, "joint_after.py", graph_code(graph, tags=True))
        record.stage_seconds["joint"] = time.perf_counter() - started

    def _graph_passes(self, gm: fx.GraphModule, phase: str, record: CompiledGraph,
                      decompositions: dict | None = None) -> fx.GraphModule:
        """Lower and schedule one graph; on a pass failure, keep it as it was (markers run eagerly)."""
        started = time.perf_counter()
        record.graph_nodes[phase] = len(gm.graph.nodes)
        if phase == "backward":
            self._tag_saved_inputs(gm, record.forward_output_roles)
        kind = "backward" if phase == "backward" else "forward"
        passes = [
            ("elide_trivial_unshard", lambda g: elide_trivial_unshard(g.graph)),
            ("lower_markers", lambda g: lower_markers(g, self.bucket_policy, decompositions)),
        ]
        if self.options.schedule:
            options = ScheduleOptions(self.options.prefetch, self.options.max_inflight_bytes,
                                      self.explicit_prefetch[kind])
            passes.append(("schedule_collectives", lambda g: schedule_collectives(g, options)))
        ours = {fn for _, fn in passes}  # rewrite graphs only (see run_passes)
        passes += [(getattr(fn, "__name__", "user_pass"), fn) for fn in self.options.passes.get(kind, [])]
        dumper = self._dumper()
        on_graph = None
        if dumper is not None:
            def on_graph(step: str, g: fx.GraphModule, counter=iter(range(100))) -> None:
                dumper.write_graph(record.index, f"{phase}/{next(counter):02d}_{step}.py", graph_code(g))
        try:
            gm, results = run_passes(gm, passes, on_graph, graph_only=ours)
        except PassFailure as failure:
            self._fail(record, phase, failure)
            results = []
        values = {r.name: r.value for r in results}
        held = None
        if phase == "backward":
            # The caller keeps every parameter resident; backward only receives some of them.
            held = {"param": max(0, record.forward_param_bytes - input_bytes(gm, "param"))}
        memory = estimate_memory(gm, held)
        snapshot = gm if record.compiler == "aot_eager" else copy_graph_module(gm)
        buckets = values.get("lower_markers") or {}
        schedule = values.get("schedule_collectives")
        timings = {r.name: r.seconds for r in results}
        if phase == "backward":
            record.backward, record.backward_buckets = snapshot, buckets
            record.backward_schedule, record.backward_memory = schedule, memory
            record.pass_seconds["backward"] = timings
        else:
            record.forward, record.forward_buckets = snapshot, buckets
            record.forward_schedule, record.forward_memory = schedule, memory
            record.inference = phase == "inference"
            record.forward_output_roles = _output_roles(gm)
            record.forward_param_bytes = input_bytes(gm, "param")
            record.pass_seconds["forward"] = timings
        self._write_summary(record)
        record.stage_seconds[phase] = time.perf_counter() - started
        return gm

    @staticmethod
    def _tag_saved_inputs(gm: fx.GraphModule, forward_output_roles: list[str]) -> None:
        """Give the backward graph's saved inputs the roles their forward outputs had.

        AOTAutograd passes the tensors forward saved, in order, as the backward graph's first
        inputs (the gradients of the outputs, ``tangents_*``, come last).
        """
        saved = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        if saved and len(saved) <= len(forward_output_roles):
            for node, role in zip(saved, forward_output_roles[-len(saved):]):
                node.meta[ROLE_META] = role

    def _compile_aot_eager(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: CompiledGraph):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        timeout = self.options.timeout or world_timeout()

        def compiler(phase: str):
            def compile_graph(g: fx.GraphModule, inputs: Sequence[Any]):
                run = self._graph_passes(g, phase, record).forward
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
            lowered = self._graph_passes(g, phase, record, select_decomp_table())
            return compile_fx_inner(lowered, inputs, **kwargs)

        key, lookups, why_off = self._compile_cache_key()
        joint_pass = _JointPass(self, record, torch._inductor.config.joint_custom_pre_pass, key)
        patches: dict[str, Any] = {"joint_custom_pre_pass": joint_pass}
        if hasattr(torch._inductor.config, "custom_partitioner_fn"):  # torch >= 2.12
            patches["custom_partitioner_fn"] = _Partitioner(torch._inductor.config.custom_partitioner_fn, key)
        if not self.cache_state.enabled and self.cache_state.directory is not None:
            patches["fx_graph_cache"] = False  # an unusable cache_dir: cold, nothing read or written
        # The AOTAutograd cache keys on the Dynamo graph and Inductor's configuration, where our
        # key travels as the uuid of the joint pass and partitioner above: a hit is exactly what
        # our passes would produce again. A key of None (a pass we cannot key) makes Inductor
        # bypass its caches.
        counts = torch._dynamo.utils.counters["aot_autograd"]
        hits, bypasses = counts["autograd_cache_hit"], counts["autograd_cache_bypass"]
        with torch._functorch.config.patch(enable_autograd_cache=lookups):
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
                             [dataclasses.asdict(c) for c in collective_calls(record, self._group_roles())])
        record.cache_key = key
        return compiled

    def cache_key_parts(self) -> dict[str, Any]:
        """Everything our passes' result depends on besides the Dynamo graph (see
        :mod:`fsdp_compile.compile_cache`); the user's passes are keyed by their uuids."""
        o, topo = self.options, self.topology
        groups = {}
        for name, group in (("shard", topo and topo.shard_group), ("replicate", topo and topo.replicate_group)):
            groups[name] = dist.get_process_group_ranks(group) if group is not None else None
        policy = self.bucket_policy
        # AOTAutograd keys a DTensor input by its global metadata only, so with uneven shards
        # ranks whose local shards differ would share an entry (a wrong graph, caught by a
        # size assertion at best): the rank and every local shard's metadata are part of ours.
        local = sorted((name, tuple(p.to_local().shape), tuple(p.to_local().stride()), str(p.dtype), str(p.device))
                       for p in self._owned.keys() for name in [sharded_name(p) or ""])
        return {
            "strategy": self.strategy.name,
            "compiler": o.compiler,
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "local_shards": local,
            "groups": groups,
            "bucket": {"kind": policy.kind, "max_bytes": policy.max_bytes, "describe": policy.describe()},
            "schedule": {"on": o.schedule, "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                         "explicit": self.explicit_prefetch},
            "mixed_precision": repr(o.mixed_precision),
            "offload": repr(o.offload),
            "kernels": os.environ.get("FSDP_COMPILE_KERNELS", ""),
            "strict": o.strict,
        }

    def _compile_cache_key(self) -> tuple[str | None, bool, str]:
        """(key for Inductor's caches, None to bypass them; whether AOTAutograd's cache may be
        read; why it may not)."""
        state = self.cache_state
        if not state.enabled and state.directory is not None:
            return None, False, state.reason  # an unusable cache_dir: everything cold
        uuids, why = user_pass_uuids(self.options.passes)
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
    def _trace_for_planning(
        self, fn: Callable, example_inputs: Sequence[Any], *, keep_joint: bool = False,
        dynamo_pass: Callable[[fx.GraphModule], None] | None = None, fake_mode: Any = None,
    ) -> tuple[list[CompiledGraph], list[JointCapture]]:
        """Run ``fn(*example_inputs)`` through ``torch.compile`` with this backend: Dynamo capture,
        AOTAutograd, the reshard policy, partitioning and our passes, backward included.

        Nothing is compiled for a device (the inner compiler is ``aot_eager``) and with fake
        inputs and a model sharded by ``_shard(materialize=False)`` nothing is allocated.
        ``dynamo_pass`` may rewrite each Dynamo graph first (the planner maps attention to the
        kernel the target device dispatches to). With ``keep_joint`` the joint graph of each
        Dynamo graph is kept, before our joint passes, for :meth:`_replay_for_planning`.
        ``fake_mode``: the FakeTensorMode of fake inputs; the compiled graphs run under it, so
        tensors they create (``arange``) are fake too. Returns the records of the graphs
        compiled by this call and the joints.
        """
        if self.options.compiler != "aot_eager":
            raise ValueError("planning traces with compiler='aot_eager' (nothing is compiled for a device)")
        start = len(self.graphs)
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
                records = self.graphs[start:]
                if any(r.backward is None and not r.inference for r in records):
                    # A torch whose AOTAutograd lowers backward lazily: run it (on fake tensors).
                    loss = [t for t in torch.utils._pytree.tree_leaves(output)
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    if loss:
                        torch.autograd.backward(loss, [torch.ones_like(t) for t in loss])
        finally:
            self._joint_captures = None
        return self.graphs[start:], captures

    def _replay_for_planning(
        self, capture: JointCapture, partitioned: tuple[fx.GraphModule, fx.GraphModule] | None = None,
    ) -> tuple[CompiledGraph, tuple[fx.GraphModule, fx.GraphModule]]:
        """What this backend's pipeline makes of a joint graph another backend captured.

        Valid when both sharded the same model with the same shard shapes, so the joint graphs
        differ only in the markers' arguments (groups, reshard flag, bucket unit): they are
        rewritten to this backend's, then partitioned under this backend's reshard policy (or
        ``partitioned`` reused, when the caller knows the policy is the same) and our passes
        run. Returns the record and the partitioned graphs, before our passes.
        """
        record = CompiledGraph(index=len(self.graphs), dynamo=capture.record.dynamo, compiler="aot_eager")
        self.graphs.append(record)
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
            self._graph_passes(mine, phase, record)
        return record, partitioned

    def _rewrite_markers(self, graph: fx.Graph) -> dict[fx.Node, tuple]:
        """Give every marker of ``graph`` this backend's arguments for its parameter; returns
        the previous arguments by node."""
        from .ops import REDUCE_GRAD, UNSHARD, decode

        previous = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in (UNSHARD, REDUCE_GRAD):
                continue
            marker = decode(node)
            previous[node] = node.args
            info = self.params.get(marker.fqn)
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

    def __init__(self, backend: FSDPBackend, record: CompiledGraph,
                 user_pass: Callable[[fx.Graph], None] | None, key: str | None = None) -> None:
        self.backend = backend
        self.record = record
        self.user_pass = user_pass
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        self.backend._joint_passes(graph, self.record)
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

    def __init__(self, user_partitioner: Callable[..., Any] | None, key: str | None = None) -> None:
        self.user_partitioner = user_partitioner
        self.key = key

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        partition = self.user_partitioner or min_cut_rematerialization_partition
        forward, backward = partition(gm, joint_inputs, **kwargs)
        order_rng_states_before_opaque(forward, backward)
        return forward, backward

    def uuid(self) -> Any:
        return _uuid(self.key, self.user_partitioner)


def _output_roles(gm: fx.GraphModule) -> list[str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    roles = []
    for value in output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]:
        if not isinstance(value, fx.Node):
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


def backend(strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, **options: Any) -> FSDPBackend:
    """Create a backend; see :class:`FSDPBackend` for the options."""
    return FSDPBackend(strategy, **options)


def compile(model: nn.Module, strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, **options: Any) -> nn.Module:
    """Shard ``model`` and return ``torch.compile(model, backend=...)``; the backend is ``.fsdp_backend``."""
    fsdp = FSDPBackend(strategy, **options)
    compiled = torch.compile(fsdp.shard(model), backend=fsdp)
    compiled.fsdp_backend = fsdp
    return compiled
