"""Parameters that are already tensor-parallel DTensors: FSDP over the dp part of a 2-D mesh.

A model parallelized with torch's ``parallelize_module`` on ``mesh["tp"]`` holds DTensor
parameters on the tp mesh. Sharding one of them over dp works on its *TP-local* tensor, exactly
as a plain parameter is sharded today: chunks of dim 0 over the shard group, padded to the first
chunk. The markers gather and reduce that TP-local tensor over the dp groups only, and the read
that ``forward`` sees rebuilds the tp DTensor (``DTensor.from_local`` on the tp mesh, with the
parameter's TP placements), so the DTensor operations of the TP plan, and the collectives they
issue, are torch's own.

The DTensor parameter users and optimizers see lives on the concatenation of the dp mesh and the
tp mesh, with FSDP2's placements (``_fsdp_param.py::_init_sharding_spec_tp``): ``_StridedShard(0,
split_factor=tp)`` on the shard dimension where TP also splits dim 0 (the dp chunk is taken of
the TP-local rows, so the global rows interleave), ``Shard(0)`` where it does not, ``Replicate()``
under NO_SHARD, followed by the TP placements. ``full_tensor()``, ``state_dict()`` and
distributed checkpoints read that layout as FSDP2 + TP writes it.

TP shards of unequal size (a dimension the tp size does not divide: 7 rows over tp 2 give
TP-local tensors of 4 and 3 rows) are sharded the same way, as FSDP2 shards them: each tp rank's
dp group chunks its own TP-local rows (2 + 2, and 2 + 1 padded to 2), and the rebuilt tp DTensor
carries the global shape explicitly, since ``from_local`` would otherwise take it for tp x the
local one.
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
    """Check that ``param`` (a DTensor parameter named ``fqn``) can be sharded over
    ``topology``'s dp mesh, and return its TP spec; raises naming the parameter otherwise."""
    tp_mesh = param.device_mesh
    placements = tuple(param.placements)
    names = tp_mesh.mesh_dim_names or ()
    if not mesh_given:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on the mesh {names or tp_mesh} (placements {placements}), "
            "so its data-parallel mesh must be given: build one mesh, e.g. init_device_mesh(device, "
            "(dp, tp), mesh_dim_names=('dp', 'tp')), apply TP on mesh['tp'] and pass "
            "fsdp_compile.backend(strategy, mesh=mesh['dp'])"
        )
    for placement in placements:
        if not isinstance(placement, (Shard, Replicate)):
            raise ValueError(
                f"parameter {fqn!r} has the placement {placement!r} on {names}: fsdp_compile shards "
                "parameters whose placements on the tp mesh are Shard(d) or Replicate() (what "
                "ColwiseParallel, RowwiseParallel and SequenceParallel give); a Partial or strided "
                "parameter has no value of its own to shard. Redistribute it first "
                "(param.redistribute(mesh, [Replicate()]))"
            )
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
        raise ValueError(
            f"parameter {fqn!r} cannot be sharded over mesh=: {why}. Build one mesh, e.g. "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply TP on mesh['tp'] "
            "and pass mesh=mesh['dp']"
        ) from None
    return TPSpec(tp_mesh, placements, param.shape, param.stride())


def tp_local(full: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """This rank's TP-local part of ``full``, a parameter's whole value (a meta-device model
    initialized whole): the rows and columns its TP placements give it, as ``distribute_tensor``
    cuts them. A view of ``full``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        if size != full.shape[dim]:
            local = local.narrow(dim, start, size)
    return local


def combined_layout(topology: Topology, spec: TPSpec, dim0_sharded: bool) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The 2-D (or 3-D for hybrid) mesh and placements of the DTensor parameter, as FSDP2 gives them."""
    mesh = DeviceMesh._concatenate([topology.mesh, spec.mesh])
    split = 1
    for dim, placement in enumerate(spec.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            split *= spec.mesh.size(dim)
    dp: list[Placement] = []
    for placement in topology.placements:
        if isinstance(placement, Shard) and dim0_sharded:
            # The dp chunk is taken of the TP-local rows: where TP split dim 0 first, the global
            # rows a dp rank holds are strided, which only _StridedShard describes.
            dp.append(_StridedShard(0, split_factor=split) if split > 1 else Shard(0))
        else:
            dp.append(Replicate())
    return mesh, (*dp, *spec.placements)
