"""The multi-process harness: a failing rank ends the run at once with its own error."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from distributed import PG_TIMEOUT, WorkerError, run_workers


def one_rank_fails_worker(rank: int, world: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective."""
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))


def test_a_failing_rank_ends_the_run_without_waiting_for_timeouts() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed") as err:
        run_workers(one_rank_fails_worker, 2)
    assert "ValueError: rank 1 gives up" in str(err.value)
    # Rank 0 is blocked in all_reduce; it is killed, not left to the process-group timeout.
    assert time.monotonic() - start < PG_TIMEOUT.total_seconds() / 4
