"""The planner against an emulated network: every strategy measured and predicted on the same links.

    python bench/plan_emulated.py                # world 2 and world 4 (2 nodes x 2), every point
    python bench/plan_emulated.py --smoke        # tiny sizes, world 2, two points: checks that it runs
    python bench/plan_emulated.py --reuse        # render again from the compare.json files already written

On :class:`fsdp_compile.EmulatedNetwork` a collective costs the time a link of the chosen speed
would take, sleeping, so communication hides under compute where the schedule lets it, as on a
GPU cluster. ``Cluster.measure()`` run on such a network measures its links, so ``plan()``
predicts for that network: the emulator is the planner's referee for exposed communication.

For each world (2: one node, FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; 4: two nodes of two, all
five strategies, the inter-node link ``--inter-slowdown`` times slower than the intra-node one),
``python -m fsdp_compile compare`` runs first on plain gloo (the *unlimited* point), then, with
``--exposed``, once per ``--ratios`` value r on the network at which FULL_SHARD's communication
per step is r times its compute (from the plain-gloo run: FULL_SHARD's measured step and wire
bytes; at world 4 FULL_SHARD's groups span the nodes, so the inter-node link sets its time).
Each run calibrates the cluster on the network it runs on, then measures and plans every
strategy.

Per strategy and point: the measured step (median of the timed steps), the prediction, the
exposed communication measured and predicted, and whether the emulation held over the timed
steps. Exposed communication is the median over the timed steps of each step minus its pair
on unlimited links in the same job (``compare --exposed``: each timed step runs on the emulated
links and on unlimited ones, alternating, and the links are calibrated both ways on one compute
calibration), so neither side carries the spread between two jobs' machine speeds or two
calibrations', and the pair's two steps share the machine's drift; beside it, the interval
that holds the true median with 95% confidence (order statistics of the differences).
Targets, printed as held or not: predicted step within 15% of measured; predicted exposed
communication within 25% of measured, or within 5% of the step, whichever is larger; the
ranking of strategies kept at each point wherever measured times differ by more than 10%.
``compare`` predicts each strategy at the speed the machine had while its steps ran (the
model's own forward and backward on one rank, timed after every step); the prediction at the
calibration's speed is shown beside it, with its own count of the step target.
Writes ``<out>/plan_emulated.json``, ``.md`` and ``plan_emulated_w<world>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plan_accuracy import QUIET, REUSE, _torchrun
from report_files import run_facts

MODEL = ("gpt_small", 4, 128)  # factory in bench/plan_accuracy.py, batch, seq
SMOKE_MODEL = ("gpt_tiny", 2, 32)
FLAT = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
ALL = (*FLAT, "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
LATENCY = 20e-6
STEP_WITHIN, EXPOSED_WITHIN, EXPOSED_FLOOR, RANK_GAP = 0.15, 0.25, 0.05, 0.10
# A row rests on the emulated link when gloo's lateness beyond the model is at most this share
# of its step (``bench/overlap.py``'s criterion); beyond it the row measures gloo on these cores.
HELD_OVERRUN = 0.02


def run_compare(world: int, strategies: tuple[str, ...], model: tuple, steps: int, out: Path,
                links: tuple[float, float] | None) -> dict | None:
    """One ``compare`` job (``plan_accuracy._torchrun``: waits for a quiet machine, honours
    ``--reuse``); ``links``: (intra, inter) bytes/s of the emulated network, None: plain gloo."""
    factory, batch, seq = model
    args = ["--model", f"plan_accuracy:{factory}", "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
            "--strategies", ",".join(strategies)]
    if world == 4:
        args += ["--shard-size", "2"]
    if links is not None:
        args += ["--emulate", f"{links[0] / 1e6:.6g}MB/s,{links[1] / 1e6:.6g}MB/s",
                 "--emulate-latency", f"{LATENCY * 1e6:.0f}us", "--exposed"]
    return _torchrun(world, args, out)


def link_speeds(unlimited: dict, ratio: float, slowdown: float) -> tuple[float, float]:
    """(intra, inter) bytes/s at which FULL_SHARD's communication per step is ``ratio`` x its compute."""
    row = next(r for r in unlimited["rows"] if r["strategy"] == "FULL_SHARD")
    compute = row["measured"]["step_seconds"]
    predicted = row["predicted"]["bytes_per_step"]
    collectives = sum(row["measured"]["collectives"].values())
    transfer = ratio * compute - LATENCY * collectives
    if transfer <= 0:
        raise SystemExit(f"{collectives} collectives pay more latency than {ratio} x compute: use a larger model")
    if unlimited["world"] == 4:  # FULL_SHARD's groups span both nodes: the inter-node link sets its time
        inter = (predicted.get("inter", 0.0) or predicted.get("intra", 0.0)) / transfer
        return inter * slowdown, inter
    intra = predicted.get("intra", 0.0) / transfer
    return intra, intra / slowdown


def rows_of(data: dict, ratio: float, unlimited: dict) -> list[dict]:
    base = {r["strategy"]: r for r in unlimited["rows"]}
    out = []
    for r in data["rows"]:
        m, p = r["measured"], r["predicted"]
        b = base[r["strategy"]]
        network = m.get("network") or {}
        overruns = network.get("overruns") or {}
        timed = m["step_times"][m.get("warmup_steps", 2):]
        # The stats' lateness summed over the timed steps: an upper bound of what a step owes to
        # gloo (lateness that no wait saw costs nothing).
        late = overruns.get("total_seconds", 0.0) / max(len(timed), 1)
        # The step on unlimited links: from the same job (``--exposed``: each timed step also run
        # there, alternating, and the links calibrated both ways), else the plain-gloo job's.
        compute = m.get("unlimited_step_seconds") or b["measured"]["step_seconds"]
        predicted_compute = (r.get("predicted_unlimited") or b["predicted"])["step_seconds"]
        # Exposed: compare's paired median and its 95% interval (``Measured.exposed_seconds``);
        # without pairs (plain gloo), the step minus the step on unlimited links.
        paired = m.get("exposed_seconds")
        measured_exposed = paired if paired is not None else m["step_seconds"] - compute
        interval = m.get("exposed_interval")
        predicted_exposed = p["step_seconds"] - predicted_compute
        at_calibration = r.get("predicted_at_calibration", p)["step_seconds"]
        out.append({
            "world": data["world"], "ratio": ratio, "strategy": r["strategy"],
            "measured_step_s": m["step_seconds"], "predicted_step_s": p["step_seconds"],
            "step_error": p["step_seconds"] / m["step_seconds"] - 1,
            "steps_s": timed, "gloo_late_per_step_s": late,
            "emulation_held": ratio == 0 or late <= HELD_OVERRUN * m["step_seconds"],
            "unlimited_step_s": compute, "predicted_unlimited_step_s": predicted_compute,
            "exposed_in_job": bool(m.get("unlimited_step_seconds")),
            "measured_exposed_s": measured_exposed, "predicted_exposed_s": predicted_exposed,
            "measured_exposed_interval_s": interval,
            "planner_exposed_comm_s": p["exposed_comm_seconds"], "predicted_comm_s": p["comm_seconds"],
            "measured_peak_bytes": m["peak_bytes"], "predicted_peak_bytes": p["peak_bytes"],
            "emulation": network.get("summary", "plain gloo" if ratio == 0 else "not recorded"),
            "overruns": overruns, "load_average": m.get("load_average"),
            # compare predicts at the speed the model's own step ran at beside the steps; the same
            # plan at the calibration's speed, and how far compute_scale moved in between
            "predicted_at_calibration_step_s": at_calibration,
            "at_calibration_error": at_calibration / m["step_seconds"] - 1,
            "speed_moved": (r["compute_scale"]["beside_steps"] / r["compute_scale"]["at_calibration"]
                            if "compute_scale" in r else 1.0),
        })
    return out


def exposed_held(row: dict) -> bool:
    diff = abs(row["predicted_exposed_s"] - row["measured_exposed_s"])
    return diff <= max(EXPOSED_WITHIN * abs(row["measured_exposed_s"]), EXPOSED_FLOOR * row["measured_step_s"])


def targets(rows: list[dict]) -> dict:
    step = [{"world": r["world"], "ratio": r["ratio"], "strategy": r["strategy"],
             "held": abs(r["step_error"]) <= STEP_WITHIN, "error": r["step_error"],
             "emulation_held": r.get("emulation_held", True)} for r in rows]
    exposed = [{"world": r["world"], "ratio": r["ratio"], "strategy": r["strategy"], "held": exposed_held(r),
                "measured_ms": r["measured_exposed_s"] * 1e3, "predicted_ms": r["predicted_exposed_s"] * 1e3,
                "emulation_held": r.get("emulation_held", True)}
               for r in rows if r["ratio"] != 0]
    ranking = []
    for key in sorted({(r["world"], r["ratio"]) for r in rows}):
        here = [r for r in rows if (r["world"], r["ratio"]) == key]
        for i, a in enumerate(here):
            for b in here[i + 1:]:
                if abs(a["measured_step_s"] / b["measured_step_s"] - 1) > RANK_GAP:
                    ranking.append({"world": key[0], "ratio": key[1], "pair": [a["strategy"], b["strategy"]],
                                    "agree": (a["measured_step_s"] < b["measured_step_s"])
                                    == (a["predicted_step_s"] < b["predicted_step_s"])})
    at_calibration = [{"world": r["world"], "ratio": r["ratio"], "strategy": r["strategy"],
                       "error": r["at_calibration_error"]} for r in rows if "at_calibration_error" in r]
    for x in at_calibration:
        x["held"] = abs(x["error"]) <= STEP_WITHIN
    return {"step": step, "exposed": exposed, "ranking": ranking, "step_at_calibration": at_calibration}


def point_name(ratio: float) -> str:
    return "unlimited (plain gloo)" if ratio == 0 else f"{ratio:g}x"


def plot(rows: list[dict], world: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    here = [r for r in rows if r["world"] == world]
    ratios = sorted({r["ratio"] for r in here})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, strategy in enumerate(s for s in ALL if any(r["strategy"] == s for r in here)):
        color = f"C{i}"
        mine = sorted((r for r in here if r["strategy"] == strategy), key=lambda r: r["ratio"])
        ax.plot([r["ratio"] for r in mine], [r["measured_step_s"] * 1e3 for r in mine], "o-", color=color,
                label=f"{strategy} measured")
        ax.plot([r["ratio"] for r in mine], [r["predicted_step_s"] * 1e3 for r in mine], "x--", color=color,
                label=f"{strategy} predicted")
    ax.set_xticks(ratios)
    ax.set_xticklabels(["plain\ngloo" if r == 0 else f"{r:g}x" for r in ratios])
    ax.set_xlabel("FULL_SHARD's modeled communication / compute")
    ax.set_ylabel("step (ms)")
    nodes = "2 nodes x 2, inter-node link 10x slower" if world == 4 else "1 node"
    ax.set_title(f"world {world} ({nodes}): measured and predicted", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def interval_text(interval: list[float] | None) -> str:
    return "" if not interval else f" ({interval[0] * 1e3:.0f} to {interval[1] * 1e3:.0f})"


def late_text(row: dict) -> str:
    """Gloo's lateness per step and its share of the step, or "-" on plain gloo."""
    if row["ratio"] == 0 or "gloo_late_per_step_s" not in row:
        return "-"
    late = row["gloo_late_per_step_s"]
    return f"{late * 1e3:.0f} ms ({late / row['measured_step_s']:.0%})"


def _where_held(results: list[dict]) -> str:
    """The count of held targets on the rows that rest on the emulated link (or plain gloo)."""
    resting = [x for x in results if x.get("emulation_held", True)]
    rows = "row" if len(resting) == 1 else "rows"
    return (f" (on the {len(resting)} {rows} where gloo was late by at most {HELD_OVERRUN:.0%} of the step, or "
            f"on plain gloo: {sum(x['held'] for x in resting)}/{len(resting)})")


def at_calibration_text(row: dict) -> str:
    if "at_calibration_error" not in row:
        return "-"
    return (f"{row['predicted_at_calibration_step_s'] * 1e3:.0f} ms, {row['at_calibration_error'] * 100:+.0f}% "
            f"({row.get('speed_moved', 1.0):.2f}x)")


def render(report: dict) -> str:
    t = report["targets"]
    lines = ["# The planner against an emulated network", "",
             (f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; "
              f"model {report['model']}, AdamW, aot_eager, `compare --steps {report['steps']}` (two warm-up steps, "
              f"the median of the rest). Links: latency {LATENCY * 1e6:.0f} us per collective; at world 4 the "
              f"inter-node link is {report['inter_slowdown']:g}x slower than the intra-node one. A point's ratio is "
              "FULL_SHARD's modeled communication per step over its compute (its step on plain gloo); the other "
              "strategies move other bytes, so their ratios differ. Each run measured the cluster on the network "
              "it ran on (`Cluster.measure()`), then measured and planned every strategy. *Predicted*: at the "
              "speed of the machine while that strategy's steps ran (the model's own forward, loss and backward "
              "on one rank, without collectives, timed after each timed step: `compute_scale` is its measured "
              "over its priced compute); *at the calibration's speed*: the same plan at the `compute_scale` "
              "of the calibration's one-block reference, and the first scale over the second. "
              "*On unlimited links*: "
              "the same strategy's step in the same job, each timed step run again with the links unlimited "
              "(gloo's own speed), alternating (`compare --exposed`), and its prediction from the same compute "
              "calibration with the links timed unlimited; *exposed* is the median over the timed steps of each "
              "step minus its pair on unlimited links, with the interval that holds the true median with 95% "
              "confidence (order statistics of the differences). *Gloo late per step*: "
              "the network's stats summed over the timed steps, how much later than the modeled link gloo "
              "finished its collectives, an upper bound of what the step owes to gloo on these cores rather than "
              "to the link. Produced by `python bench/plan_emulated.py`."), ""]
    for world in report["worlds"]:
        here = [r for r in report["rows"] if r["world"] == world]
        lines += [f"## World {world}" + (" (2 nodes x 2)" if world == 4 else " (one node)"), "",
                  f"![step against link speed](plan_emulated_w{world}.png)", "",
                  "| point | links intra / inter | strategy | measured step | predicted | error | at the calibration's "
                  "speed (`compute_scale` beside the steps / at calibration) | on unlimited links "
                  "measured / predicted | exposed measured (95% interval) | exposed predicted | gloo late per step "
                  "| emulation over the timed steps |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sorted(here, key=lambda r: (r["ratio"], ALL.index(r["strategy"]))):
            links = report["links"].get(f"{world}/{r['ratio']}")
            link_text = "gloo" if links is None else f"{links[0] / 1e6:.0f} / {links[1] / 1e6:.0f} MB/s"
            exposed = ("-" if r["ratio"] == 0 else f"{r['measured_exposed_s'] * 1e3:.0f} ms"
                       + interval_text(r.get("measured_exposed_interval_s")))
            exposed_p = ("-" if r["ratio"] == 0 else f"{r['predicted_exposed_s'] * 1e3:.0f} ms")
            unlimited = ("-" if r["ratio"] == 0 or "unlimited_step_s" not in r else
                         f"{r['unlimited_step_s'] * 1e3:.0f} / {r['predicted_unlimited_step_s'] * 1e3:.0f} ms"
                         + ("" if r.get("exposed_in_job") else " (plain-gloo job)"))
            lines.append(f"| {point_name(r['ratio'])} | {link_text} | {r['strategy']} | "
                         f"{r['measured_step_s'] * 1e3:.0f} ms | {r['predicted_step_s'] * 1e3:.0f} ms | "
                         f"{r['step_error'] * 100:+.0f}% | {at_calibration_text(r)} | {unlimited} | {exposed} | {exposed_p} | {late_text(r)} | "
                         f"{r['emulation']} |")
        lines.append("")
        winners = []
        for ratio in sorted({r["ratio"] for r in here}):
            at = sorted((r for r in here if r["ratio"] == ratio), key=lambda r: r["measured_step_s"])
            best_p = min(at, key=lambda r: r["predicted_step_s"])
            winners.append(f"{point_name(ratio)}: measured fastest {at[0]['strategy']} "
                           f"({at[0]['measured_step_s'] * 1e3:.0f} ms, next {at[1]['strategy']} "
                           f"{at[1]['measured_step_s'] / at[0]['measured_step_s']:.2f}x), predicted fastest "
                           f"{best_p['strategy']}" if len(at) > 1 else "")
        lines += ["Which strategy wins: " + "; ".join(w for w in winners if w) + ".", ""]
    step_ok = sum(x["held"] for x in t["step"])
    exposed_ok = sum(x["held"] for x in t["exposed"])
    rank_ok = sum(x["agree"] for x in t["ranking"])
    lines += ["## Targets", "",
              f"- predicted step within {STEP_WITHIN:.0%} of measured: {step_ok}/{len(t['step'])}"
              + _where_held(t["step"]) +
              "".join(f"; missed {x['strategy']} at world {x['world']}, {point_name(x['ratio'])} "
                      f"({x['error'] * 100:+.0f}%)" for x in t["step"] if not x["held"]),
              f"- predicted exposed communication within {EXPOSED_WITHIN:.0%} of measured or "
              f"{EXPOSED_FLOOR:.0%} of the step: {exposed_ok}/{len(t['exposed'])}" + _where_held(t["exposed"]) +
              "".join(f"; missed {x['strategy']} at world {x['world']}, {point_name(x['ratio'])} "
                      f"({x['predicted_ms']:.0f} ms predicted, {x['measured_ms']:.0f} ms measured)"
                      for x in t["exposed"] if not x["held"]),
              *([f"- the same, predicted at the calibration's speed: "
                 f"{sum(x['held'] for x in t['step_at_calibration'])}/{len(t['step_at_calibration'])}"
                 + "".join(f"; missed {x['strategy']} at world {x['world']}, {point_name(x['ratio'])} "
                           f"({x['error'] * 100:+.0f}%)" for x in t["step_at_calibration"] if not x["held"])]
                if t.get("step_at_calibration") else []),
              f"- ranking kept where measured steps differ by more than {RANK_GAP:.0%}: {rank_ok}/{len(t['ranking'])}"
              + "".join(f"; {x['pair'][0]} vs {x['pair'][1]} at world {x['world']}, {point_name(x['ratio'])}"
                        for x in t["ranking"] if not x["agree"]), ""]
    if report.get("analysis"):
        lines += ["## Analysis", "", report["analysis"], ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--inter-slowdown", type=float, default=10.0)
    # 30 timed pairs: the exposed communication's 95% interval is then the 10th to 21st of the
    # paired differences, about 1/sqrt(3) of its width with 10 pairs; at world 4, where 4 ranks
    # share 2 cores, single differences spread by 23-64 ms (standard deviation).
    parser.add_argument("--steps", type=int, default=32, help="steps per strategy per run (two warm up)")
    parser.add_argument("--quiet-load", type=float, default=QUIET["load"],
                        help="before each run, wait for the 1-minute load average to fall below this")
    parser.add_argument("--quiet-wait", type=float, default=QUIET["wait_s"])
    parser.add_argument("--smoke", action="store_true", help="tiny model, world 2, two points, 4 steps")
    parser.add_argument("--reuse", action="store_true", help="use compare.json files already in --out")
    parser.add_argument("--analysis", type=Path, help="a Markdown file whose text goes into the Analysis section")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    QUIET.update(load=args.quiet_load, wait_s=args.quiet_wait)
    REUSE.update(on=args.reuse)
    model = SMOKE_MODEL if args.smoke else MODEL
    if args.smoke:
        args.worlds, args.ratios, args.steps = [2], [1.0], min(args.steps, 4)
    name = "plan_emulated_smoke" if args.smoke else "plan_emulated"
    runs_dir = args.out / name
    rows, links = [], {}
    for world in args.worlds:
        strategies = FLAT if world == 2 else ALL
        unlimited = run_compare(world, strategies, model, args.steps, runs_dir / f"w{world}_unlimited", None)
        rows += rows_of(unlimited, 0.0, unlimited)
        for ratio in args.ratios:
            speeds = link_speeds(unlimited, ratio, args.inter_slowdown if world == 4 else 1.0)
            links[f"{world}/{ratio}"] = speeds
            data = run_compare(world, strategies, model, args.steps, runs_dir / f"w{world}_{ratio:g}x", speeds)
            rows += rows_of(data, ratio, unlimited)
    facts = run_facts()
    earlier = args.out / f"{name}.json"
    if args.reuse and earlier.exists():  # rendered again: the figures keep when and where they were measured
        measured = json.loads(earlier.read_text())
        facts.update(when=measured.get("when", facts["when"]), commit=measured.get("commit", facts["commit"]))
        args.steps = measured.get("steps", args.steps)
    report = {**facts,
              "model": f"{model[0]} (bench/plan_accuracy.py), batch {model[1]} x {model[2]} per rank",
              "steps": args.steps, "inter_slowdown": args.inter_slowdown, "worlds": args.worlds,
              "links": links, "rows": rows, "targets": targets(rows),
              "analysis": args.analysis.read_text() if args.analysis else None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    for world in args.worlds:
        try:
            plot(rows, world, args.out / f"{name}_w{world}.png")
        except ImportError:
            print("matplotlib is not installed: no plot")
    (args.out / f"{name}.md").write_text(render(report).replace("plan_emulated_w", f"{name}_w"))
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
