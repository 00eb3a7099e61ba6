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

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..api import CPUOffload, MixedPrecision
from ..runtime.collectives import CommSpec, padded_rows, shard_bounds
from .grad_sync import SYNC_ATTR, GradientSync, add_local_grad
from .groups import Topology, current_device
from .materialize import InitFn, has_meta
from .materialize import materialize as materialize_units
from .regions import REGION_ATTR, RegionReads, make_region_forward, region_units, relative_marker_args
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


# Every leaf that stands for a sharded parameter in forward -> a weak reference to the LocalShards
# holding it. Weak: the LocalShards holds the leaf, and a value that reaches its own key keeps
# the entry, the model's parameters, their device mesh and its process group alive forever.
_LEAF_OWNERS = WeakIdKeyDictionary()


def sharded_name(param: torch.Tensor) -> str | None:
    """The name a parameter (or the leaf that stands for it in forward) had when it was
    sharded, or None if no backend sharded it."""
    return _SHARDED_NAMES.get(param)


def leaf_owner(tensor: torch.Tensor) -> LocalShards | None:
    """The LocalShards whose forward reads ``tensor`` for a sharded parameter, if any."""
    owner = _LEAF_OWNERS.get(tensor)
    return owner() if owner is not None else None


def is_sharded(module: nn.Module) -> bool:
    return any(SPECS_ATTR in m.__dict__ for m in module.modules())


def _gathered_parameter(fqn: str, marker_args: tuple, shards: LocalShards) -> torch.Tensor:
    """A read that is not the plain case of :func:`_make_property`: a tied parameter, gradient
    accumulation without synchronization, or a read outside the model's forward."""
    shared = shards.shared_gathered
    if shared is not None and fqn in shared:  # a tied parameter: gathered once at the root
        return shared[fqn]
    return _gather(fqn, marker_args, shards)


def _gather(fqn: str, marker_args: tuple, shards: LocalShards) -> torch.Tensor:
    """One marker: the parameter's full value (its gradient reduced, or accumulated under no_sync)."""
    local = shards.leaves[fqn]
    if shards.in_forward:
        accumulating = shards.accumulating
    else:  # a read outside the model's forward (eager runtime)
        accumulating = shards.sync is not None and shards.sync.accumulating
    if accumulating and local.requires_grad:
        return torch.ops.fsdp_compile.unshard_no_sync(local, shards.sync.accumulators[fqn], *marker_args)
    return torch.ops.fsdp_compile.unshard(local, *marker_args)


@dataclass
class _Registration:
    """One name a sharded parameter is registered under: where to look for replacements."""

    parameters: dict  # the owning module's _parameters
    name: str
    fqn: str
    param: nn.Parameter


class _Shard:
    """One sharded parameter, and the plain tensor that stands for it in forward.

    ``leaf`` shares the DTensor's local storage (an optimizer step on the DTensor, a
    ``copy_`` or a checkpoint load is seen by the next forward without a copy) and is an
    autograd leaf of its own: gradients accumulate into ``leaf.grad`` and a hook moves them
    into ``param.grad`` as a DTensor, as FSDP2 moves its reduced shards into the sharded
    parameters' ``.grad``.
    """

    __slots__ = ("__weakref__", "fqn", "hooked", "leaf", "local", "owner", "param")

    def __init__(self, fqn: str, param: nn.Parameter, owner: LocalShards) -> None:
        self.fqn = fqn
        self.owner = owner
        self.param = param
        self.local = param._local_tensor
        self.leaf = self._make_leaf()

    def _make_leaf(self) -> nn.Parameter:
        # nn.Parameter: Dynamo and AOTAutograd treat it as the parameter it stands for (a
        # static input), as they treated the DTensor.
        leaf = nn.Parameter(self.local.detach(), requires_grad=False)
        _SHARDED_NAMES[leaf] = self.fqn
        _LEAF_OWNERS[leaf] = weakref.ref(self.owner)
        self.hooked = False
        self._follow(leaf)
        return leaf

    def _follow(self, leaf: nn.Parameter) -> None:
        leaf.requires_grad_(self.param.requires_grad)
        if leaf.requires_grad and not self.hooked:
            leaf.register_post_accumulate_grad_hook(_grad_mover(self))
            self.hooked = True

    def move_grad(self, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        # None when the graph gave this leaf no gradient (under no_sync it goes to the accumulator).
        if grad is not None and self.param.requires_grad:
            add_local_grad(self.param, grad)

    def refresh(self) -> bool:
        """Make the leaf follow the parameter again; True if the leaf changed (a compiled graph
        traced with the old one must not run this call)."""
        if self.param._local_tensor is not self.local:  # new storage (``param.data = ...``)
            self.local = self.param._local_tensor
            self.leaf = self._make_leaf()
            return True
        if self.leaf.requires_grad is not self.param.requires_grad:
            self._follow(self.leaf)
            return True
        return False


def _grad_mover(shard: _Shard):
    """The leaf's post-accumulate-grad hook, holding its shard weakly.

    The leaf keeps its hooks in C++, where the garbage collector cannot see them: a hook that
    held the shard strongly (a bound method) would close a cycle leaf -> hook -> shard -> leaf
    that is never collected, keeping the DTensor parameters, their mesh and its gloo process
    group (and that group's threads, which then race interpreter shutdown) alive.
    """
    ref = weakref.ref(shard)

    def move(leaf: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive.move_grad(leaf)
    return move


class LocalShards:
    """The plain tensors that stand for one model's sharded parameters in its forward.

    Why not the DTensor parameters themselves: every DTensor a graph reads costs Dynamo a
    subclass input with spec guards and an unwrapping (``to_local``) per parameter, and
    AOTAutograd a subclass input to flatten and a DTensor gradient to rebuild: together more
    than doubling the compile time of a deep model against plain ``torch.compile``. The graphs
    read one leaf per parameter instead (see :class:`_Shard`), and the DTensor parameters stay
    what the optimizer, ``state_dict`` and checkpoints see.

    Plain tensors also keep activation-checkpointed regions clean: ``DTensor.to_local()``
    inside a ``tag_activation_checkpoint`` region made AOTAutograd save the DeviceMesh for
    backward, which it cannot.

    The leaves follow their parameters (``requires_grad``, replaced storage) through
    :meth:`refresh`, which runs eagerly before every forward: at the root's forward in the
    eager runtime, and before every compiled graph runs (a graph traced with a leaf that no
    longer matches runs through the eager runtime once; Dynamo's guards on the leaf then
    compile a new graph).

    Parameters registered under several names (tied input/output embeddings) are gathered once
    per forward, at the root, and every read returns that one tensor: autograd then sums the
    gradients of all uses before the single reduction, as FSDP2 does (it gathers a unit once
    and reduces its accumulated gradient once). One marker per read would reduce each use's
    gradient separately and add the reduced shards: twice the bytes, and a different rounding.
    At the root rather than on first read: a first read inside an activation-checkpointed
    region would mutate state outside that region, which Dynamo refuses.
    """

    def __init__(self, sync: GradientSync | None = None) -> None:
        self.sync = sync
        self.shards: list[_Shard] = []
        self.registrations: list[_Registration] = []
        # What the graphs read: fqn -> leaf (the dict is kept, entries are replaced).
        self.leaves: dict[str, nn.Parameter] = {}
        # Tied parameters (registered under several names): (fqn, marker arguments).
        self.shared: list[tuple[str, tuple]] = []
        # Set by the root's forward for its duration: whether gradients accumulate without
        # synchronization (read once per forward, one guard under Dynamo), and the tied
        # parameters' gathered values.
        self.in_forward = False
        self.accumulating = False
        self.shared_gathered: dict[str, torch.Tensor] | None = None
        self.plain_reads = False  # in_forward, not accumulating, no tied parameters
        # fqn -> the (dict, key) places besides ``leaves`` that hold its leaf (region reads).
        self.mirrors: dict[str, list[tuple[dict, str]]] = {}
        self._snapshot: tuple[list, ...] | None = None  # what _unchanged compares, in parallel lists

    def add(self, fqn: str, param: nn.Parameter) -> None:
        shard = _Shard(fqn, param, self)
        self.shards.append(shard)
        self.leaves[fqn] = shard.leaf
        self._snapshot = None

    def mirror(self, fqn: str, where: dict, key: str) -> None:
        """``where[key]`` holds ``fqn``'s leaf too: keep it current when the leaf changes."""
        self.mirrors.setdefault(fqn, []).append((where, key))

    def register(self, module: nn.Module, name: str, fqn: str) -> None:
        """``module.<name>`` is (one registration of) the sharded parameter ``fqn``."""
        self.registrations.append(_Registration(module._parameters, name, fqn, module._parameters[name]))
        self._snapshot = None

    def refresh(self) -> dict[int, nn.Parameter]:
        """Bring every leaf in line with its parameter; returns ``{id(old leaf): new leaf}`` for
        the leaves that changed (empty when none did).

        Raises if a sharded parameter was replaced by another tensor after sharding: its leaf
        would go on reading the old values.
        """
        if self._unchanged():
            return {}
        for reg in self.registrations:
            current = reg.parameters.get(reg.name)
            if current is not reg.param:
                what = ("None" if current is None else "another DTensor" if isinstance(current, DTensor)
                        else "a plain tensor")
                raise RuntimeError(
                    f"parameter {reg.fqn!r} was replaced by {what} after the model was sharded; load "
                    "new values with load_state_dict() or copy_() into the existing parameter"
                )
        changed = {}
        for shard in self.shards:
            old = shard.leaf
            if shard.refresh():
                changed[id(old)] = shard.leaf
                self.leaves[shard.fqn] = shard.leaf
                for where, key in self.mirrors.get(shard.fqn, ()):
                    where[key] = shard.leaf
        self._snapshot = None
        return changed

    def _unchanged(self) -> bool:
        # Runs before every graph call, for every parameter: compared with C-level iteration
        # (map over parallel lists), a few times faster than a loop over the objects.
        if self._snapshot is None:
            regs, shards = self.registrations, self.shards
            self._snapshot = ([r.parameters for r in regs], [r.name for r in regs], [r.param for r in regs],
                              [s.param for s in shards], [s.local for s in shards], [s.leaf for s in shards])
        dicts, names, registered, params, locals_, leaves = self._snapshot
        if not (all(map(is_, map(dict.get, dicts, names), registered))
                and all(map(is_, map(_LOCAL_TENSOR, params), locals_))):
            return False
        with torch._C.DisableTorchFunctionSubclass():  # a DTensor's attributes, without its dispatch
            return all(map(is_, map(_REQUIRES_GRAD, params), map(_REQUIRES_GRAD, leaves)))


_LOCAL_TENSOR = attrgetter("_local_tensor")
_REQUIRES_GRAD = attrgetter("requires_grad")


def _make_property(name: str) -> property:
    def read(self: nn.Module) -> torch.Tensor:
        # Dynamo inlines this once per parameter read, and its cost grows with every call,
        # attribute and constant it meets (reads through helper calls cost it ~100 bytecode
        # steps each more than plain parameter reads): everything is precomputed at shard time, the marker's arguments
        # included (one tuple, one guard), and the plain case -- inside the forward, no tied
        # parameter, no accumulation, which the traced root forward decided once -- is one
        # marker on the leaf. The DTensor parameter itself is never touched (see LocalShards).
        # Plain attribute reads, not getattr() calls or module.__dict__[...] (Dynamo wraps a
        # whole __dict__ it is asked for).
        region = self._fsdp_region
        if region is not None and not region.sync.accumulating and torch.compiler.is_compiling():
            # Inside a compile region (sharding/regions.py): nothing here may name the block,
            # or the next block could not reuse this trace, nor read the root's per-forward
            # state (Dynamo does not reuse a region that read what the outer frame wrote).
            return torch.ops.fsdp_compile.unshard(region.leaves[name], *region.args[name])
        fqn, marker_args = self._fsdp_reads[name]
        shards = self._fsdp_local_shards
        if shards.plain_reads:
            return torch.ops.fsdp_compile.unshard(shards.leaves[fqn], *marker_args)
        return _gathered_parameter(fqn, marker_args, shards)

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
        if not torch.compiler.is_compiling():
            # The eager runtime; compiled graphs refresh before they run (Compiler._guarded).
            shards.refresh()
        shards.accumulating = shards.sync is not None and shards.sync.accumulating
        shards.in_forward = True
        shards.plain_reads = not shards.accumulating and not shards.shared
        try:
            shards.shared_gathered = {fqn: _gather(fqn, args_, shards) for fqn, args_ in shards.shared}
            policy = self.__dict__.get(MIXED_PRECISION_ATTR)
            if policy is None:
                return original_forward(self, *args, **kwargs)
            args, kwargs = cast_inputs(policy, args, kwargs)
            return cast_output(policy, original_forward(self, *args, **kwargs))
        finally:
            shards.in_forward = False
            shards.plain_reads = False
            shards.shared_gathered = None

    return forward


_CLASS_CACHE: dict[tuple[type, tuple[str, ...], bool, bool], type] = {}


def _sharded_class(cls: type, names: tuple[str, ...], root: bool, region: bool = False) -> type:
    """The generated subclass: a gathering property per parameter, for the root a forward that
    takes the local shards (and applies mixed precision casts), for a unit compiled as a region
    a forward that runs as one (see sharding/regions.py)."""
    key = (cls, names, root, region)
    if key not in _CLASS_CACHE:
        namespace: dict[str, Any] = {name: _make_property(name) for name in names}
        namespace[REGION_ATTR] = None  # set on the instances inside a region
        if root:
            namespace["forward"] = _make_root_forward(cls)
        elif region:
            namespace["forward"] = make_region_forward(cls)
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
    device = None if full.is_meta else current_device(topology.mesh.device_type)
    if full.dim() == 0 or topology.shard_size == 1:
        local = _place(full.clone(), offload, device)
        return DTensor.from_local(local, topology.mesh, topology.replicated_placements(),
                                  run_check=False), False
    rows = full.shape[0]
    chunk = padded_rows(rows, topology.shard_size)
    start, length = shard_bounds(rows, topology.shard_size, topology.shard_rank)
    # Stored padded (as FSDP2 does) so every rank's copy-in reads an equal chunk.
    storage = full.new_zeros((chunk, *full.shape[1:]))
    storage[:length].copy_(full[start:start + length])
    local = _place(storage, offload, device)[:length]
    dtensor = DTensor.from_local(local, topology.mesh, topology.placements, run_check=False,
                                 shape=full.shape, stride=full.stride())
    return dtensor, True


def _place(storage: torch.Tensor, offload: CPUOffload | None, device: torch.device | None = None) -> torch.Tensor:
    """Where a shard lives: host memory under ``offload`` (pinned where asked and possible),
    else ``device``, the mesh's (None: where it is). FSDP2's ``fully_shard`` moves a module's
    states to its mesh's device too: a model built on the CPU and sharded over an NCCL group
    trains on the GPU."""
    if offload is not None:
        storage = storage.to("cpu")
        return storage.pin_memory() if offload.pin_memory and offload_pins_memory() else storage
    return storage if device is None else storage.to(device)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (not meta ones: materializing places those) go to the parameters' device."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


@dataclass
class ShardResult:
    infos: dict[str, ShardedParamInfo]
    shards: LocalShards
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
    region_copies: int | None = None,
) -> ShardResult:
    """Shard every parameter of ``model`` in place; returns the info of each, by name.

    Parameters on the meta device are materialized unit by unit (see :mod:`.materialize`),
    on ``init_device``, and initialized by ``init_fn`` or each module's ``reset_parameters``;
    with ``materialize=False`` they become meta shards instead (planning: shapes only).
    ``region_copies``: compile the units of a class with that many copies or more as regions
    (see :mod:`.regions`; needs ``sync``); None: no regions.
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
    device = current_device(topology.mesh.device_type)
    _move_buffers(model, device)
    compute_device = str(device) if offload is not None else None
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
    for sharded, info in seen.values():
        shards.add(info.fqn, sharded)
    shards.shared = [(info.fqn, info.unshard_args) for key, (sharded, info) in seen.items() if registrations[key] > 1]
    module_names = {module: name for name, module in model.named_modules()}
    tied = {fqn for fqn, _ in shards.shared}
    tied_units = {unit_of(module_names[m], units) for m, specs in per_module.items()
                  if any(info.fqn in tied for info in specs.values())}
    regional = (region_units(model, units, tied_units, region_copies)
                if region_copies is not None and sync is not None else set())
    for module, specs in per_module.items():
        unit = unit_of(module_names[module], units)
        if unit in regional:
            reads = RegionReads({name: shards.leaves[info.fqn] for name, info in specs.items()},
                                {name: relative_marker_args(info.fqn, unit, info.unshard_args)
                                 for name, info in specs.items()}, sync)
            module.__dict__[REGION_ATTR] = reads
            for name, info in specs.items():
                shards.mirror(info.fqn, reads.leaves, name)
    for module, specs in per_module.items():
        for name, info in specs.items():
            shards.register(module, name, info.fqn)
        module.__dict__[SPECS_ATTR] = specs
        module.__dict__[READS_ATTR] = {name: (info.fqn, info.unshard_args) for name, info in specs.items()}
        module.__dict__[LOCALS_ATTR] = shards
        if sync is not None:
            module.__dict__[SYNC_ATTR] = sync
        region = module is not model and module_names[module] in regional
        module.__class__ = _sharded_class(type(module), tuple(sorted(specs)), module is model, region)
    for unit in sorted(regional):
        module = model.get_submodule(unit)
        if module not in per_module:  # a block whose parameters all live in its submodules
            module.__dict__[SYNC_ATTR] = sync
            module.__class__ = _sharded_class(type(module), (), False, True)
    return ShardResult(infos, shards, peak)


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
