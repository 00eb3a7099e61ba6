"""The graph vocabulary every pass, report and estimate shares (operators, node metadata, node
predicates, collectives read off their nodes), defined once so no two can disagree on a node.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..runtime import kernels, ring

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph

WAIT = _c10d.wait_tensor.default
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
# Functional collective -> its kind, as reports, the planner and the agreement check name it.
COLLECTIVES = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce"}
COLLECTIVE_OPS = tuple(COLLECTIVES)
_kernels = getattr(torch.ops, kernels.NAMESPACE)
COPY_IN = _kernels.copy_in.default
COPY_OUT = _kernels.copy_out.default
CHUNK_CAT = _kernels.chunk_cat.default
# The backend's copies around each collective -> their name, as the planner's calibration keys them.
COPY_KERNELS = {COPY_IN: "copy_in", COPY_OUT: "copy_out", CHUNK_CAT: "chunk_cat"}

# Ops that only reinterpret their input's storage: free to move, allocate nothing.
PURE_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.permute.default, aten.transpose.int,
    aten.expand.default, aten.alias.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.as_strided.default,
}
# Views plus reshapes and casts: recomputing them costs nothing; saving one keeps the whole gathered parameter.
VIEW_LIKE = PURE_VIEWS | {aten.reshape.default, aten._to_copy.default, aten.clone.default,
                          torch.ops.prims.convert_element_type.default}

# node.meta keys our passes set.
COMM_META = "fsdp_comm"  # a CommTag on every node a bucket was lowered into
ROLE_META = "fsdp_role"  # "param" on graph inputs that are parameter shards (see inspection/memory_estimate.py)
# A backward's saved input -> its forward output's storage key (region calls may share a fake storage).
SAVED_STORAGE_META = "fsdp_saved_storage"


@dataclass(frozen=True)
class CommTag:
    """On every node a bucket was lowered into; ``stage`` counts the waits before the node."""

    group: int  # one per lowered bucket, unique within the graph
    kind: str  # "gather" or "reduce"
    stage: int
    bucket: str
    bytes: int  # unsharded bytes the collective moves (gather output / reduce input)


@dataclass(frozen=True)
class Collective:
    """One functional collective of a graph, as its node states it."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce"
    group: str  # the process group's registered name
    group_size: int | None  # stated by all-gather and reduce-scatter; None for all-reduce
    dtype: torch.dtype
    buffer_bytes: int  # all-gather output, reduce-scatter input, all-reduce buffer

    def resolved_group_size(self) -> int:
        if self.group_size is not None:
            return self.group_size
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(self.group).size()

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends (= receives) with ring algorithms."""
        return ring.wire_bytes(self.kind, self.buffer_bytes, self.resolved_group_size())


def calls(node: object, targets: Collection) -> bool:
    """Whether ``node`` is a call of one of ``targets``."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_collective(node: fx.Node) -> bool:
    return calls(node, COLLECTIVES)


def is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout on a weight): run again, it would draw others."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def node_value(node: fx.Node) -> Any:
    """The (fake) value a node holds: AOTAutograd's ``val``, else Dynamo's ``example_value``."""
    return node.meta.get("val", node.meta.get("example_value"))


def placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def output_values(graph: fx.Graph) -> list[Any]:
    """What the graph's output node returns, as a list."""
    values = next(n for n in reversed(graph.nodes) if n.op == "output").args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def storage_key(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    return getattr(storage, "_cdata", None) or id(storage)


def storage_keys(value: Any) -> set[int]:
    """Keys of the storages behind a value: a tensor's, or each tensor's of a tuple (a ``split``)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return {storage_key(t) for t in values if isinstance(t, torch.Tensor)}


def decode_collective(node: fx.Node) -> Collective | None:
    """The collective ``node`` calls, or None."""
    if not is_collective(node):
        return None
    kind = COLLECTIVES[node.target]
    value = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
    if kind == "all_reduce":
        group, size = node.args[2], None
    else:
        group, size = node.args[-1], node.args[-2]
    return Collective(kind, group, size, value.dtype, value.numel() * value.element_size())


def collective_bytes(node: fx.Node) -> int:
    """Unsharded bytes a collective holds in flight."""
    return decode_collective(node).buffer_bytes


def is_compute(node: fx.Node) -> bool:
    """A node that does work on the compute stream: not communication, not a pure view."""
    return node.op == "call_function" and COMM_META not in node.meta and node.target not in PURE_VIEWS


def view_base(node: object) -> object:
    """What a chain of pure views reads (``node`` itself when it is no view)."""
    while calls(node, PURE_VIEWS):
        node = node.args[0]
    return node


def tag_parameter_input(node: fx.Node) -> None:
    """Mark the graph input a marker reads (through views) as a parameter, for the memory estimate."""
    node = view_base(node)
    if node.op == "placeholder":
        # backward's regather reads a kept piece (reshard_after_forward=n), saved as "gathered"
        node.meta.setdefault(ROLE_META, "param")


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder nodes so each follows its inputs (a spliced bucket may not), keeping the order otherwise."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    placed: set[fx.Node] = set()
    cursor: fx.Node | None = None
    for root in list(graph.nodes):
        stack = [root]
        while stack:
            node = stack[-1]
            if node in placed:
                stack.pop()
                continue
            missing = sorted((i for i in node.all_input_nodes if i not in placed), key=position.__getitem__)
            if missing:
                stack.extend(reversed(missing))
                continue
            stack.pop()
            if cursor is not None and cursor.next is not node:
                cursor.append(node)
            placed.add(node)
            cursor = node


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A lazy copy with its own graph: code generation waits for the first call instead of each pass
    (seconds each for a graph of tens of thousands of nodes)."""
    return _LazyGraphModule(gm, copy.deepcopy(gm.graph))
