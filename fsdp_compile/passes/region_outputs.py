"""Keep a region call's outputs from sharing memory that Inductor does not know is shared.

Inductor gives each output of a region call a buffer of its own and reuses a dead one's storage,
never asking whether two outputs (or an output and an operand) are one storage, which partitioned
bodies often make them (q, k, v as views of one projection): silently wrong results. So each
top-level reader of such an output reads a view of the storage's owner, made where Inductor tracks views.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .context import PassContext
from .graph import calls, is_region_call, node_value, output_values, placeholders, storage_keys
from .lowering import refresh_fake_values
from .regions import inline_call, region_body


def alias_path(node: fx.Node) -> list[fx.Node]:
    """``[owner, ..., node]``: the nodes on ``node``'s storage from its owner (input or allocating op)."""
    (key,) = storage_keys(node_value(node)) or {None}
    path = [node]
    while key is not None and path[-1].op != "placeholder":
        source = next((i for i in path[-1].all_input_nodes if key in storage_keys(node_value(i))), None)
        if source is None:
            break
        path.append(source)
    path.reverse()
    # An op of several results (native_layer_norm): each result's owner is its getitem.
    while len(path) > 1 and not isinstance(node_value(path[0]), torch.Tensor):
        path.pop(0)
    return path


def _readers(call: fx.Node) -> dict[int, list[fx.Node]]:
    """The call's ``getitem`` nodes that something reads, by output index."""
    readers: dict[int, list[fx.Node]] = {}
    for user in call.users:
        if calls(user, (operator.getitem,)) and user.users:
            readers.setdefault(user.args[1], []).append(user)
    return readers


def _output_of(call: fx.Node, owner: fx.Node, added: dict[fx.Node, int], fake_mode: Any) -> fx.Node:
    """A getitem of ``call`` reading body output ``owner``, added to the outputs once per body if missing."""
    body = region_body(call)
    outputs = output_values(body.graph)
    if owner in outputs:
        index = outputs.index(owner)
    elif owner in added:
        index = added[owner]
    else:
        output = next(n for n in reversed(body.graph.nodes) if n.op == "output")
        index = added[owner] = len(outputs)
        output.args = ((*outputs, owner),)
        body.recompile()
    existing = [u for u in call.users if u.target is operator.getitem and u.args[1] == index]
    if existing:
        return existing[0]
    values = list(node_value(call))
    while len(values) <= index:  # this call's value lacks the output the body gained
        template = node_value(owner)
        with fake_mode:
            values.append(torch.empty_strided(template.shape, template.stride(), dtype=template.dtype,
                                              device=template.device))
    call.meta["val"] = tuple(values)
    with call.graph.inserting_after(call):
        item = call.graph.call_function(operator.getitem, (call, index))
    item.meta["val"] = values[index]
    return item


def _redoable(views: list[fx.Node]) -> bool:
    """Whether each view reads only the one before it (constant sizes): copyable out of the body."""
    return all(view.all_input_nodes == [previous] for previous, view in itertools.pairwise(views))


def _redo(path: list[fx.Node], source: fx.Node, fake_mode: Any) -> fx.Node:
    """The views of ``path`` (after its owner) applied to ``source`` right after it; returns the last."""
    value = source
    for view in path[1:]:
        with source.graph.inserting_after(value):
            copy = source.graph.node_copy(view, lambda _, previous_value=value: previous_value)
        copy.meta = {k: v for k, v in view.meta.items() if k not in ("val", "tensor_meta")}
        with fake_mode:
            refresh_fake_values(copy)
        value = copy
    return value


def _shared_outputs(call: fx.Node) -> dict[fx.Node, list[tuple[int, list[fx.Node]]]]:
    """By owner, the read outputs of ``call`` on an operand's storage or another's: (index, path)."""
    readers = _readers(call)
    groups: dict[fx.Node, list[tuple[int, list[fx.Node]]]] = {}
    for index, output in enumerate(output_values(region_body(call).graph)):
        if index in readers and isinstance(output, fx.Node) and isinstance(node_value(output), torch.Tensor):
            path = alias_path(output)
            groups.setdefault(path[0], []).append((index, path))
    return {owner: read for owner, read in groups.items() if owner.op == "placeholder" or len(read) > 1}


def unalias_region_outputs(gm: fx.GraphModule, ctx: PassContext | None = None) -> int:
    """Each graph: readers of region outputs sharing a storage read views of its owner; returns how
    many. A call whose shared outputs are views sized by the body's values is inlined instead."""
    graph = gm.graph
    # Values are fake tensors in a compilation; a test may give real ones.
    fake_mode = detect_fake_mode([node_value(n) for n in placeholders(graph)]) or contextlib.nullcontext()
    added: dict[int, dict[fx.Node, int]] = {}  # id(body) -> outputs it gained
    count = 0
    for call in [n for n in graph.nodes if is_region_call(n)]:
        shared = _shared_outputs(call)
        if not shared:
            continue
        if not all(_redoable(path) for read in shared.values() for _, path in read):
            inline_call(call)
            count += 1
            continue
        body = region_body(call)
        readers = _readers(call)
        inputs = placeholders(body.graph)
        for owner, read in shared.items():
            if owner.op == "placeholder":
                source = call.args[2 + inputs.index(owner)]
            else:
                source = _output_of(call, owner, added.setdefault(id(body), {}), fake_mode)
            for index, path in read:
                if path == [owner] and owner.op != "placeholder":
                    continue  # the owner's own output stays as it is
                value = _redo(path, source, fake_mode)
                for item in readers[index]:
                    item.replace_all_uses_with(value)
                    graph.erase_node(item)
                    count += 1
    if count:
        graph.lint()
    return count

