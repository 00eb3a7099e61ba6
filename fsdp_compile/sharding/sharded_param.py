"""One sharded parameter: the tensors it is made of, and the map from those tensors to its name.

[Note: sharded tensors]
Sharding turns each parameter into the tensors below; the rest of the package uses these names
for them and does not define them again.

* DTensor parameter: the ``nn.Parameter`` wrapping a DTensor (:func:`shard_tensor`,
  :func:`sharded_parameter`) that replaces the original in ``module._parameters``. What
  ``model.parameters()``, ``state_dict()``, an optimizer, ``clip_grad_norm_`` and distributed
  checkpoints see, and where gradients end up (``.grad``, a DTensor too). Sharded on dim 0 over
  the shard group; replicated for NO_SHARD and for 0-d tensors.
* Local shard: the DTensor parameter's ``_local_tensor``, this rank's rows. Stored padded to an
  equal chunk, as FSDP2 stores it, so every rank's copy-in reads the same size; the local shard
  is the view of its first rows. In host memory under CPU offload.
* Leaf: a plain ``nn.Parameter`` sharing the local shard's storage (:class:`ShardedParam`), an
  autograd leaf of its own. It stands for the parameter in forward: the reads pass it to the
  unshard marker, and Dynamo sees it as a graph input (a static input, as a parameter is). Its
  gradient goes into the DTensor parameter's ``.grad``. Why the graphs do not read the DTensor
  parameter itself: :class:`~.local_shards.LocalShards`.
* Gathered parameter: the full tensor that ``module.<name>`` returns in forward,
  ``unshard(leaf, ...)`` (see :mod:`.sharded_class`): every rank's local shard all-gathered, in
  the mixed-precision parameter dtype if there is one. Backward reduces its gradient into the
  leaf's (under ``no_sync`` it accumulates unreduced instead: :mod:`.grad_sync`).

An optimizer step on the DTensor parameter, a ``copy_`` into it or a checkpoint load writes the
local shard's storage, which the leaf shares: the next forward sees it without a copy.

Names: the graphs' inputs are leaves, whose Dynamo sources name nothing a user recognizes, so
errors look their parameter's name up here. One weak map from tensor (DTensor parameter or leaf)
to its record, rather than attributes on the tensors: those travel with a copy (``torch.save``
pickles a parameter's attributes, ``copy.deepcopy`` a tensor's), and the copy is no sharded
parameter. Looked up when a graph is compiled, never per read.
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
    """The name of the parameter that ``tensor`` (a DTensor parameter or a leaf) is, or None if
    no backend sharded it."""
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
    """This rank's DTensor shard of ``param``, and whether it is split on dim 0.

    With ``tp`` (``param`` is then its TP-local tensor), the shard is a DTensor on the dp and tp
    meshes together (:mod:`.tensor_parallel`)."""
    full = plain_tensor(param).detach()  # a torchao float8 weight is sharded as the tensor it wraps
    device = None if full.is_meta else current_device(topology.mesh.device_type)
    if full.dim() == 0 or topology.shard_size == 1:
        local = _place(full.clone(), offload, device)
        if tp is not None:
            mesh, placements = combined_layout(topology, tp, dim0_sharded=False)
            return DTensor.from_local(local, mesh, placements, run_check=False,
                                      shape=tp.shape, stride=tp.stride), False
        return DTensor.from_local(local, topology.mesh, topology.replicated_placements(),
                                  run_check=False), False
    rows = full.shape[0]
    chunk = padded_rows(rows, topology.shard_size)
    start, length = shard_bounds(rows, topology.shard_size, topology.shard_rank)
    storage = full.new_zeros((chunk, *full.shape[1:]))
    storage[:length].copy_(full[start:start + length])
    local = _place(storage, offload, device)[:length]
    if tp is not None:
        mesh, placements = combined_layout(topology, tp, dim0_sharded=True)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=tp.shape, stride=tp.stride), True
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


def offload_pins_memory() -> bool:
    """Whether pinning is possible here: it needs an accelerator runtime."""
    return torch.cuda.is_available()


class ShardedParam:
    """One DTensor parameter and the leaf that stands for it in forward, kept in line.

    Gradients accumulate into ``leaf.grad`` and a hook moves them into ``param.grad`` as a
    DTensor, as FSDP2 moves its reduced shards into the sharded parameters' ``.grad``.
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
    """The leaf's post-accumulate-grad hook, holding its ShardedParam weakly.

    The leaf keeps its hooks in C++, where the garbage collector cannot see them: a hook that
    held the ShardedParam strongly (a bound method) would close a cycle leaf -> hook -> shard ->
    leaf that is never collected, keeping the DTensor parameters, their mesh and its gloo process
    group (and that group's threads, which then race interpreter shutdown) alive.
    """
    ref = weakref.ref(shard)

    def move(leaf: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive.move_grad(leaf)
    return move
