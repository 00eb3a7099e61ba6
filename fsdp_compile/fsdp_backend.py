"""The user-facing backend: options, ``shard``, gradient-sync control, reports. As the object
``torch.compile`` is given, it hands every captured graph to its
:class:`~fsdp_compile.compilation.pipeline.Compiler`; ``backend.graphs`` keeps what that produced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from .api import BackendOptions, ConfigError, ShardingStrategy, documents_options, signature_from
from .checks.agreement import GraphVerifier, agree_on_model
from .compilation import CompiledGraph, Compiler
from .compilation.cache import CacheState, cache_key_parts
from .inspection.bucket_advice import oversized_in
from .inspection.report import graph_summary, render_report
from .runtime import markers  # noqa: F401  (registers the marker ops)
from .sharding.backend_state import ShardingState
from .sharding.compile_regions import region_copies
from .sharding.grad_sync import GradientSync
from .sharding.groups import Topology, current_device, group_device_type, resolve_topology
from .sharding.shard import Init, shard_module
from .sharding.sharded_class import is_sharded
from .sharding.sharded_param import ShardedParamInfo
from .sharding.units import ROOT_UNIT

log = logging.getLogger("fsdp_compile")


def _memory_budget(options: BackendOptions) -> Any:
    """What the compiler is handed for ``memory_budget=`` (the planner prices it: imported only then)."""
    if options.memory_budget is None:  # cluster= alone is refused by its option check
        return None
    from .planning.budget import check_cluster, memory_budget

    check_cluster(options.cluster)
    return memory_budget(options)


def _from_state(name: str, doc: str) -> Any:
    """A read-only property that is the backend's sharding state's attribute ``name``."""
    return property(lambda self: getattr(self._state, name), doc=doc)


@documents_options
class FSDPBackend:
    """A ``torch.compile`` backend that trains a sharded model with FSDP semantics.

    Use :meth:`shard` on the model first (parameters become DTensor shards, so build the
    optimizer afterwards), then ``torch.compile(model, backend=this)``. A sharded model also
    runs without ``torch.compile`` (the eager runtime), bit for bit as under ``aot_eager``.
    ``fsdp_compile.backend("auto", ...)`` returns the subclass that plans the strategy at
    :meth:`shard` time (:class:`fsdp_compile.auto_backend.AutoBackend`).

    Training-loop controls: :meth:`no_sync` / :meth:`set_requires_gradient_sync` (accumulation
    without reduction); see also :mod:`fsdp_compile.training.checkpoint`, :func:`fsdp_compile.clip_grad_norm_`.

    Each option below is declared, documented and checked once, in
    :class:`fsdp_compile.api.BackendOptions`.
    """

    @signature_from(BackendOptions)
    def __init__(self, *strategy: Any, **options: Any) -> None:
        self.options = BackendOptions.validate(*strategy, **options)
        self.graphs: list[CompiledGraph] = []
        self.plan = None  # strategy="auto": the fsdp_compile.Plan the choice came from
        self._state = ShardingState()
        self._state.region_fallback.strict = self.options.strict
        self._gradient_sync = GradientSync()
        self._warned_oversized = False
        self.compiler = Compiler(self.options, self._state, self.graphs, budget=_memory_budget(self.options))

    def _set_options(self, **changes: Any) -> None:
        """Replace options before anything is sharded (``strategy="auto"`` applies its plan)."""
        self.options = dataclasses.replace(self.options, **changes)
        self.compiler.options = self.compiler.guard.options = self.options
        self.compiler.budget = _memory_budget(self.options)
        self._state.region_fallback.strict = self.options.strict

    @property
    def strategy(self) -> ShardingStrategy:
        return self.options.strategy

    @property
    def bucket_policy(self):
        return self.options.bucket_policy

    topology: Topology | None = _from_state(
        "topology", "The mesh and groups this backend shards over; None before the first ``shard()``.")
    params: dict[str, ShardedParamInfo] = _from_state(
        "params", "Every sharded parameter, by name: its bucket unit, full shape and communication.")
    units: set[str] = _from_state("units", "The bucket units of the sharded models (``\"\"`` is the root).")
    verifier: GraphVerifier | None = _from_state(
        "verifier", "The cross-rank check of compiled graphs (``verify=True``), once a model is sharded.")
    init_peak_bytes: int | None = _from_state(
        "init_peak_bytes", "Meta-device initialization: the most full parameter bytes one rank held at once.")

    def __repr__(self) -> str:
        return f"fsdp_compile.backend(strategy={self.strategy.name!r}, compiler={self.options.compiler!r})"

    def region_copies(self) -> int | None:
        """From how many copies a block class is compiled as a region (sharding/compile_regions.py);
        None: no regions (``regions=False``, a torch without region reuse, the eager compiler)."""
        return region_copies(self.options.regions, self.options.compiler)

    # ---------------------------------------------------------------- compiling
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """``torch.compile(model, backend=self)``: the compile pipeline (see :mod:`fsdp_compile.compilation`)."""
        return self.compiler(gm, example_inputs)

    @property
    def cache_state(self) -> CacheState:
        return self.compiler.cache_state

    @property
    def cache_stats(self) -> dict[str, int]:
        """Compile-cache lookups of this backend's graphs: hits, misses, off (see ``cache_dir=``)."""
        return self.compiler.cache_stats

    def cache_key_parts(self) -> dict[str, Any]:
        return cache_key_parts(self.options, self._state)

    # ---------------------------------------------------------------- sharding
    def shard(self, model: nn.Module, *, init_fn: Callable[[nn.Module], None] | None = None,
              device: torch.device | str | None = None, materialize: bool = True) -> nn.Module:
        """Shard ``model``'s parameters in place over this backend's groups; returns ``model``.

        A model built on the meta device is materialized on ``device`` (default: the current
        accelerator, else the CPU) one bucket unit at a time, each module initialized by
        ``init_fn(module)`` or its own ``reset_parameters()`` in post-order (as
        ``model.apply``), and sharded as soon as its unit is done: no rank holds the whole
        model, and the values equal the unsharded initialization with the same seed. With
        ``materialize=False`` a meta-device model keeps meta shards: every shape, group and
        marker is what a real run gets and no byte is allocated (what the planner traces).
        """
        _check_shardable(model)
        self._before_sharding(model)
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn= must be a callable taking a module, got {type(init_fn).__name__}")
        init_device = torch.device(device) if device is not None else None
        device_type = self._device_type(model, init_device)
        state = self._state
        if state.topology is None:
            state.topology = resolve_topology(
                self.strategy, device_type, mesh=self.options.mesh, process_groups=self.options.process_groups,
                shard_size=self.options.shard_size, timeout=self.options.timeout)
        elif state.topology.mesh.device_type != device_type:
            raise ValueError(f"this backend shards over a {state.topology.mesh.device_type!r} mesh but the model's "
                             f"parameters are on {device_type!r}; use one backend per device type")
        if self.options.verify:
            verifier = agree_on_model(self.options, state.topology, model)
            if state.verifier is None:
                state.verifier = verifier
        init = Init(init_fn, init_device or current_device(state.topology.mesh.device_type), materialize)
        result = shard_module(model, state.topology, self.options, init, sync=self._gradient_sync,
                              region_fallback=state.region_fallback, reshard_groups=state.reshard_groups)
        if self.options.memory_budget is not None:
            # The groups a choice may reshard to, made now, when every rank shards (new_group is collective).
            from .planning.budget import candidate_groups

            for n in candidate_groups(state.topology.shard_size):
                state.reshard_groups.group(state.topology, n)
        state.add_sharded(result)
        found = oversized_in(model, result.infos, self.options, state.topology)
        if found is not None:
            state.oversized_buckets[found.label] = {"share": found.share, "advice": found.advice}
            if not self._warned_oversized and not (dist.is_initialized() and dist.get_rank() != 0):
                # Once per backend, on rank 0; the report marks the bucket on every rank.
                self._warned_oversized = True
                message = found.message(self.strategy.name)
                warnings.warn(message, UserWarning, stacklevel=2)
                log.warning(message)
        state.explicit_prefetch = _resolve_prefetch_orders(model, state.units, self.options)
        state.add_parameters(model.parameters())
        return model

    def _before_sharding(self, model: nn.Module) -> None:
        """A hook for subclasses that decide options from the model (``strategy="auto"``:
        :class:`fsdp_compile.auto_backend.AutoBackend`)."""

    def _device_type(self, model: nn.Module, init_device: torch.device | None = None) -> str:
        return model_device_type(model, init_device, mesh_given=self.options.mesh is not None)

    # ---------------------------------------------------------------- reports
    def summaries(self) -> list[dict[str, Any]]:
        """One JSON-able summary per graph compiled so far on this rank (see inspection/report.py)."""
        return [graph_summary(record, self.strategy, self._state) for record in self.graphs]

    def report(self) -> str:
        """Buckets, collectives and bytes per step against the theory, memory estimate and
        schedule of every graph compiled so far on this rank: the same report as
        ``python -m fsdp_compile inspect DUMP_DIR``, without files."""
        return render_report(self.summaries())

    # ---------------------------------------------------------------- gradient sync
    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """Whether backward reduces gradients (default True), for every model this backend sharded.

        With False, backward reduces nothing and sums full, unreduced gradients locally
        (FSDP's ``no_sync``; compiled, a strategy that reshards after forward still gathers
        parameters for backward); the first backward after turning it back on adds its own and
        reduces them all into ``param.grad``. A compiled model gets one extra graph for this.
        """
        if not self.params:
            raise RuntimeError("set_requires_gradient_sync() before backend.shard(model): shard the model first")
        if self.options.offload is not None and not requires_sync:
            raise ConfigError("gradient accumulation without sync keeps full-size gradients on the compute device, "
                              "which CPU offload exists to avoid; accumulate with sync on instead (backward adds "
                              "each micro-batch's reduced shard gradients into param.grad in host memory)")
        self._gradient_sync.set_requires_sync(requires_sync)

    @contextlib.contextmanager
    def no_sync(self):
        """Context manager: gradient accumulation without communication (see
        :meth:`set_requires_gradient_sync`). Run the last micro-batch's backward outside it."""
        previous = self._gradient_sync.requires_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._gradient_sync.set_requires_sync(previous)

    def reduce_accumulated_gradients(self) -> None:
        """Reduce gradients accumulated under :meth:`no_sync` into ``param.grad`` now.

        Only needed when an accumulation window ends without a backward outside ``no_sync``
        (that backward reduces them itself)."""
        if self._gradient_sync.accumulating:
            self._gradient_sync.reduce_accumulated()


def _check_shardable(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError("shard() got a model that torch.compile already wrapped; shard the plain module "
                        "first, then compile it: torch.compile(backend.shard(model), backend=backend)")
    if is_sharded(model):
        raise ValueError("this model is already sharded (by fsdp_compile); shard a model once and reuse "
                         "the backend that sharded it")


def _resolve_prefetch_orders(model: nn.Module, units: set[str],
                             options: BackendOptions) -> dict[str, dict[str, list[str]]]:
    """forward_prefetch / backward_prefetch as bucket names; unknown units are refused by name."""
    names = {module: name for name, module in model.named_modules()}
    labels = {unit: unit or "<root>" for unit in units}

    def label(item: Any, option: str) -> str:
        unit = names.get(item) if isinstance(item, nn.Module) else item
        if unit == "<root>":
            unit = ROOT_UNIT
        if not isinstance(unit, str) or unit not in units:
            shown = unit if isinstance(unit, str) else type(item).__name__
            known = ", ".join(sorted(labels.values()))
            raise ValueError(f"{option}= names {shown!r}, which is not a bucket unit of the sharded model; "
                             f"units are: {known}")
        return labels[unit]

    orders: dict[str, dict[str, list[str]]] = {"forward": {}, "backward": {}}
    for phase, option in (("forward", "forward_prefetch"), ("backward", "backward_prefetch")):
        for trigger, targets in (getattr(options, option) or {}).items():
            if isinstance(targets, (str, nn.Module)):
                targets = [targets]
            orders[phase][label(trigger, option)] = [label(t, option) for t in targets]
    return orders


def model_device_type(model: nn.Module, init_device: torch.device | None = None, mesh_given: bool = False) -> str:
    """The device type a model's parameters will be sharded on."""
    types = {p.device.type for p in model.parameters()}
    types.discard("meta")
    if init_device is not None:
        types.add(init_device.type)
    if len(types) > 1:
        raise ValueError(f"the model's parameters are on several device types {sorted(types)}; move the "
                         "model to one device before sharding")
    if types == {"cpu"} and init_device is None and not mesh_given and group_device_type() != "cpu":
        # Built on the CPU for an accelerator's group: sharding moves the parameters there, as
        # FSDP2's fully_shard does (a mesh the user gave says the device itself).
        return group_device_type()
    return types.pop() if types else ("cuda" if torch.cuda.is_available() else "cpu")
