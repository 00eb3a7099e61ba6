"""One GPU, one process: fsdp_compile against FSDP2 + torch.compile and plain torch.compile.

    python bench/single_gpu_step.py                       # on a CUDA device
    python bench/single_gpu_step.py --smoke --out /tmp    # tiny, on the CPU with gloo (checks the script)

A GPT (8 layers, d_model 1024, 16 heads, sequence 1024, batch 8, vocabulary 50304), AdamW,
bf16 compute with fp32 parameters and gradient reduction, at world 1 (a one-rank NCCL group).
With one rank the collectives move nothing across a link: what this measures is everything
around them on a real GPU -- the compiled graphs (Inductor's Triton code, our copy-in kernel
fused with the cast), the runtime per step, compile time and peak memory -- against the peers
in the same process:

  plain        ``torch.compile(model)`` of the unsharded model under ``torch.autocast(bfloat16)``;
  fsdp2        torch's ``fully_shard`` per block and at the root (MixedPrecisionPolicy bf16 / fp32
               reduce, resharding after forward), then ``torch.compile`` (Inductor);
  fsdp_compile ``fsdp_compile.backend("FULL_SHARD", mixed_precision=bf16 / fp32 reduce)``, Inductor;
  fsdp_compile_nosched  the same with ``schedule=False`` (not run unless named): our collective
               schedule off, and with it Inductor's own peak-memory reordering back on, which the
               scheduled compile turns off to keep our order.

Step time: median of ``--steps`` steps after ``--warmup`` (the first compiles), each step timed
with CUDA events around forward, backward and the optimizer step. Compile time: the first
step's time minus the median step. Peak memory: ``torch.cuda.max_memory_allocated`` over the
timed steps, with what was allocated when the variant started in brackets; each step drops its
logits once the loss is computed, and each variant is collected before the next starts, so
neither counts in what runs after it. (The planner plans worlds of 2 or more: none is set
beside this one.) Writes JSON and a Markdown table to --out.

``--fake-world N`` runs rank 0 of N in torch's fake process group instead: each rank's shards,
gathered buffers and collectives are those of N ranks (a one-rank world has no collectives, so
nothing for a schedule to order), but no collective moves data, so the losses are meaningless
and the step time leaves out communication. What it measures is peak memory and the compute
around the collectives as the graphs order them.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from report_files import write_report

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.sharding.groups import end_process_group

VARIANTS = ("plain", "fsdp2", "fsdp_compile")
ALL_VARIANTS = (*VARIANTS, "fsdp_compile_nosched")


class Clock:
    """Seconds of a region of GPU work (CUDA events), or of wall time on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Clock:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0


def build(variant: str, base: torch.nn.Module, device: torch.device, compiler: str):
    """(model the optimizer steps, forward callable, autocast dtype or None)."""
    model = copy.deepcopy(base)
    bf16 = torch.bfloat16
    if variant == "plain":
        model.to(device)
        return model, torch.compile(model, backend=compiler), bf16
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        return model, torch.compile(model, backend=compiler), None
    if variant in ("fsdp_compile", "fsdp_compile_nosched"):
        backend = fsdp_compile.backend(
            "FULL_SHARD", compiler=compiler, schedule=variant == "fsdp_compile",
            mixed_precision=fsdp_compile.MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32))
        backend.shard(model)
        return model, torch.compile(model, backend=backend), None
    raise ValueError(variant)


def measure(variant: str, base: torch.nn.Module, cfg: GPTConfig, args: argparse.Namespace,
            device: torch.device) -> dict:
    cuda = device.type == "cuda"
    # What is allocated before this variant builds anything (the base model in a fake world):
    # part of its peak, the same for every variant.
    start_gib = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    model, forward, autocast_dtype = build(variant, base, device, args.compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    gen = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=gen).to(device)
               for _ in range(4)]
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
    for step in range(args.warmup + args.steps):
        if step == args.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        idx = batches[step % len(batches)]
        with Clock(device) as clock:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits = forward(idx[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))
            # Kept until the next step's forward returns, this step's logits (0.77 GiB at the
            # default sizes) would count in that forward's memory, which a training loop that
            # keeps only the loss does not pay.
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(clock.seconds)
        losses.append(loss.item())
    steady = statistics.median(times[args.warmup:])
    tokens = args.batch * cfg.block_size
    result = {
        "variant": variant, "step_ms": steady * 1e3,
        "step_ms_range": [min(times[args.warmup:]) * 1e3, max(times[args.warmup:]) * 1e3],
        "compile_s": times[0] - steady, "tokens_per_s": tokens / steady,
        "peak_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None),
        "start_gib": start_gib,
        "first_loss": losses[0], "last_loss": losses[-1],
    }
    del model, forward, opt, batches, loss  # the last loss holds its autograd graph (FSDP2: its hooks)
    torch._dynamo.reset()
    # Sharded models (ours and FSDP2's) live in reference cycles, which only the cycle
    # collector frees: without a collection here a model's parameters and optimizer state can
    # stay allocated into the next variant's timed steps, counted in that variant's peak, and
    # be freed in the middle of one of them.
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def markdown(report: dict) -> str:
    c = report["config"]
    fake = c.get("fake_world")
    world = (f"rank 0 of a fake world of {fake} (no collective moves data: losses of the sharded variants are "
             "meaningless, step times leave out communication)" if fake else
             f"world 1 ({report['backend']}): the collectives move nothing across a link")
    lines = [
        f"# One GPU: fsdp_compile vs FSDP2 + torch.compile vs plain torch.compile ({report['device']})", "",
        f"GPT {c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads, sequence {c['seq']}, batch "
        f"{c['batch']}, vocab {c['vocab']}; AdamW; bf16 compute, fp32 parameters; {world}; "
        f"{c.get('compiler', 'inductor')}; torch {report['torch']}, Triton {report['triton']}. Median of {c['steps']} "
        f"steps after {c['warmup']} warm-up steps (the first compiles); compile = first step - median step.", "",
        "| variant | step ms (min-max) | vs plain | vs FSDP2 | tokens/s | peak GiB (at start) | compile s "
        "| loss first -> last |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = {r["variant"]: r for r in report["rows"]}
    for r in report["rows"]:
        lo, hi = r["step_ms_range"]
        vs_plain, vs_fsdp2 = (f"{rows[peer]['step_ms'] / r['step_ms']:.2f}x" if peer in rows else "-"
                              for peer in ("plain", "fsdp2"))
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        if r.get("start_gib") is not None:
            peak += f" ({r['start_gib']:.2f})"
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} ({lo:.1f}-{hi:.1f}) | {vs_plain} | {vs_fsdp2} "
                     f"| {r['tokens_per_s']:.0f} | {peak} | {r['compile_s']:.1f} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    lines.append("")
    lines.append("Speed columns: the other variant's step time over this one's (above 1: this one is faster).")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=ALL_VARIANTS)
    p.add_argument("--smoke", action="store_true", help="tiny model on whatever device, to check the script")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--fake-world", type=int, default=0,
                   help="rank 0 of this many ranks in a fake process group (memory and compute only)")
    p.add_argument("--name", help="stem of the JSON and Markdown files (default single_gpu_step_<device>)")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab = 2, 32, 2, 16, 2, 67
        args.warmup, args.steps = 2, 2
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(cfg)
    if args.fake_world:
        base.to(device)  # a fake group names no device: the model's own says where to shard
    rows = []
    for variant in args.variants:
        rows.append(measure(variant, base, cfg, args, device))
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "backend": dist.get_backend(), "torch": torch.__version__,
        "triton": getattr(__import__("triton"), "__version__", "?"),
        "config": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                   "batch": args.batch, "vocab": args.vocab, "warmup": args.warmup, "steps": args.steps,
                   "compiler": args.compiler, "fake_world": args.fake_world},
        "rows": rows,
    }
    table = markdown(report)
    print(table)
    name = args.name or ("single_gpu_step_smoke" if args.smoke else f"single_gpu_step_{'cuda' if cuda else 'cpu'}")
    write_report(args.out, name, report, table)
    end_process_group(exit_process=True)


if __name__ == "__main__":
    main()
