"""Shard a model in place: DTensor parameters, and reads that gather them.

Afterwards ``module._parameters[name]`` holds the DTensor parameter (what ``state_dict()``,
optimizers and checkpoints see), ``module.<name>`` returns the gathered parameter through a
generated subclass (:mod:`.sharded_class`), and every sharded module carries its
:class:`~.sharded_class.ModuleState`, sharing the model's :class:`~.sharded_param.LocalShards`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..api import BackendOptions, parse_policy
from ..runtime.collectives import CommSpec
from .compile_regions import (
    ModelRegions,
    RegionClass,
    RegionFallback,
    RegionReads,
    first_names,
    region_copies,
    region_units,
    relative_marker_args,
    tp_mesh_split_classes,
)
from .grad_sync import GradientSync
from .groups import Topology, current_device
from .materialize import InitFn, has_meta
from .materialize import materialize as materialize_units
from .sharded_class import ModuleState, set_module_state, sharded_class
from .sharded_param import LocalShards, ShardedParamInfo, float8_gather, shard_tensor, sharded_parameter
from .tensor_parallel import tp_local, tp_spec
from .units import ReshardGroups, resolve_reshard, unit_modules, unit_of


@dataclass(frozen=True)
class Init:
    """How ``shard()`` initializes a meta-device model: ``fn`` (default ``reset_parameters``) on
    ``device`` (default the mesh's); ``materialize=False`` keeps meta shards (planning)."""

    fn: InitFn | None = None
    device: torch.device | None = None
    materialize: bool = True


@dataclass
class ShardResult:
    infos: dict[str, ShardedParamInfo]
    shards: LocalShards
    peak_full_bytes: int | None = None  # meta-device models: most full parameter bytes held
    reshard_to: dict[str, int] | None = None  # unit -> ranks it reshards to after forward


def shard_module(model: nn.Module, topology: Topology, options: BackendOptions, init: Init = Init(), *,
                 sync: GradientSync | None = None, region_fallback: RegionFallback | None = None,
                 reshard_groups: ReshardGroups | None = None) -> ShardResult:
    """Shard every parameter of ``model`` in place as ``options`` say; returns each one's info. Meta
    parameters are materialized as ``init`` says; regions need ``sync``; ``region_fallback`` and
    ``reshard_groups``: the backend's (new by default). TP parameters shard over the dp ``mesh=``."""
    policy, mixed_precision, offload = options.bucket_policy, options.mixed_precision, options.offload
    units = unit_modules(model, policy)
    reshard_to = resolve_reshard(options.reshard_after_forward, model, units, topology)
    groups = reshard_groups if reshard_groups is not None else ReshardGroups()
    # Every rank creates the same groups, in sorted order (new_group is collective).
    reshard_group_names = {n: groups.group(topology, n).group_name
                           for n in sorted(set(reshard_to.values())) if 1 < n < topology.shard_size}
    presharded: dict[int, tuple[torch.Tensor, bool]] = {}
    peak = None
    # Checked before anything is materialized, so bad input fails before any work.
    tp_specs = {id(param): tp_spec(fqn, param, topology, options.mesh is not None)
                for _, _, _, fqn, param in _owners(model) if isinstance(param, DTensor)}

    def shard_full(full: torch.Tensor, original: nn.Parameter) -> tuple[torch.Tensor, bool]:
        tp = tp_specs.get(id(original))
        return shard_tensor(full if tp is None else tp_local(full, tp), topology, offload, tp)

    if has_meta(model) and init.materialize:
        # Without units of its own (bytes / param policies) a model still materializes block by block.
        init_units = units if policy.uses_units else unit_modules(model, parse_policy("module"))
        result = materialize_units(model, init_units, init.device or current_device(topology.mesh.device_type),
                                   shard_full, init.fn)
        presharded, peak = result.shards, result.peak_full_bytes
    elif init.fn is not None and init.materialize:
        raise ValueError("init_fn= initializes parameters on the meta device, and this model has none; "
                         "drop init_fn or build the model under torch.device('meta')")
    device = current_device(topology.mesh.device_type)
    _move_buffers(model, device)
    compute_device = str(device) if offload is not None else None
    seen: dict[int, tuple[nn.Parameter, ShardedParamInfo]] = {}
    registrations: dict[int, int] = {}
    per_module: dict[nn.Module, dict[str, ShardedParamInfo]] = {}
    infos: dict[str, ShardedParamInfo] = {}
    for module, module_name, name, fqn, param in list(_owners(model)):
        if id(param) not in seen:
            tp = tp_specs.get(id(param))
            dtensor, dim0_sharded = presharded.get(id(param)) or shard_tensor(
                param if tp is None else param._local_tensor, topology, offload, tp)
            gathered_shape = tuple(param._local_tensor.shape) if tp is not None else tuple(param.shape)
            sharded = sharded_parameter(dtensor, fqn, param.requires_grad)
            mp = mixed_precision if mixed_precision and mixed_precision.applies_to(param) else None
            unit = unit_of(module_name, units)
            partial = reshard_to[unit] if reshard_to[unit] in reshard_group_names else 0
            float8 = float8_gather(module, name, param) if tp is None and dim0_sharded else None
            comm = CommSpec(
                shard_group=topology.shard_group_name, shard_size=topology.shard_size, dim0_sharded=dim0_sharded,
                replicate_group=topology.replicate_group_name, replicate_size=topology.replicate_size,
                param_dtype=mp.param_dtype if mp else None, reduce_dtype=mp.reduce_dtype if mp else None,
                reshard_after_forward=reshard_to[unit] > 1, compute_device=compute_device,
                reshard_group=reshard_group_names.get(partial, ""), reshard_size=partial,
                float8=float8.dtype if float8 else None, float8_pow2_scale=float8.pow2_scale if float8 else False)
            info = ShardedParamInfo(fqn, unit, gathered_shape, comm, tp)
            seen[id(param)] = (sharded, info)
            infos[fqn] = info
            if sync is not None:
                sync.add(sharded, info)
        sharded, info = seen[id(param)]
        registrations[id(param)] = registrations.get(id(param), 0) + 1
        module._parameters[name] = sharded
        per_module.setdefault(module, {})[name] = info
    casts = mixed_precision is not None and (mixed_precision.output_dtype is not None or (
        mixed_precision.cast_forward_inputs and mixed_precision.param_dtype is not None))
    per_module.setdefault(model, {})
    shards = LocalShards(sync)
    for sharded, info in seen.values():
        shards.add(info.fqn, sharded, info.unshard_args)
    shards.shared = [(info.fqn, info.unshard_args) for key, (sharded, info) in seen.items() if registrations[key] > 1]
    module_names = {module: name for name, module in model.named_modules()}
    tied = {fqn for fqn, _ in shards.shared}
    tied_units = {unit_of(module_names[m], units) for m, specs in per_module.items()
                  if any(info.fqn in tied for info in specs.values())}
    tensor_parallel = any(info.tp is not None for info in infos.values())
    copies = region_copies(options.regions, options.compiler)
    regional = region_units(model, units, tied_units, copies) if copies is not None and sync is not None else set()
    if tensor_parallel and regional:
        regional = _without_split_meshes(model, regional)
    fallback = region_fallback if region_fallback is not None else RegionFallback()
    region_classes = _region_classes(model, regional, fallback)
    for module, specs in per_module.items():
        unit = unit_of(module_names[module], units)
        region = _region_reads(specs, unit, shards, sync, region_classes[unit]) if unit in regional else None
        for name, info in specs.items():
            shards.register(module, name, info.fqn)
        root = module is model
        regions = ModelRegions(list(dict.fromkeys(region_classes.values())), fallback) if root and regional else None
        set_module_state(module, ModuleState(specs, shards, sync, region,
                                             mixed_precision if root and casts else None,
                                             region_class=region_classes.get(module_names[module]), regions=regions))
        module.__class__ = sharded_class(type(module), tuple(sorted(specs)), root,
                                         region_forward=not root and module_names[module] in regional,
                                         in_region=region is not None,
                                         tp_names=tuple(sorted(n for n, i in specs.items() if i.tp is not None)),
                                         tp_region=tensor_parallel, region_fallback=regions is not None)
    for unit in sorted(regional):
        module = model.get_submodule(unit)
        if module not in per_module:  # a block whose parameters all live in its submodules
            set_module_state(module, ModuleState({}, shards, sync, region_class=region_classes[unit]))
            module.__class__ = sharded_class(type(module), (), region_forward=True, tp_region=tensor_parallel)
    return ShardResult(infos, shards, peak, reshard_to)


def _region_classes(model: nn.Module, regional: set[str], fallback: RegionFallback) -> dict[str, RegionClass]:
    """Each region unit -> its class's switch."""
    by_class: dict[type, list[str]] = {}
    for unit in sorted(regional):
        by_class.setdefault(type(model.get_submodule(unit)), []).append(unit)
    return {unit: fallback.region_class(cls, units) for cls, units in by_class.items() for unit in units}


def _without_split_meshes(model: nn.Module, regional: set[str]) -> set[str]:
    """``regional`` less the block classes whose TP hooks hold different meshes, each warned of."""
    split = tp_mesh_split_classes(model, regional)
    for cls in sorted(split, key=lambda c: c.__qualname__):
        blocks = sorted(u for u in regional if type(model.get_submodule(u)) is cls)
        warnings.warn(f"fsdp_compile: the {cls.__qualname__} blocks ({first_names(blocks)}) compile inline, not as "
                      "one region: their tensor-parallel hooks hold different DeviceMesh objects (the TP mesh sliced "
                      "once per block, e.g. mesh['tp'] inside the loop), which torch 2.13 cannot reuse a region's "
                      "trace across. Slice the mesh once (tp_mesh = mesh['tp']) and pass that object to "
                      "parallelize_module for every block, or pass regions=False to compile inline without this "
                      "warning.", stacklevel=4)
    return {u for u in regional if type(model.get_submodule(u)) not in split}


def _region_reads(specs: dict[str, ShardedParamInfo], unit: str, shards: LocalShards,
                  sync: GradientSync | None, region_class: RegionClass) -> RegionReads:
    """A module's reads inside the region ``unit``, their leaves kept current by ``shards``."""
    reads = RegionReads({name: shards.leaves[info.fqn] for name, info in specs.items()},
                        {name: relative_marker_args(info.fqn, unit, info.unshard_args)
                         for name, info in specs.items()}, sync, region_class)
    for name, info in specs.items():
        shards.mirror(info.fqn, reads.leaves, name)
    return reads


def _owners(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, str, nn.Parameter]]:
    """(module, module name, local name, fully qualified name, parameter) per registration."""
    for mod_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, mod_name, name, f"{mod_name}.{name}" if mod_name else name, param


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (not meta ones: materializing places those) go to the parameters' device."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)
