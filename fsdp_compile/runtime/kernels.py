"""Copy-in, chunk-concatenation and copy-out as custom ops: Triton on CUDA, torch elsewhere.

These are the memory-bound steps around every collective. Each is one op in the graph (so
Inductor calls our kernel instead of generating many small copies), with a torch
implementation that defines the result and a multi-tensor Triton kernel used on CUDA devices.
``FSDP_COMPILE_KERNELS=torch`` forces the torch implementation everywhere (for comparisons).

Layout: a tensor of ``numel`` elements split over ``world`` ranks is cut into chunks of
``padded_numel`` elements (whole dim-0 rows); the last chunks are zero-padded.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from . import triton_kernels

NAMESPACE = "fsdp_compile"


def _use_triton(device: torch.device, *dtypes: torch.dtype) -> bool:
    if device.type != "cuda" or os.environ.get("FSDP_COMPILE_KERNELS", "").lower() == "torch":
        return False
    # float64 -> bfloat16 would round twice through float32 in the kernel; torch rounds once.
    return triton_kernels.available() and torch.float64 not in dtypes and all(
        d in triton_kernels.SUPPORTED_DTYPES for d in dtypes)


# ----------------------------------------------------------------------------- copy-in
def copy_in_reference(shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(sum(padded_numels), dtype=dtype, device=shards[0].device)
    for piece, shard in zip(torch.split(out, list(padded_numels)), shards):
        n = shard.numel()
        piece[:n].copy_(shard.reshape(-1))
        piece[n:].zero_()
    return out


@torch.library.custom_op(f"{NAMESPACE}::copy_in", mutates_args=())
def copy_in(shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """One flat buffer: each shard flattened, cast to ``dtype``, zero-padded to its chunk."""
    if _use_triton(shards[0].device, shards[0].dtype, dtype):
        return triton_kernels.copy_in(shards, padded_numels, dtype)
    return copy_in_reference(shards, padded_numels, dtype)


@copy_in.register_fake
def _(shards, padded_numels, dtype):
    return shards[0].new_empty(sum(padded_numels), dtype=dtype)


# ----------------------------------------------------------------------------- chunk-cat
def chunk_cat_reference(grads: Sequence[torch.Tensor], world: int, padded_numels: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    total = sum(padded_numels)
    out = torch.empty(world, total, dtype=dtype, device=grads[0].device)
    for piece, grad, padded in zip(torch.split(out, list(padded_numels), dim=1), grads, padded_numels):
        flat = grad.reshape(-1)
        n = flat.numel()
        full_ranks, rest = divmod(n, padded)
        if full_ranks:
            piece[:full_ranks].copy_(flat[:full_ranks * padded].view(full_ranks, padded))
        if rest:
            piece[full_ranks, :rest].copy_(flat[full_ranks * padded:])
            piece[full_ranks, rest:].zero_()
        piece[full_ranks + (1 if rest else 0):].zero_()
    return out.view(-1)


@torch.library.custom_op(f"{NAMESPACE}::chunk_cat", mutates_args=())
def chunk_cat(grads: list[torch.Tensor], world: int, padded_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter input: for each rank, its zero-padded chunk of every gradient, cast."""
    if _use_triton(grads[0].device, grads[0].dtype, dtype):
        return triton_kernels.chunk_cat(grads, world, padded_numels, dtype)
    return chunk_cat_reference(grads, world, padded_numels, dtype)


@chunk_cat.register_fake
def _(grads, world, padded_numels, dtype):
    return grads[0].new_empty(world * sum(padded_numels), dtype=dtype)


# ----------------------------------------------------------------------------- copy-out
def copy_out_reference(gathered: torch.Tensor, world: int, padded_numels: Sequence[int], numels: Sequence[int]) -> list[torch.Tensor]:
    per_rank = gathered.view(world, -1)
    outs = []
    for piece, numel in zip(torch.split(per_rank, list(padded_numels), dim=1), numels):
        full = torch.empty(piece.shape, dtype=gathered.dtype, device=gathered.device)
        full.copy_(piece)
        outs.append(full.view(-1)[:numel])
    return outs


@torch.library.custom_op(f"{NAMESPACE}::copy_out", mutates_args=())
def copy_out(gathered: torch.Tensor, world: int, padded_numels: list[int], numels: list[int]) -> list[torch.Tensor]:
    """Flat full tensors from an all-gather output (padding dropped), one per parameter."""
    if _use_triton(gathered.device, gathered.dtype):
        return triton_kernels.copy_out(gathered, world, padded_numels, numels)
    return copy_out_reference(gathered, world, padded_numels, numels)


@copy_out.register_fake
def _(gathered, world, padded_numels, numels):
    return [gathered.new_empty(n) for n in numels]
