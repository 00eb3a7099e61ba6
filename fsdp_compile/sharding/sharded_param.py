"""Sharded parameters: the tensors each is made of, the map from those tensors to its name, and
the leaves one model's forward reads (:class:`LocalShards`).

* DTensor parameter (:func:`shard_tensor`): in ``module._parameters``, what optimizers and
  checkpoints see and where gradients end up; sharded on dim 0 (replicated for NO_SHARD and 0-d).
* Local shard: its ``_local_tensor``, padded to an equal chunk as FSDP2's; on the host under offload.
* Leaf: a plain ``nn.Parameter`` on the local shard's storage standing for the parameter in forward
  (:class:`ShardedParam`), so an optimizer step or checkpoint load is seen without a copy.
* Gathered parameter: ``module.<name>`` in forward, ``unshard(leaf, ...)``.

Errors name a graph input's parameter through one weak map, not tensor attributes, which a copy
(``torch.save``, ``deepcopy``) would carry.

Float8: torchao ``Float8Linear`` weights that ask for it (``enable_fsdp_float8_all_gather=True``) are
stored as the tensor they wrap, their spec carrying the float8 dtype: the gather moves a byte per element
plus a scale per weight and hands ``Float8Linear`` the weight in the compute dtype. torchao is imported
only when present.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, is_

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from ..api import CPUOffload
from ..runtime.collectives import CommSpec, padded_rows, shard_bounds
from .grad_sync import GradientSync, add_local_grad
from .groups import Topology, current_device
from .tensor_parallel import TPSpec, combined_layout

FLOAT8_EXTRA = 'pip install -e ".[float8]"'


@dataclass(frozen=True)
class Float8Gather:
    """How a weight's shard is cast for its all-gather (the fields of torchao's own cast)."""

    dtype: torch.dtype  # the float8 dtype, e.g. torch.float8_e4m3fn
    pow2_scale: bool  # Float8LinearConfig.round_scales_to_power_of_2


def _is_torchao(obj: object) -> bool:
    return type(obj).__module__.startswith("torchao.")


def _is_float8_weight(tensor: torch.Tensor) -> bool:
    if not _is_torchao(tensor):
        return False
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(tensor, WeightWithDynamicFloat8CastTensor)


def float8_gather(module: nn.Module, name: str, param: torch.Tensor) -> Float8Gather | None:
    """The float8 cast of ``module.<name>``'s all-gather, or None: a weight torchao marked for
    FSDP's float8 all-gather (only with dynamic tensorwise scaling, which the gather reproduces)."""
    if name != "weight" or not _is_float8_weight(param):
        return None
    config = getattr(module, "config", None)
    return Float8Gather(param._dtype, bool(getattr(config, "round_scales_to_power_of_2", False)))


def plain_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor a float8 weight wraps, else ``param`` itself."""
    return param._tensor if _is_float8_weight(param) else param


def like_float8_weight(original: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` wrapped as ``original`` is when that is a torchao float8 weight, else ``tensor``."""
    if not _is_float8_weight(original):
        return tensor
    return type(original)(tensor, original._linear_mm_config, original._dtype)


def require_torchao(what: str) -> None:
    """Raise a clear error when float8 is asked for without torchao installed."""
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{what} needs torchao, which is not installed: {FLOAT8_EXTRA}") from exc


@dataclass(frozen=True)
class ShardedParamInfo:
    """What a read of one sharded parameter needs to become its gathered parameter."""

    fqn: str
    unit: str  # the bucket unit (module name; "" is the root)
    full_shape: tuple[int, ...]  # what the markers gather: the parameter, or a TP parameter's TP-local tensor
    comm: CommSpec
    tp: TPSpec | None = None

    @property
    def unshard_args(self) -> tuple:
        full_rows = self.full_shape[0] if self.full_shape else 0
        return (self.fqn, self.unit, full_rows, *self.comm.op_args())


@dataclass(frozen=True)
class _Record:
    name: str  # the parameter's name when it was sharded
    # A leaf's LocalShards (None for a DTensor parameter), weakly: a value reaching its own key
    # would keep the entry, the model's parameters, their mesh and its process group alive forever.
    owner: weakref.ref[LocalShards] | None


# Every DTensor parameter and leaf any backend made -> its record.
_TENSORS = WeakIdKeyDictionary()


def sharded_name(tensor: torch.Tensor) -> str | None:
    """The name of the parameter ``tensor`` (a DTensor parameter or leaf) is, or None."""
    record = _TENSORS.get(tensor)
    return record.name if record is not None else None


def leaf_owner(tensor: torch.Tensor) -> LocalShards | None:
    """The LocalShards whose forward reads ``tensor`` as a leaf, if any."""
    record = _TENSORS.get(tensor)
    return record.owner() if record is not None and record.owner is not None else None


def sharded_parameter(dtensor: torch.Tensor, fqn: str, requires_grad: bool) -> nn.Parameter:
    """The DTensor parameter that replaces the parameter named ``fqn``."""
    param = nn.Parameter(dtensor, requires_grad=requires_grad)
    _TENSORS[param] = _Record(fqn, None)
    return param


def shard_tensor(param: torch.Tensor, topology: Topology, offload: CPUOffload | None,
                 tp: TPSpec | None = None) -> tuple[torch.Tensor, bool]:
    """This rank's DTensor shard of ``param`` (with ``tp``: its TP-local tensor, the DTensor on the dp
    and tp meshes), and whether it is split on dim 0."""
    full = plain_tensor(param).detach()  # a torchao float8 weight is sharded as the tensor it wraps
    device = None if full.is_meta else current_device(topology.mesh.device_type)
    if full.dim() == 0 or topology.shard_size == 1:
        local = _place(full.clone(), offload, device)
        if tp is not None:
            return _tp_dtensor(local, topology, tp, False), False
        replicated = tuple(Replicate() for _ in topology.placements)  # a 0-d tensor, or a shard group of one
        return DTensor.from_local(local, topology.mesh, replicated, run_check=False), False
    rows = full.shape[0]
    chunk = padded_rows(rows, topology.shard_size)
    start, length = shard_bounds(rows, topology.shard_size, topology.shard_rank)
    storage = full.new_zeros((chunk, *full.shape[1:]))
    storage[:length].copy_(full[start:start + length])
    local = _place(storage, offload, device)[:length]
    if tp is not None:
        return _tp_dtensor(local, topology, tp, True), True
    return DTensor.from_local(local, topology.mesh, topology.placements, run_check=False, shape=full.shape,
                              stride=full.stride()), True


def _tp_dtensor(local: torch.Tensor, topology: Topology, tp: TPSpec, dim0_sharded: bool) -> DTensor:
    mesh, placements = combined_layout(topology, tp, dim0_sharded)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=tp.shape, stride=tp.stride)


def _place(storage: torch.Tensor, offload: CPUOffload | None, device: torch.device | None = None) -> torch.Tensor:
    """Host memory under ``offload`` (pinned where asked and possible), else ``device`` (None: in place)."""
    if offload is not None:
        storage = storage.to("cpu")
        return storage.pin_memory() if offload.pin_memory and offload_pins_memory() else storage
    return storage if device is None else storage.to(device)


def offload_pins_memory() -> bool:
    """Whether pinning is possible here: it needs an accelerator runtime."""
    return torch.cuda.is_available()


class ShardedParam:
    """A DTensor parameter and its forward leaf, whose gradient a hook moves into ``param.grad``."""

    __slots__ = ("__weakref__", "fqn", "hooked", "leaf", "local", "owner", "param")

    def __init__(self, fqn: str, param: nn.Parameter, owner: LocalShards) -> None:
        self.fqn = fqn
        self.owner = owner
        self.param = param
        self.local = param._local_tensor
        self.leaf = self._make_leaf()

    def _make_leaf(self) -> nn.Parameter:
        # nn.Parameter: Dynamo and AOTAutograd treat it as a static input, as they did the DTensor.
        leaf = nn.Parameter(self.local.detach(), requires_grad=False)
        _TENSORS[leaf] = _Record(self.fqn, weakref.ref(self.owner))
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
        """Make the leaf follow the parameter again; True if the leaf changed (graphs must retrace)."""
        if self.param._local_tensor is not self.local:  # new storage (``param.data = ...``)
            self.local = self.param._local_tensor
            self.leaf = self._make_leaf()
            return True
        if self.leaf.requires_grad is not self.param.requires_grad:
            self._follow(self.leaf)
            return True
        return False


def _grad_mover(shard: ShardedParam) -> Callable[[torch.Tensor], None]:
    """The leaf's post-accumulate-grad hook, holding its ShardedParam weakly: hooks live in C++, out of
    the collector's sight, so a strong one would keep the parameters, mesh and gloo group alive."""
    ref = weakref.ref(shard)

    def move(leaf: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive.move_grad(leaf)
    return move


@dataclass
class _Registration:
    """One name a sharded parameter is registered under: where to look for replacements."""

    parameters: dict  # the owning module's _parameters
    name: str
    fqn: str
    param: nn.Parameter


class LocalShards:
    """The leaves standing for one model's sharded parameters in its forward, and that forward's state.

    Leaves, not DTensors: a DTensor input costs Dynamo guards and AOTAutograd a subclass to flatten
    (over twice a deep model's compile time). Tied parameters are gathered once per forward at the
    root (a first read in a checkpointed region would mutate outside state), their gradients summed."""

    def __init__(self, sync: GradientSync | None = None) -> None:
        self.sync = sync
        self.shards: list[ShardedParam] = []
        self.registrations: list[_Registration] = []
        self.leaves: dict[str, nn.Parameter] = {}  # what the graphs read (the dict is kept, entries replaced)
        self.shared: list[tuple[str, tuple]] = []  # tied parameters: (fqn, marker arguments)
        self.read_args: dict[str, tuple] = {}  # fqn -> the marker's arguments after the tensor
        # Set by the root's forward for its duration (read once per forward, one guard under Dynamo).
        self.in_forward = False
        self.accumulating = False
        self.shared_gathered: dict[str, torch.Tensor] | None = None
        self.plain_reads = False  # in_forward, traced, not accumulating, no tied parameters
        # Reads that run as Python in this forward (sharded_class.eager_read): gathered ahead, and done.
        self.prefetched: dict[str, torch.Tensor] = {}
        self.read_in_forward: set[str] = set()
        self.mirrors: dict[str, list[tuple[dict, str]]] = {}  # fqn -> other (dict, key) holding its leaf
        self._snapshot: tuple[list, ...] | None = None  # what _unchanged compares, in parallel lists

    @property
    def tied(self) -> set[str]:
        return {fqn for fqn, _ in self.shared}

    def add(self, fqn: str, param: nn.Parameter, read_args: tuple | None = None) -> None:
        """Stand ``param`` in for ``fqn``; ``read_args``: its marker's arguments after the tensor."""
        if read_args is not None:
            self.read_args[fqn] = read_args
        shard = ShardedParam(fqn, param, self)
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
        """Bring every leaf in line with its parameter; returns ``{id(old leaf): new leaf}``. Raises if a
        sharded parameter was replaced by another tensor (its leaf would read the old values)."""
        if self._unchanged():
            return {}
        for reg in self.registrations:
            current = reg.parameters.get(reg.name)
            if current is not reg.param:
                what = ("None" if current is None else "another DTensor" if isinstance(current, DTensor)
                        else "a plain tensor")
                raise RuntimeError(f"parameter {reg.fqn!r} was replaced by {what} after the model was sharded; load "
                                   "new values with load_state_dict() or copy_() into the existing parameter")
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
        # Runs before every graph call: map over parallel lists is a few times faster than a loop.
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
