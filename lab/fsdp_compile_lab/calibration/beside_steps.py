"""What ``compare`` times beside each strategy's steps on a CPU (``HostCPU.beside_steps``).

The speed of a shared machine moves between a calibration and the steps. ``compare`` times the
compared model's own step again after every timed step (:func:`model_reference_step`), and the
calibration's optimizer and runtime workloads (:class:`BesideSteps`), and predicts each strategy
at the speed the machine had while that strategy's steps ran: ``compute_scale`` from the
reference (:func:`.reference.compute_scale`), the optimizer and runtime fits from the workloads.
The figures behind it: :mod:`.reference` and :mod:`fsdp_compile_lab.calibration`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from fsdp_compile.planning.calibration.compute import _compute_clock, _slowest, _stretched
from fsdp_compile.planning.calibration.outside_graphs import (
    _OPTIMIZER_POINTS,
    _RUNTIME_COUNTS,
    _optimizer_line,
    _optimizer_workload,
    _runtime_line,
    _runtime_workload,
)

from .cores import _cpu_share
from .reference import _captured_step, compute_scale


class _ModelLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: tuple, targets: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), targets)


def model_reference_step(
    model: nn.Module, inputs: tuple, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
) -> tuple[list[fx.GraphModule], Callable[[], None]]:
    """``model``'s own step as a reference: ``loss_fn(model(*inputs), targets)`` forward and
    backward on this rank alone, no collectives, its graphs and a function running one step.
    ``model`` is trained by nothing else (its gradients are dropped after each step)."""
    return _captured_step(_ModelLoss(model, loss_fn), (tuple(inputs), targets))


def time_reference(step: Callable[[], None], device: torch.device) -> float:
    """One run of a reference ``step`` on the compute clock, stretched by the rank's share of a
    core as the calibration stretches its timings: a sample of what the calibration measures."""
    clock = _compute_clock(device)
    start = clock()
    step()
    return _stretched(clock() - start, clock, _cpu_share(device))


class BesideSteps:
    """The calibration's optimizer and runtime workloads, timed again once after every step of a
    job (:func:`~fsdp_compile.planning.compare.measure_strategy`), so that the fits they give
    are those of the machine while the job's steps ran, not while the calibration did; with
    ``reference`` (the model's own step), ``compute_scale`` too.

    On a shared machine the calibration's fits move between jobs while the steps do not (the
    figures: :mod:`fsdp_compile_lab.calibration`). Each sample is one run of each workload on the
    compute clock, stretched by the rank's share of a core, the fit drawn through the medians (no
    cache is flushed: the step and the reference in between move more than the caches hold)."""

    def __init__(self, group: Any, device: torch.device, optimizer: str = "adamw",
                 reference: tuple[list[fx.GraphModule], Callable[[], None]] | None = None) -> None:
        self.optimizer = optimizer
        self.cpu_share = _cpu_share(device)
        self.reference_graphs, self.reference = reference or ([], None)
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

    def numbers(self, measured: Any, cluster: Any) -> dict[str, Any]:
        """One strategy's numbers beside its steps (``Measured``): ``compute_scale`` from its
        reference's time (on the compute clock, stretched here by the rank's share of a core as
        the calibration's are), and the optimizer and runtime fits."""
        scale = getattr(cluster.host, "compute_scale", 1.0)
        if measured.reference_seconds:
            scale = compute_scale(measured.reference_seconds / self.cpu_share, self.reference_graphs, cluster)
        return {"compute_scale": scale, **(measured.outside_graphs or {})}


QUIET_WAIT = 0.05  # a step whose ranks waited for a core at most this share of it counts as quiet


def quiet_step_seconds(step_times: Sequence[float], wait_fractions: Sequence[float],
                       cpu_share: float = 1.0) -> float | None:
    """The median of the steps whose ranks waited for a core at most ``QUIET_WAIT`` of the step
    beyond ``1 - cpu_share`` (a rank sharing a core with the job's other ranks waits for it by
    itself; see :func:`.cores._cpu_share`); None when fewer than two steps qualify."""
    limit = QUIET_WAIT + (1.0 - cpu_share)
    quiet = [t for t, w in zip(step_times, wait_fractions) if w <= limit]
    return statistics.median(quiet) if len(quiet) >= 2 else None
