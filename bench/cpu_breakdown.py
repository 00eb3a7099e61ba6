"""Where a sharded step's CPU time goes, against the same model trained by one process.

    python bench/cpu_breakdown.py            # GPT d_model 256, 4 layers, batch 4 x 128, aot_eager
    python bench/cpu_breakdown.py --smoke

The planner prices a step's compute from per-operator calibrations; on this machine its
compute for FULL_SHARD at world 2 equals what the unsharded model's step costs one process,
while the measured step is longer. This benchmark splits the difference. Three jobs:

* ``single x2``: the unsharded model compiled with ``aot_eager``, world 1, two jobs at once (so
  each has a core, as the two ranks of a world-2 job do, and shares the caches and memory as
  they do);
* ``FULL_SHARD``: the same model and per-rank batch through ``fsdp_compile`` at world 2 on plain
  gloo, with the plan's predicted compute for it.

Per job: the main thread's CPU time and wall time of forward (with the loss), backward and the
optimizer step (medians over the timed steps), and one profiled step's self time per operator
group (matmuls, copies, DTensor dispatch, issuing collectives, waiting for them). The profiler's
times are the thread's wall time inside each operator, so they include any time the thread
waited for a core. Writes ``<out>/cpu_breakdown.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "lab"))

from launch import rank_env, torchrun_command
from plain_loop import full_shard_prediction, gpt_job
from report_files import run_facts, write_report

GROUPS = {  # operator group -> names (prefix match) in the profiler's table
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product"),
    "copies": ("aten::copy_", "aten::cat", "aten::_to_copy", "fsdp_compile::copy_in", "fsdp_compile::copy_out",
               "fsdp_compile::chunk_cat"),
    "DTensor dispatch": ("PythonSubclass", "_FromTorchTensor", "_ToTorchTensor"),
    "issuing collectives": ("c10d::", "_c10d_functional::all_gather", "_c10d_functional::reduce_scatter",
                            "_c10d_functional::all_reduce"),
    "waiting for collectives": ("_c10d_functional::wait_tensor",),
}
PHASES = ("forward", "backward", "optimizer")


def _group(name: str) -> str:
    for group, prefixes in GROUPS.items():
        if name.startswith(prefixes):
            return group
    return "other"


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    import fsdp_compile
    from fsdp_compile.sharding.groups import end_process_group
    from fsdp_compile_lab import HostCPU

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, batch, build = gpt_job(args.smoke, vocab_size=512, n_layer=4)

    predicted = None
    if args.mode == "FULL_SHARD":
        cluster = fsdp_compile.Cluster.measure(device_memory=8 << 30, host=HostCPU)
        if rank == 0:
            predicted = full_shard_prediction(build, (batch, cfg.block_size), cluster, world)
        dist.barrier()
        backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
        model = backend.shard(build())
    else:
        backend, model = "aot_eager", build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen)

    def step() -> list[float]:
        marks = [(time.perf_counter(), time.thread_time())]
        loss = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
        marks.append((time.perf_counter(), time.thread_time()))
        loss.backward()
        marks.append((time.perf_counter(), time.thread_time()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append((time.perf_counter(), time.thread_time()))
        return [b[i] - a[i] for i in (0, 1) for a, b in itertools.pairwise(marks)]

    samples = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        timings = step()
        if i >= args.warmup:
            samples.append(timings)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    groups: dict[str, float] = {}
    for event in prof.key_averages():
        group = _group(event.key)
        groups[group] = groups.get(group, 0.0) + event.self_cpu_time_total / 1e6
    if rank == 0:
        med = [statistics.median(s[i] for s in samples) for i in range(6)]
        result = {"mode": args.mode, "world": world, "wall_s": dict(zip(PHASES, med[:3])),
                  "cpu_s": dict(zip(PHASES, med[3:])), "profiled_s": groups, "predicted": predicted,
                  "load_average": os.getloadavg()[0]}
        Path(args.part).write_text(json.dumps(result))
    end_process_group()


def _launch(mode: str, world: int, part: Path, args) -> subprocess.Popen:
    cmd = torchrun_command(world, str(Path(__file__).resolve()), "--part", str(part), "--mode", mode,
                           "--steps", str(args.steps), "--warmup", str(args.warmup),
                           *(["--smoke"] if args.smoke else []))
    print(" ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=rank_env())


def render(report: dict) -> str:
    jobs = report["jobs"]
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = ["# Where a sharded step's CPU time goes", "",
             f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; "
             f"{report['model']}, AdamW, `aot_eager`, the median of {report['steps']} steps after "
             f"{report['warmup']} warm-up steps. Produced by `python bench/cpu_breakdown.py`.", "",
             "| job | load | forward CPU / wall | backward CPU / wall | optimizer CPU / wall | step CPU | predicted compute |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for job in jobs:
        cpu = sum(job["cpu_s"].values())
        pred = job["predicted"]["compute_s"] if job.get("predicted") else None
        lines.append(f"| {job['name']} | {job['load_average']:.1f} | "
                     + " | ".join(f"{ms(job['cpu_s'][p])} / {ms(job['wall_s'][p])} ms" for p in PHASES)
                     + f" | {ms(cpu)} ms | {ms(pred) + ' ms' if pred else '-'} |")
    names = sorted({g for job in jobs for g in job["profiled_s"]}, key=lambda g: list(GROUPS).index(g)
                   if g in GROUPS else len(GROUPS))
    lines += ["", "One profiled step, self time per operator group (the thread's wall time inside the operators):", "",
              "| group | " + " | ".join(job["name"] for job in jobs) + " |",
              "| --- |" + " --- |" * len(jobs)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{ms(job['profiled_s'].get(name, 0.0))} ms" for job in jobs) + " |")
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--analysis", type=Path)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        worker(args)
        return
    jobs = []
    with tempfile.TemporaryDirectory() as tmp:
        parts = [Path(tmp) / f"single{i}.json" for i in range(2)]
        running = [_launch("single", 1, part, args) for part in parts]
        if any(proc.wait() for proc in running):
            raise SystemExit("a single-process job failed")
        for i, part in enumerate(parts):
            jobs.append({"name": f"single process ({i + 1} of 2 side by side)", **json.loads(part.read_text())})
        part = Path(tmp) / "sharded.json"
        if _launch("FULL_SHARD", 2, part, args).wait():
            raise SystemExit("the FULL_SHARD job failed")
        jobs.append({"name": "FULL_SHARD, world 2, rank 0", **json.loads(part.read_text())})
    model = ("GPT d_model 64, 2 layers, batch 2 x 32" if args.smoke else
             "GPT d_model 256, 4 layers, vocab 512, batch 4 x 128 per process")
    report = {**run_facts(), "model": model, "steps": args.steps,
              "warmup": args.warmup, "jobs": jobs, "analysis": args.analysis.read_text() if args.analysis else None}
    table = render(report)
    write_report(args.out, "cpu_breakdown_smoke" if args.smoke else "cpu_breakdown", report, table)
    print(table)


if __name__ == "__main__":
    main()
