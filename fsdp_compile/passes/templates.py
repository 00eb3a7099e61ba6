"""Trace each distinct lowering once and stamp copies of it for identical buckets.

Tracing a bucket's lowering with ``make_fx`` costs milliseconds, and a model of repeated blocks
has one bucket per block, all alike. :class:`TraceCache` traces a signature the first time and
hands out that graph afterwards; :func:`stamp_fake_values` gives each copied node fresh fake
values (``val``, ``tensor_meta``, ``eager_input_vals``), re-created on storages of their own,
so a stamp is node for node what a fresh trace would have produced (the memory estimate and
Inductor's re-inplacing tell buffers apart by storage). A value that aliases an input is
recomputed on fake tensors instead (:func:`refresh_fake_values`). Inputs with symbolic sizes
are never shared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from .graph import storage_key

try:  # what make_fx stores as a node's value (a detached alias of the traced fake tensor)
    from torch.fx.experimental.proxy_tensor import extract_val as _extract_val
except ImportError:  # pragma: no cover - older torch
    def _extract_val(value: Any) -> Any:
        return fx.node.map_aggregate(value, lambda v: v.detach() if isinstance(v, torch.Tensor) else v)

try:
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
except ImportError:  # pragma: no cover
    _extract_tensor_metadata = None


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
    """Traced graphs by signature for one graph's lowering; ``traces`` and ``stamps`` count fresh
    traces and reuses."""

    def __init__(self) -> None:
        self._graphs: dict[Hashable, fx.Graph] = {}
        self.traces = 0
        self.stamps = 0

    def graph_for(self, key: Hashable | None, fn: Callable, values: Sequence[Any],
                  decompositions: dict | None) -> tuple[fx.Graph, bool]:
        """(graph of ``fn`` traced on ``values``, whether it was traced just now). ``key`` names
        what the trace depends on besides the inputs' signatures; ``None`` always traces."""
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
    if isinstance(value, torch.Tensor) and _extract_tensor_metadata is not None:
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)
    else:
        node.meta.pop("tensor_meta", None)
    if "eager_input_vals" in node.meta:
        node.meta["eager_input_vals"] = fx.node.map_aggregate((node.args, node.kwargs), _eager_input_value)


class _Aliases(Exception):
    """A template value lives on an input's storage: it must be recomputed, not re-created."""


def stamp_fake_values(pairs: Sequence[tuple[fx.Node, fx.Node]], inputs: Sequence[fx.Node],
                      fake_mode: Any) -> None:
    """Give the copies of a template's nodes fresh fake values. ``pairs``: (template node, its
    copy) in graph order; ``inputs``: the template's placeholders."""
    converter = getattr(fake_mode, "fake_tensor_converter", None)
    input_storages = {storage_key(t) for n in inputs for t in _tensors(n.meta.get("val"))}
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

    # AOTAutograd runs the forward compiler with the fake mode active; tensors made on the meta
    # device inside it would go through fake dispatch (a hundred times slower).
    with unset_fake_temporarily():
        _stamp(pairs, rebuild, fake_mode)


def _stamp(pairs: Sequence[tuple[fx.Node, fx.Node]], rebuild: Callable[[Any], Any], fake_mode: Any) -> None:
    for template, copy in pairs:
        if copy.op != "call_function":
            continue
        try:
            copy.meta["val"] = rebuild(template.meta.get("val"))
        except _Aliases:
            with fake_mode, _below_autograd():
                refresh_fake_values(copy)
            continue
        if "eager_input_vals" in copy.meta:
            copy.meta["eager_input_vals"] = fx.node.map_aggregate((copy.args, copy.kwargs), _eager_input_value)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def _below_autograd():
    # Only fake values are computed: skip the autograd layer of every op (for custom ops it is
    # Python, and the most expensive part of a fake call).
    guard = getattr(torch._C, "_AutoDispatchBelowAutograd", None)
    return guard() if guard is not None else torch.no_grad()
