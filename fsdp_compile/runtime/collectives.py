"""The one definition of what gathering parameters and reducing gradients means.

The eager runtime (the markers' implementations) and the compiled path (passes that replace
markers by the traced body of these functions) both call them, so the two agree bit for bit;
they use functional collectives, the copy ops of :mod:`.kernels` and out-of-place torch ops
only, so that they trace as they are. The layout is FSDP2's: a parameter's dim 0 is cut into
``world`` chunks of ``padded_rows(rows, world)`` rows (zero-padded tail), and a bucket's buffer
holds, per rank, that rank's chunks of every parameter back to back.
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
    """How one parameter is communicated; travels as the markers' last argument (:meth:`op_args`).

    ``dim0_sharded``: False for a parameter kept whole though the strategy shards (a 0-d tensor):
    not gathered, its gradient all-reduced. ``compute_device``: under CPU offload, where the shard
    is copied to be gathered (its reduced gradient comes back to the host). ``reshard_size`` and
    ``reshard_group``: backward gathers inside groups of that many ranks (``reshard_after_forward=n``).
    ``float8``: a torchao float8 weight's gather moves that dtype, scaled as ``Float8Linear`` scales
    it (``float8_pow2_scale``: its ``round_scales_to_power_of_2``).
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
        """The spec of backward's gather from the shards kept over ``reshard_group`` (nothing to cast)."""
        return dataclasses.replace(self, shard_group=self.reshard_group, shard_size=self.reshard_size,
                                   replicate_group="", replicate_size=1, param_dtype=None, reduce_dtype=None,
                                   compute_device=None, reshard_group="", reshard_size=0, float8=None,
                                   float8_pow2_scale=False)

    def for_reduction(self) -> CommSpec:
        """Without the float8 cast, which only a gather reads: the gradient buckets with its unit's."""
        return dataclasses.replace(self, float8=None, float8_pow2_scale=False)

    def op_args(self) -> tuple[str]:
        """The markers' trailing argument: one string ``"shard_group=0;shard_size=2;..."``, not one
        argument per field, as Dynamo and AOTAutograd handle every argument of every marker."""
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
# How each field type of CommSpec reads back from its text (str: as it is).
_SPEC_PARSERS = {"int": int, "bool": lambda raw: raw == "True",
                 "torch.dtype | None": lambda raw: None if raw == "None" else getattr(torch, raw),
                 "str | None": lambda raw: None if raw == "None" else raw}


@functools.cache
def _decode_spec(text: str) -> CommSpec:
    # Cached: the fake and eager implementations decode it at every marker call.
    values = dict(part.partition("=")[::2] for part in text.split(_SPEC_SEP))
    kwargs: dict[str, object] = {}
    for f in fields(CommSpec):
        if f.name not in values:
            raise ValueError(f"marker spec {text!r} lacks {f.name}")
        kwargs[f.name] = _SPEC_PARSERS.get(str(f.type), str)(values[f.name])
    return CommSpec(**kwargs)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


def _to_compute_device(shard: torch.Tensor, device: str) -> torch.Tensor:
    """CPU offload's host-to-device copy of a shard. The aten op, not ``Tensor.to``, which would
    initialize the device's runtime: tracing for a device the host lacks cannot (tests/test_offload.py)."""
    target = torch.device(device)
    if shard.device == target:
        return shard
    return torch.ops.aten._to_copy.default(shard, device=target, non_blocking=True)


def chunk_numels(full_shapes: Sequence[Sequence[int]], world: int) -> list[int]:
    """Elements of one rank's (padded) chunk of each tensor."""
    return [padded_rows(shape[0], world) * math.prod(shape[1:]) for shape in full_shapes]


def gather_params(shards: Sequence[torch.Tensor], full_shapes: Sequence[Sequence[int]],
                  spec: CommSpec) -> list[torch.Tensor]:
    """Full parameters from this rank's shards of one bucket: copy-in, one all-gather, copy-out
    (those not gathered as a fresh copy in the compute dtype, never an alias of the shard)."""
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
    """A bucket of torchao float8 weights: one all-reduce of the amaxes, the shards cast to float8,
    one all-gather of the bytes, each weight back in ``dtype``. Scale, cast and way back are
    torchao's, so ``Float8Linear`` recasts the gathered weight to these same float8 values."""
    amax = _wait(_c10d.all_reduce(_copy_ops.amax_in(list(shards), dtype), "max", spec.shard_group))
    scales = float8_scales(amax, spec.float8, spec.float8_pow2_scale)
    flat = _copy_ops.copy_in_float8(list(shards), scales, chunks, dtype, spec.float8)
    gathered = _wait(_c10d.all_gather_into_tensor(flat, spec.shard_size, spec.shard_group))
    return list(_copy_ops.copy_out_float8(gathered, scales, spec.shard_size, chunks, *flatten_shapes(full_shapes),
                                          spec.float8, dtype))


def float8_scales(amax: torch.Tensor, float8: torch.dtype, pow2: bool) -> torch.Tensor:
    """torchao's tensorwise scales of weights with these amaxes (float32)."""
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(amax, float8, round_scales_to_power_of_2=pow2)


def divide_factors(reduce_dtype: torch.dtype, data_parallel_size: int) -> tuple[float | None, float | None]:
    """(pre, post) divisors around a summing reduction, or (None, None) to average: FSDP2's rule,
    which for float16 divides by about sqrt(N) before and the rest after, so nothing overflows."""
    if reduce_dtype in _AVG_SAFE_DTYPES:
        return None, None
    pre = 1
    while data_parallel_size % pre == 0 and data_parallel_size / pre > pre:
        pre *= 2
    return float(pre), data_parallel_size / pre


def reduce_grads(grads: Sequence[torch.Tensor], local_rows: Sequence[int], grad_dtypes: Sequence[torch.dtype],
                 spec: CommSpec) -> list[torch.Tensor]:
    """Gradients of this rank's shards, averaged over data-parallel ranks: a reduce-scatter (an
    all-reduce if not sharded) in the shard group, then an all-reduce across replicas; each cast
    back to the parameter's dtype (and under CPU offload copied to the host)."""
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

    # Each shard gradient is a narrow and a view of the reduced buffer, not one as_strided: that
    # counts from the storage's start, which Inductor may move by reducing into a slice of a
    # larger buffer (every TP rank but the first then read another's rows; docs/design.md).
    sizes = [(n, *shape[1:]) for shape, n in zip(full_shapes, local_rows)] if spec.gathers else full_shapes
    pieces = chunks if spec.gathers else [math.prod(shape) for shape in full_shapes]
    outs, offset = [], 0
    for size, piece, dtype in zip(sizes, pieces, grad_dtypes):
        outs.append(flat.narrow(0, offset, math.prod(size)).view(size).to(dtype))
        offset += piece
    if spec.compute_device is not None:
        outs = [o.to("cpu") for o in outs]
    return outs
