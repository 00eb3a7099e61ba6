"""Compile-time benchmark: fsdp_compile against plain ``torch.compile`` of the unsharded model.

    OMP_NUM_THREADS=1 python bench/compile_time.py                      # 4/16/32/64 layers, both compilers
    python bench/compile_time.py --layers 4 16 --compilers aot_eager     # a subset
    python bench/compile_time.py --smoke --out /tmp/ct                   # tiny, for the test suite
    python bench/compile_time.py --device cuda --compilers inductor      # on a GPU machine

The project's GPT (d_model 64, 4 heads, sequence 64, vocab 67, batch 2 per rank) at several
depths, at world 2 (gloo, CPU), or with ``--device cuda`` one rank per GPU over NCCL (world 1
on a one-GPU machine: the collectives move nothing, but Inductor generates and compiles Triton
kernels, which is what a GPU user's compile pays). Every (depth, compiler, variant) runs in fresh processes
(``torchrun``-style, one per rank, each with an empty Inductor cache directory of its own), so
no cache leaks from one measurement into another. Variants:

  plain           ``torch.compile(model)`` of the unsharded model on the same ranks;
  plain_regions   the same with every block's forward a ``torch.compiler.nested_compile_region``
                  (torch's own way to compile a repeated block once), the peer for regions;
  fsdp            ``fsdp_compile`` FULL_SHARD, regions and scheduling on (the defaults);
  fsdp_no_regions the same with ``regions=False`` (every block traced and compiled inline);
  fsdp_nosched    the same as fsdp with ``schedule=False``;
  fsdp_warm     (Inductor only) the fsdp variant with ``cache_dir=`` a fresh directory
                (``fsdp_cold_cached``), then new processes compiling it again with that
                directory: the warm restart.

Per run: the first step (forward + backward; it compiles) minus the median of the next steps
is the compile time, max over ranks. Before timing, each process compiles a tiny unrelated
function with the same compiler, so module imports and compiler start-up are not counted. The
breakdown comes from torch's own instrumentation (``torch._dynamo.utils.compilation_time_metrics``,
the ``dynamo_timed`` regions: Dynamo tracing, guards, AOTAutograd tracing, the partitioner,
Inductor's ``compile_fx_inner``) and from the backend's own timings (``CompiledGraph.pass_seconds``
per pass, ``stage_seconds`` for all of our work per phase), on rank 0.

Writes ``compile_time_cpu.json`` and ``compile_time_cpu.md`` (``compile_time_smoke.*`` with
``--smoke``) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import rank_env, torchrun_command

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("plain", "plain_regions", "fsdp", "fsdp_no_regions", "fsdp_nosched", "fsdp_warm")
ALL_VARIANTS = (*VARIANTS, "fsdp_cold_cached")
COMPILERS = ("aot_eager", "inductor")

# torch's dynamo_timed regions that make up a compile, grouped for the breakdown. Regions
# nest (compile_inner holds everything); these groups do not overlap one another.
TORCH_REGIONS = {
    "dynamo_trace": ["bytecode_tracing"],
    "dynamo_guards": ["build_guards"],
    "aot_trace": ["aot_collect_metadata", "aot_trace_joint_graph"],
    # Inductor times its partitioner under the partitioner's name (ours: PartitionerHook, _Partitioner in older results);
    # under aot_eager the benchmark (plain) and the backend (stage_seconds) time it.
    "partitioner": ["min_cut_rematerialization_partition", "PartitionerHook", "_Partitioner",
                    "partition (timed by the benchmark)"],
    # Inductor's joint-graph passes (ours run among them and are subtracted) and its
    # compilation of each graph (lowering, code generation, C++ compilation, cache lookups).
    "inductor": ["_recursive_joint_graph_passes", "compile_fx_inner"],
}
BREAKDOWN = ("dynamo_trace", "dynamo_guards", "aot_trace", "partitioner", "ours", "inductor", "other")


# ----------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    # A cache directory per rank and run: ranks compiling the same graph must not reuse each
    # other's kernels, and no run may reuse an earlier run's.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(args.inductor_cache, f"rank{rank}")
    # Triton's kernel cache follows Inductor's directory unless the environment names one of
    # its own, which would carry kernels from one run to the next on a GPU machine.
    os.environ.pop("TRITON_CACHE_DIR", None)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fsdp_compile
    from fsdp_compile.models.gpt import GPT, GPTConfig
    from fsdp_compile.sharding.groups import end_process_group

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()

    def synchronize() -> None:
        if cuda:  # a step's time includes its kernels, not only their launches
            torch.cuda.synchronize(device)

    # Imports and compiler start-up (Inductor's worker pool, the C++ toolchain probe, CUDA's
    # context) once, outside the measurement, with the same compiler.
    probe = torch.compile(lambda t: (t.sin() * 2).sum(), backend=args.compiler)
    probe(torch.randn(8, requires_grad=True, device=device)).backward()
    synchronize()
    torch._dynamo.reset()

    cfg = GPTConfig(vocab_size=67, block_size=args.seq, n_layer=args.layers[0], n_head=4, d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(cfg)
    backend = None
    partition_seconds: list[float] = []
    if args.variant == "plain_regions":
        # The benchmark's own process: the model class is patched here only.
        from fsdp_compile.models.gpt import Block

        Block.forward = torch.compiler.nested_compile_region(Block.forward)
    plain = args.variant in ("plain", "plain_regions")
    if plain:
        model.to(device)  # fsdp_compile's shard() moves it instead
    if plain and args.compiler == "aot_eager":
        # torch's aot_eager backend, with its partitioner timed (torch times it only inside
        # Inductor).
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def timed_partition(*a, **k):
            start = time.perf_counter()
            try:
                return min_cut_rematerialization_partition(*a, **k)
            finally:
                partition_seconds.append(time.perf_counter() - start)

        compiled = torch.compile(model, backend=aot_autograd(
            fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=timed_partition,
            keep_inference_input_mutations=True))
    elif plain:
        compiled = torch.compile(model, backend=args.compiler)
    else:
        options = {"compiler": args.compiler, "schedule": args.variant != "fsdp_nosched",
                   "regions": args.variant != "fsdp_no_regions"}
        if args.cache_dir:
            options["cache_dir"] = args.cache_dir
        backend = fsdp_compile.backend("FULL_SHARD", **options)
        backend.shard(model)  # moves a model built on the CPU to the group's device
        compiled = torch.compile(model, backend=backend)

    gen = torch.Generator().manual_seed(1000 + rank)
    metrics = torch._dynamo.utils.compilation_time_metrics
    metrics.clear()
    times, cpu_times = [], []
    first_metrics: dict[str, float] = {}
    for step in range(1 + args.steps):
        idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=gen).to(device)
        synchronize()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(compiled(idx[:, :-1]).reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))
        loss.backward()
        synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
        model.zero_grad(set_to_none=True)
        if step == 0:
            first_metrics = {k: sum(v) for k, v in metrics.items()}
            if partition_seconds:
                first_metrics["partition (timed by the benchmark)"] = sum(partition_seconds)
    steady = statistics.median(times[1:])
    result = {
        "first_step_s": times[0],
        "steady_step_s": steady,
        "compile_s": times[0] - steady,
        # CPU time of this process (its threads; not Inductor's compile workers): less sensitive
        # than wall time to other jobs on a shared machine.
        "compile_cpu_s": cpu_times[0] - statistics.median(cpu_times[1:]),
        "torch_regions": first_metrics,
    }
    if backend is not None:
        result["graphs"] = [
            {"pass_seconds": r.pass_seconds, "stage_seconds": r.stage_seconds,
             "graph_nodes": {"dynamo": len(r.dynamo.graph.nodes), **r.graph_nodes},
             "fallbacks": r.fallbacks}
            for r in backend.graphs
        ]
        result["cache"] = dict(getattr(backend, "cache_stats", {}) or {})
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered, indent=1))
    end_process_group(exit_process=True)


# ----------------------------------------------------------------------------- parent
def depth_fit(shallow: int, shallow_s: float, deep: int, deep_s: float) -> tuple[float, float, float] | None:
    """(fixed seconds, seconds per block, the most seconds per block with which ``deep`` layers
    take at most 2x of ``shallow``) for compile time = fixed + layers x per block through both
    points; None when the depths do not allow it (one depth, or ``deep`` <= 2 x ``shallow``)."""
    if deep <= 2 * shallow:
        return None
    per_block = (deep_s - shallow_s) / (deep - shallow)
    fixed = shallow_s - shallow * per_block
    # fixed + deep p <= 2 (fixed + shallow p)  <=>  p <= fixed / (deep - 2 shallow)
    return fixed, per_block, fixed / (deep - 2 * shallow)


def run_config(args: argparse.Namespace, layers: int, compiler: str, variant: str, workdir: Path,
               cache_dir: str | None) -> dict:
    result = workdir / f"{compiler}_{layers}_{variant}.json"
    inductor_cache = tempfile.mkdtemp(prefix="inductor_", dir=workdir)
    command = torchrun_command(args.world, __file__, "--worker", "--layers", str(layers), "--compiler", compiler,
                               "--variant", variant, "--result", str(result), "--inductor-cache", inductor_cache,
                               "--d-model", str(args.d_model), "--seq", str(args.seq), "--batch", str(args.batch),
                               "--steps", str(args.steps), "--device", args.device)
    if cache_dir:
        command += ["--cache-dir", cache_dir]
    started = time.perf_counter()
    proc = subprocess.run(command, check=False, env=rank_env(), capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} {layers} layers {variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = json.loads(result.read_text())
    shutil.rmtree(inductor_cache, ignore_errors=True)
    return summarize(ranks, layers, compiler, variant, time.perf_counter() - started)


def summarize(ranks: list[dict], layers: int, compiler: str, variant: str, wall: float) -> dict:
    lead = ranks[0]
    regions = lead["torch_regions"]
    breakdown = {name: sum(regions.get(k, 0.0) for k in keys) for name, keys in TORCH_REGIONS.items()}
    passes: dict[str, float] = {}
    nodes: dict[str, int] = {}
    ours = 0.0
    for graph in lead.get("graphs", []):
        stages = dict(graph["stage_seconds"])
        if "partition" in stages:  # the partitioner is torch's, timed by the backend under aot_eager
            breakdown["partitioner"] += stages.pop("partition")
        if compiler == "inductor":  # our joint passes ran inside Inductor's joint-graph passes
            breakdown["inductor"] -= stages.get("joint", 0.0)
        ours += sum(stages.values())
        for phase, timings in graph["pass_seconds"].items():
            for name, seconds in timings.items():
                passes[f"{phase}/{name}"] = passes.get(f"{phase}/{name}", 0.0) + seconds
        for phase, count in graph["graph_nodes"].items():
            nodes[phase] = nodes.get(phase, 0) + count
    breakdown["ours"] = ours
    compile_s = max(r["compile_s"] for r in ranks)
    # Our passes run inside torch's regions under Inductor (the joint passes inside the
    # partition step, the graph passes inside fw/bw_compiler but outside compile_fx_inner), so
    # "other" is what is left of rank 0's compile time after all the named parts.
    breakdown["other"] = lead["compile_s"] - sum(v for k, v in breakdown.items() if k != "other")
    per_node = {}
    for key, seconds in passes.items():
        phase = key.split("/", 1)[0]
        phase_nodes = nodes.get(phase) or nodes.get("inference")
        if phase_nodes:
            per_node[key] = seconds / phase_nodes * 1e6
    return {
        "layers": layers, "compiler": compiler, "variant": variant,
        "compile_s": compile_s,
        "compile_cpu_s": max(r["compile_cpu_s"] for r in ranks),
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "steady_step_s": max(r["steady_step_s"] for r in ranks),
        "rank0_compile_s": lead["compile_s"],
        "breakdown_s": breakdown,
        "passes_s": passes,
        "pass_us_per_node": per_node,
        "graph_nodes": nodes,
        "torch_regions_s": regions,
        "fallbacks": [f for g in lead.get("graphs", []) for f in g["fallbacks"]],
        "cache": lead.get("cache", {}),
        "wall_s": wall,
    }


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def median_runs(rows: list[dict]) -> list[dict]:
    """One row per (compiler, layers, variant): the run with the median compile time, carrying
    every run's compile time (a noisy machine moves one run by 15% or more)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["compiler"], row["layers"], row["variant"]), []).append(row)
    chosen = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r["compile_s"])
        median = dict(runs[(len(runs) - 1) // 2])
        median["compile_s_runs"] = [r["compile_s"] for r in runs]
        chosen.append(median)
    return chosen


def markdown(report: dict) -> str:
    rows = report["results"]
    find = {(r["compiler"], r["layers"], r["variant"]): r for r in rows}
    lines = [
        "# Compile time: fsdp_compile vs plain torch.compile",
        "",
        (f"GPT (d_model {report['config']['d_model']}, 4 heads, sequence {report['config']['seq']}, "
        f"vocab 67, batch {report['config']['batch']}/rank), FULL_SHARD, world {report['world']} "
        f"({report.get('transport', 'gloo, CPU')}), {report['machine']}, torch {report['torch']}. Compile time = first step "
        f"(forward + backward) minus the median of the next {report['config']['steps']} steps, max "
        "over ranks; every (depth, compiler, variant) in fresh processes with empty caches, after a "
        "tiny warm-up compile that pays imports."
        + (f" Each configuration ran {report['repeats']} times, interleaved with the others at its "
           "depth; the table shows the run with the median compile time (every run's compile time "
           "is in the JSON, `compile_s_runs`)." if report.get("repeats", 1) > 1 else "")),
        "",
        *([f"**Caveat:** {report['caveat']}", ""] if report.get("caveat") else []),
    ]
    for compiler in report["compilers"]:
        lines += [f"## {compiler}", "",
                  "| layers | plain s | fsdp_compile s | ratio | ratio of CPU time | no regions s | plain with regions s | no scheduling s | scheduling cost | our work s (% of compile) | warm restart: first step s (% of cold) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for layers in report["layers"]:
            plain = find.get((compiler, layers, "plain"))
            fsdp = find.get((compiler, layers, "fsdp"))
            nosched = find.get((compiler, layers, "fsdp_nosched"))
            warm = find.get((compiler, layers, "fsdp_warm"))
            cold_cached = find.get((compiler, layers, "fsdp_cold_cached"))
            ratio = f"{fsdp['compile_s'] / plain['compile_s']:.2f}x" if plain and fsdp else "-"
            cpu_ratio = f"{fsdp['compile_cpu_s'] / plain['compile_cpu_s']:.2f}x" if plain and fsdp else "-"
            cost = (f"{(fsdp['compile_s'] / nosched['compile_s'] - 1) * 100:+.0f}%"
                    if fsdp and nosched else "-")
            ours = (f"{fsdp['breakdown_s']['ours']:.2f} ({fsdp['breakdown_s']['ours'] / fsdp['rank0_compile_s'] * 100:.0f}%)"
                    if fsdp else "-")
            warm_s = "-"
            if warm and cold_cached:
                warm_s = (f"{warm['first_step_s']:.1f} ({warm['first_step_s'] / cold_cached['first_step_s'] * 100:.0f}% "
                          f"of the run that filled the cache, {cold_cached['first_step_s']:.1f}")
                if fsdp:
                    warm_s += f"; {warm['first_step_s'] / fsdp['first_step_s'] * 100:.0f}% of fsdp_compile's"
                warm_s += ")"

            flat = find.get((compiler, layers, "fsdp_no_regions"))
            plain_regions = find.get((compiler, layers, "plain_regions"))
            lines.append(f"| {layers} | {fmt(plain and plain['compile_s'])} | {fmt(fsdp and fsdp['compile_s'])} | "
                         f"{ratio} | {cpu_ratio} | {fmt(flat and flat['compile_s'])} | "
                         f"{fmt(plain_regions and plain_regions['compile_s'])} | {fmt(nosched and nosched['compile_s'])} | "
                         f"{cost} | {ours} | {warm_s} |")
        shallow, deep = report["layers"][0], report["layers"][-1]
        lines += ["", f"Depth: compile time at each depth over the shallowest's ({compiler}); as a fixed part plus a "
                  f"cost per block, from {shallow} and {deep} layers, and the cost per block at which {deep} layers "
                  f"would take 2x of {shallow} with that fixed part:", "",
                  "| variant | " + " | ".join(f"{layers} layers" for layers in report["layers"])
                  + " | fixed s | per block s | per block for 2x s |",
                  "| --- | " + " | ".join("---" for _ in report["layers"]) + " | --- | --- | --- |"]
        for variant in ("plain", "plain_regions", "fsdp", "fsdp_no_regions"):
            runs = [find.get((compiler, layers, variant)) for layers in report["layers"]]
            if runs[0] and all(runs):
                fit = depth_fit(shallow, runs[0]["compile_s"], deep, runs[-1]["compile_s"])
                fitted = " | ".join(f"{v:.2f}" for v in fit) if fit else "- | - | -"
                lines.append(f"| {variant} | " + " | ".join(f"{r['compile_s'] / runs[0]['compile_s']:.2f}x"
                                                          for r in runs) + f" | {fitted} |")
        lines += ["", f"Breakdown on rank 0, seconds ({compiler}):", "",
                  "| layers | variant | compile | " + " | ".join(BREAKDOWN) + " |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in BREAKDOWN) + " |"]
        for layers in report["layers"]:
            for variant in ALL_VARIANTS:
                r = find.get((compiler, layers, variant))
                if r:
                    lines.append(f"| {layers} | {variant} | {r['rank0_compile_s']:.2f} | "
                                 + " | ".join(f"{r['breakdown_s'][k]:.2f}" for k in BREAKDOWN) + " |")
        fsdp_rows = [find[(compiler, layers, "fsdp")] for layers in report["layers"] if (compiler, layers, "fsdp") in find]
        if fsdp_rows:
            names = sorted({k for r in fsdp_rows for k in r["pass_us_per_node"]})
            lines += ["", (f"Our passes ({compiler}, fsdp): microseconds per node of the graph each pass "
                           "receives (linear passes stay flat across depths), and seconds in total:"), "",
                      "| pass | " + " | ".join(f"{r['layers']} layers" for r in fsdp_rows) + " | last / first |",
                      "| --- | " + " | ".join("---" for _ in fsdp_rows) + " | --- |"]
            for name in names:
                values = [r["pass_us_per_node"].get(name) for r in fsdp_rows]
                spread = f"{values[-1] / values[0]:.2f}" if values[0] and values[-1] else "-"
                cells = [f"{v:.1f} us ({r['passes_s'][name]:.3f} s)" if v is not None else "-"
                         for v, r in zip(values, fsdp_rows)]
                lines.append(f"| {name} | " + " | ".join(cells) + f" | {spread} |")
        lines.append("")
    lines += ["## Where the time goes", "", *where_the_time_goes(report, find), ""]
    if report.get("notes"):
        lines += ["## Notes", ""] + report["notes"] + [""]
    return "\n".join(lines)


def where_the_time_goes(report: dict, find: dict) -> list[str]:
    """Per compiler and depth: what fsdp_compile adds over plain torch.compile, by part."""
    out = []
    for compiler in report["compilers"]:
        for layers in report["layers"]:
            plain, fsdp = find.get((compiler, layers, "plain")), find.get((compiler, layers, "fsdp"))
            if not (plain and fsdp):
                continue
            extra = fsdp["rank0_compile_s"] - plain["rank0_compile_s"]
            parts = sorted(((k, fsdp["breakdown_s"][k] - plain["breakdown_s"].get(k, 0.0)) for k in BREAKDOWN),
                           key=lambda kv: -abs(kv[1]))
            described = ", ".join(f"{k} {v:+.2f} s" for k, v in parts if abs(v) >= 0.005)
            out.append(f"- {compiler}, {layers} layers: fsdp_compile {fsdp['rank0_compile_s']:.2f} s vs plain "
                       f"{plain['rank0_compile_s']:.2f} s ({extra:+.2f} s): {described}.")
    return out


def build_report(rows: list[dict], args: argparse.Namespace, earlier: dict | None, torch_version: str,
                 machine: str) -> dict:
    """The report of ``rows`` (the median run per configuration), merged into ``earlier`` (an
    ``--append`` run's predecessor): rows measured again replace theirs, the others stay."""
    rows = median_runs(rows)
    layers, compilers = list(args.layers), list(args.compilers)
    if earlier:
        measured = {(r["compiler"], r["layers"], r["variant"]) for r in rows}
        rows = [r for r in earlier["results"] if (r["compiler"], r["layers"], r["variant"]) not in measured] + rows
        layers = sorted({*earlier["layers"], *layers})
        compilers = [c for c in COMPILERS if c in {*earlier["compilers"], *compilers}]
    return {
        "torch": torch_version,
        "machine": machine,
        "world": args.world,
        "transport": "NCCL, CUDA" if args.device == "cuda" else "gloo, CPU",
        "layers": layers,
        "compilers": compilers,
        "config": {"d_model": args.d_model, "seq": args.seq, "batch": args.batch, "steps": args.steps},
        "caveat": args.caveat,
        "repeats": args.repeats,
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--compilers", nargs="+", choices=COMPILERS, default=list(COMPILERS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one rank per GPU over NCCL (results named compile_time_cuda.*)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: 2 on the CPU, every GPU with --device cuda)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps after the first, for the steady time")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per configuration (interleaved); the median run is reported")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager, for the tests")
    parser.add_argument("--append", action="store_true",
                        help="merge into the results already in --out (rows measured now replace theirs)")
    parser.add_argument("--caveat", default="",
                        help="what the reader should know about the conditions (say, other jobs on the machine)")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiler", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=ALL_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--inductor-cache", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more")
    if args.smoke:
        args.layers, args.d_model, args.seq, args.steps = [1, 2], 16, 8, 1
        args.compilers = args.compilers if "--compilers" in sys.argv else ["aot_eager"]
        args.variants = args.variants if "--variants" in sys.argv else ["plain", "fsdp"]
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "compile_time_smoke" if args.smoke else f"compile_time_{args.device}"
    earlier = json.loads((out / f"{name}.json").read_text()) if args.append and (out / f"{name}.json").exists() else None
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name(0)}"

    def write(rows: list[dict]) -> str:
        """Every row so far, written at once: a run stopped part way (by a deadline) keeps what
        it measured."""
        report = build_report(rows, args, earlier, torch.__version__, machine)
        text = markdown(report)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
        (out / f"{name}.md").write_text(text)
        return text

    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        write(rows)
        print(f"{row['compiler']:9s} {row['layers']:3d} layers {row['variant']:16s} compile {row['compile_s']:7.2f} s "
              f"(first step {row['first_step_s']:.2f} s)", flush=True)

    with tempfile.TemporaryDirectory(prefix="compile_time_") as tmp:
        workdir = Path(tmp)
        for compiler in args.compilers:
            for layers in args.layers:
                for variant in [v for _ in range(args.repeats) for v in args.variants]:
                    if variant == "fsdp_warm":
                        if compiler != "inductor":
                            continue  # torch caches Inductor's output only
                        # A cold run that fills a fresh cache_dir, then a new run that reads it.
                        cache_dir = str(workdir / f"fsdp_cache_{compiler}_{layers}")
                        record(run_config(args, layers, compiler, "fsdp_cold_cached", workdir, cache_dir))
                        record(run_config(args, layers, compiler, variant, workdir, cache_dir))
                        shutil.rmtree(cache_dir, ignore_errors=True)
                    else:
                        record(run_config(args, layers, compiler, variant, workdir, None))
    print(write(rows))


if __name__ == "__main__":
    main()
