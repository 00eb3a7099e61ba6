"""Which markers communicate together: the assignment of markers to buckets.

A bucket is one collective instead of one per parameter: a unit policy's unit
(:mod:`fsdp_compile.sharding.units`), a byte budget's run of consecutive markers, or one
parameter under ``"param"``; markers share a bucket only when they communicate alike (the
:class:`CommSpec`, but for the float8 cast only a weight's gather reads) and read one dtype.
The graph's last run of markers of a unit read earlier is a bucket of its own, ``<unit>:tail``:
a transformer's root would otherwise gather its head with its embeddings before anything
computes, and reduce both after the last gradient (torchtitan shards ``[norm, output]`` apart
by hand for this). A tail parameter gathered earlier (a tied head) stays in the earlier bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..api import Policy
from ..runtime.collectives import CommSpec
from ..runtime.markers import Marker

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
