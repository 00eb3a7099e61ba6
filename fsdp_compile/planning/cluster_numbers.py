"""A measured cluster's numbers as JSON and back, so a published job can be planned again with
the planner as it is later (``bench/replan.py``) without running it again.
"""

from __future__ import annotations

from typing import Any

import torch

from .cluster import Cluster
from .host_model import HostModel
from .vocabulary import MeasuredCollective

# Tuples of (fixed, per unit) seconds, by name.
_LINES = ("optimizer_step",)
_FITS = (("collectives", "measured_collectives"), ("inter_node_collectives", "measured_inter_collectives"))
_SHAPE = ("name", "nodes", "devices_per_node", "device_memory", "device_type", "reserved_memory",
          "collective_latency", "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency",
          "inter_node_latency")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fits_json(fits: dict[str, MeasuredCollective]) -> dict[str, dict[str, Any]]:
    return {k: {"step_latency": v.step_latency, "bandwidth": v.bandwidth, "group_size": v.group_size}
            for k, v in fits.items()}


def _fits_from(numbers: dict[str, Any], key: str) -> dict[str, MeasuredCollective]:
    return {k: MeasuredCollective(v["step_latency"], v["bandwidth"], v["group_size"])
            for k, v in (numbers.get(key) or {}).items()}


def cluster_numbers(cluster: Cluster) -> dict[str, Any]:
    """Every number of ``cluster`` and of its host model, JSON-ready (:func:`cluster_from_numbers`)."""
    numbers = {**{name: getattr(cluster, name) for name in _SHAPE},
               "peak_flops": {_dtype_name(k): v for k, v in cluster.peak_flops.items()},
               "attention_flops": {_dtype_name(k): v for k, v in cluster.attention_flops.items()},
               "memory_bandwidth": cluster.memory_bandwidth, "comm_overlap": cluster.comm_overlap,
               "runtime_per_tensor": cluster.runtime_per_tensor, "collective_workspace": cluster.collective_workspace,
               **{name: getattr(cluster, name) for name in _LINES},
               **{key: _fits_json(getattr(cluster, field)) for key, field in _FITS}}
    if cluster.host is not None:
        numbers.update(cluster.host.numbers())
    return numbers


def cluster_from_numbers(numbers: dict[str, Any], *, nodes: int | None = None,
                         devices_per_node: int | None = None, device_memory: float | None = None,
                         host: type[HostModel] | None = None) -> Cluster:
    """The :class:`Cluster` that :func:`cluster_numbers` wrote.

    Files written before the cluster's shape was recorded need ``nodes`` and ``devices_per_node``;
    their links are each link's all-gather fit, their device a CPU with ``device_memory`` (default
    64 GiB, what ``compare`` plans against). ``host``: the host model's class that reads its numbers
    back (without it, none). An argument given overrides the file.
    """
    def dtypes(values: dict[str, float]) -> dict[torch.dtype, float]:
        return {getattr(torch, name): v for name, v in values.items()}

    fits = {field: _fits_from(numbers, key) for key, field in _FITS}
    shape = {name: numbers[name] for name in _SHAPE if name in numbers}
    given = {"nodes": nodes, "devices_per_node": devices_per_node, "device_memory": device_memory}
    shape.update({name: value for name, value in given.items() if value is not None})
    missing = [name for name in ("nodes", "devices_per_node") if name not in shape]
    if missing:
        raise ValueError(f"cluster_from_numbers: the numbers do not say the cluster's {' or '.join(missing)}: "
                         "pass them (a compare.json's world is nodes x devices_per_node)")
    if "intra_node_bandwidth" not in shape:  # written before the shape was: the links are the fits
        intra = fits["measured_collectives"]["all_gather"]
        inter = fits["measured_inter_collectives"].get("all_gather", intra)
        several = shape["nodes"] > 1
        shape.update(name="measured-cpu", device_type="cpu", intra_node_bandwidth=intra.bandwidth,
                     intra_node_latency=intra.step_latency,
                     inter_node_bandwidth=inter.bandwidth if several else None,
                     inter_node_latency=inter.step_latency if several else None)
    shape.setdefault("device_memory", float(64 << 30))
    return Cluster(**shape, peak_flops=dtypes(numbers["peak_flops"]),
                   attention_flops=dtypes(numbers.get("attention_flops", {})),
                   memory_bandwidth=numbers["memory_bandwidth"],
                   comm_overlap=numbers["comm_overlap"], runtime_per_tensor=numbers["runtime_per_tensor"],
                   collective_workspace=dict(numbers.get("collective_workspace", {})),
                   **{name: {k: tuple(v) for k, v in numbers.get(name, {}).items()} for name in _LINES},
                   **fits, host=host.from_numbers(numbers) if host is not None else None)
