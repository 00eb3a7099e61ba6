"""The one definition of what gathering parameters and reducing gradients means.

Both the eager runtime (the implementations of the ``unshard`` / ``reduce_grad`` markers) and
the compiled path (passes that replace markers by the traced body of these functions) call the
functions here, so eager and compiled runs perform the same operations in the same order and
agree bit for bit.

Everything is written with functional collectives (``torch.ops._c10d_functional``), the copy
ops of :mod:`fsdp_compile.runtime.kernels` and out-of-place torch ops, so these functions can
be traced into a graph as they are.

Data layout follows FSDP2: a parameter with ``rows`` rows on dim 0 is cut into ``world`` chunks
of ``padded_rows(rows, world)`` rows (``torch.chunk`` semantics; the tail is zero padding), and a
bucket's all-gather buffer holds, per rank, that rank's padded chunks of every parameter back to
back. The reduce-scatter buffer uses the same layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from .kernels import flatten_shapes  # importing kernels also registers the copy ops

_c10d = torch.ops._c10d_functional
_copy_ops = torch.ops.fsdp_compile

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
    """How one parameter is communicated; travels as the markers' last argument, one string of
    ``field=value`` pairs (see :meth:`op_args`).

    ``dim0_sharded`` is False for a parameter kept whole on every rank even though the strategy
    shards (a 0-d tensor): it is not gathered, and its gradient is all-reduced over the shard
    group instead of reduce-scattered.

    ``compute_device`` is set under CPU offload: the shard lives in host memory, is copied to
    that device to be gathered, and its reduced gradient is copied back to the host.

    ``reshard_size`` (with ``reshard_group``) is set for a parameter whose unit reshards after
    forward to groups of that many ranks of the shard group (``reshard_after_forward=n``):
    backward gathers it inside ``reshard_group`` (sharding/reshard_policy.py).

    ``float8`` (a float8 dtype) is set for a torchao float8 weight (sharding/float8_gather.py): its
    gather moves that dtype, scaled as ``Float8Linear`` scales it (``float8_pow2_scale``: its
    ``round_scales_to_power_of_2``), and returns it in the compute dtype.
    """

    shard_group: str
    shard_size: int
    dim0_sharded: bool
    replicate_group: str
    replicate_size: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    compute_device: str | None = None
    reshard_group: str = ""
    reshard_size: int = 0
    float8: torch.dtype | None = None
    float8_pow2_scale: bool = False

    def resharded(self) -> CommSpec:
        """The spec of the gather backward makes from the shards kept over ``reshard_group``:
        the gathered parameter's dtype already, nothing else to cast or copy."""
        return dataclasses.replace(self, shard_group=self.reshard_group, shard_size=self.reshard_size,
                                   replicate_group="", replicate_size=1, param_dtype=None, reduce_dtype=None,
                                   compute_device=None, reshard_group="", reshard_size=0, float8=None,
                                   float8_pow2_scale=False)

    def for_reduction(self) -> CommSpec:
        """This spec without what only a gather reads (the float8 cast): a float8 weight's
        gradient reduces like its unit's other gradients, in one bucket with them."""
        return dataclasses.replace(self, float8=None, float8_pow2_scale=False)

    def op_args(self) -> tuple[str]:
        """The markers' trailing arguments (see markers.py): one string naming every field,
        ``"shard_group=0;shard_size=2;...;compute_device=None"``.

        One argument rather than one per field: Dynamo and AOTAutograd handle every argument
        of every marker (a proxy, a guard source, the custom op's autograd layer), and a deep
        model has a marker per parameter read.
        """
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            text = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)
            if isinstance(value, str) and (_SPEC_SEP in value or "=" in value):
                raise ValueError(f"CommSpec.{f.name}={value!r}: a marker cannot carry {_SPEC_SEP!r} or '=' here")
            parts.append(f"{f.name}={text}")
        return (_SPEC_SEP.join(parts),)

    @staticmethod
    def from_op_args(*args: str) -> CommSpec:
        """The spec that :meth:`op_args` wrote."""
        if len(args) != 1 or not isinstance(args[0], str):
            raise ValueError(f"a marker's spec is one string of field=value pairs, got {args!r}")
        return _decode_spec(args[0])

    @property
    def gathers(self) -> bool:
        return self.dim0_sharded and self.shard_size > 1

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype or param_dtype

    @property
    def gathers_float8(self) -> bool:
        return self.gathers and self.float8 is not None

    def gather_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype the all-gather moves (float8 travels as bytes)."""
        return torch.uint8 if self.gathers_float8 else self.compute_dtype(param_dtype)

    def grad_reduce_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        # FSDP2's default: reduce in the compute dtype unless told otherwise.
        return self.reduce_dtype or self.param_dtype or grad_dtype


_SPEC_SEP = ";"


@functools.cache
def _decode_spec(text: str) -> CommSpec:
    # Cached: the fake and eager implementations decode it at every marker call.
    values = dict(part.partition("=")[::2] for part in text.split(_SPEC_SEP))
    kwargs: dict[str, object] = {}
    for f in fields(CommSpec):
        if f.name not in values:
            raise ValueError(f"marker spec {text!r} lacks {f.name}")
        raw, kind = values[f.name], str(f.type)
        if kind == "int":
            kwargs[f.name] = int(raw)
        elif kind == "bool":
            kwargs[f.name] = raw == "True"
        elif kind == "torch.dtype | None":
            kwargs[f.name] = None if raw == "None" else getattr(torch, raw)
        elif kind == "str | None":
            kwargs[f.name] = None if raw == "None" else raw
        else:
            kwargs[f.name] = raw
    return CommSpec(**kwargs)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _to_compute_device(shard: torch.Tensor, device: str) -> torch.Tensor:
    """CPU offload's host-to-device copy of a shard (nothing if it is there already).

    From pinned host memory the copy is asynchronous and ordered before the gather. The aten op
    rather than ``Tensor.to``: ``Tensor.to`` first initializes the device's runtime, which
    tracing with fake tensors of a device the host lacks cannot do (tests/test_offload.py
    compiles for a CUDA compute device on a CPU-only machine that way).
    """
    target = torch.device(device)
    if shard.device == target:
        return shard
    return torch.ops.aten._to_copy.default(shard, device=target, non_blocking=True)


def chunk_numels(full_shapes: Sequence[Sequence[int]], world: int) -> list[int]:
    """Elements of one rank's (padded) chunk of each tensor."""
    return [padded_rows(shape[0], world) * math.prod(shape[1:]) for shape in full_shapes]


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
    if spec.compute_device is not None:
        shards = [_to_compute_device(s, spec.compute_device) for s in shards]
    if not spec.gathers:
        return [s.to(dtype, copy=True) for s in shards]
    chunks = chunk_numels(full_shapes, spec.shard_size)
    if spec.gathers_float8:
        return _gather_float8(shards, full_shapes, chunks, dtype, spec)
    flat = _copy_ops.copy_in(list(shards), chunks, dtype)
    gathered = _wait(_c10d.all_gather_into_tensor(flat, spec.shard_size, spec.shard_group))
    return list(_copy_ops.copy_out(gathered, spec.shard_size, chunks, *flatten_shapes(full_shapes)))


def _gather_float8(shards: Sequence[torch.Tensor], full_shapes: Sequence[Sequence[int]], chunks: list[int],
                   dtype: torch.dtype, spec: CommSpec) -> list[torch.Tensor]:
    """The float8 gather of a bucket of torchao float8 weights: one all-reduce of every
    weight's amax, then the shards cast to float8 into the gather buffer, one all-gather of
    the bytes, and each weight back in the compute dtype ``dtype``.

    The scale is the one ``Float8Linear`` computes for the weight it is handed in the compute
    dtype (torchao's ``amax_to_scale`` of the amax of the weight in that dtype: the max over
    ranks of each shard's, which rounding to ``dtype`` keeps). The cast and the way back are
    torchao's, so ``Float8Linear`` recasts the gathered weight to these same float8 values
    (docs/mixed-precision.md).
    """
    amax = _wait(_c10d.all_reduce(_copy_ops.amax_in(list(shards), dtype), "max", spec.shard_group))
    scales = float8_scales(amax, spec.float8, spec.float8_pow2_scale)
    flat = _copy_ops.copy_in_float8(list(shards), scales, chunks, dtype, spec.float8)
    gathered = _wait(_c10d.all_gather_into_tensor(flat, spec.shard_size, spec.shard_group))
    return list(_copy_ops.copy_out_float8(gathered, scales, spec.shard_size, chunks, *flatten_shapes(full_shapes),
                                          spec.float8, dtype))


def float8_scales(amax: torch.Tensor, float8: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao's tensorwise scales of weights with these amaxes (float32): the float8 dtype's
    largest value over the amax, computed in float64 as torchao does."""
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(amax, float8, round_scales_to_power_of_2=pow2)


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


def reduce_grads(
    grads: Sequence[torch.Tensor],
    local_rows: Sequence[int],
    grad_dtypes: Sequence[torch.dtype],
    spec: CommSpec,
) -> list[torch.Tensor]:
    """Gradients of this rank's shards: the average over data-parallel ranks of the full gradients.

    Sharded parameters: one reduce-scatter in the shard group; replicated ones (or NO_SHARD):
    an all-reduce in the shard group; then, with replicas, one all-reduce across them. Each
    result is cast back to the parameter's dtype (and, under CPU offload, copied to the host).
    """
    reduce_dtype = spec.grad_reduce_dtype(grads[0].dtype)
    pre, post = divide_factors(reduce_dtype, spec.shard_size * spec.replicate_size)
    op = "avg" if pre is None else "sum"
    full_shapes = [g.shape for g in grads]

    if spec.gathers:
        chunks = chunk_numels(full_shapes, spec.shard_size)
        flat = _copy_ops.chunk_cat(list(grads), spec.shard_size, chunks, reduce_dtype)
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

    # Each shard gradient is a view of the reduced buffer at its offset (as FSDP2 takes them):
    # a narrow and a view, both relative to the buffer. Not one as_strided: its offset counts
    # from the start of the storage, which Inductor may change by reducing in place into a slice
    # of a larger buffer (NO_SHARD's all-reduce of one TP-local gradient did, and every tp rank
    # but the first read another rank's rows; docs/design.md).
    sizes = [(n, *shape[1:]) for shape, n in zip(full_shapes, local_rows)] if spec.gathers else full_shapes
    pieces = chunks if spec.gathers else [math.prod(shape) for shape in full_shapes]
    outs, offset = [], 0
    for size, piece, dtype in zip(sizes, pieces, grad_dtypes):
        outs.append(flat.narrow(0, offset, math.prod(size)).view(size).to(dtype))
        offset += piece
    if spec.compute_device is not None:
        outs = [o.to("cpu") for o in outs]
    return outs
