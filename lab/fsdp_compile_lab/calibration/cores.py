"""Ranks sharing a machine's cores, as the calibrations see it (``HostCPU.compute_in_turns`` and
``HostCPU.beside_collectives``, the hooks ``Cluster.measure(host=HostCPU)`` calls)."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fsdp_compile.planning.calibration.compute import _node_ranks

T = TypeVar("T")


def _machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cores_per_thread() -> float:
    """This node's cores over the compute threads its ranks run (ranks x intra-op threads)."""
    return _machine_cores() / (max(_node_ranks(), 1) * torch.get_num_threads())


def _cpu_share(device: torch.device) -> float:
    """The share of a core each rank's compute gets from its own job: below 1 where this node's
    ranks (times their intra-op threads) outnumber its cores. A thread's CPU time does not see
    that sharing; a step's wall clock does."""
    return 1.0 if device.type != "cpu" else min(1.0, _cores_per_thread())


def in_turns(calibrate: Callable[[float], T], group: Any, device: torch.device) -> T:
    """Run a compute calibration ``calibrate(share)`` on every rank of ``group`` and return this
    rank's result.

    Side by side (share 1: the calibration barriers before each timing) where every rank has a
    core. Where this node's ranks outnumber its cores they take turns, as many at a time as
    there are cores: ranks time-slicing a core evict each other's caches within one short timing,
    which a step's long operators do not suffer; the sharing is modelled once, by the stretch."""
    share = _cpu_share(device)
    if share >= 1.0 or not dist.is_initialized():
        return calibrate(share)
    turns = math.ceil(1.0 / share)
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank()
    result = None
    for turn in range(turns):
        if local_rank % turns == turn:
            result = calibrate(share)
        dist.barrier(group=group)
    return result


@contextlib.contextmanager
def beside_compute(device: torch.device) -> Iterator[None]:
    """While open, a thread of this rank runs matmuls if this node's ranks fill its cores, one
    rank per core: a training step's collectives run beside its compute, and gloo's threads
    then wait for a core.

    Not where the ranks outnumber the cores (4 ranks on 2): there the computing threads starve
    the ranks' own threads of the wake-ups a burst needs, and on some hosts the timings became
    noise (the figures: :mod:`fsdp_compile_lab.calibration`). On an emulated link the computing
    thread also delays each wake-up from a wait, as it does in a step, so a fit can come out a
    few percent off the link's speed."""
    if device.type != "cpu" or _cores_per_thread() != 1.0:
        yield
        return
    stop = threading.Event()
    operand = torch.randn(256, 256)

    def compute() -> None:
        while not stop.is_set():
            torch.mm(operand, operand)  # releases the GIL: the timing thread is not held up

    thread = threading.Thread(target=compute, name="calibration-compute", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
