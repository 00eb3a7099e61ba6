"""The ``bucket=`` option's vocabulary: the policies it accepts, parsed and checked.

Which modules a policy makes bucket units of is decided on the model, when it is sharded
(:mod:`fsdp_compile.sharding.units`); how markers are grouped into buckets on the graph is
:mod:`fsdp_compile.passes.lowering`. Both read the :class:`Policy` parsed here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.nn as nn

BucketPolicy = str | int | Iterable[type] | Callable[[nn.Module], bool]


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
        raise ValueError(f"bucket={bucket!r} is not a policy; use 'module', 'param', a size in bytes, a set of "
                         "module classes, or a callable module -> bool")
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
                f"bucket= as a collection must hold nn.Module subclasses; got {bad or 'an empty collection'}")
        return Policy("classes", classes=classes)
    if callable(bucket):
        return Policy("callable", predicate=bucket)
    raise TypeError(f"bucket= got {type(bucket).__name__}; see fsdp_compile.backend's documentation")
