"""A static memory estimate of a graph: live tensor bytes along its node order.

Walks the graph once, using the fake tensors in ``node.meta["val"]``. Views share their
base's storage; a storage is allocated by the first node that produces it and freed after the
last node that uses any tensor on it. Graph inputs are held by the caller for the whole graph
(parameters, saved activations), so they count from start to end.

A caller can add bytes it holds without passing them in (``held``): the parameters a backward
graph does not read stay resident all the same. Each storage gets a role, from what the passes
recorded on the nodes: ``param`` (shards, or whole parameters for NO_SHARD), ``gathered``
(unsharded parameters and gather buffers), ``grad`` (reduction buffers and gradients),
``buffer`` (module buffers, where a caller tagged them), ``activation`` (everything else).
Separately it tracks the bytes of collectives in flight (issued, not yet waited), which the
scheduler bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..passes.graph import COLLECTIVE_OPS, COMM_META, ROLE_META, WAIT, collective_bytes

ROLES = ("param", "gathered", "grad", "activation", "buffer")


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
        return {"peak_bytes": self.peak_bytes, "peak_node": self.peak_node,
                "peak_by_role": self.peak_by_role, "max_by_role": self.max_by_role,
                "peak_inflight_bytes": self.peak_inflight_bytes}


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
    node_storages: dict[fx.Node, list] = {}
    for i, node in enumerate(nodes):
        keys = []
        for t in _tensors(node.meta.get("val")):
            key = _storage_key(t)
            keys.append(key)
            if key not in size:
                size[key] = _storage_bytes(t, symbolic)
                role[key] = role_of(node)
                born[key] = 0 if node.op == "placeholder" else i
                last_use[key] = end if node.op == "placeholder" else i
        node_storages[node] = keys
    for node in nodes:
        for user in node.users:
            for key in node_storages[node]:
                last_use[key] = max(last_use[key], index[user])
    return StorageLifetimes(nodes, size, role, born, last_use)


def input_bytes(gm: fx.GraphModule, role: str) -> int:
    """Bytes of the graph inputs with ``role`` (distinct storages)."""
    seen, total = set(), 0
    for node in gm.graph.nodes:
        if node.op == "placeholder" and role_of(node) == role:
            for t in _tensors(node.meta.get("val")):
                key = _storage_key(t)
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
    return "activation"


def estimate_memory(gm: fx.GraphModule, held: dict[str, int] | None = None) -> MemoryEstimate:
    """``held``: bytes per role the caller keeps alive during the graph without passing them
    in (e.g. the parameters a backward graph does not read), counted at every node."""
    lifetimes = storage_lifetimes(gm)
    nodes, size, role, born, last_use = (lifetimes.nodes, lifetimes.size, lifetimes.role,
                                          lifetimes.born, lifetimes.last_use)

    allocs: dict[int, list] = {}
    frees: dict[int, list] = {}
    for key in size:
        allocs.setdefault(born[key], []).append(key)
        frees.setdefault(last_use[key], []).append(key)

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
        elif node.target in COLLECTIVE_OPS:
            in_flight[node] = collective_bytes(node)
        if live > peak:
            peak, peak_node, peak_by_role = live, node.name, dict(by_role)
        for r in ROLES:
            max_by_role[r] = max(max_by_role[r], by_role[r])
        timeline.append((node.name, live))
        role_timeline.append(dict(by_role))
        inflight_timeline.append(sum(in_flight.values()))
        for key in frees.get(i, []):
            live -= size[key]
            by_role[role[key]] -= size[key]
    return MemoryEstimate(
        peak_bytes=max(peak, 0), peak_node=peak_node, peak_by_role=peak_by_role,
        max_by_role=max_by_role, peak_inflight_bytes=max(inflight_timeline, default=0),
        timeline=timeline, role_timeline=role_timeline, inflight_timeline=inflight_timeline,
    )
