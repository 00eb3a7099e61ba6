"""The host-CPU model's calibration: what :meth:`HostCPU.calibrate <.host.HostCPU.calibrate>` runs
after ``Cluster.measure()`` has measured the device's own numbers.

In order, on every rank of the group at once and each the slowest rank's, it measures: the
per-operator overhead of a graph run as Python (``op_overhead``); the backend's copies around
each collective, each the real op on cold operands (``copy_kernels``, :mod:`.copies`); the
``compute_scale`` of a one-block GPT's forward and backward graphs run for real (the median of
``repeats``, at least 5) over their cost priced from the cluster's numbers
(:mod:`.reference`); on an
:class:`~fsdp_compile.EmulatedNetwork`, gloo's own fits, the same collectives timed again with
its links unlimited (``backend_collectives``); the issuing thread's time to start each kind
(``collective_issue``), the CPU seconds gloo's threads spend per collective (``collective_cpu``)
and how fast their work goes while the rank computes (``backend_share``); and where this node's
ranks outnumber its cores, the skew a collective waits for (``rank_skew``) and how far the ranks
drift apart computing side by side (``core_sharing``, ``rank_drift``: :mod:`.drift`).

The operators' calibrations run in turns where ranks outnumber the cores, as the device's do
(:func:`.cores.in_turns`); the reference step does not:
what ranks time-slicing a core cost each other's caches is part of what it measures.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from fsdp_compile.network.links import unlimited_links
from fsdp_compile.planning.calibration.calibrate import _collectives_per_link, _link_fields
from fsdp_compile.planning.calibration.compute import _compute_seconds, _slowest
from fsdp_compile.planning.cluster import Cluster
from fsdp_compile.planning.host_model import HostCalibration
from fsdp_compile.planning.vocabulary import ClusterError

from .copies import _copy_kernels
from .cores import _cpu_share, beside_compute, in_turns
from .drift import core_sharing, rank_drift
from .host_collectives import _backend_share, _collective_cpu, _issue_seconds, _rank_skew
from .reference import compute_scale, timed_reference


def time_op_overhead(device: torch.device, repeats: int) -> float:
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
    return _compute_seconds(lambda: gm(tiny), repeats, device, share=_cpu_share(device)) / count


def _backend_collectives(network: Any, groups: tuple[Any, Any], device: torch.device, sizes: tuple[int, ...],
                         repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The backend's own fits on each link, where they differ from the links' (``network``, the
    emulated network ``groups`` run on: timed with its links unlimited for the while); ({}, {})
    elsewhere (``network`` None)."""
    if network is None or device.type != "cpu":
        return {}, {}
    with unlimited_links(network):
        return _collectives_per_link(groups, device, sizes, repeats, beside=beside_compute)


def backend_links(cluster: Cluster) -> Cluster:
    """``cluster`` with its links at the backend's own speed: what it is on an emulated
    network's links made unlimited (``compare --exposed`` plans each strategy both ways from one
    calibration, so that the predicted difference is the links' alone)."""
    if cluster.host is None or not getattr(cluster.host, "backend_collectives", None):
        raise ClusterError(f"cluster {cluster.name!r} has no backend_collectives: measure it with Cluster.measure("
                           "host=HostCPU) on an EmulatedNetwork, whose links it then times unlimited too")
    return cluster.replace(**_link_fields(cluster.host.backend_collectives, cluster.host.backend_inter_collectives)
                           ).with_host(backend_collectives={}, backend_inter_collectives={})


def host_numbers(cluster: Cluster, calibration: HostCalibration) -> dict[str, Any]:
    """Every number of a :class:`~..host.HostCPU` but ``compute_scale``, measured on every rank of
    ``calibration.group``; none on a device other than a CPU (the defaults add nothing)."""
    group, device, sizes, repeats = calibration.group, calibration.device, calibration.sizes, calibration.repeats
    if device.type != "cpu":
        return {}
    overhead = _slowest(in_turns(lambda share: time_op_overhead(device, repeats), group, device), group)
    copy_kernels = {name: tuple(_slowest(v, group) for v in fit) for name, fit in in_turns(
        lambda share: _copy_kernels(group, device, repeats, share), group, device).items()}
    backend, backend_inter = _backend_collectives(calibration.network, calibration.link_groups, device, sizes,
                                                  repeats)
    drift = rank_drift(group, device, repeats)
    return {"op_overhead": overhead, "copy_kernels": copy_kernels,
            "collective_issue": _issue_seconds(group, device, sizes, repeats),
            # A CPU's communication threads take compute's cores: their CPU seconds per collective,
            # read from clocks (not from a race), are priced as such.
            "collective_cpu": _collective_cpu(group, device, sizes, repeats),
            "backend_collectives": backend, "backend_inter_collectives": backend_inter,
            "backend_share": _backend_share(device), "rank_skew": _rank_skew(group, device, repeats),
            "core_sharing": core_sharing(device) if drift > 0 else None, "rank_drift": drift}


def measured_compute_scale(cluster: Cluster, calibration: HostCalibration) -> float:
    """``compute_scale`` for ``cluster`` (its host model measured but for it): a reference step
    run on every rank at once, over its price on ``cluster``; the same on every rank (each priced
    the same graphs on the same slowest-rank numbers)."""
    reference_seconds, reference_graphs = timed_reference(calibration.repeats, calibration.device,
                                                          calibration.group, sync=True)
    return compute_scale(_slowest(reference_seconds, calibration.group), reference_graphs, cluster)
