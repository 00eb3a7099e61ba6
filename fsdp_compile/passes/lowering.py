"""Replace each bucket of markers by the collectives it stands for.

Forward (and backward re-gathers): a bucket's ``unshard`` markers become copy-in of every shard
(cast to the compute dtype) into one flat buffer, one ``all_gather_into_tensor`` and its wait,
and copy-out into per-parameter full tensors. Backward: a bucket's ``reduce_grad`` markers
become one chunk-concatenated buffer of the full gradients (cast to the reduce dtype), one
``reduce_scatter_tensor`` (all-reduce for NO_SHARD), for hybrid one ``all_reduce`` across
replicas, the divide factor, and per-parameter shard gradients in the parameter's dtype.

The replacement is the traced body of :func:`gather_params` / :func:`reduce_grads`, the same
functions the markers' eager implementations call, so lowering changes how many collectives
run, never what they compute.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from ..ops import REDUCE_GRAD, UNSHARD, markers
from ..runtime.collectives import gather_params, reduce_grads
from .bucketing import Bucket, Policy, assign_buckets


Decompositions = Optional[dict]


def _splice(graph: fx.Graph, before: fx.Node, fn: Callable, inputs: Sequence[fx.Node],
            decompositions: Decompositions) -> list[fx.Node]:
    """Trace ``fn`` on the inputs' fake values and copy its graph in before ``before``.

    ``decompositions`` must be the table the graph itself was traced with (Inductor rejects an
    op it has a decomposition for, such as ``aten._to_copy``).
    """
    values = [n.meta["val"] for n in inputs]
    fake_mode = detect_fake_mode(values)
    with fake_mode:
        traced = make_fx(fn, decomposition_table=decompositions)(*values)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with graph.inserting_before(before):
        outputs = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    return list(outputs)


def _lower_gather(graph: fx.Graph, bucket: Bucket, decompositions: Decompositions) -> None:
    entries: dict[tuple, int] = {}  # (shard node, fqn) -> position in the bucket
    inputs, full_shapes = [], []
    for marker in bucket.markers:
        key = (marker.input, marker.fqn)
        if key not in entries:  # a parameter read twice is gathered once
            entries[key] = len(inputs)
            inputs.append(marker.input)
            full_shapes.append(tuple(marker.node.meta["val"].shape))
    spec = bucket.spec
    outputs = _splice(graph, bucket.markers[0].node,
                      lambda *shards: gather_params(list(shards), full_shapes, spec), inputs,
                      decompositions)
    for marker in bucket.markers:
        marker.node.replace_all_uses_with(outputs[entries[(marker.input, marker.fqn)]])
        graph.erase_node(marker.node)


def _lower_reduce(graph: fx.Graph, bucket: Bucket, decompositions: Decompositions) -> None:
    inputs = [m.input for m in bucket.markers]
    local_rows = [m.rows for m in bucket.markers]
    grad_dtypes = [m.grad_dtype for m in bucket.markers]
    spec = bucket.spec
    # Every gradient of the bucket exists once its last marker's input does.
    outputs = _splice(graph, bucket.markers[-1].node,
                      lambda *grads: reduce_grads(list(grads), local_rows, grad_dtypes, spec), inputs,
                      decompositions)
    for marker, output in zip(bucket.markers, outputs):
        marker.node.replace_all_uses_with(output)
        graph.erase_node(marker.node)


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder nodes so each follows its inputs, keeping the existing order where it is valid.

    Splicing a bucket in before its first marker can place a collective ahead of an input that
    is computed later (or a use of a reduced gradient ahead of the reduction); each such node is
    moved just far enough: its missing inputs are placed first, in their original order.
    """
    position = {n: i for i, n in enumerate(graph.nodes)}
    placed: set[fx.Node] = set()
    cursor: fx.Node | None = None
    for root in list(graph.nodes):
        stack = [root]
        while stack:
            node = stack[-1]
            if node in placed:
                stack.pop()
                continue
            missing = sorted((i for i in node.all_input_nodes if i not in placed), key=position.__getitem__)
            if missing:
                stack.extend(reversed(missing))
                continue
            stack.pop()
            if cursor is not None and cursor.next is not node:
                cursor.append(node)
            placed.add(node)
            cursor = node


def lower_markers(gm: fx.GraphModule, policy: Policy,
                  decompositions: Decompositions = None) -> dict[str, list[Bucket]]:
    """Lower every marker of ``gm`` bucket by bucket; returns the buckets by kind."""
    buckets = {
        "unshard": assign_buckets(markers(gm.graph, UNSHARD), policy),
        "reduce_grad": assign_buckets(markers(gm.graph, REDUCE_GRAD), policy),
    }
    for bucket in buckets["unshard"]:
        _lower_gather(gm.graph, bucket, decompositions)
    for bucket in buckets["reduce_grad"]:
        _lower_reduce(gm.graph, bucket, decompositions)
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return buckets
