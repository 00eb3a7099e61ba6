"""Facts about compiled graphs: what communicates, and what forward keeps for backward."""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

from .ops import REDUCE_GRAD, UNSHARD
from .passes.reshard import VIEW_LIKE


def op_counts(gm: fx.GraphModule | None) -> Counter:
    """How many times each operator is called in ``gm`` (keys are ``str`` of the target)."""
    if gm is None:
        return Counter()
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def marker_counts(gm: fx.GraphModule | None) -> dict[str, int]:
    counts = op_counts(gm)
    return {"unshard": counts[str(UNSHARD)], "reduce_grad": counts[str(REDUCE_GRAD)]}


def _origin(node: fx.Node) -> fx.Node:
    """Follow views and casts back to the node that produced the data."""
    while node.op == "call_function" and node.target in VIEW_LIKE and node.args:
        node = node.args[0]
    return node


def saved_gathered_parameters(forward: fx.GraphModule) -> list[str]:
    """Forward outputs that are (views of) gathered parameters, i.e. kept alive for backward.

    The user-visible outputs of a training graph are activations, so any forward output that
    traces back to an ``unshard`` marker is a full parameter saved for the backward graph.
    """
    output = next(n for n in forward.graph.nodes if n.op == "output")
    saved = []
    for arg in _flatten(output.args):
        if isinstance(arg, fx.Node) and _origin(arg).target is UNSHARD:
            saved.append(arg.name)
    return saved


def _flatten(args) -> list:
    out: list = []
    fx.node.map_aggregate(args, out.append)
    return out
