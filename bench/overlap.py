"""Does overlap pay? Training steps on an emulated cluster network, link speed swept against compute.

    python bench/overlap.py                      # every strategy; launches its own torchrun jobs
    python bench/overlap.py --smoke              # tiny sizes, 1 round: checks that it runs
    python bench/overlap.py --strategies FULL_SHARD --rounds 2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/overlap.py --strategies FULL_SHARD
                                                 # one job by hand (world 2; 4 for the hybrid strategies)

Every collective runs through gloo but completes only when an emulated link would have finished it
(:class:`fsdp_compile.EmulatedNetwork`), sleeping meanwhile. A step then costs max(compute,
communication) where communication is hidden under compute, and their sum where it is not.

FULL_SHARD, SHARD_GRAD_OP and NO_SHARD run on 2 ranks (one node); HYBRID_SHARD and
HYBRID_SHARD_ZERO2 on 4 ranks as 2 nodes x 2, the inter-node link ``--inter-slowdown`` (10) times
slower than the intra-node one. Per strategy, in the same processes, the variants:

  fsdp_compile_scheduled    fsdp_compile, default options (Inductor, scheduling on);
  fsdp_compile_unscheduled  the same with ``schedule=False``;
  fsdp2_eager               torch FSDP2 ``fully_shard`` per block + root, resharding as the strategy does
                            (HSDP on a 2-D mesh for the hybrid strategies);
  fsdp2_compile             the same under ``torch.compile`` (Inductor);
  ddp                       DistributedDataParallel, the data-parallel reference: measured with NO_SHARD
                            (the same all-reduce of every gradient at world 2) and with HYBRID_SHARD
                            (world 4, its all-reduce spanning the nodes on the inter-node link).

Points: the link first unlimited (``float("inf")``, 1 ns latency): a variant's step there is its
*compute* time. Then, for each ``--ratios`` value r, the bandwidth at which fsdp_compile_scheduled's
modeled communication per step is r times its compute (from its own collectives, counted by the
network on the unlimited link: wire bytes and count per link, so ``latency x count + bytes /
bandwidth = r x compute`` on the busier link). Every variant runs at every point, in the same
processes, on the same compiled code (``EmulatedNetwork.set_links``).

Method, as ``bench/train_step.py``: every variant built and warmed up once; ``--rounds`` rounds, the
point order and the variant order rotated each round; at each point one untimed step per variant,
then ``--steps`` steps interleaved one variant at a time; a variant's figure in a round is the
median of its steps (max over ranks); reported: the median over rounds with the range, ratios per
round with their range, "within noise" where a range includes 1.

Per row (strategy x point x variant): step time, compute time (the variant's step on the unlimited
link, same round), modeled communication per step (busy seconds of the busier link, from
``net.stats()``), exposed communication (step - compute), the limit max(compute, communication),
and the emulation's overruns (collectives gloo itself finished after their modeled end: a row
whose overruns add up to more than 2% of its step time is marked as not resting on the emulated
link alone). One step of each fsdp_compile variant per point is traced collective by collective
(issue, modeled start and end, gloo's completion, when the step waited and how long it was
blocked). Writes ``<out>/<name>.json``, ``.md`` and a plot per strategy (``<name>_<strategy>.png``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import rank_env, torchrun_command
from report_files import write_report
from rounds import fmt_ratio, fmt_spread, rotated, spread

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.network import emulated
from fsdp_compile.network.links import UNLIMITED_LINKS, format_bandwidth
from fsdp_compile.sharding.groups import end_process_group

FLAT = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
VARIANTS = ("fsdp_compile_scheduled", "fsdp_compile_unscheduled", "fsdp2_eager", "fsdp2_compile", "ddp")
# DDP is one algorithm whatever the strategy: measured where its collectives compare.
DDP_WITH = {"NO_SHARD": "NO_SHARD at world 2: the same all-reduce of every gradient",
            "HYBRID_SHARD": "HYBRID_SHARD at 2 x 2: DDP all-reduces every gradient over all 4 ranks, across nodes"}
# Measured at the unlimited point only, once per job: what the step costs without communication
# (one rank's model, no collectives) and with plain gloo instead of the emulated link.
REFERENCES = ("local", "fsdp_compile_gloo")
UNLIMITED = 0.0  # the ratio that names the unlimited point
LATENCY = 20e-6  # per collective on the swept links: NVLink / InfiniBand order
HELD_OVERRUN = 0.02  # a row's overruns may add up to this share of its step and it still counts


# ---------------------------------------------------------------------------------------------- variants
def fsdp2_mesh(strategy: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "NO_SHARD":  # replicated over every rank: FSDP2 all-reduces as DDP does
        return init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    if strategy in HYBRID:
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def plain_groups(strategy: str, world: int, plain):
    """Plain gloo groups for the strategy: the world, or (shard group, replicate group) of 2 x 2."""
    if strategy not in HYBRID:
        return plain
    rank = dist.get_rank()
    # Every rank takes part in creating every group, its own or not.
    shards = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 1], [2, 3])]
    replicas = [dist.new_group(ranks, backend="gloo") for ranks in ([0, 2], [1, 3])]
    return shards[rank // 2], replicas[rank % 2]


def build(variant: str, strategy: str, base: torch.nn.Module, world: int, compiler: str, plain) -> tuple:
    """(model whose parameters the optimizer steps, callable for the forward)."""
    model = copy.deepcopy(base)
    if variant == "local":
        return model, torch.compile(model, backend=compiler)
    if variant.startswith("fsdp_compile"):
        options: dict[str, Any] = {"compiler": compiler, "schedule": variant != "fsdp_compile_unscheduled"}
        if variant == "fsdp_compile_gloo":
            options["process_groups"] = plain_groups(strategy, world, plain)
        elif strategy in HYBRID:
            options["shard_size"] = 2
        backend = fsdp_compile.backend(strategy, **options)
        backend.shard(model)
        return model, torch.compile(model, backend=backend)
    if variant.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        mesh = fsdp2_mesh(strategy, world)
        reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
        # Every unit, the root too, reshards as the strategy says (FSDP2's default keeps the
        # root's parameters for backward).
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model, (torch.compile(model, backend=compiler) if variant == "fsdp2_compile" else model)
    if variant == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model)
    raise ValueError(variant)


class Tracer:
    """Every collective of one step, from issue to the end of its wait (for finding what blocks).

    Wraps the emulated group's issue and the works' wait for as long as it is active; the network
    keeps issue time, modeled start and end and gloo's completion on each work already."""

    def __init__(self) -> None:
        self.works: list = []
        self.waits: dict[int, list[float]] = {}

    @contextlib.contextmanager
    def active(self):
        group, work_cls = emulated.EmulatedProcessGroup, emulated.EmulatedWork
        issue, wait = group._issue, work_cls.wait
        tracer = self

        def traced_issue(pg, *args, **kwargs):
            work = issue(pg, *args, **kwargs)
            tracer.works.append(work)
            return work

        def traced_wait(work, *args, **kwargs):
            called = time.monotonic()
            try:
                return wait(work, *args, **kwargs)
            finally:
                tracer.waits.setdefault(id(work), [called, time.monotonic()])

        group._issue, work_cls.wait = traced_issue, traced_wait
        try:
            yield self
        finally:
            group._issue, work_cls.wait = issue, wait

    def gloo_seen_done(self, timeout: float = 10.0) -> None:
        """Wait until gloo's completion of every traced work has been seen (on the network's
        own threads: the step itself waited only for the modeled ends), at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while any(w.gloo_done_at is None for w in self.works) and time.monotonic() < deadline:
            time.sleep(0.001)

    def waited(self) -> tuple[float, float, int]:
        """(seconds the step spent in waits, seconds of them past the modeled ends, waits): the
        second is what the step owes to gloo (or to waking up) rather than to the emulated link."""
        blocked = beyond = 0.0
        for w in self.works:
            if id(w) in self.waits:
                called, returned = self.waits[id(w)]
                blocked += returned - called
                beyond += max(0.0, returned - max(called, w.modeled_end))
        return blocked, beyond, len(self.waits)

    def records(self, origin: float) -> list[dict]:
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - origin) * 1e3, 3)

        out = []
        for w in self.works:
            called, returned = self.waits.get(id(w), (None, None))
            out.append({"kind": w.kind, "link": w.link, "modeled_ms": round(w.seconds * 1e3, 3),
                        "issued": ms(w.issued_at), "start": ms(w.modeled_start), "end": ms(w.modeled_end),
                        "gloo_done": ms(w.gloo_done_at), "wait_called": ms(called), "wait_returned": ms(returned)})
        return out


class Variant:
    """One way of training the model: its module, forward, optimizer and data stream."""

    def __init__(self, name: str, strategy: str, base: torch.nn.Module, cfg: GPTConfig, batch: int, rank: int,
                 world: int, compiler: str, plain) -> None:
        self.name, self.cfg, self.batch = name, cfg, batch
        self.model, self.forward = build(name, strategy, base, world, compiler, plain)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        # Each variant draws its own copy of the same stream: every variant sees the same batches.
        self.gen = torch.Generator().manual_seed(1000 + rank)

    def step(self) -> None:
        idx = torch.randint(0, self.cfg.vocab_size, (self.batch, self.cfg.block_size + 1), generator=self.gen)
        x, y = idx[:, :-1], idx[:, 1:]
        loss = F.cross_entropy(self.forward(x).reshape(-1, self.cfg.vocab_size), y.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def timed_step(self, net, plain, trace: bool = False) -> dict:
        """One step after a barrier: wall and CPU seconds, and what the links did in it."""
        dist.barrier(group=plain)
        net.reset_stats()
        tracer = Tracer()
        start, start_thread, start_process = time.monotonic(), time.thread_time(), time.process_time()
        with tracer.active():
            self.step()
        wall = time.monotonic() - start
        out = {"wall": wall, "main_cpu": time.thread_time() - start_thread,
               "process_cpu": time.process_time() - start_process}
        tracer.gloo_seen_done()  # before reading the overruns
        stats = net.stats()
        out["busy"] = {link: stats.total(link=link).busy_seconds for link in ("intra", "inter")}
        out["count"] = {link: stats.count(link=link) for link in ("intra", "inter")}
        out["wire"] = {link: stats.total(link=link).wire_bytes for link in ("intra", "inter")}
        o = stats.overruns()
        out["overruns"] = {"count": o.count, "observed": o.observed, "max_s": o.max_seconds, "total_s": o.total_seconds}
        out["blocked"], out["beyond"], out["waits"] = tracer.waited()
        if trace:
            out["trace"] = tracer.records(start)
        return out


# ---------------------------------------------------------------------------------------------- measuring
@dataclasses.dataclass
class EmulatedRank:
    """This rank of a torchrun job on an emulated network, and a plain gloo group beside it (for
    barriers and for gathering results without going through the emulated links)."""

    net: Any
    rank: int
    world: int
    plain: Any

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)


def emulated_rank(devices_per_node: int, minutes: int = 30) -> EmulatedRank:
    """Start this rank's process group on an :class:`fsdp_compile.EmulatedNetwork` (unlimited
    links until ``set_links``), with a plain group beside it; one intra-op thread per rank."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ["WORLD_SIZE"])
    net = fsdp_compile.EmulatedNetwork(math.inf, latency=1e-9, devices_per_node=devices_per_node)
    net.init_process_group(timeout=datetime.timedelta(minutes=minutes))
    plain = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(minutes=minutes))
    return EmulatedRank(net, dist.get_rank(), world, plain)


def timed_on(net, plain, step) -> tuple[float, Any]:
    """(wall seconds, the network's stats) of ``step()``, the ranks lined up first on ``plain``."""
    dist.barrier(group=plain)
    net.reset_stats()
    start = time.monotonic()
    step()
    return time.monotonic() - start, net.stats()


def gathered(value: Any, world: int, plain) -> list:
    out = [None] * world
    dist.all_gather_object(out, value, group=plain)
    return out


def link_speeds(ratio: float, compute: float, per_step: dict, slowdown: float) -> dict:
    """The links at which the busier one is busy ``ratio x compute`` seconds a step.

    ``per_step``: {link: (wire bytes, collectives)} a step puts on it; the inter-node link runs
    ``slowdown`` times slower than the intra-node one."""
    if ratio == UNLIMITED:
        return dict(UNLIMITED_LINKS)
    target = ratio * compute
    needed = 0.0  # the intra-node bandwidth each link asks for
    for link, (wire, count) in per_step.items():
        if not count:
            continue
        transfer = target - LATENCY * count
        if transfer <= 0:
            raise SystemExit(f"{count} collectives a step pay {LATENCY * count * 1e3:.1f} ms of latency, more than "
                             f"{ratio} x compute ({target * 1e3:.1f} ms): use a larger model or fewer ratios")
        needed = max(needed, wire * (slowdown if link == "inter" else 1.0) / transfer)
    if needed == 0.0:
        raise SystemExit("no collective on any link: nothing to sweep")
    return {"intra_node": needed, "inter_node": needed / slowdown, "latency": LATENCY}


def per_step_links(samples: list[dict]) -> dict:
    return {link: (statistics.median(s["wire"][link] for s in samples), round(statistics.median(
        s["count"][link] for s in samples))) for link in ("intra", "inter")}


def measure_strategy(args, strategy: str, base, cfg, rank: int, world: int, net, plain, references: list[str],
                     log: Callable[[str], None]) -> dict:
    torch._dynamo.reset()
    net.set_links(**UNLIMITED_LINKS)
    variants = [v for v in args.variants if v != "ddp" or strategy in DDP_WITH]
    built: dict[str, Variant] = {}
    compile_s: dict[str, float] = {}
    for name in [*variants, *references]:
        start = time.monotonic()
        built[name] = Variant(name, strategy, base, cfg, args.batch, rank, world, args.compiler, plain)
        for _ in range(args.warmup):
            built[name].timed_step(net, plain)
        compile_s[name] = time.monotonic() - start
        log(f"{strategy} {name}: built, {compile_s[name]:.1f} s with {args.warmup} warm-up steps")

    # Calibration: the compute time and the collectives of fsdp_compile_scheduled on the unlimited link.
    ref = built["fsdp_compile_scheduled"]
    samples = [ref.timed_step(net, plain) for _ in range(args.calibration_steps)]
    walls = gathered(statistics.median(s["wall"] for s in samples), world, plain)
    compute = max(walls)
    per_link = gathered(per_step_links(samples), world, plain)
    # Every rank must model the same links; rank 0's view of the bytes decides.
    per_link = per_link[0]
    points = [UNLIMITED, *args.ratios]
    speeds = {r: link_speeds(r, compute, per_link, args.inter_slowdown if strategy in HYBRID else 1.0)
              for r in points}
    log(f"{strategy}: compute {compute * 1e3:.1f} ms/step; links: " + ", ".join(
        f"{point_name(r)} {format_bandwidth(s['intra_node'])}" for r, s in speeds.items()))

    per_round: dict[tuple[float, str], list[dict]] = {}
    traces: dict[tuple[float, str], list] = {}
    point_orders, variant_orders = [], []
    load_after = []
    for r in range(args.rounds):
        order_points = rotated(points, r)
        order_variants = rotated(variants, r)
        point_orders.append(order_points)
        variant_orders.append(order_variants)
        for point in order_points:
            net.set_links(**speeds[point])
            names = order_variants + (references if point == UNLIMITED else [])
            for name in names:
                built[name].timed_step(net, plain)  # untimed: caches went cold while the others ran
            steps: dict[str, list[dict]] = {name: [] for name in names}
            for i in range(args.steps):
                for name in names:
                    trace = (r == args.rounds - 1 and i == 0 and name.startswith("fsdp_compile")
                             and name != "fsdp_compile_gloo")
                    steps[name].append(built[name].timed_step(net, plain, trace=trace))
            for name in names:
                mine = steps[name]
                summary = {
                    "wall": statistics.median(s["wall"] for s in mine),
                    "main_cpu": statistics.median(s["main_cpu"] for s in mine),
                    "process_cpu": statistics.median(s["process_cpu"] for s in mine),
                    "busy": {link: statistics.mean(s["busy"][link] for s in mine) for link in ("intra", "inter")},
                    "count": {link: statistics.mean(s["count"][link] for s in mine) for link in ("intra", "inter")},
                    "blocked": statistics.median(s["blocked"] for s in mine),
                    "beyond": statistics.median(s["beyond"] for s in mine),
                    "waits": statistics.median(s["waits"] for s in mine),
                    "overruns": {"count": sum(s["overruns"]["count"] for s in mine),
                                 "observed": sum(s["overruns"]["observed"] for s in mine),
                                 "max_s": max(s["overruns"]["max_s"] for s in mine),
                                 "total_s": sum(s["overruns"]["total_s"] for s in mine) / len(mine)},
                }
                everyone = gathered(summary, world, plain)
                per_round.setdefault((point, name), []).append({
                    "step_s": max(g["wall"] for g in everyone),  # a step ends when its slowest rank ends
                    "main_cpu_s": statistics.mean(g["main_cpu"] for g in everyone),
                    "process_cpu_s": statistics.mean(g["process_cpu"] for g in everyone),
                    "busy_s": {link: max(g["busy"][link] for g in everyone) for link in ("intra", "inter")},
                    "collectives": {link: max(g["count"][link] for g in everyone) for link in ("intra", "inter")},
                    # The waits of the slowest rank's step: how long it was blocked, and how much
                    # of that came after the modeled end (gloo late, or waking up).
                    "blocked_s": max(g["blocked"] for g in everyone), "beyond_model_s": max(g["beyond"] for g in everyone),
                    "python_waits": max(g["waits"] for g in everyone),
                    "overruns": {"count": sum(g["overruns"]["count"] for g in everyone),
                                 "observed": sum(g["overruns"]["observed"] for g in everyone),
                                 "max_s": max(g["overruns"]["max_s"] for g in everyone),
                                 "total_per_step_s": max(g["overruns"]["total_s"] for g in everyone)},
                })
                if "trace" in mine[0]:
                    traces[(point, name)] = gathered(mine[0]["trace"], world, plain)[0]
            log(f"{strategy} round {r + 1}/{args.rounds} at {point_name(point)}: " + ", ".join(
                f"{name} {per_round[(point, name)][-1]['step_s'] * 1e3:.0f} ms" for name in names))
        load_after.append(os.getloadavg()[0])

    result = {
        "strategy": strategy, "world": world, "compute_calibration_ms": compute * 1e3,
        "per_step_links": {link: {"wire_bytes": wire, "collectives": count} for link, (wire, count) in per_link.items()},
        "points": [{"ratio": p, **{k: v for k, v in speeds[p].items()}} for p in points],
        "variants": variants, "references": references, "compile_s": compile_s,
        "point_orders": point_orders, "variant_orders": variant_orders, "load_after_rounds": load_after,
        "per_round": [{"ratio": p, "variant": n, "rounds": rows} for (p, n), rows in per_round.items()],
        "traces": [{"ratio": p, "variant": n, "collectives": t} for (p, n), t in traces.items()],
    }
    if strategy in DDP_WITH and "ddp" in variants:
        result["ddp_compared_with"] = DDP_WITH[strategy]
    del built, ref
    gc.collect()
    return result


def worker(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ["WORLD_SIZE"])
    strategies = [s for s in args.strategies if (s in HYBRID) == (world == 4)]
    if not strategies or world not in (2, 4):
        raise SystemExit(f"world {world}: {', '.join(FLAT)} run at world 2, {', '.join(HYBRID)} at world 4 "
                         f"(2 nodes x 2); asked for {args.strategies}")
    load_before = os.getloadavg()
    net = fsdp_compile.EmulatedNetwork(math.inf, latency=1e-9, devices_per_node=2)
    net.init_process_group(timeout=datetime.timedelta(minutes=20))
    rank = dist.get_rank()
    plain = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(minutes=20))
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(cfg)

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    results = []
    for i, strategy in enumerate(strategies):
        references = [r for r in args.references if i == 0]
        results.append(measure_strategy(args, strategy, base, cfg, rank, world, net, plain, references, log))
        if rank == 0 and args.part:
            Path(args.part).write_text(json.dumps(job_report(args, world, base, load_before, results)))
    if rank == 0 and not args.part:
        finish(args, [job_report(args, world, base, load_before, results)])
    end_process_group(exit_process=True)


def job_report(args, world: int, base, load_before, results: list[dict]) -> dict:
    return {"world": world, "config": {"layers": args.layers, "d_model": args.d_model, "seq": args.seq,
                                       "vocab": args.vocab, "batch_per_rank": args.batch,
                                       "parameters": base.num_parameters()},
            "load_before": list(load_before), "strategies": results}


# ---------------------------------------------------------------------------------------------- the report
def ratio_spread(ours: list[float], theirs: list[float]) -> dict:
    result = spread([a / b for a, b in zip(ours, theirs)])
    result["verdict"] = "faster" if result["max"] < 1 else "slower" if result["min"] > 1 else "within noise"
    return result


def summarize_strategy(s: dict) -> list[dict]:
    """Rows (point x variant) from a strategy's per-round figures."""
    by = {(p["ratio"], p["variant"]): p["rounds"] for p in s["per_round"]}
    rows = []
    for point in s["points"]:
        ratio = point["ratio"]
        for name in s["variants"] + (s["references"] if ratio == UNLIMITED else []):
            rounds = by[(ratio, name)]
            unlimited = by[(UNLIMITED, name)]
            step = [r["step_s"] * 1e3 for r in rounds]
            compute = [r["step_s"] * 1e3 for r in unlimited]
            links = {link: statistics.median(r["busy_s"][link] for r in rounds) * 1e3 for link in ("intra", "inter")}
            comm = max(links.values())
            limit = [max(c, comm) for c in compute]
            over = {"count": sum(r["overruns"]["count"] for r in rounds),
                    "observed": sum(r["overruns"]["observed"] for r in rounds),
                    "max_ms": max(r["overruns"]["max_s"] for r in rounds) * 1e3,
                    "per_step_ms": max(r["overruns"]["total_per_step_s"] for r in rounds) * 1e3}
            # On the unlimited link gloo's own time is the link: nothing to hold.
            blocked = statistics.median(r["blocked_s"] for r in rounds) * 1e3
            beyond = statistics.median(r["beyond_model_s"] for r in rounds) * 1e3
            # Where the step waits from Python (every variant but DDP, whose reducer waits on
            # futures in C++), what it owes to gloo is read off its waits; else from the stats'
            # lateness, an upper bound (lateness that no wait saw costs nothing).
            waits = statistics.median(r["python_waits"] for r in rounds)
            owed = beyond if waits else over["per_step_ms"]
            held = ratio == UNLIMITED or owed <= HELD_OVERRUN * statistics.median(step)
            rows.append({
                "strategy": s["strategy"], "ratio": ratio, "variant": name,
                "link": {k: point[k] for k in ("intra_node", "inter_node", "latency")},
                "step_ms": spread(step), "compute_ms": spread(compute),
                "communication_ms": comm, "communication_by_link_ms": links,
                "collectives_per_step": {link: statistics.median(r["collectives"][link] for r in rounds)
                                         for link in ("intra", "inter")},
                "comm_over_compute": comm / statistics.median(compute),
                "exposed_ms": spread([a - c for a, c in zip(step, compute)]),
                "limit_ms": spread(limit), "over_limit": spread([a / lim for a, lim in zip(step, limit)]),
                "no_overlap_ms": statistics.median(compute) + comm,
                "main_cpu_ms": statistics.median(r["main_cpu_s"] for r in rounds) * 1e3,
                "process_cpu_ms": statistics.median(r["process_cpu_s"] for r in rounds) * 1e3,
                "overruns": over, "blocked_ms": blocked, "beyond_model_ms": beyond if waits else None,
                "owed_to_gloo_ms": owed, "emulation_held": held,
            })
    # Ratios per round against the peers at the same point.
    index = {(r["ratio"], r["variant"]): r for r in rows}
    for row in rows:
        comps = {}
        for peer in ("fsdp_compile_unscheduled", "fsdp2_eager", "fsdp2_compile", "fsdp_compile_scheduled"):
            other = index.get((row["ratio"], peer))
            if other is not None and peer != row["variant"]:
                comps[peer] = ratio_spread(row["step_ms"]["rounds"], other["step_ms"]["rounds"])
        row["vs"] = comps
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The three targets at every point where they apply, each held or not."""
    out = []
    for row in rows:
        if row["variant"] != "fsdp_compile_scheduled":
            continue
        # Where a target applies is read off the measured communication / compute: the points
        # are set from a calibration that a loaded machine can throw off.
        measured = row["comm_over_compute"]
        where = f"{row['strategy']} at {point_name(row['ratio'])}"
        if row["ratio"] != UNLIMITED:
            where += f" (comm/compute {measured:.2f})"
        emulation = "" if row["emulation_held"] else " (the emulation did not hold here)"
        if row["ratio"] != UNLIMITED and measured <= 1.0:  # on the unlimited link the step is its own limit
            o = row["over_limit"]
            held = o["median"] <= 1.15
            every = "in every round" if (o["max"] <= 1.15) == held else "at the median, not in every round"
            out.append({"target": "within 15% of the limit", "where": where, "strategy": row["strategy"],
                        "ratio": row["ratio"], "held": held,
                        "detail": f"step {fmt_spread(row['step_ms'], 0)} ms, limit {fmt_spread(row['limit_ms'], 0)} ms: "
                                  f"{fmt_ratio(o)} of it; {'held' if held else 'missed'} {every}{emulation}"})
        if measured >= 0.5 and "fsdp_compile_unscheduled" in row["vs"]:
            c = row["vs"]["fsdp_compile_unscheduled"]
            out.append({"target": "faster than unscheduled", "where": where, "strategy": row["strategy"],
                        "ratio": row["ratio"], "held": c["verdict"] == "faster",
                        "detail": f"{fmt_ratio(c)} per round: {c['verdict']}{emulation}"})
        for peer in ("fsdp2_eager", "fsdp2_compile"):
            if peer in row["vs"]:
                c = row["vs"][peer]
                out.append({"target": f"no slower than {peer}", "where": where, "strategy": row["strategy"],
                            "ratio": row["ratio"], "held": c["verdict"] != "slower",
                            "detail": f"{fmt_ratio(c)} per round: {c['verdict']}{emulation}"})
    return out


def point_name(ratio: float) -> str:
    return "unlimited" if ratio == UNLIMITED else f"{ratio:g}x"


def link_text(row: dict) -> str:
    if row["ratio"] == UNLIMITED:
        return "unlimited"
    if row["strategy"] in HYBRID:
        return f"{format_bandwidth(row['link']['intra_node'])} / {format_bandwidth(row['link']['inter_node'])}"
    return format_bandwidth(row["link"]["intra_node"])


def overrun_text(row: dict) -> str:
    o = row["overruns"]
    if row["ratio"] == UNLIMITED:
        return "(gloo's own time)"
    text = f"{o['count']}/{o['observed']}"
    if o["count"]:
        text += f", max {o['max_ms']:.1f}, {o['per_step_ms']:.1f}/step"
    if row["beyond_model_ms"] is not None:
        text += f"; waits past the model {row['beyond_model_ms']:.1f}/step"
    return text if row["emulation_held"] else f"**did not hold**: {text}"


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# Overlap on an emulated cluster network",
        "",
        (f"GPT {cfg['layers']} layers, d_model {cfg['d_model']}, seq {cfg['seq']}, vocab {cfg['vocab']}, batch "
         f"{cfg['batch_per_rank']}/rank ({cfg['parameters']:,} parameters), AdamW; {report['machine']}, one thread "
         f"per rank, torch {report['torch']}, {report['date']}; compiler {report['compiler']}. "
         f"FULL_SHARD, SHARD_GRAD_OP, NO_SHARD on 2 ranks (one node); hybrid strategies on 4 ranks as 2 nodes x 2, "
         f"the inter-node link {report['inter_slowdown']:g}x slower than the intra-node link, "
         f"{LATENCY * 1e6:.0f} us latency per collective. {report['rounds']} rounds, point and variant order "
         f"rotated each round; per round and point the median of {report['steps']} steps (max over ranks) after "
         f"one untimed step each, variants interleaved step by step. Figures: median over rounds (range); ratios "
         f"per round (range). Load average (1 min): {report['load']}."),
        "",
        ("**Columns.** *compute*: the variant's step on the unlimited link in the same round. *comm*: modeled "
         "communication per step, the busy time of the busier link (`net.stats()`; a hybrid step's two links run "
         "side by side). *exposed*: step - compute. *limit*: max(compute, comm), what perfect overlap would give. "
         "*sum*: compute + comm, what no overlap gives. *overruns* (`net.stats()`, all ranks and steps of the "
         "row): collectives gloo itself finished after the modeled end / collectives observed, the largest "
         "lateness and the summed lateness per step (ms; lateness of collectives that run side by side on gloo "
         "adds up, so this overstates); then, from the step's own waits, how long per step it waited past the "
         "modeled ends: what the step owes to gloo (or to waking up) rather than to the emulated link. Where that "
         f"(for DDP, whose waits are in C++, the summed lateness) exceeds {HELD_OVERRUN:.0%} of the step, the row is "
         "marked: its time does not rest on the emulated link alone."),
        "",
    ]
    rows_by_strategy: dict[str, list[dict]] = {}
    for row in report["rows"]:
        rows_by_strategy.setdefault(row["strategy"], []).append(row)
    for strategy, rows in rows_by_strategy.items():
        s = next(x for x in report["strategies"] if x["strategy"] == strategy)
        lines += [f"## {strategy} (world {s['world']})", ""]
        if s.get("ddp_compared_with"):
            lines += [f"DDP is compared with {s['ddp_compared_with']}.", ""]
        lines += [f"![{strategy}]({report['plots'][strategy]})", "",
                  ("| point | link | variant | step ms | compute ms | comm ms | comm/compute | exposed ms | limit ms "
                   "| step/limit | sum ms | vs unscheduled | vs FSDP2 eager | vs FSDP2 + compile | overruns |"),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            vs = row["vs"]
            lines.append(
                f"| {point_name(row['ratio'])} | {link_text(row)} | {row['variant']} | {fmt_spread(row['step_ms'], 0)} | "
                f"{fmt_spread(row['compute_ms'], 0)} | {row['communication_ms']:.0f} | {row['comm_over_compute']:.2f} | "
                f"{fmt_spread(row['exposed_ms'], 0)} | {fmt_spread(row['limit_ms'], 0)} | {fmt_ratio(row['over_limit'])} | "
                f"{row['no_overlap_ms']:.0f} | {fmt_ratio(vs.get('fsdp_compile_unscheduled'))} | "
                f"{fmt_ratio(vs.get('fsdp2_eager'))} | {fmt_ratio(vs.get('fsdp2_compile'))} | {overrun_text(row)} |")
        lines.append("")
    lines += ["## Targets", "",
              ("fsdp_compile scheduled: within 15% of the limit (median over rounds) wherever communication <= "
               "compute; faster than unscheduled, the range over rounds excluding 1, wherever communication >= half "
               "the compute; no slower than FSDP2 eager nor FSDP2 + compile at any point (slower only if slower in "
               "every round). Communication / compute as measured at each point (the modeled communication over "
               "the median compute), which decides where a target applies."), ""]
    for t in report["targets"]:
        lines.append(f"- {'held' if t['held'] else '**missed**'}: {t['target']}, {t['where']}: {t['detail']}")
    held = sum(t["held"] for t in report["targets"])
    lines += ["", f"{held} of {len(report['targets'])} held.", ""]
    lines += ["## What communication costs on the CPU", "", cpu_cost_text(report), ""]
    lines += ["## Where the scheduled step waits", "", ("fsdp_compile scheduled, one traced step per point (last "
              "round, rank 0): how long its waits blocked it, split into the start (the first two gathers: nothing "
              "computes before the first bucket arrives), the end (reductions waited after the last gather: the "
              "optimizer needs them) and in between; how much of it came after the modeled ends (gloo late, or a "
              "late peer); and the longest waits, with how long each collective queued before the link took it."), ""]
    lines += wait_summary(report)
    if report.get("analysis"):
        lines += ["", "## Analysis", "", report["analysis"]]
    return "\n".join(lines) + "\n"


def cpu_cost_text(report: dict) -> str:
    parts = []
    for s in report["strategies"]:
        rows = {r["variant"]: r for r in report["rows"] if r["strategy"] == s["strategy"] and r["ratio"] == UNLIMITED}
        if "local" not in rows:
            continue
        local, ours = rows["local"], rows["fsdp_compile_scheduled"]
        text = (f"{s['strategy']} (world {s['world']}), on the unlimited link: one rank's model without any "
                f"communication steps in {fmt_spread(local['step_ms'], 0)} ms; fsdp_compile scheduled in "
                f"{fmt_spread(ours['step_ms'], 0)} ms ({ours['step_ms']['median'] / local['step_ms']['median']:.2f}x), its process "
                f"spending {ours['process_cpu_ms']:.0f} ms of CPU per step of which {ours['main_cpu_ms']:.0f} ms on "
                f"the main thread (compute, Python)")
        if "fsdp_compile_gloo" in rows:
            gloo = rows["fsdp_compile_gloo"]
            text += (f"; on plain gloo instead of the emulated link: {fmt_spread(gloo['step_ms'], 0)} ms "
                     f"({ours['step_ms']['median'] / gloo['step_ms']['median']:.2f}x of it on the emulated link)")
        parts.append(text + ".")
    note = ("Gloo moves and reduces the data on CPU threads of the same cores that compute, so communication "
            "costs CPU time even where the emulated link hides its duration: the *compute* of every row includes "
            "it, and the limit max(compute, comm) is reachable only in that sense.")
    return " ".join([*parts, note])


def wait_breakdown(collectives: list[dict]) -> dict:
    """Where one traced step was blocked, ms: at the start (the first two gathers: nothing computes
    before the first bucket arrives), at the end (reductions waited after the last gather: the
    optimizer needs them), in between; and how much of it came after the modeled ends."""
    waited = [c for c in collectives if c["wait_called"] is not None and c["wait_returned"] is not None]
    gathers = [c for c in waited if c["kind"] == "all_gather"]
    first = {id(c) for c in sorted(gathers, key=lambda c: c["issued"])[:2]}
    last_gather = max((c["wait_returned"] for c in gathers), default=-math.inf)
    out = {"start": 0.0, "middle": 0.0, "end": 0.0, "beyond_model": 0.0}
    for c in waited:
        blocked = c["wait_returned"] - c["wait_called"]
        part = "start" if id(c) in first else "end" if c["wait_called"] >= last_gather else "middle"
        out[part] += blocked
        out["beyond_model"] += max(0.0, c["wait_returned"] - max(c["wait_called"], c["end"]))
    return out


def wait_summary(report: dict) -> list[str]:
    lines = ["| strategy | point | blocked ms | at the start | in between | at the end | past the modeled ends "
             "| longest waits |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in report["traces"]:
        if t["variant"] != "fsdp_compile_scheduled" or t["ratio"] == UNLIMITED:
            continue
        blocked = []
        for c in t["collectives"]:
            if c["wait_called"] is None or c["wait_returned"] is None:
                continue
            waited = c["wait_returned"] - c["wait_called"]
            if waited > 1.0:
                late = c["start"] - c["issued"]
                blocked.append((waited, f"{c['kind']} on {c['link']} ({c['modeled_ms']:.0f} ms modeled) issued at "
                                        f"{c['issued']:.0f} ms, on the link {late:.0f} ms later, waited "
                                        f"{waited:.0f} ms from {c['wait_called']:.0f} ms"))
        parts = wait_breakdown(t["collectives"])
        worst = "; ".join(text for _, text in sorted(blocked, reverse=True)[:3])
        lines.append(f"| {t['strategy']} | {point_name(t['ratio'])} | {sum(w for w, _ in blocked):.0f} | "
                     f"{parts['start']:.0f} | {parts['middle']:.0f} | {parts['end']:.0f} | {parts['beyond_model']:.0f} "
                     f"| {worst or 'none'} |")
    return lines


def plot(report: dict, out: Path, stem: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    strategies = {r["strategy"] for r in report["rows"]}
    for strategy in [s["strategy"] for s in report["strategies"] if s["strategy"] in strategies]:
        rows = [r for r in report["rows"] if r["strategy"] == strategy]
        ours = [r for r in rows if r["variant"] == "fsdp_compile_scheduled"]
        # x: the point's communication / compute, as fsdp_compile scheduled measured it.
        x_of = {r["ratio"]: r["comm_over_compute"] for r in ours}
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
            mine = sorted((r for r in rows if r["variant"] == name), key=lambda r: r["ratio"])
            xs = [x_of[r["ratio"]] for r in mine]
            ys = [r["step_ms"]["median"] for r in mine]
            err = [[r["step_ms"]["median"] - r["step_ms"]["min"] for r in mine],
                   [r["step_ms"]["max"] - r["step_ms"]["median"] for r in mine]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        ours = sorted(ours, key=lambda r: r["ratio"])
        xs = [x_of[r["ratio"]] for r in ours]
        ax.plot(xs, [r["limit_ms"]["median"] for r in ours], "k--", label="limit max(compute, comm), scheduled")
        ax.plot(xs, [r["no_overlap_ms"] for r in ours], "k:", label="no overlap: compute + comm")
        ax.set_xlabel("modeled communication / compute (fsdp_compile scheduled)")
        ax.set_ylabel("step time, ms (median over rounds, range)")
        ax.set_title(f"{strategy}: step time on an emulated link")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{stem}_{strategy.lower()}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files[strategy] = name
    return files


def machine() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"a {os.cpu_count()}-core {model}"


def finish(args, parts: list[dict]) -> dict:
    """The whole report from the jobs' parts: rows, targets, Markdown, plots; printed and written."""
    strategies = [{**s, "world": p["world"]} for p in parts for s in p["strategies"]]
    report = {
        "config": parts[0]["config"], "machine": machine(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "compiler": args.compiler, "smoke": args.smoke,
        "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "ratios": args.ratios,
        "inter_slowdown": args.inter_slowdown, "latency_s": LATENCY,
        "load": "; ".join(f"world {p['world']}: {p['load_before'][0]:.2f} before, after each round " + ", ".join(
            f"{x:.2f}" for s in p["strategies"] for x in s["load_after_rounds"]) for p in parts),
        "strategies": [{k: v for k, v in s.items() if k != "traces"} for s in strategies],
        "traces": [{"strategy": s["strategy"], **t} for s in strategies for t in s["traces"]],
    }
    return render(args, report)


def render(args, report: dict) -> dict:
    """Rows, targets, Markdown and plots from the measured figures of ``report``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["rows"] = rows = [row for s in report["strategies"] for row in summarize_strategy(s)]
    report["targets"] = targets(rows)
    if args.analysis:
        report["analysis"] = Path(args.analysis).read_text()
    report["plots"] = plot(report, out, args.name)
    text = markdown(report)
    write_report(out, args.name, report, text)
    print(text)
    print("Emulation per row (overruns: count/observed, max ms, per step ms):")
    for row in rows:
        o = row["overruns"]
        print(f"  {row['strategy']} {point_name(row['ratio'])} {row['variant']}: {o['count']}/{o['observed']}, "
              f"max {o['max_ms']:.2f}, {o['per_step_ms']:.2f}/step -> "
              f"{'held' if row['emulation_held'] else 'DID NOT HOLD'}")
    return report


def driver(args) -> None:
    """Runs a torchrun job per world size and merges their parts into one report."""
    jobs = [(2, [s for s in args.strategies if s in FLAT]), (4, [s for s in args.strategies if s in HYBRID])]
    parts = []
    forwarded = [a for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        for world, strategies in jobs:
            if not strategies:
                continue
            part = Path(tmp) / f"world{world}.json"
            command = torchrun_command(world, __file__, *forwarded, "--strategies", *strategies, "--part", str(part))
            print(f"world {world}: {' '.join(strategies)}", flush=True)
            proc = subprocess.run(command, env=rank_env(os.environ.get("OMP_NUM_THREADS", "1")), check=False)
            if not part.exists():
                raise SystemExit(f"the world-{world} job failed (exit status {proc.returncode}) before any result")
            parts.append(json.loads(part.read_text()))
            if proc.returncode:
                print(f"the world-{world} job exited with {proc.returncode}: reporting what it finished", flush=True)
    finish(args, parts)


SMOKE = {"layers": 2, "d_model": 32, "seq": 16, "vocab": 64, "batch": 2, "warmup": 1, "steps": 1, "rounds": 1,
         "calibration_steps": 2, "compiler": "aot_eager", "references": []}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=[*FLAT, *HYBRID], choices=[*FLAT, *HYBRID])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--references", nargs="*", default=list(REFERENCES), choices=REFERENCES,
                   help="measured on the unlimited link with the first strategy of each job")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5, 1.0, 2.0],
                   help="communication / compute of fsdp_compile scheduled at each point")
    p.add_argument("--inter-slowdown", type=float, default=10.0, help="inter-node link this many times slower")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per point per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="steps after building a variant (these compile)")
    p.add_argument("--calibration-steps", type=int, default=3)
    # Compute per step grows with the tokens, communication with the parameters: 3072 tokens a
    # rank on a narrow model keep gloo's own time for a step's collectives well under the modeled
    # time even at 0.25x (at d_model 256 and 768 tokens it was not, and the emulation overran).
    p.add_argument("--batch", type=int, default=12, help="sequences per rank")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=256)
    # A vocabulary of 1024 keeps the root's parameters (embeddings, head: one unit for FSDP2 as
    # for fsdp_compile) at 14% of the model; four times larger they would be 40%, and the first
    # gather and the last reduction, which nothing can hide, would dominate every strategy.
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 round, aot_eager: checks that it runs")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name", default=None, help="file stem (default overlap_cpu, or overlap_smoke)")
    p.add_argument("--analysis", help="a Markdown file whose text goes into the report's Analysis section")
    p.add_argument("--part", help=argparse.SUPPRESS)  # where a job launched by the driver leaves its results
    p.add_argument("--render", metavar="JSON", help="only rebuild the report (Markdown, plots, targets) from an "
                   "earlier run's JSON, e.g. with --analysis; written beside it, figures as measured")
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.name = args.name or ("overlap_smoke" if args.smoke else "overlap_cpu")
    for flag in ("steps", "rounds", "warmup", "batch", "calibration_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if any(r <= 0 for r in args.ratios) or len(set(args.ratios)) != len(args.ratios):
        p.error(f"--ratios must be distinct and positive, got {args.ratios}")
    if "fsdp_compile_scheduled" not in args.variants:
        p.error("--variants must include fsdp_compile_scheduled: it sets the points")
    if args.render:
        report = json.loads(Path(args.render).read_text())
        args.name, args.out = Path(args.render).stem, str(Path(args.render).parent)
        render(args, report)
        return
    if "WORLD_SIZE" in os.environ:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
