"""Facts about compiled graphs: what communicates, how many bytes, what forward keeps for backward."""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter

import torch.fx as fx

from ..passes.graph import COLLECTIVES, COPY_OUT, VIEW_LIKE, WAIT, Collective, decode_collective, is_compute
from ..runtime.markers import REDUCE_GRAD, UNSHARD, UNSHARD_NO_SYNC, UNSHARD_TARGETS


def marker_counts(gm: fx.GraphModule | None) -> dict[str, int]:
    counts = Counter(str(n.target) for n in (gm.graph.nodes if gm is not None else ()) if n.op == "call_function")
    return {"unshard": counts[str(UNSHARD)] + counts[str(UNSHARD_NO_SYNC)], "reduce_grad": counts[str(REDUCE_GRAD)]}


def collectives(gm: fx.GraphModule | None) -> list[Collective]:
    """Every collective of ``gm`` in graph order, with its group's size resolved."""
    if gm is None:
        return []
    found = (decode_collective(n) for n in gm.graph.nodes)
    return [dataclasses.replace(c, group_size=c.resolved_group_size()) for c in found if c is not None]


def collective_counts(gm: fx.GraphModule | None) -> dict[str, int]:
    counts = Counter(c.kind for c in collectives(gm))
    return {kind: counts[kind] for kind in COLLECTIVES.values()}


def missed_overlaps(gm: fx.GraphModule) -> list[str]:
    """Collectives waited right after they are issued although some later compute node (not a
    view) does not need the result and could have run between."""
    nodes = list(gm.graph.nodes)
    missed = []
    for i, node in enumerate(nodes):
        wait = node.next
        if node.target not in COLLECTIVES or wait.target is not WAIT or wait.args[0] is not node:
            continue
        needs_wait = _closure(wait, lambda n: n.users)
        later = (n for n in nodes[i + 2:] if is_compute(n))
        if any(n not in needs_wait for n in later):
            missed.append(node.name)
    return missed


def _closure(start: fx.Node, step) -> set[fx.Node]:
    seen, stack = set(), [start]
    while stack:
        for other in step(stack.pop()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _origin(node: fx.Node) -> fx.Node:
    """Follow views and casts back to the node that produced the data."""
    while node.op == "call_function" and node.target in VIEW_LIKE and node.args:
        node = node.args[0]
    return node


def is_gathered(node: fx.Node) -> bool:
    """Whether ``node`` is (a view of) a gathered parameter."""
    node = _origin(node)
    if node.target in UNSHARD_TARGETS:
        return True
    return node.target is operator.getitem and getattr(node.args[0], "target", None) is COPY_OUT


def saved_gathered_parameters(forward: fx.GraphModule) -> list[str]:
    """Forward outputs that trace back to a gather: full parameters saved for the backward graph."""
    output = next(n for n in forward.graph.nodes if n.op == "output")
    found: list = []
    fx.node.map_aggregate(output.args, found.append)
    return [arg.name for arg in found if isinstance(arg, fx.Node) and is_gathered(arg)]
