"""Copy-in, chunk-concatenation and copy-out as custom ops: Triton on CUDA, torch elsewhere.

The memory-bound steps around every collective, each one op in the graph (so Inductor calls our
kernel instead of generating many small copies): a torch implementation defines the result, a
multi-tensor Triton kernel runs on CUDA (``FSDP_COMPILE_KERNELS=torch`` forces torch's). A tensor
split over ``world`` ranks is cut into chunks of ``padded_numel`` elements (whole dim-0 rows).
"""

from __future__ import annotations

import itertools
import math
import os
import types
from collections.abc import Sequence

import torch

NAMESPACE = "fsdp_compile"


def _triton() -> types.ModuleType:
    # Imported on the first CUDA copy: importing Triton costs every other process ~80 ms.
    from . import triton_kernels

    return triton_kernels


def _use_triton(device: torch.device, *dtypes: torch.dtype) -> bool:
    if device.type != "cuda" or os.environ.get("FSDP_COMPILE_KERNELS", "").lower() == "torch":
        return False
    # float64 -> bfloat16 would round twice through float32 in the kernel; torch rounds once.
    return _triton().available() and torch.float64 not in dtypes and all(
        d in _triton().SUPPORTED_DTYPES for d in dtypes)


# ----------------------------------------------------------------------------- copy-in
def copy_in_reference(shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    # Two multi-tensor calls (as FSDP2's copy-in): copy with cast, then zero the padding.
    out = torch.empty(sum(padded_numels), dtype=dtype, device=shards[0].device)
    pieces = torch.split(out, list(padded_numels))
    with torch.no_grad():
        torch._foreach_copy_([p[:s.numel()] for p, s in zip(pieces, shards)], [s.reshape(-1) for s in shards])
        padding = [p[s.numel():] for p, s in zip(pieces, shards) if p.numel() > s.numel()]
        if padding:
            torch._foreach_zero_(padding)
    return out


@torch.library.custom_op(f"{NAMESPACE}::copy_in", mutates_args=())
def copy_in(shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer: each shard flattened, cast to ``dtype``, zero-padded to its chunk."""
    if _use_triton(shards[0].device, shards[0].dtype, dtype):
        return _triton().copy_in(shards, padded_numels, dtype)
    return copy_in_reference(shards, padded_numels, dtype)


@copy_in.register_fake
def _(shards, padded_numels, dtype):
    return shards[0].new_empty(sum(padded_numels), dtype=dtype)


# ----------------------------------------------------------------------------- chunk-cat
def chunk_cat_reference(grads: Sequence[torch.Tensor], world: int, padded_numels: Sequence[int],
                        dtype: torch.dtype) -> torch.Tensor:
    # As FSDP2: cast to the reduce dtype, then one _chunk_cat (pads each rank's chunk). Its
    # chunks are whole dim-0 rows, so they match padded_numels.
    grads = [g if g.dtype == dtype else g.to(dtype) for g in grads]
    return torch._chunk_cat(grads, dim=0, num_chunks=world).view(-1)


@torch.library.custom_op(f"{NAMESPACE}::chunk_cat", mutates_args=())
def chunk_cat(grads: list[torch.Tensor], world: int, padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter input: for each rank, its zero-padded chunk of every gradient, cast."""
    if _use_triton(grads[0].device, grads[0].dtype, dtype):
        return _triton().chunk_cat(grads, world, padded_numels, dtype)
    return chunk_cat_reference(grads, world, padded_numels, dtype)


@chunk_cat.register_fake
def _(grads, world, padded_numels, dtype):
    return grads[0].new_empty(world * sum(padded_numels), dtype=dtype)


# ----------------------------------------------------------------------------- copy-out
def flatten_shapes(shapes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(every dimension back to back, the number of dimensions of each shape): how shapes travel
    as arguments of an op (a schema has no list of lists)."""
    return [int(d) for shape in shapes for d in shape], [len(shape) for shape in shapes]


def unflatten_shapes(dims: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """The shapes :func:`flatten_shapes` wrote."""
    return [tuple(dims[start:start + rank]) for start, rank in zip(itertools.accumulate(ranks, initial=0), ranks)]


def copy_out_reference(gathered: torch.Tensor, world: int, padded_numels: Sequence[int],
                       shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    # One split_with_sizes_copy into per-parameter (world, chunk) buffers, as FSDP2's copy-out.
    outs = [torch.empty(world, padded, dtype=gathered.dtype, device=gathered.device) for padded in padded_numels]
    torch.split_with_sizes_copy(gathered.view(world, -1), list(padded_numels), dim=1, out=outs)
    return [out.view(-1)[:math.prod(shape)].view(shape) for out, shape in zip(outs, shapes)]


@torch.library.custom_op(f"{NAMESPACE}::copy_out", mutates_args=())
def copy_out(gathered: torch.Tensor, world: int, padded_numels: list[int], dims: list[int],
             ranks: list[int]) -> list[torch.Tensor]:
    """Full tensors of the given shapes from an all-gather output (padding dropped), one per
    parameter; ``dims`` and ``ranks`` are the shapes as :func:`flatten_shapes` writes them.

    Shaped rather than flat: one node per parameter in a lowered graph instead of two (a flat
    output and its view), which a deep model pays for in every compiler stage after lowering.
    """
    shapes = unflatten_shapes(dims, ranks)
    if _use_triton(gathered.device, gathered.dtype):
        return _triton().copy_out(gathered, world, padded_numels, shapes)
    return copy_out_reference(gathered, world, padded_numels, shapes)


@copy_out.register_fake
def _(gathered, world, padded_numels, dims, ranks):
    return [gathered.new_empty(shape) for shape in unflatten_shapes(dims, ranks)]


# ----------------------------------------------------------------------------- float8
# The gather of torchao float8 weights (collectives.py: _gather_float8): cast into a byte buffer
# and back to the compute dtype, as torchao's cast and to_original_precision do.
def _to_float8(values: torch.Tensor, scale: torch.Tensor, float8: torch.dtype) -> torch.Tensor:
    # torchao's hp_tensor_and_scale_to_float8: scale in float32, saturate, round to float8.
    largest = torch.finfo(float8).max
    return (values.to(torch.float32) * scale).clamp(min=-largest, max=largest).to(float8)


@torch.library.custom_op(f"{NAMESPACE}::amax_in", mutates_args=())
def amax_in(shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """max |shard| of each shard as it is in ``dtype``, as float32 (0 for an empty shard).

    Rounding to a dtype is monotonic, so this is the amax of the shard rounded to ``dtype``
    without rounding the shard. An op rather than traced torch ops: Inductor fuses a
    round trip through a narrower dtype away, and the rounding is what makes the scale
    torchao's for the weight in ``dtype``."""
    amaxes = [s.abs().amax() if s.numel() else s.new_zeros(()) for s in shards]
    return torch.stack(amaxes).to(dtype).to(torch.float32)


@amax_in.register_fake
def _(shards, dtype):
    return shards[0].new_empty(len(shards), dtype=torch.float32)


def copy_in_float8_reference(shards: Sequence[torch.Tensor], scales: torch.Tensor, padded_numels: Sequence[int],
                             dtype: torch.dtype, float8: torch.dtype) -> torch.Tensor:
    out = torch.zeros(sum(padded_numels), dtype=torch.uint8, device=shards[0].device)
    start = 0
    with torch.no_grad():
        for i, (shard, padded) in enumerate(zip(shards, padded_numels)):
            cast = _to_float8(shard.reshape(-1).to(dtype), scales[i], float8)
            out[start:start + shard.numel()].copy_(cast.view(torch.uint8))
            start += padded
    return out


@torch.library.custom_op(f"{NAMESPACE}::copy_in_float8", mutates_args=())
def copy_in_float8(shards: list[torch.Tensor], scales: torch.Tensor, padded_numels: list[int], dtype: torch.dtype,
                   float8: torch.dtype) -> torch.Tensor:
    """One flat byte buffer: each shard, rounded to ``dtype`` (the compute dtype), scaled by
    its ``scales`` entry and cast to ``float8`` (saturating), zero-padded to its chunk."""
    if _use_triton(shards[0].device, shards[0].dtype) and float8 in _triton().FLOAT8_DTYPES \
            and dtype in (shards[0].dtype, torch.bfloat16):
        return _triton().copy_in_float8(shards, scales, padded_numels, dtype, float8)
    return copy_in_float8_reference(shards, scales, padded_numels, dtype, float8)


@copy_in_float8.register_fake
def _(shards, scales, padded_numels, dtype, float8):
    return shards[0].new_empty(sum(padded_numels), dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::copy_out_float8", mutates_args=())
def copy_out_float8(gathered: torch.Tensor, scales: torch.Tensor, world: int, padded_numels: list[int],
                    dims: list[int], ranks: list[int], float8: torch.dtype, dtype: torch.dtype) -> list[torch.Tensor]:
    """Full tensors in ``dtype`` from a float8 all-gather's bytes: each weight's float8 values
    over its scale (torchao's way back to the original precision), padding dropped."""
    data = copy_out_reference(gathered, world, padded_numels, unflatten_shapes(dims, ranks))
    return [d.view(float8).to(dtype) / scales[i] for i, d in enumerate(data)]


@copy_out_float8.register_fake
def _(gathered, scales, world, padded_numels, dims, ranks, float8, dtype):
    return [gathered.new_empty(shape, dtype=dtype) for shape in unflatten_shapes(dims, ranks)]
