"""``Cluster.measure()``: calibrate the planner's numbers on the machine it runs on.

Collective over the group: every rank runs the same measurements in the same order, at the
same time (a barrier before each: in training the ranks compute side by side and share the
machine's caches and memory), and each timing is the slowest rank's (a step waits for the
slowest rank), so all ranks get the same cluster.

Each compute timing is the fastest of several repeats: noise (other processes, interrupts)
only ever adds time, so the fastest repeat is the closest to what the machine does. Matmuls
and attention are the exception: a step runs each of them once, after other operators, so
they are timed as a pass over every shape and the median pass counts
(:func:`.compute._matmul_flops`). A collective's time is the median: its spread is the
collective's own (the backend's threads waking on every rank, fresh buffers), a step pays the
typical one, and on a shared 2-core CPU machine the median 1-16 MB gloo collective took
1.2-4x the fastest. On a CPU whose ops run on one thread, compute is timed by the thread's
CPU time, not the wall clock: on a shared machine a rank waits for a core whenever other jobs
hold it, and that wait belongs to the other jobs, not to the operator
(``bench/plan_accuracy.py`` measures it separately). When the job's own ranks outnumber the
cores (a 2 x 2 hybrid world on 2 cores), each rank gets a share of a core: the operators'
calibrations run in turns, a core per rank (:func:`_in_turns`), and compute times, and the
CPU time communication takes from compute, are stretched by that share
(:func:`.compute._cpu_share`). The reference step (:mod:`.reference`) does not take turns:
it runs on every rank at once, so ``compute_scale`` carries what ranks time-slicing a core
cost each other's caches into the price of every operator.

The calibrations themselves: :mod:`.compute` (FLOP/s, memory bandwidth, operator overhead,
and the clocks), :mod:`.outside_graphs` (optimizer step, runtime work per parameter),
:mod:`.copies` (the backend's copies around each collective), :mod:`.reference` (a whole
graph's measured compute over its priced cost), :mod:`.collectives` (ring fits,
issuing, workspace, overlap), :mod:`.drift` (how far ranks sharing cores drift apart) and
:mod:`.memory` (allocator peaks, a CPU rank's memory).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..numbers import ClusterError
from .collectives import (
    _backend_share,
    _collective_cpu,
    _collective_workspace,
    _collectives,
    _gpu_overlap,
    _issue_seconds,
    _rank_skew,
)
from .compute import _attention_flops, _cpu_share, _matmul_flops, _memory_bandwidth, _op_overhead, _slowest
from .copies import _copy_kernels
from .drift import core_sharing, rank_drift
from .memory import _cpu_memory_per_rank
from .outside_graphs import _optimizer_step, _runtime_per_tensor
from .reference import compute_scale, timed_reference

if TYPE_CHECKING:
    from ..cluster import Cluster


def _in_turns(calibrate, group: Any, device: torch.device):
    """Run a compute calibration ``calibrate(sync)`` on every rank of ``group`` and return this
    rank's result.

    Side by side (``sync=True``: the calibration barriers before each timing) when every rank
    has a core, as ranks compute in training. When this node's ranks outnumber its cores (a
    2 x 2 hybrid world on 2 cores) they take turns, as many at a time as there are cores:
    ranks time-slicing one core evict each other's caches within a single short timing, which
    a training step's long operators do not suffer, so each calibration sees a core of its
    own and the sharing is modelled once, by stretching compute with :func:`.compute._cpu_share`."""
    share = _cpu_share(device)
    if share >= 1.0 or not dist.is_initialized():
        return calibrate(True)
    turns = math.ceil(1.0 / share)
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else dist.get_rank()
    result = None
    for turn in range(turns):
        if local_rank % turns == turn:
            result = calibrate(False)
        dist.barrier(group=group)
    return result


def _link_groups(group: Any, nodes: int) -> tuple[Any, Any]:
    """This rank's groups to time each link on: (intra-node, inter-node; None on one node).

    On one node every collective runs on the intra-node link: ``group`` is timed. Over several
    nodes the two links differ (NVLink and InfiniBand; an emulated network's two rates), and a
    group is bound by the slowest link it spans: the intra-node link is timed on the groups of
    one node's ranks, the inter-node one on the groups of one rank per node (what a hybrid
    strategy's replicate groups are). Collective: every rank creates every group, in the same
    order, so create them once per calibration.
    """
    if nodes <= 1:
        return group, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    per_node = len(ranks) // nodes
    me = dist.get_rank()
    mine = []
    for layout in ([ranks[i * per_node:(i + 1) * per_node] for i in range(nodes)],  # one node each
                   [ranks[i::per_node] for i in range(per_node)]):  # one rank per node each
        for members in layout:
            created = dist.new_group(members)
            if me in members:
                mine.append(created)
    return mine[0], mine[1]


def _collectives_per_link(groups: tuple[Any, Any], device: torch.device, sizes: tuple[int, ...],
                          repeats: int, network: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The collectives' fits on each link of :func:`_link_groups`: (intra-node, inter-node), each
    set run on all its groups at once, as a training step runs them; timed, or on ``network``
    (an emulated network) read from what its links charged."""
    intra, inter = groups
    return (_collectives(intra, device, sizes, repeats, network),
            {} if inter is None else _collectives(inter, device, sizes, repeats, network))


def _default_sizes(device: torch.device) -> tuple[int, ...]:
    return (1 << 16, 1 << 18, 1 << 20, 1 << 22) if device.type == "cpu" else (1 << 20, 1 << 24, 1 << 27)


def _link_fields(collectives: dict[str, Any], inter_collectives: dict[str, Any]) -> dict[str, Any]:
    """A cluster's link numbers from the collectives' fits on each link (the all-gather's ring
    sets the bandwidths and latencies that collectives without a fit are priced from)."""
    ring = collectives["all_gather"]
    inter_ring = inter_collectives.get("all_gather", ring)
    return {"intra_node_bandwidth": ring.bandwidth, "inter_node_bandwidth": inter_ring.bandwidth,
            "intra_node_latency": ring.step_latency, "inter_node_latency": inter_ring.step_latency,
            "measured_collectives": collectives, "measured_inter_collectives": inter_collectives}


def _emulated_network(group: Any) -> Any:
    """The :class:`~fsdp_compile.EmulatedNetwork` ``group`` runs on, or None."""
    from ...network.emulated import EmulatedProcessGroup

    process_group = group if group is not None else dist.group.WORLD
    return process_group.network if isinstance(process_group, EmulatedProcessGroup) else None


def _backend_collectives(network: Any, groups: tuple[Any, Any], device: torch.device, sizes: tuple[int, ...],
                         repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The backend's own fits on each link, where they differ from the links' (``network``, the
    emulated network ``groups`` (:func:`_link_groups`) run on: timed with its links unlimited for
    the while); ({}, {}) elsewhere (``network`` None)."""
    from ...network.links import unlimited_links

    if network is None or device.type != "cpu":
        return {}, {}
    with unlimited_links(network):
        return _collectives_per_link(groups, device, sizes, repeats)


def backend_links(cluster: Cluster) -> Cluster:
    """``cluster`` with its links at the backend's own speed: what it is on an emulated
    network's links made unlimited (``compare --exposed`` plans each strategy both ways from one
    calibration, so that the predicted difference is the links' alone)."""
    if cluster.host is None or not cluster.host.backend_collectives:
        raise ClusterError(f"cluster {cluster.name!r} has no backend_collectives: measure it with Cluster.measure() "
                           "on an EmulatedNetwork, whose links it then times unlimited too")
    return cluster.replace(**_link_fields(cluster.host.backend_collectives, cluster.host.backend_inter_collectives)
                           ).with_host(backend_collectives={}, backend_inter_collectives={})


def measure_cluster(cls: type[Cluster], *, group: Any, sizes: tuple[int, ...] | None, repeats: int,
                    dtypes: tuple[torch.dtype, ...], nodes: int, device: torch.device | str | None,
                    device_memory: float | None) -> Cluster:
    """Run every calibration on every rank of ``group`` and build a ``cls`` from the results
    (see :meth:`Cluster.measure` for the arguments)."""
    if not dist.is_initialized():
        raise ClusterError("Cluster.measure() measures the current process groups: call "
                           "torch.distributed.init_process_group() first (torchrun sets it up)")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    world = dist.get_world_size(group)
    if world % nodes:
        raise ClusterError(f"nodes={nodes} does not divide the group's {world} ranks")
    sizes = sizes or _default_sizes(device)
    # _slowest takes the largest value: negated, it gives the slowest rank's rate
    # Two rounds over the dtypes, the faster kept: a slowdown of the machine lasting seconds
    # (another tenant, frequency scaling) can outlast all repeats of one round, not both rounds.
    flops: dict[torch.dtype, float] = {}
    for _ in range(2):
        for dtype in dtypes:
            rate = -_slowest(-_in_turns(lambda sync, dtype=dtype: _matmul_flops(dtype, device, repeats, group, sync),
                                        group, device), group)
            flops[dtype] = max(flops.get(dtype, 0.0), rate)
    attention = {dtype: -_slowest(-_in_turns(
        lambda sync, dtype=dtype: _attention_flops(dtype, device, repeats, group, sync), group, device), group)
        for dtype in dtypes}
    bandwidth = -_slowest(-_in_turns(lambda sync: _memory_bandwidth(device, repeats, group, sync), group, device),
                          group)
    overhead = (_slowest(_in_turns(lambda sync: _op_overhead(device, repeats), group, device), group)
                if device.type == "cpu" else 0.0)
    optimizer_step = {
        name: tuple(_slowest(v, group) for v in _in_turns(
            lambda sync, name=name: _optimizer_step(name, group, device, repeats, sync), group, device))
        for name in ("adamw", "sgd")}
    runtime_per_tensor = _slowest(_in_turns(lambda sync: _runtime_per_tensor(group, device, repeats, sync),
                                            group, device), group)
    copy_kernels = {name: tuple(_slowest(v, group) for v in fit) for name, fit in _in_turns(
        lambda sync: _copy_kernels(group, device, repeats, sync), group, device).items()}
    # Not in turns: what ranks time-slicing a core cost each other is part of what it measures.
    reference_seconds, reference_graphs = timed_reference(repeats, device, group, sync=True)
    reference_seconds = _slowest(reference_seconds, group)
    link_groups = _link_groups(group, nodes)
    network = _emulated_network(group)
    # On an emulated network, the links' fits are what its links charge (its model), gloo's are timed apart.
    collectives, inter_collectives = _collectives_per_link(link_groups, device, sizes, repeats, network)
    backend, backend_inter = _backend_collectives(network, link_groups, device, sizes, repeats)
    collective_issue = _issue_seconds(group, device, sizes, repeats)
    workspace = _collective_workspace(group, device)
    # A CPU's communication threads take compute's cores: their CPU seconds per collective, read
    # from clocks (not from a race), are priced as such; nothing else of a collective is hidden
    # or not by the overlap share, which is a GPU's (a race against a copy engine).
    collective_cpu = _collective_cpu(group, device, sizes, repeats) if device.type == "cpu" else {}
    rank_skew = _rank_skew(group, device, repeats)
    drift = rank_drift(group, device, repeats)
    overlap = 1.0 if device.type == "cpu" else _gpu_overlap(group, device, repeats)
    if device_memory is None:
        device_memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                         else _cpu_memory_per_rank())
    where = f"measured by Cluster.measure() ({time.strftime('%Y-%m-%d %H:%M')}, world {world}, {device.type})"
    measured = ["peak_flops", "attention_flops", "memory_bandwidth", "collectives", "comm_overlap", "optimizer_step",
                "runtime_per_tensor", "collective_workspace", "device_memory"]
    host = None
    if device.type == "cpu":
        from ..host import HostCPU

        host = HostCPU(op_overhead=overhead, copy_kernels=copy_kernels, collective_issue=collective_issue,
                       collective_cpu=collective_cpu, backend_collectives=backend,
                       backend_inter_collectives=backend_inter, backend_share=_backend_share(device),
                       rank_skew=rank_skew, core_sharing=core_sharing(device) if drift > 0 else None,
                       rank_drift=drift)
        measured += ["op_overhead", "copy_kernels", "collective_issue", "collective_cpu", "rank_skew", "core_sharing",
                     "rank_drift", "compute_scale", "backend_collectives", "backend_share"]
    cluster = cls(
        name=f"measured-{device.type}", nodes=nodes, devices_per_node=world // nodes,
        device_memory=float(device_memory), peak_flops=flops, memory_bandwidth=bandwidth,
        **_link_fields(collectives, inter_collectives),
        collective_latency=0.0, reserved_memory=0.0, comm_overlap=overlap,
        runtime_per_tensor=runtime_per_tensor, attention_flops=attention, device_type=device.type,
        optimizer_step=optimizer_step, collective_workspace=workspace, host=host,
        sources=dict.fromkeys(measured, where))
    if host is None:
        return cluster
    # The same on every rank: each priced the same graphs on the same (slowest-rank) numbers.
    return cluster.with_host(compute_scale=compute_scale(reference_seconds, reference_graphs, cluster))
