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

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .compute import _cold_seconds, _compute_seconds, _slowest, _sync_ranks
from .reference import time_reference


def _sharded_params(count: int, numel: int, group: Any, device: torch.device) -> list[torch.nn.Parameter]:
    """``count`` zero parameters of ``numel`` local elements each, DTensors sharded on dim 0 over
    ``group`` as the backend's parameters are (no communication: each rank makes its own)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    return [torch.nn.Parameter(DTensor.from_local(torch.zeros(numel, device=device), mesh, [Shard(0)],
                                                  run_check=False)) for _ in range(count)]


# The two workloads each line is drawn through: many small tensors (per-tensor dispatch) and few
# large ones (bytes) for the optimizer; two parameter counts for the runtime's round trip.
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
    (count_many, numel_many), (count_few, numel_few) = _OPTIMIZER_POINTS
    bytes_many, bytes_few = count_many * numel_many * 4, count_few * numel_few * 4
    # Solve t = tensors * a + bytes * b through both points; clipped at 0 like fit_line.
    per_byte = max((t_few - t_many * count_few / count_many) / (bytes_few - bytes_many * count_few / count_many), 0.0)
    per_tensor = max((t_many - bytes_many * per_byte) / count_many, 0.0)
    return per_tensor, per_byte


def _optimizer_step(optimizer: str, group: Any, device: torch.device, repeats: int,
                    sync: bool = True) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per shard byte) of one real ``optimizer`` step
    over DTensor shards on ``group``, as the backend's sharded parameters are: a line through
    a step over many small tensors (per-tensor dispatch) and one over few large ones (bytes).
    Each step is timed with cold caches, as it runs after a backward (a loop of steps runs
    faster per tensor than the same steps after the caches were refilled)."""
    def step_seconds(count: int, numel: int) -> float:
        step = _optimizer_workload(optimizer, count, numel, group, device)
        _sync_ranks(group, sync)
        return _cold_seconds(step, repeats, device)

    return _optimizer_line(*(step_seconds(*point) for point in _OPTIMIZER_POINTS))


def _runtime_workload(count: int, group: Any, device: torch.device) -> Callable[[], None]:
    """One autograd round trip through :class:`LocalShards` over ``count`` sharded parameters."""
    from ...sharding.local_shards import LocalShards

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


def _runtime_per_tensor(group: Any, device: torch.device, repeats: int, sync: bool = True) -> float:
    """Seconds per sharded parameter per training step spent outside the compiled graphs: each
    graph call first checks every leaf against its DTensor parameter
    (:meth:`~fsdp_compile.sharding.local_shards.LocalShards.refresh`), and backward accumulates each
    reduced gradient into its leaf, whose hook wraps it into a DTensor ``.grad``. Timed as a
    real autograd round trip through :class:`LocalShards` at two parameter counts (the slope:
    per tensor), like the optimizer step, so the graphs' own work is not counted twice."""
    def round_trip_seconds(count: int) -> float:
        step = _runtime_workload(count, group, device)
        _sync_ranks(group, sync)
        return _compute_seconds(step, repeats, device)

    return _runtime_line(*(round_trip_seconds(count) for count in _RUNTIME_COUNTS))


class BesideSteps:
    """The calibration's optimizer and runtime workloads, timed again once after every step of a
    job (:func:`~fsdp_compile.planning.compare.measure_strategy`), so that the fits they give
    are those of the machine while the job's steps ran, not while the calibration did.

    The calibration times each workload within a fraction of a second, once per job: on a shared
    machine the fits it gives move between jobs a few minutes apart while the jobs' steps do not
    (the figures: :mod:`fsdp_compile_lab.calibration`, in the repository's lab). Each sample here is one run of each
    workload on the compute clock, stretched by the rank's share of a core, as the model's own
    reference beside the steps is (:func:`.reference.time_reference`), and the fit is drawn
    through the medians: the step runs the optimizer at the machine's typical speed, not its
    fastest. No cache is flushed between samples: the training step and the model's reference
    run in between, each moving more data than the caches hold."""

    def __init__(self, group: Any, device: torch.device, optimizer: str = "adamw") -> None:
        self.optimizer = optimizer
        self._group = group
        self._device = device
        self._workloads = {
            **{("optimizer", point): _optimizer_workload(optimizer, *point, group, device)
               for point in _OPTIMIZER_POINTS},
            **{("runtime", count): _runtime_workload(count, group, device) for count in _RUNTIME_COUNTS}}
        self._samples: dict[Any, list[float]] = {key: [] for key in self._workloads}
        for run in self._workloads.values():  # the first run allocates the optimizer's state
            run()

    def sample(self) -> None:
        """Time one run of every workload on this rank."""
        for key, run in self._workloads.items():
            self._samples[key].append(time_reference(run, self._device))

    def reset(self) -> None:
        for samples in self._samples.values():
            samples.clear()

    def fits(self) -> dict[str, Any] | None:
        """The fits through each rank's medians so far, each field the slowest rank's as the
        calibration takes it, as the :class:`Cluster` fields they replace (call it on every rank):
        ``{"optimizer_step": {optimizer: (per tensor, per byte)}, "runtime_per_tensor": seconds}``;
        None before any sample."""
        if not all(self._samples.values()):
            return None
        median = {key: statistics.median(samples) for key, samples in self._samples.items()}
        optimizer = _optimizer_line(*(median["optimizer", point] for point in _OPTIMIZER_POINTS))
        runtime = _runtime_line(*(median["runtime", count] for count in _RUNTIME_COUNTS))
        return {"optimizer_step": {self.optimizer: tuple(_slowest(v, self._group) for v in optimizer)},
                "runtime_per_tensor": _slowest(runtime, self._group)}
