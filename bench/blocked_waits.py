"""Where a plain-gloo step's main thread blocks in waits for collectives, and what was in flight.

    python bench/blocked_waits.py            # gpt_small (bench/plan_accuracy.py), world 2, plain gloo
    python bench/blocked_waits.py --smoke

The planner predicts a step's waits for collectives from each collective's calibrated time on
its link; on plain gloo at world 2 the main thread blocks 2-4x longer than it predicts
(``bench/results/plain_loop.md``, "Where a step goes"). This benchmark looks at the waits one
by one. One job at world 2 calibrates the cluster, then per strategy (FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD) trains a few steps and profiles ``--steps`` more with
``torch.profiler``. Per wait that blocks the main thread longer than 0.5 ms: the phase it falls
in (forward, backward, optimizer step), when (from the step's start), how long, and the gloo
collectives running meanwhile on gloo's threads, with their durations and the time the
calibration prices each of them at (``Cluster.measure()``'s fit for its kind and size). Per
strategy, against the plan: the blocked time per step, measured (the median profiled step of
the slowest rank) and predicted (the plan's waits: exposed communication minus the gloo CPU it
charges to compute). A profiled step runs slower than an unprofiled one (the profiler records
every operator of the main thread); ``plain_loop``'s unprofiled steps block as long. Writes
``<out>/blocked_waits.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "lab"))

from parts import parser, run_part
from report_files import run_facts, write_report

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
PHASES = ("forward", "backward", "optimizer")
BLOCKING = 0.5e-3  # a wait shorter than this found its collective done, or nearly
GLOO_EVENTS = ("gloo:all_gather", "gloo:all_reduce")


def _kind(event_name: str, strategy: str) -> str:
    """The functional collective behind a gloo event: gloo runs a reduce-scatter as an
    all-reduce of the whole buffer, and only NO_SHARD all-reduces of these strategies."""
    if event_name == "gloo:all_gather":
        return "all_gather"
    return "all_reduce" if strategy == "NO_SHARD" else "reduce_scatter"


def _priced_seconds(cluster, kind: str, elements: int, world: int) -> float:
    """The planner's time for a collective of ``kind`` over the world's ranks on one node, whose
    buffer (an all-gather's output, a reduce-scatter's input) holds ``elements`` float32 values."""
    from fsdp_compile.planning.cost import Group, collective_cost

    return collective_cost(kind, elements * 4, Group(world, 1), cluster).seconds


def _step_waits(events, world: int, cluster, strategy: str) -> dict:
    """The blocking waits of one profiled step (its phases are ``record_function`` ranges)."""
    def span(e) -> tuple[float, float]:
        return e.time_range.start / 1e6, e.time_range.end / 1e6

    phases = {e.name: span(e) for e in events if e.name in PHASES}
    start = min(a for a, _ in phases.values())
    gloo = []
    for e in events:
        if e.name in GLOO_EVENTS:
            dims = [d for d in (e.input_shapes or []) if d]
            elements = 1
            for d in (dims[0] if dims else []):
                elements *= d
            kind = _kind(e.name, strategy)
            if kind == "all_gather":  # gloo's event holds this rank's input: the buffer is world times it
                elements *= world
            gloo.append((*span(e), kind, elements))
    waits = []
    for e in events:
        if e.name != "_c10d_functional::wait_tensor":
            continue
        a, b = span(e)
        if b - a < BLOCKING:
            continue
        phase = next((name for name, (p, q) in phases.items() if p <= a <= q), "between")
        running = [{"kind": kind, "seconds": q - p, "priced_seconds": _priced_seconds(cluster, kind, n, world)
                    if n > 1 else None} for p, q, kind, n in gloo if p < b and q > a]
        waits.append({"phase": phase, "at_s": a - start, "blocked_s": b - a, "in_flight": running})
    return {"blocked_s": sum(w["blocked_s"] for w in waits), "waits": waits,
            "by_phase": {name: sum(w["blocked_s"] for w in waits if w["phase"] == name) for name in PHASES}}


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from plan_accuracy import gpt_small, gpt_tiny
    from torch.profiler import ProfilerActivity, profile, record_function

    import fsdp_compile
    from fsdp_compile.planning.cli import cross_entropy_loss
    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    build, (batch, seq) = (gpt_tiny, (2, 32)) if args.smoke else (gpt_small, (4, 128))
    from fsdp_compile_lab import HostCPU

    cluster = fsdp_compile.Cluster.measure(device_memory=8 << 30, host=HostCPU)
    tokens = torch.randint(0, build().cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))
    results = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        planned = fsdp_compile.plan(build(), (tokens,), cluster=cluster, loss_fn=cross_entropy_loss, world_size=world,
                                    strategies=[strategy], prefetch=(1,), memory_budget=8 << 30).row(strategy)
        backend = fsdp_compile.backend(strategy, compiler="aot_eager")
        torch.manual_seed(0)
        model = backend.shard(build())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        compiled = torch.compile(model, backend=backend)

        def step() -> None:
            with record_function("forward"):
                loss = F.cross_entropy(compiled(tokens).flatten(0, 1), tokens.flatten())
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            dist.barrier()
            step()
        steps = []
        for _ in range(args.steps):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                step()
            steps.append(_step_waits(prof.events(), world, cluster, strategy))
        everyone = [None] * world
        dist.all_gather_object(everyone, steps)
        # per step, the rank that blocked longest; then the median step of those
        slowest = [max((ranks[i] for ranks in everyone), key=lambda s: s["blocked_s"]) for i in range(args.steps)]
        median = sorted(slowest, key=lambda s: s["blocked_s"])[len(slowest) // 2]
        results[strategy] = {"measured": median, "predicted_waits_s": planned.exposed_comm_seconds
                             - (planned.backend_cpu_seconds or 0.0), "predicted_step_s": planned.step_seconds}
    if rank == 0:
        Path(args.part).write_text(json.dumps({"strategies": results, "load_average": os.getloadavg()[0]}))
    end_process_group()


def render(report: dict) -> str:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    lines = ["# Where a plain-gloo step blocks", "",
             f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; "
             f"{report['model']}, AdamW, `aot_eager`, plain gloo at world 2; the median of {report['steps']} "
             f"profiled steps (each the rank that blocked longest) after {report['warmup']} warm-up steps. "
             "Produced by `python bench/blocked_waits.py`.", "",
             "| strategy | blocked per step, measured | predicted waits | forward / backward / optimizer |",
             "| --- | --- | --- | --- |"]
    for name, r in report["strategies"].items():
        m = r["measured"]
        lines.append(f"| {name} | {ms(m['blocked_s'])} ms | {ms(r['predicted_waits_s'])} ms | "
                     + " / ".join(ms(m["by_phase"][p]) for p in PHASES) + " ms |")
    lines += ["", "Each wait that blocked more than 0.5 ms in that step, with the gloo collectives running "
              "meanwhile (measured / priced by the calibration):", "",
              "| strategy | phase | at | blocked | in flight |", "| --- | --- | --- | --- | --- |"]
    for name, r in report["strategies"].items():
        for w in r["measured"]["waits"]:
            flight = ", ".join(f"{c['kind']} {ms(c['seconds'])} / "
                               f"{ms(c['priced_seconds']) if c['priced_seconds'] is not None else '?'} ms"
                               for c in w["in_flight"]) or "none (the peer rank was late)"
            lines.append(f"| {name} | {w['phase']} | {ms(w['at_s'])} ms | {ms(w['blocked_s'])} ms | {flight} |")
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parser(__doc__, steps=5, warmup=4).parse_args()
    if args.part:
        worker(args)
        return
    job = run_part(__file__, args)
    model = "gpt_tiny, batch 2 x 32" if args.smoke else "gpt_small (d_model 256, 4 layers), batch 4 x 128 per rank"
    report = {**run_facts(), "model": model, "steps": args.steps,
              "warmup": args.warmup, **job, "analysis": args.analysis.read_text() if args.analysis else None}
    table = render(report)
    write_report(args.out, "blocked_waits_smoke" if args.smoke else "blocked_waits", report, table)
    print(table)


if __name__ == "__main__":
    main()
