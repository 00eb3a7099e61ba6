"""One strategy's measured steps and the statistics ``compare`` draws from them: the median step, the spread that says
whether two strategies differ, and the communication an emulated network exposes with an interval. Order statistics, not
means: steps on a shared machine have heavy tails, and a median's distribution-free interval assumes nothing about them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measured:
    strategy: str
    step_seconds: float
    step_times: list[float]
    compile_seconds: float
    peak_bytes: float
    resident_bytes: float
    tokens_per_second: float
    bytes_per_step: dict[str, float]  # what the compiled graphs' collectives move (ring formula)
    backend_bytes_per_step: float = 0.0  # what gloo / NCCL ran (gloo: reduce-scatter as all-reduce)
    collectives: dict[str, int] = field(default_factory=dict)
    cpu_seconds: float | None = None  # the main thread's CPU time per step (median, slowest rank)
    cpu_wait_fraction: float | None = None  # run-queue wait / wall time per step (median, largest rank)
    core_wait_seconds: float | None = None  # the main thread's wait for a core per step (median, largest rank)
    load_average: float | None = None  # the machine's 1-minute load average after the steps
    wait_fractions: list[float] = field(default_factory=list)  # per step, the largest rank's
    network: dict[str, Any] | None = None  # an emulated network's NetworkStats over the timed steps alone
    warmup_steps: int = 2
    # With ``unlimited_too``: each timed step run again on unlimited links, right before or after it
    unlimited_step_times: list[float] = field(default_factory=list)
    # With ``reference``: its step's median on the compute clock beside the timed steps (slowest rank).
    reference_seconds: float | None = None
    # With ``outside_graphs``: its fits beside the steps, as the Cluster fields they replace
    outside_graphs: dict[str, Any] | None = None
    # The other threads' (gloo's) CPU time per step (median, largest rank): against backend_cpu_seconds
    others_cpu_seconds: float | None = None

    @property
    def unlimited_step_seconds(self) -> float | None:
        return statistics.median(self.unlimited_step_times) if self.unlimited_step_times else None

    @property
    def exposed_differences(self) -> list[float]:
        """With ``unlimited_too``: each timed step minus its pair's step on unlimited links."""
        return [a - b for a, b in zip(self.steady_step_times, self.unlimited_step_times)]

    @property
    def exposed_seconds(self) -> float | None:
        """The communication the network exposes: the median of the paired differences (the machine's drift, common to a
        pair's back-to-back steps, cancels in each)."""
        differences = self.exposed_differences
        return statistics.median(differences) if differences else None

    @property
    def exposed_interval(self) -> tuple[float, float] | None:
        """A 95% distribution-free interval of ``exposed_seconds`` (:func:`median_interval`)."""
        return median_interval(self.exposed_differences)

    @property
    def steady_step_times(self) -> list[float]:
        """The timed steps (after warm-up), whose median is ``step_seconds``."""
        return self.step_times[self.warmup_steps:] or self.step_times[-1:]

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "unlimited_step_seconds": self.unlimited_step_seconds,
                "exposed_seconds": self.exposed_seconds, "exposed_interval": self.exposed_interval}


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """An interval that holds the median of the distribution ``values`` were drawn from with at least ``confidence``,
    whatever that distribution: the k-th smallest and k-th largest value, k the largest with P(Binomial(n, 1/2) < k) <=
    (1 - confidence) / 2. None for fewer than 6 values (no order statistic reaches 95% then: the range is all there
    is)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k = 0.0, 0
    while True:
        tail += math.comb(n, k) / 2 ** n
        if tail > (1 - confidence) / 2:
            break
        k += 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def step_range(measured: Measured) -> tuple[float, float]:
    """The middle half of the timed steps (first to third quartile): how much a step varies."""
    steps = sorted(measured.steady_step_times)
    if len(steps) < 4:
        return steps[0], steps[-1]
    q1, _, q3 = statistics.quantiles(steps, n=4, method="inclusive")
    return q1, q3


def within_noise(measured: dict[str, Measured]) -> list[str]:
    """A line for each pair of strategies whose step times cannot be told apart: the middle halves of their timed steps
    overlap, so which one is faster is not measured by this run."""
    lines = []
    for a, b in itertools.combinations(measured, 2):
        (a_low, a_high), (b_low, b_high) = step_range(measured[a]), step_range(measured[b])
        if a_low <= b_high and b_low <= a_high:
            lines.append(f"{a} and {b} are within noise of each other: the middle halves of their steps overlap "
                         f"({a_low * 1e3:.1f}-{a_high * 1e3:.1f} ms and {b_low * 1e3:.1f}-{b_high * 1e3:.1f} ms)")
    return lines
