"""Where an emulated network's collectives finish late: a peer that reaches them late, or gloo.

The planner's referee (`bench/plan_emulated.py`) reads figures on an emulated network only as
far as the emulation held: gloo finishing a collective after the modeled link would have is an
*overrun*. This benchmark says what the overruns are made of. It trains the planner benchmark's
model (gpt_small, batch 4 x 128 per rank, AdamW, aot_eager) with fsdp_compile on the emulated
network, records the timed steps' collectives (`EmulatedNetwork.record`) and splits their
lateness (`fsdp_compile.network.lateness_causes`): the part the group's last rank's late
arrival explains (gloo cannot start before every rank has issued), and the rest, gloo's own
transfer after the last rank issued. World 2 (a core per rank) and world 4 (2 nodes x 2, the
inter-node link 10x slower, 4 ranks on 2 cores), on plain links and at plan_emulated's 1x and
2x points.

    python bench/emulation_lateness.py              # every point, about 10 minutes here
    python bench/emulation_lateness.py --smoke      # world 2, one point, a tiny model

Writes bench/results/emulation_lateness.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import parser, run_part
from report_files import run_facts, write_report

# (world, strategy, label, intra-node, inter-node): plan_emulated's points (its results file)
POINTS = [
    (2, "FULL_SHARD", "plain links", "inf", "inf"),
    (2, "FULL_SHARD", "1x", "76MB/s", "76MB/s"),
    (4, "FULL_SHARD", "plain links", "inf", "inf"),
    (4, "FULL_SHARD", "1x", "639MB/s", "64MB/s"),
    (4, "HYBRID_SHARD_ZERO2", "plain links", "inf", "inf"),
    (4, "HYBRID_SHARD_ZERO2", "2x", "319MB/s", "32MB/s"),
]
SMOKE_POINTS = [(2, "FULL_SHARD", "1x", "76MB/s", "76MB/s")]


def _bandwidth(text: str) -> float | str:
    return float("inf") if text == "inf" else text


def rank_main(args: argparse.Namespace) -> None:
    """One point, on this torchrun job's ranks; rank 0 writes the result to ``args.part``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from plan_accuracy import gpt_small, gpt_tiny

    import fsdp_compile
    from fsdp_compile.network import lateness_causes
    from fsdp_compile.sharding.groups import end_process_group

    net = fsdp_compile.EmulatedNetwork(intra_node=_bandwidth(args.intra), inter_node=_bandwidth(args.inter),
                                       latency="20us", devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, batch, seq = (gpt_tiny(), 2, 32) if args.smoke else (gpt_small(), 4, 128)
    vocab = model.tok_emb.num_embeddings
    backend = fsdp_compile.backend(args.strategy, compiler="aot_eager",
                                   **({"shard_size": 2} if args.strategy.startswith("HYBRID") else {}))
    backend.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        F.cross_entropy(compiled(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):  # compiles; ranks drift apart by seconds here
        step()
    dist.barrier()
    net.reset_stats()
    net.record()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    causes = lateness_causes(net)
    net.record(False)
    if rank == 0:
        stats = net.stats()
        result = {"world": world, "strategy": args.strategy, "label": args.label, "intra": args.intra,
                  "inter": args.inter, "steps": args.steps, "step_seconds": statistics.median(times),
                  "overrun_summary_rank0": stats.overrun_summary(), "overruns_rank0": stats.overruns().count,
                  **causes.to_dict(), "summary": causes.summary()}
        Path(args.part).write_text(json.dumps(result, indent=2))
    end_process_group(exit_process=True)  # gloo's threads can abort a finalizing interpreter (its docstring)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def render(report: dict) -> str:
    lines = [
        "# Where the emulated network's collectives finish late",
        "",
        f"Run {report['when']} on {report['machine']}, torch {report['torch']}, commit {report['commit']}; "
        f"{report['model']}, {report['steps']} timed steps after {report['warmup']} warm-up steps, every rank's "
        "collectives of "
        "the timed steps recorded. *Late*: gloo finished after the modeled link would have; *from a late peer*: "
        "how late it would still have been had gloo finished the moment the group's last rank issued it; the "
        "rest is gloo's own. *Wait for the last rank* and *gloo after it*: over the late collectives, 10th / "
        "50th / 90th percentile, ms. Produced by `python bench/emulation_lateness.py`.",
        "",
        "| world | strategy | links (intra / inter) | step | late / recorded | lateness per step | from a late peer "
        "| wait for the last rank | gloo after it |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        links = "plain (unlimited)" if r["label"] == "plain links" else f"{r['label']}: {r['intra']} / {r['inter']}"
        per_step = r["lateness_seconds"] / r["steps"] / r["world"]
        lines.append(
            f"| {r['world']} | {r['strategy']} | {links} | {1e3 * r['step_seconds']:.0f} ms | {r['late']} / "
            f"{r['collectives']} | {_ms(per_step)} ms per rank | {100 * r['from_peers_share']:.0f}% | "
            f"{' / '.join(_ms(s) for s in r['peer_wait_seconds'])} | "
            f"{' / '.join(_ms(s) for s in r['gloo_after_last_seconds'])} |")
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, steps=8, warmup=2)
    # one point, given to the job's ranks by the parent
    for name in ("strategy", "label", "intra", "inter"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        rank_main(args)
        return
    if args.smoke:
        args.steps = 2
    rows = []
    for world, strategy, label, intra, inter in SMOKE_POINTS if args.smoke else POINTS:
        row = run_part(__file__, args, world, ("--strategy", strategy, "--label", label, "--intra", intra,
                                               "--inter", inter))
        print(f"  world {world} {strategy} {label}: {row['summary']}", flush=True)
        rows.append(row)
    report = {**run_facts(), "steps": args.steps, "warmup": args.warmup,
              "model": ("gpt_tiny, batch 2 x 32" if args.smoke else "gpt_small (bench/plan_accuracy.py), batch 4 x 128")
              + " per rank, AdamW, aot_eager",
              "rows": rows, "analysis": args.analysis.read_text() if args.analysis else None}
    table = render(report)
    write_report(args.out, "emulation_lateness_smoke" if args.smoke else "emulation_lateness", report, table)
    print(table)


if __name__ == "__main__":
    main()
