"""The user-facing backend: options, ``shard``, gradient-sync control, reports.

:class:`FSDPBackend` shards a model over its process groups (:mod:`fsdp_compile.sharding`),
checks that every rank shards alike (:mod:`fsdp_compile.agreement`), and, as the object
``torch.compile`` is given, hands every graph Dynamo captures to its
:class:`~fsdp_compile.compiler.Compiler`, which runs the pipeline (joint passes, partition,
graph passes, inner compiler). ``backend.graphs`` keeps what the compiler produced.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.weak import WeakIdKeyDictionary

from . import api
from .agreement import GraphVerifier, agree_on_sharding
from .api import BackendOptions, ConfigError, CPUOffload, MixedPrecision, ShardingStrategy
from .compile_cache import CacheState
from .compiler import CompiledGraph, Compiler
from .inspection.bucket_advice import oversized_bucket
from .inspection.report import graph_summary, render_report
from .runtime import markers  # noqa: F401  (registers the marker ops)
from .sharding.grad_sync import GradientSync
from .sharding.groups import Topology, current_device, group_device_type, resolve_topology, world_timeout
from .sharding.local_shards import LocalShards
from .sharding.module_state import is_sharded
from .sharding.regions import MIN_REGION_COPIES, regions_supported
from .sharding.shard import shard_module
from .sharding.sharded_param import ShardedParamInfo
from .sharding.units import ROOT_UNIT, BucketPolicy, unit_modules, unit_of

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


class FSDPBackend:
    """A ``torch.compile`` backend that trains a sharded model with FSDP semantics.

    Use :meth:`shard` on the model first (parameters become DTensor shards, so build the
    optimizer afterwards), then ``torch.compile(model, backend=this)``. A sharded model also
    runs without ``torch.compile`` (the eager runtime), with the same results.

    Options: ``compiler`` ("inductor", "aot_eager" or "eager"); ``mesh`` / ``process_groups`` /
    ``shard_size`` / ``timeout`` (see :func:`fsdp_compile.sharding.groups.resolve_topology`);
    ``bucket`` (see :mod:`fsdp_compile.passes.bucketing`); ``mixed_precision``
    (:class:`fsdp_compile.MixedPrecision`); ``schedule`` (overlap collectives with compute;
    under Inductor it also turns off Inductor's own peak-memory reordering for graphs with
    collectives, which it would undo), ``prefetch``, ``max_inflight_bytes``,
    ``forward_prefetch`` / ``backward_prefetch``
    (``{unit: [units to gather when it starts]}``, units by name or module) (see
    :mod:`fsdp_compile.passes.scheduling`); ``dump_dir`` (or ``FSDP_COMPILE_DUMP``): write
    every graph before and after each pass plus a JSON summary (see :mod:`fsdp_compile.inspection.dump`);
    ``strict``: raise when a pass fails instead of running that graph through the eager
    runtime; ``passes``: extra passes ``{"forward" | "backward": [fn(GraphModule)]}`` run after
    ours; ``offload``: :class:`fsdp_compile.CPUOffload` keeps shards, gradients and the
    optimizer step in host memory; ``verify`` (default True): check at ``shard()`` and on the
    first run of every compiled graph that all ranks will communicate alike, and raise a named
    error on every rank otherwise (see :mod:`fsdp_compile.agreement`); ``verify_gradients``
    (or ``FSDP_COMPILE_VERIFY=1``; default off): on the first step of each compiled graph, run
    it through the eager runtime too and raise :class:`fsdp_compile.GradientMismatch` naming the
    first parameter whose gradient differs (``True``, or a tolerance; see
    :mod:`fsdp_compile.gradient_check`), the first thing to try when training diverges; ``disable_passes``: names
    of our passes to skip (see ``fsdp_compile.passes.pipeline.PIPELINE``; e.g.
    ``("schedule_collectives",)``), for debugging a pass or measuring what it buys. ``cache_dir``: under
    Inductor, a process that
    compiles what an earlier one compiled with the same directory loads it from there (warm
    restarts; see :mod:`fsdp_compile.compile_cache`). ``FSDP_COMPILE_EAGER=1`` runs every
    captured graph through the eager runtime.

    ``fsdp_compile.backend("auto", ...)`` returns the subclass that plans the strategy at
    :meth:`shard` time (:class:`fsdp_compile.planning.auto.AutoBackend`).

    Training-loop controls: :meth:`no_sync` / :meth:`set_requires_gradient_sync` (gradient
    accumulation without communication); see also :mod:`fsdp_compile.training.checkpoint` and
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
        disable_passes: Sequence[str] = (),
        regions: bool | int = True,
        verify_gradients: bool | float = False,
    ) -> None:
        self.options = BackendOptions.validate(
            strategy, compiler=compiler, mesh=mesh, process_groups=process_groups, shard_size=shard_size,
            timeout=timeout, bucket=bucket, mixed_precision=mixed_precision, schedule=schedule, prefetch=prefetch,
            max_inflight_bytes=max_inflight_bytes, forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch, dump_dir=dump_dir, strict=strict, passes=passes, offload=offload,
            verify=verify, cache_dir=cache_dir, disable_passes=disable_passes, regions=regions,
            verify_gradients=verify_gradients)
        self.bucket_policy = self.options.bucket_policy
        self.units: set[str] = {ROOT_UNIT}
        self.explicit_prefetch: dict[str, dict[str, list[str]]] = {"forward": {}, "backward": {}}
        self.topology: Topology | None = None
        self.params: dict[str, ShardedParamInfo] = {}
        self.graphs: list[CompiledGraph] = []
        self._owned = WeakIdKeyDictionary()  # sharded parameter -> its info
        self.local_shards: weakref.WeakSet[LocalShards] = weakref.WeakSet()  # per model it sharded
        self.gradient_sync = GradientSync()
        self.init_peak_bytes: int | None = None  # meta-device init: most full parameter bytes held
        # Buckets over half of a model's parameters under a resharding strategy, by label: what
        # the report marks (see inspection/bucket_advice.py).
        self.oversized_buckets: dict[str, dict[str, Any]] = {}
        self._warned_oversized = False
        self.verifier: GraphVerifier | None = None
        self.plan = None  # strategy="auto": the fsdp_compile.Plan the choice came from
        self.compiler = Compiler(self)

    @property
    def strategy(self) -> ShardingStrategy:
        return self.options.strategy

    def __repr__(self) -> str:
        strategy = self.strategy.name
        return f"fsdp_compile.backend(strategy={strategy!r}, compiler={self.options.compiler!r})"

    # ---------------------------------------------------------------- sharding
    def region_copies(self) -> int | None:
        """From how many copies a block class is compiled as a region (sharding/regions.py);
        None: no regions (``regions=False``, a torch without region reuse, the eager compiler)."""
        regions = self.options.regions
        if regions is False or not regions_supported():
            return None
        if regions is True:
            return MIN_REGION_COPIES.get(self.options.compiler)
        return regions

    # ---------------------------------------------------------------- compiling
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """``torch.compile(model, backend=self)``: the compile pipeline (see :mod:`fsdp_compile.compiler`)."""
        return self.compiler(gm, example_inputs)

    @property
    def cache_state(self) -> CacheState:
        return self.compiler.cache_state

    @property
    def cache_stats(self) -> dict[str, int]:
        """Compile-cache lookups of this backend's graphs: hits, misses, off (see ``cache_dir=``)."""
        return self.compiler.cache_stats

    def cache_key_parts(self) -> dict[str, Any]:
        return self.compiler.cache_key_parts()

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
        self._before_sharding(model)
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
                              materialize=materialize, region_copies=self.region_copies())
        infos = result.infos
        self.local_shards.add(result.shards)
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

    def _sharding_items(self, model: nn.Module) -> list[tuple[str, Any]]:
        """What must be equal on every rank for the ranks to communicate alike, in a fixed order."""
        o, topo = self.options, self.topology
        items: list[tuple[str, Any]] = [
            ("the fsdp_compile version", api.__version__),
            ("the torch version", torch.__version__),
            ("strategy=", self.strategy.name),
            ("compiler=", o.compiler),
            ("bucket=", self.bucket_policy.describe()),
            ("mixed_precision=", repr(o.mixed_precision)),
            ("offload=", repr(o.offload)),
            ("schedule=", o.schedule),
            ("prefetch=", o.prefetch),
            ("max_inflight_bytes=", o.max_inflight_bytes),
            ("disable_passes=", list(o.disable_passes)),
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
    def _before_sharding(self, model: nn.Module) -> None:
        """A hook for subclasses that decide options from the model (``strategy="auto"``:
        :class:`fsdp_compile.planning.auto.AutoBackend`)."""

    def summaries(self) -> list[dict[str, Any]]:
        """One JSON-able summary per graph compiled so far on this rank (see inspection/report.py)."""
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

    def _device_type(self, model: nn.Module, init_device: torch.device | None = None) -> str:
        types = {p.device.type for p in model.parameters()}
        types.discard("meta")
        if init_device is not None:
            types.add(init_device.type)
        if len(types) > 1:
            raise ValueError(
                f"the model's parameters are on several device types {sorted(types)}; move the "
                "model to one device before sharding"
            )
        if types == {"cpu"} and init_device is None and self.options.mesh is None and group_device_type() != "cpu":
            # Built on the CPU for an accelerator's group (NCCL): sharding moves the parameters
            # there, as FSDP2's fully_shard moves a module to its mesh's device. A mesh the
            # user gave says the device itself.
            return group_device_type()
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
