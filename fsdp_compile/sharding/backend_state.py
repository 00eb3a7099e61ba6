"""What a backend's ``shard()`` calls leave for the compile pipeline to read: the compiler reads
only this, never the backend (topology, marker arguments, leaves, the cross-rank verifier)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .compile_regions import RegionFallback
from .groups import Topology
from .sharded_param import LocalShards, ShardedParamInfo
from .units import ROOT_UNIT, ReshardGroups

if TYPE_CHECKING:
    from .shard import ShardResult


class GraphCheck(Protocol):
    """The cross-rank check compiled graphs' guard calls (``checks.agreement.GraphVerifier``)."""

    calls: int  # compiled-graph runs so far: the number the next check publishes under

    def verify(self, graph: str, calls: list[Any]) -> None: ...


@dataclass
class ShardingState:
    topology: Topology | None = None  # resolved at the first shard()
    params: dict[str, ShardedParamInfo] = field(default_factory=dict)  # fqn -> what a read needs
    units: set[str] = field(default_factory=lambda: {ROOT_UNIT})  # bucket units ("" is the root)
    # One LocalShards per model sharded: the leaves each model's forward reads.
    local_shards: weakref.WeakSet[LocalShards] = field(default_factory=weakref.WeakSet)
    # {"forward" | "backward": {bucket: [buckets to gather when it starts]}}, from the options.
    explicit_prefetch: dict[str, dict[str, list[str]]] = field(default_factory=lambda: {"forward": {}, "backward": {}})
    verifier: GraphCheck | None = None  # set by the first shard() with verify=True
    # Buckets over half of a model's parameters under a resharding strategy (inspection/bucket_advice.py).
    oversized_buckets: dict[str, dict[str, Any]] = field(default_factory=dict)
    init_peak_bytes: int | None = None  # meta-device init: most full parameter bytes held
    # The region classes' switches, and the count of graph calls the fallback reads.
    region_fallback: RegionFallback = field(default_factory=RegionFallback)
    # reshard_after_forward=: each unit's ranks it reshards to, and the groups of fewer ranks it made.
    reshard_to: dict[str, int] = field(default_factory=dict)
    reshard_groups: ReshardGroups = field(default_factory=ReshardGroups)
    # memory_budget=: what the compiler chose (planning/budget.py), once it has.
    reshard_choice: Any = None
    _owned: Any = field(default_factory=WeakIdKeyDictionary)  # sharded parameter -> True

    def group_roles(self) -> dict[str, str]:
        """Process-group name -> its role, for cross-rank checks."""
        roles = self.topology.group_roles() if self.topology is not None else {}
        for n, group in self.reshard_groups.groups().items():
            roles[group.group_name] = f"reshard group ({n} ranks of the shard group)"
        for info in self.params.values():
            if info.tp is not None:
                mesh = info.tp.mesh
                for dim in range(mesh.ndim):
                    name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else str(dim)
                    roles[mesh.get_group(dim).group_name] = f"tensor-parallel group {name!r} ({mesh.size(dim)} ranks)"
        return roles

    def add_sharded(self, result: ShardResult) -> None:
        """What one ``shard()`` made: its parameters' marker arguments, units, leaves, settings."""
        self.params.update(result.infos)
        self.units.update(info.unit for info in result.infos.values())
        self.reshard_to.update(result.reshard_to or {})
        self.local_shards.add(result.shards)
        if result.peak_full_bytes is not None:
            self.init_peak_bytes = max(self.init_peak_bytes or 0, result.peak_full_bytes)

    def add_parameters(self, params: Any) -> None:
        for param in params:
            self._owned[param] = True

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a parameter this backend sharded."""
        return param in self._owned

    def sharded_parameters(self) -> list[torch.Tensor]:
        return list(self._owned.keys())
