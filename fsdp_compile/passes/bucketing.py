"""Which markers communicate together: the assignment of markers to buckets.

A bucket is one all-gather (or one reduce-scatter) instead of one per parameter: fewer, larger
collectives that reach the link's bandwidth, at the cost of gathering a whole bucket at once.
Under a unit policy a bucket is a unit's markers (units are decided when the model is sharded:
:mod:`fsdp_compile.sharding.units`); under a byte budget, consecutive markers in graph order
until the bucket holds that many bytes of full tensors (in the collective's dtype; a larger
tensor gets a bucket of its own); under ``"param"``, one per parameter. Markers only share a
bucket when they communicate the same way (same :class:`CommSpec`) and read the same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.collectives import CommSpec
from ..runtime.markers import Marker
from ..sharding.units import Policy


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
            size = marker.full_bytes
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
