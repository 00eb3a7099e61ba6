"""Triton copy kernels against the torch implementation, bit for bit.

On a machine without a GPU these run in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py). The interpreter's float32 -> bfloat16 cast truncates; the kernel rounds to nearest
even with integer arithmetic instead, so it matches torch on CPU and on GPU alike.
"""

from __future__ import annotations

import random

import pytest
import torch

from fsdp_compile.runtime import kernels, triton_kernels
from fsdp_compile.runtime.collectives import chunk_numels, shard_bounds

pytestmark = [
    pytest.mark.skipif(not triton_kernels.available(), reason="triton is not installed"),
    # The interpreter warns when a huge float32 becomes float16 infinity, as the cast should.
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (signed zeros count), except that any NaN equals any NaN.

    NaN payloads carry no meaning and torch itself is not consistent: its vectorized CPU cast
    to bfloat16 writes 0xFFFF, its scalar path 0x7FC0, CUDA 0x7FFF.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    same_bits = a.contiguous().view(int_type) == b.contiguous().view(int_type)
    return bool(torch.equal(a_nan, b_nan) and (same_bits | a_nan).all())


def tricky_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Random floats plus values where casts go wrong: ties, NaN, inf, subnormals, big numbers."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())
    specials = torch.tensor([
        1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8),  # bfloat16 ties: to even
        float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
        1e-40, -1e-40, 3e38, 65520.0, 1e-8,                    # subnormal, near bf16/fp16 limits
    ])
    k = min(n, len(specials))
    x[:k] = specials[:k]
    return x


def random_full_shapes(rng: random.Random, count: int) -> list[tuple[int, ...]]:
    shapes = []
    for _ in range(count):
        rows = rng.choice([1, 2, 3, 5, 7, 16, 33, 100, 1031])
        tail = rng.choice([(), (1,), (3,), (4, 5), (17,)])
        shapes.append((rows, *tail))
    return shapes


def fulls_for(shapes, dtype, gen) -> list[torch.Tensor]:
    return [tricky_values(int(torch.Size(s).numel()), gen).view(s).to(dtype).to(DEVICE) for s in shapes]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_copy_in(seed: int, world: int, dst_dtype: torch.dtype) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    shapes = random_full_shapes(rng, rng.randint(1, 12))
    fulls = fulls_for(shapes, torch.float32, gen)
    chunks = chunk_numels(shapes, world)
    for rank in range(world):  # the last ranks hold padded or empty shards
        shards = []
        for f in fulls:
            start, length = shard_bounds(f.shape[0], world, rank)
            shards.append(f[start:start + length])
        want = kernels.copy_in_reference(shards, chunks, dst_dtype)
        got = triton_kernels.copy_in(shards, chunks, dst_dtype)
        assert bits_equal(got, want), f"rank {rank}: shapes {shapes}"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float32, torch.float16),
])
def test_chunk_cat(seed: int, world: int, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> None:
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    shapes = random_full_shapes(rng, rng.randint(1, 12))
    grads = fulls_for(shapes, src_dtype, gen)
    chunks = chunk_numels(shapes, world)
    want = kernels.chunk_cat_reference(grads, world, chunks, dst_dtype)
    got = triton_kernels.chunk_cat(grads, world, chunks, dst_dtype)
    assert bits_equal(got, want), f"shapes {shapes}"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_out(seed: int, world: int, dtype: torch.dtype) -> None:
    rng, gen = random.Random(200 + seed), torch.Generator().manual_seed(200 + seed)
    shapes = random_full_shapes(rng, rng.randint(1, 12))
    chunks = chunk_numels(shapes, world)
    gathered = tricky_values(world * sum(chunks), gen).to(dtype).to(DEVICE)
    want = kernels.copy_out_reference(gathered, world, chunks, shapes)
    got = triton_kernels.copy_out(gathered, world, chunks, shapes)
    assert [tuple(g.shape) for g in got] == [tuple(s) for s in shapes]
    assert all(bits_equal(g, w) for g, w in zip(got, want)), f"shapes {shapes}"


def test_bfloat16_rounding_is_to_nearest_even() -> None:
    x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9], device=DEVICE)
    got = triton_kernels.copy_in([x], [3], torch.bfloat16)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even is 1. 1 + 3*2^-8 ties to 1 + 2^-6.
    assert got.tolist() == [1.0, 1.0 + 2 ** -6, 1.0]


def test_mixed_dtypes_in_one_launch_are_rejected() -> None:
    a = torch.zeros(4, device=DEVICE)
    b = torch.zeros(4, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="one source dtype"):
        triton_kernels.copy_in([a, b], [4, 4], torch.float32)


def test_kernels_env_forces_the_torch_path(monkeypatch) -> None:
    """The dispatch decision the copy ops make for a CUDA tensor (only the device's type is
    read, so it is checked without CUDA): Triton unless FSDP_COMPILE_KERNELS=torch."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("FSDP_COMPILE_KERNELS", raising=False)
    assert kernels._use_triton(cuda, torch.float32, torch.bfloat16)
    assert not kernels._use_triton(cpu, torch.float32, torch.bfloat16)  # CPU: always torch
    for value in ("torch", "Torch"):
        monkeypatch.setenv("FSDP_COMPILE_KERNELS", value)
        assert not kernels._use_triton(cuda, torch.float32, torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernels_never_make_the_host_wait_for_the_gpu() -> None:
    """A host sync per launch would stop the CPU running ahead of the GPU: every bucket's copy
    would wait for all the work queued before it. torch's sync debug mode raises on one."""
    shapes, world = [(33, 4), (7,), (100, 17)], 4
    chunks = chunk_numels(shapes, world)
    fulls = [torch.randn(s, device="cuda") for s in shapes]
    bounds = [shard_bounds(f.shape[0], world, 1) for f in fulls]  # rank 1's shards
    shards = [f[start:start + length] for f, (start, length) in zip(fulls, bounds)]

    def launches() -> None:
        triton_kernels.copy_in(shards, chunks, torch.bfloat16)
        triton_kernels.chunk_cat(fulls, world, chunks, torch.float32)
        triton_kernels.copy_out(torch.randn(world * sum(chunks), device="cuda"), world, chunks, shapes)

    launches()  # compiles the kernels
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            launches()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def float8_edge_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, the midpoints between neighbours (ties: to even) and
    values just off them, beyond the largest (saturation), and NaN, both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20),
                        torch.tensor([449.0, 464.0, 500.0, 1e30, float("inf"), float("nan"), 2 ** -12, 2 ** -10])])
    return torch.cat([values, -values])


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # 1e30 * scale: inf
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("src_dtype,dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_float8_copy_in(seed: int, world: int, src_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """The cast of float8 weights' shards into the gather buffer: rounded to the compute dtype,
    scaled, saturated and rounded to float8 as torchao's cast does, bit for bit."""
    rng, gen = random.Random(300 + seed), torch.Generator().manual_seed(300 + seed)
    shapes = random_full_shapes(rng, rng.randint(1, 8))
    fulls = fulls_for(shapes, src_dtype, gen)
    edges = float8_edge_values().to(src_dtype)
    fulls[0].view(-1)[:edges.numel()] = edges[:fulls[0].numel()]
    # Scales as the gather computes them, and 1.0 for the first weight (its edge values are
    # float8 values and midpoints as they are).
    scales = torch.stack([torch.tensor(1.0)] + [torch.exp2(torch.randint(-8, 8, ())) * (1 + torch.rand(()))
                                                 for _ in fulls[1:]]).to(DEVICE)
    chunks = chunk_numels(shapes, world)
    for rank in range(world):
        shards = []
        for f in fulls:
            start, length = shard_bounds(f.shape[0], world, rank)
            shards.append(f[start:start + length])
        want = kernels.copy_in_float8_reference(shards, scales, chunks, dtype, torch.float8_e4m3fn)
        got = triton_kernels.copy_in_float8(shards, scales, chunks, dtype, torch.float8_e4m3fn)
        nan = want.view(torch.float8_e4m3fn).float().isnan()
        assert torch.equal(got.view(torch.float8_e4m3fn).float().isnan(), nan), f"rank {rank}: NaNs differ"
        mismatch = (got != want) & ~nan
        assert not mismatch.any(), (f"rank {rank}: {int(mismatch.sum())} bytes differ, e.g. "
                                    f"{got[mismatch][:4].tolist()} for {want[mismatch][:4].tolist()}")
