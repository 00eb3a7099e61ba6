"""How far ranks that time-slice a machine's cores drift apart: ``HostCPU.core_sharing`` and
``HostCPU.rank_drift``, which :mod:`..host.shared_cores` plays a step with.

Four ranks on two cores do not progress evenly: the scheduler serves some more than others for
a while, so ranks that start a span of compute together finish it at different times. On a
2-core x86 machine the five world-4 calibrations of one ``bench/plan_emulated.py`` run read 32-58
ms per square root of a second (14-26 ms of standard deviation over 0.2 s), and with the ranks
played together at such drifts the planner held every exposure of that run, and 19-20 of 20 at
world 4 in each of the four runs before, where lockstep had missed 2-3 (``docs/results.md``).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile.planning.calibration.compute import _node_ranks

from ..host.shared_cores import REFERENCE_SPAN
from .cores import _machine_cores

_DRIFT_ROUNDS = 8


def core_sharing(device: torch.device) -> tuple[int, int] | None:
    """``(ranks, cores)`` of this machine where its ranks' compute threads outnumber its
    cores (each rank's intra-op threads counting as one rank per thread's worth of cores);
    None where every rank has a core of its own, and on a GPU."""
    if device.type != "cpu":
        return None
    ranks = max(_node_ranks(), 1)
    cores = max(_machine_cores() // torch.get_num_threads(), 1)
    return (ranks, cores) if ranks > cores else None


def rank_drift(group: Any, device: torch.device, repeats: int) -> float:
    """Seconds of standard deviation of the ranks' finish times per square root of a second
    of compute, where this machine's ranks outnumber its cores; 0 elsewhere.

    Every rank computes the same CPU time (its thread's clock: equal work, whatever the
    scheduler gives it) from a barrier, about ``REFERENCE_SPAN`` of wall time at its share of
    the cores, and the ranks' wall times are gathered; per round their standard deviation,
    and the median over rounds over the square root of the span, the statistic
    :func:`..host.shared_cores.spread` plays. The same on every rank."""
    sharing = core_sharing(device)
    if sharing is None or not dist.is_initialized():
        return 0.0
    ranks, cores = sharing
    cpu_span = REFERENCE_SPAN * cores / ranks
    operand = torch.randn(128, 128)
    n = dist.get_world_size(group)
    deviations, spans = [], []
    for _ in range(max(repeats, _DRIFT_ROUNDS)):
        dist.barrier(group=group)
        start, start_cpu = time.perf_counter(), time.thread_time()
        while time.thread_time() - start_cpu < cpu_span:
            operand.mul_(1.0)
        wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        walls = [torch.empty_like(wall) for _ in range(n)]
        dist.all_gather(walls, wall, group=group)
        values = [float(w) for w in walls]
        deviations.append(statistics.pstdev(values))
        spans.append(statistics.fmean(values))
    return statistics.median(deviations) / math.sqrt(statistics.median(spans))
