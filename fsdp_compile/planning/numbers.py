"""The planner's base vocabulary: units, collective kinds, optimizer states, its errors, and a
measured collective's fitted line (what :mod:`.cluster`, :mod:`.calibration`, :mod:`.plan` and
the modules around them share, so none of them imports another in a circle)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..api import ConfigError
from ..passes.graph import COPY_KERNELS as GRAPH_COPY_KERNELS

GB = 1e9
GiB = 1 << 30
TFLOPS = 1e12
GBITS = 1e9 / 8  # bytes per second in one gigabit per second

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The backend's copies around each collective, by name (the ops: ``passes.graph.COPY_KERNELS``).
COPY_KERNELS = tuple(GRAPH_COPY_KERNELS.values())


# Optimizer states per parameter element, in units of the gradient (AdamW: two moments).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "none": 0}


class PlanError(ConfigError):
    """No strategy fits, or the planner was asked something it cannot answer."""


class ClusterError(ConfigError):
    """A cluster description is incomplete or impossible."""


@dataclass(frozen=True)
class MeasuredCollective:
    """A fitted ring model of one collective kind, from :meth:`Cluster.measure`.

    time = ``step_latency`` x ring steps + wire bytes / ``bandwidth`` (steps and wire bytes:
    :mod:`fsdp_compile.runtime.ring`).
    """

    step_latency: float  # seconds per ring step
    bandwidth: float  # wire bytes per second
    group_size: int  # the group it was measured on
    samples: tuple[tuple[int, float], ...] = ()  # (buffer bytes, median seconds)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clipped at 0 (time never falls with size)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    slope = max(slope, 1e-18)
    return max(my - slope * mx, 0.0), slope
