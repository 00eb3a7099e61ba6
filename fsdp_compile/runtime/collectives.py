"""The one definition of what gathering parameters and reducing gradients means.

Both the eager runtime (the implementations of the ``unshard`` / ``reduce_grad`` markers) and
the compiled path (passes that replace markers by the traced body of these functions) call the
functions here, so eager and compiled runs perform the same operations in the same order and
agree bit for bit.

Everything is written with functional collectives (``torch.ops._c10d_functional``) and
out-of-place torch ops, so these functions can be traced into a graph as they are.

Data layout follows FSDP2: a parameter with ``rows`` rows on dim 0 is cut into ``world`` chunks
of ``padded_rows(rows, world)`` rows (``torch.chunk`` semantics; the tail is zero padding), and a
bucket's all-gather buffer holds, per rank, that rank's padded chunks of every parameter back to
back. The reduce-scatter buffer uses the same layout (``torch._chunk_cat``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

_c10d = torch.ops._c10d_functional

# Reduce dtypes that cannot overflow when summed across ranks; for these FSDP2 (and we) let the
# collective average, otherwise the sum is pre- and post-divided by about sqrt(world).
_AVG_SAFE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def padded_rows(rows: int, world: int) -> int:
    """Rows of one rank's chunk of a tensor with ``rows`` rows split over ``world`` ranks."""
    return -(-rows // world)


def shard_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s rows, as ``torch.chunk`` and DTensor ``Shard(0)`` place them."""
    chunk = padded_rows(rows, world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows) - start


@dataclass(frozen=True)
class CommSpec:
    """How one parameter is communicated; travels as the markers' trailing arguments.

    ``dim0_sharded`` is False for a parameter kept whole on every rank even though the strategy
    shards (a 0-d tensor): it is not gathered, and its gradient is all-reduced over the shard
    group instead of reduce-scattered.
    """

    shard_group: str
    shard_size: int
    dim0_sharded: bool
    replicate_group: str
    replicate_size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool

    def op_args(self) -> tuple:
        return (
            self.shard_group,
            self.shard_size,
            self.dim0_sharded,
            self.replicate_group,
            self.replicate_size,
            self.param_dtype,
            self.reduce_dtype,
            self.reshard_after_forward,
        )

    @classmethod
    def from_op_args(cls, args: Sequence) -> "CommSpec":
        return cls(*args)

    @property
    def gathers(self) -> bool:
        return self.dim0_sharded and self.shard_size > 1

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or param_dtype

    def grad_reduce_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        # FSDP2's default: reduce in the compute dtype unless told otherwise.
        return self.reduce_dtype or self.param_dtype or grad_dtype


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def copy_in(shards: Sequence[torch.Tensor], rows_per_rank: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer of every shard, cast to ``dtype`` and zero-padded to ``rows_per_rank`` rows."""
    pieces = []
    for shard, rows in zip(shards, rows_per_rank):
        shard = shard.to(dtype)
        missing = rows - shard.shape[0]
        if missing:
            shard = torch.cat([shard, shard.new_zeros((missing, *shard.shape[1:]))])
        pieces.append(shard.reshape(-1))
    return torch.cat(pieces)


def copy_out(
    gathered: torch.Tensor,
    world: int,
    full_shapes: Sequence[Sequence[int]],
    rows_per_rank: Sequence[int],
) -> list[torch.Tensor]:
    """Split an all-gather output into full per-parameter tensors (padding dropped)."""
    per_rank = gathered.view(world, -1)
    numels = [rows * math.prod(shape[1:]) for shape, rows in zip(full_shapes, rows_per_rank)]
    outs = []
    for piece, shape, rows in zip(torch.split(per_rank, numels, dim=1), full_shapes, rows_per_rank):
        full = piece.reshape(world * rows, *shape[1:])
        outs.append(full.narrow(0, 0, shape[0]))
    return outs


def gather_params(
    shards: Sequence[torch.Tensor],
    full_shapes: Sequence[Sequence[int]],
    spec: CommSpec,
) -> list[torch.Tensor]:
    """Full parameters from this rank's shards: copy-in, one all-gather, copy-out.

    All shards share ``spec`` (one bucket). Parameters that are not gathered come back as a
    fresh copy in the compute dtype, never as an alias of the shard.
    """
    dtype = spec.compute_dtype(shards[0].dtype)
    if not spec.gathers:
        return [s.to(dtype, copy=True) for s in shards]
    rows = [padded_rows(shape[0], spec.shard_size) for shape in full_shapes]
    flat = copy_in(shards, rows, dtype)
    gathered = _wait(_c10d.all_gather_into_tensor(flat, spec.shard_size, spec.shard_group))
    return copy_out(gathered, spec.shard_size, full_shapes, rows)


def divide_factors(reduce_dtype: torch.dtype, data_parallel_size: int) -> tuple[float | None, float | None]:
    """(pre, post) divisors applied around a summing reduction, or (None, None) to average.

    Same rule as FSDP2: average in the collective for dtypes that cannot overflow; for float16,
    divide by about sqrt(N) before and the rest after, so neither the sum nor the
    per-rank values leave the representable range.
    """
    if reduce_dtype in _AVG_SAFE_DTYPES:
        return None, None
    pre = 1
    while data_parallel_size % pre == 0 and data_parallel_size / pre > pre:
        pre *= 2
    return float(pre), data_parallel_size / pre


def chunk_cat(grads: Sequence[torch.Tensor], world: int, dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter input: per rank, that rank's padded chunk of every gradient."""
    return torch._chunk_cat([g.to(dtype) for g in grads], dim=0, num_chunks=world).view(-1)


def reduce_grads(
    grads: Sequence[torch.Tensor],
    local_rows: Sequence[int],
    grad_dtypes: Sequence[torch.dtype],
    spec: CommSpec,
) -> list[torch.Tensor]:
    """Gradients of this rank's shards: the average over data-parallel ranks of the full gradients.

    Sharded parameters: one reduce-scatter in the shard group; replicated ones (or NO_SHARD):
    an all-reduce in the shard group; then, with replicas, one all-reduce across them. Each
    result is cast back to the parameter's dtype.
    """
    reduce_dtype = spec.grad_reduce_dtype(grads[0].dtype)
    pre, post = divide_factors(reduce_dtype, spec.shard_size * spec.replicate_size)
    op = "avg" if pre is None else "sum"
    full_shapes = [g.shape for g in grads]

    if spec.gathers:
        rows = [padded_rows(shape[0], spec.shard_size) for shape in full_shapes]
        flat = chunk_cat(grads, spec.shard_size, reduce_dtype)
    else:
        flat = torch.cat([g.to(reduce_dtype).reshape(-1) for g in grads])
    if pre is not None:
        flat = flat / pre
    if spec.shard_size > 1:
        if spec.gathers:
            flat = _wait(_c10d.reduce_scatter_tensor(flat, op, spec.shard_size, spec.shard_group))
        else:
            flat = _wait(_c10d.all_reduce(flat, op, spec.shard_group))
    if spec.replicate_size > 1:
        flat = _wait(_c10d.all_reduce(flat, op, spec.replicate_group))
    if post is not None:
        flat = flat / post

    outs = []
    if spec.gathers:
        numels = [r * math.prod(shape[1:]) for shape, r in zip(full_shapes, rows)]
        pieces = torch.split(flat, numels)
        for piece, shape, r, n, dtype in zip(pieces, full_shapes, rows, local_rows, grad_dtypes):
            outs.append(piece.view(r, *shape[1:]).narrow(0, 0, n).to(dtype))
    else:
        numels = [math.prod(shape) for shape in full_shapes]
        for piece, shape, dtype in zip(torch.split(flat, numels), full_shapes, grad_dtypes):
            outs.append(piece.view(shape).to(dtype))
    return outs
