"""``unalias_region_outputs`` on a small graph: a region call whose outputs share storage with an
operand and with each other is read through the storage's owner, and computes the same."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fsdp_compile.passes.region_outputs import _shared_outputs, alias_path, unalias_region_outputs
from fsdp_compile.passes.regions import is_region_call, region_body

aten = torch.ops.aten


def _graph() -> tuple[fx.GraphModule, tuple[torch.Tensor, torch.Tensor]]:
    """region(x, w) -> (relu(p), q, k, x, p) where q and k are the two halves of one projection
    ``p = x @ w`` (views of it, as a body's saved q/k are) and x is the input passed through;
    the top-level graph reads relu(p), q, k and x."""
    x, w = torch.randn(3, 4), torch.randn(4, 8)
    body = fx.Graph()
    bx, bw = body.placeholder("x"), body.placeholder("w")
    p = body.call_function(aten.mm.default, (bx, bw))
    pieces = body.call_function(aten.split.Tensor, (p, 4, 1))
    q = body.call_function(operator.getitem, (pieces, 0))
    k = body.call_function(aten.t.default, (body.call_function(operator.getitem, (pieces, 1)),))
    relu = body.call_function(aten.relu.default, (p,))
    body.output((relu, q, k, bx))
    values = {}
    for node in body.nodes:  # the values a trace would record, storages shared as they are
        if node.op == "placeholder":
            values[node] = {"x": x, "w": w}[node.name]
        elif node.op == "call_function":
            values[node] = node.target(*fx.node.map_arg(node.args, values.__getitem__))
        node.meta["val"] = values.get(node)
    root = torch.nn.Module()
    root.body = fx.GraphModule(torch.nn.Module(), body)
    g = fx.Graph()
    gx, gw = g.placeholder("x"), g.placeholder("w")
    gx.meta["val"], gw.meta["val"] = x, w
    call = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr("body"), "body", gx, gw))
    call.meta["val"] = tuple(values[n] for n in (relu, q, k, bx))
    reads = []
    for index in range(4):
        item = g.call_function(operator.getitem, (call, index))
        item.meta["val"] = call.meta["val"][index]
        reads.append(g.call_function(aten.mul.Tensor, (item, 2.0)))
    g.output(tuple(reads))
    return fx.GraphModule(root, g), (x, w)


def test_alias_path_walks_back_to_the_owner_through_a_split() -> None:
    gm, _ = _graph()
    outputs = next(n for n in gm.body.graph.nodes if n.op == "output").args[0]
    assert [n.target for n in alias_path(outputs[2])] == [aten.mm.default, aten.split.Tensor, operator.getitem,
                                                          aten.t.default]
    assert alias_path(outputs[0]) == [outputs[0]]  # relu owns its storage
    assert alias_path(outputs[3]) == [outputs[3]]  # the input itself


def test_shared_outputs_are_read_through_their_owner() -> None:
    gm, inputs = _graph()
    before = gm(*inputs)
    (call,) = [n for n in gm.graph.nodes if is_region_call(n)]
    assert {owner.name: sorted(i for i, _ in read) for owner, read in _shared_outputs(call).items()} == {
        "mm_default": [1, 2], "x": [3]}
    assert unalias_region_outputs(gm) == 3
    gm.recompile()
    after = gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # Only relu and the projection's owner (now an output of the body) are read from the call;
    # q and k are views of the owner made in the top-level graph, x is the operand.
    read = sorted(u.args[1] for u in call.users if u.users)
    assert read == [0, 4]
    assert len(next(n for n in region_body(call).graph.nodes if n.op == "output").args[0]) == 5
    assert _shared_outputs(call) == {}
    third = next(n for n in gm.graph.nodes if n.op == "output").args[0][3]
    assert third.args[0].name == "x"


def test_an_output_that_owns_its_storage_alone_is_left_alone() -> None:
    gm, _ = _graph()
    (call,) = [n for n in gm.graph.nodes if is_region_call(n)]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (output.args[0][:2],)  # nothing reads k and x
    gm.graph.eliminate_dead_code()
    gm.recompile()
    code = gm.code
    # q alone reads the projection's storage: nothing to do.
    assert _shared_outputs(call) == {}
    assert unalias_region_outputs(gm) == 0
    gm.recompile()
    assert gm.code == code
