"""Parameters that are already tensor-parallel DTensors: FSDP over the dp part of a 2-D mesh.

Such a parameter is sharded over dp through its TP-local tensor; the read rebuilds the tp DTensor
(with the global shape: unequal TP shards would be misread), so TP's ops are torch's own. The
DTensor parameter has FSDP2's placements on the dp and tp meshes, so checkpoints read as FSDP2 + TP's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .groups import Topology


@dataclass(frozen=True, eq=False)
class TPSpec:
    """How a gathered TP-local tensor becomes the tp DTensor the module computes with."""

    mesh: DeviceMesh  # the tp mesh the parameter was on
    placements: tuple[Placement, ...]  # its TP placements
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]  # the global stride


def as_tp_dtensor(gathered: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The TP DTensor the module reads, from the TP-local tensor the markers gathered."""
    return DTensor.from_local(gathered, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


def tp_spec(fqn: str, param: DTensor, topology: Topology, mesh_given: bool) -> TPSpec:
    """The TP spec of DTensor parameter ``fqn``; raises naming it when it cannot be sharded over dp."""
    tp_mesh = param.device_mesh
    placements = tuple(param.placements)
    names = tp_mesh.mesh_dim_names or ()
    if not mesh_given:
        raise ValueError(f"parameter {fqn!r} is a DTensor on the mesh {names or tp_mesh} (placements {placements}), "
                         "so its data-parallel mesh must be given: build one mesh, e.g. init_device_mesh(device, "
                         "(dp, tp), mesh_dim_names=('dp', 'tp')), apply TP on mesh['tp'] and pass "
                         "fsdp_compile.backend(strategy, mesh=mesh['dp'])")
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise ValueError(f"parameter {fqn!r} has the placement {placement!r} on {names}: fsdp_compile shards "
                             "parameters whose placements on the tp mesh are Shard(d) or Replicate() (what "
                             "ColwiseParallel, RowwiseParallel and SequenceParallel give); a Partial or strided "
                             "parameter has no value of its own to shard. Redistribute it first "
                             "(param.redistribute(mesh, [Replicate()]))")
    if len(placements) != tp_mesh.ndim:
        raise ValueError(f"parameter {fqn!r}: {len(placements)} placements for a {tp_mesh.ndim}-D mesh")
    try:
        DeviceMesh._concatenate([topology.mesh, tp_mesh])
    except RuntimeError as exc:
        dp_names = topology.mesh.mesh_dim_names
        if "different device mesh" in str(exc):
            why = (f"mesh= (dims {dp_names}) and the mesh this parameter lives on (dims {names}) "
                   "were not sliced from one DeviceMesh")
        else:
            why = (f"mesh= (dims {dp_names}) overlaps the mesh this parameter lives on (dims {names}): "
                   "mesh= must be the data-parallel part of the mesh, the TP plan its other part")
        raise ValueError(f"parameter {fqn!r} cannot be sharded over mesh=: {why}. Build one mesh, e.g. "
                         "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply TP on mesh['tp'] "
                         "and pass mesh=mesh['dp']") from None
    return TPSpec(tp_mesh, placements, param.shape, param.stride())


def tp_local(full: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's TP-local view of a whole value, as ``distribute_tensor`` cuts it (meta-device init)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        if size != full.shape[dim]:
            local = local.narrow(dim, start, size)
    return local


def combined_layout(topology: Topology, spec: TPSpec, dim0_sharded: bool) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The dp + tp mesh and placements of the DTensor parameter, as FSDP2 gives them."""
    mesh = DeviceMesh._concatenate([topology.mesh, spec.mesh])
    split = 1
    for dim, placement in enumerate(spec.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            split *= spec.mesh.size(dim)
    dp: list[Placement] = []
    for placement in topology.placements:
        if isinstance(placement, Shard) and dim0_sharded:
            # Where TP split dim 0 first, a dp rank's global rows are strided: _StridedShard.
            dp.append(_StridedShard(0, split_factor=split) if split > 1 else Shard(0))
        else:
            dp.append(Replicate())
    return mesh, (*dp, *spec.placements)
