"""The generated subclass of every sharded module: ``module.<name>`` gathers the parameter.

One property per parameter returns ``unshard(leaf, ...)``, a marker Dynamo inlines and the eager
runtime executes. A read's needs are in :class:`ModuleState`, one instance attribute: for Dynamo
one load and one guard, with a source below the module's so a region's trace of one block replays
for the next (FSDP2's map keyed by module would not). A read that runs as Python has no graph to
bucket in, so a bucket's first read gathers all its unread parameters at once (:func:`eager_read`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from ..api import MixedPrecision
from ..runtime import markers  # noqa: F401  (registers the bucket ops)
from .compile_regions import (
    ModelRegions,
    RegionClass,
    RegionReads,
    make_region_forward,
    region_fallback_call,
    region_input,
)
from .grad_sync import GradientSync
from .sharded_param import LocalShards, ShardedParamInfo
from .tensor_parallel import TPSpec, as_tp_dtensor

# Read as the literal ``self._fsdp_state`` in traced code: the cheapest load for Dynamo.
STATE_ATTR = "_fsdp_state"


@dataclass(eq=False)
class ModuleState:
    """One sharded module's state: ``module._fsdp_state``."""

    specs: dict[str, ShardedParamInfo]  # by local parameter name
    shards: LocalShards  # the model's, shared by all its modules
    sync: GradientSync | None  # the backend's, shared by all the models it shards
    region: RegionReads | None = None  # inside a unit compiled as a region
    mixed_precision: MixedPrecision | None = None  # the root's, when it casts inputs or the output
    region_class: RegionClass | None = None  # a unit compiled as a region: its class's switch
    regions: ModelRegions | None = None  # the root of a model with regions: their classes, the fallback
    reads: dict[str, tuple[str, tuple]] = field(init=False)  # local name -> (fqn, the marker's arguments)
    tp: dict[str, TPSpec] = field(init=False)  # local name -> TP spec, for tensor-parallel parameters

    def __post_init__(self) -> None:
        self.reads = {name: (info.fqn, info.unshard_args) for name, info in self.specs.items()}
        self.tp = {name: info.tp for name, info in self.specs.items() if info.tp is not None}


def module_state(module: nn.Module) -> ModuleState | None:
    """``module``'s state, or None if it was not sharded."""
    return module.__dict__.get(STATE_ATTR)


def set_module_state(module: nn.Module, state: ModuleState) -> None:
    module.__dict__[STATE_ATTR] = state


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it was sharded."""
    return any(module_state(m) is not None for m in module.modules())


@dataclass(frozen=True)
class EagerBucket:
    """Parameters gathered together by a Python read: the markers' arguments, as lists."""

    fqns: list[str]
    full_rows: list[int]
    local_rows: list[int]
    grad_dtypes: list[torch.dtype]
    spec: str  # the CommSpec, as the markers carry it


class _GatherBucket(torch.autograd.Function):
    """A bucket gathered with one collective, its gradients reduced with one (the bucket ops)."""

    @staticmethod
    def forward(ctx: Any, bucket: EagerBucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)  # a parameter the forward did not use gets no gradient
        return tuple(torch.ops.fsdp_compile.unshard_bucket(list(shards), bucket.fqns, bucket.full_rows, bucket.spec))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        bucket = ctx.bucket
        used = [i for i, g in enumerate(grads) if g is not None]
        if not used:
            return (None,) * (len(grads) + 1)
        reduced = iter(torch.ops.fsdp_compile.reduce_grad_bucket(
            *([field[i] for i in used] for field in (grads, bucket.fqns, bucket.local_rows, bucket.grad_dtypes)),
            bucket.spec))
        return (None, *(None if g is None else next(reduced) for g in grads))


def _bucket_key(shards: LocalShards, fqn: str) -> tuple:
    _, unit, _, spec = shards.read_args[fqn]
    leaf = shards.leaves[fqn]
    return unit, spec, leaf.dtype, leaf.requires_grad


def _bucket(shards: LocalShards, fqns: list[str]) -> EagerBucket:
    leaves = [shards.leaves[f] for f in fqns]
    return EagerBucket(fqns, [shards.read_args[f][2] for f in fqns],
                       [leaf.shape[0] if leaf.dim() else 0 for leaf in leaves], [leaf.dtype for leaf in leaves],
                       shards.read_args[fqns[0]][3])


def eager_read(shards: LocalShards, fqn: str) -> torch.Tensor:
    """The gathered value of ``fqn`` for a read that runs as Python in a forward."""
    value = shards.prefetched.pop(fqn, None)
    if value is not None:
        return value
    read, tied = shards.read_in_forward, shards.tied
    if fqn in read or fqn in tied:  # read again, or tied (the root gathers it on its own)
        return torch.ops.fsdp_compile.unshard(shards.leaves[fqn], *shards.read_args[fqn])
    key = _bucket_key(shards, fqn)
    members = [f for f in shards.read_args if f not in read and f not in tied and _bucket_key(shards, f) == key]
    values = _GatherBucket.apply(_bucket(shards, members), *(shards.leaves[f] for f in members))
    read.update(members)
    for member, gathered in zip(members, values):
        if member != fqn:
            shards.prefetched[member] = gathered
    return values[members.index(fqn)]


_CLASS_CACHE: dict[tuple[type, tuple[str, ...], bool, bool, bool, tuple[str, ...], bool, bool], type] = {}


def sharded_class(cls: type, names: tuple[str, ...], root: bool = False, region_forward: bool = False,
                  in_region: bool = False, tp_names: tuple[str, ...] = (), tp_region: bool = False,
                  region_fallback: bool = False) -> type:
    """The generated subclass: a gathering property per parameter, for the root a forward that sets
    up the reads (and with ``region_fallback`` a retrying call), for a region unit a region forward.
    ``tp_names``' reads return the tp DTensor; ``tp_region``: a region of a tensor-parallel model."""
    key = (cls, names, root, region_forward, in_region, tp_names, tp_region, region_fallback)
    if key not in _CLASS_CACHE:
        namespace: dict[str, Any] = {name: _make_property(name, in_region, name in tp_names) for name in names}
        namespace["_fsdp_region"] = _REGION_READS
        if root:
            namespace["forward"] = _make_root_forward(cls)
            if region_fallback:
                namespace["__call__"] = region_fallback_call(cls)
        elif region_forward:
            namespace["forward"] = make_region_forward(cls, tp_region)
        namespace["__module__"] = cls.__module__
        namespace["_fsdp_original_class"] = cls
        _CLASS_CACHE[key] = type(f"Sharded{cls.__name__}", (cls,), namespace)
    return _CLASS_CACHE[key]


# Which modules run inside a compile region, for whoever inspects a sharded model.
_REGION_READS = property(lambda self: self._fsdp_state.region,
                         doc="This module's RegionReads inside a compile region, else None.")


def _make_property(name: str, in_region: bool, tp: bool = False) -> property:
    # Dynamo inlines every read at a cost per call, attribute and constant (a helper call: ~100
    # bytecode steps per read), so all is precomputed at shard time, reads are plain attribute
    # loads (Dynamo wraps a whole __dict__), and the two reads repeat their common part.
    def read(self: nn.Module) -> torch.Tensor:
        state = self._fsdp_state
        fqn, marker_args = state.reads[name]
        shards = state.shards
        if shards.plain_reads:
            return torch.ops.fsdp_compile.unshard(shards.leaves[fqn], *marker_args)
        return gathered_parameter(fqn, marker_args, shards)

    def read_in_region(self: nn.Module) -> torch.Tensor:
        region = self._fsdp_state.region
        if not region.sync.accumulating and torch.compiler.is_compiling():
            # Nothing here may name the block or read the root's per-forward state, or the next
            # block could not reuse this trace (inline too: a frame compiled after a graph break
            # serves every block). The captured graph's pass names every read at its call site.
            return torch.ops.fsdp_compile.unshard(region.leaves[name], *region.args[name])
        state = self._fsdp_state
        fqn, marker_args = state.reads[name]
        shards = state.shards
        if shards.plain_reads:
            return torch.ops.fsdp_compile.unshard(shards.leaves[fqn], *marker_args)
        return gathered_parameter(fqn, marker_args, shards)

    def write(self: nn.Module, value: object) -> None:
        info = self._fsdp_state.specs.get(name)
        fqn = info.fqn if info else name
        raise AttributeError(f"cannot assign to sharded parameter {fqn!r}; load new values with load_state_dict() "
                             "or copy_() into the existing parameter")

    plain = read_in_region if in_region else read
    if tp:
        # A separate property, so plain reads pay nothing for TP.
        def read_tp(self: nn.Module) -> torch.Tensor:
            return as_tp_dtensor(plain(self), self._fsdp_state.tp[name])

        def read_tp_in_region(self: nn.Module) -> torch.Tensor:
            gathered = plain(self)
            region = self._fsdp_state.region
            if not region.sync.accumulating and region.region_class.enabled:
                gathered = region_input(gathered)  # the marker moves out of the region body
            return as_tp_dtensor(gathered, self._fsdp_state.tp[name])

        if in_region:
            read_tp = read_tp_in_region

        return property(read_tp, write, doc=f"Sharded tensor-parallel parameter {name!r} (gathers it over dp).")
    return property(plain, write, doc=f"Full value of sharded parameter {name!r} (gathers it).")


def gathered_parameter(fqn: str, marker_args: tuple, shards: LocalShards) -> torch.Tensor:
    """A read that is not the plain case: tied, accumulating, outside the forward, or run as Python."""
    shared = shards.shared_gathered
    if shared is not None and fqn in shared:  # a tied parameter: gathered once at the root
        return shared[fqn]
    return _gather(fqn, marker_args, shards)


def _gather(fqn: str, marker_args: tuple, shards: LocalShards) -> torch.Tensor:
    """One marker (its gradient reduced, or accumulated under no_sync), or a Python read's bucket."""
    local = shards.leaves[fqn]
    if shards.in_forward:
        accumulating = shards.accumulating
    else:  # a read outside the model's forward (eager runtime)
        accumulating = shards.sync is not None and shards.sync.accumulating
    if accumulating and local.requires_grad:
        return torch.ops.fsdp_compile.unshard_no_sync(local, shards.sync.accumulators[fqn], *marker_args)
    if shards.in_forward and not torch.compiler.is_compiling():
        return eager_read(shards, fqn)
    return torch.ops.fsdp_compile.unshard(local, *marker_args)


def _make_root_forward(cls: type) -> Callable[..., Any]:
    original_forward = cls.forward

    def run(self: nn.Module, shards: LocalShards, args: tuple, kwargs: dict) -> Any:
        shards.shared_gathered = {fqn: _gather(fqn, args_, shards) for fqn, args_ in shards.shared}
        policy = self._fsdp_state.mixed_precision
        if policy is None:
            return original_forward(self, *args, **kwargs)
        args, kwargs = cast_inputs(policy, args, kwargs)
        return cast_output(policy, original_forward(self, *args, **kwargs))

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Not in hooks: Dynamo compiles module hooks as frames of their own.
        shards = self._fsdp_state.shards
        if torch.compiler.is_compiling():
            # No try/finally while traced: Dynamo cannot resume a frame inside one after a graph
            # break. The graph after the break resets the state (after an exception, the next forward).
            _begin_forward(shards, traced=True)
            output = run(self, shards, args, kwargs)
            _end_forward(shards)
            return output
        shards.refresh()  # the eager runtime; compiled graphs refresh before they run
        _begin_forward(shards, traced=False)
        try:
            return run(self, shards, args, kwargs)
        finally:
            _end_forward(shards)

    return forward


def _begin_forward(shards: LocalShards, traced: bool) -> None:
    shards.accumulating = shards.sync is not None and shards.sync.accumulating
    shards.in_forward = True
    # Reads that run as Python gather by bucket (through gathered_parameter), which plain reads skip.
    shards.plain_reads = traced and not shards.accumulating and not shards.shared
    shards.prefetched = {}
    shards.read_in_forward = set()


def _end_forward(shards: LocalShards) -> None:
    shards.in_forward = False
    shards.plain_reads = False
    shards.shared_gathered = None
    shards.prefetched = {}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def cast_inputs(policy: MixedPrecision, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The root module's forward inputs as ``policy`` wants them."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        return _cast(args, policy.param_dtype), _cast(kwargs, policy.param_dtype)
    return args, kwargs


def cast_output(policy: MixedPrecision, output: Any) -> Any:
    """The root module's forward output as ``policy`` wants it."""
    return output if policy.output_dtype is None else _cast(output, policy.output_dtype)
