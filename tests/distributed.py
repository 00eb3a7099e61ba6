"""Run a function on several CPU processes joined by a gloo process group.

``run_workers(fn, world_size, *args)`` returns each rank's return value. Every rank uses
``OMP_NUM_THREADS=1`` (the CI machine has 2 cores), a process-group timeout, and ends its group
with ``end_process_group()`` (a barrier that holds no earlier collective, then
``destroy_process_group()``: gloo can abort at exit otherwise). When any rank raises or dies,
the others are killed within seconds and the parent raises every rank's failure, so a test
never waits on ranks blocked in a collective. The rank that failed first leads the report, not
the one whose error arrived first: when a rank dies, its peers' "connection reset" errors can
reach the parent before the dead rank's own traceback, and a rank killed by a signal reports
nothing but its exit code and the stack ``faulthandler`` wrote.

The processes of one world size are kept and run one call after another: starting a rank and
importing torch costs seconds, paid by dozens of tests. They are replaced after a call that
leaves a rank holding more than ``MAX_GROUPS_HELD`` process groups (see there). Each call
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
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 900
# Generous: ranks compile different graphs (uneven shards have rank-dependent shapes), and at
# world 4 on 2 cores one rank's Inductor compile can keep the others in a collective for over
# a minute. A rank that fails does not leave the others waiting this long: the parent kills
# them as soon as it hears of the failure.
PG_TIMEOUT = datetime.timedelta(seconds=300)
# How long the parent waits, after the first failure, for the other ranks to report theirs or
# die. A rank that lost a peer fails within milliseconds; one blocked in a collective with a
# rank that is still alive would wait out PG_TIMEOUT, and is reported as waiting instead.
FAILURE_GRACE_S = 10.0
# A rank's file descriptor 2 is kept beside its fault file, under this suffix.
STDERR_SUFFIX = ".stderr"
# What a rank's error says when it failed because another rank went away, not on its own.
PEER_LOSS_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                   "Another rank has most likely exited or is stuck")


class WorkerError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, tasks: Any, results: Any, default_group: bool,
           fault_path: str) -> None:
    """A rank's loop: run each task ``(id, fn, args, env)`` until told to stop (``None``)."""
    # A rank killed by a signal (a heap corruption in native code aborts) writes every
    # thread's Python stack to its fault file first, which the parent's report quotes.
    fault_file = open(fault_path, "w")  # noqa: SIM115 -- open until the process ends
    faulthandler.enable(file=fault_file)
    # What native code prints before it aborts (std::terminate's "what():", a gloo enforce)
    # goes to file descriptor 2, which faulthandler does not see: keep it for the report too.
    native_stderr = open(fault_path + STDERR_SUFFIX, "w")  # noqa: SIM115 -- open until the process ends
    os.dup2(native_stderr.fileno(), 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
        TORCHINDUCTOR_CACHE_DIR=os.path.join(tempfile.gettempdir(), "fsdp_compile_inductor"),
    )
    import torch
    import torch.distributed as dist
    from conftest import guard_dynamo

    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    fresh_environment = dict(os.environ)
    fresh_seed = torch.initial_seed()
    try:
        if default_group:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PG_TIMEOUT)
        while (task := tasks.get()) is not None:
            task_id, fn, args, env = task
            # The report quotes the end of this file: keep it to the task now running (an earlier
            # task's warnings would push the native abort message out of the quote).
            sys.stderr.flush()
            native_stderr.seek(0)
            native_stderr.truncate()
            os.environ.clear()
            os.environ.update(fresh_environment, **env)
            torch._dynamo.reset()
            # The session's Dynamo settings (tests/conftest.py) hold in every rank, whatever an
            # earlier task set
            guard_dynamo()
            torch.manual_seed(fresh_seed)
            try:
                value = fn(rank, world, *args)
                if default_group:
                    dist.barrier()
                else:
                    end_process_group()
                results.put((task_id, rank, "ok", pickle.dumps(value), _groups_held()))
            except BaseException:  # report anything, including KeyboardInterrupt, to the parent
                results.put((task_id, rank, "error", traceback.format_exc(), 0))
                return  # the parent kills the others, which may be blocked in a collective
        end_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Ranks that hold more process groups than this are replaced after the call. Each gloo group
# keeps a thread that polls its sockets, and its connections open; tests make groups (hybrid
# layouts, meshes) and a fresh process would have none of them. Kept for the whole session, a
# world-4 rank held 45 such threads half way through the default run, and after 56 stress jobs
# (tests/stress_jobs.py) 281 of them with 1,434 open files, which took 1.2 cores of the
# machine's two while the rank sat idle. Destroying a task's groups instead is not enough:
# torch's DeviceMesh caches keep meshes whose groups are gone, and a later task with an equal
# mesh fails to resolve them.
MAX_GROUPS_HELD = 12


def _groups_held() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


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
        self.fault_paths = [_fault_path(r) for r in range(world)]
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, world, port, self.tasks[r], self.results, default_group,
                                        self.fault_paths[r]))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.groups_held = 0  # the most process groups a rank held after a call

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
                done_id, rank, status, payload, groups = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(not p.is_alive() and r not in values for r, p in enumerate(self.procs)):
                    self._fail(task_id, {}, values)
                continue
            if done_id != task_id:
                continue
            if status == "error":
                self._fail(task_id, {rank: payload}, values)
            values[rank] = pickle.loads(payload)
            self.groups_held = max(self.groups_held, groups)
        return [values[r] for r in range(self.world)]

    def _fail(self, task_id: int, errors: dict[int, str], values: dict[int, Any]) -> NoReturn:
        """Wait up to FAILURE_GRACE_S for every rank's own outcome, then raise them all."""
        grace_end = time.monotonic() + FAILURE_GRACE_S

        def settled() -> bool:
            return all(r in values or r in errors or not self.procs[r].is_alive() for r in range(self.world))

        def take(timeout: float) -> bool:
            try:
                done_id, rank, status, payload, _ = self.results.get(timeout=timeout)
            except queue.Empty:
                return False
            if done_id == task_id:
                if status == "error":
                    errors[rank] = payload
                else:  # finished after all: not a rank to report
                    values[rank] = pickle.loads(payload)
            return True

        while not settled() and time.monotonic() < grace_end:
            take(0.2)
        # A rank that reported and then exited has its report in the pipe already.
        while take(0.2):
            pass
        raise WorkerError(self._report(errors, values))

    def _report(self, errors: dict[int, str], values: dict[int, Any]) -> str:
        """Every rank's outcome, ranks that failed on their own before those that lost a peer."""
        causes, consequences = [], []
        for rank, proc in enumerate(self.procs):
            if rank in errors:
                text = f"rank {rank} failed:\n{errors[rank]}"
                lost_a_peer = any(sign in errors[rank] for sign in PEER_LOSS_SIGNS)
                (consequences if lost_a_peer else causes).append(text)
            elif rank in values:
                continue
            elif not proc.is_alive():
                text = f"rank {rank} {_exit_status(proc.exitcode)} without a result"
                fault = _fault_report(self.fault_paths[rank])
                causes.append(f"{text}; its fault report:\n{fault}" if fault else text)
                native = _stderr_tail(self.fault_paths[rank] + STDERR_SUFFIX)
                if native:
                    causes.append(f"rank {rank}'s stderr ended with:\n{native}")
            else:
                consequences.append(f"rank {rank} was still running (most likely waiting in a collective "
                                    f"for a failed rank) {FAILURE_GRACE_S:.0f}s after the first failure")
        return "\n\n".join(causes + consequences)

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
        for path in self.fault_paths:
            for file in (path, path + STDERR_SUFFIX):
                if os.path.exists(file):
                    os.remove(file)


def _fault_path(rank: int) -> str:
    fd, path = tempfile.mkstemp(prefix=f"fsdp_compile_rank{rank}_", suffix=".fault")
    os.close(fd)
    return path


def _exit_status(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exited with code {code}"
    name = signal.Signals(-code).name
    if name == "SIGKILL":
        return "was killed by SIGKILL (the kernel's out-of-memory killer sends it, as does a kill -9)"
    return f"was killed by {name}"


def _fault_report(path: str, limit: int = 12000) -> str:
    """The stacks ``faulthandler`` wrote, the thread that received the signal first (faulthandler
    writes it first), without its list of loaded extension modules (one per compiled kernel)."""
    with open(path, errors="replace") as f:
        lines = [line for line in f.read().splitlines() if not line.startswith("Extension modules:")]
    text = "\n".join(lines).strip()
    return text if len(text) <= limit else text[:limit] + "\n[... cut]"


def _stderr_tail(path: str, limit: int = 4000) -> str:
    """The end of what a rank wrote to its file descriptor 2 (Python's warnings among it)."""
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        text = f.read().strip()
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


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
        values = pool.run(fn, args, dict(env or {}), timeout_s)
    except BaseException:
        del _POOLS[key]
        pool.kill()
        raise
    if pool.groups_held > MAX_GROUPS_HELD:
        del _POOLS[key]
        pool.close()
    return values


@atexit.register
def shutdown_workers() -> None:
    """Stop every kept process cleanly (barrier, then destroy the process group)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()
