"""What each node of a lowered graph costs on a cluster.

* Compute nodes: a roofline, the larger of FLOPs (torch's own formulas, ``torch.utils.flop_counter``,
  on the node's fake tensors) over the dtype's peak (fused attention: its own rate) and the bytes
  read and written over memory bandwidth. Views are free.
* Collectives: the ring model (:mod:`fsdp_compile.runtime.ring`) on the group's link (a group
  spanning nodes: the inter-node one), latency per intra- and inter-node step; a measured fit of
  the kind on its link replaces the data-sheet numbers.

That is a GPU's cost; a cluster's host model (``Cluster.host``, :class:`~.host_model.HostModel`) prices views, compute
nodes, operator calls and what it adds to collectives. Sizes may be symbolic (sympy): every cost is then an expression.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.distributed as dist
from torch import fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..inspection.memory_estimate import size_hint
from ..passes.graph import ALL_GATHER, COLLECTIVES, PURE_VIEWS, WAIT
from ..runtime.ring import ring_steps, wire_bytes

if TYPE_CHECKING:
    from .cluster import Cluster

aten = torch.ops.aten
COLLECTIVE_KIND = COLLECTIVES  # functional collective -> its kind (the graph vocabulary's table)

# Nodes that only reinterpret or name existing storage: no kernel runs.
FREE = PURE_VIEWS | {
    aten.alias.default, aten.detach.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.chunk.default, aten.view_as_real.default, aten.view_as_complex.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.lift_fresh.default, aten.sym_size.int,
    aten.sym_numel.default, aten.sym_stride.int, operator.getitem,
}


# The CPU flash kernels have no entry in torch's table; they compute what the CUDA ones do.
_EXTRA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_val=None, **kwargs: sdpa_flop_count(q.shape, k.shape, v.shape),
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_val=None, **kwargs: sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape),
}


# Fused attention runs at its own rate (``Cluster.attention_flops``), not at the matmul peak.
ATTENTION_OPS = frozenset(
    packet for packet in (*flop_registry, *_EXTRA_FLOPS)
    if "attention" in str(packet) and "flex" not in str(packet))


def maximum(a: Any, b: Any) -> Any:
    """``max`` for numbers and sympy expressions alike."""
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Max(a, b)
    return max(a, b)


def _value(x: Any, symbolic: bool) -> Any:
    """An fx argument with its SymInts as sympy expressions (``symbolic``) or their hints."""
    if isinstance(x, fx.Node):
        return _value(x.meta.get("val"), symbolic)
    if isinstance(x, (list, tuple)):
        return type(x)(_value(v, symbolic) for v in x)
    if isinstance(x, torch.SymInt):
        return x.node.expr if symbolic else size_hint(x)
    return x


def _number(x: Any, symbolic: bool) -> Any:
    return _value(x, symbolic) if isinstance(x, torch.SymInt) else x if isinstance(x, sympy.Basic) else int(x)


def tensor_bytes(t: torch.Tensor, symbolic: bool = False) -> Any:
    return _number(t.numel(), symbolic) * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


@dataclass(frozen=True)
class Group:
    """A process group as the cost model sees it: its size and how many nodes it spans."""

    size: int
    nodes: int


def group_ranks(name: str, cache: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The ranks of the process group registered under ``name`` in the current (fake) world."""
    if name not in cache:
        from torch.distributed.distributed_c10d import _resolve_process_group

        cache[name] = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
    return cache[name]


def group_of(name: str, devices_per_node: int, cache: dict[str, Group]) -> Group:
    """The group registered under ``name`` in the current (fake) world."""
    if name not in cache:
        ranks = group_ranks(name, {})
        cache[name] = Group(len(ranks), len({r // devices_per_node for r in ranks}))
    return cache[name]


@dataclass(frozen=True)
class NodeCost:
    """One node's cost. ``kind``: "compute", "free", "collective" or "wait"."""

    kind: str
    seconds: Any = 0.0
    flops: Any = 0
    bytes: Any = 0
    link: str | None = None  # collectives: "intra" or "inter"
    wire_bytes: Any = 0  # collectives: bytes each rank sends
    host: Any = None  # collectives: what the cluster's host model adds (its ``events(issue)`` plays it)


def _fit(kind: str, link: str, intra: dict[str, Any], inter: dict[str, Any]) -> Any:
    """A collective's fit on ``link``: the inter-node one where there is one, else the intra-node one."""
    return (inter.get(kind) if link == "inter" else None) or intra.get(kind)


def collective_cost(kind: str, buffer_bytes: Any, group: Group, cluster: Cluster) -> NodeCost:
    """Ring model of one collective on ``group`` (see the module docstring)."""
    n = group.size
    wire = wire_bytes(kind, buffer_bytes, n)
    link = "intra" if group.nodes <= 1 else "inter"
    if n <= 1:
        return NodeCost("collective", 0.0, link=link, wire_bytes=0)
    steps = ring_steps(kind, n)
    measured = _fit(kind, link, cluster.measured_collectives, cluster.measured_inter_collectives)
    if measured is not None:
        seconds = steps * measured.step_latency + wire / measured.bandwidth
    else:
        if group.nodes <= 1:
            latency = cluster.collective_latency + steps * cluster.intra_node_latency
            bandwidth = cluster.intra_node_bandwidth
        else:
            inter_steps = ring_steps(kind, group.nodes)
            latency = (cluster.collective_latency + (steps - inter_steps) * cluster.intra_node_latency
                       + inter_steps * cluster.inter_node_latency)
            bandwidth = min(cluster.inter_node_bandwidth, cluster.intra_node_bandwidth)
        seconds = latency + wire / bandwidth
    cost = NodeCost("collective", seconds, link=link, wire_bytes=wire)
    if cluster.host is None:
        return cost
    return cluster.host.collective(cost, kind, buffer_bytes, steps, measured is not None, cluster.device_type)


def node_cost(node: fx.Node, cluster: Cluster, groups: dict[str, Group], symbolic: bool = False) -> NodeCost:
    if node.op != "call_function":
        return NodeCost("free")
    target = node.target
    if target is WAIT:
        return NodeCost("wait")
    if target in COLLECTIVE_KIND:
        kind = COLLECTIVE_KIND[target]
        buffer = node.meta["val"] if target is ALL_GATHER else node.args[0].meta["val"]
        group = group_of(node.args[-1], cluster.devices_per_node, groups)
        return collective_cost(kind, tensor_bytes(buffer, symbolic), group, cluster)
    if target in FREE:  # no kernel runs
        return cluster.host.free_node(target) if cluster.host is not None else NodeCost("free")
    args = _value(node.args, symbolic)
    kwargs = {k: _value(v, symbolic) for k, v in node.kwargs.items()}
    out = _value(node.meta.get("val"), symbolic)
    packet = getattr(target, "overloadpacket", None)
    formula = _EXTRA_FLOPS.get(packet) or flop_registry.get(packet)
    flops = 0
    dtype = None
    if formula is not None:
        flops = formula(*args, **kwargs, out_val=out)
        if isinstance(flops, torch.SymInt):
            flops = _number(flops, symbolic)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dtype = tensors[0].dtype if tensors else None
    distinct = {id(t): t for t in _tensors(args) + _tensors(kwargs) + _tensors(out)}
    moved = sum((tensor_bytes(t, symbolic) for t in distinct.values()), 0)
    seconds = moved / cluster.memory_bandwidth
    if flops and dtype is not None and dtype.is_floating_point:
        rate = cluster.attention_flops_for(dtype) if packet in ATTENTION_OPS else cluster.flops_for(dtype)
        seconds = maximum(flops / rate, seconds)
    cost = NodeCost("compute", seconds, flops=flops, bytes=moved)
    return cluster.host.compute_node(cost, target, args, out) if cluster.host is not None else cost


def graph_costs(gm: fx.GraphModule, cluster: Cluster, groups: dict[str, Group] | None = None,
                symbolic: bool = False) -> list[tuple[fx.Node, NodeCost]]:
    groups = {} if groups is None else groups
    fused = float8_cast_kernels(gm.graph)
    if cluster.host is not None:
        fused = cluster.host.fused_casts(fused)
    return [(node, _fused_cost(node, fused[node], cluster, symbolic) if node in fused
             else node_cost(node, cluster, groups, symbolic)) for node in gm.graph.nodes]


# A float8 cast (torchao's: amax = max(abs(x)); (x.to(float32) * scale).clamp(...).to(float8)) is two kernels after
# Inductor, a reduction that reads x and an elementwise pass that reads x and writes the float8 tensor. Priced op by op,
# as the rest of the unfused graph, its five passes over x would outweigh the float8 matmul they feed.
_FLOAT8 = frozenset(d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2",
                                                                   "float8_e4m3fnuz", "float8_e5m2fnuz")) if d)
_CAST_CHAIN = frozenset({aten._to_copy.default, aten.mul.Tensor, aten.div.Tensor, aten.clamp.default,
                         aten.clamp_min.default, aten.clamp_max.default, aten.reciprocal.default,
                         torch.ops.prims.convert_element_type.default})
_AMAX = frozenset({aten.max.default, aten.amax.default})


def _value_of(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def float8_cast_kernels(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """The float8 casts and amaxes of ``graph`` as Inductor's kernels: each kernel's last node -> the values it reads
    from memory; the nodes fused into it -> []."""
    fused: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        value = _value_of(node)
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        if node.target in _CAST_CHAIN and value.dtype in _FLOAT8:
            source = node.args[0]
            while (isinstance(source, fx.Node) and source.op == "call_function" and source.target in _CAST_CHAIN
                   and len(source.users) == 1 and isinstance(_value_of(source.args[0]), torch.Tensor)):
                fused[source] = []
                source = source.args[0]
            fused[node] = [source]
        elif node.target in _AMAX and isinstance(node.args[0], fx.Node) and node.args[0].target is aten.abs.default \
                and len(node.args[0].users) == 1:
            fused[node.args[0]] = []
            fused[node] = [node.args[0].args[0]]
    return fused


def _fused_cost(node: fx.Node, reads: list[fx.Node], cluster: Cluster, symbolic: bool) -> NodeCost:
    if not reads:
        return NodeCost("free")
    moved = sum(tensor_bytes(_value(_value_of(n), symbolic), symbolic) for n in reads)
    moved = moved + tensor_bytes(_value(_value_of(node), symbolic), symbolic)
    return NodeCost("compute", moved / cluster.memory_bandwidth, bytes=moved)


def optimizer_seconds(optimizer: str, shard_numel: int, shard_bytes: int, tensors: int, cluster: Cluster) -> float:
    """One optimizer step over this rank's shards: the measured line (``cluster.optimizer_step``, per tensor and per
    shard byte), else memory-bound passes over the shard bytes (AdamW: 7, reading parameter, gradient and moments,
    writing parameter and moments; SGD: 3) plus each foreach operator's call per tensor where a host model prices
    calls."""
    if optimizer == "none":
        return 0.0
    measured = cluster.optimizer_step.get("adamw" if optimizer == "adam" else optimizer)
    if measured is not None:
        per_tensor, per_byte = measured
        return tensors * per_tensor + shard_bytes * per_byte
    passes, ops = {"adamw": (7, 12), "adam": (7, 12), "sgd": (3, 2)}[optimizer]
    seconds = passes * shard_bytes / cluster.memory_bandwidth
    return seconds + cluster.host.operator_calls(ops * tensors) if cluster.host is not None else seconds


def outside_graph_seconds(optimizer: str, shard_numel: int, shard_bytes: int, tensors: int,
                          cluster: Cluster) -> float:
    """A step's compute outside its graphs: the optimizer step and the runtime's per-parameter work
    (``cluster.runtime_per_tensor``)."""
    return (optimizer_seconds(optimizer, shard_numel, shard_bytes, tensors, cluster)
            + tensors * cluster.runtime_per_tensor)
