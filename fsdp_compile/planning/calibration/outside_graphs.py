"""What a training step spends outside the compiled graphs, per sharded parameter: the optimizer step and the runtime's
work around each graph call scale with the number of tensors as much as with their bytes. Each is timed as the real
thing over DTensor shards at two sizes, and the line through both separates the cost per tensor
(``Cluster.optimizer_step``, ``runtime_per_tensor``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..vocabulary import fit_two_points
from .compute import _cold_seconds, _compute_seconds, _sync_ranks


def _sharded_params(count: int, numel: int, group: Any, device: torch.device) -> list[torch.nn.Parameter]:
    """``count`` zero parameters of ``numel`` local elements each, DTensors sharded on dim 0 over ``group`` as the
    backend's parameters are (no communication: each rank makes its own)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    return [torch.nn.Parameter(DTensor.from_local(torch.zeros(numel, device=device), mesh, [Shard(0)],
                                                  run_check=False)) for _ in range(count)]


# The two workloads each line is drawn through: many small tensors (per-tensor dispatch) and few large ones (bytes) for
# the optimizer; two parameter counts for the runtime's round trip.
_OPTIMIZER_POINTS = ((64, 1 << 10), (4, 1 << 20))
_RUNTIME_COUNTS = (8, 32)


def _optimizer_workload(optimizer: str, count: int, numel: int, group: Any,
                        device: torch.device) -> Callable[[], None]:
    """One ``optimizer`` step over ``count`` DTensor shards of ``numel`` elements with gradients."""
    params = _sharded_params(count, numel, group, device)
    grads = _sharded_params(count, numel, group, device)
    for p, g in zip(params, grads):
        p.grad = g.detach().fill_(1.0)
    opt = (torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4))
    return opt.step


def _optimizer_line(t_many: float, t_few: float) -> tuple[float, float]:
    """(seconds per tensor, seconds per byte) through the two points' times."""
    return fit_two_points(*((count, count * numel * 4, t) for (count, numel), t in zip(_OPTIMIZER_POINTS,
                                                                                          (t_many, t_few))))


def _optimizer_step(optimizer: str, group: Any, device: torch.device, repeats: int,
                    share: float = 1.0) -> tuple[float, float]:
    """(seconds per tensor, seconds per shard byte) of a real ``optimizer`` step over DTensor shards, through many small
    tensors and few large ones, each timed with cold caches as it runs after a backward."""
    def step_seconds(count: int, numel: int) -> float:
        step = _optimizer_workload(optimizer, count, numel, group, device)
        _sync_ranks(group, share)
        return _cold_seconds(step, repeats, device, share)

    return _optimizer_line(*(step_seconds(*point) for point in _OPTIMIZER_POINTS))


def _runtime_workload(count: int, group: Any, device: torch.device) -> Callable[[], None]:
    """One autograd round trip through :class:`LocalShards` over ``count`` sharded parameters."""
    from ...sharding.sharded_param import LocalShards

    params = _sharded_params(count, 64, group, device)
    shards = LocalShards()
    for index, param in enumerate(params):
        shards.add(f"p{index}", param)
    leaves = list(shards.leaves.values())

    def step() -> None:
        shards.refresh()
        torch.stack([leaf.sum() for leaf in leaves]).sum().backward()
        for p in params:
            p.grad = None

    return step


def _runtime_line(t_few: float, t_many: float) -> float:
    few, many = _RUNTIME_COUNTS
    return max((t_many - t_few) / (many - few), 0.0)


def _runtime_per_tensor(group: Any, device: torch.device, repeats: int, share: float = 1.0) -> float:
    """Seconds per sharded parameter per step outside the graphs (leaf checks,
    :meth:`~fsdp_compile.sharding.sharded_param.LocalShards.refresh`, DTensor ``.grad`` wrapping):
    the slope of a real autograd round trip through :class:`LocalShards` at two counts."""
    def round_trip_seconds(count: int) -> float:
        step = _runtime_workload(count, group, device)
        _sync_ranks(group, share)
        return _compute_seconds(step, repeats, device, share=share)

    return _runtime_line(*(round_trip_seconds(count) for count in _RUNTIME_COUNTS))
