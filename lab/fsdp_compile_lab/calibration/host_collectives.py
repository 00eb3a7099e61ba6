"""The host-CPU model's collective calibrations: the issuing thread's time to start each kind
(``collective_issue``), the CPU a CPU backend's own threads spend on each (``collective_cpu``),
how fast that work goes while the rank computes (``backend_share``), and how long a collective
waits for the last of ranks time-slicing the cores (``rank_skew``).

Each runs on every rank of the group at once, its timings the slowest rank's, on the clocks and
buffers of :mod:`fsdp_compile.planning.calibration` (the device's own calibrations).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile.planning.calibration.collective_fits import (
    _COLLECTIVE_REPEATS,
    _c10d,
    _group_name,
    _issue_collective,
    _local_buffers,
    _run_collective,
    collective_buffers,
)
from fsdp_compile.planning.calibration.compute import _slowest
from fsdp_compile.planning.vocabulary import COLLECTIVE_KINDS, fit_line
from fsdp_compile.runtime.ring import wire_bytes

from .cores import _cores_per_thread, _cpu_share


def backend_share(cores_per_thread: float) -> tuple[float, float]:
    """(while the rank computes, while it waits): how fast a CPU backend's own work on a
    collective goes, relative to its fit (``HostCPU.backend_share``), with ``cores_per_thread``
    cores per compute thread on the node.

    A computing rank runs two busy threads, its compute and its backend's; a waiting one only
    the backend's. A thread then gets ``min(1, c / 2)`` of a core in the first case and
    ``min(1, c)`` in the second, and the fit was timed at the second: half speed under compute
    where the ranks fill the cores, full speed with two cores per rank or more. With it,
    ``bench/plan_emulated.py`` held every world-2 exposure target, which gloo's own time under
    compute had made it miss before (``docs/planning.md``)."""
    return (min(1.0, cores_per_thread / 2) / min(1.0, cores_per_thread), 1.0)


def _backend_share(device: torch.device) -> tuple[float, float]:
    return (1.0, 1.0) if device.type != "cpu" else backend_share(_cores_per_thread())


def _issue_seconds(group: Any, device: torch.device, sizes: tuple[int, ...],
                   repeats: int) -> dict[str, tuple[float, float]]:
    """``{kind: (seconds, seconds per buffer byte)}`` the issuing thread spends starting a
    collective, on a CPU (``{}`` elsewhere, where the CPU runs ahead of the device).

    That time is the compute stream's: gloo checks and enqueues on the caller's thread, and its
    reduce-scatter and all-reduce first copy their input there (about 1 ms for a 3 MB bucket on
    a 2-core Xeon), so a collective starts only after it, however well it is hidden. The
    median of each size's issues on the thread's clock, fitted to a line over the buffer's
    bytes (an all-gather's output, the others' input, as the cost model prices them); the
    first issue of each size is a warm-up."""
    if device.type != "cpu":
        return {}
    n, name = dist.get_world_size(group), _group_name(group)
    samples: dict[str, list[tuple[int, float]]] = {kind: [] for kind in COLLECTIVE_KINDS}
    for kind, buffer_bytes, buffers in collective_buffers(group, device, sizes, repeats + 1):
        seconds = []
        for buffer in buffers:
            dist.barrier(group=group)
            start = time.thread_time()
            result = _issue_collective(kind, buffer, n, name)
            seconds.append(time.thread_time() - start)
            _c10d.wait_tensor(result)
        # stretched by the rank's share of a core, as compute is (``_compute_seconds``)
        typical = statistics.median(seconds[1:]) / _cpu_share(device)
        samples[kind].append((buffer_bytes, _slowest(typical, group)))
    return {kind: fit_line(points) for kind, points in samples.items()}


def _collective_cpu(group: Any, device: torch.device, sizes: tuple[int, ...],
                    repeats: int) -> dict[str, tuple[float, float]]:
    """``{kind: (seconds, seconds per wire byte)}`` of CPU a CPU backend's own threads spend on a
    collective (gloo moves and reduces bytes on threads of its own), stretched by the rank's
    share of a core; ``{}`` where every rank has a core to spare.

    When this node's ranks occupy every core with compute, that CPU time is taken from compute
    however the schedule hides the collective. It is counted in CPU seconds, not as a share of
    the collective's time: on an emulated link the same transfer takes longer while gloo's work
    stays the same. Measured from clocks, not from a race between compute and a collective
    (whose outcome the scheduler decides differently from run to run): the CPU time of this
    process's other threads across collectives of each kind at each of ``sizes`` (buffer
    bytes, as :func:`_collectives` times them), for the slowest rank, fitted to a line over the
    bytes each rank sends. The small sizes matter: a tensor-parallel step's all-reduces are
    activations of a few hundred KB, and a line through 1-4 MB buckets alone put an intercept of
    up to 6 ms on each. The issuing thread's own share is not counted here: it is compute's time
    before the collective starts (:func:`_issue_seconds`).
    """
    if _cores_per_thread() > 1.0:
        return {}
    n, name = dist.get_world_size(group), _group_name(group)
    samples: dict[str, list[tuple[int, float]]] = {kind: [] for kind in COLLECTIVE_KINDS}
    for kind, buffer_bytes, (local,) in collective_buffers(group, device, sizes, 1):
        _run_collective(kind, local, n, name)
        cpu = []
        for _ in range(max(repeats, _COLLECTIVE_REPEATS)):
            dist.barrier(group=group)
            start_cpu, start_own = time.process_time(), time.thread_time()
            _run_collective(kind, local, n, name)
            cpu.append((time.process_time() - start_cpu) - (time.thread_time() - start_own))
        # Where ranks share cores (2 x 2 on 2 cores), communication threads get a rank's share
        # of a core like compute does: the compute they displace is stretched by the same share.
        typical = statistics.median(cpu) / _cpu_share(device)
        samples[kind].append((wire_bytes(kind, buffer_bytes, n), _slowest(typical, group)))
    return {kind: fit_line(points) for kind, points in samples.items()}


# CPU seconds of compute between two of the skew calibration's collectives: about what a step
# on a CPU runs between two bucket waits (a world-4 gpt_small step: 12-23 collectives in 200 ms
# of each rank's CPU).
_SKEW_INTERVAL = 0.01


def _rank_skew(group: Any, device: torch.device, repeats: int) -> float:
    """Seconds a blocking collective waits, beyond its own time, for the last rank of the group
    to reach it, where this node's ranks outnumber its cores; 0 where every rank has a core.

    Time-sliced ranks do not run their compute at an even share of a core: the scheduler
    hands a core out in slices of milliseconds, so between two collectives one rank gets
    further than another, and the collective waits for the last. The stretch of compute by
    the rank's share of a core (:func:`.cores._cpu_share`) prices the average rank. At world 4
    on 2 cores, every collective of a gpt_small step left the main thread blocked 2-7 ms more
    than the plan's waits, on plain gloo and on emulated links alike, while at world 2 (a core
    per rank) blocked and predicted agreed within a few milliseconds
    (``bench/results/archive/plan_emulated_w4_before_rank_skew.md``). Measured as a step runs it: every
    rank computes about ``_SKEW_INTERVAL`` of CPU, then all-reduces a few bytes, over and
    over; each round's wall time beyond its compute stretched by the share of a core, and
    beyond the same all-reduce's time from synchronized ranks, is the skew (median of the rounds,
    slowest rank)."""
    share = _cpu_share(device)
    if share >= 1.0 or device.type != "cpu":
        return 0.0
    n, name = dist.get_world_size(group), _group_name(group)
    _, (tiny,) = _local_buffers("all_reduce", 64, n, 1, device)
    operand = torch.randn(128, 128, device=device)

    def compute() -> None:
        end = time.thread_time() + _SKEW_INTERVAL
        while time.thread_time() < end:
            operand.mul_(1.0)

    alone = []
    for _ in range(max(repeats, _COLLECTIVE_REPEATS)):
        dist.barrier(group=group)
        start = time.perf_counter()
        _run_collective("all_reduce", tiny, n, name)
        alone.append(time.perf_counter() - start)
    rounds = max(4 * repeats, 20)
    skews = []
    dist.barrier(group=group)
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.thread_time()
        compute()
        _run_collective("all_reduce", tiny, n, name)
        cpu = time.thread_time() - start_cpu
        skews.append(time.perf_counter() - start - cpu / share)
    return _slowest(max(statistics.median(skews) - statistics.median(alone), 0.0), group)
