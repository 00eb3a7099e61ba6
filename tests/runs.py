"""Multi-process runs shared by several test files, each run once per test session."""

from __future__ import annotations

import functools

from distributed import run_workers
from workers import parity_worker

# Hybrid strategies run as 2 "nodes" x 2 "devices".
WORLD = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 2, "NO_SHARD": 2, "HYBRID_SHARD": 4, "HYBRID_SHARD_ZERO2": 4}
STRATEGIES = list(WORLD)
STEPS = 5


@functools.cache
def parity_run(strategy: str) -> dict:
    """Rank 0's results of training with every mode, FSDP2 and the single-process reference."""
    modes = ["eager", "aot_eager", "inductor", "fsdp2"]
    return run_workers(parity_worker, WORLD[strategy], strategy, modes, STEPS)[0]
