"""Which markers share a collective when lowered (hand-made graphs, markers traced fake)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_compile  # noqa: F401  (registers the markers)
from fsdp_compile.api import parse_policy
from fsdp_compile.passes.graph import COMM_META
from fsdp_compile.passes.lowering import assign_buckets, lower_markers
from fsdp_compile.runtime.collectives import CommSpec
from fsdp_compile.runtime.markers import markers

_c10d = torch.ops._c10d_functional
GROUP_G = CommSpec("g", 2, True, "", 1, None, None, True)
GROUP_H = CommSpec("h", 2, True, "", 1, None, None, True)  # another shard group of the same size


def one_unit_graph():
    """Four 8 x 8 weights of one unit "b0" (4 x 8 shards): two fp32 in group g, one fp64 in
    group g, one fp32 in group h; forward gathers them, backward reduces their gradients."""
    def f(x, a, b, c, d):
        weights = [torch.ops.fsdp_compile.unshard(s, name, "b0", 8, *spec.op_args())
                   for s, name, spec in ((a, "a", GROUP_G), (b, "b", GROUP_G), (c, "c", GROUP_G), (d, "d", GROUP_H))]
        out = x @ weights[0].t() + x @ weights[1].t() + (x.double() @ weights[2].t()).float() + x @ weights[3].t()
        grads = [torch.ops.fsdp_compile.reduce_grad(torch.tanh(w), name, "b0", 4, w.dtype, *spec.op_args())
                 for w, name, spec in zip(weights, "abcd", (GROUP_G, GROUP_G, GROUP_G, GROUP_H))]
        return out, grads
    shards = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8)]
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), *shards)
    lower_markers(gm, parse_policy("module"))
    return gm


def test_parameters_share_a_bucket_only_when_groups_and_dtypes_match() -> None:
    gm = one_unit_graph()
    gathers, reductions = [], []
    for node in gm.graph.nodes:
        if node.target is _c10d.all_gather_into_tensor.default:
            out = node.meta["val"]
            gathers.append((node.args[-1], out.dtype, out.numel()))
        elif node.target is _c10d.reduce_scatter_tensor.default:
            buffer = node.args[0].meta["val"]
            reductions.append((node.args[-1], buffer.dtype, buffer.numel()))
    # One collective per (group, dtype) within the unit, each holding 2 ranks x 32 elements
    # per parameter it carries: a and b together, c and d alone.
    expected = sorted([("g", torch.float32, 128), ("g", torch.float64, 64), ("h", torch.float32, 64)], key=str)
    assert sorted(gathers, key=str) == expected
    assert sorted(reductions, key=str) == expected


def test_a_lowered_bucket_adds_one_or_two_nodes_per_parameter_besides_its_collective() -> None:
    # Compile time after lowering grows with the nodes per block: copy-out hands out shaped
    # parameters (no view node after it) and each shard gradient is one view of the reduced
    # buffer: a narrow and a view (not split, getitem and view). One as_strided per gradient
    # would be a node fewer, but its offset is absolute in the storage, which Inductor may
    # change (tests/test_tensor_parallel.py's NO_SHARD case).
    gm = one_unit_graph()
    per_bucket: dict[tuple[str, int], list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if COMM_META in node.meta:
            tag = node.meta[COMM_META]
            per_bucket.setdefault((tag.kind, tag.group), []).append(node)
    sizes = sorted((kind, len(nodes)) for (kind, _), nodes in per_bucket.items())
    # Gather: copy_in, all_gather, wait, copy_out, a getitem per parameter; reduce: chunk_cat,
    # reduce_scatter, wait, a narrow and a view per parameter. Buckets hold 2, 1 and 1 parameters.
    assert sizes == [("gather", 5), ("gather", 5), ("gather", 6), ("reduce", 5), ("reduce", 5), ("reduce", 7)]
    for (kind, _), nodes in per_bucket.items():
        for out in (n for n in nodes if n.target in (operator.getitem, torch.ops.aten.view.default)):
            want = (8, 8) if kind == "gather" else (4, 8)
            assert tuple(out.meta["val"].shape) == want, out.format_node()
            assert all(COMM_META not in user.meta for user in out.users), "a lowered output feeds another lowered node"


def root_at_both_ends_graph():
    """A transformer's shape: root parameters read first ("emb") and last ("head", plus "emb"
    again, as a head tied to the embeddings reads it), a block "b0" between them; gradients in
    the reverse order."""
    def f(x, emb, w, head):
        def read(shard, name, unit):
            return torch.ops.fsdp_compile.unshard(shard, name, unit, 8, *GROUP_G.op_args())
        e, b, h, tied = read(emb, "emb", ""), read(w, "w", "b0"), read(head, "head", ""), read(emb, "emb", "")
        y = ((x @ e.t()) @ b.t()) @ h.t() + x @ tied.t()
        grads = [torch.ops.fsdp_compile.reduce_grad(torch.tanh(p), name, unit, 4, p.dtype, *GROUP_G.op_args())
                 for p, name, unit in ((h, "head", ""), (tied, "emb", ""), (b, "w", "b0"), (e, "emb", ""))]
        return y, grads
    return make_fx(f, tracing_mode="fake")(torch.randn(3, 8), *(torch.randn(4, 8) for _ in range(3)))


def test_a_unit_read_at_both_ends_gets_a_tail_bucket() -> None:
    gm = root_at_both_ends_graph()
    module = parse_policy("module")
    gathers = assign_buckets(markers(gm.graph, "unshard"), module)
    # The head is gathered after the block, alone; the tied read of "emb" reuses the first gather.
    assert [(b.key, b.fqns) for b in gathers] == [("<root>", ["emb", "emb"]), ("b0", ["w"]), ("<root>:tail", ["head"])]
    reductions = assign_buckets(markers(gm.graph, "reduce_grad"), module)
    # The head's gradients are reduced before the block's; the embeddings' last one, alone, at the end.
    assert [(b.key, b.fqns) for b in reductions] == [("<root>", ["head", "emb"]), ("b0", ["w"]),
                                                     ("<root>:tail", ["emb"])]
    # Policies without units split nothing.
    assert [b.fqns for b in assign_buckets(markers(gm.graph, "unshard"), parse_policy(1 << 20))] == [
        ["emb", "w", "head", "emb"]]


def test_a_unit_read_only_at_the_end_is_one_bucket() -> None:
    def f(x, a, w):
        block = torch.ops.fsdp_compile.unshard(w, "w", "b0", 8, *GROUP_G.op_args())
        head = torch.ops.fsdp_compile.unshard(a, "a", "", 8, *GROUP_G.op_args())
        return (x @ block.t()) @ head.t()
    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, 8))
    assert [b.key for b in assign_buckets(markers(gm.graph, "unshard"), parse_policy("module"))] == ["b0", "<root>"]


def test_markers_with_symbolic_sizes_lower_with_their_sizes_specialized() -> None:
    # A parameter read that Dynamo compiles once per parameter (a frame of its own after a graph
    # break) may come back with its size a SymInt once two of them differ. The lowered
    # collectives are traced with sizes baked in: each is specialized to the value it has.
    def f(x, a, b, rows):
        w = torch.ops.fsdp_compile.unshard(a, "a", "b0", rows, *GROUP_G.op_args())
        v = torch.ops.fsdp_compile.unshard(b, "b", "b0", 6, *GROUP_G.op_args())
        g = torch.ops.fsdp_compile.reduce_grad(torch.tanh(w), "a", "b0", a.shape[0], w.dtype, *GROUP_G.op_args())
        return x @ w.t(), v, g

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 6), torch.randn(4, 6), torch.randn(3), 8)
    assert isinstance(next(n for n in gm.graph.nodes if n.name == "rows_1").meta["val"], torch.SymInt)
    buckets = lower_markers(gm, parse_policy("module"))
    assert not markers(gm.graph)
    (gather,) = buckets["unshard"]
    (copy_out,) = [n for n in gm.graph.nodes if n.target is torch.ops.fsdp_compile.copy_out.default]
    assert copy_out.args[3] == [8, 6, 6]  # the flat shapes: a's full [8, 6], b's [6], as ints
    assert [m.full_shape for m in gather.markers] == [(8, 6), (6,)]
