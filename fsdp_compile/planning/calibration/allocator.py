"""Memory as the allocator sees it: the running sum of a profile's allocations and frees, the
peak a function allocates, and the memory a rank may plan against on a CPU.

:meth:`Cluster.measure` uses these for what a collective allocates beside its result and for
the default ``device_memory`` on a CPU; the planner's comparison with a real run and the
training-step benchmark read a step's peak with the same records.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..vocabulary import ClusterError
from .compute import _node_ranks

# Above every level kineto logs at: on torch 2.13 its "USDT: ... profiler_start" and
# "profiler_stop" lines go to stderr at every level up to 5.
_KINETO_QUIET = "6"


def quiet_profiler() -> None:
    """Keep the profiler's own C++ logging out of the tools' output (a tool's output is its
    table), unless the user asked for it by setting ``KINETO_LOG_LEVEL``.

    Kineto reads the level once, when the process starts its first profile: call this before
    profiling. A process that profiled before keeps the level it started with.
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)


def allocation_records(prof: Any) -> list[tuple[int, int, int]]:
    """Every CPU allocation and free a profile (``profile_memory=True``) recorded, on any
    thread, as ``(time ns, address, bytes)`` in time order (frees negative)."""
    from torch._C._profiler import _EventType

    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            records.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(records)


def allocator_peak(records: list[tuple[int, int, int]]) -> int:
    """The largest running sum of allocations minus frees, in bytes beyond what was allocated
    before the first record.

    Records are ordered by timestamps taken on the threads that allocate and free: a free
    recorded on one thread can carry a later time than an allocation on another thread that
    already reuses its address. An address is never handed out twice, so an allocation of an
    address still live in the sum closes the earlier allocation first; summed naively, the
    buffer counts twice (spikes of megabytes in some steps of a hybrid world on a CPU).
    """
    live: dict[int, int] = {}
    running = peak = 0
    for _, address, nbytes in records:
        if nbytes > 0:
            running += nbytes - live.pop(address, 0)
            live[address] = nbytes
        else:
            # a free of memory allocated before the records began is counted as it is
            running -= live.pop(address, -nbytes)
        peak = max(peak, running)
    return peak


def _allocated_peak(fn, device: torch.device) -> tuple[float, Any]:
    """Bytes the allocator handed out at the peak while ``fn`` ran, beyond what was allocated
    before it (the profiler's memory events on a CPU, the caching allocator's peak on a GPU),
    and ``fn``'s result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before), result
    from torch.profiler import ProfilerActivity, profile

    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return float(allocator_peak(allocation_records(prof))), result


def _cpu_memory_per_rank() -> float:
    """This node's memory (``MemTotal``) split evenly between the job's ranks on it."""
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        raise ClusterError("cannot read the host's memory size; pass device_memory= to Cluster.measure()") from None
    return total_kib * 1024 / max(_node_ranks(), 1)
