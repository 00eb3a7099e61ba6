"""Memory as the allocator sees it: the running sum of a profile's allocations and frees, the peak a function allocates
(a collective's workspace, ``compare``'s step peak), and the memory a rank may plan against on a CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..vocabulary import ClusterError
from .compute import _node_ranks

# Above every level kineto logs at: on torch 2.13 its "USDT: ... profiler_start" and "profiler_stop" lines go to stderr
# at every level up to 5.
_KINETO_QUIET = "6"


def quiet_profiler() -> None:
    """Keep the profiler's C++ logging out of the tools' output unless ``KINETO_LOG_LEVEL`` asks for it. Kineto reads
    the level at a process's first profile: call this before it."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)


def allocation_records(prof: Any) -> list[tuple[int, int, int]]:
    """Every CPU allocation and free a profile (``profile_memory=True``) recorded, on any thread, as ``(time ns,
    address, bytes)`` in time order (frees negative)."""
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
    """The largest running sum of allocations minus frees, in bytes beyond what was allocated before the first record.

    Records are ordered by timestamps taken on the threads that allocate and free: a free recorded on one thread can
    carry a later time than an allocation on another thread that already reuses its address. An address is never handed
    out twice, so an allocation of an address still live in the sum closes the earlier allocation first; summed naively,
    the buffer counts twice (spikes of megabytes in some steps of a hybrid world on a CPU).
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


def _allocated_peak(fn, device: torch.device, events: list | None = None) -> tuple[float, Any]:
    """Bytes the allocator handed out at the peak while ``fn`` ran, beyond what was allocated before it (the profiler's
    memory events on a CPU, the caching allocator's peak on a GPU), and ``fn``'s result. ``events``: receives the
    profiler's events, with their shapes."""
    from torch.profiler import ProfilerActivity, profile

    quiet_profiler()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda, record_shapes=events is not None) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize(device)
    if events is not None:
        events.extend(prof.profiler.kineto_results.events())
    if cuda:
        return float(torch.cuda.max_memory_allocated(device) - before), result
    return float(allocator_peak(allocation_records(prof))), result


def _cpu_memory_per_rank() -> float:
    """This node's memory (``MemTotal``) split evenly between the job's ranks on it."""
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        raise ClusterError("cannot read the host's memory size; pass device_memory= to Cluster.measure()") from None
    return total_kib * 1024 / max(_node_ranks(), 1)
