"""Bytes per step per rank: theory from parameter shapes = compiled graphs = a profiled step.

Bytes are collective buffer sizes per rank (all-gather output, reduce-scatter input,
all-reduce buffer), padding included; with ring algorithms a rank sends (N-1)/N of an
all-gather or reduce-scatter buffer and 2(N-1)/N of an all-reduce buffer. The theory is computed in the test from parameter shapes, the strategy and
the configured dtypes, without the implementation's helpers; the profiled step reads element
counts and dtypes of the collectives from torch's profiler (implementation-independent).
"""

from __future__ import annotations

import pytest
from distributed import run_workers
from runs import WORLD
from workers import bytes_worker


# The ZeRO-2 variants run with -m slow (they only drop the backward gathers).
@pytest.mark.parametrize("strategy", [
    s if s in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD") else pytest.param(s, marks=pytest.mark.slow)
    for s in WORLD])
def test_bytes_per_step_equal_the_theory(strategy: str) -> None:
    for rank, report in enumerate(run_workers(bytes_worker, WORLD[strategy], strategy)):
        for precision, r in report.items():
            assert r["graph"] == r["theory"], f"rank {rank} {precision}: graph {r['graph']} vs theory {r['theory']}"
            assert r["profiled"] == r["theory"], f"rank {rank} {precision}: profiled {r['profiled']}"
        # Measured: bf16 gathers move half the bytes of fp32 ones; reductions stay in fp32.
        fp32, bf16 = report["fp32"]["profiled"], report["bf16"]["profiled"]
        assert bf16["all_gather"] * 2 == fp32["all_gather"]
        assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
        assert bf16["all_reduce"] == fp32["all_reduce"]
