"""Reads that run as Python gather their whole bucket at once.

In a compiled graph lowering gathers a bucket's markers with one collective; a read that runs as
Python (the eager runtime, or a frame Dynamo runs as Python after a graph break, such as a loop
over blocks) has no graph to be bucketed in, and would be a bucket of one. So the first such
read of a bucket in a forward gathers every parameter of the bucket not yet read, with one
all-gather, and keeps the others until read (``LocalShards.prefetched``, emptied when the
forward ends); their gradients are reduced together once backward produced them all.

A bucket: the parameters of one unit that communicate alike (``CommSpec``, dtype,
``requires_grad``). A tied parameter has none (the root gathers it once), and a parameter read
again in the same forward gathers again on its own. The values do not change: the gather and
reductions are the compiled path's (:mod:`fsdp_compile.runtime.collectives`).
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
