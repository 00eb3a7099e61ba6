"""What a sharded module knows about its parameters: one :class:`ModuleState` per module.

Every module that holds sharded parameters (and the root, and every unit compiled as a region)
carries its state in one instance attribute, ``module._fsdp_state``, because the reads that use
it are traced: an instance attribute costs Dynamo one attribute load and one type guard, and
its source lies below the module's, so a region's trace of one block replays for the next.
FSDP2's map keyed by module (read by its hooks outside the graph) would give sources that do
not move from block to block. Nothing of an instance lives in the generated classes, which all
instances of a class with the same parameter names and role share (a pitfall of SimpleFSDP).

Shared by reference: the model's :class:`~.local_shards.LocalShards`, the backend's
:class:`~.grad_sync.GradientSync`, a region unit's :class:`~.compile_regions.RegionClass`. The
only registry is for tensors, not modules: :mod:`.sharded_param`'s weak map to their names.
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

# Read as the literal ``self._fsdp_state`` in traced code: the cheapest load for Dynamo.
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
    # local parameter name -> its TP spec, for tensor-parallel parameters.
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
