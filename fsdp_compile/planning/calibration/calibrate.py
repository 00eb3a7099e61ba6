"""``Cluster.measure()``: calibrate the planner's numbers on the machine it runs on.

Every rank runs the same measurements in the same order, side by side (a barrier before each: in training ranks share
the machine's caches and memory), each the slowest rank's, so all ranks get the same cluster. A compute timing is the
fastest repeat (noise only adds time), except matmuls and attention, which a step runs once each: their median pass
counts. A collective's is the median (its spread is its own, and a step pays the typical one). On a CPU with one
intra-op thread compute is timed by the thread's CPU time: waits for a core belong to other jobs. A host model may run
the compute calibrations in turns (``compute_in_turns``), time the collectives beside compute (``beside_collectives``),
and adds its own numbers last (``calibrate``). The calibrations: :mod:`.compute`, :mod:`.outside_graphs`,
:mod:`.collective_fits`, :mod:`.allocator`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..host_model import HostCalibration, HostModel
from ..vocabulary import ClusterError
from .allocator import _cpu_memory_per_rank
from .collective_fits import _collective_workspace, _collectives, _gpu_overlap
from .compute import _slowest, measure_attention_flops, measure_matmul_flops, measure_memory_bandwidth
from .outside_graphs import _optimizer_step, _runtime_per_tensor

if TYPE_CHECKING:
    from ..cluster import Cluster


def _link_groups(group: Any, nodes: int) -> tuple[Any, Any]:
    """This rank's groups to time each link on: (intra-node, inter-node; None on one node).

    Over several nodes a group is bound by the slowest link it spans: the intra-node link is timed on groups of one
    node's ranks, the inter-node one on groups of one rank per node (a hybrid strategy's replicate groups). Collective:
    every rank creates every group, once.
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


def _collectives_per_link(groups: tuple[Any, Any], device: torch.device, sizes: tuple[int, ...], repeats: int,
                          network: Any = None, beside: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The collectives' fits on each link of :func:`_link_groups`: (intra-node, inter-node), each set run on all its
    groups at once, as a training step runs them (:func:`.collective_fits._collectives`)."""
    intra, inter = groups
    return (_collectives(intra, device, sizes, repeats, network, beside),
            {} if inter is None else _collectives(inter, device, sizes, repeats, network, beside))


def _side_by_side(calibrate: Callable[[float], Any], group: Any, device: torch.device) -> Any:
    """A compute calibration on every rank at once, each with a core (no host model's turns)."""
    return calibrate(1.0)


def _default_sizes(device: torch.device) -> tuple[int, ...]:
    return (1 << 16, 1 << 18, 1 << 20, 1 << 22) if device.type == "cpu" else (1 << 20, 1 << 24, 1 << 27)


def _link_fields(collectives: dict[str, Any], inter_collectives: dict[str, Any]) -> dict[str, Any]:
    """A cluster's link numbers from each link's fits (the all-gather's sets the bandwidths and latencies)."""
    ring = collectives["all_gather"]
    inter_ring = inter_collectives.get("all_gather", ring)
    return {"intra_node_bandwidth": ring.bandwidth, "inter_node_bandwidth": inter_ring.bandwidth,
            "intra_node_latency": ring.step_latency, "inter_node_latency": inter_ring.step_latency,
            "measured_collectives": collectives, "measured_inter_collectives": inter_collectives}


def _emulated_network(group: Any) -> Any:
    """The network model ``group``'s links run on (an :class:`~fsdp_compile.EmulatedNetwork`'s process group keeps it as
    ``network``), or None."""
    process_group = group if group is not None else dist.group.WORLD
    return getattr(process_group, "network", None)


def measure_cluster(cls: type[Cluster], *, group: Any, sizes: tuple[int, ...] | None, repeats: int,
                    dtypes: tuple[torch.dtype, ...], nodes: int, device: torch.device | str | None,
                    device_memory: float | None, host: type[HostModel] | None = None) -> Cluster:
    """:meth:`Cluster.measure` (its arguments): every calibration on every rank of ``group``."""
    if not dist.is_initialized():
        raise ClusterError("Cluster.measure() measures the current process groups: call "
                           "torch.distributed.init_process_group() first (torchrun sets it up)")
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    world = dist.get_world_size(group)
    if world % nodes:
        raise ClusterError(f"nodes={nodes} does not divide the group's {world} ranks")
    sizes = sizes or _default_sizes(device)
    turns = host.compute_in_turns if host is not None else _side_by_side

    def fastest_rate(calibrate: Callable[[float], float]) -> float:
        return -_slowest(-turns(calibrate, group, device), group)  # the slowest rank's rate

    # Two rounds over the dtypes, the faster kept: a slowdown of the machine lasting seconds (another tenant, frequency
    # scaling) can outlast all repeats of one round, not both rounds.
    flops: dict[torch.dtype, float] = {}
    for _ in range(2):
        for dtype in dtypes:
            rate = fastest_rate(lambda share, dtype=dtype: measure_matmul_flops(dtype, device, repeats, group, share))
            flops[dtype] = max(flops.get(dtype, 0.0), rate)
    attention = {dtype: fastest_rate(
        lambda share, dtype=dtype: measure_attention_flops(dtype, device, repeats, group, share)) for dtype in dtypes}
    bandwidth = fastest_rate(lambda share: measure_memory_bandwidth(device, repeats, group, share))
    optimizer_step = {
        name: tuple(_slowest(v, group) for v in turns(
            lambda share, name=name: _optimizer_step(name, group, device, repeats, share), group, device))
        for name in ("adamw", "sgd")}
    runtime_per_tensor = _slowest(turns(lambda share: _runtime_per_tensor(group, device, repeats, share),
                                        group, device), group)
    link_groups = _link_groups(group, nodes)
    network = _emulated_network(group)
    # On a network model, the links' fits are what its links charge (its model), not the wall time.
    collectives, inter_collectives = _collectives_per_link(link_groups, device, sizes, repeats, network,
                                                           host.beside_collectives if host is not None else None)
    workspace = _collective_workspace(group, device)
    # Nothing of a CPU's collective is hidden or not by the overlap share, which is a GPU's (a race against a copy
    # engine); what its backend's threads take from compute is a host model's.
    overlap = 1.0 if device.type == "cpu" else _gpu_overlap(group, device, repeats)
    if device_memory is None:
        device_memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                         else _cpu_memory_per_rank())
    where = f"measured by Cluster.measure() ({time.strftime('%Y-%m-%d %H:%M')}, world {world}, {device.type})"
    measured = ["peak_flops", "attention_flops", "memory_bandwidth", "collectives", "comm_overlap", "optimizer_step",
                "runtime_per_tensor", "collective_workspace", "device_memory"]
    cluster = cls(
        name=f"measured-{device.type}", nodes=nodes, devices_per_node=world // nodes,
        device_memory=float(device_memory), peak_flops=flops, memory_bandwidth=bandwidth,
        **_link_fields(collectives, inter_collectives),
        collective_latency=0.0, reserved_memory=0.0, comm_overlap=overlap,
        runtime_per_tensor=runtime_per_tensor, attention_flops=attention, device_type=device.type,
        optimizer_step=optimizer_step, collective_workspace=workspace,
        sources=dict.fromkeys(measured, where))
    if host is None:
        return cluster
    model = host.calibrate(cluster, HostCalibration(group, link_groups, device, sizes, repeats, network))
    return cluster.replace(host=model, sources={**cluster.sources, **dict.fromkeys(model.numbers(), where)})
