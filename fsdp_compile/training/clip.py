"""Gradient clipping by the global norm over every rank's shards."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def clip_grad_norm_(parameters: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so their global ``norm_type`` norm is at most ``max_norm``.

    Same contract as ``torch.nn.utils.clip_grad_norm_`` (returns the total norm before clipping,
    equal on every rank), for sharded gradients: only the mesh dimensions a gradient is sharded
    on are summed across ranks (replicas must not count twice); one all-reduce per layout.
    """
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a positive number")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or math.isnan(norm_type):
        raise ValueError(f"norm_type={norm_type!r} must be positive or inf")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = _local(grads[0]).device
    infinite = math.isinf(norm_type)
    combine = torch.maximum if infinite else torch.add  # how per-gradient parts make the total
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        part = (torch.linalg.vector_norm(local.float(), norm_type) if local.numel()
                else torch.zeros((), device=device))
        if not infinite:
            part = part ** norm_type
        dims = _sharded_mesh_dims(grad)
        if dims:
            groups.setdefault(dims, []).append(part)
        else:
            replicated = combine(replicated, part)
    roots = {mesh._get_root_mesh() for mesh, _ in groups}
    if len(roots) > 1:
        raise ValueError("gradients are sharded over meshes that were not sliced from one DeviceMesh "
                         f"({[dims for _, dims in groups]}); clip each model's parameters separately")
    # One sum per (mesh, sharded dims): under tensor parallelism a parameter may be split on dp
    # and tp, dp only or tp only; each is summed over exactly the dims that split it.
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    sharded = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, mesh_dims), parts in groups.items():
        part = functools.reduce(combine, parts, torch.zeros((), dtype=torch.float32, device=device))
        for dim in mesh_dims:
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        sharded = combine(sharded, part)
    total = torch.maximum(sharded, replicated) if infinite else (sharded + replicated) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [_local(g) for g in grads]
    torch._foreach_mul_(locals_, coefficient.to(locals_[0].device))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sharded_mesh_dims(t: torch.Tensor) -> tuple | None:
    if not isinstance(t, DTensor):
        return None
    dims = tuple(i for i, p in enumerate(t.placements) if isinstance(p, (Shard, _StridedShard)))
    return (t.device_mesh, dims) if dims else None
