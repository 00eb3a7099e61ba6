"""Copy-in (cast + pack shards into the all-gather buffer): our Triton kernel vs FSDP2 vs a plain copy.

    python bench/copy_in_kernel.py                      # on a CUDA device
    python bench/copy_in_kernel.py --smoke --out /tmp   # tiny sizes, any device (checks the script)

For 16, 64 and 256 parameters it times, in one run on one device:
  * ours: ``fsdp_compile::copy_in`` (one multi-tensor Triton launch, cast fused, padding written);
  * FSDP2: what ``fully_shard`` does per all-gather: each shard cast to the compute dtype
    (one kernel per parameter when casting), then ``torch.ops.fsdp.all_gather_copy_in``
    (one ``_foreach_copy_`` into the flat buffer);
  * the device's copy bandwidth: ``dst.copy_(src)`` of one large tensor (read + write).
``float8``: fp32 shards cast to float8_e4m3fn with a scale per parameter, as torchao's float8
all-gather casts them: ours is ``fsdp_compile::copy_in_float8`` (one launch, cast fused); FSDP2's is
torchao's ``hp_tensor_and_scale_to_float8`` per shard (what ``fsdp_pre_all_gather`` runs with a
precomputed scale), then ``all_gather_copy_in`` of the bytes.
Bandwidth counts bytes read plus bytes written. Results: JSON and a Markdown table in --out.
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from report_files import write_report

import fsdp_compile  # noqa: F401  (registers the ops)
from fsdp_compile.runtime import triton_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "float8": torch.float8_e4m3fn}


def shard_shapes(count: int, world: int, total_bytes: int, seed: int) -> list[tuple[int, ...]]:
    """Transformer-like shards: weight matrices, biases and norm vectors of mixed sizes."""
    rng = random.Random(seed)
    weights = [rng.uniform(0.2, 1.0) for _ in range(count)]
    scale = total_bytes / 4 / sum(weights)
    shapes = []
    for w in weights:
        numel = max(1, int(w * scale))
        cols = rng.choice([1, 64, 128, 256]) if numel > 4096 else 1
        rows = max(1, numel // cols)
        full_rows = rows * world - rng.randrange(world)  # some shards carry padding
        shapes.append((full_rows, cols) if cols > 1 else (full_rows,))
    return shapes


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def float8_copy_ins(shards, padded, chunks, world: int, rank: int, device: torch.device):
    """(ours, FSDP2 with torchao) for the float8 copy-in of ``shards`` (see the module docstring).
    Without torchao (a GPU machine may lack it), FSDP2's side runs the torch ops torchao's cast
    is made of, without its tensor subclass."""
    float8 = torch.float8_e4m3fn
    scales = torch.rand(len(shards), device=device) * 100 + 1
    total = sum(chunks)
    out = torch.empty(total * world, dtype=torch.uint8, device=device)
    largest = torch.finfo(float8).max
    try:
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            LinearMMConfig,
            hp_tensor_and_scale_to_float8,
        )

        config = LinearMMConfig()

        def cast(p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return hp_tensor_and_scale_to_float8(p, scale, float8, config, GemmInputRole.WEIGHT)._data
    except ImportError:
        def cast(p: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return (p.to(torch.float32) * scale).clamp(min=-largest, max=largest).to(float8)

    def ours():
        return torch.ops.fsdp_compile.copy_in_float8(shards, scales, chunks, torch.float32, float8)

    def fsdp2():
        data = [cast(p, scales[i]).view(torch.uint8) for i, p in enumerate(padded)]
        return torch.ops.fsdp.all_gather_copy_in(data, out, chunks, total, rank)

    return ours, fsdp2


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    world = args.world
    results = []
    copy_numel = args.copy_bytes // 4
    src = torch.randn(copy_numel, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, args.iters, args.warmup)
    copy_gbps = 2 * src.numel() * 4 / copy_s / 1e9
    for count in args.params:
        for name in args.dtypes:
            dtype = DTYPES[name]
            shapes = shard_shapes(count, world, args.total_bytes, seed=count)
            rank = world - 1  # the last rank holds the padded (or empty) shards
            padded, shards = [], []
            for shape in shapes:
                rows = -(-shape[0] // world)
                start = min(rank * rows, shape[0])
                length = min(start + rows, shape[0]) - start
                cols = math.prod(shape[1:])
                storage = torch.randn(rows, cols, device=device)  # FSDP2 keeps shards padded
                storage[length:] = 0  # with zeros in the padding
                padded.append(storage.view(-1))
                shards.append(storage[:length].view(length, *shape[1:]))
            chunks = [p.numel() for p in padded]
            total = sum(chunks)
            if name == "float8":
                ours, fsdp2 = float8_copy_ins(shards, padded, chunks, world, rank, device)
            else:
                out = torch.empty(total * world, dtype=dtype, device=device)

                def ours():
                    return torch.ops.fsdp_compile.copy_in(shards, chunks, dtype)

                def fsdp2():
                    inputs = padded if dtype == torch.float32 else [p.to(dtype) for p in padded]
                    return torch.ops.fsdp.all_gather_copy_in(inputs, out, chunks, total, rank)

            assert torch.equal(ours(), fsdp2()[0]), "ours and FSDP2 disagree"
            ours_s = timed(ours, device, args.iters, args.warmup)
            by_block = {}
            default_block = triton_kernels.BLOCK
            for block in args.blocks:  # elements per Triton program: a sweep for tuning BLOCK
                triton_kernels.BLOCK = block
                assert torch.equal(ours(), fsdp2()[0]), f"ours (BLOCK {block}) and FSDP2 disagree"
                by_block[block] = timed(ours, device, args.iters, args.warmup) * 1e6
            triton_kernels.BLOCK = default_block
            fsdp2_s = timed(fsdp2, device, args.iters, args.warmup)
            moved = total * 4 + total * dtype.itemsize  # read fp32 shards, write the buffer
            results.append({
                "params": count, "dtype": name, "buffer_mib": total * dtype.itemsize / 2**20,
                "ours_us": ours_s * 1e6, "fsdp2_us": fsdp2_s * 1e6,
                "ours_gbps": moved / ours_s / 1e9, "fsdp2_gbps": moved / fsdp2_s / 1e9,
                "ours_vs_copy_bandwidth": moved / ours_s / 1e9 / copy_gbps,
                "speedup_vs_fsdp2": fsdp2_s / ours_s,
                "ours_us_by_block": by_block,
            })
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "world": world, "copy_gbps": copy_gbps,
        "kernel": "triton" if device.type == "cuda" and triton_kernels.available() else "torch",
        "block": triton_kernels.BLOCK if triton_kernels.available() else None,
        "rows": results,
    }


def markdown(report: dict) -> str:
    lines = [
        f"Copy-in on {report['device']} (torch {report['torch']}, kernel: {report['kernel']}, BLOCK "
        f"{report.get('block')}); device copy bandwidth {report['copy_gbps']:.0f} GB/s (read + write). Each "
        "time is the median call, host work included (table, launch).",
        "",
        "| params | dtype | buffer MiB | ours µs | FSDP2 µs | ours GB/s | of copy bw | vs FSDP2 | ours µs by BLOCK |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        sweep = ", ".join(f"{b}: {us:.0f}" for b, us in r.get("ours_us_by_block", {}).items()) or "-"
        lines.append(
            f"| {r['params']} | {r['dtype']} | {r['buffer_mib']:.1f} | {r['ours_us']:.1f} | {r['fsdp2_us']:.1f} | "
            f"{r['ours_gbps']:.0f} | {r['ours_vs_copy_bandwidth']:.0%} | {r['speedup_vs_fsdp2']:.2f}x | {sweep} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--params", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "float8"], choices=sorted(DTYPES))
    p.add_argument("--blocks", type=int, nargs="*", default=[],
                   help="also time our kernel at these BLOCK sizes (elements per program), for tuning")
    p.add_argument("--world", type=int, default=8, help="ranks the shards come from (sets padding)")
    p.add_argument("--total-bytes", type=int, default=256 * 2**20, help="fp32 bytes of all full parameters")
    p.add_argument("--copy-bytes", type=int, default=512 * 2**20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script anywhere")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.smoke:
        args.total_bytes, args.copy_bytes, args.iters, args.warmup = 2**16, 2**16, 2, 1
    report = run(args)
    table = markdown(report)
    print(table)
    write_report(args.out, "copy_in_smoke" if args.smoke else f"copy_in_{args.device}", report, table)


if __name__ == "__main__":
    main()
