"""The multi-process harness: a failing rank ends the run at once with its own error."""

from __future__ import annotations

import os
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


def rank_goes_away_then_raises_worker(rank: int, world: int) -> None:
    """Rank 1 leaves the group (rank 0 fails at once on the lost peer), then raises late."""
    if rank == 1:
        dist.destroy_process_group()
        time.sleep(2.0)
        raise ValueError("rank 1's own cause")
    dist.all_reduce(torch.ones(1))


def test_the_rank_that_failed_on_its_own_leads_the_report() -> None:
    """Rank 0's "connection closed" reaches the parent first; the report still opens with
    rank 1's traceback, the cause, and keeps rank 0's after it."""
    with pytest.raises(WorkerError) as err:
        run_workers(rank_goes_away_then_raises_worker, 2)
    report = str(err.value)
    assert report.startswith("rank 1 failed"), report[:2000]
    assert "ValueError: rank 1's own cause" in report
    assert "rank 0 failed" in report


def rank_aborts_worker(rank: int, world: int) -> None:
    """Rank 1 dies of SIGABRT (as a native heap corruption does) while rank 0 waits for it,
    after writing to file descriptor 2 what native code prints before it aborts."""
    if rank == 1:
        os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n")
        os.abort()
    dist.all_reduce(torch.ones(1))


def writes_to_stderr_worker(rank: int, world: int) -> None:
    os.write(2, b"x" * 3000 + b" an earlier task's warning\n")  # longer than what the next task writes


def test_a_rank_killed_by_a_signal_is_named_with_its_python_stack() -> None:
    run_workers(writes_to_stderr_worker, 2)  # the same ranks run the next task
    with pytest.raises(WorkerError) as err:
        run_workers(rank_aborts_worker, 2)
    report = str(err.value)
    assert report.startswith("rank 1 was killed by SIGABRT without a result"), report[:2000]
    assert "rank_aborts_worker" in report  # faulthandler's stack of the dying rank
    assert "rank 1's stderr ended with:\nterminate called after throwing" in report
    assert "an earlier task's warning" not in report  # the quote is the failing task's own


def make_groups_worker(rank: int, world: int, count: int) -> int:
    import torch.distributed as dist

    for _ in range(count):
        dist.new_group(list(range(world)))
    return os.getpid()


def test_ranks_that_hold_many_process_groups_are_replaced() -> None:
    from distributed import MAX_GROUPS_HELD

    few = run_workers(make_groups_worker, 2, 1)
    assert run_workers(make_groups_worker, 2, 0) == few  # kept
    many = run_workers(make_groups_worker, 2, MAX_GROUPS_HELD)
    assert many == few  # the call that piles them up still runs on the kept ranks...
    assert set(run_workers(make_groups_worker, 2, 0)).isdisjoint(many)  # ...which are then replaced
