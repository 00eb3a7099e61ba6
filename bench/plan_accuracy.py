"""How right is the planner? Measured on the machine that runs this script, and against published figures.

    python bench/plan_accuracy.py                 # every part (long: run it on a quiet machine)
    python bench/plan_accuracy.py --part accuracy # or zero, anchors, a10g

Parts (each writes its section of bench/results/plan_accuracy.json and the Markdown beside it):

* ``accuracy``: on the machine that runs it, ``Cluster.measure()`` then every strategy run for real with
  ``python -m fsdp_compile compare`` (world 2; the hybrid strategies at 2 x 2) for two GPT sizes;
  predicted peak memory against the allocator's (counted as right within 10%), predicted step
  time against the measured median (within 25%), and the predicted ranking against the measured
  one wherever measured times differ by more than 10%.
* ``zero``: the ZeRO paper's Table 1 (7.5B parameters, Adam, 64 devices) from ``plan()`` rows.
* ``anchors``: the FSDP paper's GPT-175B on 128 A100s (159 TFLOP/s per GPU) and torchtitan's
  Llama-3-8B on 8 H100s (40.96 GiB, 7,227 tokens/s per GPU) beside the planner's predictions
  with the presets' data-sheet numbers. No constant is tuned to make them agree.
* ``a10g``: the deepest model of a GPT family each strategy fits
  on one G5.48xlarge (8x A10G), predicted, beside the ZeRO formula's parameter count.

Timings taken while other jobs share the machine are noisy: each accuracy run first waits for a
quiet machine (``--quiet-load``), and the results record the load and when they were taken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.planning import Cluster, plan
from fsdp_compile.planning.cli import cross_entropy_loss
from fsdp_compile_lab import HostCPU
from fsdp_compile_lab.calibration.beside_steps import quiet_step_seconds
from fsdp_compile_lab.calibration.calibrate import time_op_overhead

GB = 1e9
GiB = 1 << 30
BF16 = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ---------------------------------------------------------------------- models for the accuracy runs
def gpt_small() -> GPT:
    return GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, d_model=256))


def gpt_medium() -> GPT:
    return GPT(GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8, d_model=512))


def gpt_tiny() -> GPT:
    return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, d_model=64))


ACCURACY_RUNS = [  # (factory, batch, seq)
    ("gpt_small", 4, 128),
    ("gpt_medium", 4, 256),
]
SMOKE_RUNS = [("gpt_tiny", 2, 32)]


QUIET = {"load": 1.5, "wait_s": 600.0}  # --quiet-load / --quiet-wait


def _wait_for_quiet() -> float:
    """Wait (up to ``QUIET["wait_s"]``) for the 1-minute load average to fall below
    ``QUIET["load"]``: on a shared machine other jobs' time on the cores shows up in every step.
    Returns the load when the run starts (it is recorded beside the run)."""
    deadline = time.time() + QUIET["wait_s"]
    load = os.getloadavg()[0]
    while load >= QUIET["load"] and time.time() < deadline:
        print(f"  load average {load:.1f} >= {QUIET['load']}: waiting for a quieter machine", flush=True)
        time.sleep(15)
        load = os.getloadavg()[0]
    return load


REUSE = {"on": False, "only": False}  # --reuse / --reuse-only


def _torchrun(world: int, args: list[str], out: Path) -> dict | None:
    if REUSE["on"] and (out / "compare.json").exists():
        return json.loads((out / "compare.json").read_text())
    if REUSE["only"]:
        print(f"  {out / 'compare.json'} is missing: left out (--reuse-only)", flush=True)
        return None
    load = _wait_for_quiet()
    # The lab's host-CPU model: what ranks sharing this machine's cores and gloo add to the plan.
    cmd = torchrun_command(world, "-m", "fsdp_compile", "compare", *args, "--host", "fsdp_compile_lab:HostCPU",
                           "--out", str(out))
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=rank_env(), check=True)
    data = json.loads((out / "compare.json").read_text())
    data["load_at_start"] = load
    (out / "compare.json").write_text(json.dumps(data, indent=2))
    return data


def job_cpu_share(world: int) -> float:
    """The share of a core each of a job's ``world`` ranks gets here: below 1 when they outnumber
    the cores (2 x 2 on 2 cores), a wait that is the job's own, not other jobs'."""
    return min(1.0, (os.cpu_count() or 1) / world)


def measured_quiet_step(measured: dict, world: int) -> float | None:
    """The median of a ``compare`` row's quiet steps (``quiet_step_seconds``); None without the
    steps' run-queue waits."""
    waits = measured.get("wait_fractions") or []
    if not waits:
        return None
    return quiet_step_seconds(measured["step_times"][-len(waits):], waits, job_cpu_share(world))


def part_accuracy(steps: int, out: Path, smoke: bool = False) -> dict:
    runs = []
    for factory, batch, seq in SMOKE_RUNS if smoke else ACCURACY_RUNS:
        model = f"plan_accuracy:{factory}"
        common = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--steps", str(steps)]
        flat = _torchrun(2, [*common, "--strategies", "FULL_SHARD,NO_SHARD" if smoke else "FULL_SHARD,SHARD_GRAD_OP,NO_SHARD"], out / f"compare_{factory}_w2")
        runs_here = [flat]
        if not smoke:
            runs_here.append(_torchrun(4, [*common, "--strategies", "HYBRID_SHARD,HYBRID_SHARD_ZERO2", "--shard-size", "2"], out / f"compare_{factory}_w4"))
        for data in filter(None, runs_here):
            for row in data["rows"]:
                m, p = row["measured"], row["predicted"]
                m["quiet_step_seconds"] = measured_quiet_step(m, data["world"])
                runs.append({
                    "model": factory, "batch": batch, "seq": seq, "world": data["world"], "strategy": row["strategy"],
                    "measured_step_s": m["step_seconds"], "predicted_step_s": p["step_seconds"],
                    "step_error": p["step_seconds"] / m["step_seconds"] - 1,
                    "measured_peak_bytes": m["peak_bytes"], "predicted_peak_bytes": p["peak_bytes"],
                    "peak_error": p["peak_bytes"] / m["peak_bytes"] - 1,
                    "measured_wire_bytes": sum(m["bytes_per_step"].values()),
                    "measured_backend_wire_bytes": m.get("backend_bytes_per_step", 0.0),
                    "predicted_wire_bytes": sum(p["bytes_per_step"].values()),
                    "collectives": m["collectives"], "compile_s": m["compile_seconds"], "cluster": data["cluster"],
                    "measured_cpu_s": m.get("cpu_seconds"), "cpu_wait_fraction": m.get("cpu_wait_fraction"),
                    "load_average": m.get("load_average"), "load_at_start": data.get("load_at_start"),
                    "quiet_step_s": m.get("quiet_step_seconds"), "wait_fractions": m.get("wait_fractions"),
                    "cpu_share": job_cpu_share(data["world"]),
                    "quiet_step_error": (p["step_seconds"] / m["quiet_step_seconds"] - 1
                                         if m.get("quiet_step_seconds") else None),
                    "predicted_compute_s": p["compute_seconds"], "predicted_comm_s": p["comm_seconds"],
                    "predicted_exposed_s": p["exposed_comm_seconds"],
                    "predicted_includes_workspace": "collective_workspace" in data.get("cluster_numbers", {})})
    _peaks_with_workspace(runs)
    ranking = []
    for factory, _, _ in SMOKE_RUNS if smoke else ACCURACY_RUNS:
        for world in (2, 4):
            rows = [r for r in runs if r["model"] == factory and r["world"] == world]
            for i, a in enumerate(rows):
                for b in rows[i + 1:]:
                    # quiet steps where both runs have them (other jobs' time on the cores is not the strategy's)
                    quiet = bool(a.get("quiet_step_s") and b.get("quiet_step_s"))
                    ta, tb = ((a["quiet_step_s"], b["quiet_step_s"]) if quiet else
                              (a["measured_step_s"], b["measured_step_s"]))
                    if abs(ta / tb - 1) > 0.10:
                        agree = (ta < tb) == (a["predicted_step_s"] < b["predicted_step_s"])
                        ranking.append({"model": factory, "world": world, "pair": [a["strategy"], b["strategy"]],
                                        "agree": agree, "quiet_steps": quiet})
    return {"runs": runs, "ranking": ranking}


# gloo's workspace per byte of a collective's buffer, as Cluster.measure() found it on the 2-core
# x86_64 CPU of bench/results/plan_accuracy.md (2026-11-23); used only for runs whose compare.json predates the measurement.
GLOO_WORKSPACE = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 0.0}


def _peaks_with_workspace(runs: list[dict]) -> None:
    """Plan each run's peak again with the collective workspace its cluster measured (or, for a
    run recorded before the planner knew of it, ``GLOO_WORKSPACE``). Peak memory depends on the
    graphs and the workspace only, not on the timing calibrations."""
    for key in {(r["model"], r["batch"], r["seq"], r["world"]) for r in runs}:
        factory, batch, seq, world = key
        here = [r for r in runs if (r["model"], r["batch"], r["seq"], r["world"]) == key]
        if all(r.get("predicted_includes_workspace") for r in here):
            continue
        cluster = Cluster(name="peaks", nodes=world // 2 if world > 2 else 1, devices_per_node=2,
                          device_memory=64 * GiB, peak_flops={torch.float32: 1e11}, memory_bandwidth=1e10,
                          intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, intra_node_latency=0.0,
                          inter_node_latency=0.0, device_type="cpu", collective_workspace=GLOO_WORKSPACE)
        result = plan(globals()[factory](), (torch.zeros(batch, seq, dtype=torch.long),), cluster=cluster,
                      loss_fn=cross_entropy_loss, world_size=world, strategies=[r["strategy"] for r in here],
                      prefetch=(1,), memory_budget=64 * GiB)
        for r in here:
            r["predicted_peak_run_bytes"] = r["predicted_peak_bytes"]
            r["predicted_peak_bytes"] = result.row(r["strategy"]).peak_bytes
            r["peak_error"] = r["predicted_peak_bytes"] / r["measured_peak_bytes"] - 1
            r["peak_note"] = "re-planned with the collective workspace (the run's plan predates it)"


# ---------------------------------------------------------------------- where the time goes
def _category(target: object) -> str:
    from fsdp_compile.planning.cost import FREE

    if target in FREE:
        # only the call is priced (op_overhead); timed by the interpreter, a node also carries
        # the interpreter's own per-node Python work, which a compiled graph's code does not
        return "views"
    name = str(target)
    if any(k in name for k in ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.")):
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith("fsdp_compile."):
        return "fsdp copies"
    return "other"


def _real(value: object) -> object:
    """A real tensor with a fake tensor's metadata (indices are 0: valid for any gather)."""
    if isinstance(value, torch.Tensor):
        shape = tuple(int(d) for d in value.shape)
        return torch.randn(shape, dtype=value.dtype) if value.is_floating_point() else torch.zeros(shape, dtype=value.dtype)
    if isinstance(value, torch.SymInt):
        return int(value)
    return value


def _node_cpu_seconds(gm: torch.fx.GraphModule, repeats: int) -> dict:
    """Each compute node's CPU time when the graph runs for real on this thread (the fastest of
    ``repeats`` runs). Collectives are replaced by an uninitialised result of the right shape:
    their time is the links', measured separately."""
    from fsdp_compile.passes.graph import WAIT
    from fsdp_compile.planning.cost import COLLECTIVE_KIND

    class Timed(torch.fx.Interpreter):
        def __init__(self, module: torch.fx.GraphModule) -> None:
            super().__init__(module)
            self.seconds: dict = {}

        def run_node(self, node: torch.fx.Node) -> object:
            if node.op == "call_function" and node.target in COLLECTIVE_KIND:
                return _real(node.meta["val"])
            if node.op == "call_function" and node.target is WAIT:
                return self.env[node.args[0]]
            start = time.thread_time()
            out = super().run_node(node)
            self.seconds[node] = time.thread_time() - start
            return out

    inputs = [_real(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    best: dict = {}
    for _ in range(repeats):
        timed = Timed(gm)
        timed.run(*inputs)
        for node, seconds in timed.seconds.items():
            best[node] = min(best.get(node, seconds), seconds)
    return best


def part_attribution(smoke: bool = False, repeats: int = 5) -> dict:
    """The compute half of the step-time model, node by node, robust to other jobs on the machine.

    ``plan()`` traces each model for FULL_SHARD at world 2 with this CPU's compute numbers
    (the calibrations ``Cluster.measure()`` runs); then every compute node of the forward and
    backward graphs runs for real, one at a time on this thread, and its CPU time (the thread's,
    not the wall clock: other jobs' time on the core is not the operator's) is set beside the
    node's predicted roofline time, summed by kind of operator. (The optimizer step is not here:
    ``Cluster.measure()`` times a real one over DTensor shards, which needs a process group.)
    """
    from fsdp_compile.planning.calibration import compute as measuring
    from fsdp_compile.planning.cost import graph_costs
    from fsdp_compile.planning.world import fake_world

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun with OMP_NUM_THREADS=1: one core per rank
    try:
        cpu = torch.device("cpu")
        cluster = Cluster(
            name="cpu (compute calibrations only)", nodes=1, devices_per_node=2, device_memory=64 * GiB,
            peak_flops={torch.float32: measuring.measure_matmul_flops(torch.float32, cpu, repeats)},
            attention_flops={torch.float32: measuring.measure_attention_flops(torch.float32, cpu, repeats)},
            memory_bandwidth=measuring.measure_memory_bandwidth(cpu, repeats), intra_node_bandwidth=1e9,
            inter_node_bandwidth=None, intra_node_latency=0.0, inter_node_latency=None,
            device_type="cpu", host=HostCPU(op_overhead=time_op_overhead(cpu, repeats)))
        models = []
        for factory, batch, seq in SMOKE_RUNS if smoke else ACCURACY_RUNS:
            model = globals()[factory]()
            tokens = torch.zeros(batch, seq, dtype=torch.long)
            result = plan(model, (tokens,), cluster=cluster, loss_fn=cross_entropy_loss, world_size=2,
                          strategies=["FULL_SHARD"], prefetch=(1,), memory_budget=64 * GiB)
            traced = next(iter(result._context.traced.values()))
            by_kind: dict = {}
            nodes = 0
            with fake_world(2):
                for record in traced.records:
                    for gm in (record.forward, record.backward):
                        if gm is None:
                            continue
                        costs = dict(graph_costs(gm, cluster))
                        for node, seconds in _node_cpu_seconds(gm, repeats).items():
                            cost = costs[node]
                            if cost.kind != "compute":
                                continue
                            nodes += 1
                            entry = by_kind.setdefault(_category(node.target),
                                                       {"nodes": 0, "predicted_s": 0.0, "measured_s": 0.0, "flops": 0})
                            entry["nodes"] += 1
                            entry["predicted_s"] += float(cost.seconds)
                            entry["measured_s"] += seconds
                            entry["flops"] += int(cost.flops or 0)
            models.append({"model": factory, "batch": batch, "seq": seq, "compute_nodes": nodes, "by_kind": by_kind,
                           "predicted_s": sum(v["predicted_s"] for v in by_kind.values()),
                           "measured_s": sum(v["measured_s"] for v in by_kind.values())})
        return {"cluster": cluster.describe(), "op_overhead_s": cluster.host.op_overhead, "repeats": repeats,
                "models": models}
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------- scale: Llama-3-70B on 512 H100s
SCALE_COMMAND = ["plan", "--model", "llama3-70b", "--activation-checkpointing", "--seq", "8192", "--cluster",
                 "h100-sxm", "--nodes", "64"]


def part_scale(smoke: bool = False) -> dict:
    """``python -m fsdp_compile plan`` of Llama-3-70B for 64 nodes x 8 H100 (512 devices) in a
    fresh process: how long ``plan()`` takes (the CLI prints it), the process's wall and CPU
    time and its peak resident memory (the parameters would be 282 GB in fp32: they are never
    allocated), and the plan itself for the docs."""
    import resource

    command = (["plan", "--model", "llama-tiny", "--seq", "64", "--cluster", "h100-sxm", "--nodes", "2"] if smoke
               else SCALE_COMMAND)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        load = os.getloadavg()[0]
        done = subprocess.run([sys.executable, "-m", "fsdp_compile", *command, "--json", f"{tmp}/plan.json"],
                              env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        data = json.loads(Path(f"{tmp}/plan.json").read_text())
    planned = next((float(line.split()[2].rstrip("s")) for line in done.stdout.splitlines()
                    if line.startswith("planned in ")), None)
    return {"command": "python -m fsdp_compile " + " ".join(command), "plan_seconds": planned,
            "process_wall_seconds": wall, "process_cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "load_at_start": load, "load_at_end": os.getloadavg()[0],
            "parameters": data.get("parameters"), "output": done.stdout, "plan": data}


# ---------------------------------------------------------------------- ZeRO Table 1
def part_zero(smoke: bool = False) -> dict:
    # A GPT of ~7.5B parameters (ZeRO's Table 1 model size): 36 layers of d_model 4096.
    cfg = (GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, d_model=64) if smoke else
           GPTConfig(vocab_size=50257, block_size=1024, n_layer=36, n_head=32, d_model=4096))
    with torch.device("meta"):
        model = GPT(cfg)
    P = sum(p.numel() for p in model.parameters())
    tokens = torch.zeros(1, cfg.block_size, dtype=torch.long)
    result = plan(model, (tokens,), cluster=Cluster.preset("h100-sxm", nodes=8), loss_fn=cross_entropy_loss,
                  mixed_precision=BF16, strategies=["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"], prefetch=(1,),
                  memory_budget=1e15)
    paper = {"NO_SHARD": (120, "16P"), "SHARD_GRAD_OP": (16.6, "2P + 14P/N"), "FULL_SHARD": (1.88, "16P/N")}
    rows = []
    for name, (paper_gb, formula) in paper.items():
        row = result.row(name)
        states = row.memory["params"] + row.memory["grads"] + row.memory["optimizer"]
        from fsdp_compile.api import ShardingStrategy
        from fsdp_compile.planning.plan import model_state_bytes

        resident = model_state_bytes(model, ShardingStrategy.parse(name), 64, 8, "adamw")
        resident_states = resident["params"] + resident["grads"] + resident["optimizer"]
        rows.append({"strategy": name, "paper_gb": paper_gb, "formula": formula,
                     "formula_gb_at_P": {"NO_SHARD": 16 * P, "SHARD_GRAD_OP": 2 * P + 14 * P / 64,
                                         "FULL_SHARD": 16 * P / 64}[name] / GB,
                     "plan_model_states_gb": resident_states / GB,
                     "plan_gathered_at_peak_gb": row.memory["gathered"] / GB,
                     "plan_states_at_peak_gb": states / GB,
                     "plan_peak_gb": row.peak_bytes / GB, "peak_phase": row.phase, "traced": row.traced})
    return {"parameters": P, "devices": 64, "rows": rows, "plan_seconds": result.seconds}


# ---------------------------------------------------------------------- published anchors
def part_anchors() -> dict:
    out = {}
    # FSDP paper: GPT-175B, batch 20 x sequence 512 per GPU, 128 A100 80GB, FULL_SHARD, bf16.
    with torch.device("meta"):
        gpt175 = GPT(GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, d_model=12288))
    tokens = torch.zeros(20, 512, dtype=torch.long)
    a100 = Cluster.preset("a100-80gb", nodes=16)
    r = plan(gpt175, (tokens,), cluster=a100, loss_fn=cross_entropy_loss, mixed_precision=BF16,
             strategies=["FULL_SHARD"], prefetch=(1,), trace_all=True)
    row = r.row("FULL_SHARD")
    out["fsdp_paper_gpt175b_128xA100"] = {
        "published_tflops_per_gpu": 159, "published_fraction_of_peak": 0.51,
        "predicted_tflops_per_gpu": row.mfu * 312, "predicted_mfu": row.mfu,
        "predicted_step_s": row.step_seconds, "predicted_exposed_comm_s": row.exposed_comm_seconds,
        "predicted_peak_gib": row.peak_bytes / GiB, "fits_80gb": row.fits, "memory_gib": {
            k: v / GiB for k, v in row.memory.items()}, "plan_seconds": r.seconds}
    # torchtitan PR 1881: Llama-3-8B, 8 H100, batch 1 x 8192, FSDP=8 (FULL_SHARD), bf16 / fp32 reduce.
    from fsdp_compile.models.llama import Llama, LlamaConfig

    rows = {}
    for checkpoint in (False, True):
        with torch.device("meta"):
            llama = Llama(LlamaConfig.llama3_8b(checkpoint_blocks=checkpoint))
        tokens = torch.zeros(1, 8192, dtype=torch.long)
        r = plan(llama, (tokens,), cluster=Cluster.preset("h100-sxm", nodes=1), loss_fn=cross_entropy_loss,
                 mixed_precision=BF16, strategies=["FULL_SHARD"], prefetch=(1,), trace_all=True)
        row = r.row("FULL_SHARD")
        rows["full activation checkpointing" if checkpoint else "no activation checkpointing"] = {
            "predicted_peak_gib": row.peak_bytes / GiB, "predicted_tokens_per_s_per_gpu": row.tokens_per_second,
            "predicted_mfu": row.mfu, "fits": row.fits, "memory_gib": {k: v / GiB for k, v in row.memory.items()},
            "plan_seconds": r.seconds}
    out["torchtitan_llama3_8b_8xH100"] = {"published_peak_gib": 40.96, "published_tokens_per_s_per_gpu": 7227,
                                          "published_note": "selective (per-op) activation checkpointing",
                                          "predicted": rows}
    return out


# ---------------------------------------------------------------------- deepest model per strategy on A10Gs
def part_a10g(width: int = 4096, seq: int = 1024, memory_budget: float | None = None, vocab: int = 50257) -> dict:
    """Deepest GPT (d_model ``width``, batch 1 x ``seq``) each strategy fits on 8x A10G, by bisection
    on depth with plan() (each probe traces the real graphs)."""
    cluster = Cluster.preset("a10g", nodes=1)
    tokens = torch.zeros(1, seq, dtype=torch.long)
    per_layer = 12 * width * width
    embeddings = 2 * vocab * width
    found = {}
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"):
        cache: dict[int, bool] = {}

        def fits(depth: int, cache: dict[int, bool] = cache, strategy: str = strategy) -> bool:
            if depth not in cache:
                with torch.device("meta"):
                    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=depth, n_head=max(width // 128, 1),
                                          d_model=width))
                r = plan(model, (tokens,), cluster=cluster, loss_fn=cross_entropy_loss, mixed_precision=BF16,
                         strategies=[strategy], prefetch=(1,), memory_budget=memory_budget)
                cache[depth] = r.row(strategy).fits
                print(f"  {strategy} depth {depth}: {'fits' if cache[depth] else 'does not fit'}", flush=True)
            return cache[depth]

        # The ZeRO formula ignores activations, so its depth is an upper bound: start there.
        states_per_param = {"NO_SHARD": 16, "SHARD_GRAD_OP": 2 + 14 / 8, "FULL_SHARD": 16 / 8}[strategy]
        budget = memory_budget or cluster.usable_memory
        lo, hi = 0, max(int((budget / states_per_param - embeddings) / per_layer) + 1, 1)
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        found[strategy] = {"depth": lo, "parameters": lo * per_layer + embeddings, "probes": len(cache)}
    usable = memory_budget or cluster.device_memory
    formula = {"NO_SHARD": usable / 16, "SHARD_GRAD_OP": usable / (2 + 14 / 8), "FULL_SHARD": usable / (16 / 8)}
    for name, value in formula.items():
        found[name]["zero_formula_parameters"] = value
    return {"width": width, "seq": seq, "batch": 1, "mixed_precision": "bf16 params, fp32 reduce", "rows": found}


# ---------------------------------------------------------------------- report
def render(results: dict) -> str:
    machine = results.get("machine", "?")
    lines = ["# Planner accuracy", "", (f"Run {results.get('when', '?')} on {machine}, torch "
             f"{results.get('torch', '?')}. GPU figures are predictions from data-sheet presets (no GPU ran "
             "them); CPU predictions use `Cluster.measure()` on the machine named. Each accuracy run waits "
             f"for the 1-minute load average to fall below {QUIET['load']} before it starts (the load at its "
             "start and after it are in the table)."), ""]
    acc = results.get("accuracy")
    if acc:
        lines += [f"## Measured on the CPU ({machine}, gloo)", "",
                  ("| model | world | strategy | predicted step | measured: all steps | error | quiet steps | "
                   "measured: quiet steps | error | waiting for a core | main-thread CPU (predicted compute) | "
                   "load at start / after | "
                   "peak measured | "
                   "peak predicted | error | wire MB issued / by gloo / predicted |"),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in acc["runs"]:
            cpu = (f"{r['measured_cpu_s'] * 1e3:.0f} ms ({r['predicted_compute_s'] * 1e3:.0f} ms)"
                   if r.get("measured_cpu_s") is not None else "n/a")
            wait = f"{r['cpu_wait_fraction'] * 100:.0f}%" if r.get("cpu_wait_fraction") is not None else "n/a"
            load = " / ".join(f"{r[k]:.1f}" if r.get(k) is not None else "n/a"
                              for k in ("load_at_start", "load_average"))
            fractions = r.get("wait_fractions") or []
            limit = 0.05 + 1.0 - r.get("cpu_share", 1.0)
            n_quiet = f"{sum(w <= limit for w in fractions)}/{len(fractions)}" if fractions else "n/a"
            quiet = (f"{r['quiet_step_s'] * 1e3:.0f} ms | {r['quiet_step_error'] * 100:+.0f}%"
                     if r.get("quiet_step_s") else "- | -")
            lines.append(
                f"| {r['model']} b{r['batch']}x{r['seq']} | {r['world']} | {r['strategy']} | "
                f"{r['predicted_step_s'] * 1e3:.0f} ms | {r['measured_step_s'] * 1e3:.0f} ms | "
                f"{r['step_error'] * 100:+.0f}% | {n_quiet} | {quiet} | {wait} | {cpu} | {load} | "
                f"{r['measured_peak_bytes'] / 2**20:.1f} MiB | {r['predicted_peak_bytes'] / 2**20:.1f} MiB | "
                f"{r['peak_error'] * 100:+.0f}% | {r['measured_wire_bytes'] / 1e6:.1f} / "
                f"{r.get('measured_backend_wire_bytes', 0) / 1e6:.1f} / {r['predicted_wire_bytes'] / 1e6:.1f} |")
        if any(r.get("peak_note") for r in acc["runs"]):
            lines += ["", ("Predicted peaks: these runs' own plans predate the collective workspace (gloo allocates "
                           "an output-sized temporary per all-gather and an input-sized one per reduce-scatter, "
                           "measured by `Cluster.measure()`); the peaks above are planned again with it by this "
                           "script, from the same graphs (peak memory does not depend on the timing calibrations). "
                           "The runs' own predictions: " + ", ".join(
                               f"{r['model']} {r['strategy']} {r['predicted_peak_run_bytes'] / 2**20:.1f} MiB"
                               for r in acc["runs"] if r.get("peak_note")) + ".")]
        runs = acc["runs"]
        within_mem = sum(abs(r["peak_error"]) <= 0.10 for r in runs)
        within_step = sum(abs(r["step_error"]) <= 0.25 for r in runs)
        agree = sum(p["agree"] for p in acc["ranking"])
        quiet = [r for r in runs if r.get("quiet_step_s")]
        quiet_ok = sum(abs(r["quiet_step_error"]) <= 0.25 for r in quiet)
        idle = [r for r in runs if r.get("load_at_start") is not None and r["load_at_start"] < QUIET["load"]]
        idle_ok = sum(abs(r["step_error"]) <= 0.25 for r in idle)
        lines += ["", (f"Peak memory within 10%: {within_mem}/{len(runs)}. Step time within 25%: {within_step}/"
                       f"{len(runs)} against the median of all steps ({idle_ok}/{len(idle)} of the runs that "
                       f"started on an otherwise idle machine, load below {QUIET['load']}); {quiet_ok}/{len(quiet)} "
                       f"against the quiet steps, for the {len(quiet)} runs that had at least two. Ranking agrees on "
                       f"{agree}/{len(acc['ranking'])} pairs whose measured times differ by more than 10% (quiet "
                       "steps where both runs have them)."), "",
                  ("On an idle machine a rank still waits for a core while the job's own communication threads "
                   "run (world 2 puts two main threads and two ranks' gloo threads on 2 cores), so the run-queue "
                   "wait is not zero and few or no steps pass the quiet-step test: that test separates other "
                   "jobs' time from the step's only when the machine is shared. Runs that started on an idle "
                   "machine are judged on all their steps."), "",
                  ("The planner predicts the machine without other jobs. 'waiting for a core' is how long the rank's "
                   "threads were runnable while other processes held the cores, over the step's wall time (run-queue "
                   "wait from /proc summed over the rank's threads, so above 100% when several wait at once; the "
                   "largest rank's, median over steps); a *quiet step* is one in which no rank waited "
                   "more than 5% (at 2 x 2 on 2 cores: 5% beyond the 50% a rank waits for the rank sharing its "
                   "core). 'main-thread CPU' is the CPU time of the rank's main thread per step (the slowest "
                   "rank's), 'load' the 1-minute load average at the run's start and after it."), "",
                  ("Wire bytes: 'issued' counts the collectives the compiled graphs called (from the profiler's "
                   "functional-collective events), 'by gloo' what gloo ran: it runs a reduce-scatter as an "
                   "all-reduce of the whole buffer, twice a ring reduce-scatter's bytes. The planner predicts the "
                   "collectives the graph issues, timed with the measured cost of each kind on gloo."), ""]
    att = results.get("attribution")
    if att:
        lines += ["## Where the compute time goes: each node of the real graphs against its prediction", "",
                  (f"FULL_SHARD at world 2, traced by `plan()`; every compute node then run for real on one thread "
                   f"(its thread CPU time, the fastest of {att['repeats']} runs; collectives left out) beside its "
                   f"predicted time on {att['cluster']} (the compute calibrations of `Cluster.measure()`, "
                   f"{att['op_overhead_s'] * 1e6:.1f} us per operator). Measured by thread CPU time, these hold "
                   "while other jobs load the machine."), "",
                  "| model | kind | nodes | predicted | measured CPU | error | measured GFLOP/s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for m in att["models"]:
            for kind, v in sorted(m["by_kind"].items(), key=lambda kv: -kv[1]["measured_s"]):
                rate = f"{v['flops'] / v['measured_s'] / 1e9:.0f}" if v["flops"] and v["measured_s"] else ""
                error = v["predicted_s"] / v["measured_s"] - 1 if v["measured_s"] else 0.0
                lines.append(f"| {m['model']} b{m['batch']}x{m['seq']} | {kind} | {v['nodes']} | "
                             f"{v['predicted_s'] * 1e3:.1f} ms | {v['measured_s'] * 1e3:.1f} ms | {error * 100:+.0f}% | "
                             f"{rate} |")
            lines.append(f"| {m['model']} b{m['batch']}x{m['seq']} | **all** | {m['compute_nodes']} | "
                         f"**{m['predicted_s'] * 1e3:.1f} ms** | **{m['measured_s'] * 1e3:.1f} ms** | "
                         f"**{(m['predicted_s'] / m['measured_s'] - 1) * 100:+.0f}%** | |")
        lines.append("")
    scale = results.get("scale")
    if scale:
        params = scale.get("parameters") or 0
        lines += [f"## Scale: Llama-3-70B for 512 H100s, planned on a CPU ({machine})", "",
                  (f"`{scale['command']}` ({params / 1e9:.1f}B parameters: {params * 4 / 1e9:.0f} GB in fp32, "
                  "never allocated; the model lives on the meta device and the plan runs on fake tensors in a "
                  "fake world of 512 ranks)."), "",
                  "| plan() | whole process (wall) | process CPU | peak resident memory | load average (start / end) |",
                  "| --- | --- | --- | --- | --- |",
                  (f"| {scale['plan_seconds']:.1f} s | {scale['process_wall_seconds']:.1f} s | "
                  f"{scale['process_cpu_seconds']:.1f} s | {scale['peak_rss_bytes'] / 2**30:.2f} GiB | "
                  f"{scale['load_at_start']:.1f} / {scale['load_at_end']:.1f} |")]
        earlier = scale.get("earlier_run")
        if earlier:
            lines.append(f"| {earlier['plan_seconds']:.1f} s | {earlier['process_wall_seconds']:.1f} s | "
                         f"{earlier['process_cpu_seconds']:.1f} s | {earlier['peak_rss_bytes'] / 2**30:.2f} GiB | "
                         f"{earlier['load_at_start']:.1f} / {earlier['load_at_end']:.1f} ({earlier['note']}) |")
        lines += ["",
                  ("The load average shows whether other jobs shared the machine; where they did, the wall "
                  "time is an upper bound on what the plan takes alone. "
                  "`tests/test_planning_scale.py` checks that no parameter is allocated (peak resident memory "
                  "against the parameters' size, in a fresh process)."), "", "```", scale["output"].rstrip(), "```", ""]
    zero = results.get("zero")
    if zero:
        lines += ["## ZeRO paper, Table 1 (7.5B parameters, Adam, 64 devices)", "",
                  f"Model: a GPT of {zero['parameters'] / 1e9:.2f}B parameters, bf16 compute, fp32 shards.", "",
                  ("| strategy | paper | formula at this P | plan: resident model states | plan: + gathered parameters "
                  "at the peak | plan: whole peak (where) |"),
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in zero["rows"]:
            lines.append(f"| {r['strategy']} | {r['paper_gb']} GB ({r['formula']}) | {r['formula_gb_at_P']:.2f} GB | "
                         f"{r['plan_model_states_gb']:.2f} GB | "
                         f"{r['plan_model_states_gb'] + r['plan_gathered_at_peak_gb']:.2f} GB | "
                         f"{r['plan_peak_gb']:.2f} GB ({r['peak_phase']}) |")
        lines += ["", ("Why they differ: ZeRO counts fp16 parameters (2P) and fp16 gradients (2P) plus K=12 bytes of "
                  "optimizer state (fp32 master copy, momentum, variance). Here the shards are the fp32 master "
                  "parameters (4 bytes), gradients are fp32 (4), AdamW keeps two fp32 moments (8): 16 bytes per "
                  "parameter, as in ZeRO, but SHARD_GRAD_OP keeps no resident fp16 copy: its 2P of bf16 parameters "
                  "exist only while gathered, from forward to backward (the 'gathered at peak' column), so its "
                  "resident model states are 16P/N, and its peak adds the gathered parameters instead of ZeRO-2's "
                  "2P + 14P/N. The whole peak adds what ZeRO's table leaves out: activations, fp32 reduction "
                  "buffers and, at NO_SHARD's optimizer step, AdamW's shard-sized temporary."), ""]
    anchors = results.get("anchors")
    if anchors:
        f = anchors["fsdp_paper_gpt175b_128xA100"]
        lines += ["## Published figures beside the planner's predictions", "",
                  "| configuration | published | predicted (data-sheet preset, not measured) |", "| --- | --- | --- |",
                  (f"| FSDP paper: GPT-175B, 128 A100, batch 20 x 512, FULL_SHARD | 159 TFLOP/s per GPU (51% of peak) | "
                  f"{f['predicted_tflops_per_gpu']:.0f} TFLOP/s ({f['predicted_mfu'] * 100:.0f}%), peak "
                  f"{f['predicted_peak_gib']:.0f} GiB per GPU ({'fits' if f['fits_80gb'] else 'does NOT fit'} 80 GB) |")]
        t = anchors["torchtitan_llama3_8b_8xH100"]
        for label, p in t["predicted"].items():
            lines.append(f"| torchtitan: Llama-3-8B, 8 H100, batch 1 x 8192, FSDP=8 ({label}) | 40.96 GiB, 7,227 "
                         f"tokens/s per GPU ({t['published_note']}) | {p['predicted_peak_gib']:.1f} GiB, "
                         f"{p['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s ({p['predicted_mfu'] * 100:.0f}% MFU) |")
        lines += ["", ("The differences are stated as they are: the planner uses data-sheet peak FLOP/s and bandwidths "
                  "with a roofline per operator, so it predicts the time of an ideal kernel for every operator of the "
                  "unfused graph; it knows nothing of kernel efficiency below peak, of launch gaps, or of the "
                  "fusions Inductor would make."), ""]
    a10g = results.get("a10g")
    if a10g:
        lines += ["## Deepest model per strategy on one G5.48xlarge (8x A10G 24 GB), predicted", "",
                  f"GPT family with d_model {a10g['width']}, batch 1 x {a10g['seq']}, {a10g['mixed_precision']}, AdamW.", "",
                  "| strategy | deepest that fits | parameters | ZeRO formula (16 B/param, no activations) |",
                  "| --- | --- | --- | --- |"]
        for name, r in a10g["rows"].items():
            lines.append(f"| {name} | {r['depth']} layers | {r['parameters'] / 1e9:.2f}B | "
                         f"{r['zero_formula_parameters'] / 1e9:.2f}B |")
        lines += ["", ("Activations, gathered parameters and reduction buffers are what separates the planner's "
                  "answer from the formula's."), ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", action="append", choices=["accuracy", "attribution", "scale", "zero", "anchors", "a10g"])
    parser.add_argument("--steps", type=int, default=14, help="steps per strategy (2 warm-up, the rest timed)")
    parser.add_argument("--quiet-load", type=float, default=QUIET["load"],
                        help="before each measured run, wait for the 1-minute load average to fall below this")
    parser.add_argument("--quiet-wait", type=float, default=QUIET["wait_s"],
                        help="seconds to wait for it at most (then run anyway; the load is recorded)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--reuse", action="store_true",
                        help="accuracy: use the compare.json files already in --out instead of running them again")
    parser.add_argument("--reuse-only", action="store_true", help="like --reuse, leaving out runs not written")
    args = parser.parse_args()
    QUIET.update(load=args.quiet_load, wait_s=args.quiet_wait)
    REUSE.update(on=args.reuse or args.reuse_only, only=args.reuse_only)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = "plan_accuracy_smoke" if args.smoke else "plan_accuracy"
    path = out / f"{name}.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(when=time.strftime("%Y-%m-%d %H:%M"), machine=f"{platform.machine()} {os.cpu_count()} cores",
                   torch=torch.__version__)
    runners = {
        "accuracy": lambda: part_accuracy(args.steps, out, args.smoke),
        "attribution": lambda: part_attribution(args.smoke),
        "scale": lambda: part_scale(args.smoke),
        "zero": lambda: part_zero(args.smoke),
        "anchors": part_anchors,
        "a10g": (lambda: part_a10g(width=128, seq=32, memory_budget=4e6, vocab=256)) if args.smoke else part_a10g,
    }
    default_parts = (["accuracy", "attribution", "scale", "zero", "a10g"] if args.smoke else
                     ["accuracy", "attribution", "scale", "zero", "anchors", "a10g"])
    for part in args.part or default_parts:
        started = time.time()
        results[part] = runners[part]()
        results[part]["seconds"] = time.time() - started
        path.write_text(json.dumps(results, indent=2, default=str))
        (out / f"{name}.md").write_text(render(results))
        print(f"{part}: done in {time.time() - started:.0f}s", flush=True)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
