"""The data layout of gathers and reductions, checked without communication."""

from __future__ import annotations

import pytest
import torch

import fsdp_compile  # noqa: F401  (registers the ops)
from fsdp_compile.runtime.collectives import (
    chunk_numels,
    divide_factors,
    padded_rows,
    shard_bounds,
)
from fsdp_compile.runtime.kernels import flatten_shapes

ops = torch.ops.fsdp_compile


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rows", range(0, 10))
def test_shard_bounds_follow_torch_chunk(rows: int, world: int) -> None:
    chunks = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        start, length = shard_bounds(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, start + length)) == expected
        assert length <= padded_rows(rows, world)


def shard_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    start, length = shard_bounds(full.shape[0], world, rank)
    return full[start:start + length]


FULLS = [torch.randn(5, 3), torch.randn(3), torch.randn(1, 2), torch.randn(8, 2, 2), torch.randn(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_copy_in_then_gather_then_copy_out_rebuilds_full_tensors(world: int, dtype: torch.dtype) -> None:
    chunks = chunk_numels([f.shape for f in FULLS], world)
    # An all-gather concatenates every rank's copy-in buffer.
    gathered = torch.cat([ops.copy_in([shard_of(f, world, r) for f in FULLS], chunks, dtype) for r in range(world)])
    outs = ops.copy_out(gathered, world, chunks, *flatten_shapes([f.shape for f in FULLS]))
    for out, f in zip(outs, FULLS):
        assert out.dtype == dtype
        assert out.shape == f.shape and out.is_contiguous()
        assert torch.equal(out, f.to(dtype))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_input_has_the_all_gather_layout(world: int) -> None:
    chunks = chunk_numels([f.shape for f in FULLS], world)
    per_rank = ops.chunk_cat(FULLS, world, chunks, torch.float32).view(world, -1)
    assert torch.equal(per_rank, torch._chunk_cat(FULLS, dim=0, num_chunks=world))
    for rank in range(world):
        expected = ops.copy_in([shard_of(f, world, rank) for f in FULLS], chunks, torch.float32)
        assert torch.equal(per_rank[rank], expected)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 16, 24, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_divide_factors_follow_fsdp2(size: int, dtype: torch.dtype) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    class Group:  # the FSDP2 helper only asks a group for its size
        def size(self) -> int:
            return size

    pre, post, rs_op, _ = _get_gradient_divide_factors(Group(), None, dtype)
    ours = divide_factors(dtype, size)
    if rs_op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM) and pre is None and post is None:
        assert ours == (None, None)  # FSDP2 averages in the collective (SUM at size 1 is the same)
    else:
        assert ours == (pre, post)
