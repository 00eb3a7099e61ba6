"""A static memory estimate of a graph: live tensor bytes along its node order.

From the fake tensors in ``node.meta["val"]``: a storage lives from the node that produces it
to the last use of any tensor on it (views share their base's); graph inputs, held by the caller,
count throughout, and ``held`` adds bytes the caller holds outside the graph. Each storage has a
role from what the passes recorded: ``param``, ``gathered`` (unsharded parameters and gather
buffers), ``grad``, ``buffer``, ``tp_comm`` (the buffers of torch's own collectives, tensor
parallelism's), ``activation`` (the rest). The bytes of our collectives in flight, which the
scheduler bounds, are tracked apart.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..passes.graph import COLLECTIVE_OPS, COMM_META, PURE_VIEWS, ROLE_META, SAVED_STORAGE_META, WAIT, collective_bytes
from ..passes.regions import aliased_input, is_region_call, region_body

ROLES = ("param", "gathered", "grad", "activation", "buffer", "tp_comm")


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_node: str
    peak_by_role: dict[str, int]  # live bytes of each role at the overall peak
    max_by_role: dict[str, int]  # each role's own maximum along the graph
    peak_inflight_bytes: int  # collectives issued and not yet waited
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (node, live bytes after it)
    role_timeline: list[dict[str, int]] = field(default_factory=list)
    inflight_timeline: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        names = ("peak_bytes", "peak_node", "peak_by_role", "max_by_role", "peak_inflight_bytes")
        return {name: getattr(self, name) for name in names}


def _tensors(value) -> list[torch.Tensor]:
    found: list = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _storage_key(t: torch.Tensor):
    try:
        return id(t.untyped_storage())
    except Exception:  # tensors without storage (e.g. some subclasses): one key per tensor
        return ("tensor", id(t))


def _storage_bytes(t: torch.Tensor, symbolic: bool = False):
    """Bytes of ``t``'s storage: an int, or with ``symbolic`` a sympy expression when the
    graph was traced with symbolic sizes. A symbolic size is never turned into an int by
    ``int()``, which would add a guard and specialize the graph: its hint is used instead."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except Exception:
        nbytes = t.numel() * t.element_size()
    if isinstance(nbytes, torch.SymInt):
        return nbytes.node.expr if symbolic else size_hint(nbytes)
    return int(nbytes)


def size_hint(value) -> int:
    """The example value behind a symbolic size, without guarding on it (torch >= 2.11)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    from torch.fx.experimental import symbolic_shapes

    for name in ("optimization_hint", "hint_int"):  # 2.13 / 2.11
        fn = getattr(symbolic_shapes, name, None)
        if fn is not None:
            return int(fn(value))
    return int(value.node.hint)


@dataclass
class StorageLifetimes:
    """Each storage of a graph: its bytes, role, and the node indices it lives between."""

    nodes: list[fx.Node]
    size: dict
    role: dict
    born: dict
    last_use: dict
    keys: dict = field(default_factory=dict)  # node -> the storage keys of its value's tensors


def storage_keys(gm: fx.GraphModule) -> dict[fx.Node, list[tuple[Any, torch.Tensor]]]:
    """Each node's tensors, with a key naming the storage each one lives on at run time.

    A value inherits a key only from the node's own inputs (an aliasing op: a view, a getitem of
    a split, a wait), else it is a new storage: fake propagation can hand unrelated nodes one
    fake storage (every call of a region body returns the first call's). A pure view takes its
    base's key whatever its value; a region call's outputs are new but those passed through from
    an input; a backward graph's saved input takes its forward output's key (``SAVED_STORAGE_META``).
    """
    keys: dict[fx.Node, list[tuple[Any, torch.Tensor]]] = {}
    for node in gm.graph.nodes:
        tensors = _tensors(node.meta.get("val"))
        if node.op == "placeholder":
            keys[node] = _input_keys(node)
            continue
        if is_region_call(node):
            keys[node] = _region_call_keys(node, tensors, keys)
            continue
        inputs = node.all_input_nodes
        if node.op == "call_function" and node.target in PURE_VIEWS and inputs and keys.get(inputs[0]):
            keys[node] = [(keys[inputs[0]][0][0], t) for t in tensors]
            continue
        inherited = {_storage_key(v): key for inp in inputs for key, v in keys.get(inp, [])}
        keys[node] = [(inherited.get(_storage_key(t), (node.name, _storage_key(t))), t) for t in tensors]
    return keys


def _input_keys(node: fx.Node) -> list[tuple[Any, torch.Tensor]]:
    saved = node.meta.get(SAVED_STORAGE_META)
    return [(("saved", saved) if saved is not None else ("input", _storage_key(t)), t)
            for t in _tensors(node.meta.get("val"))]


def _region_call_keys(call: fx.Node, tensors: list[torch.Tensor], keys: dict) -> list[tuple[Any, torch.Tensor]]:
    """A region call's outputs: an output its body passes through from an input (or a view
    of one) is on that input's storage; the others are new storages of the call, shared
    where their values share one (views of one body value)."""
    body = region_body(call)
    operands = call.args[2:]
    out = []
    for index, t in enumerate(tensors):
        source = aliased_input(body, index)
        operand = operands[source] if source is not None and source < len(operands) else None
        passed = isinstance(operand, fx.Node) and keys.get(operand)
        out.append((keys[operand][0][0] if passed else (call.name, _storage_key(t)), t))
    return out


def storage_lifetimes(gm: fx.GraphModule, symbolic: bool = False) -> StorageLifetimes:
    """A storage is allocated by the first node producing it (inputs: at the start) and freed
    after the last node using any tensor on it (inputs: at the end)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    size: dict = {}
    role: dict = {}
    born: dict = {}
    last_use: dict = {}
    node_keys = storage_keys(gm)
    for i, node in enumerate(nodes):
        for key, t in node_keys[node]:
            if key not in size:
                size[key] = _storage_bytes(t, symbolic)
                role[key] = role_of(node)
                born[key] = 0 if node.op == "placeholder" else i
                last_use[key] = end if node.op == "placeholder" else i
    for node in nodes:
        for user in node.users:
            for key, _ in node_keys[node]:
                last_use[key] = max(last_use[key], index[user])
    keys = {node: [key for key, _ in pairs] for node, pairs in node_keys.items()}
    return StorageLifetimes(nodes, size, role, born, last_use, keys)


def output_storage_keys(lifetimes: StorageLifetimes) -> list[Any]:
    """The storage key of each of the graph's outputs (None where it is not a tensor node):
    what a backward graph's saved inputs carry as ``SAVED_STORAGE_META``."""
    output = next(n for n in reversed(lifetimes.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    return [lifetimes.keys[v][0] if isinstance(v, fx.Node) and lifetimes.keys.get(v) else None for v in values]


def input_bytes(gm: fx.GraphModule, role: str) -> int:
    """Bytes of the graph inputs with ``role`` (distinct storages)."""
    seen, total = set(), 0
    for node in gm.graph.find_nodes(op="placeholder"):
        if role_of(node) == role:
            for key, t in _input_keys(node):
                if key not in seen:
                    seen.add(key)
                    total += _storage_bytes(t)
    return total


def role_of(node: fx.Node) -> str:
    if ROLE_META in node.meta:
        return node.meta[ROLE_META]
    tag = node.meta.get(COMM_META)
    if tag is not None:
        return "gathered" if tag.kind == "gather" else "grad"
    # Not ours (untagged): torch's own, tensor parallelism's; its wait's value too.
    if node.target in COLLECTIVE_OPS or (node.target is WAIT and isinstance(node.args[0], fx.Node)
                                         and node.args[0].target in COLLECTIVE_OPS):
        return "tp_comm"
    return "activation"


def _region_scratch_bytes(call: fx.Node, scratch: dict[int, int]) -> int:
    """The most bytes a region call's body holds at once besides its inputs and outputs,
    which the calling graph counts (cached per body: its calls share it)."""
    body = region_body(call)
    if id(body) not in scratch:
        life = storage_lifetimes(body)
        ends = {key for node in body.graph.nodes if node.op in ("placeholder", "output")
                for arg in ([node] if node.op == "placeholder" else node.all_input_nodes)
                for key in life.keys.get(arg, [])}
        change = [0] * (len(life.nodes) + 1)
        for key, nbytes in life.size.items():
            if key not in ends:
                change[life.born[key]] += nbytes
                change[life.last_use[key] + 1] -= nbytes
        scratch[id(body)] = max(0, *itertools.accumulate(change))
    return scratch[id(body)]


def estimate_memory(gm: fx.GraphModule, held: dict[str, int] | None = None,
                    lifetimes: StorageLifetimes | None = None) -> MemoryEstimate:
    """``held``: bytes per role the caller keeps alive during the graph without passing them
    in (e.g. the parameters a backward graph does not read), counted at every node.
    ``lifetimes``: ``storage_lifetimes(gm)``, where the caller needs them too."""
    if lifetimes is None:
        lifetimes = storage_lifetimes(gm)
    nodes, size, role = lifetimes.nodes, lifetimes.size, lifetimes.role
    allocs: dict[int, list] = {}
    frees: dict[int, list] = {}
    for key in size:
        allocs.setdefault(lifetimes.born[key], []).append(key)
        frees.setdefault(lifetimes.last_use[key], []).append(key)

    scratch: dict[int, int] = {}  # region body -> bytes it needs beyond its inputs and outputs
    in_flight: dict[fx.Node, int] = {}  # collective -> bytes, from the collective until its wait
    by_role = dict.fromkeys(ROLES, 0)
    for r, extra in (held or {}).items():
        by_role[r] += extra
    live = sum(by_role.values())
    timeline, role_timeline, inflight_timeline = [], [], []
    peak, peak_node, peak_by_role = -1, "", dict(by_role)
    max_by_role = dict(by_role)
    for i, node in enumerate(nodes):
        for key in allocs.get(i, []):
            live += size[key]
            by_role[role[key]] += size[key]
        if node.target is WAIT:
            in_flight.pop(node.args[0], None)
        elif node.target in COLLECTIVE_OPS and COMM_META in node.meta:  # ours: what the schedule bounds
            in_flight[node] = collective_bytes(node)
        # A region call's body holds its own intermediates while it runs, on top of what is
        # live here (its inputs, and its outputs allocated above).
        body_bytes = _region_scratch_bytes(node, scratch) if is_region_call(node) else 0
        live += body_bytes
        by_role["activation"] += body_bytes
        if live > peak:
            peak, peak_node, peak_by_role = live, node.name, dict(by_role)
        for r in ROLES:
            max_by_role[r] = max(max_by_role[r], by_role[r])
        timeline.append((node.name, live))
        role_timeline.append(dict(by_role))
        inflight_timeline.append(sum(in_flight.values()))
        live -= body_bytes
        by_role["activation"] -= body_bytes
        for key in frees.get(i, []):
            live -= size[key]
            by_role[role[key]] -= size[key]
    return MemoryEstimate(peak_bytes=max(peak, 0), peak_node=peak_node, peak_by_role=peak_by_role,
                          max_by_role=max_by_role, peak_inflight_bytes=max(inflight_timeline, default=0),
                          timeline=timeline, role_timeline=role_timeline, inflight_timeline=inflight_timeline)
