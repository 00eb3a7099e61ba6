"""Resolve a strategy plus the user's mesh / process-group arguments into one data-parallel layout.

Every sharded parameter is a DTensor on ``Topology.mesh``; the markers in the graph name the
groups by their registered names so the functional collectives can find them.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from ..api import ShardingStrategy

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class Topology:
    """Where a strategy's collectives run, as seen from this rank: ``shard_group`` gathers and
    reduce-scatters (None under NO_SHARD), ``replicate_group`` all-reduces across replicas."""

    strategy: ShardingStrategy
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shard_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_group is None else self.shard_group.size()

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard_group is None else self.shard_group.rank()

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else self.replicate_group.size()

    @property
    def shard_group_name(self) -> str:
        return "" if self.shard_group is None else self.shard_group.group_name

    @property
    def replicate_group_name(self) -> str:
        return "" if self.replicate_group is None else self.replicate_group.group_name

    def group_roles(self) -> dict[str, str]:
        """Process-group name -> its role, which cross-rank checks compare (groups differ per rank)."""
        return {self.shard_group_name: f"shard group ({self.shard_size} ranks)",
                self.replicate_group_name: f"replicate group ({self.replicate_size} ranks)"}


def world_timeout() -> datetime.timedelta:
    """The default group's timeout (its own, else its backend's), so groups we create fail as fast."""
    own = getattr(dist.group.WORLD, "timeout", None)
    if isinstance(own, datetime.timedelta):
        return own
    try:
        backend = dist.group.WORLD._get_backend(torch.device(_default_device_type()))
        return backend.options._timeout
    except Exception:  # not every backend exposes its options; fall back to torch's default
        return _DEFAULT_TIMEOUT


def end_process_group(*, exit_process: bool = False) -> None:
    """Wait for every rank (``monitored_barrier()`` on gloo, whose ``barrier()`` keeps collectives
    alive), then destroy the default process group. ``exit_process=True`` then exits (status 0)
    without finalizing: a gloo group still referenced outlives ``destroy_process_group()``, and its
    thread can abort finalization (pytorch/pytorch#190489)."""
    if dist.is_initialized():
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=world_timeout())
            elif _own_monitored_barrier(dist.group.WORLD):
                dist.group.WORLD.monitored_barrier(world_timeout())
            else:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    if exit_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _own_monitored_barrier(group: Any) -> bool:
    """Whether ``group``'s class has its own monitored barrier (a Python group, as the emulated network's)."""
    return type(group).monitored_barrier is not dist.ProcessGroup.monitored_barrier


def current_device(device_type: str) -> torch.device:
    """This rank's device of ``device_type``: the current accelerator, or the CPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _default_device_type() -> str:
    return "cuda" if "nccl" in dist.get_backend() else "cpu"


def group_device_type() -> str:
    """The device the default process group communicates on ("cuda" for NCCL, else "cpu")."""
    _require_initialized()
    return _default_device_type()


def _require_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fsdp_compile needs torch.distributed: call torch.distributed.init_process_group() "
                           "first (torchrun sets up the environment for it), also for a single process")


def resolve_topology(strategy: ShardingStrategy, device_type: str, *, mesh: DeviceMesh | None = None,
                     process_groups: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
                     shard_size: int | None = None, timeout: datetime.timedelta | None = None) -> Topology:
    """The layout for ``strategy`` from at most one of ``mesh`` / ``process_groups`` (validated options)."""
    _require_initialized()  # the options themselves were checked by BackendOptions.validate
    timeout = timeout or world_timeout()
    if strategy.is_hybrid:
        mesh = _hybrid_mesh(device_type, mesh, process_groups, shard_size, timeout)
        return Topology(strategy, mesh, (Replicate(), Shard(0)), shard_group=mesh.get_group(1),
                        replicate_group=mesh.get_group(0))
    mesh = _flat_mesh(strategy, device_type, mesh, process_groups)
    group = mesh.get_group(0)
    if strategy is ShardingStrategy.NO_SHARD:
        return Topology(strategy, mesh, (Replicate(),), shard_group=None, replicate_group=group)
    return Topology(strategy, mesh, (Shard(0),), shard_group=group, replicate_group=None)


def _flat_mesh(strategy: ShardingStrategy, device_type: str, mesh: DeviceMesh | None,
               process_groups: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None) -> DeviceMesh:
    dim_name = "replicate" if strategy is ShardingStrategy.NO_SHARD else "shard"
    if mesh is not None:
        _check_mesh_device(mesh, device_type)
        if mesh.ndim != 1:
            raise ValueError(f"{strategy.name} takes a 1-D mesh, got a {mesh.ndim}-D mesh; use HYBRID_SHARD "
                             "or HYBRID_SHARD_ZERO2 for a 2-D (replicate, shard) mesh")
        return mesh
    if process_groups is None:
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=(dim_name,))
    if isinstance(process_groups, (tuple, list)):
        if len(process_groups) != 1:
            raise ValueError(f"{strategy.name} takes one process group (process_groups=pg); a "
                             "(shard_pg, replicate_pg) pair is for HYBRID_SHARD / HYBRID_SHARD_ZERO2")
        (process_groups,) = process_groups
    if not isinstance(process_groups, dist.ProcessGroup):
        raise TypeError(f"process_groups= must be a ProcessGroup, got {type(process_groups).__name__}")
    return DeviceMesh.from_group(process_groups, device_type, mesh_dim_names=(dim_name,))


def _check_mesh_device(mesh: DeviceMesh, device_type: str) -> None:
    if mesh.device_type != device_type:
        raise ValueError(f"mesh= is a {mesh.device_type!r} mesh but the model's parameters are on "
                         f"{device_type!r}; build the mesh with device_type={device_type!r}")


def _hybrid_mesh(device_type: str, mesh: DeviceMesh | None, process_groups: Sequence[dist.ProcessGroup] | None,
                 shard_size: int | None, timeout: datetime.timedelta) -> DeviceMesh:
    names = ("replicate", "shard")
    if mesh is not None:
        _check_mesh_device(mesh, device_type)
        if mesh.ndim != 2:
            raise ValueError(f"hybrid sharding takes a 2-D mesh with dims (replicate, shard); got a {mesh.ndim}-D mesh")
        return mesh
    if process_groups is not None:
        if not (isinstance(process_groups, (tuple, list)) and len(process_groups) == 2):
            raise ValueError("hybrid sharding takes process_groups=(shard_pg, replicate_pg), a pair of ProcessGroups")
        shard_pg, replicate_pg = process_groups
        layout = _layout_from_groups(shard_pg, replicate_pg)
        return DeviceMesh.from_group([replicate_pg, shard_pg], device_type, mesh=layout, mesh_dim_names=names)
    world = dist.get_world_size()
    if shard_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("hybrid sharding needs the size of a shard group (a node): set LOCAL_WORLD_SIZE "
                             "(torchrun does), or pass shard_size=, mesh= or process_groups=")
        shard_size = int(env)
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size= must be a positive int, got {shard_size!r}")
    if world % shard_size:
        raise ValueError(f"shard_size={shard_size} does not divide the world size {world}: hybrid sharding "
                         "needs equal shard groups; pass a shard_size that divides it")
    layout = torch.arange(world).view(world // shard_size, shard_size)
    shard_pg, replicate_pg = new_groups(layout.tolist(), timeout), new_groups(layout.t().tolist(), timeout)
    return DeviceMesh.from_group([replicate_pg, shard_pg], device_type, mesh=layout, mesh_dim_names=names)


def new_groups(rank_lists: list[list[int]], timeout: Any) -> dist.ProcessGroup | None:
    """Create a group of each rank list, as every rank must (``new_group`` is collective); returns this rank's."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _layout_from_groups(shard_pg: dist.ProcessGroup, replicate_pg: dist.ProcessGroup) -> torch.Tensor:
    """The (replicate, shard) layout the groups describe; collective, so all ranks fail together."""
    for label, pg in (("shard_pg", shard_pg), ("replicate_pg", replicate_pg)):
        if not isinstance(pg, dist.ProcessGroup):
            raise TypeError(f"process_groups=(shard_pg, replicate_pg): {label} must be a ProcessGroup, "
                            f"got {type(pg).__name__}")
    world = dist.get_world_size()
    mine = (tuple(dist.get_process_group_ranks(shard_pg)), tuple(dist.get_process_group_ranks(replicate_pg)))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    shard_groups = sorted({tuple(sorted(s)) for s, _ in everyone})
    replicate_groups = {tuple(sorted(r)) for _, r in everyone}

    def tiles(groups: set | list, label: str) -> int:
        sizes = {len(g) for g in groups}
        members = sorted(r for g in groups for r in g)
        if members != list(range(world)) or len(sizes) != 1:
            raise ValueError(f"process_groups: the {label} groups {sorted(groups)} do not tile the world of {world} "
                             f"ranks; every rank must be in exactly one {label} group and all {label} groups must "
                             "have the same size")
        return sizes.pop()

    s = tiles(shard_groups, "shard")
    r = tiles(replicate_groups, "replicate")
    if r * s != world:
        raise ValueError(f"process_groups: shard groups of {s} and replicate groups of {r} ranks do not make a "
                         f"world of {world} ranks (need shard size x replicate size = world size)")
    replicate_of = {rank: tuple(sorted(rg)) for _, rg in everyone for rank in rg}
    columns = [replicate_of[rank] for rank in shard_groups[0]]
    for group in shard_groups:
        for column in columns:
            if len(common := set(group) & set(column)) != 1:
                raise ValueError(f"process_groups: shard group {list(group)} and replicate group {list(column)} "
                                 f"share {len(common)} ranks; each replicate group must hold exactly one rank of "
                                 "each shard group")
    return torch.tensor([[(set(group) & set(column)).pop() for column in columns] for group in shard_groups])
