"""Passes that keep compile regions' collectives in the top-level graph (inside a body they would
escape bucketing, scheduling and the reshard policy), and inline the region calls AOTAutograd
would refuse or sum gradients differently for.

* ``hoist_region_markers``: a body's ``unshard`` markers become body inputs, gathered at each call site.
* ``inline_mutating_regions``: a body writing an input while training is refused by every
  higher-order operator's autograd kernel; the same test (``invoke_subgraph.gen_schema``) inlines them.
* ``inline_reordering_regions``: an input read twice in the body and also elsewhere would get its
  gradient summed in another order than eagerly (other bits).
* ``route_region_inputs`` (joint): a backward call's input that a forward call passed through (or
  viewed) is taken from the gather, which the reshard policy can then recompute.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..runtime.markers import REDUCE_GRAD, UNSHARD, UNSHARD_TARGETS
from ..sharding.compile_regions import REGION_UNIT
from .context import PassContext
from .graph import (
    INVOKE_SUBGRAPH,
    PURE_VIEWS,
    calls,
    copy_graph_module,
    is_random,
    is_region_call,
    node_value,
    output_values,
    placeholders,
    view_base,
)

# node.meta key: the sharded parameter a Dynamo graph input stands for (set by the compiler).
PARAM_META = "fsdp_param"
# Dynamo's graphs call the marker through its overload packet, AOTAutograd's through .default.
_UNSHARD_TARGETS = (UNSHARD, UNSHARD.overloadpacket)


def _is_region_marker(node: fx.Node) -> bool:
    return calls(node, _UNSHARD_TARGETS) and node.args[2] == REGION_UNIT


def has_regions(graph: fx.Graph) -> bool:
    """Whether a captured graph calls regions, or holds the markers of a region Dynamo inlined."""
    return any(is_region_call(n) or _is_region_marker(n) for n in graph.nodes)


def is_region_body_joint(graph: fx.Graph) -> bool:
    """Whether a joint graph is a region body's (hoisted: no markers, no region calls)."""
    return not any(calls(n, (*UNSHARD_TARGETS, REDUCE_GRAD, INVOKE_SUBGRAPH)) for n in graph.nodes)


def region_body(node: fx.Node) -> fx.GraphModule:
    """The graph module a region call runs."""
    return getattr(node.graph.owning_module, node.args[0].target)


def _hoist_from_body(body: fx.GraphModule, hoisted: list[tuple[fx.Node, int]]) -> tuple[list[int], list[fx.Node]]:
    """The markers' outputs become new inputs of ``body``; returns the kept inputs' indices, the new ones."""
    graph = body.graph
    inputs = placeholders(graph)
    new_inputs = []
    last = inputs[-1] if inputs else None
    for marker, _ in hoisted:
        with graph.inserting_after(last) if last is not None else contextlib.nullcontext():
            full = graph.placeholder(f"{marker.name}_full")
        full.meta = dict(marker.meta)
        last = full
        marker.replace_all_uses_with(full)
        graph.erase_node(marker)
        new_inputs.append(full)
    read = {j for _, j in hoisted}
    dropped = {j for j, p in enumerate(inputs) if j in read and not p.users}
    for j in sorted(dropped):
        graph.erase_node(inputs[j])
    body.recompile()
    return [j for j in range(len(inputs)) if j not in dropped], new_inputs


# Higher-order operators whose body hoisting reaches into (a checkpoint body in a region's body).
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
    """Move the markers of every body ``owner`` calls (nested level by level) into ``owner``; returns
    how many. Bodies are rewritten as copies (a failed pass rolls back ``owner``'s graph only)."""
    count = 0
    for call in [n for n in owner.graph.nodes if calls(n, _OPERANDS_START)]:
        start, attr = _OPERANDS_START[call.target], call.args[0]
        original = getattr(owner, attr.target)
        if id(original) not in done:
            body = copy_graph_module(original)
            _lift(body, done)
            inputs = {p: i for i, p in enumerate(placeholders(body.graph))}
            markers = [(n, inputs[n.args[0]]) for n in body.graph.nodes if _is_region_marker(n) and n.args[0] in inputs]
            reads = [(j, tuple(marker.args[1:])) for marker, j in markers]
            kept, new_inputs = _hoist_from_body(body, markers)
            values = [node_value(n) for n in new_inputs]
            done[id(original)] = _Hoisted(body, f"{attr.target}_hoisted", kept, reads, values)
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
    """Move every region body's markers to its call sites; returns how many the top-level graph
    gained or renamed. ``params``: parameter name -> its marker's arguments after the input, which
    those markers (and a body Dynamo inlined) get, found from the graph input they read."""
    _lift(gm, {})
    markers = [n for n in gm.graph.nodes if _is_region_marker(n)]
    for marker in markers:
        name = marker.args[0].meta.get(PARAM_META)
        if name not in params:
            raise ValueError(f"{marker.name} reads {marker.args[0].name} as a sharded parameter, but that input is "
                             "not one this backend sharded")
        marker.args = (marker.args[0], *params[name])
    _drop_unused_bodies(gm)
    return len(markers)  # the markers _lift added are among them


def _drop_unused_bodies(gm: fx.GraphModule) -> None:
    """Delete the bodies ``gm`` no longer reads (``delete_all_unused_submodules`` also drops nested ones)."""
    read = {n.target for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for name, child in list(gm.named_children()):
        if isinstance(child, fx.GraphModule) and name not in read:
            delattr(gm, name)


def _reorders_gradients(call: fx.Node, body: fx.GraphModule) -> bool:
    """Whether ``call`` passes a tensor needing a gradient that the body reads twice and others read."""
    for operand, placeholder in zip(call.args[2:], placeholders(body.graph)):
        value = node_value(operand) if isinstance(operand, fx.Node) else None
        if (isinstance(value, torch.Tensor) and value.requires_grad and len(placeholder.users) > 1
                and len(operand.users) > 1):
            return True
    return False


def inline_call(call: fx.Node) -> None:
    """Replace a region call by a copy of its body's nodes."""
    graph, gm, body = call.graph, call.graph.owning_module, region_body(call)
    env: dict[fx.Node, object] = dict(zip(placeholders(body.graph), call.args[2:]))
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
        if calls(user, (operator.getitem,)):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if call.users:
        raise ValueError(f"region call {call.name} is used other than through its outputs")
    graph.erase_node(call)


def inline_regions(gm: fx.GraphModule, bodies: Collection[str] | None = None) -> int:
    """Inline the calls of the given bodies (by attribute name; default all); returns how many."""
    inlined = [c for c in gm.graph.nodes if is_region_call(c) and (bodies is None or c.args[0].target in bodies)]
    for call in inlined:
        attr = call.args[0]
        inline_call(call)
        if not attr.users:
            gm.graph.erase_node(attr)
    if inlined:
        _drop_unused_bodies(gm)
    return len(inlined)


@dataclass(frozen=True)
class InlinedRegion:
    """A body whose calls were inlined: its block class, and the input it writes."""

    block_class: type | None
    written: str


def _block_class(call: fx.Node) -> type | None:
    """The class of the module whose forward made the region call (Dynamo's module stack)."""
    stack = call.meta.get("nn_module_stack")
    if not stack:
        return None
    _, cls = list(stack.values())[-1]
    return getattr(cls, "_fsdp_original_class", cls)


def _written_input(call: fx.Node) -> str | None:
    """The name of an input ``call``'s body writes to while it needs gradients, if any."""
    operands = [a.meta.get("example_value", a.meta.get("val")) if isinstance(a, fx.Node) else a for a in call.args[2:]]
    tensors = [v for v in operands if isinstance(v, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return None
    # The operands' own mode: the context Dynamo calls the backend in may hold another.
    fake_mode = next((t.fake_mode for t in tensors if isinstance(t, FakeTensor)), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        schema = INVOKE_SUBGRAPH.gen_schema(region_body(call), call.args[1], *operands)
    # The schema's arguments are the body, its identifier, then the operands in order.
    written = [i for i, arg in enumerate(schema.arguments[2:]) if arg.is_write]
    if not written:
        return None
    operand = call.args[2 + written[0]]
    return operand.name if isinstance(operand, fx.Node) else f"operand {written[0]}"


def inline_mutating_regions(gm: fx.GraphModule, ctx: PassContext | None = None) -> list[InlinedRegion]:
    """Captured graph: calls of bodies that write an input while training are inlined, one entry per body."""
    checked: dict[str, str | None] = {}
    found: list[InlinedRegion] = []
    for call in [n for n in gm.graph.nodes if is_region_call(n)]:
        body = call.args[0].target
        if body not in checked:
            checked[body] = _written_input(call)
            if checked[body] is not None:
                found.append(InlinedRegion(_block_class(call), checked[body]))
    bodies = {body for body, written in checked.items() if written is not None}
    if bodies:
        inline_regions(gm, bodies)
    return found


def _view_chain(body: fx.GraphModule, output_index: int) -> tuple[fx.Node | None, list[fx.Node]]:
    """The node ``body``'s output ``output_index`` is (a chain of pure views of), and the views."""
    values = output_values(body.graph)
    if output_index >= len(values):
        return None, []
    node, views = values[output_index], []
    while calls(node, PURE_VIEWS):
        views.append(node)
        node = node.args[0]
    return (node if isinstance(node, fx.Node) else None), views[::-1]


def _input_index(body: fx.GraphModule, node: fx.Node | None) -> int | None:
    if node is None or node.op != "placeholder":
        return None
    return placeholders(body.graph).index(node)


def aliased_input(body: fx.GraphModule, output_index: int) -> int | None:
    """The index of the input that ``body``'s output ``output_index`` is, or is a view of."""
    return _input_index(body, _view_chain(body, output_index)[0])


def passed_through(body: fx.GraphModule, output_index: int) -> tuple[int, list[fx.Node]] | None:
    """(input index, views) when output ``output_index`` is an input or a view redoable outside the body."""
    root, views = _view_chain(body, output_index)
    index = _input_index(body, root)
    found: list[fx.Node] = []
    fx.node.map_arg([(view.args[1:], view.kwargs) for view in views], found.append)
    if index is None or found:
        return None  # a view sized by the body's own values cannot be redone outside it
    return index, views


def parameter_computation(body: fx.GraphModule, output_index: int, gathered: Collection[int]) -> list[fx.Node] | None:
    """The body's nodes computing output ``output_index`` from the inputs at ``gathered`` alone, or None."""
    values = output_values(body.graph)
    if output_index >= len(values):
        return None
    target = values[output_index]
    if not isinstance(target, fx.Node) or target.op != "call_function":
        return None
    inputs = placeholders(body.graph)
    allowed = {inputs[i] for i in gathered if i < len(inputs)}
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
    """Compute before ``call`` a forward output made from gathered parameters alone, to recompute it."""
    operands = producer.args[2:]
    gathered = [i for i, operand in enumerate(operands) if calls(view_base(operand), UNSHARD_TARGETS)]
    nodes = parameter_computation(body, output_index, gathered) if gathered else None
    if not nodes:
        return None
    inputs = placeholders(body.graph)
    mapping: dict[fx.Node, fx.Node] = {inputs[i]: operands[i] for i in gathered}
    with graph.inserting_before(call):
        for node in nodes:
            args, kwargs = fx.map_arg((node.args, dict(node.kwargs)), mapping.__getitem__)
            copy = graph.call_function(node.target, args, kwargs)
            copy.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
            mapping[node] = copy
    return mapping[nodes[-1]]


def _same_view(base: object, view: object) -> bool:
    """Whether ``view`` reads exactly what ``base`` does (symbolic layouts never do)."""
    if not (isinstance(base, torch.Tensor) and isinstance(view, torch.Tensor)):
        return False
    layouts = [(t.dtype, *t.shape, *t.stride(), t.storage_offset()) for t in (base, view)]
    if any(isinstance(x, torch.SymInt) for layout in layouts for x in layout):
        return False
    return layouts[0] == layouts[1]


def route_region_inputs(graph: fx.Graph) -> int:
    """Give region calls the inputs of earlier region calls directly; returns how many changed."""
    count = 0
    for call in [n for n in graph.nodes if is_region_call(n)]:
        args = list(call.args)
        for position, operand in enumerate(args[2:], start=2):
            if not (calls(operand, (operator.getitem,)) and is_region_call(operand.args[0])):
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
            if _same_view(node_value(value), node_value(operand)):
                # e.g. t(t(w)), which a linear layer's body saves: two no-op nodes per weight.
                views = []
            with graph.inserting_before(call):
                for view in views:
                    value_meta = dict(view.meta)
                    value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    value.meta.update(value_meta)
            value.meta.setdefault("val", node_value(operand))
            args[position] = value
            count += 1
        call.args = tuple(args)
    return count


def hoist_region_markers_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Captured graph: region bodies' gathers move to their call sites, to be bucketed there."""
    return hoist_region_markers(gm, ctx.params or {})


def inline_reordering_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Captured graph: calls whose input gradient the body would sum in another order are inlined."""
    unsafe = {c.args[0].target for c in gm.graph.nodes if is_region_call(c) and _reorders_gradients(c, region_body(c))}
    return inline_regions(gm, unsafe)


def route_region_inputs_pass(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Joint graph: region calls take gathered parameters from the gather, not an earlier call."""
    return route_region_inputs(gm.graph)
