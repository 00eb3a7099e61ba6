"""Passes that keep the collectives of compile regions in the top-level graph.

A unit compiled as a region (:mod:`fsdp_compile.sharding.compile_regions`) is one body that every
block calls through ``invoke_subgraph``. Collectives inside that body would be invisible to
bucketing and scheduling (which work on the top-level graph), would run once per read through
the eager runtime, and the strategy's reshard policy could not reach them. Three passes move
them out and keep them out:

* ``hoist_region_markers`` (the Dynamo graph, before AOTAutograd): every ``unshard`` marker a
  body applies to one of its inputs becomes an input of the body that takes the full
  parameter, and each call site gathers it in the top-level graph with its own parameter's
  marker (name, unit, groups). The body is shared, so it is rewritten once; the call sites
  each get their markers. AOTAutograd then derives the reductions at the top level too.
* ``inline_reordering_regions`` (the Dynamo graph, after hoisting): a region changes where
  autograd adds up a gradient when one of its inputs is read twice inside the body and is
  also read elsewhere (a decoder's cross-attention over the encoder's output): the body sums
  its own reads first, eagerly every read is added in turn. The sums are equal up to
  rounding, but compiled runs promise the eager runtime's bits, so the calls of such a body
  are inlined (its blocks then compile as without regions; the others keep their region).
* ``route_region_inputs`` (the joint graph, before the reshard policy): AOTAutograd's
  partition of a body saves what its backward needs as extra outputs of its forward call,
  gathered parameters included, so the backward call would receive the full parameter from
  the forward call and the top-level partitioner could only save it (FULL_SHARD would hold
  every gathered block until backward). A backward call's input that is only an input of the
  forward call passed through (or a view of one) is taken from the forward call's input
  instead: the gather's output, which the reshard policy can then recompute in backward. A
  chain of views that ends where it began (``t(t(w))``) is not redone: the input itself is
  passed.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime.markers import REDUCE_GRAD, UNSHARD, UNSHARD_TARGETS
from ..sharding.compile_regions import REGION_UNIT
from .context import PassContext
from .graph import PURE_VIEWS, copy_graph_module, is_random

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
# node.meta key: the sharded parameter a Dynamo graph input stands for (set by the compiler).
PARAM_META = "fsdp_param"
# Dynamo's graphs call the marker through its overload packet, AOTAutograd's through .default.
_UNSHARD_TARGETS = (UNSHARD, UNSHARD.overloadpacket)


def is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is INVOKE_SUBGRAPH


def has_regions(graph: fx.Graph) -> bool:
    """Whether a captured graph calls regions, or holds the markers of a region Dynamo inlined."""
    return any(is_region_call(n) or (n.op == "call_function" and n.target in _UNSHARD_TARGETS
                                     and n.args[2] == REGION_UNIT) for n in graph.nodes)


def is_region_body_joint(graph: fx.Graph) -> bool:
    """Whether a joint graph is a region body's (AOTAutograd partitions each body through the
    backend's partitioner too): no markers of ours and no region calls. A body's markers were
    hoisted; a top-level graph reads parameters through markers or calls regions."""
    ours = (*UNSHARD_TARGETS, REDUCE_GRAD, INVOKE_SUBGRAPH)
    return not any(n.op == "call_function" and n.target in ours for n in graph.nodes)


def region_body(node: fx.Node) -> fx.GraphModule:
    """The graph module a region call runs."""
    owner = node.graph.owning_module
    return getattr(owner, node.args[0].target)


def _value(node: fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _region_markers(body: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """The markers of ``body`` that read one of its inputs, with that input's index."""
    index = {p: i for i, p in enumerate(n for n in body.graph.nodes if n.op == "placeholder")}
    return [(n, index[n.args[0]]) for n in body.graph.nodes
            if n.op == "call_function" and n.target in _UNSHARD_TARGETS and n.args[0] in index
            and n.args[2] == REGION_UNIT]


def _hoist_from_body(body: fx.GraphModule, hoisted: list[tuple[fx.Node, int]]) -> tuple[list[int], list[fx.Node]]:
    """Rewrite ``body`` so the outputs of ``hoisted`` markers are inputs; returns which
    original inputs it still takes (by index), and the new inputs (one per marker, in order;
    their metadata is the marker's: the full parameter)."""
    graph = body.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    new_inputs = []
    last = placeholders[-1] if placeholders else None
    for marker, _ in hoisted:
        with graph.inserting_after(last) if last is not None else contextlib.nullcontext():
            full = graph.placeholder(f"{marker.name}_full")
        full.meta = dict(marker.meta)
        last = full
        marker.replace_all_uses_with(full)
        graph.erase_node(marker)
        new_inputs.append(full)
    read = {j for _, j in hoisted}
    dropped = {j for j, p in enumerate(placeholders) if j in read and not p.users}
    for j in sorted(dropped):
        graph.erase_node(placeholders[j])
    body.recompile()
    return [j for j in range(len(placeholders)) if j not in dropped], new_inputs


# Higher-order operators whose body the hoisting reaches into: where their operands start.
# A block that checkpoints its activations holds its reads inside a checkpoint body inside the
# region's body.
_OPERANDS_START = {INVOKE_SUBGRAPH: 2, torch.ops.higher_order.tag_activation_checkpoint: 1,
                   torch.ops.higher_order.wrap: 1}


@dataclass
class _Hoisted:
    """A body with its region markers moved out: the rewritten copy and what its callers pass."""

    body: fx.GraphModule
    attr: str  # the copy's attribute name on the caller
    kept: list[int]  # original operands still passed, by index
    reads: list[tuple[int, tuple]]  # per new operand: the original operand read, marker arguments after it
    values: list[object]  # per new operand: its value (the full parameter)


def _lift(owner: fx.GraphModule, done: dict[int, _Hoisted]) -> int:
    """Move region markers out of every body ``owner``'s graph calls (bodies first, so markers
    nested deeper come up level by level) into ``owner``'s graph, where they keep naming the
    region; returns how many ``owner`` gained. Bodies are rewritten as copies registered beside
    the originals, which stay as they were (a failed pass rolls back ``owner``'s graph only)."""
    count = 0
    for call in [n for n in owner.graph.nodes if n.op == "call_function" and n.target in _OPERANDS_START]:
        start, attr = _OPERANDS_START[call.target], call.args[0]
        original = getattr(owner, attr.target)
        if id(original) not in done:
            body = copy_graph_module(original)
            _lift(body, done)
            markers = _region_markers(body)
            reads = [(j, tuple(marker.args[1:])) for marker, j in markers]
            kept, new_inputs = _hoist_from_body(body, markers)
            name = f"{attr.target}_hoisted"
            done[id(original)] = _Hoisted(body, name, kept, reads, [_value(n) for n in new_inputs])
        hoisted = done[id(original)]
        if not hasattr(owner, hoisted.attr):
            owner.register_module(hoisted.attr, hoisted.body)
        head, operands = list(call.args[:start]), call.args[start:]
        new_operands = [operands[j] for j in hoisted.kept]
        with owner.graph.inserting_before(call):
            for (j, args), value in zip(hoisted.reads, hoisted.values):
                full = owner.graph.call_function(UNSHARD.overloadpacket, (operands[j], *args))
                full.meta["example_value"] = value
                new_operands.append(full)
                count += 1
            head[0] = owner.graph.get_attr(hoisted.attr)
        call.args = (*head, *new_operands)
        if not attr.users:
            owner.graph.erase_node(attr)
    if count:
        owner.recompile()
    return count


def hoist_region_markers(gm: fx.GraphModule, params: dict[str, tuple]) -> int:
    """Move every region body's markers to its call sites (see the module docstring), through
    checkpoint bodies inside regions too; returns how many markers the top-level graph gained
    or had renamed. ``params``: each sharded parameter's name -> its marker's arguments after
    the input (:attr:`ShardedParamInfo.unshard_args`).

    Markers that reach the top-level graph still name the region, as do those of a body Dynamo
    inlined because only one call used it (a block that matched no other, such as a frozen
    one): each is given its parameter's own name, unit and groups, found from the graph input
    it reads (the leaf of that parameter)."""
    _lift(gm, {})
    markers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _UNSHARD_TARGETS
               and n.args[2] == REGION_UNIT]
    renamed = {m: _call_site_args(m, m.args[0], params) for m in markers}
    for marker, args in renamed.items():
        marker.args = (marker.args[0], *args)
    _drop_unused_bodies(gm)
    return len(renamed)  # the markers _lift added are among them


def _drop_unused_bodies(gm: fx.GraphModule) -> None:
    """Delete the graph modules ``gm`` holds that its graph no longer reads. Not
    ``delete_all_unused_submodules()``: it also deletes the bodies nested in kept bodies,
    which only those bodies' own graphs read."""
    read = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm.named_children()):
        if isinstance(child, fx.GraphModule) and name not in read:
            delattr(gm, name)


def _call_site_args(where: fx.Node, source: fx.Node, params: dict[str, tuple]) -> tuple:
    """The marker arguments of the parameter whose leaf ``source`` is (read at ``where``)."""
    name = source.meta.get(PARAM_META)
    if name is None or name not in params:
        raise ValueError(f"{where.name} reads {source.name} as a sharded parameter, but that input is not one "
                         "this backend sharded")
    return params[name]


def _reorders_gradients(call: fx.Node, body: fx.GraphModule) -> bool:
    """Whether ``call`` passes a tensor that needs a gradient, is read more than once in the
    body, and has other readers (so its gradient's sum would be grouped differently)."""
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    for operand, placeholder in zip(call.args[2:], placeholders):
        value = _value(operand) if isinstance(operand, fx.Node) else None
        if (isinstance(value, torch.Tensor) and value.requires_grad and len(placeholder.users) > 1
                and len(operand.users) > 1):
            return True
    return False


def inline_call(call: fx.Node) -> None:
    """Replace a region call by a copy of its body's nodes."""
    graph, gm, body = call.graph, call.graph.owning_module, region_body(call)
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, call.args[2:]))
    outputs: object = None
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = fx.node.map_arg(node.args[0], env.__getitem__)
                break
            copy = graph.node_copy(node, env.__getitem__)
            if node.op == "get_attr":  # a module the body holds (a nested region): hold it here too
                target = f"{call.args[0].target}_{node.target}".replace(".", "_")
                if not hasattr(gm, target):
                    gm.register_module(target, getattr(body, node.target))
                copy.target = target
            env[node] = copy
    results = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if call.users:
        raise ValueError(f"region call {call.name} is used other than through its outputs")
    graph.erase_node(call)


def inline_reordering_regions(gm: fx.GraphModule) -> int:
    """Inline every call of a body that some call would reorder a gradient sum for (see the
    module docstring); returns how many calls were inlined."""
    calls = [n for n in gm.graph.nodes if is_region_call(n)]
    unsafe = {c.args[0].target for c in calls if _reorders_gradients(c, region_body(c))}
    return inline_regions(gm, unsafe)


def inline_regions(gm: fx.GraphModule, bodies: Collection[str] | None = None) -> int:
    """Inline the calls of the given bodies (by attribute name; all by default); returns how
    many calls were inlined. A graph run as Python (``compiler="eager"``) needs them all
    inlined: a region's backward is traced when it first runs, which only works under
    AOTAutograd."""
    calls = [n for n in gm.graph.nodes if is_region_call(n)]
    inlined = [c for c in calls if bodies is None or c.args[0].target in bodies]
    for call in inlined:
        attr = call.args[0]
        inline_call(call)
        if not attr.users:
            gm.graph.erase_node(attr)
    if inlined:
        _drop_unused_bodies(gm)
    return len(inlined)


def _mentions_nodes(args: object) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return bool(found)


def _view_chain(body: fx.GraphModule, output_index: int) -> tuple[fx.Node | None, list[fx.Node]]:
    """The node ``body``'s output ``output_index`` is a chain of pure views of (or is), and
    those views from it to the output; (None, []) when there is no such output."""
    output = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)) or output_index >= len(values):
        return None, []
    node, views = values[output_index], []
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in PURE_VIEWS:
        views.append(node)
        node = node.args[0]
    return (node if isinstance(node, fx.Node) else None), views[::-1]


def _input_index(body: fx.GraphModule, node: fx.Node | None) -> int | None:
    if node is None or node.op != "placeholder":
        return None
    return [n for n in body.graph.nodes if n.op == "placeholder"].index(node)


def aliased_input(body: fx.GraphModule, output_index: int) -> int | None:
    """The index of the input that ``body``'s output ``output_index`` is, or is a view of:
    that output is on the input's storage, not a new one."""
    return _input_index(body, _view_chain(body, output_index)[0])


def passed_through(body: fx.GraphModule, output_index: int) -> tuple[int, list[fx.Node]] | None:
    """(input index, views from that input to the output) when ``body``'s output
    ``output_index`` is one of its inputs or a view of one that can be redone outside the
    body; else None."""
    root, views = _view_chain(body, output_index)
    index = _input_index(body, root)
    if index is None or any(_mentions_nodes((view.args[1:], view.kwargs)) for view in views):
        return None  # a view sized by the body's own values cannot be redone outside it
    return index, views


def parameter_computation(body: fx.GraphModule, output_index: int,
                          gathered: Collection[int]) -> list[fx.Node] | None:
    """The body's nodes that compute its output ``output_index`` from the inputs at positions
    ``gathered`` alone, in body order; None when it reads anything else (another input, a
    constant) or is an input itself."""
    output = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)) or output_index >= len(values):
        return None
    target = values[output_index]
    if not isinstance(target, fx.Node) or target.op != "call_function":
        return None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    allowed = {placeholders[i] for i in gathered if i < len(placeholders)}
    needed: set[fx.Node] = set()
    pending = [target]
    while pending:
        node = pending.pop()
        if node in needed or node in allowed:
            continue
        if node.op != "call_function" or node.target is INVOKE_SUBGRAPH or is_random(node):
            return None
        needed.add(node)
        pending.extend(node.all_input_nodes)
    return [n for n in body.graph.nodes if n in needed]


def _redo_parameter_computation(graph: fx.Graph, call: fx.Node, producer: fx.Node, body: fx.GraphModule,
                                output_index: int) -> fx.Node | None:
    """Compute a forward call's output that backward reads again in the top-level graph,
    before ``call``, when the body computes it from gathered parameters alone (a float8
    weight's scaled cast): the reshard policy then recomputes it in backward from the
    regathered parameter instead of the partitioner saving it. None when it does not."""
    operands = producer.args[2:]
    gathered = [i for i, operand in enumerate(operands) if _is_gathered(operand)]
    nodes = parameter_computation(body, output_index, gathered) if gathered else None
    if not nodes:
        return None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    mapping: dict[fx.Node, fx.Node] = {placeholders[i]: operands[i] for i in gathered}
    with graph.inserting_before(call):
        for node in nodes:
            args, kwargs = fx.map_arg((node.args, dict(node.kwargs)), mapping.__getitem__)
            copy = graph.call_function(node.target, args, kwargs)
            copy.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            mapping[node] = copy
    return mapping[nodes[-1]]


def _is_gathered(operand: object) -> bool:
    """Whether a region call's operand is a gathered parameter (a marker's output, or a pure
    view of one)."""
    while isinstance(operand, fx.Node) and operand.op == "call_function" and operand.target in PURE_VIEWS:
        operand = operand.args[0]
    return isinstance(operand, fx.Node) and operand.op == "call_function" and operand.target in UNSHARD_TARGETS


def _same_view(base: object, view: object) -> bool:
    """Whether ``view`` reads exactly what ``base`` does (same dtype, sizes, strides and
    offset); symbolic layouts never count as the same."""
    if not (isinstance(base, torch.Tensor) and isinstance(view, torch.Tensor)):
        return False
    layouts = [(t.dtype, *t.shape, *t.stride(), t.storage_offset()) for t in (base, view)]
    if any(isinstance(x, torch.SymInt) for layout in layouts for x in layout):
        return False
    return layouts[0] == layouts[1]


def route_region_inputs(graph: fx.Graph) -> int:
    """Give region calls the inputs of earlier region calls directly (see the module
    docstring); returns how many call inputs changed."""
    count = 0
    for call in [n for n in graph.nodes if is_region_call(n)]:
        args = list(call.args)
        for position, operand in enumerate(args[2:], start=2):
            if not (isinstance(operand, fx.Node) and operand.op == "call_function"
                    and operand.target is operator.getitem and is_region_call(operand.args[0])):
                continue
            producer, output_index = operand.args
            body = region_body(producer)
            found = passed_through(body, output_index)
            if found is None:
                redone = _redo_parameter_computation(graph, call, producer, body, output_index)
                if redone is not None:
                    args[position] = redone
                    count += 1
                continue
            input_index, views = found
            value = producer.args[2 + input_index]
            if _same_view(_value(value), _value(operand)):
                # e.g. t(t(w)), which a linear layer's body saves for its backward: a graph
                # of many blocks would carry two nodes per weight that change nothing.
                views = []
            with graph.inserting_before(call):
                for view in views:
                    value_meta = dict(view.meta)
                    value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    value.meta.update(value_meta)
            value.meta.setdefault("val", _value(operand))
            args[position] = value
            count += 1
        call.args = tuple(args)
    return count


def hoist_region_markers_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pipeline entry of :func:`hoist_region_markers` (the captured Dynamo graph)."""
    return hoist_region_markers(gm, ctx.params or {})


def inline_reordering_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pipeline entry of :func:`inline_reordering_regions` (the captured Dynamo graph)."""
    return inline_reordering_regions(gm)


def route_region_inputs_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Pipeline entry of :func:`route_region_inputs` (joint graph)."""
    return route_region_inputs(gm.graph)
