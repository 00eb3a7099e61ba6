"""A measured cluster written as JSON and read back: what ``bench/replan.py`` plans again from."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fsdp_compile.planning.cluster import Cluster
from fsdp_compile.planning.cluster_numbers import cluster_from_numbers, cluster_numbers
from fsdp_compile.planning.vocabulary import MeasuredCollective
from fsdp_compile_lab import HostCPU


def measured_like() -> Cluster:
    """A cluster with every number the cost model reads set, and none at its default."""
    return Cluster.preset("a100-80gb", nodes=2).replace(
        name="measured-cpu", device_type="cpu", comm_overlap=0.9,
        measured_collectives={"all_gather": MeasuredCollective(1e-4, 2e9, 4),
                              "reduce_scatter": MeasuredCollective(2e-4, 1e9, 4)},
        measured_inter_collectives={"all_reduce": MeasuredCollective(3e-4, 5e8, 2)},
        optimizer_step={"adamw": (7e-4, 3e-9)}, collective_workspace={"all_gather": 1.0}, runtime_per_tensor=2e-4,
        attention_flops={torch.float32: 3e10}, host=HostCPU(
        op_overhead=1.2e-5,
        backend_collectives={"all_gather": MeasuredCollective(5e-5, 4e9, 4)},
        backend_inter_collectives={"all_reduce": MeasuredCollective(6e-5, 3e9, 2)}, backend_share=(0.5, 1.0),
        copy_kernels={"copy_in": (1e-5, 2e-10)},
        collective_issue={"all_gather": (3e-4, 1e-10)}, collective_cpu={"reduce_scatter": (1e-3, 2e-9)},
        rank_skew=1.5e-3, core_sharing=(4, 2), rank_drift=0.03, compute_scale=1.2))


def test_every_number_the_planner_reads_survives_the_round_trip() -> None:
    cluster = measured_like()
    back = cluster_from_numbers(json.loads(json.dumps(cluster_numbers(cluster))), host=HostCPU)
    for field in dataclasses.fields(Cluster):
        if field.name != "sources":  # where each number came from is the file's header, not a number
            assert getattr(back, field.name) == getattr(cluster, field.name), field.name


def test_numbers_written_before_the_shape_need_it_and_take_the_links_from_the_fits() -> None:
    numbers = cluster_numbers(measured_like())
    for name in ("name", "nodes", "devices_per_node", "device_memory", "device_type", "reserved_memory",
                 "collective_latency", "intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency",
                 "inter_node_latency"):
        del numbers[name]
    with pytest.raises(ValueError, match="nodes or devices_per_node"):
        cluster_from_numbers(numbers)
    numbers["inter_node_collectives"]["all_gather"] = {"step_latency": 5e-4, "bandwidth": 1e8, "group_size": 2}
    old = cluster_from_numbers(numbers, nodes=2, devices_per_node=2)
    assert (old.nodes, old.devices_per_node, old.device_type) == (2, 2, "cpu")
    assert (old.intra_node_bandwidth, old.intra_node_latency) == (2e9, 1e-4)
    assert (old.inter_node_bandwidth, old.inter_node_latency) == (1e8, 5e-4)
    assert old.measured_collectives == measured_like().measured_collectives


def test_the_host_models_numbers_are_read_back_by_its_class_only() -> None:
    numbers = json.loads(json.dumps(cluster_numbers(measured_like())))
    assert cluster_from_numbers(numbers).host is None  # the package reads the devices' numbers alone
    plain = cluster_numbers(measured_like().replace(host=None))
    assert "op_overhead" not in plain and cluster_from_numbers(plain, host=HostCPU).host is None
