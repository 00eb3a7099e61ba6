"""What a sharded module knows about its parameters: one :class:`ModuleState` per module.

Every module that holds sharded parameters (and the root, and every unit compiled as a region)
carries its state in one instance attribute, ``module._fsdp_state``, reached from the module and
nowhere else, because the reads that use it are traced:

* ``module.<name>`` (see :mod:`.sharded_class`) runs inside every forward Dynamo traces, once per
  parameter read. An instance attribute costs Dynamo one attribute load and one type guard, and
  its source lies below the module's. FSDP2 keeps its states in a map keyed by module
  (``torch.distributed._composable_state``), which its hooks read outside the graph; a read
  through such a global would give Dynamo sources that do not move from one block to the next,
  and a compile region's trace of one block could not be replayed for the others (see
  :mod:`.regions`: the replay moves every source below ``self`` to the next block).
* Per instance, on the instance: the generated classes are shared by all instances of a class
  with the same parameter names and role (the root, a module inside a region), and a region's
  replay guards on each module's class, so nothing about one instance may live in the class, a
  pitfall seen in SimpleFSDP.

Shared by reference: the model's :class:`~.local_shards.LocalShards` (its leaves, and the
per-forward state the root's forward sets), the backend's :class:`~.grad_sync.GradientSync`, and
a region unit's :class:`~.regions.RegionClass` switch. The module's own: its parameters' specs,
the precomputed reads (one tuple of marker arguments per name: one guard per read), the
:class:`~.regions.RegionReads` of a module inside a region, the root's mixed precision policy and,
in a model with regions, the root's :class:`~.region_fallback.ModelRegions`.

One registry remains, for tensors rather than modules: the weak map in :mod:`.sharded_param`
from DTensor parameters and leaves to their names, which the compiler needs about a graph's
inputs (it sees tensors, not modules). The cache of generated classes in :mod:`.sharded_class`
holds code, nothing of any instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..api import MixedPrecision
from .compile_regions import RegionClass, RegionReads
from .grad_sync import GradientSync
from .local_shards import LocalShards
from .region_fallback import ModelRegions
from .sharded_param import ShardedParamInfo
from .tensor_parallel import TPSpec

# Read as the literal ``self._fsdp_state`` in traced code (sharded_class.py, regions.py): a plain
# attribute load is what Dynamo traces cheapest.
STATE_ATTR = "_fsdp_state"


@dataclass(eq=False)
class ModuleState:
    """One sharded module's state: ``module._fsdp_state``."""

    specs: dict[str, ShardedParamInfo]  # local parameter name -> its spec
    shards: LocalShards  # the model's, shared by all its modules
    sync: GradientSync | None  # the backend's, shared by all the models it shards
    region: RegionReads | None = None  # inside a unit compiled as a region
    mixed_precision: MixedPrecision | None = None  # the root's, when it casts inputs or the output
    region_class: RegionClass | None = None  # a unit compiled as a region: its class's switch
    regions: ModelRegions | None = None  # the root of a model with regions: their classes, the fallback
    # local parameter name -> (fqn, the unshard marker's arguments): what a read passes on.
    reads: dict[str, tuple[str, tuple]] = field(init=False)
    # local parameter name -> its TP spec, for tensor-parallel parameters (a read rebuilds the
    # tp DTensor from the gathered TP-local tensor: sharding/tensor_parallel.py).
    tp: dict[str, TPSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.reads = {name: (info.fqn, info.unshard_args) for name, info in self.specs.items()}
        self.tp = {name: info.tp for name, info in self.specs.items() if info.tp is not None}


def module_state(module: nn.Module) -> ModuleState | None:
    """``module``'s state, or None if it was not sharded."""
    return module.__dict__.get(STATE_ATTR)


def set_module_state(module: nn.Module, state: ModuleState) -> None:
    module.__dict__[STATE_ATTR] = state


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it was sharded."""
    return any(module_state(m) is not None for m in module.modules())
