"""Which data-sheet cluster a GPU is: matched by the device's name and total memory, with
devices faked by their properties (``name``, ``total_memory`` as ``torch.cuda`` reports them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from fsdp_compile.planning import Cluster, ClusterError
from fsdp_compile.planning.auto import machine_cluster
from fsdp_compile.planning.presets import PRESETS, preset_for_device

GiB = 1 << 30

# (name, total_memory) as torch.cuda.get_device_properties reports them on each part.
DEVICES = [
    ("NVIDIA H100 80GB HBM3", 85_031_714_816, "h100-sxm"),
    ("NVIDIA H200", 150_109_716_480, "h200"),
    ("NVIDIA B200", 191_503_138_816, "b200"),
    ("NVIDIA A100-SXM4-80GB", 85_198_045_184, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100-40gb"),
    ("NVIDIA L40S", 48_305_799_168, "l40s"),
    ("NVIDIA A10G", 23_836_098_560, "a10g"),
    ("NVIDIA L4", 23_580_639_232, "l4"),
    ("AMD Instinct MI300X", 205_822_885_888, "mi300x"),
]


def device(name: str, total_memory: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, total_memory=total_memory)


@pytest.mark.parametrize("name, memory, preset", DEVICES)
def test_each_gpu_gets_its_own_preset_and_its_own_memory(name, memory, preset):
    assert preset_for_device(name, memory) == preset
    cluster = Cluster.for_device(nodes=2, properties=device(name, memory))
    assert cluster.name == f"{preset} ({name})" and cluster.world_size == 16
    # planned against what the device has, not the data sheet's round figure
    assert cluster.device_memory == memory and "total_memory" in cluster.sources["device_memory"]
    assert cluster.peak_flops == PRESETS[preset]["peak_flops"] and cluster.host is None


def test_an_a100_40gb_is_not_planned_with_80_gb():
    # The A100's name names no size: the memory picks the part.
    assert preset_for_device("NVIDIA A100-SXM4-40GB", 40 * GiB) == "a100-40gb"
    assert preset_for_device("NVIDIA A100-SXM4-80GB", 80 * GiB) == "a100-80gb"
    # a memory no part of the family has matches nothing, not the nearest part
    assert preset_for_device("NVIDIA A100-SXM4-40GB", 60 * GiB) is None


def test_other_parts_of_a_family_match_nothing():
    # PCIe and NVL cards have other clocks and links than the SXM parts the presets describe,
    # and an L40 is not an L40S, nor an L40S an L4
    for name, memory in [("NVIDIA H100 PCIe", 85e9), ("NVIDIA H100 NVL", 100e9), ("NVIDIA H200 NVL", 150e9),
                         ("NVIDIA A100 80GB PCIe", 85e9), ("NVIDIA A100-PCIE-40GB", 42.5e9), ("NVIDIA L40", 48e9),
                         ("Tesla T4", 15.8e9)]:
        assert preset_for_device(name, memory) is None, name
    assert preset_for_device("NVIDIA L40S", 48e9) == "l40s" and preset_for_device("NVIDIA L4", 24e9) == "l4"


def test_presets_name_a_source_for_every_number():
    for name in PRESETS:
        cluster = Cluster.preset(name, nodes=2)
        for key in ("device_memory", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                    "inter_node_bandwidth", "latency", "reserved_memory"):
            assert cluster.sources.get(key), (name, key)
        assert cluster.usable_memory > 0 and torch.bfloat16 in cluster.peak_flops


def test_an_unknown_gpu_is_measured_where_there_is_a_process_group_to_measure_it():
    with pytest.raises(ClusterError, match=r"no cluster preset describes GPU 'Tesla T4' \(14.8 GiB.*init_process_group"):
        Cluster.for_device(properties=device("Tesla T4", 15_843_721_216))


class _MeasuredOnDevice(Cluster):
    """A Cluster whose measure() stands for a calibration on a GPU (this machine has none)."""

    calls: ClassVar[list] = []

    @classmethod
    def measure(cls, **kwargs):
        cls.calls.append(kwargs)
        return Cluster.preset("a10g", nodes=kwargs["nodes"], devices_per_node=2).replace(
            name="measured-cuda", device_memory=kwargs["device_memory"])


def unknown_gpu_worker(rank: int, world: int) -> tuple:
    _MeasuredOnDevice.calls.clear()
    cluster = _MeasuredOnDevice.for_device(nodes=1, properties=device("Tesla T4", 15_843_721_216))
    return cluster.name, cluster.device_memory, _MeasuredOnDevice.calls


def test_an_unknown_gpu_gets_a_cluster_of_its_rates_measured_and_its_memory():
    from distributed import run_workers

    for name, memory, calls in run_workers(unknown_gpu_worker, 2):
        assert name == "measured Tesla T4" and memory == 15_843_721_216
        assert calls == [{"nodes": 1, "device": None, "device_memory": 15_843_721_216.0}]


def test_auto_plans_with_the_matched_preset():
    # strategy="auto" on a GPU: what machine_cluster gives for this job's world and topology
    cluster = machine_cluster(16, 8, "cuda", None, properties=device("NVIDIA A100-SXM4-40GB", 42_505_273_344))
    assert (cluster.name, cluster.nodes, cluster.devices_per_node) == ("a100-40gb (NVIDIA A100-SXM4-40GB)", 2, 8)
    assert cluster.device_memory == 42_505_273_344
    with pytest.raises(ClusterError, match="torch sees none"):
        Cluster.for_device()  # a CPU machine, no properties given
