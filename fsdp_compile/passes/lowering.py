"""Group markers into buckets, and replace each bucket by the collectives it stands for.

A bucket (a unit's markers, a byte budget's run, or one parameter) holds markers that communicate
alike and read one dtype. A unit read again at the graph's end gets a ``<unit>:tail`` bucket, or a
transformer's root would gather its head with its embeddings before any compute (torchtitan shards
``[norm, output]`` apart for this). A bucket becomes the traced body of :func:`gather_params` /
:func:`reduce_grads`, which the eager markers call too, so lowering never changes what is computed.
Identical buckets are traced once (:class:`TraceCache`); copies get fake values on storages of their
own (:func:`stamp_fake_values`): the memory estimate and Inductor's re-inplacing tell buffers apart by storage.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import extract_val as _extract_val  # what make_fx stores as a value
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..api import Policy
from ..runtime.collectives import CommSpec, chunk_numels, gather_params, reduce_grads
from ..runtime.markers import Marker, markers
from .context import PassContext
from .graph import COMM_META, WAIT, CommTag, stable_topological_sort, storage_key, storage_keys, tag_parameter_input

TAIL = ":tail"  # a unit's bucket of the graph's last run of markers


def unit_label(bucket_label: str) -> str:
    """The unit a unit policy's bucket belongs to, by its label (its tail bucket included)."""
    return bucket_label.removesuffix(TAIL)


@dataclass
class Bucket:
    """Markers of one kind that become one collective."""

    kind: str  # "unshard" or "reduce_grad"
    key: str
    spec: CommSpec
    markers: list[Marker] = field(default_factory=list)

    @property
    def fqns(self) -> list[str]:
        return [m.fqn for m in self.markers]


def _dtype(marker: Marker) -> torch.dtype:
    return marker.input.meta["val"].dtype


def _tail_start(markers: list[Marker]) -> int:
    """Index of the graph's last run of markers if its unit was read earlier, else len(markers)."""
    start = len(markers)
    while start > 0 and markers[start - 1].unit == markers[-1].unit:
        start -= 1
    earlier = any(m.unit == markers[-1].unit for m in markers[:start])
    return start if earlier else len(markers)


def assign_buckets(markers: list[Marker], policy: Policy) -> list[Bucket]:
    """Group markers (of one kind, in graph order) into buckets, ordered by first marker."""
    tail = _tail_start(markers) if policy.uses_units and markers else len(markers)
    gathered_before_tail = {m.fqn for m in markers[:tail] if m.kind == "unshard"}
    buckets: dict[tuple, Bucket] = {}
    open_bucket: dict[tuple, tuple] = {}  # for the bytes policy: compat key -> current key
    filled: dict[tuple, int] = {}
    for i, marker in enumerate(markers):
        spec = marker.spec.for_reduction() if marker.kind == "reduce_grad" else marker.spec
        compat = (spec, _dtype(marker))
        if policy.uses_units:
            in_tail = i >= tail and marker.fqn not in gathered_before_tail
            key = (marker.unit, in_tail, *compat)
            label = (marker.unit or "<root>") + (TAIL if in_tail else "")
        elif policy.kind == "param":
            key = (marker.fqn, *compat)
            label = marker.fqn
        else:
            size = marker.full_bytes
            key = open_bucket.get(compat)
            if key is None or (filled[key] + size > policy.max_bytes and filled[key] > 0):
                key = (len(buckets), *compat)
                open_bucket[compat] = key
                filled[key] = 0
            filled[key] += size
            label = f"bytes[{key[0]}]"
        if key not in buckets:
            buckets[key] = Bucket(marker.kind, label, spec)
        buckets[key].markers.append(marker)
    return list(buckets.values())


def value_signature(value: Any) -> Hashable | None:
    """What a trace may depend on about one input; None when it is symbolic (never shared)."""
    if not isinstance(value, torch.Tensor):
        return None
    sizes, strides = tuple(value.shape), tuple(value.stride())
    offset = value.storage_offset()
    if any(isinstance(s, torch.SymInt) for s in (*sizes, *strides, offset)):
        return None
    return (sizes, strides, offset, value.dtype, value.device, value.layout, value.requires_grad)


class TraceCache:
    """Traced graphs by signature for one graph's lowering; counts fresh ``traces`` and reuses (``stamps``)."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, fx.Graph] = {}
        self.traces = 0
        self.stamps = 0

    def graph_for(self, key: Hashable | None, fn: Callable, values: Sequence[Any],
                  decompositions: dict | None) -> tuple[fx.Graph, bool]:
        """(``fn`` traced on ``values``, whether just now); ``key``: what else it depends on (None: trace)."""
        signatures = tuple(value_signature(v) for v in values)
        full_key = None if key is None or any(s is None for s in signatures) else (key, signatures)
        graph = self._graphs.get(full_key) if full_key is not None else None
        if graph is not None and all(n.op in ("placeholder", "call_function", "output") for n in graph.nodes):
            self.stamps += 1
            return graph, False
        fake_mode = torch._guards.detect_fake_mode(values)
        with fake_mode:
            graph = make_fx(fn, decomposition_table=decompositions)(*values).graph
        self.traces += 1
        if full_key is not None:
            self._graphs[full_key] = graph
        return graph, True


def _eager_input_value(node: Any) -> Any:
    # As make_fx records them: fake values of node arguments, None for everything else.
    if not isinstance(node, fx.Node) or "val" not in node.meta:
        return None
    value = node.meta["val"]
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return None
    return _extract_val(value)


def refresh_fake_values(node: fx.Node) -> None:
    """Recompute a node's fake value and the metadata derived from it, under the graph's fake mode."""
    if node.op != "call_function":
        return
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    value = node.target(*args, **kwargs)
    node.meta["val"] = _extract_val(value)
    if isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)
    else:
        node.meta.pop("tensor_meta", None)
    if "eager_input_vals" in node.meta:
        node.meta["eager_input_vals"] = fx.node.map_aggregate((node.args, node.kwargs), _eager_input_value)


class _Aliases(Exception):
    """A template value lives on an input's storage: it must be recomputed, not re-created."""


def stamp_fake_values(pairs: Sequence[tuple[fx.Node, fx.Node]], inputs: Sequence[fx.Node], fake_mode: Any) -> None:
    """Give the copies of a template's nodes fresh fake values; ``pairs``: (template, copy) in order."""
    converter = getattr(fake_mode, "fake_tensor_converter", None)
    input_storages = set().union(*(storage_keys(n.meta.get("val")) for n in inputs))
    storages: dict[int, Any] = {}

    def recreate(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in input_storages or t.requires_grad or converter is None:
            raise _Aliases
        storage = storages.get(key)
        if storage is None:
            storage = torch.empty((t.untyped_storage().nbytes(),), dtype=torch.uint8, device="meta").untyped_storage()
            storages[key] = storage
        meta = torch.empty((0,), dtype=t.dtype, device="meta")
        meta.set_(storage, t.storage_offset(), t.shape, t.stride())
        return converter.from_meta_and_device(fake_mode, meta, t.device)

    def rebuild(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return recreate(value)
        if isinstance(value, (list, tuple)):
            return type(value)(rebuild(v) for v in value)
        return value

    # Meta tensors made under AOTAutograd's active fake mode would be a hundred times slower.
    with unset_fake_temporarily():
        _stamp(pairs, rebuild, fake_mode)


def _stamp(pairs: Sequence[tuple[fx.Node, fx.Node]], rebuild: Callable[[Any], Any], fake_mode: Any) -> None:
    for template, copy in pairs:
        if copy.op != "call_function":
            continue
        try:
            copy.meta["val"] = rebuild(template.meta.get("val"))
        except _Aliases:
            # Fake values only: skip the autograd layer (Python for custom ops, the costliest part).
            with fake_mode, torch._C._AutoDispatchBelowAutograd():
                refresh_fake_values(copy)
            continue
        if "eager_input_vals" in copy.meta:
            copy.meta["eager_input_vals"] = fx.node.map_aggregate((copy.args, copy.kwargs), _eager_input_value)


Decompositions = dict | None


def _splice(graph: fx.Graph, before: fx.Node, fn: Callable, inputs: Sequence[fx.Node],
            decompositions: Decompositions, tag: Callable[[int], CommTag],
            cache: TraceCache | None = None, key: Hashable | None = None) -> list[fx.Node]:
    """Trace ``fn`` on the inputs' fake values and copy it in before ``before``, each node tagged
    ``tag(stage)``. ``decompositions``: the graph's table (Inductor rejects an op it decomposes)."""
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
    """Lower every marker of ``gm.graph`` bucket by bucket; returns the buckets by kind.
    ``reuse_traces=False`` traces every bucket afresh (same result)."""
    buckets = {kind: assign_buckets(markers(gm.graph, kind), policy) for kind in ("unshard", "reduce_grad")}
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
