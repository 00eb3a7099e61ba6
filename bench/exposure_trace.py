"""Collective by collective: one strategy's measured steps on an emulated network against the
planner's simulation of the same step.

    python bench/exposure_trace.py --job bench/results/plan_emulated/w4_2x --strategy HYBRID_SHARD
    python bench/exposure_trace.py --smoke

``bench/plan_emulated.py`` holds whole steps against the plan: a step, and its exposed
communication (the step on the network's links minus the same step on unlimited links). Where
an exposure misses, this looks inside. It starts a job of the published job's world on the
job's network (its links, latency and nodes), trains ``--warmup`` steps of one strategy as
``compare`` does (Python's collector between the steps, not inside them), then ``--steps``
pairs of steps, one on the network's links and one on unlimited links in alternating order
(``compare --exposed``), every rank recording each collective's issue, modeled start and end,
gloo's completion, and when its wait was called and returned (``bench/overlap.py``'s tracer). The planner simulates the same step on the job's own
clusters (the numbers measured beside that strategy's steps, rebuilt as ``bench/replan.py``
does) with a trace of the same events (``simulate_events(trace=...)``). That trace is one
rank's timeline (lockstep); where the job's ranks outnumber its cores and its cluster measured
their drift, the plan's step is every rank played together (the lab's ``fsdp_compile_lab.host.shared_cores``), which
it does not trace: its planned step is that one, its collectives lockstep's.

Per collective in issue order, on the network and on unlimited links: when it was issued and
how long its wait blocked, measured (per step the slowest rank, then the median over steps) and
simulated, and how long gloo finished after the link's modeled end. The collectives of a step
are matched by issue order; the report says so where the measured and simulated counts differ.
Writes ``<out>/exposure_trace_<job>_<strategy>.json`` and ``.md``.
"""

from __future__ import annotations

import gc
import itertools
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

from parts import parser, run_part
from replan import job_clusters, job_model, job_network, job_shape
from report_files import run_facts, write_report

PUBLISHED = ROOT / "bench" / "results" / "plan_emulated"
# --smoke: a published world-2 job's network and clusters, with a model small enough to check that it runs
SMOKE_JOB, SMOKE_MODEL = PUBLISHED / "w2_1x", {"model": "gpt-tiny", "layers": None, "seq": 32, "batch": 2}


def load_job(path: Path, smoke: bool) -> dict:
    """The ``compare.json`` of the job at ``path`` (``--smoke``: with :data:`SMOKE_MODEL`)."""
    file = path / "compare.json" if path.is_dir() else path
    if not file.exists():
        raise SystemExit(f"{file}: no such compare.json (a bench/plan_emulated.py job directory)")
    job = json.loads(file.read_text())
    return {**job, **SMOKE_MODEL} if smoke else job


def _network_args(job: dict) -> dict:
    links = job_network(job)
    if links is None:
        raise SystemExit("exposure_trace: the job ran on plain gloo; give a job of an emulated network")
    _, per_node = job_shape(job)
    return {**links, "devices_per_node": per_node}


def worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from overlap import Tracer

    import fsdp_compile
    from fsdp_compile.compilation import collector_paused
    from fsdp_compile.network.links import unlimited_links
    from fsdp_compile.planning.cli import build_model
    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    job = load_job(args.job, args.smoke)
    network = fsdp_compile.EmulatedNetwork(**_network_args(job))
    network.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job["world"]:
        raise SystemExit(f"the job ran {job['world']} ranks; this one has {world}")
    options = {"shard_size": network.devices_per_node} if args.strategy.startswith("HYBRID") else {}
    backend = fsdp_compile.backend(args.strategy, compiler=job["compiler"], **options)
    torch.manual_seed(0)
    base = build_model(job["model"], layers=job.get("layers"), seq=job["seq"], device="cpu")
    vocab = base.cfg.vocab_size
    model = backend.shard(base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1 + rank)

    def step() -> None:
        data = torch.randint(0, vocab, (job["batch"], job["seq"] + 1), generator=gen)
        logits = compiled(data[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab).float(), data[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def traced() -> dict:
        gc.collect(1)  # as compare runs its steps: the collector between them, not inside
        with collector_paused():
            dist.barrier()
            tracer = Tracer()
            start, cpu = time.monotonic(), time.process_time()
            with tracer.active():
                step()
            wall, cpu = time.monotonic() - start, time.process_time() - cpu
        tracer.gloo_seen_done()
        return {"wall": wall, "process_cpu": cpu, "trace": tracer.records(start)}

    for _ in range(args.warmup):
        dist.barrier()
        step()
    steps = []
    for i in range(args.steps):
        pair = {}
        for where in (("network", "unlimited") if i % 2 == 0 else ("unlimited", "network")):
            if where == "unlimited":
                with unlimited_links(network):
                    pair[where] = traced()
            else:
                pair[where] = traced()
        steps.append(pair)
    everyone = [None] * world
    dist.all_gather_object(everyone, steps)
    if rank == 0:
        Path(args.part).write_text(json.dumps({"ranks": everyone, "load_average": os.getloadavg()[0],
                                               "cores": len(os.sched_getaffinity(0))}))
    end_process_group()


def simulated(job: dict, strategy: str) -> dict:
    """The planner's trace of ``strategy``'s step on the job's network and on unlimited links."""
    from fsdp_compile.planning.world import fake_world

    with fake_world(job["world"]):  # plan() traces in it, and the graphs' groups resolve in it after
        return _simulated(job, strategy)


def _simulated(job: dict, strategy: str) -> dict:
    from fsdp_compile.planning.cli import COMPARE_PLAN_OPTIONS, cross_entropy_loss
    from fsdp_compile.planning.cost import COLLECTIVE_KIND, graph_costs
    from fsdp_compile.planning.plan import plan
    from fsdp_compile.planning.simulate import simulate_graph

    on = job_clusters(job)
    model, example = job_model(job)
    out = {}
    for where, key in (("network", strategy), ("unlimited", f"{strategy} unlimited")):
        cluster = on[key][0]
        result = plan(model, example, cluster=cluster, strategies=[strategy], loss_fn=cross_entropy_loss,
                      world_size=job["world"], **COMPARE_PLAN_OPTIONS)
        (traced,) = result._context.traced.values()  # the graphs it simulated
        records, clock, groups = [], 0.0, {}
        for record in traced.records:
            for phase, gm in (("forward", record.forward), ("backward", record.backward)):
                if gm is None:
                    continue
                costs = graph_costs(gm, cluster, groups)
                wire = {node: cost.wire_bytes for node, cost in costs}
                trace: list[dict] = []
                timeline = simulate_graph(costs, cluster.comm_overlap, cluster.host, trace)
                for r in trace:
                    records.append({"phase": phase, "kind": COLLECTIVE_KIND[r["key"].target], "link": r["link"],
                                    "wire_mb": wire[r["key"]] / 1e6, "modeled_ms": r["seconds"] * 1e3,
                                    **{k: (clock + r[k]) * 1e3 for k in ("issued", "start", "end", "wait_called",
                                                                          "wait_returned")}})
                clock += timeline.seconds
        row = result.row(strategy)
        backend_cpu = row.backend_cpu_seconds or 0.0
        out[where] = {"step_ms": row.step_seconds * 1e3, "graphs_ms": clock * 1e3, "collectives": records,
                      # what the plan's step is made of: the CPU it prices on one rank's timeline (compute,
                      # stretched where ranks share cores, and the backend's CPU it charges to compute),
                      # and its waits (its exposed communication less that backend CPU)
                      "planned_cpu_ms": (row.compute_seconds + backend_cpu) * 1e3,
                      "planned_waits_ms": (row.exposed_comm_seconds - backend_cpu) * 1e3}
    return out


def measured(ranks: list, where: str, cores: int) -> dict:
    """Per step the slowest rank; per collective the median over those steps."""
    slowest = [max((r[i][where] for r in ranks), key=lambda s: s["wall"]) for i in range(len(ranks[0]))]
    counts = {len(s["trace"]) for s in slowest}
    n = min(counts)

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    shared = shared_waits(ranks, where, cores)
    rows = []
    for i in range(n):
        same = [s["trace"][i] for s in slowest]
        first = same[0]
        blocked = [c["wait_returned"] - c["wait_called"] if c["wait_called"] is not None else None for c in same]
        late = [c["gloo_done"] - c["end"] if c["gloo_done"] is not None else None for c in same]
        rows.append({"kind": first["kind"], "link": first["link"], "modeled_ms": median([c["modeled_ms"] for c in same]),
                     "issued": median([c["issued"] for c in same]), "blocked_ms": median(blocked),
                     "gloo_late_ms": median(late), "idling_share": shared["idling_share"].get(i)})
    return {"step_ms": statistics.median(s["wall"] for s in slowest) * 1e3, "counts": sorted(counts),
            "collectives": rows, "waits_idle_core_ms": shared["idle_core_ms"], **core_account(ranks, where, cores)}


def shared_waits(ranks: list, where: str, cores: int) -> dict:
    """How the ranks' waits line up in time. A core idles while fewer ranks than cores can run
    (their main threads; gloo's are not counted). ``idle_core_ms``: the median over steps of the
    core time idled so; ``idling_share``: per collective (issue order), the share of the ranks'
    waits on it, over every rank and step, during which a core idled. The ranks' clocks are
    their own steps' starts, which follow one barrier."""
    world = len(ranks)
    idle, blocked, idling = [], {}, {}
    for i in range(len(ranks[0])):
        waits = [[(c["wait_called"], c["wait_returned"], k) for k, c in enumerate(r[i][where]["trace"])
                  if c["wait_called"] is not None and c["wait_returned"] > c["wait_called"]] for r in ranks]
        edges = sorted({t for rank in waits for a, b, _ in rank for t in (a, b)})
        total = 0.0
        for lo, hi in itertools.pairwise(edges):
            inside = [[k for a, b, k in rank if a <= lo and hi <= b] for rank in waits]
            waiting = sum(1 for ks in inside if ks)
            short = max(0, cores - (world - waiting))  # cores with no rank to run
            total += short * (hi - lo)
            for ks in inside:
                for k in ks:
                    blocked[k] = blocked.get(k, 0.0) + (hi - lo)
                    if short:
                        idling[k] = idling.get(k, 0.0) + (hi - lo)
        idle.append(total)
    return {"idle_core_ms": statistics.median(idle) if idle else 0.0,
            "idling_share": {k: idling.get(k, 0.0) / v for k, v in blocked.items() if v > 0}}


def core_account(ranks: list, where: str, cores: int) -> dict:
    """Where the ranks outnumber the cores, a step's wall time is the CPU every rank's threads
    spent over the cores, plus the time cores stood idle over the cores: medians over steps of
    the step (the slowest rank's), the ranks' summed process CPU, the idle core time
    (cores x step - CPU) and the ranks' mean time blocked in waits, ms."""
    steps = range(len(ranks[0]))
    wall = [max(r[i][where]["wall"] for r in ranks) for i in steps]
    cpu = [sum(r[i][where]["process_cpu"] for r in ranks) for i in steps]
    blocked = [statistics.mean(sum(c["wait_returned"] - c["wait_called"] for c in r[i][where]["trace"]
                                   if c["wait_called"] is not None) for r in ranks) for i in steps]
    return {"ranks_cpu_ms": statistics.median(cpu) * 1e3,
            "idle_core_ms": statistics.median(cores * w - c for w, c in zip(wall, cpu)) * 1e3,
            "mean_rank_blocked_ms": statistics.median(blocked)}


def render(report: dict) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    m, s = report["measured"], report["simulated"]
    lines = [f"# {report['strategy']} at {report['job']}: measured collective by collective against the plan", "",
             f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; the "
             f"job's model ({report['model']}), network ({report['network']}) and clusters; {report['steps']} pairs "
             f"of traced steps (network, unlimited links) after {report['warmup']} warm-up steps; measured: per "
             "step the slowest rank, the median over steps. Produced by `python bench/exposure_trace.py`.", ""]
    cores = report["cores"]
    lines += [f"| links | step measured | planned step (its graphs) | ranks' CPU / {cores} cores | idle cores / "
              f"{cores} | the same, counting the main threads alone | a rank blocked in waits, measured (mean over "
              "ranks) | simulated |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for where in ("network", "unlimited"):
        blocked_s = sum(c["wait_returned"] - c["wait_called"] for c in s[where]["collectives"])
        lines.append(f"| {where} | {f(m[where]['step_ms'])} ms | {f(s[where]['step_ms'])} ms "
                     f"({f(s[where]['graphs_ms'])} ms) | {f(m[where]['ranks_cpu_ms'] / cores)} ms | "
                     f"{f(m[where]['idle_core_ms'] / cores)} ms | {f(m[where]['waits_idle_core_ms'] / cores)} ms | "
                     f"{f(m[where]['mean_rank_blocked_ms'])} ms | {f(blocked_s)} ms |")
    lines += ["", f"Collectives per step: measured {m['network']['counts']} (network), {m['unlimited']['counts']} "
              f"(unlimited), simulated {len(s['network']['collectives'])}."
              + ("" if m["network"]["counts"] == [len(s["network"]["collectives"])] else
                 " The counts differ: rows are matched by issue order up to the shorter list."), "",
              "| # | phase | kind | link | MB sent | modeled ms | issued at, measured / simulated | blocked on the "
              "network, measured / simulated | of the ranks' waits on it, the share with a core idle | gloo after "
              "the modeled end | blocked on unlimited links, measured / simulated |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, (mn, sn) in enumerate(zip(m["network"]["collectives"], s["network"]["collectives"])):
        mu = m["unlimited"]["collectives"][i] if i < len(m["unlimited"]["collectives"]) else {}
        su = s["unlimited"]["collectives"][i] if i < len(s["unlimited"]["collectives"]) else None
        lines.append(
            f"| {i} | {sn['phase']} | {mn['kind']} | {mn['link']} | {sn['wire_mb']:.2f} | {f(mn['modeled_ms'])} | "
            f"{f(mn['issued'])} / {f(sn['issued'])} | {f(mn['blocked_ms'])} / "
            f"{f(sn['wait_returned'] - sn['wait_called'])} | "
            f"{'-' if mn.get('idling_share') is None else format(mn['idling_share'], '.0%')} | "
            f"{f(mn['gloo_late_ms'])} | {f(mu.get('blocked_ms'))} / "
            f"{f(su['wait_returned'] - su['wait_called']) if su else '-'} |")
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"]]
    return "\n".join(lines) + "\n"


def summary(reports: list[dict], analysis: str | None) -> str:
    """One table over several jobs' reports: each step split into CPU and idle cores, measured
    and planned, and the exposure (network minus unlimited links) both ways."""
    lines = ["# Inside the planner's exposure misses: the cores' account", "",
             "Each row is one `bench/exposure_trace.py` report (linked): a published `bench/plan_emulated.py` job's "
             "strategy, traced again on the job's network and on unlimited links, with the planner's simulation "
             "of the same step from the job's own clusters. Per links: the step, measured (the slowest rank, "
             "median over steps) / planned; the ranks' CPU over the cores, measured / the CPU the plan prices on "
             "its one rank's timeline; and the cores' idle time over the cores, measured / the plan's waits "
             "(where every rank waits at once, as the plan assumes, the cores idle for as long as one rank "
             "waits). *Exposed*: network minus unlimited links, measured / planned. ms. Produced by "
             "`python bench/exposure_trace.py --summary REPORT...`.", "",
             "| job | strategy | step, network | step, unlimited | exposed | CPU / cores, network | "
             "CPU / cores, unlimited | idle / cores, network | idle / cores, unlimited |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        m, s, cores = r["measured"], r["simulated"], r["cores"]

        def pair(a: float, b: float) -> str:
            return f"{a:.0f} / {b:.0f}"

        name = f"exposure_trace_{r['job']}_{r['strategy'].lower()}.md"
        lines.append(
            f"| [{r['job']}]({name}) | {r['strategy']} | {pair(m['network']['step_ms'], s['network']['step_ms'])} | "
            f"{pair(m['unlimited']['step_ms'], s['unlimited']['step_ms'])} | "
            f"{pair(m['network']['step_ms'] - m['unlimited']['step_ms'], s['network']['step_ms'] - s['unlimited']['step_ms'])} | "
            + " | ".join(pair(m[w]["ranks_cpu_ms"] / cores, s[w]["planned_cpu_ms"]) for w in ("network", "unlimited"))
            + " | " + " | ".join(pair(m[w]["idle_core_ms"] / cores, s[w]["planned_waits_ms"])
                                 for w in ("network", "unlimited")) + " |")
    if analysis:
        lines += ["", "## Analysis", "", analysis]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, steps=6, warmup=2)
    p.add_argument("--job", type=Path, help="a bench/plan_emulated.py job directory (its compare.json; default: "
                   "w4_2x of bench/results/plan_emulated, with --smoke w2_1x)")
    p.add_argument("--strategy", default="HYBRID_SHARD")
    p.add_argument("--reuse", action="store_true", help="simulate and render again from the ranks' traces already written")
    p.add_argument("--summary", nargs="+", type=Path, metavar="REPORT",
                   help="write <out>/exposure_trace.md: one table over these reports (exposure_trace_*.json)")
    args = p.parse_args()
    if args.summary:
        reports = [json.loads(path.read_text()) for path in args.summary]
        (args.out / "exposure_trace.md").write_text(summary(reports, args.analysis.read_text() if args.analysis else None))
        return
    args.job = args.job or (SMOKE_JOB if args.smoke else PUBLISHED / "w4_2x")
    if args.part:
        worker(args)
        return
    job = load_job(args.job, args.smoke)
    if args.strategy not in {row["strategy"] for row in job["rows"]}:
        raise SystemExit(f"--strategy {args.strategy}: the job measured "
                         + ", ".join(row["strategy"] for row in job["rows"]))
    extra = ("--job", str(args.job.resolve()), "--strategy", args.strategy)
    stem = f"exposure_trace_{args.job.name}_{args.strategy.lower()}" + ("_smoke" if args.smoke else "")
    raw = args.out / f"{stem}_ranks.json"
    if args.reuse and raw.exists():  # rendered again: the figures keep when and where they were measured
        part = json.loads(raw.read_text())
    else:
        part = {**run_part(__file__, args, job["world"], extra), "facts": run_facts()}
        args.out.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(part))
    report = {**(part.get("facts") or run_facts()), "job": args.job.name, "strategy": args.strategy, "model": job["model"],
              "network": job["network"], "steps": args.steps, "warmup": args.warmup,
              "load_average": part["load_average"], "simulated": simulated(job, args.strategy),
              "cores": part["cores"],
              "measured": {where: measured(part["ranks"], where, part["cores"]) for where in ("network", "unlimited")},
              "analysis": args.analysis.read_text() if args.analysis else None}
    table = render(report)
    write_report(args.out, stem, report, table)
    print(table)


if __name__ == "__main__":
    main()
