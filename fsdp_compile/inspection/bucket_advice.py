"""Whether a model's bucket units defeat sharding, and what to pass instead.

A strategy that reshards after forward holds about two buckets unsharded at once (in use and
prefetched): a bucket with more than half of the parameters holds most of the model whole, as
NO_SHARD would, with little compute to overlap its gather. Checked at ``shard()``; the backend
warns once and its report marks the bucket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..api import Policy
from ..sharding.units import ROOT_UNIT, repeated_classes, unit_of

# Over this share of the parameters, one bucket leaves too little to shard.
MAX_SHARE = 0.5
# A suggested byte size gives about this many buckets.
SUGGESTED_BUCKETS = 8


@dataclass(frozen=True)
class OversizedBucket:
    """A bucket unit that holds more than half of the model's parameters (by element count)."""

    unit: str
    share: float
    advice: str

    @property
    def label(self) -> str:
        return self.unit or "<root>"

    def message(self, strategy: str) -> str:
        return (f"fsdp_compile: bucket {self.label!r} holds {self.share:.0%} of the model's parameters (by "
                f"element count), and {strategy} gathers a bucket whole: every step holds that share of "
                f"the model unsharded at once, with little compute to overlap its all-gather. {self.advice}")


def oversized_bucket(model: nn.Module, units: Mapping[str, str], gathered_itemsize: Mapping[str, int],
                     policy: Policy) -> OversizedBucket | None:
    """The unit holding more than half of ``model``'s parameter elements, if one does.

    ``units`` maps each parameter's name to its unit; ``gathered_itemsize`` to the bytes per
    element of its gathered (compute) dtype, for a byte size to suggest.
    """
    params = dict(model.named_parameters())
    numel = {fqn: params[fqn].numel() for fqn in units}
    total = sum(numel.values())
    per_unit: dict[str, int] = {}
    for fqn, unit in units.items():
        per_unit[unit] = per_unit.get(unit, 0) + numel[fqn]
    if not total:
        return None
    unit, size = max(per_unit.items(), key=lambda item: item[1])
    if size <= MAX_SHARE * total or max(numel.values()) > MAX_SHARE * total:
        # A parameter over half the model is gathered whole under any policy: nothing to suggest.
        return None
    return OversizedBucket(unit, size / total, _advice(model, unit, units, numel, gathered_itemsize, policy))


def _advice(model: nn.Module, unit: str, units: Mapping[str, str], numel: Mapping[str, int],
            gathered_itemsize: Mapping[str, int], policy: Policy) -> str:
    if policy.kind == "module":
        why = ("bucket='module' found no repeated blocks in it" if unit == ROOT_UNIT
               else f"bucket='module' took {unit!r} for one block")
    else:
        why = f"bucket={policy.describe()} leaves it whole"
    all_units = set(units.values()) - {ROOT_UNIT}
    classes = repeated_classes(model, lambda name: name != unit and unit_of(name, all_units) == unit)
    model_bytes = sum(numel[fqn] * gathered_itemsize[fqn] for fqn in numel)
    suggested = math.ceil(model_bytes / SUGGESTED_BUCKETS)
    fix = f"a set of its classes, e.g. bucket={{{', '.join(classes)}}} (these repeat in it), or " if classes else ""
    return (f"{why}. Pass {fix}a bucket size in bytes, e.g. bucket={suggested} (about "
            f"1/{SUGGESTED_BUCKETS} of the model per bucket).")


def oversized_in(model: nn.Module, infos: Mapping[str, Any], options: Any, topology: Any) -> OversizedBucket | None:
    """:func:`oversized_bucket` where it defeats sharding: a bucket gathered whole, freed and
    gathered again (FULL_SHARD, HYBRID_SHARD over a shard group of 2+), for the parameters
    ``infos`` (name -> :class:`~fsdp_compile.sharding.sharded_param.ShardedParamInfo`) a backend with
    ``options`` sharded over ``topology``; None elsewhere."""
    policy = options.bucket_policy
    if not (policy.uses_units and options.strategy.reshard_after_forward and topology.shard_size > 1):
        return None
    params = dict(model.named_parameters())
    itemsize = {fqn: (info.comm.param_dtype or params[fqn].dtype).itemsize for fqn, info in infos.items()}
    return oversized_bucket(model, {fqn: info.unit for fqn, info in infos.items()}, itemsize, policy)
