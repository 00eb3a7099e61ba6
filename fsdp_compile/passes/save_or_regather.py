"""Joint-graph passes that turn each unit's reshard policy into partitioner decisions.

A unit that reshards has its gather and all computed from gathered parameters alone (a float8 cast
too, or the partitioner saves a float8 copy of every weight) tagged must-recompute; a unit that
keeps it, must-save; a unit resharding to ``n`` ranks keeps its ``1/n`` (``reshard``, must-save)
and backward gathers those pieces in the group. The gradient's reduction is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime.collectives import CommSpec
from ..runtime.markers import REDUCE_GRAD, RESHARD, UNSHARD, UNSHARD_TARGETS, Marker, decode
from .context import PassContext
from .graph import ROLE_META, calls, is_collective, is_random, tag_parameter_input


def unshard_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if calls(n, UNSHARD_TARGETS)]


def elide_trivial_unshard(graph: fx.Graph) -> int:
    """Replace markers that neither gather nor cast by their input; returns how many (a NO_SHARD
    marker's copy, saved for backward, would double the parameter memory)."""
    count = 0
    for node in unshard_nodes(graph):
        spec = decode(node).spec
        source = node.args[0]
        source_dtype = source.meta["val"].dtype if "val" in source.meta else None
        if spec.gathers or (spec.param_dtype is not None and spec.param_dtype != source_dtype):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        tag_parameter_input(source)
        count += 1
    return count


def tag_reshard_policy(graph: fx.Graph) -> int:
    """Tag each gather with its unit's policy; returns how many reshard. Must-save is stated: the
    partitioner's cost model might re-run a gather, doubling backward's traffic."""
    count = 0
    backward = backward_nodes(graph)
    dropped: list[fx.Node] = []
    for node in unshard_nodes(graph):
        marker = decode(node)
        spec = marker.spec
        if not spec.gathers:
            continue
        if not spec.reshard_after_forward:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        count += 1
        if spec.reshard_size:
            _regather_in_group(graph, marker, backward)
            continue
        dropped.append(node)
    for node in parameter_only(graph, dropped, backward):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return count


def parameter_only(graph: fx.Graph, sources: list[fx.Node], backward: set[fx.Node]) -> list[fx.Node]:
    """``sources`` and the forward nodes computed from them (and constants) alone, in graph order."""
    chain = set(sources)
    for node in graph.nodes:
        communicates = is_collective(node) or calls(node, (*UNSHARD_TARGETS, REDUCE_GRAD, RESHARD))
        if node in chain or node.op != "call_function" or node in backward or communicates or is_random(node):
            continue
        inputs = node.all_input_nodes
        if inputs and any(n in chain for n in inputs) and all(n in chain or n.op == "get_attr" for n in inputs):
            chain.add(node)
    return [n for n in graph.nodes if n in chain]


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of a joint graph that the incoming gradients (``tangents_*``) reach."""
    reached: set[fx.Node] = set()
    pending = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    while pending:
        node = pending.pop()
        if node not in reached:
            reached.add(node)
            pending.extend(u for u in node.users if u.op != "output")
    return reached


def _regather_in_group(graph: fx.Graph, marker: Marker, backward: set[fx.Node]) -> None:
    """Forward keeps this rank's piece over the reshard group; backward gathers it in the group."""
    full, spec = marker.node, marker.spec
    chain = parameter_only(graph, [full], backward)
    uses = [(user, source) for source in chain for user in source.users if user in backward]
    if not uses:
        return
    fake_mode = detect_fake_mode([full.meta.get("val")])
    first = min((user for user, _ in uses), key=_position(graph))
    with graph.inserting_after(full):
        kept = graph.call_function(RESHARD, (full, marker.fqn, marker.unit, *spec.op_args()))
    regathered_spec = CommSpec.resharded(spec)
    with graph.inserting_before(first):
        regathered = graph.call_function(UNSHARD, (kept, marker.fqn, marker.unit, marker.rows,
                                                   *regathered_spec.op_args()))
    _fake(kept, fake_mode)
    _fake(regathered, fake_mode)
    kept.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    kept.meta[ROLE_META] = "gathered"  # a piece of the gathered parameter, held to backward
    redone: dict[fx.Node, fx.Node] = {full: regathered}

    in_chain = set(chain)

    def redo(node: fx.Node) -> fx.Node:
        if node not in redone:
            inputs = [redo(n) for n in node.all_input_nodes if n in in_chain]
            args, kwargs = fx.map_arg((node.args, dict(node.kwargs)), lambda n: redone[n] if n in in_chain else n)
            last = inputs[0] if len(inputs) == 1 else max(inputs, key=_position(graph))
            with graph.inserting_after(last):
                copy = graph.call_function(node.target, args, kwargs)
            _fake(copy, fake_mode)
            redone[node] = copy
        return redone[node]

    for user, source in uses:
        user.replace_input_with(source, redo(source))
    for node in redone.values():
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _fake(node: fx.Node, fake_mode) -> None:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = node.target(*args, **kwargs)


def apply_reshard_choice(graph: fx.Graph, reshard: dict[str, tuple[int, str]]) -> int:
    """Give each unit's gathers the setting ``memory_budget=`` chose; returns how many changed."""
    count = 0
    for node in unshard_nodes(graph):
        marker = decode(node)
        if marker.unit not in reshard or not marker.spec.gathers:
            continue
        ranks, group = reshard[marker.unit]
        partial = 1 < ranks < marker.spec.shard_size
        spec = dataclasses.replace(marker.spec, reshard_after_forward=ranks > 1,
                                   reshard_size=ranks if partial else 0, reshard_group=group if partial else "")
        node.args = (*node.args[:-1], *spec.op_args())
        count += 1
    return count


def apply_reshard_choice_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Joint graph, under ``memory_budget=``: each unit's gathers get the reshard setting chosen."""
    return apply_reshard_choice(gm.graph, ctx.reshard or {})


def elide_trivial_unshard_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Joint graph and each graph: markers that neither gather nor cast are dropped."""
    return elide_trivial_unshard(gm.graph)


def tag_reshard_policy_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Joint graph: the reshard policy as partitioner tags (FULL_SHARD gathers again in backward)."""
    return tag_reshard_policy(gm.graph)
