"""What the planner knows about the machines: devices, their memory and speed, and the links.

Every number is per device; bandwidths are bytes per second in one direction. Presets carry data-sheet figures with
their sources (:mod:`.presets`); :meth:`Cluster.measure` calibrates the machine it runs on. A host model (``host``,
:mod:`.host_model`) adds what a device other than a GPU adds to the GPU's cost model. Collectives are rings
(:mod:`fsdp_compile.runtime.ring`) at the speed of their slowest link; latency is a fixed start-up plus a cost per
intra- and inter-node step (NCCL's tuning model, ``src/graph/tuning.cc``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .host_model import HostModel
from .presets import PRESETS, preset_for_device
from .vocabulary import (
    COLLECTIVE_KINDS,
    GB,
    TFLOPS,
    ClusterError,
    GiB,
    MeasuredCollective,
    fit_problems,
    line_problems,
    number_problems,
)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices and the links between them.

    ``peak_flops``: dtype -> dense matmul FLOP/s; ``memory_bandwidth``: bytes/s; ``intra_node_bandwidth`` /
    ``inter_node_bandwidth``: bytes/s per device in one direction; ``*_latency``: seconds per ring step,
    ``collective_latency`` a collective's fixed start-up. Plans must fit in ``usable_memory``: ``device_memory`` less
    ``reserved_memory`` (CUDA context, communication buffers). ``comm_overlap``: the share of a collective's time that
    can hide under compute (1: a separate engine). ``device_type`` selects the kernels assumed (flash attention on
    ``"cuda"``). ``optimizer_step``: optimizer -> measured ``(seconds per parameter tensor, seconds per shard byte)``
    over sharded parameters (without it, memory-bound passes). ``collective_workspace``: kind -> bytes the backend
    allocates beside the result per buffer byte until the wait (gloo's temporaries; NCCL: 0). ``runtime_per_tensor``:
    seconds per sharded parameter per step outside the graphs (leaf checks, ``.grad`` wrapping; 0 in presets).
    ``measured_collectives`` / ``measured_inter_collectives``: kind -> fitted ring model on the intra- / inter-node link
    (without one, priced from the bandwidths and latencies; a group spanning nodes falls back to the intra-node fit).
    ``attention_flops``: dtype -> fused attention FLOP/s (forward and backward; without it, ``peak_flops``). ``host``: a
    :class:`~.host_model.HostModel`, None for GPUs. ``sources``: where each number comes from.
    """

    name: str
    nodes: int
    devices_per_node: int
    device_memory: float
    peak_flops: dict[torch.dtype, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float | None
    intra_node_latency: float
    inter_node_latency: float | None
    collective_latency: float = 0.0
    reserved_memory: float = 0.0
    comm_overlap: float = 1.0
    device_type: str = "cuda"
    measured_collectives: dict[str, MeasuredCollective] = field(default_factory=dict)
    measured_inter_collectives: dict[str, MeasuredCollective] = field(default_factory=dict)
    optimizer_step: dict[str, tuple[float, float]] = field(default_factory=dict)
    collective_workspace: dict[str, float] = field(default_factory=dict)
    runtime_per_tensor: float = 0.0
    attention_flops: dict[torch.dtype, float] = field(default_factory=dict)
    host: HostModel | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`ClusterError` naming every missing or impossible number."""
        problems = _problems(self)
        if problems:
            raise ClusterError(f"cluster {self.name!r}: " + "; ".join(problems))

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_memory(self) -> float:
        return self.device_memory - self.reserved_memory

    def flops_for(self, dtype: torch.dtype) -> float:
        """Dense FLOP/s for matmuls in ``dtype``; a clear error when the cluster does not say."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype in (torch.float64,) and torch.float32 in self.peak_flops:
            return self.peak_flops[torch.float32] / 2
        known = ", ".join(str(d) for d in self.peak_flops)
        raise ClusterError(
            f"cluster {self.name!r} has no peak FLOP/s for {dtype} (it has: {known}); add it with "
            f"cluster.replace(peak_flops={{**cluster.peak_flops, {dtype}: ...}})")

    def attention_flops_for(self, dtype: torch.dtype) -> float:
        """Fused attention's FLOP/s in ``dtype``, else the matmul peak."""
        return self.attention_flops.get(dtype) or self.flops_for(dtype)

    def check_world(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ClusterError(f"world_size={world_size!r} must be a positive int")
        if world_size > self.world_size:
            raise ClusterError(
                f"world_size={world_size} does not fit cluster {self.name!r}: it holds {self.nodes} node(s) x "
                f"{self.devices_per_node} devices = {self.world_size}; use a smaller world or "
                f"Cluster.preset(..., nodes={-(-world_size // self.devices_per_node)})")

    def replace(self, **changes: Any) -> Cluster:
        """A copy with some numbers changed (validated again); the host model's: :meth:`with_host`."""
        unknown = changes.keys() - {f.name for f in dataclasses.fields(self)}
        if unknown:
            misplaced = [name for name in changes if self.host is not None and hasattr(self.host, name)]
            if not misplaced:
                raise ClusterError(f"Cluster has no number {', '.join(sorted(unknown))}; its numbers: "
                                   f"{', '.join(f.name for f in dataclasses.fields(self))}")
            given = ", ".join(f"{name}=..." for name in misplaced)
            raise ClusterError(f"{', '.join(misplaced)}: numbers of the host CPU model (Cluster.host), not of the "
                               f"devices: use cluster.with_host({given})")
        return dataclasses.replace(self, **changes)

    def with_host(self, **changes: Any) -> Cluster:
        """A copy whose host model has some numbers changed (its ``replace``)."""
        if self.host is None:
            raise ClusterError(f"cluster {self.name!r} has no host model to change {', '.join(sorted(changes))} of: "
                               "give it one with cluster.replace(host=...)")
        return dataclasses.replace(self, host=self.host.replace(**changes))

    def describe(self) -> str:
        flops = ", ".join(f"{str(d).replace('torch.', '')} {v / TFLOPS:.4g} TFLOP/s"
                          for d, v in self.peak_flops.items())
        inter = (f"{self.inter_node_bandwidth / GB:.4g} GB/s" if self.inter_node_bandwidth else "n/a")
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device_type} devices, "
                f"{self.device_memory / GiB:.3g} GiB each ({self.usable_memory / GiB:.3g} usable), {flops}, "
                f"memory {self.memory_bandwidth / GB:.4g} GB/s, intra-node {self.intra_node_bandwidth / GB:.4g} GB/s, "
                f"inter-node {inter} per device")

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, nodes: int = 1, devices_per_node: int | None = None) -> Cluster:
        """A cluster of ``nodes`` nodes from data-sheet numbers (:mod:`.presets`, :meth:`presets`), each number's source
        in ``.sources``."""
        key = name.strip().lower()
        if key not in PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
        fields = dict(PRESETS[key])
        fields["nodes"] = nodes
        if devices_per_node is not None:
            fields["devices_per_node"] = devices_per_node
        return cls(**fields)

    @staticmethod
    def presets() -> list[str]:
        return sorted(PRESETS)

    @classmethod
    def for_device(cls, device: torch.device | str | int | None = None, *, nodes: int = 1,
                   devices_per_node: int | None = None, properties: Any = None) -> Cluster:
        """The cluster of ``nodes`` nodes of this GPU: its preset (:func:`.presets.preset_for_device`) with the device's
        own total memory; a GPU no preset describes is measured instead (:meth:`measure`, collective: every rank must
        call this).

        ``properties``: ``name`` and ``total_memory`` (default the device's). ``devices_per_node``: default the
        preset's, or for a measured GPU ``LOCAL_WORLD_SIZE``.

        Raises:
            ClusterError: no CUDA device and no ``properties``; or an unknown GPU outside a process group.
        """
        if properties is None:
            if not torch.cuda.is_available():
                raise ClusterError("Cluster.for_device() describes a GPU, and torch sees none: on a CPU use "
                                   "Cluster.measure(), or describe the cluster with Cluster(...)")
            properties = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        name, memory = str(properties.name), float(properties.total_memory)
        key = preset_for_device(name, memory)
        if key is not None:
            cluster = cls.preset(key, nodes=nodes, devices_per_node=devices_per_node)
            return cluster.replace(
                name=f"{key} ({name})", device_memory=memory,
                sources={**cluster.sources, "device_memory": f"torch.cuda.get_device_properties: {name}, "
                         f"total_memory {memory / GiB:.1f} GiB (the data sheet: {cluster.device_memory / GB:.0f} GB)"})
        if not dist.is_initialized():
            raise ClusterError(
                f"no cluster preset describes GPU {name!r} ({memory / GiB:.1f} GiB; presets: "
                f"{', '.join(sorted(PRESETS))}), and measuring it needs the job's process group: call "
                "torch.distributed.init_process_group() first, or pass cluster=Cluster(...)")
        if devices_per_node is None:
            devices_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        measured = cls.measure(nodes=nodes, device=device, device_memory=memory)
        if measured.devices_per_node != devices_per_node:
            raise ClusterError(f"devices_per_node={devices_per_node} does not match the {measured.world_size} ranks "
                               f"measured over {nodes} node(s)")
        return measured.replace(name=f"measured {name}")

    # ------------------------------------------------------------------ measuring
    @classmethod
    def measure(cls, *, group: Any = None, sizes: tuple[int, ...] | None = None, repeats: int = 5,
                dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                nodes: int = 1, device: torch.device | str | None = None,
                device_memory: float | None = None, host: type[HostModel] | None = None) -> Cluster:
        """Calibrate a cluster on the machine it is called on, over the process group ``group``.

        Collective over ``group``: every rank calls it with the same arguments, with no other collective in flight;
        every number is the slowest rank's, so all ranks get the same cluster. In order: matmul FLOP/s per dtype (a
        transformer's linear layers in their three layouts, the median pass, two rounds); fused causal attention FLOP/s;
        memory bandwidth (a GPU's large copy, a CPU's memory-bound operators on cold inputs); an AdamW and an SGD step
        over DTensor shards and the runtime's work per parameter; each collective at each of ``sizes`` (the median
        burst), fitted to the ring model, or on a process group that models its links (an
        :class:`~fsdp_compile.EmulatedNetwork`'s) the time its links charged; the backend's workspace per collective; on
        a GPU ``comm_overlap``; with ``host``, its numbers.

        Compute is timed by the fastest repeat (matmuls and attention by the median pass), on a CPU with one intra-op
        thread by the thread's CPU time, so other jobs do not slow it. It takes seconds to tens of seconds; its largest
        buffers are 256 MB on a CPU, about 5 GB on a GPU; on a CPU it runs :mod:`torch.profiler` briefly.

        Args:
            group: the process group to calibrate (default: the world); its size is the world size.
            sizes: buffer bytes to time each collective at (an all-gather's output, the others' input), rounded down to
                whole float32 elements per rank; two or more. Default: 64 KiB, 256 KiB, 1 MiB, 4 MiB on a CPU; 1, 16,
                128 MiB on a GPU.
            repeats: timings per compute calibration (collectives take at least 9).
            dtypes: the compute dtypes whose matmul and attention FLOP/s are measured.
            nodes: how many nodes ``group`` spans (consecutive ranks share a node); it must divide the group's size.
                Over several, the intra-node link is timed on groups of one node's ranks and the inter-node link on
                groups of one rank per node (``measured_inter_collectives``); each link's all-gather fit sets its
                bandwidth and latency.
            device: default the current CUDA device where CUDA is available, else the CPU.
            device_memory: bytes each rank may plan against. Default: the CUDA device's capacity; on a CPU this node's
                ``MemTotal`` split between its ranks (rarely the budget: pass it).
            host: a host model's class (:class:`~.host_model.HostModel`), calibrated last.

        Returns:
            A :class:`Cluster` named ``"measured-cpu"`` or ``"measured-cuda"`` with the measured
            fields filled in, ``host`` calibrated (or None), and ``sources`` saying when, at what
            world size and on which device each number was measured.

        Raises:
            ClusterError: ``torch.distributed`` is not initialized; ``nodes`` does not divide the group's size; the
                node's memory size cannot be read; or a measured number is impossible.
        """
        from .calibration.calibrate import measure_cluster

        return measure_cluster(cls, group=group, sizes=sizes, repeats=repeats, dtypes=dtypes,
                               nodes=nodes, device=device, device_memory=device_memory, host=host)


def _problems(cluster: Cluster) -> list[str]:
    """What is wrong with ``cluster``'s numbers, each named."""
    problems: list[str] = []

    def need(name: str, value: Any, **kwargs: Any) -> None:
        problems.extend(number_problems(name, value, **kwargs))

    def per_dtype(name: str, rates: dict) -> None:
        for dtype, value in rates.items():
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                problems.append(f"{name} key {dtype!r} must be a floating-point torch.dtype")
            need(f"{name}[{dtype}]", value)

    whole, positive, at_least_0 = {"integer": True}, {}, {"positive": False}
    for name, kwargs in (("nodes", whole), ("devices_per_node", whole), ("device_memory", positive),
                         ("memory_bandwidth", positive), ("intra_node_bandwidth", positive),
                         ("intra_node_latency", at_least_0), ("collective_latency", at_least_0),
                         ("reserved_memory", at_least_0), ("comm_overlap", {"positive": False, "at_most": 1.0}),
                         ("runtime_per_tensor", at_least_0)):
        need(name, getattr(cluster, name), **kwargs)
    several = isinstance(cluster.nodes, int) and cluster.nodes > 1  # the inter-node link must be described
    if several or cluster.inter_node_bandwidth is not None:
        need("inter_node_bandwidth", cluster.inter_node_bandwidth)
    if several or cluster.inter_node_latency is not None:
        need("inter_node_latency", cluster.inter_node_latency, positive=False)
    if not isinstance(cluster.peak_flops, dict) or not cluster.peak_flops:
        problems.append("peak_flops is missing: give {dtype: dense FLOP/s}, e.g. {torch.bfloat16: 989e12}")
    else:
        per_dtype("peak_flops", cluster.peak_flops)
    if (isinstance(cluster.device_memory, (int, float)) and isinstance(cluster.reserved_memory, (int, float))
            and cluster.device_memory > 0 and cluster.reserved_memory >= cluster.device_memory):
        problems.append(f"reserved_memory={cluster.reserved_memory:.3g} leaves nothing of "
                        f"device_memory={cluster.device_memory:.3g}")
    if cluster.device_type not in ("cuda", "cpu"):
        problems.append(f"device_type={cluster.device_type!r} must be 'cuda' or 'cpu'")
    if not isinstance(cluster.attention_flops, dict):
        problems.append(f"attention_flops={cluster.attention_flops!r} must be a dict {{dtype: FLOP/s}}")
    else:
        per_dtype("attention_flops", cluster.attention_flops)
    if cluster.host is not None and not isinstance(cluster.host, HostModel):
        problems.append(f"host={cluster.host!r} must be a host model (fsdp_compile.planning.host_model.HostModel: "
                        "free_node, compute_node, collective, timeline, ...) or None")
    for field_name in ("measured_collectives", "measured_inter_collectives"):
        problems += fit_problems(field_name, getattr(cluster, field_name))
    for kind, share in cluster.collective_workspace.items():
        if kind not in COLLECTIVE_KINDS:
            problems.append(f"collective_workspace[{kind!r}]: kinds are {', '.join(COLLECTIVE_KINDS)}")
        elif not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
            problems.append(f"collective_workspace[{kind!r}]={share!r} must be a number >= 0")
    problems += line_problems("optimizer_step", cluster.optimizer_step, "seconds per tensor", None)
    return problems
