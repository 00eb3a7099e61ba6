"""Collectives on the current process group: their timing fitted to the ring model, what the backend allocates beside
each, and on a GPU how much of their time can hide under compute.

A run is a burst of collectives issued back to back and waited at the end, over their number: the planner needs how long
a collective holds the link, and a single collective timed from a barrier also pays the ranks' skew leaving it
(milliseconds of fitted latency per step on an emulated link, ``tests/test_planning_network.py``). The median burst
(why: :mod:`.calibrate`) at each size is fitted to a line over the bytes each rank sends: the slope is the bandwidth,
the intercept over the ring's steps the latency per step. On an emulated network a burst's time is what the network
charged (:func:`_modeled_seconds`), not the wall time, which is also gloo's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.ring import ring_steps, wire_bytes
from ..vocabulary import COLLECTIVE_KINDS, MeasuredCollective, fit_line
from .allocator import _allocated_peak
from .compute import _fastest_time, _slowest, _typical_time

_c10d = torch.ops._c10d_functional


def _issue_collective(kind: str, buffer: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather":
        return _c10d.all_gather_into_tensor(buffer, n, group_name)
    if kind == "reduce_scatter":
        return _c10d.reduce_scatter_tensor(buffer, "sum", n, group_name)
    return _c10d.all_reduce(buffer, "sum", group_name)


def _run_collective(kind: str, buffer: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_issue_collective(kind, buffer, n, group_name))


def _run_burst(kind: str, buffers: list[torch.Tensor], n: int, group_name: str) -> None:
    """Issue one collective per buffer back to back, then wait for all (see the module docstring)."""
    for result in [_issue_collective(kind, b, n, group_name) for b in buffers]:
        _c10d.wait_tensor(result)


def _local_buffers(kind: str, size: int, n: int, count: int, device: torch.device) -> tuple[int, list[torch.Tensor]]:
    """(the buffer's float32 elements, ``count`` local inputs) of ``kind`` collectives whose buffer is about ``size``
    bytes over ``n`` ranks: an all-gather's buffer is its output, each rank contributing 1/n of it; the others' is their
    input."""
    numel = max(n, size // 4 // n * n)
    return numel, [torch.ones(numel // n if kind == "all_gather" else numel, device=device) for _ in range(count)]


_COLLECTIVE_REPEATS = 9  # a median needs more samples than a minimum
BURST = 4  # collectives per timed run


def collective_buffers(group: Any, device: torch.device, sizes: tuple[int, ...],
                       count: int) -> Iterator[tuple[str, int, list[torch.Tensor]]]:
    """``(kind, buffer bytes, count local inputs)`` for each kind at each of ``sizes`` on ``group``: the skeleton every
    collective calibration (the device's and a host model's) loops over."""
    n = dist.get_world_size(group)
    for kind in COLLECTIVE_KINDS:
        for size in sizes:
            numel, buffers = _local_buffers(kind, size, n, count, device)
            yield kind, numel * 4, buffers


def _group_name(group: Any) -> str:
    return (group or dist.group.WORLD).group_name


def _collectives(group: Any, device: torch.device, sizes: tuple[int, ...], repeats: int,
                 network: Any = None, beside: Callable[[torch.device], Any] | None = None
                 ) -> dict[str, MeasuredCollective]:
    """Each kind's fit on ``group``'s link, each burst timed inside ``beside(device)`` (a host model's
    ``beside_collectives``). With ``network`` (the :class:`~fsdp_compile.EmulatedNetwork` ``group`` runs on), a burst's
    time is what the network charged (:func:`_modeled_seconds`)."""
    n = dist.get_world_size(group)
    name = _group_name(group)
    samples: dict[str, list[tuple[int, float]]] = {kind: [] for kind in COLLECTIVE_KINDS}
    for kind, buffer_bytes, buffers in collective_buffers(group, device, sizes, BURST):
        dist.barrier(group=group)
        burst = functools.partial(_run_burst, kind, buffers, n, name)
        if network is not None and n > 1:  # a group of one crosses no link: timed as before
            seconds = _modeled_seconds(network, kind, burst)
        else:
            with beside(device) if beside is not None else contextlib.nullcontext():
                seconds = _typical_time(burst, max(repeats, _COLLECTIVE_REPEATS), device) / BURST
        samples[kind].append((buffer_bytes, _slowest(seconds, group)))
    fits = {}
    for kind, points in samples.items():
        latency, per_byte = fit_line([(wire_bytes(kind, b, n), s) for b, s in points])
        fits[kind] = MeasuredCollective(step_latency=latency / max(ring_steps(kind, n), 1),
                                        bandwidth=1.0 / per_byte, group_size=n, samples=tuple(points))
    return fits


def _modeled_seconds(network: Any, kind: str, burst: Callable[[], None]) -> float:
    """Seconds per collective that ``network``'s links charged the ``kind`` collectives ``burst`` ran (their modeled
    duration, the links' own account).

    An emulated collective ends when both its link and gloo are done with it, so its wall time is the larger of the two.
    Where gloo is the slower (small buffers, ranks sharing cores), a line through wall times would take gloo's time for
    the link's. Gloo's own time is a host model's to time apart (with the links unlimited)."""
    before = network.stats().total(kind)
    burst()
    after = network.stats().total(kind)
    count = after.count - before.count
    if count <= 0:
        raise RuntimeError(f"the emulated network recorded none of the {kind} collectives it was sent")
    return (after.busy_seconds - before.busy_seconds) / count


def _collective_workspace(group: Any, device: torch.device) -> dict[str, float]:
    """Bytes the backend allocates beside each collective's result, per byte of its buffer (the all-gather's output; the
    input of the others), by the allocator."""
    n = dist.get_world_size(group)
    name = _group_name(group)
    numel = (1 << 20) // n * n
    shares = {}
    for kind in COLLECTIVE_KINDS:
        local = torch.ones(numel // n if kind == "all_gather" else numel, device=device)
        buffer_bytes = numel * local.element_size()
        _run_collective(kind, local, n, name)  # warm-up: first-call allocations are not per collective
        dist.barrier(group=group)
        peak, result = _allocated_peak(lambda kind=kind, local=local: _run_collective(kind, local, n, name), device)
        extra = max(peak - result.numel() * result.element_size(), 0.0) / buffer_bytes
        shares[kind] = _slowest(round(extra, 2), group)
    return shares


def _gpu_overlap(group: Any, device: torch.device, repeats: int) -> float:
    """Fraction of a collective's time hidden when it runs beside compute (1: fully hidden), from racing an all-reduce
    against matmuls on a device whose communication runs on an engine of its own."""
    n = dist.get_world_size(group)
    name = _group_name(group)
    a = torch.randn(384, 384, device=device)
    buffer = torch.ones(4 << 20, device=device)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    def comm() -> None:
        _run_collective("all_reduce", buffer, n, name)

    def both() -> None:
        work = _c10d.all_reduce(buffer, "sum", name)
        compute()
        _c10d.wait_tensor(work)

    dist.barrier(group=group)
    t_compute = _slowest(_fastest_time(compute, repeats, device), group)
    dist.barrier(group=group)
    t_comm = _slowest(_fastest_time(comm, repeats, device), group)
    dist.barrier(group=group)
    t_both = _slowest(_fastest_time(both, repeats, device), group)
    hidden = t_compute + t_comm - t_both
    return min(max(hidden / min(t_compute, t_comm), 0.0), 1.0)
