"""Replace each bucket of markers by the collectives it stands for.

A bucket's ``unshard`` markers become copy-in of every shard (cast to the compute dtype) into
one flat buffer, one ``all_gather_into_tensor`` and its wait, and copy-out into full tensors;
its ``reduce_grad`` markers become one chunk-concatenated buffer of the full gradients, one
``reduce_scatter_tensor`` (all-reduce for NO_SHARD; for hybrid, then an ``all_reduce`` across
replicas), the divide factor, and shard gradients in the parameter's dtype.

The replacement is the traced body of :func:`gather_params` / :func:`reduce_grads`, the
functions the markers' eager implementations call: lowering changes how many collectives run,
never what they compute.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..api import Policy
from ..runtime.collectives import chunk_numels, gather_params, reduce_grads
from ..runtime.markers import markers
from .bucketing import Bucket, assign_buckets
from .context import PassContext
from .graph import COMM_META, WAIT, CommTag, stable_topological_sort, tag_parameter_input
from .templates import TraceCache, stamp_fake_values

Decompositions = dict | None


def _splice(graph: fx.Graph, before: fx.Node, fn: Callable, inputs: Sequence[fx.Node],
            decompositions: Decompositions, tag: Callable[[int], CommTag],
            cache: TraceCache | None = None, key: Hashable | None = None) -> list[fx.Node]:
    """Trace ``fn`` on the inputs' fake values and copy its graph in before ``before``; every new
    node gets ``tag(stage)`` as its ``fsdp_comm`` metadata. ``decompositions`` must be the table
    the graph was traced with (Inductor rejects an op it has a decomposition for). ``key`` names
    ``fn``'s constants for ``cache`` (:mod:`.templates`)."""
    values = [n.meta["val"] for n in inputs]
    cache = cache if cache is not None else TraceCache()
    traced, fresh = cache.graph_for(key, fn, values, decompositions)
    fake_mode = None if fresh else detect_fake_mode(values)
    placeholders = [n for n in traced.nodes if n.op == "placeholder"]
    previous = before.prev
    copies = dict(zip(placeholders, inputs))
    with graph.inserting_before(before):
        outputs = graph.graph_copy(traced, copies)
    if not fresh:
        stamp_fake_values([(t, c) for t, c in copies.items() if t.op != "placeholder"], placeholders, fake_mode)
    stage = 0
    node = previous.next
    while node is not before:
        if node.target is WAIT:
            stage += 1
        node.meta[COMM_META] = tag(stage)
        node = node.next
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _buffer_bytes(shapes: Sequence[Sequence[int]], dtype: torch.dtype, spec) -> int:
    """Unsharded bytes of a bucket's collective buffer (padding included when sharded)."""
    if spec.gathers:
        return sum(chunk_numels(shapes, spec.shard_size)) * spec.shard_size * dtype.itemsize
    return sum(int(torch.Size(s).numel()) for s in shapes) * dtype.itemsize


def _lower_gather(graph: fx.Graph, bucket: Bucket, decompositions: Decompositions, group: int,
                  cache: TraceCache | None = None) -> None:
    entries: dict[tuple, int] = {}  # (shard node, fqn) -> position in the bucket
    inputs, full_shapes = [], []
    for marker in bucket.markers:
        key = (marker.input, marker.fqn)
        if key not in entries:  # a parameter read twice is gathered once
            entries[key] = len(inputs)
            inputs.append(marker.input)
            full_shapes.append(marker.full_shape)
    spec = bucket.spec
    size = _buffer_bytes(full_shapes, spec.gather_dtype(inputs[0].meta["val"].dtype), spec)
    outputs = _splice(graph, bucket.markers[0].node,
                      lambda *shards: gather_params(list(shards), full_shapes, spec), inputs,
                      decompositions, lambda stage: CommTag(group, "gather", stage, bucket.key, size),
                      cache, ("gather", tuple(full_shapes), spec))
    for marker in bucket.markers:
        marker.node.replace_all_uses_with(outputs[entries[(marker.input, marker.fqn)]])
        graph.erase_node(marker.node)


def _lower_reduce(graph: fx.Graph, bucket: Bucket, decompositions: Decompositions, group: int,
                  cache: TraceCache | None = None) -> None:
    inputs = [m.input for m in bucket.markers]
    local_rows = [m.rows for m in bucket.markers]
    grad_dtypes = [m.grad_dtype for m in bucket.markers]
    spec = bucket.spec
    values = [n.meta["val"] for n in inputs]
    size = _buffer_bytes([m.full_shape for m in bucket.markers], spec.grad_reduce_dtype(values[0].dtype), spec)
    # Every gradient of the bucket exists once its last marker's input does.
    outputs = _splice(graph, bucket.markers[-1].node,
                      lambda *grads: reduce_grads(list(grads), local_rows, grad_dtypes, spec), inputs,
                      decompositions, lambda stage: CommTag(group, "reduce", stage, bucket.key, size),
                      cache, ("reduce", tuple(local_rows), tuple(grad_dtypes), spec))
    for marker, output in zip(bucket.markers, outputs):
        marker.node.replace_all_uses_with(output)
        graph.erase_node(marker.node)


def lower_markers(gm: fx.GraphModule, policy: Policy, decompositions: Decompositions = None,
                  reuse_traces: bool = True, trace_cache: TraceCache | None = None) -> dict[str, list[Bucket]]:
    """Lower every marker of ``gm`` bucket by bucket (``gm.graph`` only: recompile before
    running it); returns the buckets by kind. ``reuse_traces=False`` traces every bucket afresh
    (same result); ``trace_cache``: the cache to use (a fresh one by default)."""
    buckets = {
        "unshard": assign_buckets(markers(gm.graph, "unshard"), policy),
        "reduce_grad": assign_buckets(markers(gm.graph, "reduce_grad"), policy),
    }
    for bucket in buckets["unshard"]:
        for marker in bucket.markers:
            tag_parameter_input(marker.input)
    # Identical blocks have identical buckets: each distinct lowering is traced once.
    cache = (trace_cache if trace_cache is not None else TraceCache()) if reuse_traces else None
    lowerings = [(_lower_gather, b) for b in buckets["unshard"]] + [(_lower_reduce, b) for b in buckets["reduce_grad"]]
    for group, (lower, bucket) in enumerate(lowerings):
        lower(gm.graph, bucket, decompositions, group, cache)
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    return buckets


def lower_markers_pass(gm: fx.GraphModule, ctx: PassContext) -> dict[str, list[Bucket]]:
    """Each graph: markers become bucketed collectives, under the backend's bucket policy."""
    return lower_markers(gm, ctx.bucket_policy, ctx.decompositions)
