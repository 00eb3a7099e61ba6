"""``Cluster.measure()``: calibrate the planner's numbers on the machine it runs on.

Collective over the group: every rank runs the same measurements in the same order, and each
timing is the slowest rank's (a step waits for the slowest rank), so all ranks get the same
cluster. Timings are medians of several repeats.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from .cluster import (
    COLLECTIVE_KINDS,
    Cluster,
    ClusterError,
    MeasuredCollective,
    _fit_line,
)

_c10d = torch.ops._c10d_functional


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _slowest(value: float, group: Any) -> float:
    """The largest of every rank's ``value`` (all ranks get the same number)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _matmul_flops(dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    best = 0.0
    sizes = (256, 512, 1024) if device.type == "cpu" else (2048, 4096, 8192)
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _median_time(lambda a=a, b=b: torch.mm(a, b), repeats, device)
        best = max(best, 2 * n ** 3 / seconds)
    return best


def _memory_bandwidth(device: torch.device, repeats: int) -> float:
    numel = (64 << 20) if device.type == "cpu" else (256 << 20)
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() * src.element_size() / seconds  # read + write


def _op_overhead(device: torch.device, repeats: int) -> float:
    """Seconds per operator of a graph run as Python (aot_eager), on tiny tensors."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    value = x
    count = 200
    for _ in range(count):
        value = graph.call_function(torch.ops.aten.add.Tensor, (value, x))
    graph.output(value)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    tiny = torch.ones(1, device=device)
    return _median_time(lambda: gm(tiny), repeats, device) / count


def _wire_bytes(kind: str, buffer_bytes: int, n: int) -> float:
    share = (n - 1) / n
    return buffer_bytes * share * (2 if kind == "all_reduce" else 1)


def ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def _run_collective(kind: str, buffer: torch.Tensor, n: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather":
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(buffer, n, group_name))
    if kind == "reduce_scatter":
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(buffer, "sum", n, group_name))
    return _c10d.wait_tensor(_c10d.all_reduce(buffer, "sum", group_name))


def _collectives(group: Any, device: torch.device, sizes: tuple[int, ...], repeats: int) -> dict[str, MeasuredCollective]:
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    fits = {}
    for kind in COLLECTIVE_KINDS:
        samples = []
        for size in sizes:
            # all-gather's buffer is its output; each rank contributes 1/n of it
            numel = max(n, size // 4 // n * n)
            local = torch.ones(numel // n if kind == "all_gather" else numel, device=device)
            dist.barrier(group=group)
            seconds = _slowest(_median_time(lambda kind=kind, local=local: _run_collective(kind, local, n, name),
                                                repeats, device), group)
            samples.append((numel * 4, seconds))
        latency, per_byte = _fit_line([(_wire_bytes(kind, b, n), s) for b, s in samples])
        fits[kind] = MeasuredCollective(step_latency=latency / max(ring_steps(kind, n), 1),
                                        bandwidth=1.0 / per_byte, group_size=n, samples=tuple(samples))
    return fits


def _overlap(group: Any, device: torch.device, repeats: int) -> float:
    """Fraction of a collective's time hidden when it runs beside compute (1: fully hidden)."""
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    a = torch.randn(384, 384, device=device)
    buffer = torch.ones(4 << 20, device=device)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    def comm() -> None:
        _run_collective("all_reduce", buffer, n, name)

    def both() -> None:
        work = _c10d.all_reduce(buffer, "sum", name)
        compute()
        _c10d.wait_tensor(work)

    dist.barrier(group=group)
    t_compute = _slowest(_median_time(compute, repeats, device), group)
    dist.barrier(group=group)
    t_comm = _slowest(_median_time(comm, repeats, device), group)
    dist.barrier(group=group)
    t_both = _slowest(_median_time(both, repeats, device), group)
    hidden = t_compute + t_comm - t_both
    return min(max(hidden / min(t_compute, t_comm), 0.0), 1.0)


def _cpu_memory_per_rank() -> float:
    try:
        with open("/proc/meminfo") as f:
            total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        raise ClusterError("cannot read this machine's memory size; pass device_memory= to Cluster.measure()") from None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return total_kib * 1024 / max(ranks, 1)


def measure_cluster(cls: type[Cluster], *, group: Any, sizes: tuple[int, ...] | None, repeats: int,
                    dtypes: tuple[torch.dtype, ...], nodes: int, device: torch.device | str | None,
                    device_memory: float | None) -> Cluster:
    if not dist.is_initialized():
        raise ClusterError("Cluster.measure() measures the current process groups: call "
                           "torch.distributed.init_process_group() first (torchrun sets it up)")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    world = dist.get_world_size(group)
    if world % nodes:
        raise ClusterError(f"nodes={nodes} does not divide the group's {world} ranks")
    if sizes is None:
        sizes = (1 << 16, 1 << 18, 1 << 20, 1 << 22) if device.type == "cpu" else (1 << 20, 1 << 24, 1 << 27)
    # _slowest takes the largest value: negated, it gives the slowest rank's rate
    flops = {dtype: -_slowest(-_matmul_flops(dtype, device, repeats), group) for dtype in dtypes}
    bandwidth = -_slowest(-_memory_bandwidth(device, repeats), group)
    overhead = _slowest(_op_overhead(device, repeats), group) if device.type == "cpu" else 0.0
    collectives = _collectives(group, device, sizes, repeats)
    overlap = _overlap(group, device, repeats)
    if device_memory is None:
        device_memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                         else _cpu_memory_per_rank())
    ring = collectives["all_gather"]
    where = f"measured on this machine ({time.strftime('%Y-%m-%d %H:%M')}, world {world}, {device.type})"
    return cls(
        name=f"measured-{device.type}", nodes=nodes, devices_per_node=world // nodes,
        device_memory=float(device_memory), peak_flops=flops, memory_bandwidth=bandwidth,
        intra_node_bandwidth=ring.bandwidth, inter_node_bandwidth=ring.bandwidth,
        intra_node_latency=ring.step_latency, inter_node_latency=ring.step_latency,
        collective_latency=0.0, reserved_memory=0.0, op_overhead=overhead, comm_overlap=overlap,
        device_type=device.type, measured_collectives=collectives,
        sources={key: where for key in ("peak_flops", "memory_bandwidth", "collectives", "op_overhead",
                                         "comm_overlap", "device_memory")})
