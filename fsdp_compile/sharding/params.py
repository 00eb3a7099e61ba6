"""Shard a model in place: DTensor shards as its parameters, and reads that gather them.

After :func:`shard_module`:

* ``module._parameters[name]`` (and so ``named_parameters()``, ``state_dict()``, an optimizer
  built afterwards, ``clip_grad_norm_``, distributed checkpointing) holds an ``nn.Parameter``
  wrapping a DTensor sharded on dim 0 over the shard group (replicated for NO_SHARD and for
  0-d tensors), stored padded to an equal chunk as FSDP2 stores it.
* ``module.<name>`` (what ``forward`` reads) is a property of a generated subclass of the
  module's class that returns ``unshard(shard)``: one marker per read, which Dynamo inlines
  into the graph and the eager runtime executes directly.

Per-instance data (shapes, groups, dtypes) lives on the instance in ``_fsdp_specs``; the
generated classes are shared between instances of the same class and parameter names, so
nothing about one instance may live in the class (a pitfall seen in SimpleFSDP).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..api import CPUOffload, MixedPrecision
from ..runtime.collectives import CommSpec, padded_rows, shard_bounds
from .grad_sync import SYNC_ATTR, GradientSync
from .groups import Topology, current_device
from .materialize import InitFn, has_meta
from .materialize import materialize as materialize_units
from .units import Policy, parse_policy, unit_modules, unit_of

SPECS_ATTR = "_fsdp_specs"
MIXED_PRECISION_ATTR = "_fsdp_mixed_precision"
LOCALS_ATTR = "_fsdp_local_shards"
READS_ATTR = "_fsdp_reads"  # parameter name -> (fqn, the unshard marker's arguments)


@dataclass(frozen=True)
class ShardedParamInfo:
    """What a read of one sharded parameter needs to become its full tensor."""

    fqn: str
    unit: str  # the bucket unit (module name; "" is the root)
    full_shape: tuple[int, ...]
    comm: CommSpec

    @property
    def unshard_args(self) -> tuple:
        full_rows = self.full_shape[0] if self.full_shape else 0
        return (self.fqn, self.unit, full_rows, *self.comm.op_args())


# Every parameter any backend sharded -> its name, for errors about a graph's inputs (Dynamo's
# source for a parameter read through the root's local shards says nothing a user recognizes).
_SHARDED_NAMES = WeakIdKeyDictionary()


def sharded_name(param: torch.Tensor) -> str | None:
    """The name a parameter had when it was sharded, or None if no backend sharded it."""
    return _SHARDED_NAMES.get(param)


def is_sharded(module: nn.Module) -> bool:
    return any(SPECS_ATTR in m.__dict__ for m in module.modules())


def _gathered_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    # Dynamo inlines this once per parameter read, and its cost grows with every attribute,
    # call and constant it meets: everything a read needs is precomputed at shard time, the
    # marker's arguments included (one tuple), and per-forward state is read from the root's
    # LocalShards, which the traced root forward itself set (no guard per module).
    param = module._parameters[name]
    if param is None:
        return None
    # Attribute reads, not module.__dict__[...]: Dynamo wraps a whole __dict__ it is asked for.
    fqn, marker_args = getattr(module, READS_ATTR)[name]
    if not isinstance(param, DTensor):
        raise RuntimeError(
            f"parameter {fqn!r} was replaced by a plain tensor after the model was sharded; "
            "load new values with load_state_dict() or copy_() into the existing parameter"
        )
    shards = getattr(module, LOCALS_ATTR)
    shared = shards.shared_gathered
    if shared is not None and fqn in shared:  # a tied parameter: gathered once at the root
        return shared[fqn]
    return _gather(param, fqn, marker_args, shards)


def _gather(param: nn.Parameter, fqn: str, marker_args: tuple, shards: LocalShards) -> torch.Tensor:
    """One marker: ``param``'s full value (its gradient reduced, or accumulated under no_sync)."""
    current = shards.current
    if current is not None:  # inside the root's forward
        local = current.get(fqn)
        accumulating = shards.accumulating
    else:  # a read outside the model's forward (eager runtime)
        local = None
        accumulating = shards.sync is not None and shards.sync.accumulating
    if local is None:
        local = param.to_local()
    if accumulating and param.requires_grad:
        return torch.ops.fsdp_compile.unshard_no_sync(local, shards.sync.accumulators[fqn], *marker_args)
    return torch.ops.fsdp_compile.unshard(local, *marker_args)


class LocalShards:
    """The local tensor of every shard of one model, taken once per forward at its root.

    Why at the root: inside an activation-checkpointed region (a ``tag_activation_checkpoint``
    higher-order op under torch.compile) ``DTensor.to_local()`` makes AOTAutograd save the
    DeviceMesh for backward, which it cannot. Taken before the region, the region only sees
    plain tensors.

    Parameters registered under several names (tied input/output embeddings) are gathered once
    per forward, at the root, and every read returns that one tensor: autograd then sums the
    gradients of all uses before the single reduction, as FSDP2 does (it gathers a unit once
    and reduces its accumulated gradient once). One marker per read would reduce each use's
    gradient separately and add the reduced shards: twice the bytes, and a different rounding.
    At the root rather than on first read: a first read inside an activation-checkpointed
    region would mutate state outside that region, which Dynamo refuses.
    """

    def __init__(self, sync: GradientSync | None = None) -> None:
        self.params: list[tuple[str, nn.Parameter]] = []
        self.sync = sync
        # Tied parameters (registered under several names): (fqn, parameter, marker arguments).
        self.shared: list[tuple[str, nn.Parameter, tuple]] = []
        # Set by the root's forward for its duration: the local shards, whether gradients
        # accumulate without synchronization (read once per forward, one guard under Dynamo),
        # and the tied parameters' gathered values.
        self.current: dict[str, torch.Tensor] | None = None
        self.accumulating = False
        self.shared_gathered: dict[str, torch.Tensor] | None = None


def _make_property(name: str) -> property:
    def read(self: nn.Module) -> torch.Tensor | None:
        return _gathered_parameter(self, name)

    def write(self: nn.Module, value: object) -> None:
        info = self.__dict__[SPECS_ATTR].get(name)
        fqn = info.fqn if info else name
        raise AttributeError(
            f"cannot assign to sharded parameter {fqn!r}; load new values with load_state_dict() "
            "or copy_() into the existing parameter"
        )

    return property(read, write, doc=f"Full value of sharded parameter {name!r} (gathers it).")


def _make_root_forward(cls: type):
    original_forward = cls.forward

    def forward(self: nn.Module, *args, **kwargs):
        # Inside forward rather than in hooks: Dynamo compiles module hooks as frames of their
        # own, so hooks would add graphs; this way all of it is part of the model's graph.
        shards = self.__dict__[LOCALS_ATTR]
        shards.accumulating = shards.sync is not None and shards.sync.accumulating
        shards.current = {fqn: param.to_local() for fqn, param in shards.params}
        try:
            shards.shared_gathered = {fqn: _gather(param, fqn, args_, shards) for fqn, param, args_ in shards.shared}
            policy = self.__dict__.get(MIXED_PRECISION_ATTR)
            if policy is None:
                return original_forward(self, *args, **kwargs)
            args, kwargs = cast_inputs(policy, args, kwargs)
            return cast_output(policy, original_forward(self, *args, **kwargs))
        finally:
            shards.current = None
            shards.shared_gathered = None

    return forward


_CLASS_CACHE: dict[tuple[type, tuple[str, ...], bool], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...], root: bool) -> type:
    """The generated subclass: a gathering property per parameter, and for the root a forward
    that takes the local shards (and applies mixed precision casts)."""
    key = (cls, names, root)
    if key not in _CLASS_CACHE:
        namespace = {name: _make_property(name) for name in names}
        if root:
            namespace["forward"] = _make_root_forward(cls)
        namespace["__module__"] = cls.__module__
        namespace["_fsdp_original_class"] = cls
        _CLASS_CACHE[key] = type(f"Sharded{cls.__name__}", (cls,), namespace)
    return _CLASS_CACHE[key]


def _owners(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, str, nn.Parameter]]:
    """(module, module name, local name, fully qualified name, parameter) per registration."""
    for mod_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, mod_name, name, f"{mod_name}.{name}" if mod_name else name, param


def _shard_tensor(param: torch.Tensor, topology: Topology, offload: CPUOffload | None) -> tuple[torch.Tensor, bool]:
    """This rank's DTensor shard of ``param``, and whether it is split on dim 0."""
    full = param.detach()
    if full.dim() == 0 or topology.shard_size == 1:
        local = _place(full.clone(), offload)
        return DTensor.from_local(local, topology.mesh, topology.replicated_placements(),
                                  run_check=False), False
    rows = full.shape[0]
    chunk = padded_rows(rows, topology.shard_size)
    start, length = shard_bounds(rows, topology.shard_size, topology.shard_rank)
    # Stored padded (as FSDP2 does) so every rank's copy-in reads an equal chunk.
    storage = full.new_zeros((chunk, *full.shape[1:]))
    storage[:length].copy_(full[start:start + length])
    local = _place(storage, offload)[:length]
    dtensor = DTensor.from_local(local, topology.mesh, topology.placements, run_check=False,
                                 shape=full.shape, stride=full.stride())
    return dtensor, True


def _place(storage: torch.Tensor, offload: CPUOffload | None) -> torch.Tensor:
    if offload is None:
        return storage
    storage = storage.to("cpu")
    return storage.pin_memory() if offload.pin_memory and offload_pins_memory() else storage


@dataclass
class ShardResult:
    infos: dict[str, ShardedParamInfo]
    peak_full_bytes: int | None = None  # meta-device models: most full parameter bytes held


def shard_module(
    model: nn.Module,
    topology: Topology,
    policy: Policy,
    mixed_precision: MixedPrecision | None = None,
    *,
    sync: GradientSync | None = None,
    offload: CPUOffload | None = None,
    init_fn: InitFn | None = None,
    init_device: torch.device | None = None,
    materialize: bool = True,
) -> ShardResult:
    """Shard every parameter of ``model`` in place; returns the info of each, by name.

    Parameters on the meta device are materialized unit by unit (see :mod:`.materialize`),
    on ``init_device``, and initialized by ``init_fn`` or each module's ``reset_parameters``;
    with ``materialize=False`` they become meta shards instead (planning: shapes only).
    """
    units = unit_modules(model, policy)
    presharded: dict[int, tuple[torch.Tensor, bool]] = {}
    peak = None
    if has_meta(model) and materialize:
        # Without units of its own (bytes / param policies) a model still materializes block by block.
        init_units = units if policy.uses_units else unit_modules(model, parse_policy("module"))
        result = materialize_units(model, init_units, init_device or current_device(topology.mesh.device_type),
                             lambda full: _shard_tensor(full, topology, offload), init_fn)
        presharded, peak = result.shards, result.peak_full_bytes
    elif init_fn is not None and materialize:
        raise ValueError("init_fn= initializes parameters on the meta device, and this model has none; "
                         "drop init_fn or build the model under torch.device('meta')")
    compute_device = str(current_device(topology.mesh.device_type)) if offload is not None else None
    seen: dict[int, tuple[nn.Parameter, ShardedParamInfo]] = {}
    registrations: dict[int, int] = {}
    per_module: dict[nn.Module, dict[str, ShardedParamInfo]] = {}
    infos: dict[str, ShardedParamInfo] = {}
    for module, module_name, name, fqn, param in list(_owners(model)):
        if id(param) not in seen:
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {fqn!r} is already a DTensor (placements {param.placements}); "
                    "fsdp_compile shards plain parameters, pass the model before any other "
                    "parallelism is applied"
                )
            if id(param) in presharded:
                dtensor, dim0_sharded = presharded[id(param)]
            else:
                dtensor, dim0_sharded = _shard_tensor(param, topology, offload)
            sharded = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            mp = mixed_precision if mixed_precision and mixed_precision.applies_to(param) else None
            comm = CommSpec(
                shard_group=topology.shard_group_name,
                shard_size=topology.shard_size,
                dim0_sharded=dim0_sharded,
                replicate_group=topology.replicate_group_name,
                replicate_size=topology.replicate_size,
                param_dtype=mp.param_dtype if mp else None,
                reduce_dtype=mp.reduce_dtype if mp else None,
                reshard_after_forward=topology.strategy.reshard_after_forward,
                compute_device=compute_device,
            )
            info = ShardedParamInfo(fqn, unit_of(module_name, units), tuple(param.shape), comm)
            seen[id(param)] = (sharded, info)
            infos[fqn] = info
            _SHARDED_NAMES[sharded] = fqn
            if sync is not None:
                sync.add(sharded, fqn, info.unit, info.full_shape, comm)
        sharded, info = seen[id(param)]
        registrations[id(param)] = registrations.get(id(param), 0) + 1
        module._parameters[name] = sharded
        per_module.setdefault(module, {})[name] = info
    casts = mixed_precision is not None and (
        mixed_precision.output_dtype is not None
        or (mixed_precision.cast_forward_inputs and mixed_precision.param_dtype is not None))
    if casts:
        model.__dict__[MIXED_PRECISION_ATTR] = mixed_precision
    per_module.setdefault(model, {})
    shards = LocalShards(sync)
    shards.params = [(fqn, sharded) for sharded, info in seen.values() for fqn in [info.fqn]]
    shards.shared = [(info.fqn, sharded, info.unshard_args) for key, (sharded, info) in seen.items()
                     if registrations[key] > 1]
    for module, specs in per_module.items():
        module.__dict__[SPECS_ATTR] = specs
        module.__dict__[READS_ATTR] = {name: (info.fqn, info.unshard_args) for name, info in specs.items()}
        module.__dict__[LOCALS_ATTR] = shards
        if sync is not None:
            module.__dict__[SYNC_ATTR] = sync
        module.__class__ = _sharded_class(type(module), tuple(sorted(specs)), module is model)
    return ShardResult(infos, peak)


# ---------------------------------------------------------------- mixed precision and offload
def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def cast_inputs(policy: MixedPrecision, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The root module's forward inputs as ``policy`` wants them."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        return _cast(args, policy.param_dtype), _cast(kwargs, policy.param_dtype)
    return args, kwargs


def cast_output(policy: MixedPrecision, output: Any) -> Any:
    """The root module's forward output as ``policy`` wants it."""
    return output if policy.output_dtype is None else _cast(output, policy.output_dtype)


def offload_pins_memory() -> bool:
    """Whether pinning is possible here: it needs an accelerator runtime."""
    return torch.cuda.is_available()
