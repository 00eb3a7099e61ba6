"""Which parameters communicate together: bucket policies and the assignment of markers.

A bucket is one all-gather (or one reduce-scatter) instead of one per parameter: fewer, larger
collectives that reach the link's bandwidth, at the cost of gathering a whole bucket at once.

Policies (``fsdp_compile.backend(bucket=...)``):

* ``"module"`` (default): one bucket per repeated block (each member of an ``nn.ModuleList`` or
  ``nn.Sequential`` of two or more modules of one class, like FSDP's transformer auto-wrap),
  plus one bucket for the parameters outside every block;
* a set of module classes, or a callable ``module -> bool`` (as FSDP1's ``auto_wrap_policy``):
  each selected module is a unit; a parameter belongs to its nearest selected ancestor, else to
  the root;
* an int: consecutive markers in graph order until the bucket holds that many bytes of full
  tensors (in the collective's dtype); a larger tensor gets a bucket of its own;
* ``"param"``: one bucket per parameter.

Units are decided when the model is sharded and travel in each marker's ``unit`` argument, so
bucketing needs nothing but the graph. Markers only share a bucket when they communicate the
same way (same :class:`CommSpec`) and read the same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

import torch
import torch.nn as nn

from ..ops import Marker
from ..runtime.collectives import CommSpec

BucketPolicy = Union[str, int, Iterable[type], Callable[[nn.Module], bool]]
ROOT_UNIT = ""


@dataclass(frozen=True)
class Policy:
    """A validated bucket policy."""

    kind: str  # "module", "classes", "callable", "bytes", "param"
    classes: tuple[type, ...] = ()
    predicate: Callable[[nn.Module], bool] | None = None
    max_bytes: int = 0

    @property
    def uses_units(self) -> bool:
        return self.kind in ("module", "classes", "callable")

    def describe(self) -> str:
        if self.kind == "classes":
            return "{" + ", ".join(c.__name__ for c in self.classes) + "}"
        if self.kind == "callable":
            return getattr(self.predicate, "__name__", repr(self.predicate))
        if self.kind == "bytes":
            return str(self.max_bytes)
        return repr(self.kind)


def parse_policy(bucket: BucketPolicy) -> Policy:
    """Validate ``bucket=``; errors name the argument and what it accepts."""
    if isinstance(bucket, str):
        if bucket in ("module", "param"):
            return Policy(bucket)
        raise ValueError(
            f"bucket={bucket!r} is not a policy; use 'module', 'param', a size in bytes, a set of "
            "module classes, or a callable module -> bool"
        )
    if isinstance(bucket, bool):
        raise TypeError("bucket= takes 'module', 'param', a size in bytes, module classes or a callable, not a bool")
    if isinstance(bucket, int):
        if bucket <= 0:
            raise ValueError(f"bucket={bucket} must be a positive number of bytes")
        return Policy("bytes", max_bytes=bucket)
    if isinstance(bucket, type):
        bucket = (bucket,)
    if isinstance(bucket, (set, frozenset, list, tuple)):
        classes = tuple(bucket)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(
                f"bucket= as a collection must hold nn.Module subclasses; got {bad or 'an empty collection'}"
            )
        return Policy("classes", classes=classes)
    if callable(bucket):
        return Policy("callable", predicate=bucket)
    raise TypeError(f"bucket= got {type(bucket).__name__}; see fsdp_compile.backend's documentation")


def _repeated_blocks(model: nn.Module) -> set[str]:
    units = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                units.update(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return units


def unit_modules(model: nn.Module, policy: Policy) -> set[str]:
    """Names of the modules that head a bucket under ``policy`` (the root is implicit)."""
    if policy.kind == "module":
        return _repeated_blocks(model)
    if not policy.uses_units:
        return set()
    if policy.kind == "classes":
        chosen = {n for n, m in model.named_modules() if isinstance(m, policy.classes)}
    else:
        chosen = {n for n, m in model.named_modules() if policy.predicate(m)}
    chosen.discard(ROOT_UNIT)
    if not chosen:
        raise ValueError(
            f"bucket={policy.describe()} matches no module of {type(model).__name__} (other than the "
            "root); name classes that occur in the model or a callable that selects some of its "
            "submodules"
        )
    return chosen


def unit_of(module_name: str, units: set[str]) -> str:
    """The nearest unit at or above ``module_name`` (the root unit if none)."""
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in units:
            return candidate
    return ROOT_UNIT


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


def _full_bytes(marker: Marker) -> int:
    val = marker.node.meta["val"] if marker.kind == "unshard" else marker.input.meta["val"]
    dtype = val.dtype if marker.kind == "unshard" else marker.spec.grad_reduce_dtype(val.dtype)
    return val.numel() * dtype.itemsize


def assign_buckets(markers: list[Marker], policy: Policy) -> list[Bucket]:
    """Group markers (of one kind, in graph order) into buckets, ordered by first marker."""
    buckets: dict[tuple, Bucket] = {}
    open_bucket: dict[tuple, tuple] = {}  # for the bytes policy: compat key -> current key
    filled: dict[tuple, int] = {}
    for marker in markers:
        compat = (marker.spec, _dtype(marker))
        if policy.uses_units:
            key = (marker.unit, *compat)
            label = marker.unit or "<root>"
        elif policy.kind == "param":
            key = (marker.fqn, *compat)
            label = marker.fqn
        else:
            size = _full_bytes(marker)
            key = open_bucket.get(compat)
            if key is None or (filled[key] + size > policy.max_bytes and filled[key] > 0):
                key = (len(buckets), *compat)
                open_bucket[compat] = key
                filled[key] = 0
            filled[key] += size
            label = f"bytes[{key[0]}]"
        if key not in buckets:
            buckets[key] = Bucket(marker.kind, label, marker.spec)
        buckets[key].markers.append(marker)
    return list(buckets.values())
