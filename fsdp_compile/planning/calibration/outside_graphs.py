"""What a training step spends outside the compiled graphs, per sharded parameter.

The optimizer step over the shards and the runtime's work around each graph call (checking
every shard's leaf against its parameter, wrapping each reduced gradient into a DTensor
``.grad``) scale with the number of parameter tensors as much as with their bytes. Each is
timed as the real thing over DTensor shards, as the backend's parameters are, at two sizes,
and the line through both points separates the cost per tensor from the rest (for the
optimizer, from its cost per byte): ``Cluster.optimizer_step`` and
``Cluster.runtime_per_tensor``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .compute import _cold_seconds, _compute_seconds, _sync_ranks


def _sharded_params(count: int, numel: int, group: Any, device: torch.device) -> list[torch.nn.Parameter]:
    """``count`` zero parameters of ``numel`` local elements each, DTensors sharded on dim 0 over
    ``group`` as the backend's parameters are (no communication: each rank makes its own)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    return [torch.nn.Parameter(DTensor.from_local(torch.zeros(numel, device=device), mesh, [Shard(0)],
                                                  run_check=False)) for _ in range(count)]


def _optimizer_step(optimizer: str, group: Any, device: torch.device, repeats: int,
                    sync: bool = True) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per shard byte) of one real ``optimizer`` step
    over DTensor shards on ``group``, as the backend's sharded parameters are: a line through
    a step over many small tensors (per-tensor dispatch) and one over few large ones (bytes).
    Each step is timed with cold caches, as it runs after a backward (on a 2-core Xeon a loop
    of steps ran 10% faster per tensor than the same steps after the caches were refilled)."""
    def step_seconds(count: int, numel: int) -> float:
        params = _sharded_params(count, numel, group, device)
        grads = _sharded_params(count, numel, group, device)
        for p, g in zip(params, grads):
            p.grad = g.detach().fill_(1.0)
        opt = (torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4))
        _sync_ranks(group, sync)
        return _cold_seconds(opt.step, repeats, device)

    many, few = (64, 1 << 10), (4, 1 << 20)
    t_many, t_few = step_seconds(*many), step_seconds(*few)
    bytes_many, bytes_few = many[0] * many[1] * 4, few[0] * few[1] * 4
    # Solve t = tensors * a + bytes * b through both points; clipped at 0 like fit_line.
    per_byte = max((t_few - t_many * few[0] / many[0]) / (bytes_few - bytes_many * few[0] / many[0]), 0.0)
    per_tensor = max((t_many - bytes_many * per_byte) / many[0], 0.0)
    return per_tensor, per_byte


def _runtime_per_tensor(group: Any, device: torch.device, repeats: int, sync: bool = True) -> float:
    """Seconds per sharded parameter per training step spent outside the compiled graphs: each
    graph call first checks every leaf against its DTensor parameter
    (:meth:`~fsdp_compile.sharding.local_shards.LocalShards.refresh`), and backward accumulates each
    reduced gradient into its leaf, whose hook wraps it into a DTensor ``.grad``. Timed as a
    real autograd round trip through :class:`LocalShards` at two parameter counts (the slope:
    per tensor), like the optimizer step, so the graphs' own work is not counted twice."""
    from ...sharding.local_shards import LocalShards

    def round_trip_seconds(count: int) -> float:
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

        _sync_ranks(group, sync)
        return _compute_seconds(step, repeats, device)

    few, many = 8, 32
    return max((round_trip_seconds(many) - round_trip_seconds(few)) / (many - few), 0.0)
