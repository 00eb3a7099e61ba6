"""What the planner knows about the machines: devices, their memory and speed, and the links.

A :class:`Cluster` is ``nodes`` x ``devices_per_node`` identical devices. Every number is per
device; bandwidths are bytes per second in one direction. Presets carry vendor data-sheet
figures with their source beside each (:mod:`.presets`; :meth:`Cluster.for_device` finds the
one of the GPU it runs on); :meth:`Cluster.measure` calibrates the machine it runs on instead
(matmul FLOP/s, memory bandwidth, collectives on the current process groups).

A cluster may carry a host model (``host``, :mod:`.host_model`) for what a device other than a
GPU adds to the GPU's cost model; GPUs and the presets carry none.

Collectives are modelled as rings (what NCCL and gloo use for large messages; the steps
and the bytes each rank sends are :mod:`fsdp_compile.runtime.ring`'s), and a ring runs at the
speed of its slowest link: a group whose ranks are all on one node uses the intra-node link,
a group that spans nodes is bound by the inter-node link. Latency is a fixed start-up cost
plus a per-step cost for each intra- and inter-node step (NCCL's tuning model,
``src/graph/tuning.cc``).
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

    ``peak_flops`` maps a compute dtype to dense FLOP/s (matmuls); ``memory_bandwidth`` is the
    device memory's bytes/s; ``intra_node_bandwidth`` / ``inter_node_bandwidth`` are bytes/s per
    device in one direction; ``*_latency`` are seconds per ring step, ``collective_latency`` the
    fixed start-up of a collective. ``device_memory`` is the capacity in bytes and
    ``reserved_memory`` what the runtime keeps for itself (CUDA context, communication
    buffers), so plans must fit in ``usable_memory``. ``comm_overlap`` is the fraction of a
    collective's time that can hide under compute (1: a separate engine). ``device_type`` selects
    the kernels the planner assumes (e.g. flash attention on ``"cuda"``). ``optimizer_step`` maps
    an optimizer's name to a measured ``(seconds per parameter tensor, seconds per shard byte)``
    of one step over the backend's sharded parameters (:meth:`measure` fills it; without it the
    step is timed as memory-bound passes over the shards). ``collective_workspace`` maps a
    collective kind to the bytes the communication backend allocates beside the result per byte
    of the collective's buffer, alive until the wait (gloo gathers into a temporary and reduces
    a copy; measured by the allocator in :meth:`measure`; NCCL works in the user's buffers: 0).
    ``runtime_per_tensor`` is seconds per sharded parameter per step outside the compiled graphs
    (leaf checks, gradient accumulation, DTensor ``.grad`` wrapping; measured, 0 in presets).
    ``measured_collectives`` maps a collective kind to its fitted ring model on the intra-node
    link (:meth:`measure`; a collective without one is priced from the bandwidths and
    latencies), ``measured_inter_collectives`` the same on the inter-node link (measured over
    several nodes; a group spanning nodes without it uses ``measured_collectives``).
    ``attention_flops`` maps a compute dtype to the FLOP/s fused attention kernels reach
    (forward and backward, FLOPs as torch's flop counter counts them; measured by
    :meth:`measure`); a dtype it lacks prices attention at ``peak_flops``, as the presets do.
    ``host``: a host model (:class:`~.host_model.HostModel`: what the device adds to the GPU's
    cost model, such as ranks computing on CPU cores beside their communication backend's
    threads), which ``measure(host=...)`` calibrates; None for GPUs. ``sources`` says where each
    number comes from.
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
        problems = _problems(self) + _measured_problems(self)
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
        """FLOP/s for fused attention in ``dtype``: measured where the cluster has it, else the
        matmul peak."""
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
        """A copy with some numbers changed (validated again); the host model's numbers change
        through :meth:`with_host`."""
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
        """A copy whose host model has some numbers changed (its ``replace``); a cluster without
        one gets one with ``replace(host=...)``."""
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
        """A cluster of ``nodes`` nodes from data-sheet numbers (:mod:`.presets`): ``"h100-sxm"``,
        ``"h200"``, ``"b200"``, ``"a100-80gb"``, ``"a100-40gb"``, ``"l40s"``, ``"a10g"`` (AWS
        G5.48xlarge: 8x A10G per node), ``"l4"``, ``"mi300x"``. Each number's source is in
        ``.sources``."""
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
        """The cluster of ``nodes`` nodes of this GPU: its preset, matched by the device's name and
        total memory (:func:`.presets.preset_for_device`), with the device's own total memory; a
        GPU no preset describes is measured instead (:meth:`measure`, a collective over the job's
        process group: every rank must call this), and named after the device.

        ``properties``: the device's properties (``name`` and ``total_memory``; default
        ``torch.cuda.get_device_properties(device)``). ``devices_per_node``: default the preset's,
        or for a measured GPU ``LOCAL_WORLD_SIZE`` (torchrun's ranks per node).

        Raises:
            ClusterError: no CUDA device and no ``properties``; or an unknown GPU outside a
                process group (nothing to measure it with): pass ``cluster=Cluster(...)``.
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

        Collective over ``group``: every rank of it must call this with the same arguments, at
        the same point, with no other collective in flight on the group. Each rank runs the
        same calibrations in the same order (barriers between them) and every number is the
        slowest rank's, so all ranks return the same cluster. In order, it measures:

        * matmul FLOP/s per dtype: the matmuls of a transformer's linear layers in their
          forward and both backward layouts, the median pass over all of them (two rounds,
          the faster kept);
        * fused causal attention FLOP/s per dtype, forward and backward;
        * memory bandwidth: on a GPU one large copy, on a CPU the median over a step's
          memory-bound operators (elementwise, normalization, softmax, ...) on cold inputs;
        * one AdamW and one SGD step over sharded (DTensor) parameters, as seconds per tensor
          and per shard byte, and the runtime's work per sharded parameter outside the graphs;
        * all-gather, reduce-scatter and all-reduce at each of ``sizes`` (the median run; where
          ranks fill a CPU's cores, beside a thread of matmuls), fitted to the ring model
          (:mod:`fsdp_compile.runtime.ring`) as a latency per ring step and a bandwidth; on a
          process group that models its links (an
          :class:`~fsdp_compile.EmulatedNetwork`'s), the time its links charged those
          collectives (its model, not the wall time, which is also gloo's);
        * the bytes the communication backend allocates beside each collective's result;
        * on a GPU how much of a collective's time can hide under compute (``comm_overlap``),
          from a race of an all-reduce against matmuls;
        * with ``host``, the host model's own numbers (its ``calibrate``), last.

        Compute is timed by the fastest repeat (the matmul and attention passes by the median);
        on a CPU with one intra-op thread (``OMP_NUM_THREADS=1``, torchrun's default for several
        ranks per node) by the thread's CPU time, so other jobs on the machine do not slow it.
        When this node's ranks outnumber its cores the operators' calibrations run in turns, a core
        per rank, and compute is stretched by each one's share.

        It costs seconds to tens of seconds, longer with more ``repeats``, larger ``sizes``, ranks
        taking turns on shared cores, or a host model to calibrate. Its largest buffers: on a CPU
        256 MB (the bandwidth operators' inputs), on a GPU about 3 GB of float32 matmul operands
        and 2 GiB for the copy. On a CPU it runs :mod:`torch.profiler` briefly, for the
        collectives' allocations.

        Args:
            group: the process group to calibrate (default: the world). Its size is the
                cluster's world size; its collectives are the ones timed.
            sizes: buffer bytes to time each collective at (an all-gather's output, the
                others' input), each rounded down to a whole number of float32 elements per
                rank, at least one. The fit is a line through them: give two sizes or more.
                Default: 64 KiB, 256 KiB, 1 MiB, 4 MiB on a CPU; 1, 16, 128 MiB on a GPU.
            repeats: timings per compute calibration and per ``comm_overlap`` measurement;
                the collectives' timings take at least 9 for their median.
            dtypes: the compute dtypes whose matmul and attention FLOP/s are measured (the
                keys of ``peak_flops`` and ``attention_flops``).
            nodes: how many nodes ``group`` spans; it must divide the group's size, which
                gives ``devices_per_node`` (consecutive ranks share a node, as torchrun places
                them). On one node every collective is timed on ``group``; over several, the
                intra-node link on groups of one node's ranks and the inter-node link on groups
                of one rank per node (``measured_inter_collectives``), all groups of a kind at
                once. The intra- and inter-node bandwidth and latency are each link's
                all-gather fit.
            device: the device to calibrate (default: the current CUDA device where CUDA is
                available, else the CPU).
            device_memory: bytes of memory each rank may plan against. Default: the CUDA
                device's capacity; on a CPU this node's ``MemTotal`` split evenly between its
                ranks (``LOCAL_WORLD_SIZE``, else the world's size), which on a CPU is rarely
                the budget to plan against: pass it.
            host: a host model's class (:class:`~.host_model.HostModel`), whose ``calibrate``
                measures the cluster's ``host`` after the device's numbers (default: none).

        Returns:
            A :class:`Cluster` named ``"measured-cpu"`` or ``"measured-cuda"`` of ``nodes`` x
            (group size / ``nodes``) devices, with ``measured_collectives`` (and, over several
            nodes, ``measured_inter_collectives``), ``collective_workspace``, ``optimizer_step``
            (``"adamw"``, ``"sgd"``) and ``runtime_per_tensor`` filled in; ``host`` the calibrated
            host model, or None; ``collective_latency`` and ``reserved_memory`` 0, and ``sources``
            saying when, at what world size and on which device type each number was measured.

        Raises:
            ClusterError: ``torch.distributed`` is not initialized; ``nodes`` does not divide
                the group's size; on a CPU without ``device_memory``, the node's memory size
                cannot be read (no ``/proc/meminfo``); or a measured number is impossible (the
                cluster's own validation).
        """
        from .calibration.calibrate import measure_cluster

        return measure_cluster(cls, group=group, sizes=sizes, repeats=repeats, dtypes=dtypes,
                               nodes=nodes, device=device, device_memory=device_memory, host=host)


def _problems(cluster: Cluster) -> list[str]:
    """What is wrong with ``cluster``'s numbers other than its measured fits, each named."""
    problems: list[str] = []

    def need(name: str, value: Any, **kwargs: Any) -> None:
        problems.extend(number_problems(name, value, **kwargs))

    def per_dtype(name: str, rates: dict) -> None:
        for dtype, value in rates.items():
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                problems.append(f"{name} key {dtype!r} must be a floating-point torch.dtype")
            need(f"{name}[{dtype}]", value)

    need("nodes", cluster.nodes, integer=True)
    need("devices_per_node", cluster.devices_per_node, integer=True)
    need("device_memory", cluster.device_memory)
    need("memory_bandwidth", cluster.memory_bandwidth)
    need("intra_node_bandwidth", cluster.intra_node_bandwidth)
    need("intra_node_latency", cluster.intra_node_latency, positive=False)
    need("collective_latency", cluster.collective_latency, positive=False)
    need("reserved_memory", cluster.reserved_memory, positive=False)
    need("comm_overlap", cluster.comm_overlap, positive=False, at_most=1.0)
    need("runtime_per_tensor", cluster.runtime_per_tensor, positive=False)
    if isinstance(cluster.nodes, int) and cluster.nodes > 1:
        # Several nodes talk over the inter-node link: it must be described.
        need("inter_node_bandwidth", cluster.inter_node_bandwidth)
        need("inter_node_latency", cluster.inter_node_latency, positive=False)
    else:
        if cluster.inter_node_bandwidth is not None:
            need("inter_node_bandwidth", cluster.inter_node_bandwidth)
        if cluster.inter_node_latency is not None:
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
    return problems


def _measured_problems(cluster: Cluster) -> list[str]:
    """What is wrong with the measured fits of ``cluster`` (collectives, workspace, the optimizer
    step), each named."""
    problems: list[str] = []
    for field_name in ("measured_collectives", "measured_inter_collectives"):
        problems += fit_problems(field_name, getattr(cluster, field_name))
    for kind, share in cluster.collective_workspace.items():
        if kind not in COLLECTIVE_KINDS:
            problems.append(f"collective_workspace[{kind!r}]: kinds are {', '.join(COLLECTIVE_KINDS)}")
        elif not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
            problems.append(f"collective_workspace[{kind!r}]={share!r} must be a number >= 0")
    problems += line_problems("optimizer_step", cluster.optimizer_step, "seconds per tensor", None)
    return problems
