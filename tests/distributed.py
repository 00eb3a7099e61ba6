"""Run a function on several CPU processes joined by a gloo process group.

``run_workers(fn, world_size, *args)`` returns each rank's return value. Every rank uses
``OMP_NUM_THREADS=1`` (the CI machine has 2 cores), a process-group timeout, and a barrier
before ``destroy_process_group()`` (gloo can abort at exit otherwise). When any rank raises, the
others are killed at once and the failing rank's traceback is raised in the parent, so a test
never waits on ranks blocked in a collective.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 900
# Generous: ranks compile different graphs (uneven shards have rank-dependent shapes), and at
# world 4 on 2 cores one rank's Inductor compile can keep the others in a collective for over
# a minute. A rank that fails does not leave the others waiting this long: the parent kills
# them as soon as it hears of the failure.
PG_TIMEOUT = datetime.timedelta(seconds=300)


class WorkerError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
        value = fn(rank, world, *args)
        dist.barrier()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report anything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    finally:
        if dist.is_initialized():
            # After an error the barrier could block on dead peers; the parent kills us then.
            dist.destroy_process_group()


def run_workers(
    fn: Callable,
    world_size: int,
    *args: Any,
    env: dict | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns values by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "fsdp_compile_inductor"),
           **(env or {})}
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, env, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"workers did not finish within {timeout_s:.0f}s (ranks done: {sorted(values)})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise WorkerError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]
