"""memory_budget= on an emulated cluster network: memory spent for speed, against the strategies and FSDP2.

    python bench/memory_budget.py              # both jobs: world 2 (one node), then 2 nodes x 2
    python bench/memory_budget.py --smoke      # tiny sizes, aot_eager, 1 round: checks that it runs
    python bench/memory_budget.py --render bench/results/memory_budget_cpu.json   # the report again

A GPT of ``--layers`` blocks trains with AdamW on an :class:`fsdp_compile.EmulatedNetwork` (every
collective runs through gloo and completes when a link of the chosen speed would have finished
it). World 2 is one node; world 4 is 2 nodes x 2 ranks whose inter-node link is
``--inter-slowdown`` (10) times slower than the intra-node one. Per job:

1. **Compute and links.** FULL_SHARD (fsdp_compile, default options) steps on unlimited links give
   the step's compute and its bytes per link; for each ``--ratios`` value r, the links at which
   the busier one is busy r x compute (as ``bench/overlap.py``).
2. **Budgets.** ``--budgets`` budgets, evenly spaced from FULL_SHARD's peak to the peak of
   keeping every unit gathered, both as ``memory_budget=`` counts them (the planner's count of
   the compiled step, read from a choice under an unlimited budget); FULL_SHARD's and
   SHARD_GRAD_OP's measured peaks per rank (the allocator's, as ``compare`` reads it: every
   storage alive before a profiled step plus the most allocated during it) beside them.
3. **The cluster model** ``memory_budget=`` predicts on: ``Cluster.measure()`` on the emulated
   network (``--smoke``: the H100 preset), its link fits set to each point's links (what the
   emulated links charge: a latency per collective and a bandwidth).
4. **Variants, at every point:** fsdp_compile's FULL_SHARD, SHARD_GRAD_OP and (world 4)
   HYBRID_SHARD and FULL_SHARD with ``reshard_after_forward=2`` (every unit keeps a shard over
   its node); FULL_SHARD with ``memory_budget=`` each budget (the compiler chooses at that
   point's links); FSDP2 eager with ``fully_shard(reshard_after_forward=...)`` per module set to
   what each budget chose (the root and every block, as FSDP2 users shard). ``--rounds`` rounds of
   ``--steps`` timed steps, variants interleaved, the order rotated every round; a step is its
   slowest rank's; the figure is the median over rounds.

Per row: step time, measured peak (after the timed steps, one profiled step), the links' wire
bytes per step by kind (``net.stats()``), and what the budget chose. Targets (stated in the
report, each row marked): measured peak within the budget at every budget; step time
non-increasing as the budget grows (beyond the rounds' spread); at the largest budget within
5% of SHARD_GRAD_OP; at 2 x 2 with the inter-node link dominating, resharded to the node, every
backward gather inside it (the inter-node gather bytes are forward's alone), and the best budget's
step at most 0.8x FULL_SHARD's; every budget at or below FSDP2 with its settings. A budget that
keeps some units over the node and reshards others to the shard group still gathers those others
across nodes in backward: the table's intra / inter columns show both.
Writes ``<out>/<name>.json``, ``.md`` and ``<name>.png``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import rank_env, torchrun_command
from overlap import emulated_rank, gathered, link_speeds, timed_on
from report_files import run_facts, write_report
from rounds import rotated

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.network.links import UNLIMITED_LINKS, format_bandwidth
from fsdp_compile.runtime.ring import ring_steps
from fsdp_compile.sharding.groups import end_process_group

LATENCY = 20e-6
UNLIMITED = 0.0
NODE = "FULL_SHARD to node"
NOISE_FLOOR = 0.03  # a difference below 3% of a step is within this machine's noise, whatever the spread


# ---------------------------------------------------------------------------------------------- variants
@dataclasses.dataclass
class Variant:
    name: str
    model: torch.nn.Module
    forward: Any
    opt: torch.optim.Optimizer
    backend: Any = None
    budget: float | None = None
    settings: dict[str, Any] | None = None  # FSDP2: unit -> reshard_after_forward
    note: str = ""  # what the variant sets beyond its strategy

    def step(self, idx: torch.Tensor, vocab: int) -> None:
        x, y = idx[:, :-1], idx[:, 1:]
        F.cross_entropy(self.forward(x).reshape(-1, vocab), y.reshape(-1)).backward()
        self.opt.step()
        self.opt.zero_grad()

    def choice(self) -> dict[str, int] | None:
        choice = getattr(getattr(self.backend, "_state", None), "reshard_choice", None)
        return None if choice is None else choice.reshard_to


def fsdp_compile_variant(name: str, strategy: str, base, compiler: str, **options) -> Variant:
    model = copy.deepcopy(base)
    extra = {"shard_size": 2} if strategy == "HYBRID_SHARD" else {}
    backend = fsdp_compile.backend(strategy, compiler=compiler, **extra, **options)
    backend.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    note = f"reshard_after_forward={options['reshard_after_forward']}" if "reshard_after_forward" in options else ""
    return Variant(name, model, torch.compile(model, backend=backend), opt, backend, options.get("memory_budget"),
                   note=note)


def fsdp2_variant(name: str, base, world: int, settings: dict[str, Any]) -> Variant:
    """FSDP2 eager, each unit resharding as ``settings`` says (the root's key is "")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=settings.get(f"blocks.{i}", True))
    fully_shard(model, mesh=mesh, reshard_after_forward=settings.get("", True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return Variant(name, model, model, opt, settings=settings)


def fsdp2_settings(choice: dict[str, int], world: int) -> dict[str, Any]:
    """What FSDP2's reshard_after_forward is for each unit our choice named."""
    return {unit: (False if ranks == 1 else True if ranks >= world else ranks) for unit, ranks in choice.items()}


# ---------------------------------------------------------------------------------------------- measuring
def timed_step(v: Variant, idx: torch.Tensor, vocab: int, net, plain) -> dict:
    wall, stats = timed_on(net, plain, lambda: v.step(idx, vocab))
    return {"wall": wall, "count": {link: stats.count(link=link) for link in ("intra", "inter")},
            "wire": {f"{kind}/{link}": stats.total(kind=kind, link=link).wire_bytes
                     for kind in ("all_gather", "reduce_scatter", "all_reduce") for link in ("intra", "inter")}}


def measured_peak(v: Variant, idx: torch.Tensor, vocab: int) -> float:
    """The allocator's peak of one step, as ``python -m fsdp_compile compare`` reads it."""
    from torch.profiler import ProfilerActivity, profile

    from fsdp_compile.planning.calibration.allocator import allocation_records, allocator_peak, quiet_profiler

    gc.collect()
    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step(idx, vocab)
    return float(allocator_peak(allocation_records(prof)))


def cluster_at(cluster, speeds: dict) -> Any:
    """``cluster`` with its links' fits set to what the emulated links charge at ``speeds``."""
    from fsdp_compile.planning.vocabulary import MeasuredCollective

    latency = speeds["latency"]

    def fits(bandwidth: float, group_size: int) -> dict:
        return {kind: MeasuredCollective(latency / max(ring_steps(kind, group_size), 1), bandwidth, group_size)
                for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    inter = speeds["inter_node"] if math.isfinite(speeds["inter_node"]) else 1e15
    intra = speeds["intra_node"] if math.isfinite(speeds["intra_node"]) else 1e15
    return cluster.replace(measured_collectives=fits(intra, cluster.devices_per_node),
                           measured_inter_collectives=fits(inter, cluster.world_size))


def measure_job(args, rank: int, world: int, net, plain, log) -> dict:
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(cfg)
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=gen)

    nodes = world // 2 if world == 4 else 1
    if args.smoke:
        cluster = fsdp_compile.Cluster.preset("h100-sxm", nodes=nodes, devices_per_node=world // nodes)
    else:
        net.set_links(**UNLIMITED_LINKS)
        start = time.monotonic()
        from fsdp_compile_lab import HostCPU  # on the ranks' PYTHONPATH (launch.rank_env)

        cluster = fsdp_compile.Cluster.measure(nodes=nodes, host=HostCPU)
        log(f"world {world}: Cluster.measure() in {time.monotonic() - start:.0f} s")

    # 1. compute and links; 2. budgets, from the two strategies' measured peaks.
    net.set_links(**UNLIMITED_LINKS)
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", *(["HYBRID_SHARD"] if world == 4 else [])]
    fixed = {s: fsdp_compile_variant(s, s, base, args.compiler) for s in strategies}
    if world == 4:
        # Every unit keeps a shard over its node after forward, so that backward gathers inside it.
        fixed[NODE] = fsdp_compile_variant(NODE, "FULL_SHARD", base, args.compiler, reshard_after_forward=2)
    for v in fixed.values():
        for _ in range(args.warmup):
            timed_step(v, batch(), cfg.vocab_size, net, plain)
    samples = [timed_step(fixed["FULL_SHARD"], batch(), cfg.vocab_size, net, plain) for _ in range(3)]
    compute = max(gathered(statistics.median(s["wall"] for s in samples), world, plain))
    wire = {link: sum(statistics.median(s["wire"][f"{k}/{link}"] for s in samples)
                      for k in ("all_gather", "reduce_scatter", "all_reduce")) for link in ("intra", "inter")}
    count = {link: round(statistics.median(s["count"][link] for s in samples)) for link in ("intra", "inter")}
    per_link = gathered({link: (wire[link], count[link]) for link in wire}, world, plain)[0]
    slowdown = args.inter_slowdown if world == 4 else 1.0
    points = [UNLIMITED, *args.ratios]
    speeds = {r: link_speeds(r, compute, per_link, slowdown) for r in points}
    peaks = {s: max(gathered(measured_peak(fixed[s], batch(), cfg.vocab_size), world, plain))
             for s in ("FULL_SHARD", "SHARD_GRAD_OP")}
    # A budget is in the planner's count of a step's peak (what memory_budget= means): from
    # FULL_SHARD's own (the least any budget may be) to what keeping every unit needs.
    generous = fsdp_compile_variant("generous", "FULL_SHARD", base, args.compiler, memory_budget=1 << 50,
                                    cluster=cluster_at(cluster, speeds[points[-1]]))
    timed_step(generous, batch(), cfg.vocab_size, net, plain)
    predicted = generous.backend._state.reshard_choice.summary()
    low, high = predicted["strategy_peak"], predicted["peak"]
    del generous
    budgets = [low + (high - low) * k / (args.budgets - 1) for k in range(args.budgets)]
    log(f"world {world}: compute {compute * 1e3:.0f} ms/step; measured peaks FULL_SHARD "
        f"{peaks['FULL_SHARD'] / 2**20:.2f} MiB, SHARD_GRAD_OP {peaks['SHARD_GRAD_OP'] / 2**20:.2f} MiB; predicted "
        f"{low / 2**20:.2f} to {high / 2**20:.2f} MiB; links " + ", ".join(
            f"{r}x: {format_bandwidth(s['intra_node'])}" for r, s in speeds.items() if r))

    rows = []
    for point in args.ratios:
        net.set_links(**speeds[point])
        at = cluster_at(cluster, speeds[point])
        variants: dict[str, Variant] = dict(fixed)
        for k, budget in enumerate(budgets):
            name = f"budget{k + 1}"
            try:
                variants[name] = fsdp_compile_variant(name, "FULL_SHARD", base, args.compiler,
                                                      memory_budget=int(budget), cluster=at)
                timed_step(variants[name], batch(), cfg.vocab_size, net, plain)  # compiles, and chooses
                if variants[name].choice() is None:
                    raise RuntimeError("the step ran without compiling (Dynamo's recompile limit?): no choice made")
            except Exception as exc:  # a budget the choice refuses: reported as such
                variants.pop(name, None)
                rows.append({"world": world, "ratio": point, "variant": name, "budget": budget,
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
                log(f"world {world} {point}x {name}: {type(exc).__name__}")
                continue
            settings = fsdp2_settings(variants[name].choice(), world)
            variants[f"fsdp2_{name}"] = fsdp2_variant(f"fsdp2_{name}", base, world, settings)
        for v in variants.values():
            for _ in range(args.warmup):
                timed_step(v, batch(), cfg.vocab_size, net, plain)
        per_round: dict[str, list[float]] = {n: [] for n in variants}
        wires: dict[str, dict] = {}
        for r in range(args.rounds):
            for name in rotated(list(variants), r):
                steps = [timed_step(variants[name], batch(), cfg.vocab_size, net, plain) for _ in range(args.steps)]
                per_round[name].append(max(gathered(statistics.median(s["wall"] for s in steps), world, plain)))
                wires[name] = {k: statistics.median(s["wire"][k] for s in steps) for k in steps[0]["wire"]}
        for name, v in variants.items():
            peak = max(gathered(measured_peak(v, batch(), cfg.vocab_size), world, plain))
            rows.append({"world": world, "ratio": point, "variant": name, "budget": v.budget,
                         "choice": v.choice(), "fsdp2_settings": v.settings, "note": v.note,
                         "step_ms": statistics.median(per_round[name]) * 1e3,
                         "step_ms_rounds": [x * 1e3 for x in per_round[name]],
                         "peak_bytes": peak, "wire_bytes": wires[name]})
        log(f"world {world} at {point}x: " + ", ".join(
            f"{row['variant']} {row['step_ms']:.0f} ms" for row in rows if row["ratio"] == point and "step_ms" in row))
        del variants
        gc.collect()
    return {"world": world, "config": {"layers": args.layers, "d_model": args.d_model, "seq": args.seq,
                                       "vocab": args.vocab, "batch_per_rank": args.batch,
                                       "parameters": base.num_parameters()},
            "compute_ms": compute * 1e3, "peaks": peaks, "predicted_peaks": {"FULL_SHARD": low, "keep_all": high},
            "budgets": budgets,
            "links": {str(r): {k: v for k, v in s.items()} for r, s in speeds.items()},
            "cluster": cluster.describe(), "rows": rows}


def worker(args) -> None:
    # Every variant is a copy of one model class whose forward Dynamo compiles once per backend:
    # past the recompile limit (8) Dynamo would run the later variants uncompiled.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    job = emulated_rank(devices_per_node=2)
    part = measure_job(args, job.rank, job.world, job.net, job.plain, job.log)
    if job.rank == 0:
        Path(args.part).write_text(json.dumps(part))
    end_process_group(exit_process=True)


# ---------------------------------------------------------------------------------------------- the report
def _spread(row: dict) -> float:
    rounds = row["step_ms_rounds"]
    return max(max(rounds) - min(rounds), NOISE_FLOOR * row["step_ms"])


def targets(parts: list[dict], ratios: list[float]) -> list[dict]:
    out = []
    for part in parts:
        world = part["world"]
        for point in ratios:
            rows = {r["variant"]: r for r in part["rows"] if r["ratio"] == point and "step_ms" in r}
            budget_rows = [rows[f"budget{k + 1}"] for k in range(len(part["budgets"])) if f"budget{k + 1}" in rows]
            where = f"world {world} at {point}x"
            for row in budget_rows:
                out.append({"target": "measured peak within the budget", "where": f"{where} {row['variant']}",
                            "held": row["peak_bytes"] <= row["budget"],
                            "figure": f"{row['peak_bytes'] / 2**20:.2f} MiB of {row['budget'] / 2**20:.2f} MiB"})
                twin = rows.get(f"fsdp2_{row['variant']}")
                if twin is not None:
                    out.append({"target": "at or below FSDP2 with the same settings", "where": f"{where} {row['variant']}",
                                "held": row["step_ms"] <= twin["step_ms"] + _spread(twin),
                                "figure": f"{row['step_ms']:.0f} vs {twin['step_ms']:.0f} ms"})
            for a, b in itertools.pairwise(budget_rows):
                out.append({"target": "step non-increasing as the budget grows",
                            "where": f"{where} {a['variant']} -> {b['variant']}",
                            "held": b["step_ms"] <= a["step_ms"] + max(_spread(a), _spread(b)),
                            "figure": f"{a['step_ms']:.0f} -> {b['step_ms']:.0f} ms"})
            if budget_rows and "SHARD_GRAD_OP" in rows and budget_rows[-1]["variant"] == f"budget{len(part['budgets'])}":
                top, sgo = budget_rows[-1], rows["SHARD_GRAD_OP"]
                out.append({"target": "at the largest budget within 5% of SHARD_GRAD_OP", "where": where,
                            "held": top["step_ms"] <= 1.05 * sgo["step_ms"],
                            "figure": f"{top['step_ms'] / sgo['step_ms']:.3f}x"})
            if world == 4 and point == max(ratios) and budget_rows:
                full, sgo_inter = rows["FULL_SHARD"], rows["SHARD_GRAD_OP"]["wire_bytes"]["all_gather/inter"]
                if NODE in rows:
                    inter = rows[NODE]["wire_bytes"]["all_gather/inter"]
                    out.append({"target": "resharded to the node, every backward gather inside it", "where": where,
                                "held": inter <= sgo_inter * 1.001,
                                "figure": f"inter-node gather bytes {inter / 2**20:.2f} MiB (forward's alone: "
                                          f"{sgo_inter / 2**20:.2f} MiB); {rows[NODE]['step_ms'] / full['step_ms']:.2f}x "
                                          "FULL_SHARD's step"})
                best = min(budget_rows, key=lambda r: r["step_ms"])
                out.append({"target": "at most 0.8x FULL_SHARD where the inter-node link dominates", "where": where,
                            "held": best["step_ms"] <= 0.8 * full["step_ms"],
                            "figure": f"{best['variant']}: {best['step_ms'] / full['step_ms']:.2f}x"})
    return out


def describe_choice(choice: dict[str, int] | None) -> str:
    """What a budget chose, briefly: which units keep their parameters, which a shard over n ranks."""
    if not choice:
        return "every unit reshards"
    by_ranks: dict[int, list[str]] = {}
    for unit, ranks in sorted(choice.items()):
        by_ranks.setdefault(ranks, []).append((unit or "root").replace("blocks.", "b"))
    return "; ".join(("keep " if ranks == 1 else f"{ranks}-way ") + ", ".join(units)
                     for ranks, units in sorted(by_ranks.items()))


def markdown(report: dict) -> str:
    lines = [f"# memory_budget= on an emulated network ({'smoke' if report['smoke'] else 'measured'})", "",
             f"{report['machine']}, torch {report['torch']}, commit {report['commit']}, {report['when']}; compiler "
             f"{report['compiler']}, {report['rounds']} rounds of {report['steps']} steps, AdamW. Step: the slowest "
             "rank's median, the median over rounds. Peak: the allocator's, one profiled step, the largest rank's.", ""]
    for part in report["parts"]:
        world = part["world"]
        c = part["config"]
        lines += [f"## World {world} ({'2 nodes x 2, inter-node link 10x slower' if world == 4 else 'one node'})", "",
                  f"GPT {c['layers']} blocks, d_model {c['d_model']}, seq {c['seq']}, batch {c['batch_per_rank']} per rank "
                  f"({c['parameters'] / 1e6:.2f} M parameters); compute {part['compute_ms']:.0f} ms per step. Budgets: "
                  + ", ".join(f"{b / 2**20:.2f}" for b in part["budgets"]) + " MiB (the predicted peaks of FULL_SHARD and "
                  "of keeping every unit gathered); measured peaks: FULL_SHARD "
                  f"{part['peaks']['FULL_SHARD'] / 2**20:.2f} MiB, SHARD_GRAD_OP "
                  f"{part['peaks']['SHARD_GRAD_OP'] / 2**20:.2f} MiB.", ""]
        for point in report["ratios"]:
            rows = [r for r in part["rows"] if r["ratio"] == point]
            full = next((r for r in rows if r["variant"] == "FULL_SHARD"), None)
            lines += [f"### Communication {point}x compute", "",
                      "| variant | budget MiB | chose | peak MiB | step ms | vs FULL_SHARD | gather MiB intra / inter |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in rows:
                if "error" in r:
                    lines.append(f"| {r['variant']} | {r['budget'] / 2**20:.2f} | {r['error']} | | | | |")
                    continue
                budget = f"{r['budget'] / 2**20:.2f}" if r.get("budget") else ""
                chose = (describe_choice(r["choice"]) if r["variant"].startswith("budget")
                         else f"FSDP2 {r['fsdp2_settings']}" if r.get("fsdp2_settings") is not None
                         else r.get("note", ""))
                ratio = f"{r['step_ms'] / full['step_ms']:.2f}x" if full else ""
                w = r["wire_bytes"]
                lines.append(f"| {r['variant']} | {budget} | {chose} | {r['peak_bytes'] / 2**20:.2f} | {r['step_ms']:.0f} | "
                             f"{ratio} | {w['all_gather/intra'] / 2**20:.2f} / {w['all_gather/inter'] / 2**20:.2f} |")
            lines.append("")
    lines += ["## Targets", "", "| target | where | held | figure |", "| --- | --- | --- | --- |"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['where']} | {'yes' if t['held'] else 'no'} | {t['figure']} |")
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"].strip()]
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path, name: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    parts = report["parts"]
    fig, axes = plt.subplots(len(parts), 2, figsize=(11, 4 * len(parts)), squeeze=False)
    for row_axes, part in zip(axes, parts):
        for point in report["ratios"]:
            rows = {r["variant"]: r for r in part["rows"] if r["ratio"] == point and "step_ms" in r}
            budgets = [(part["budgets"][k] / 2**20, rows[f"budget{k + 1}"]) for k in range(len(part["budgets"]))
                       if f"budget{k + 1}" in rows]
            xs = [b for b, _ in budgets]
            line, = row_axes[0].plot(xs, [r["step_ms"] for _, r in budgets], "o-", label=f"{point}x: budget")
            twins = [rows.get(f"fsdp2_{r['variant']}") for _, r in budgets]
            row_axes[0].plot(xs, [t["step_ms"] if t else math.nan for t in twins], "x--", color=line.get_color(),
                             label=f"{point}x: FSDP2 same settings")
            for strategy, style in (("FULL_SHARD", ":"), ("SHARD_GRAD_OP", "-."), ("HYBRID_SHARD", "--")):
                if strategy in rows:
                    row_axes[0].axhline(rows[strategy]["step_ms"], color=line.get_color(), linestyle=style, alpha=0.4)
            row_axes[1].plot(xs, [r["peak_bytes"] / 2**20 for _, r in budgets], "o-", color=line.get_color(),
                             label=f"{point}x")
        lim = [min(part["budgets"]) / 2**20, max(part["budgets"]) / 2**20]
        row_axes[1].plot(lim, lim, "k:", label="budget")
        row_axes[0].set(title=f"world {part['world']}: step time (dotted FULL_SHARD, dash-dot SHARD_GRAD_OP)",
                        xlabel="budget (MiB)", ylabel="ms")
        row_axes[1].set(title=f"world {part['world']}: measured peak", xlabel="budget (MiB)", ylabel="MiB")
        row_axes[0].legend(fontsize=7)
        row_axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def render(args, report: dict) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["targets"] = targets(report["parts"], report["ratios"])
    if args.analysis:
        report["analysis"] = Path(args.analysis).read_text()
    report["plot"] = plot(report, out, args.name)
    text = markdown(report)
    write_report(out, args.name, report, text)
    print(text)
    return report


def driver(args) -> None:
    parts = []
    forwarded = [a for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            part = Path(tmp) / f"world{world}.json"
            command = torchrun_command(world, __file__, *forwarded, "--part", str(part))
            print(f"world {world}", flush=True)
            proc = subprocess.run(command, env=rank_env(os.environ.get("OMP_NUM_THREADS", "1")), check=False)
            if not part.exists():
                raise SystemExit(f"the world-{world} job failed (exit status {proc.returncode}) before any result")
            parts.append(json.loads(part.read_text()))
    report = {**run_facts(), "smoke": args.smoke, "compiler": args.compiler, "rounds": args.rounds,
              "steps": args.steps, "ratios": args.ratios, "inter_slowdown": args.inter_slowdown, "parts": parts}
    render(args, report)


SMOKE = {"layers": 2, "d_model": 32, "seq": 16, "vocab": 64, "batch": 2, "warmup": 1, "steps": 1, "rounds": 1,
         "compiler": "aot_eager", "budgets": 3, "ratios": [1.0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=[2, 4])
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 1.0, 2.0],
                   help="communication per step over compute, on the busier link")
    p.add_argument("--budgets", type=int, default=5, help="budgets from FULL_SHARD's predicted peak to the predicted peak of keeping every unit")
    p.add_argument("--inter-slowdown", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name", default=None)
    p.add_argument("--analysis")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--render", metavar="JSON")
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.name = args.name or ("memory_budget_smoke" if args.smoke else "memory_budget_cpu")
    if args.render:
        render(args, json.loads(Path(args.render).read_text()))
    elif "RANK" in os.environ:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
