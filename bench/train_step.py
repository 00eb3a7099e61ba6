"""Training-step benchmark: fsdp_compile against FSDP2, FSDP2 + torch.compile and DDP, repeated.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/train_step.py

A GPT (8 layers, d_model 256, sequence 128) on CPU with gloo at world 2. Every variant trains
the same model from the same weights on the same data with AdamW, in the same processes:

  fsdp_compile (FULL_SHARD, Inductor) with scheduling on, and with it off;
  torch FSDP2 ``fully_shard`` (per block + root, all resharding after forward as FULL_SHARD), eager;
  FSDP2 + ``torch.compile`` (Inductor; FSDP2's hooks stay eager, blocks compile);
  DDP, eager.

Every variant is built and warmed up (compiled) once, then measured in ``--rounds`` rounds. A
round takes ``--steps`` steps of every variant, interleaved one step at a time in the round's
order, which rotates by one each round (no variant always runs first or after the same
neighbour), so that the load of a shared machine, drifting over minutes, lands on every variant
alike. A variant's step time in a round is the median of its steps (max over ranks); the report
gives the median over rounds and the range (min-max over rounds), and every ratio is computed per
round, with its range. A comparison whose range includes 1.0 is reported as within noise.

Peak memory per rank: the resident training state (parameter shards, buffers, optimizer state)
plus the peak of bytes allocated during a profiled steady step, summed in the order the CPU
allocator reported them (on every thread). It is measured in every round, so the report shows
whether it repeats. Also per variant: tokens/s, compile time (warm-up steps minus steady steps,
one cold compile), the collectives per step as gloo runs them (count and bytes, from the
profiler), CPU time per step, and how much of gloo's running time overlapped compute.
Writes JSON and a Markdown table to --out; ``--smoke`` runs a tiny model for two steps.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from report_files import write_report
from rounds import fmt_ratio, fmt_spread, rotated, spread
from torch.profiler import ProfilerActivity, profile, record_function

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.planning.calibration.allocator import allocation_records, allocator_peak
from fsdp_compile.sharding.groups import end_process_group

COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::native_layer_norm",
               "aten::native_layer_norm_backward", "aten::gelu", "aten::gelu_backward",
               "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::embedding_dense_backward",
               "aten::_softmax", "aten::_log_softmax", "aten::_log_softmax_backward_data")


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total(intervals) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a, b) -> float:
    return sum(max(0.0, min(ae, be) - max(as_, bs)) for as_, ae in a for bs, be in b)


def build(variant: str, base: torch.nn.Module, world: int, compiler: str):
    """(model whose parameters the optimizer steps, callable for the forward)."""
    model = copy.deepcopy(base)
    if variant.startswith("fsdp_compile"):
        backend = fsdp_compile.backend("FULL_SHARD", compiler=compiler, schedule=variant.endswith("scheduled"))
        backend.shard(model)
        return model, torch.compile(model, backend=backend)
    if variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # Configured as FULL_SHARD: every unit, the root too, reshards after forward (FSDP2's
        # default keeps the root's parameters for backward).
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        return model, (torch.compile(model, backend=compiler) if variant == "fsdp2_compile" else model)
    if variant == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return model, ddp
    raise ValueError(variant)


def resident_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    seen, size = set(), 0
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        t = local(t)
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            size += t.untyped_storage().nbytes()
    return size


MEASURED_STEP = "bench_measured_step"


class Variant:
    """One way of training the model: its module, forward, optimizer and data stream."""

    def __init__(self, name: str, base: torch.nn.Module, cfg: GPTConfig, batch: int, rank: int, world: int,
                 compiler: str) -> None:
        self.name, self.cfg, self.batch = name, cfg, batch
        self.model, self.forward = build(name, base, world, compiler)
        # foreach: one kernel per op over all parameters, much faster for DTensor shards on CPU.
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        # Each variant draws its own copy of the same stream: every variant sees the same batches.
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def step(self) -> float:
        """One training step; returns the seconds the optimizer took."""
        idx = torch.randint(0, self.cfg.vocab_size, (self.batch, self.cfg.block_size + 1), generator=self.gen)
        x, y = idx[:, :-1], idx[:, 1:]
        loss = F.cross_entropy(self.forward(x).reshape(-1, self.cfg.vocab_size), y.reshape(-1))
        loss.backward()
        start = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - start

    def timed_steps(self, n: int) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"wall": [], "optimizer": [], "main_cpu": [], "process_cpu": []}
        for _ in range(n):
            dist.barrier()
            start, start_thread, start_process = time.perf_counter(), time.thread_time(), time.process_time()
            out["optimizer"].append(self.step())
            out["wall"].append(time.perf_counter() - start)
            # CPU time of this rank: its main thread (compute and Python), and the whole process
            # (plus gloo's communication threads). On a machine with a core per rank, a process
            # whose CPU time fills its step has no idle core left to hide communication on.
            out["main_cpu"].append(time.thread_time() - start_thread)
            out["process_cpu"].append(time.process_time() - start_process)
        return out

    def profiled_step(self, world: int) -> dict:
        """Memory, collectives and overlap of one steady step, from the profiler.

        Two steps are profiled and the second is measured: the CPU allocator reports a free only
        for memory allocated while profiling, so the first step's frees of older tensors go
        unreported, while everything the second step frees was allocated under the profiler.
        """
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
            self.step()
            dist.barrier()
            with record_function(MEASURED_STEP):
                self.step()
        raw = prof.profiler.kineto_results
        marker = next(e for e in raw.events() if e.name() == MEASURED_STEP)
        start_ns, end_ns, origin = marker.start_ns(), marker.end_ns(), raw.trace_start_ns()
        # Every allocation and free is one record with its own timestamp, address and size, from
        # every thread. Summing them in time order gives the bytes allocated at each moment
        # (allocator_peak: an address reused before its free's timestamp is counted once). (The
        # profiler's per-op memory columns attribute each record to every op whose time range
        # contains it, on any thread, so gloo's ops running beside compute pick up compute's
        # allocations: a peak built from them changes with timing from run to run.)
        peak = allocator_peak([r for r in allocation_records(prof) if start_ns <= r[0] <= end_ns])

        lo, hi = (start_ns - origin) / 1e3, (end_ns - origin) / 1e3
        events = [e for e in prof.events() if lo <= e.time_range.start and e.time_range.end <= hi]
        main = next((e.thread for e in events if e.name in ("aten::mm", "aten::addmm")), None)
        # A collective counts when it starts inside the step: gloo's worker thread records its
        # end after it has signalled completion, which can land just past the step's end (DDP's
        # last all-reduce was sometimes missed).
        comm_events = [e for e in prof.events() if e.name.startswith("gloo:") and lo <= e.time_range.start <= hi]
        comm = union([(e.time_range.start, min(e.time_range.end, hi)) for e in comm_events])
        compute = union([(e.time_range.start, e.time_range.end) for e in events
                         if e.name in COMPUTE_OPS and e.thread == main])
        collectives, moved = {}, 0
        for e in comm_events:
            kind = e.name.split(":", 1)[1]
            collectives[kind] = collectives.get(kind, 0) + 1
            numel = 1
            for d in (e.input_shapes[0] if e.input_shapes and e.input_shapes[0] else []):
                numel *= d
            moved += numel * 4 * (world if kind == "all_gather" else 1)
        return {"resident_bytes": resident_bytes(self.model, self.opt), "step_peak_bytes": peak,
                "collectives": collectives, "collective_bytes": moved,
                "compute_ms": total(compute) / 1e3, "communication_ms": total(comm) / 1e3,
                "communication_under_compute_ms": intersect(comm, compute) / 1e3}


def measure(args, variants: list[str], base, cfg, rank: int, world: int,
            after_round: Callable[[list[dict], list[list[str]], float], None]) -> None:
    """Builds every variant, then measures the rounds; after each round, rank 0 hands the summary
    so far to ``after_round`` (so that a run stopped early still leaves its completed rounds)."""
    built = {}
    warmup_times = {}
    for name in variants:
        built[name] = Variant(name, base, cfg, args.batch, rank, world, args.compiler)
        warmup_times[name] = built[name].timed_steps(args.warmup)["wall"]
        if rank == 0:
            print(f"{name}: built, {sum(warmup_times[name]):.1f} s in {args.warmup} warm-up steps", flush=True)

    per_round: dict[str, list[dict]] = {name: [] for name in variants}
    orders = []
    for r in range(args.rounds):
        order = rotated(variants, r)
        orders.append(order)
        for name in order:
            built[name].step()  # untimed: the first step after the others' work has cold caches
        # Interleaved one step at a time: a variant's steps and its peers' are taken seconds apart,
        # so the load of a shared machine, which drifts over minutes, lands on all of them alike.
        timed: dict[str, dict[str, list[float]]] = {name: {} for name in order}
        for _ in range(args.steps):
            for name in order:
                for key, values in built[name].timed_steps(1).items():
                    timed[name].setdefault(key, []).extend(values)
        for name in order:
            variant = built[name]
            profiled = variant.profiled_step(world)
            mine = {key: statistics.median(values) for key, values in timed[name].items()}
            gathered = [None] * world
            dist.all_gather_object(gathered, {**mine, "peak": profiled["resident_bytes"] + profiled["step_peak_bytes"],
                                              "resident": profiled["resident_bytes"]})
            per_round[name].append({
                # A step ends when its slowest rank ends.
                "step_ms": max(g["wall"] for g in gathered) * 1e3,
                "optimizer_ms": max(g["optimizer"] for g in gathered) * 1e3,
                "main_cpu_ms": statistics.mean(g["main_cpu"] for g in gathered) * 1e3,
                "process_cpu_ms": statistics.mean(g["process_cpu"] for g in gathered) * 1e3,
                "peak_mib": max(g["peak"] for g in gathered) / 2**20,
                "resident_mib": max(g["resident"] for g in gathered) / 2**20,
                "profile": profiled,
            })
            if rank == 0:
                row = per_round[name][-1]
                print(f"round {r + 1}/{args.rounds} {name}: {row['step_ms']:.1f} ms/step, "
                      f"peak {row['peak_mib']:.1f} MiB", flush=True)
        if rank == 0:
            after_round(summarize(args, cfg, world, per_round, warmup_times), orders, os.getloadavg()[0])


def summarize(args, cfg, world: int, per_round: dict[str, list[dict]], warmup_times: dict[str, list[float]]) -> list[dict]:
    results = []
    for name, rows in per_round.items():
        step = spread([row["step_ms"] for row in rows])
        prof = rows[0]["profile"]
        results.append({
            "variant": name,
            "step_ms": step,
            "optimizer_ms": spread([row["optimizer_ms"] for row in rows]),
            "tokens_per_s": args.batch * cfg.block_size * world / (step["median"] / 1e3),
            # One cold compile per variant: the warm-up steps minus as many steady steps.
            "compile_s": sum(warmup_times[name]) - args.warmup * step["median"] / 1e3,
            "peak_memory_mib": spread([row["peak_mib"] for row in rows]),
            "resident_mib": spread([row["resident_mib"] for row in rows]),
            "collectives_per_step": prof["collectives"],
            "collective_mib_per_step": prof["collective_bytes"] / 2**20,
            "cpu_ms": {"main_thread": spread([row["main_cpu_ms"] for row in rows]),
                       "process": spread([row["process_cpu_ms"] for row in rows])},
            "profile_ms": {key: statistics.median(row["profile"][f"{key}_ms"] for row in rows)
                           for key in ("compute", "communication", "communication_under_compute")},
        })
    return results


def process_cpu(row: dict) -> dict:
    return row["cpu_ms"]["process"]


def comparison(rows: list[dict], ours: str, peer: str, figure: Callable[[dict], dict] = lambda r: r["step_ms"]) -> dict:
    """Ratio of a figure (step time by default) ours/peer, per round (the two measured in the same round)."""
    by = {r["variant"]: r for r in rows}
    ratios = [a / b for a, b in zip(figure(by[ours])["rounds"], figure(by[peer])["rounds"])]
    result = spread(ratios)
    if result["max"] < 1.0:
        result["verdict"] = "faster"
    elif result["min"] > 1.0:
        result["verdict"] = "slower"
    else:
        result["verdict"] = "within noise"
    return {"ours": ours, "peer": peer, **result}


def comparisons(rows: list[dict], figure: Callable[[dict], dict] = lambda r: r["step_ms"]) -> list[dict]:
    names = [r["variant"] for r in rows]
    pairs = [(name, peer) for peer in ("fsdp2_eager", "fsdp2_compile") if peer in names
             for name in names if name != peer and not (peer == "fsdp2_compile" and name in ("fsdp2_eager", "ddp"))]
    if {"fsdp_compile_scheduled", "fsdp_compile_unscheduled"} <= set(names):
        pairs.append(("fsdp_compile_scheduled", "fsdp_compile_unscheduled"))
    return [comparison(rows, ours, peer, figure) for ours, peer in pairs]


def markdown(report: dict) -> str:
    rows = report["results"]
    comps = {(c["ours"], c["peer"]): c for c in report["comparisons"]}
    load = report["load"]
    planned = report.get("rounds_planned", report["rounds"])
    stopped = f" (of {planned} planned: the run was stopped early)" if planned != report["rounds"] else ""
    lines = [
        (f"Training step, GPT {report['config']}, {report['world']} ranks on CPU (gloo), "
        f"{report['machine']}, torch {report['torch']}. {report['rounds']} rounds{stopped}, the variant order rotated "
        f"each round; per round, the median of {report['steps']} steps (max over ranks), the variants' steps "
         f"interleaved one by one after one untimed step each. "
        f"Each figure is the median over rounds with its range (min-max over rounds) in parentheses; ratios "
        f"are taken per round. Load average (1 min) on the machine: {load['before'][0]:.2f} before, "
        f"{', '.join(f'{x:.2f}' for x in load['after_rounds'])} after each round ({report['cores']} cores; "
        f"this benchmark itself keeps {report['world']} busy)."),
        "",
        ("| variant | step ms | vs FSDP2 eager | vs FSDP2 + compile | of which optimizer | tokens/s | compile s "
         "| peak MiB/rank | collectives/step | MiB/step |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = r["variant"]
        colls = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives_per_step"].items()))
        eager = "1.00x" if name == "fsdp2_eager" else fmt_ratio(comps.get((name, "fsdp2_eager")))
        compiled = "1.00x" if name == "fsdp2_compile" else fmt_ratio(comps.get((name, "fsdp2_compile")))
        lines.append(
            f"| {name} | {fmt_spread(r['step_ms'])} | {eager} | {compiled} | {fmt_spread(r['optimizer_ms'])} | "
            f"{r['tokens_per_s']:.0f} | {r['compile_s']:.1f} | {fmt_spread(r['peak_memory_mib'])} | {colls} | "
            f"{r['collective_mib_per_step']:.1f} |")
    memory_note = (
        "Peak memory per rank: the resident state (parameter shards, optimizer state) plus the peak of bytes "
        "allocated during a profiled steady step, every allocation and free summed in time order on all threads. "
        "It is measured in every round; where the rounds differ, the range is given. They can differ for the same "
        "code: gloo's threads allocate and free buffers, and drop the tensors a collective held, at moments that "
        "depend on timing.")
    time_note = (
        "Where a step's time goes, ms per rank (mean over ranks, median over rounds): CPU time of the main "
        "thread (compute, Python, launching collectives), of the whole process (plus gloo's communication "
        "threads), and from one profiled step the time a gloo collective was running and how much of it "
        "overlapped aten compute ops on the main thread (Inductor's fused kernels are not aten ops, so "
        "for compiled variants this overlap is a lower bound):")
    lines += ["", memory_note, "", time_note, "",
              ("| variant | step (wall) | main-thread CPU | process CPU | process CPU vs FSDP2 eager "
               "| process CPU / wall | gloo running | gloo under aten compute |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    cpu_comps = {(c["ours"], c["peer"]): c for c in report.get("cpu_comparisons", [])}
    for r in rows:
        p, c = r["profile_ms"], r["cpu_ms"]
        cpu_eager = "1.00x" if r["variant"] == "fsdp2_eager" else fmt_ratio(cpu_comps.get((r["variant"], "fsdp2_eager")))
        lines.append(f"| {r['variant']} | {r['step_ms']['median']:.1f} | {fmt_spread(c['main_thread'])} | "
                     f"{fmt_spread(c['process'])} | {cpu_eager} | {c['process']['median'] / r['step_ms']['median']:.2f} | "
                     f"{p['communication']:.1f} | {p['communication_under_compute']:.1f} |")
    lines += ["", "Round by round, step ms in the order each round ran:", ""]
    by = {r["variant"]: r for r in rows}
    for i, order in enumerate(report["orders"]):
        lines.append(f"- round {i + 1}: " + ", ".join(f"{n} {by[n]['step_ms']['rounds'][i]:.1f}" for n in order))
    if report.get("verdict"):
        lines += ["", ("Verdicts (FULL_SHARD, scheduled): a comparison counts only when its range over rounds "
                       "stays on one side of 1.0."), ""]
        lines += [f"- {line}" for line in report["verdict"]]
    return "\n".join(lines) + "\n"


def verdict(report: dict) -> list[str]:
    rows, world = report["results"], report["world"]
    by = {r["variant"]: r for r in rows}
    comps = {(c["ours"], c["peer"]): c for c in report["comparisons"]}
    ours = by["fsdp_compile_scheduled"]
    notes = []
    for peer in ("fsdp2_eager", "fsdp2_compile"):
        c = comps[("fsdp_compile_scheduled", peer)]
        notes.append(f"vs {peer}: {fmt_ratio(c)}, {c['verdict']}")
    off = comps[("fsdp_compile_scheduled", "fsdp_compile_unscheduled")]
    effect = {"faster": "helps", "slower": "hurts",
              "within noise": "makes no difference this run can measure"}[off["verdict"]]
    off_cpu = {(c["ours"], c["peer"]): c for c in report["cpu_comparisons"]}[("fsdp_compile_scheduled",
                                                                             "fsdp_compile_unscheduled")]
    notes.append(f"scheduling on vs off: {fmt_ratio(off)} per round "
                 f"({fmt_spread(ours['step_ms'])} vs {fmt_spread(by['fsdp_compile_unscheduled']['step_ms'])} ms): "
                 f"scheduling {effect} here; process CPU per step {fmt_ratio(off_cpu)}: the same work, moved.")
    for peer in ("fsdp2_eager", "fsdp2_compile"):
        c = {(c["ours"], c["peer"]): c for c in report["cpu_comparisons"]}[("fsdp_compile_scheduled", peer)]
        notes.append(f"process CPU per step vs {peer} (steadier than wall time on a loaded machine): "
                     f"{fmt_ratio(c)}, {c['verdict'].replace('faster', 'less in every round').replace('slower', 'more in every round')}.")
    for peer in ("fsdp2_eager", "fsdp2_compile"):
        mine, theirs = ours["peak_memory_mib"], by[peer]["peak_memory_mib"]
        if mine["max"] < theirs["min"]:
            side = "less in every round"
        elif mine["min"] > theirs["max"]:
            side = "more in every round"
        else:
            side = "the ranges over rounds overlap: within noise"
        notes.append(f"peak memory per rank vs {peer}: {fmt_spread(mine)} vs {fmt_spread(theirs)} MiB "
                     f"({mine['median'] / theirs['median']:.2f}x of medians; {side}).")
    cpu = {k: v["median"] for k, v in ours["cpu_ms"].items()}
    step = ours["step_ms"]["median"]
    notes.append(
        f"fsdp_compile_scheduled: each rank spends {cpu['main_thread']:.1f} ms of main-thread CPU and "
        f"{cpu['process']:.1f} ms of process CPU per {step:.1f} ms step "
        f"({cpu['process'] / step:.0%} of the wall time, with {report['cores']} cores for "
        f"{world} ranks). Communication on gloo is CPU work (memory copies and reductions on "
        f"gloo's threads) on the same cores as compute, so once a rank's core is busy for its whole step, "
        f"overlap can only move communication, not hide it: the step cannot be shorter than the process CPU "
        f"time. That floor is {cpu['process'] / by['fsdp2_eager']['step_ms']['median']:.2f}x FSDP2 eager's step.")
    fsdp2 = by["fsdp2_eager"]["cpu_ms"]["main_thread"]["median"]
    notes.append(
        f"Compute: our main thread needs {cpu['main_thread']:.1f} ms per step against FSDP2 eager's "
        f"{fsdp2:.1f} ms ({cpu['main_thread'] / fsdp2:.2f}x): Inductor on CPU fuses "
        f"pointwise work, while the matrix multiplications that dominate this model run the same kernels.")
    return notes


# aot_eager: Inductor's cold compiles of three variants would take minutes on a loaded 2-core machine.
SMOKE = {"layers": 1, "d_model": 64, "seq": 32, "vocab": 256, "batch": 2, "warmup": 1, "steps": 2, "rounds": 3,
         "compiler": "aot_eager"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the variant order rotated each round")
    p.add_argument("--warmup", type=int, default=3, help="steps before the first round (these compile)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--variants", nargs="+", default=["fsdp_compile_scheduled", "fsdp_compile_unscheduled",
                                                      "fsdp2_eager", "fsdp2_compile", "ddp"])
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                   help="for fsdp_compile and FSDP2 + torch.compile")
    p.add_argument("--smoke", action="store_true",
                   help="check that the benchmark runs: a 1-layer model, 2 steps, 3 rounds, aot_eager (figures mean nothing)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name", default=None, help="file name stem (default train_step_cpu, or train_step_smoke)")
    p.add_argument("--render", metavar="JSON", help="only rewrite the Markdown (and verdict) of an earlier run's JSON")
    args = p.parse_args()
    if args.render:
        path = Path(args.render)
        report = json.loads(path.read_text())
        report["comparisons"] = comparisons(report["results"])
        report["cpu_comparisons"] = comparisons(report["results"], process_cpu)
        if "verdict" in report:
            report["verdict"] = verdict(report)
        path.write_text(json.dumps(report, indent=2) + "\n")
        path.with_suffix(".md").write_text(markdown(report))
        return
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    for flag in ("steps", "rounds", "warmup", "batch"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if len(set(args.variants)) != len(args.variants):
        p.error(f"--variants lists a variant twice: {args.variants}")
    stem = args.name or ("train_step_smoke" if args.smoke else "train_step_cpu")
    if not args.smoke:
        # Cold compiles for every variant, so compile times do not depend on the order they run
        # in or on what earlier runs left in the cache.
        torch._inductor.config.force_disable_caches = True

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load_before = os.getloadavg()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(cfg)
    torch._dynamo.reset()
    load_after: list[float] = []
    out = Path(args.out)

    def write(results: list[dict], orders: list[list[str]], load: float) -> None:
        load_after.append(load)
        report = {
            "config": f"{args.layers} layers, d_model {args.d_model}, seq {args.seq}, vocab {args.vocab}, "
                      f"batch {args.batch}/rank, {base.num_parameters():,} parameters",
            "world": world, "steps": args.steps, "warmup": args.warmup, "rounds": len(orders),
            "rounds_planned": args.rounds, "compiler": args.compiler, "smoke": args.smoke, "orders": orders,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "cores": os.cpu_count(),
            "torch": torch.__version__,
            "load": {"before": list(load_before), "after_rounds": load_after},
            "results": results,
        }
        report["comparisons"] = comparisons(results)
        report["cpu_comparisons"] = comparisons(results, process_cpu)
        if {"fsdp_compile_scheduled", "fsdp_compile_unscheduled", "fsdp2_eager", "fsdp2_compile"} <= set(args.variants):
            report["verdict"] = verdict(report)
        table = markdown(report) if "fsdp2_eager" in args.variants else json.dumps(results, indent=2)
        if len(orders) == args.rounds:
            print(table)
        write_report(out, stem, report, table)

    measure(args, args.variants, base, cfg, rank, world, write)
    end_process_group(exit_process=True)


if __name__ == "__main__":
    main()
