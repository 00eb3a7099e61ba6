"""Plan published ``compare`` jobs again with the planner as it is now.

    python bench/replan.py bench/results/plan_emulated/w2_1x bench/results/plan_emulated/w4_*x
    python bench/replan.py --out /tmp/replan bench/results/plan_emulated/w*   # also JSON and Markdown
    python bench/replan.py --links-from-network OLD_RUN/w4_*x   # jobs whose links' fits were timed

Each job's ``compare.json`` holds the cluster it measured (``cluster_numbers``; with ``--exposed``
also ``unlimited_cluster_numbers``) and, per strategy, the numbers measured beside its steps
(``compute_scale``, the optimizer and runtime fits). This rebuilds the clusters
(:func:`fsdp_compile.planning.cluster_numbers.cluster_from_numbers`), applies those numbers as
``compare`` did, and plans every strategy again, so a change to the cost model is judged on
published measurements in minutes. Unchanged, it reproduces the published predictions.
``--links-from-network`` plans jobs on an emulated network, written when ``Cluster.measure()``
still timed the links, on the links' fits it makes now (what the links charge).
Per strategy: the measured step, the published and the new prediction, and with ``--exposed``
the same for exposed communication, each judged by ``bench/plan_emulated.py``'s targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "lab"))

from plan_emulated import EXPOSED_FLOOR, EXPOSED_WITHIN, STEP_WITHIN
from report_files import run_facts, write_report

from fsdp_compile.network.links import parse_bandwidth, parse_latency
from fsdp_compile.planning.cli import COMPARE_PLAN_OPTIONS, build_model, cross_entropy_loss, plan_each
from fsdp_compile.planning.cluster_numbers import cluster_from_numbers
from fsdp_compile.planning.compare import clusters_beside_steps
from fsdp_compile.runtime.ring import ring_steps
from fsdp_compile_lab import HostCPU
from fsdp_compile_lab.calibration.host_collectives import backend_share

_NETWORK = re.compile(r"EmulatedNetwork\(intra_node=([^,]+), inter_node=([^,]+), latency=([^,]+),")


def job_shape(job: dict) -> tuple[int, int]:
    """(nodes, devices per node) of the job's cluster: recorded, or read from its description."""
    numbers = job["cluster_numbers"]
    if "nodes" in numbers:
        return numbers["nodes"], numbers["devices_per_node"]
    found = re.search(r"(\d+) node\(s\) x (\d+)", job.get("cluster", ""))
    if not found:
        raise SystemExit("compare.json says neither the cluster's nodes nor its description: cannot replan it")
    return int(found[1]), int(found[2])


def job_network(job: dict) -> dict[str, str] | None:
    """The emulated network the job ran on, as ``EmulatedNetwork``'s ``intra_node``,
    ``inter_node`` and ``latency`` arguments (read from its recorded description); None on plain gloo."""
    found = _NETWORK.match(str(job.get("network") or ""))
    return None if found is None else {"intra_node": found[1], "inter_node": found[2], "latency": found[3]}


def links_from_network(job: dict) -> dict:
    """``job`` with its links' fits as ``Cluster.measure()`` now makes them on an emulated
    network: what the links charge (their latency per collective and bandwidth, from the job's
    recorded network), not the timed bursts of jobs written before it read them so. Jobs on plain
    gloo come back unchanged."""
    links = job_network(job)
    if links is None:
        return job
    intra, inter = parse_bandwidth(links["intra_node"]), parse_bandwidth(links["inter_node"])
    latency = parse_latency(links["latency"])
    numbers = dict(job["cluster_numbers"])
    for key, bandwidth in (("collectives", intra), ("inter_node_collectives", inter)):
        numbers[key] = {kind: {**fit, "step_latency": latency / max(ring_steps(kind, fit["group_size"]), 1),
                               "bandwidth": bandwidth}
                        for kind, fit in numbers.get(key, {}).items()}
    return {**job, "cluster_numbers": numbers}


def job_clusters(job: dict, cores: int | None = None, rank_drift: float | None = None) -> dict[str, tuple]:
    """``plan_each``'s ``on`` for ``job``: per strategy, the job's cluster with the numbers
    measured beside that strategy's steps, and with ``--exposed`` the same on unlimited links
    (under "<strategy> unlimited"). Jobs written before the cluster recorded the backend's own
    collectives and its share take the first from their unlimited cluster's links and the
    second from ``cores`` (the machine's, all ranks on it). ``rank_drift`` plans a job whose
    world outnumbers ``cores`` with its ranks played together at that drift
    (``HostCPU.rank_drift``) whatever the job measured (jobs measured before the calibration
    read it have none); 0 plans it in lockstep, one rank's timeline."""
    if job.get("tp", 1) != 1:
        raise SystemExit("replan: jobs under tensor parallelism are not supported (their mesh is not recorded)")
    nodes, per_node = job_shape(job)
    sharing = {}
    if "backend_share" not in job["cluster_numbers"]:
        if cores is None:
            raise SystemExit("replan: this compare.json predates the backend's share of the cores: give the cores "
                             "of the machine it ran on (--cores)")
        sharing["backend_share"] = backend_share(cores / job["world"])
    if rank_drift is not None:
        if cores is None:
            raise SystemExit("replan: --rank-drift needs the cores of the machine the job ran on (--cores)")
        sharing.update({"core_sharing": (job["world"], cores), "rank_drift": rank_drift}
                       if job["world"] > cores and rank_drift > 0 else {"core_sharing": None, "rank_drift": 0.0})
    clusters = {key: cluster_from_numbers(job[key], nodes=nodes, devices_per_node=per_node, host=HostCPU)
                .with_host(**sharing) if job.get(key) else None
                for key in ("cluster_numbers", "unlimited_cluster_numbers")}
    unlimited = clusters["unlimited_cluster_numbers"]
    if unlimited is not None and not clusters["cluster_numbers"].host.backend_collectives:
        clusters["cluster_numbers"] = clusters["cluster_numbers"].with_host(
            backend_collectives=unlimited.measured_collectives,
            backend_inter_collectives=unlimited.measured_inter_collectives)
    beside = {row["strategy"]: {"compute_scale": row["compute_scale"]["beside_steps"],
                                **(row["outside_graphs"]["beside_steps"] or {})} for row in job["rows"]}
    return clusters_beside_steps(clusters["cluster_numbers"], clusters["unlimited_cluster_numbers"], beside)


def job_model(job: dict) -> tuple[torch.nn.Module, tuple]:
    """The job's model as ``compare`` built it, and one rank's example inputs."""
    torch.manual_seed(0)
    model = build_model(job["model"], layers=job.get("layers"), seq=job["seq"], device="cpu")
    return model, (torch.zeros(job["batch"], job["seq"], dtype=torch.long),)


def replan_job(job: dict, cores: int | None = None, rank_drift: float | None = None) -> list[dict]:
    """Every strategy of ``job`` planned again: one row per strategy (see :func:`job_clusters`)."""
    on = job_clusters(job, cores, rank_drift)
    model, example = job_model(job)
    plans = plan_each(model, example, on=on, loss_fn=cross_entropy_loss, world_size=job["world"], tp_degrees=(1,),
                      parallelize_fn=None, **COMPARE_PLAN_OPTIONS)
    rows = []
    for row in job["rows"]:
        name, measured = row["strategy"], row["measured"]
        out = {"strategy": name, "measured_step_s": measured["step_seconds"],
               "published_step_s": row["predicted"]["step_seconds"],
               "replanned_step_s": plans[name].row(name).as_dict()["step_seconds"]}
        if f"{name} unlimited" in plans and measured.get("exposed_seconds") is not None:
            out.update(measured_exposed_s=measured["exposed_seconds"],
                       published_exposed_s=out["published_step_s"] - row["predicted_unlimited"]["step_seconds"],
                       replanned_exposed_s=out["replanned_step_s"]
                       - plans[f"{name} unlimited"].row(name).as_dict()["step_seconds"])
        rows.append(out)
    return rows


def held(row: dict, which: str) -> tuple[bool, bool | None]:
    """(step within target, exposure within target or None) of one prediction."""
    step = abs(row[f"{which}_step_s"] / row["measured_step_s"] - 1) <= STEP_WITHIN
    if "measured_exposed_s" not in row:
        return step, None
    allowed = max(EXPOSED_WITHIN * abs(row["measured_exposed_s"]), EXPOSED_FLOOR * row["measured_step_s"])
    return step, abs(row[f"{which}_exposed_s"] - row["measured_exposed_s"]) <= allowed


def render(report: dict) -> str:
    lines = ["# Published compare jobs planned again", "",
             f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}. "
             "*Published*: the prediction in the job's compare.json; *replanned*: the same job's clusters "
             "and beside-the-steps numbers planned with this commit"
             + (", the links' fits of jobs on an emulated network taken from the links themselves, as the "
                "calibration now fits them (`--links-from-network`)" if report.get("links_from_network") else "")
             + ("" if report.get("rank_drift") is None else
                f", jobs whose world outnumbers the cores played on every rank together at a drift of "
                f"{report['rank_drift'] * 1e3:.1f} ms per square root of a second (`--rank-drift`)"
                if report["rank_drift"] > 0 else
                ", jobs whose world outnumbers the cores planned in lockstep, one rank's timeline (`--rank-drift 0`)")
             + ". Produced by `python bench/replan.py`.", "",
             "| job | strategy | measured step | published | replanned | exposed measured | published | replanned |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{1e3 * seconds:.0f} ms"

    for r in report["rows"]:
        marks = {w: held(r, w) for w in ("published", "replanned")}
        lines.append(f"| {r['job']} | {r['strategy']} | {ms(r['measured_step_s'])} | "
                     + " | ".join(f"{ms(r[f'{w}_step_s'])}{'' if marks[w][0] else ' (missed)'}"
                                  for w in ("published", "replanned"))
                     + f" | {ms(r.get('measured_exposed_s'))} | "
                     + " | ".join(f"{ms(r.get(f'{w}_exposed_s'))}{' (missed)' if marks[w][1] is False else ''}"
                                  for w in ("published", "replanned")) + " |")
    lines += ["", "## Targets", ""]
    for which in ("published", "replanned"):
        steps = [held(r, which)[0] for r in report["rows"]]
        exposed = [e for r in report["rows"] if (e := held(r, which)[1]) is not None]
        lines.append(f"- {which}: step within {STEP_WITHIN:.0%} in {sum(steps)}/{len(steps)}; exposed within "
                     f"{EXPOSED_WITHIN:.0%} or {EXPOSED_FLOOR:.0%} of the step in {sum(exposed)}/{len(exposed)}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="+", type=Path, help="directories holding a compare.json (or the files)")
    p.add_argument("--out", type=Path, help="write replan.json and replan.md here")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores of the machine the jobs ran on, for jobs that do not record the backend's share "
                        "(default: this machine's)")
    p.add_argument("--links-from-network", action="store_true",
                   help="plan emulated-network jobs on their links as the calibration now fits them (what the "
                        "links charge), where the job's own fits were timed")
    p.add_argument("--rank-drift", type=float,
                   help="plan jobs whose world outnumbers --cores with every rank played together at this drift "
                        "(HostCPU.rank_drift, seconds per square root of a second), whatever the job measured; "
                        "0: in lockstep, one rank's timeline")
    args = p.parse_args()
    rows = []
    for path in args.jobs:
        file = path / "compare.json" if path.is_dir() else path
        if not file.exists():
            raise SystemExit(f"{file}: no such compare.json")
        job = json.loads(file.read_text())
        if args.links_from_network:
            job = links_from_network(job)
        for row in replan_job(job, args.cores, args.rank_drift):
            rows.append({"job": file.parent.name, **row})
            print(f"{file.parent.name:12s} {row['strategy']:20s} step {1e3 * row['measured_step_s']:7.1f} measured, "
                  f"{1e3 * row['published_step_s']:7.1f} published, {1e3 * row['replanned_step_s']:7.1f} replanned"
                  + (f"; exposed {1e3 * row['measured_exposed_s']:6.1f} / {1e3 * row['published_exposed_s']:6.1f} / "
                     f"{1e3 * row['replanned_exposed_s']:6.1f}" if "measured_exposed_s" in row else ""), flush=True)
    report = {**run_facts(), "links_from_network": args.links_from_network, "rank_drift": args.rank_drift,
              "rows": rows}
    table = render(report)
    print(table)
    if args.out:
        write_report(args.out, "replan", report, table)


if __name__ == "__main__":
    main()
