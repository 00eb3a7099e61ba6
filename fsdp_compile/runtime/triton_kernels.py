"""Multi-tensor copy kernels in Triton: one launch moves every tensor of a bucket.

Copy-in (one segment per shard), chunk-cat (one per gradient and rank) and copy-out (one per
parameter and rank) are all "segment copies": ``src_len`` elements from ``src[src_start:]`` into
``dst[dst_start:dst_start + dst_len]``, cast, the rest zero-filled. One int64 table describes the
segments; each program finds its own by binary search, so launches and the bytes sent per launch
do not grow with the tensors. bfloat16 conversions use integer arithmetic, so results equal
torch's casts on a GPU and in Triton's CPU interpreter (whose float casts truncate).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence

import torch

try:  # Triton is a dependency, but keep the torch path usable where it cannot import
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

BLOCK = 2048

_TL_DTYPES = {}
if tl is not None:
    _TL_DTYPES = {
        torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
        torch.float64: tl.float64,
    }

SUPPORTED_DTYPES = tuple(_TL_DTYPES)
# The float8 dtypes the float8 copy-in rounds to (bit arithmetic below); others use torch.
FLOAT8_DTYPES = (torch.float8_e4m3fn,)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _to_bfloat16_rne(x):
        # float32 -> bfloat16, round to nearest even, NaN kept quiet: integer arithmetic so the
        # interpreter (which truncates in its float cast) agrees with the GPU and with torch.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _from_bfloat16_exact(x):
        # bfloat16 -> float32 is exact: the bfloat16 bits are the float32's top half.
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _segment_of(pid, first_block, n_segments, SEARCH_STEPS: tl.constexpr):
        # A program's segment is the last one whose first block is at or before it: a binary
        # search over the first-block column, so no per-block table crosses to the device.
        lo = tl.zeros((), tl.int64)
        hi = lo + n_segments - 1
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            after = tl.load(first_block + mid) <= pid
            lo = tl.where(after, mid, lo)
            hi = tl.where(after, hi, mid - 1)
        return lo

    @triton.jit
    def _segment_copy_kernel(table, n_segments, SRC_DTYPE: tl.constexpr, DST_DTYPE: tl.constexpr,
                             WIDEN_FROM_BF16: tl.constexpr, ROUND_TO_BF16: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             SEARCH_STEPS: tl.constexpr):
        # The table holds one column per field (see segment_copy), n_segments long each.
        pid = tl.program_id(0).to(tl.int64)
        first_block = table + 6 * n_segments
        seg = _segment_of(pid, first_block, n_segments, SEARCH_STEPS)
        offset = (pid - tl.load(first_block + seg)) * BLOCK_SIZE
        src = tl.load(table + seg).to(tl.pointer_type(SRC_DTYPE))
        src_start = tl.load(table + n_segments + seg)
        src_len = tl.load(table + 2 * n_segments + seg)
        dst = tl.load(table + 3 * n_segments + seg).to(tl.pointer_type(DST_DTYPE))
        dst_start = tl.load(table + 4 * n_segments + seg)
        dst_len = tl.load(table + 5 * n_segments + seg)
        idx = offset + tl.arange(0, BLOCK_SIZE)
        values = tl.load(src + src_start + idx, mask=idx < src_len, other=0.0)
        if WIDEN_FROM_BF16:
            values = _from_bfloat16_exact(values)
        if ROUND_TO_BF16:
            values = _to_bfloat16_rne(values.to(tl.float32))
        else:
            values = values.to(DST_DTYPE)
        tl.store(dst + dst_start + idx, values, mask=idx < dst_len)


    @triton.jit
    def _to_float8_e4m3fn_bits(x):
        # float32 (already saturated to +-448) -> float8_e4m3fn bits, round to nearest even, in
        # integer arithmetic so Triton's interpreter agrees with the GPU and with torch.
        bits = x.to(tl.uint32, bitcast=True)
        sign = ((bits >> 24) & 0x80).to(tl.int32)
        magnitude = (bits & 0x7FFFFFFF).to(tl.int32)
        exponent = magnitude >> 23
        # Normal results (>= 2**-6): keep 3 mantissa bits, rebias the exponent from 127 to 7.
        normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
        # Subnormal results: the magnitude in units of 2**-9, rounded to an integer (8 is the
        # smallest normal, whose bits are 8 too).
        mantissa = (magnitude & 0x7FFFFF) | 0x800000
        shift = tl.minimum(141 - exponent, 31)
        kept = mantissa >> shift
        rest = mantissa - (kept << shift)
        half = 1 << (shift - 1)
        subnormal = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
        code = tl.where(exponent >= 121, normal, subnormal)
        code = tl.where(x != x, 0x7F, code)
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _float8_copy_in_kernel(
        table, scales, out, n_segments, SRC_DTYPE: tl.constexpr, WIDEN_FROM_BF16: tl.constexpr,
        ROUND_TO_BF16: tl.constexpr, LARGEST: tl.constexpr, BLOCK_SIZE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    ):
        # Columns: source pointer, source length, destination start (in ``out``), destination
        # length, scale index, first block.
        pid = tl.program_id(0).to(tl.int64)
        first_block = table + 5 * n_segments
        seg = _segment_of(pid, first_block, n_segments, SEARCH_STEPS)
        offset = (pid - tl.load(first_block + seg)) * BLOCK_SIZE
        src = tl.load(table + seg).to(tl.pointer_type(SRC_DTYPE))
        src_len = tl.load(table + n_segments + seg)
        dst_start = tl.load(table + 2 * n_segments + seg)
        dst_len = tl.load(table + 3 * n_segments + seg)
        scale = tl.load(scales + tl.load(table + 4 * n_segments + seg))
        idx = offset + tl.arange(0, BLOCK_SIZE)
        values = tl.load(src + idx, mask=idx < src_len, other=0.0)
        if WIDEN_FROM_BF16:
            values = _from_bfloat16_exact(values)
        values = values.to(tl.float32)
        if ROUND_TO_BF16:  # the compute dtype's rounding, before torchao's float32 scaling
            values = _from_bfloat16_exact(_to_bfloat16_rne(values))
        scaled = values * scale
        saturated = tl.where(scaled != scaled, scaled, tl.minimum(tl.maximum(scaled, -LARGEST), LARGEST))
        tl.store(out + dst_start + idx, _to_float8_e4m3fn_bits(saturated), mask=idx < dst_len)


class Segments:
    """Segment copies to run in one launch, kept as parallel columns (no object per segment:
    a bucket of hundreds of tensors is built every call, and the GPU waits for it).

    A segment copies ``src_len`` elements from ``src[src_start:]`` into
    ``dst[dst_start:dst_start + dst_len]``; tensors must be contiguous, all sources one dtype
    and all targets one dtype."""

    __slots__ = ("dst_len", "dst_ptr", "dst_start", "dtypes", "src_len", "src_ptr", "src_start", "tensors")

    def __init__(self) -> None:
        self.src_ptr: list[int] = []
        self.src_start: list[int] = []
        self.src_len: list[int] = []
        self.dst_ptr: list[int] = []
        self.dst_start: list[int] = []
        self.dst_len: list[int] = []
        self.tensors: list[torch.Tensor] = []  # what the pointers point into, for the checks
        self.dtypes: tuple[torch.dtype, torch.dtype] | None = None

    def add(self, src: torch.Tensor, src_start: int, src_len: int, dst: torch.Tensor, dst_start: int,
            dst_len: int) -> None:
        if dst_len <= 0:
            return
        self.src_ptr.append(src.data_ptr())
        self.src_start.append(src_start)
        self.src_len.append(max(0, min(src_len, dst_len)))
        self.dst_ptr.append(dst.data_ptr())
        self.dst_start.append(dst_start)
        self.dst_len.append(dst_len)
        if self.dtypes is None:
            self.dtypes = (src.dtype, dst.dtype)
        self.tensors += (src, dst)


def segment_copy(segments: Segments) -> None:
    """Run every segment copy in one kernel launch."""
    if triton is None:
        raise RuntimeError("the Triton kernels need the triton package; pip install triton")
    if segments.dtypes is None:
        return
    src_dtype, dst_dtype = segments.dtypes
    sources, targets = segments.tensors[0::2], segments.tensors[1::2]
    if any(t.dtype is not src_dtype for t in sources) or any(t.dtype is not dst_dtype for t in targets):
        raise ValueError("segment_copy needs one source dtype and one target dtype per launch")
    if not all(t.is_contiguous() for t in segments.tensors):
        raise ValueError("segment_copy needs contiguous tensors")
    if src_dtype not in _TL_DTYPES or dst_dtype not in _TL_DTYPES:
        raise TypeError(f"segment_copy supports {SUPPORTED_DTYPES}, got {src_dtype} -> {dst_dtype}")
    device = targets[0].device
    # One int64 table, one column per field (pointers, starts, lengths, each segment's first
    # block), sent to the device in one copy.
    first_blocks = list(itertools.accumulate((-(-n // BLOCK) for n in segments.dst_len), initial=0))
    # array.array packs Python ints about twice as fast as torch.tensor(list) does.
    columns = array.array("q", segments.src_ptr + segments.src_start + segments.src_len + segments.dst_ptr
                          + segments.dst_start + segments.dst_len + first_blocks[:-1])
    table = _to_device(torch.frombuffer(columns, dtype=torch.int64), device)
    converts = src_dtype != dst_dtype
    _segment_copy_kernel[(first_blocks[-1],)](
        table, len(segments.dst_len),
        SRC_DTYPE=_TL_DTYPES[src_dtype], DST_DTYPE=_TL_DTYPES[dst_dtype],
        WIDEN_FROM_BF16=converts and src_dtype is torch.bfloat16,
        ROUND_TO_BF16=converts and dst_dtype is torch.bfloat16, BLOCK_SIZE=BLOCK,
        SEARCH_STEPS=max(1, (len(segments.dst_len) - 1).bit_length()),
    )


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (host memory) on ``device`` without making the host wait for the device.

    torch copies pageable host memory to a GPU synchronously: the host would wait for every
    kernel queued before the copy, once per launch, and could no longer run ahead of the GPU
    (every bucket's copy-in, chunk-cat and copy-out would pay the whole queue's latency on the
    critical path). Pinned memory from torch's caching host allocator is copied
    asynchronously, and the allocator keeps the block until the copy has run.
    """
    if device.type == "cpu":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def copy_in(shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(sum(padded_numels), dtype=dtype, device=shards[0].device)
    segments, start = Segments(), 0
    for shard, padded in zip(shards, padded_numels):
        segments.add(shard.contiguous(), 0, shard.numel(), out, start, padded)
        start += padded
    segment_copy(segments)
    return out


def chunk_cat(grads: Sequence[torch.Tensor], world: int, padded_numels: Sequence[int],
              dtype: torch.dtype) -> torch.Tensor:
    total = sum(padded_numels)
    out = torch.empty(world * total, dtype=dtype, device=grads[0].device)
    segments, offset = Segments(), 0
    for grad, padded in zip(grads, padded_numels):
        grad = grad.contiguous()
        for rank in range(world):
            start = rank * padded
            segments.add(grad, start, grad.numel() - start, out, rank * total + offset, padded)
        offset += padded
    segment_copy(segments)
    return out


def copy_out(gathered: torch.Tensor, world: int, padded_numels: Sequence[int],
             shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    total = sum(padded_numels)
    outs = [torch.empty(shape, dtype=gathered.dtype, device=gathered.device) for shape in shapes]
    segments, offset = Segments(), 0
    for out, padded in zip(outs, padded_numels):
        numel = out.numel()
        for rank in range(world):
            start = rank * padded
            segments.add(gathered, rank * total + offset, padded, out, start, max(0, min(padded, numel - start)))
        offset += padded
    segment_copy(segments)
    return outs


def copy_in_float8(shards: Sequence[torch.Tensor], scales: torch.Tensor, padded_numels: Sequence[int],
                   dtype: torch.dtype, float8: torch.dtype) -> torch.Tensor:
    """The float8 copy-in (see kernels.copy_in_float8) in one launch: each shard rounded to
    ``dtype``, scaled, saturated and rounded to float8 into the byte buffer, padding zeroed."""
    if triton is None:
        raise RuntimeError("the Triton kernels need the triton package; pip install triton")
    if float8 not in FLOAT8_DTYPES:
        raise TypeError(f"copy_in_float8 rounds to {FLOAT8_DTYPES}, got {float8}")
    src_dtype = shards[0].dtype
    if src_dtype not in _TL_DTYPES or any(s.dtype is not src_dtype for s in shards):
        raise TypeError(f"copy_in_float8 needs shards of one dtype of {SUPPORTED_DTYPES}")
    out = torch.empty(sum(padded_numels), dtype=torch.uint8, device=shards[0].device)
    sources = [s.contiguous() for s in shards]
    starts = list(itertools.accumulate(padded_numels, initial=0))[:-1]
    lengths = [int(n) for n in padded_numels]
    first_blocks = list(itertools.accumulate((-(-n // BLOCK) for n in lengths), initial=0))
    columns = array.array("q", [s.data_ptr() for s in sources] + [s.numel() for s in sources] + starts + lengths
                          + list(range(len(sources))) + first_blocks[:-1])
    table = _to_device(torch.frombuffer(columns, dtype=torch.int64), out.device)
    scales = scales.to(torch.float32).contiguous()
    _float8_copy_in_kernel[(first_blocks[-1],)](
        table, scales, out, len(sources), SRC_DTYPE=_TL_DTYPES[src_dtype],
        WIDEN_FROM_BF16=src_dtype is torch.bfloat16,
        ROUND_TO_BF16=dtype is torch.bfloat16 and src_dtype is not torch.bfloat16,
        LARGEST=float(torch.finfo(float8).max), BLOCK_SIZE=BLOCK,
        SEARCH_STEPS=max(1, (len(sources) - 1).bit_length()),
    )
    return out
