"""One sharded parameter: the tensors it is made of, and the map from those tensors to its name.

[Note: sharded tensors]
Sharding turns each parameter into these tensors; the package uses these names for them:

* DTensor parameter: the ``nn.Parameter`` wrapping a DTensor (:func:`shard_tensor`) that replaces
  the original in ``module._parameters``: what ``parameters()``, ``state_dict()``, optimizers,
  ``clip_grad_norm_`` and checkpoints see, and where gradients end up. Sharded on dim 0 over
  the shard group; replicated for NO_SHARD and 0-d tensors.
* Local shard: its ``_local_tensor``, this rank's rows, stored padded to an equal chunk as FSDP2
  stores it (every rank's copy-in reads the same size). In host memory under CPU offload.
* Leaf: a plain ``nn.Parameter`` sharing the local shard's storage (:class:`ShardedParam`),
  an autograd leaf of its own that stands for the parameter in forward: the reads pass it to
  the unshard marker. Its gradient goes into the DTensor parameter's ``.grad``. Why graphs do
  not read the DTensor: :class:`~.local_shards.LocalShards`.
* Gathered parameter: the full tensor ``module.<name>`` returns in forward, ``unshard(leaf,
  ...)`` (:mod:`.sharded_class`), in the mixed-precision dtype if any.

An optimizer step, a ``copy_`` or a checkpoint load writes the local shard's storage, which the
leaf shares: the next forward sees it without a copy.

Names: errors name a graph input's parameter through one weak map from tensor to record, not
attributes on the tensors, which travel with a copy (``torch.save``, ``copy.deepcopy``) that is
no sharded parameter. Looked up when a graph is compiled, never per read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from ..api import CPUOffload
from ..runtime.collectives import CommSpec, padded_rows, shard_bounds
from .float8_gather import plain_tensor
from .grad_sync import add_local_grad
from .groups import Topology, current_device
from .tensor_parallel import TPSpec, combined_layout

if TYPE_CHECKING:
    from collections.abc import Callable

    from .local_shards import LocalShards


@dataclass(frozen=True)
class ShardedParamInfo:
    """What a read of one sharded parameter needs to become its gathered parameter."""

    fqn: str
    unit: str  # the bucket unit (module name; "" is the root)
    # What the markers gather: the full parameter, or for a tensor-parallel parameter its
    # TP-local tensor (``tp.shape`` is then the global shape).
    full_shape: tuple[int, ...]
    comm: CommSpec
    tp: TPSpec | None = None

    @property
    def unshard_args(self) -> tuple:
        full_rows = self.full_shape[0] if self.full_shape else 0
        return (self.fqn, self.unit, full_rows, *self.comm.op_args())


@dataclass(frozen=True)
class _Record:
    name: str  # the parameter's name when it was sharded
    # A leaf's LocalShards, weakly: it holds the leaf, and a value that reaches its own key keeps
    # the entry, the model's parameters, their device mesh and its process group alive forever.
    # None for a DTensor parameter.
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
    """This rank's DTensor shard of ``param``, and whether it is split on dim 0. With ``tp``
    (``param`` is its TP-local tensor) the DTensor is on the dp and tp meshes together."""
    full = plain_tensor(param).detach()  # a torchao float8 weight is sharded as the tensor it wraps
    device = None if full.is_meta else current_device(topology.mesh.device_type)
    if full.dim() == 0 or topology.shard_size == 1:
        local = _place(full.clone(), offload, device)
        if tp is not None:
            return _tp_dtensor(local, topology, tp, False), False
        return DTensor.from_local(local, topology.mesh, topology.replicated_placements(), run_check=False), False
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
    """Where a shard lives: host memory under ``offload`` (pinned where asked and possible), else
    ``device``, the mesh's (None: where it is), as FSDP2 moves a module's states to its mesh's."""
    if offload is not None:
        storage = storage.to("cpu")
        return storage.pin_memory() if offload.pin_memory and offload_pins_memory() else storage
    return storage if device is None else storage.to(device)


def offload_pins_memory() -> bool:
    """Whether pinning is possible here: it needs an accelerator runtime."""
    return torch.cuda.is_available()


class ShardedParam:
    """One DTensor parameter and the leaf that stands for it in forward, kept in line; a hook
    moves ``leaf.grad`` into ``param.grad`` as a DTensor, as FSDP2 moves its reduced shards."""

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


def _grad_mover(shard: ShardedParam) -> Callable[[torch.Tensor], None]:
    """The leaf's post-accumulate-grad hook, holding its ShardedParam weakly: the leaf keeps hooks
    in C++, out of the garbage collector's sight, so a strong hook would close a cycle that
    keeps the parameters, their mesh and its gloo group (whose threads race shutdown) alive."""
    ref = weakref.ref(shard)

    def move(leaf: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive.move_grad(leaf)
    return move
