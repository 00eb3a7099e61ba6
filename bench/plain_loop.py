"""A user's own training loop against the plan: where the time the planner does not predict goes.

    python bench/plain_loop.py                 # 4 runs (fresh jobs), world 2, plain gloo
    python bench/plain_loop.py --runs 2 --smoke

The loop is what a user writes, not ``compare``: a GPT (d_model 256, 6 layers, vocab 1024),
batch 4 x 128 per rank, AdamW, ``fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")``, the
median of 6 steps after 2 warm-up steps, Python's garbage collector left as it is. Each run is a
fresh torchrun job that first calls ``Cluster.measure()`` and ``plan()`` for the same step, so
the spread of the calibration from run to run is part of what is measured.

Per step, each rank records: wall time, split into forward (with the loss), backward and the
optimizer step; the time Python's collector spent in collections (``gc.callbacks``) and which
generations ran; and the main thread's CPU time. The report sets, per run, the measured median
against the prediction beside that split and the run's calibration (matmul FLOP/s, per-operator
overhead, all-gather bandwidth), so the spread from run to run can be put on the collector, on
the calibration, or on neither. Writes ``<out>/plain_loop.json`` and ``.md``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "lab"))

from parts import parser, run_part
from report_files import run_facts


def full_shard_prediction(build, tokens_shape: tuple[int, int], cluster, world: int) -> dict:
    """The plan's FULL_SHARD row (prefetch 1, an 8 GiB budget) for a GPT from ``build()`` fed
    token batches of ``tokens_shape``: step, compute, communication and exposed seconds."""
    import fsdp_compile
    from fsdp_compile.planning.cli import cross_entropy_loss

    example = (torch.zeros(*tokens_shape, dtype=torch.long),)
    row = fsdp_compile.plan(build(), example, cluster=cluster, loss_fn=cross_entropy_loss, world_size=world,
                            strategies=["FULL_SHARD"], prefetch=(1,), memory_budget=8 << 30).row("FULL_SHARD")
    return {"step_s": row.step_seconds, "compute_s": row.compute_seconds, "comm_s": row.comm_seconds,
            "exposed_s": row.exposed_comm_seconds, "backend_cpu_s": row.backend_cpu_seconds}


def gpt_job(smoke: bool, *, vocab_size: int, n_layer: int) -> tuple:
    """The benchmark jobs' GPT: d_model 256, 4 heads, sequence 128 and a batch of 4 per rank at
    ``vocab_size`` and ``n_layer`` (with ``smoke`` a tiny one). Returns (config, per-rank batch,
    ``build()``, which seeds and constructs it, so every build is the same model)."""
    from fsdp_compile.models.gpt import GPT, GPTConfig

    cfg = (GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, d_model=64) if smoke else
           GPTConfig(vocab_size=vocab_size, block_size=128, n_layer=n_layer, n_head=4, d_model=256))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    return cfg, 2 if smoke else 4, build


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import fsdp_compile
    from fsdp_compile.planning.cluster_numbers import cluster_numbers
    from fsdp_compile.planning.compare import thread_times
    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, batch, build = gpt_job(args.smoke, vocab_size=1024, n_layer=6)

    from fsdp_compile_lab import HostCPU

    cluster = fsdp_compile.Cluster.measure(device_memory=8 << 30, host=HostCPU)
    predicted = full_shard_prediction(build, (batch, cfg.block_size), cluster, world) if rank == 0 else None
    dist.barrier()

    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    model = backend.shard(build())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1 + rank)

    collections: list[tuple[int, float]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(on_gc)
    steps = []
    for _ in range(args.warmup + args.steps):
        data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen)
        x, y = data[:, :-1], data[:, 1:]
        dist.barrier()
        collections.clear()
        t0, c0, s0 = time.perf_counter(), time.thread_time(), thread_times()
        logits = compiled(x)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3, s3 = time.perf_counter(), thread_times()
        steps.append({"wall_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2,
                      "core_wait_s": s3.main_waiting - s0.main_waiting if s0 and s3 else None,
                      "cpu_s": time.thread_time() - c0, "gc_s": sum(d for _, d in collections),
                      "gc_generations": [g for g, _ in collections]})
    gc.callbacks.remove(on_gc)
    everyone = [None] * world
    dist.all_gather_object(everyone, steps)
    if rank == 0:
        timed = list(range(args.warmup, args.warmup + args.steps))
        # a step ends when its slowest rank ends
        per_step = [max(everyone[r][i]["wall_s"] for r in range(world)) for i in timed]
        result = {"predicted": predicted, "cluster": cluster_numbers(cluster), "steps": everyone,
                  "measured_step_s": statistics.median(per_step), "timed_steps_s": per_step,
                  "load": os.getloadavg()[0]}
        Path(args.part).write_text(json.dumps(result, default=str))
    end_process_group(exit_process=True)


def attribution(run: dict, warmup: int) -> dict:
    """Medians over the timed steps of rank 0 and the largest rank."""
    def med(key: str) -> float:
        return statistics.median(max(rank[i][key] for rank in run["steps"]) for i in range(warmup, len(run["steps"][0])))

    gc_steps = sum(any(rank[i]["gc_s"] > 0 for rank in run["steps"]) for i in range(warmup, len(run["steps"][0])))
    gc_max = max(max(rank[i]["gc_s"] for rank in run["steps"]) for i in range(warmup, len(run["steps"][0])))
    return {"forward_s": med("forward_s"), "backward_s": med("backward_s"), "optimizer_s": med("optimizer_s"),
            "cpu_s": med("cpu_s"), "gc_s_median": med("gc_s"), "gc_s_max": gc_max, "steps_with_gc": gc_steps,
            "split": step_split(run, warmup)}


def step_split(run: dict, warmup: int) -> dict | None:
    """Each rank's step three ways, the medians over the timed steps of the ranks' mean: the
    main thread's CPU, its wait for a core, and the rest of its wall time (blocked in waits for
    collectives). They add up to a rank's step; None without scheduler statistics."""
    ranks, steps = run["steps"], range(warmup, len(run["steps"][0]))
    if any(rank[i].get("core_wait_s") is None for rank in ranks for i in steps):
        return None

    def mean_over_ranks(i: int, part) -> float:
        return statistics.mean(part(rank[i]) for rank in ranks)

    parts = {"cpu_s": lambda s: s["cpu_s"], "core_wait_s": lambda s: s["core_wait_s"],
             "blocked_s": lambda s: s["wall_s"] - s["cpu_s"] - s["core_wait_s"]}
    return {name: statistics.median(mean_over_ranks(i, part) for i in steps) for name, part in parts.items()}


def render(report: dict) -> str:
    lines = ["# A plain training loop against the plan", "",
             (f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}. "
              f"{report['model']}; FULL_SHARD, aot_eager, plain gloo at world 2; the median of {report['steps']} "
              f"steps after {report['warmup']} warm-up steps, Python's collector left as it is. Each run is a fresh "
              "job: `Cluster.measure()`, `plan()`, then the loop. Produced by `python bench/plain_loop.py`."), "",
             "| run | load | predicted step | measured | measured / predicted | steps with a collection | "
             "collector per step (median / max) | forward / backward / optimizer | main-thread CPU | "
             "matmul GFLOP/s | op overhead | all-gather MB/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, run in enumerate(report["runs"], 1):
        a, c, p = run["attribution"], run["cluster"], run["predicted"]
        flops = c["peak_flops"].get("float32", 0) / 1e9
        ag = c["collectives"].get("all_gather", {}).get("bandwidth", 0) / 1e6
        lines.append(
            f"| {i} | {run['load']:.1f} | {p['step_s'] * 1e3:.0f} ms | {run['measured_step_s'] * 1e3:.0f} ms | "
            f"{run['measured_step_s'] / p['step_s']:.2f}x | {a['steps_with_gc']}/{report['steps']} | "
            f"{a['gc_s_median'] * 1e3:.1f} / {a['gc_s_max'] * 1e3:.1f} ms | {a['forward_s'] * 1e3:.0f} / "
            f"{a['backward_s'] * 1e3:.0f} / {a['optimizer_s'] * 1e3:.0f} ms | {a['cpu_s'] * 1e3:.0f} ms | "
            f"{flops:.1f} | {c['op_overhead'] * 1e6:.1f} us | {ag:.0f} |")
    ratios = [r["measured_step_s"] / r["predicted"]["step_s"] for r in report["runs"]]
    preds = [r["predicted"]["step_s"] * 1e3 for r in report["runs"]]
    meas = [r["measured_step_s"] * 1e3 for r in report["runs"]]
    lines += ["", (f"Measured / predicted: {min(ratios):.2f}x to {max(ratios):.2f}x. Predictions ranged "
                   f"{min(preds):.0f}-{max(preds):.0f} ms ({max(preds) / min(preds) - 1:.0%} apart) and "
                   f"measurements {min(meas):.0f}-{max(meas):.0f} ms ({max(meas) / min(meas) - 1:.0%} apart) "
                   "over the runs."), ""]
    splits = [(i, run["attribution"].get("split"), run["predicted"]) for i, run in enumerate(report["runs"], 1)]
    if any(split for _, split, _ in splits):
        lines += ["## Where a step goes", "",
                  "Per rank, measured against predicted: the main thread's CPU against the predicted compute "
                  "(graphs, optimizer, runtime), its wait for a core (held by gloo's threads or the other "
                  "rank) against the gloo CPU the plan charges to compute, and the rest of the step, where it "
                  "was blocked in waits for collectives, against the plan's waits. The medians over the timed "
                  "steps of the two ranks' mean, so the three add up to a rank's step.", "",
                  "| run | main-thread CPU / predicted compute | waiting for a core / predicted gloo CPU | "
                  "blocked / predicted waits | step / predicted |", "| --- | --- | --- | --- | --- |"]
        for i, split, p in splits:
            if not split:
                continue
            waits = p["exposed_s"] - (p.get("backend_cpu_s") or 0.0)
            cells = [(split["cpu_s"], p["compute_s"]), (split["core_wait_s"], p.get("backend_cpu_s") or 0.0),
                     (split["blocked_s"], waits), (sum(split.values()), p["step_s"])]
            lines.append(f"| {i} | " + " | ".join(f"{m * 1e3:.0f} / {q * 1e3:.0f} ms" for m, q in cells) + " |")
        lines.append("")
    if report.get("analysis"):
        lines += ["## Analysis", "", report["analysis"], ""]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, steps=6, warmup=2)
    p.add_argument("--runs", type=int, default=4)
    args = p.parse_args()
    if args.part:
        worker(args)
        return
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs}:", flush=True)
        run = run_part(__file__, args)
        run["attribution"] = attribution(run, args.warmup)
        print(f"  predicted {run['predicted']['step_s'] * 1e3:.0f} ms, measured {run['measured_step_s'] * 1e3:.0f} ms,"
              f" collector {run['attribution']['gc_s_median'] * 1e3:.1f} ms/step (max "
              f"{run['attribution']['gc_s_max'] * 1e3:.1f})", flush=True)
        runs.append(run)
    model = ("GPT d_model 64, 2 layers, batch 2 x 32" if args.smoke else
             "GPT d_model 256, 6 layers, vocab 1024, batch 4 x 128 per rank")
    report = {**run_facts(), "model": model, "steps": args.steps,
              "warmup": args.warmup, "runs": runs, "analysis": args.analysis.read_text() if args.analysis else None}
    name = "plain_loop_smoke" if args.smoke else "plain_loop"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / f"{name}.md").write_text(render(report))
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
