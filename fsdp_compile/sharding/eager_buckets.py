"""Reads that run as Python gather their whole bucket at once.

Inside a compiled graph, a read of a sharded parameter is a marker, and lowering gathers the
markers of one bucket with one collective. A read that runs as Python has no graph to be
bucketed in. That is a read in the eager runtime, or one in a frame Dynamo runs as Python after
a graph break: a block that breaks the graph inside a loop over blocks makes Dynamo run that
whole loop, and the root's reads before and after it, as Python; each read there would compile
as a graph of its own, a bucket of one.

So a Python read gathers its bucket instead. The first read of a bucket in a forward gathers
every parameter of that bucket not yet read in this forward, with one all-gather, and keeps
the others until they are read (``LocalShards.prefetched``, emptied when the forward ends). Their
gradients are reduced together, with one reduce-scatter, once backward has produced all that it
produces.
- *What a bucket is:* the parameters of one bucket unit that communicate alike (the same
  ``CommSpec``, dtype and ``requires_grad``). A tied parameter has no bucket: the root gathers
  it once per forward.
- *What it changes:* not the values. The gather and copy functions are the compiled path's
  (:mod:`fsdp_compile.runtime.collectives`), and the reductions compute what each parameter's
  own would.
- *A parameter read again in the same forward* gathers again on its own, as any read did
  before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..runtime import markers  # noqa: F401  (registers the bucket ops)

if TYPE_CHECKING:
    from .local_shards import LocalShards


@dataclass(frozen=True)
class EagerBucket:
    """Parameters gathered together by a Python read: the markers' arguments, as lists."""

    fqns: list[str]
    full_rows: list[int]
    local_rows: list[int]
    grad_dtypes: list[torch.dtype]
    spec: str  # the CommSpec, as the markers carry it


class _GatherBucket(torch.autograd.Function):
    """Every parameter of a bucket gathered with one collective; their gradients reduced with one
    (the runtime's bucket ops, :mod:`fsdp_compile.runtime.markers`)."""

    @staticmethod
    def forward(ctx: Any, bucket: EagerBucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)  # a parameter the forward did not use gets no gradient
        return tuple(torch.ops.fsdp_compile.unshard_bucket(list(shards), bucket.fqns, bucket.full_rows, bucket.spec))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        bucket = ctx.bucket
        used = [i for i, g in enumerate(grads) if g is not None]
        shard_grads: list[torch.Tensor | None] = [None] * len(grads)
        if used:
            reduced = torch.ops.fsdp_compile.reduce_grad_bucket(
                [grads[i] for i in used], [bucket.fqns[i] for i in used], [bucket.local_rows[i] for i in used],
                [bucket.grad_dtypes[i] for i in used], bucket.spec)
            for i, grad in zip(used, reduced):
                shard_grads[i] = grad
        return (None, *shard_grads)


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
    """The gathered value of parameter ``fqn`` for a read that runs as Python in a forward
    (see the module docstring)."""
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
