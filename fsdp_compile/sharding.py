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

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .groups import Topology
from .mixed_precision import MixedPrecision, cast_inputs, cast_output
from .passes.bucketing import Policy, unit_modules, unit_of
from .runtime.collectives import CommSpec, padded_rows, shard_bounds

SPECS_ATTR = "_fsdp_specs"
MIXED_PRECISION_ATTR = "_fsdp_mixed_precision"


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


def is_sharded(module: nn.Module) -> bool:
    return any(SPECS_ATTR in m.__dict__ for m in module.modules())


def _gathered_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    param = module._parameters[name]
    if param is None:
        return None
    if not isinstance(param, DTensor):
        info = module.__dict__[SPECS_ATTR][name]
        raise RuntimeError(
            f"parameter {info.fqn!r} was replaced by a plain tensor after the model was sharded; "
            "load new values with load_state_dict() or copy_() into the existing parameter"
        )
    info = module.__dict__[SPECS_ATTR][name]
    return torch.ops.fsdp_compile.unshard(param.to_local(), *info.unshard_args)


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


def _make_casting_forward(cls: type):
    original_forward = cls.forward

    def forward(self: nn.Module, *args, **kwargs):
        # Inside forward rather than in hooks: Dynamo compiles module hooks as frames of their
        # own, so hooks would add graphs; this way the casts are part of the model's graph.
        policy = self.__dict__[MIXED_PRECISION_ATTR]
        args, kwargs = cast_inputs(policy, args, kwargs)
        return cast_output(policy, original_forward(self, *args, **kwargs))

    return forward


_CLASS_CACHE: dict[tuple[type, tuple[str, ...], bool], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...], casts: bool) -> type:
    """The generated subclass: a gathering property per parameter, a casting forward for the root."""
    key = (cls, names, casts)
    if key not in _CLASS_CACHE:
        namespace = {name: _make_property(name) for name in names}
        if casts:
            namespace["forward"] = _make_casting_forward(cls)
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


def _shard_tensor(param: nn.Parameter, topology: Topology) -> tuple[torch.Tensor, bool]:
    """This rank's DTensor shard of ``param``, and whether it is split on dim 0."""
    full = param.detach()
    if full.dim() == 0 or topology.shard_size == 1:
        local = full.clone()
        return DTensor.from_local(local, topology.mesh, topology.replicated_placements(),
                                  run_check=False), False
    rows = full.shape[0]
    chunk = padded_rows(rows, topology.shard_size)
    start, length = shard_bounds(rows, topology.shard_size, topology.shard_rank)
    # Stored padded (as FSDP2 does) so every rank's copy-in reads an equal chunk.
    storage = full.new_zeros((chunk, *full.shape[1:]))
    storage[:length].copy_(full[start:start + length])
    local = storage[:length]
    dtensor = DTensor.from_local(local, topology.mesh, topology.placements, run_check=False,
                                 shape=full.shape, stride=full.stride())
    return dtensor, True


def shard_module(
    model: nn.Module,
    topology: Topology,
    policy: Policy,
    mixed_precision: MixedPrecision | None = None,
) -> dict[str, ShardedParamInfo]:
    """Shard every parameter of ``model`` in place; returns the info of each, by name."""
    units = unit_modules(model, policy)
    seen: dict[int, tuple[nn.Parameter, ShardedParamInfo]] = {}
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
            if param.device.type == "meta":
                raise ValueError(
                    f"parameter {fqn!r} is on the meta device; materialize the model (e.g. "
                    "model.to_empty(device=...) and re-initialize) before sharding"
                )
            dtensor, dim0_sharded = _shard_tensor(param, topology)
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
            )
            info = ShardedParamInfo(fqn, unit_of(module_name, units), tuple(param.shape), comm)
            seen[id(param)] = (sharded, info)
            infos[fqn] = info
        sharded, info = seen[id(param)]
        module._parameters[name] = sharded
        per_module.setdefault(module, {})[name] = info
    casts = mixed_precision is not None and (
        mixed_precision.output_dtype is not None
        or (mixed_precision.cast_forward_inputs and mixed_precision.param_dtype is not None))
    if casts:
        model.__dict__[MIXED_PRECISION_ATTR] = mixed_precision
        per_module.setdefault(model, {})
    for module, specs in per_module.items():
        module.__dict__[SPECS_ATTR] = specs
        module.__class__ = _sharded_class(type(module), tuple(sorted(specs)), casts and module is model)
    return infos
