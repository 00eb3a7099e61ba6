"""The backend's own copies around each collective, timed as the real custom ops.

A step copies every bucket three times on a rank: its shards into the all-gather's input
(``copy_in``), the gathered buffer out into one tensor per parameter (``copy_out``), and the
gradients into the reduce-scatter's input (``chunk_cat``). Priced as memory-bound operators at
the calibrated bandwidth they came out 2-3x too cheap on a 2-core Xeon (copy-out and copy-in
ran at 4-7 GB/s in a FULL_SHARD step, the bandwidth calibration's operators at 14-15): each is
one op over many tensors, a copy per parameter into a freshly allocated output, on operands
a step has long evicted from the caches. So each op is timed as itself, on cold operands, at a
bucket of many small parameters and one of few large ones, and the line through both points
separates its cost per parameter from its cost per byte it moves (the bytes of its inputs and
outputs, as :func:`fsdp_compile.planning.cost.node_cost` counts them): ``HostCPU.copy_kernels``.

Measured on a CPU only: on a GPU the copies are multi-tensor kernels the roofline prices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile.planning.calibration.compute import _cold_seconds, _sync_ranks
from fsdp_compile.planning.vocabulary import fit_two_points
from fsdp_compile.runtime import kernels

# (parameters, elements each) of the two buckets the line goes through
_MANY_SMALL, _FEW_LARGE = (64, 1 << 12), (4, 1 << 18)


def _moved_bytes(*values: Any) -> int:
    tensors: list[torch.Tensor] = []
    for value in values:
        tensors += list(value) if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors)


def _bucket_ops(count: int, numel: int, world: int, device: torch.device) -> dict[str, tuple[Any, Any]]:
    """Each copy op over a bucket of ``count`` 2-D parameters of ``numel`` elements (rows that
    split evenly over ``world``), as ``{name: (run it, its inputs)}``."""
    shapes = [(world * 8, numel // (world * 8))] * count
    padded = [numel // world] * count
    dims, ranks = kernels.flatten_shapes(shapes)
    shards = [torch.randn(p, device=device) for p in padded]
    gathered = torch.randn(sum(padded) * world, device=device)
    grads = [torch.randn(shape, device=device) for shape in shapes]
    return {
        "copy_in": (lambda: kernels.copy_in(shards, padded, torch.float32), shards),
        "copy_out": (lambda: kernels.copy_out(gathered, world, padded, dims, ranks), gathered),
        "chunk_cat": (lambda: kernels.chunk_cat(grads, world, padded, torch.float32), grads),
    }


def _copy_kernels(group: Any, device: torch.device, repeats: int,
                  share: float = 1.0) -> dict[str, tuple[float, float]]:
    """``{op: (seconds per parameter, seconds per byte moved)}`` for the three copy ops, on a
    CPU (``{}`` elsewhere), each timed with cold caches (:func:`.compute._cold_seconds`)."""
    if device.type != "cpu":
        return {}
    world = max(dist.get_world_size(group) if dist.is_initialized() else 1, 2)
    points: dict[str, list[tuple[int, int, float]]] = {"copy_in": [], "copy_out": [], "chunk_cat": []}
    for count, numel in (_MANY_SMALL, _FEW_LARGE):
        ops = _bucket_ops(count, numel, world, device)
        for name, (op, inputs) in ops.items():
            moved = _moved_bytes(inputs, op())
            _sync_ranks(group, share)
            points[name].append((count, moved, _cold_seconds(op, repeats, device, share)))
    return {name: fit_two_points(*pair) for name, pair in points.items()}
