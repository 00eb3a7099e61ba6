"""Run a function on several CPU processes joined by a gloo process group.

``run_workers(fn, world_size, *args)`` returns each rank's return value. Every rank uses
``OMP_NUM_THREADS=1`` (the CI machine has 2 cores), a process-group timeout, and ends its group
with ``end_process_group()`` (a barrier that holds no earlier collective, then
``destroy_process_group()``: gloo can abort at exit otherwise). When any rank raises, the
others are killed at once and the failing rank's traceback is raised in the parent, so a test
never waits on ranks blocked in a collective.

The processes of one world size are kept for the whole test session and run one call after
another: starting a rank and importing torch costs seconds, paid by dozens of tests. Each call
starts from the same state a fresh process would have: the environment as it was at start-up
(plus ``env``), Dynamo's caches cleared, torch's default RNG seed. After a failure or a timeout
the processes are killed and the next call starts new ones.

``default_group=False`` runs ``fn`` on ranks (kept apart from the others) that have no process
group: ``fn`` makes its own default group, as a script that sets up the process group its own
way (an emulated network) does, from the usual environment (``MASTER_ADDR``, a fresh
``MASTER_PORT`` per call, ``RANK``, ``WORLD_SIZE``). A group ``fn`` leaves behind is ended
after it.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import itertools
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

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


def _serve(rank: int, world: int, port: int, tasks: Any, results: Any, default_group: bool) -> None:
    """A rank's loop: run each task ``(id, fn, args, env)`` until told to stop (``None``)."""
    # A rank killed by a signal (a heap corruption in native code aborts) prints every
    # thread's Python stack first, so the failure names where it happened.
    faulthandler.enable()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=os.path.join(tempfile.gettempdir(), "fsdp_compile_inductor"),
    )
    import torch
    import torch.distributed as dist

    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    fresh_environment = dict(os.environ)
    fresh_seed = torch.initial_seed()
    try:
        if default_group:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
        while (task := tasks.get()) is not None:
            task_id, fn, args, env = task
            os.environ.clear()
            os.environ.update(fresh_environment, **env)
            torch._dynamo.reset()
            torch.manual_seed(fresh_seed)
            try:
                value = fn(rank, world, *args)
                if default_group:
                    dist.barrier()
                else:
                    end_process_group()
                results.put((task_id, rank, "ok", pickle.dumps(value)))
            except BaseException:  # report anything, including KeyboardInterrupt, to the parent
                results.put((task_id, rank, "error", traceback.format_exc()))
                return  # the parent kills the others, which may be blocked in a collective
        end_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Pool:
    """``world`` ranks that run one function after another."""

    _ids = itertools.count()

    def __init__(self, world: int, default_group: bool = True) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.default_group = default_group
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.tasks[r], self.results, default_group),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, env: dict, timeout_s: float) -> list[Any]:
        task_id = next(self._ids)
        if not self.default_group:
            env = {"MASTER_PORT": str(_free_port()), **env}
        for q in self.tasks:
            q.put((task_id, fn, args, env))
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerError(f"workers did not finish within {timeout_s:.0f}s (ranks done: {sorted(values)})")
            try:
                done_id, rank, status, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in values]
                if dead:
                    raise WorkerError(f"rank {dead[0]} exited with code {self.procs[dead[0]].exitcode} "
                                      "without a result") from None
                continue
            if done_id != task_id:
                continue
            if status == "error":
                raise WorkerError(f"rank {rank} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
        return [values[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_POOLS: dict[tuple[int, bool], _Pool] = {}


def run_workers(
    fn: Callable,
    world_size: int,
    *args: Any,
    env: dict | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
    default_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns values by rank.

    ``fn`` must be importable by name (a module-level function of a module on ``sys.path``).
    ``fresh=True`` runs it on new processes (nothing in memory from earlier calls), as a
    restarted job would. ``default_group=False``: the ranks have no process group and ``fn``
    makes its own (see the module docstring).
    """
    key = (world_size, default_group)
    pool = _POOLS.get(key)
    if fresh and pool is not None:
        pool.close()
        pool = None
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[key] = _Pool(world_size, default_group)
    try:
        return pool.run(fn, args, dict(env or {}), timeout_s)
    except BaseException:
        del _POOLS[key]
        pool.kill()
        raise


@atexit.register
def shutdown_workers() -> None:
    """Stop every kept process cleanly (barrier, then destroy the process group)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()
