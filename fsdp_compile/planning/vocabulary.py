"""The planner's base vocabulary: units, collective kinds, optimizer states, its errors, and a
measured collective's fitted line (what :mod:`.cluster`, :mod:`.calibration`, :mod:`.plan` and
the modules around them share, so none of them imports another in a circle)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..errors import ConfigError
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


def fit_two_points(first: tuple[float, float, float], second: tuple[float, float, float]) -> tuple[float, float]:
    """(seconds per item, seconds per byte) solving ``t = items * a + bytes * b`` through two ``(items, bytes, t)``
    points, clipped at 0 like :func:`fit_line`."""
    (c1, b1, t1), (c2, b2, t2) = first, second
    per_byte = max((t2 - t1 * c2 / c1) / (b2 - b1 * c2 / c1), 0.0)
    return max((t1 - b1 * per_byte) / c1, 0.0), per_byte


def number_problems(name: str, value: object, *, positive: bool = True, integer: bool = False,
                    at_most: float | None = None) -> list[str]:
    """What is wrong with one number of a cluster description, each named."""
    if value is None:
        return [f"{name} is missing"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [f"{name}={value!r} must be a number"]
    problems = []
    if integer and int(value) != value:
        problems.append(f"{name}={value!r} must be a whole number")
    if math.isnan(value) or math.isinf(value):
        problems.append(f"{name}={value!r} must be finite")
    elif positive and value <= 0:
        problems.append(f"{name}={value!r} must be > 0")
    elif not positive and value < 0:
        problems.append(f"{name}={value!r} must be >= 0")
    elif at_most is not None and value > at_most:
        problems.append(f"{name}={value!r} must be <= {at_most}")
    return problems


def fit_problems(field_name: str, fits: dict) -> list[str]:
    """What is wrong with measured collective fits (kind -> :class:`MeasuredCollective`), named."""
    problems = []
    for kind, fit in fits.items():
        if kind not in COLLECTIVE_KINDS:
            problems.append(f"{field_name}[{kind!r}]: kinds are {', '.join(COLLECTIVE_KINDS)}")
        elif not (fit.bandwidth > 0 and fit.step_latency >= 0):
            problems.append(f"{field_name}[{kind!r}] has bandwidth {fit.bandwidth} and latency "
                            f"{fit.step_latency}: bandwidth must be > 0, latency >= 0")
    return problems


def line_problems(field_name: str, lines: dict, units: str, keys: tuple[str, ...] | None) -> list[str]:
    """What is wrong with fitted lines (name -> (fixed, per byte) seconds), named."""
    problems = []
    for name, fit in lines.items():
        if keys is not None and name not in keys:
            problems.append(f"{field_name}[{name!r}]: keys are {', '.join(keys)}")
        elif (not isinstance(fit, tuple) or len(fit) != 2
                or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in fit)):
            problems.append(f"{field_name}[{name!r}]={fit!r} must be ({units} >= 0, seconds per byte >= 0)")
    return problems
