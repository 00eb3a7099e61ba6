"""``python -m fsdp_compile plan ...`` and ``torchrun ... -m fsdp_compile compare ...``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..sharding.groups import end_process_group
from .cluster_numbers import cluster_numbers

# GPT-3 paper (Brown et al., 2020), Table 2.1: layers, d_model, heads; vocabulary 50257, context 2048.
GPT_SIZES = {
    "gpt-125m": (12, 768, 12), "gpt-350m": (24, 1024, 16), "gpt-760m": (24, 1536, 16),
    "gpt-1.3b": (24, 2048, 16), "gpt-2.7b": (32, 2560, 32), "gpt-6.7b": (32, 4096, 32),
    "gpt-13b": (40, 5120, 40), "gpt-175b": (96, 12288, 96),
    "gpt-tiny": (2, 64, 2),  # for smoke tests and runs on a CPU
    "gpt-demo": (2, 64, 4),  # the demo's GPT (python -m fsdp_compile.demo)
}
LLAMA_SIZES = ("llama3-8b", "llama3-70b", "llama-tiny")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "none": None}


def model_names() -> list[str]:
    return [*GPT_SIZES, *LLAMA_SIZES]


def build_model(name: str, *, layers: int | None = None, seq: int = 2048, vocab: int | None = None,
                checkpoint: bool = False, device: str = "meta") -> nn.Module:
    """A built-in model by name (``gpt-1.3b``, ``llama3-70b``, ...) or ``module:factory``."""
    if ":" in name:
        factory = _import_fn(name, "--model")
        with torch.device(device):
            model = factory()
        if not isinstance(model, nn.Module):
            raise SystemExit(f"--model {name}: the factory returned {type(model).__name__}, not an nn.Module")
        return model
    if name in GPT_SIZES:
        from ..models.gpt import GPT, GPTConfig

        n_layer, d_model, n_head = GPT_SIZES[name]
        cfg = GPTConfig(vocab_size=vocab or (128 if name in ("gpt-tiny", "gpt-demo") else 50257), block_size=seq,
                        n_layer=layers or n_layer, n_head=n_head, d_model=d_model)
        with torch.device(device):
            return GPT(cfg)
    if name in LLAMA_SIZES:
        from ..models.llama import Llama, LlamaConfig

        config = {"llama-tiny": LlamaConfig, "llama3-8b": LlamaConfig.llama3_8b, "llama3-70b": LlamaConfig.llama3_70b}
        overrides = {"n_layers": layers, "vocab_size": vocab}
        with torch.device(device):
            return Llama(config[name](max_seq_len=max(seq, 2), checkpoint_blocks=checkpoint,
                                      **{key: value for key, value in overrides.items() if value}))
    raise SystemExit(f"--model {name!r}: use one of {', '.join(model_names())} or module:factory")


def _strategies(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",")] if text else None


def _bucket(text: str) -> Any:
    if text in ("module", "param"):
        return text
    try:
        return int(float(text) * (1 << 20))  # MiB
    except ValueError:
        raise SystemExit(f"--bucket {text!r}: use module, param or a size in MiB") from None


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict every strategy's memory and step time on a cluster")
    p.add_argument("--model", default="gpt-1.3b", help=f"{', '.join(model_names())}, or module:factory")
    p.add_argument("--layers", type=int, help="override the model's depth")
    p.add_argument("--batch", type=int, default=1, help="sequences per device per step")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block (llama)")
    p.add_argument("--cluster", default="h100-sxm", help="preset: " + ", ".join(_presets()))
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", type=int)
    p.add_argument("--world-size", type=int, help="default: every device of the cluster")
    p.add_argument("--mixed-precision", choices=list(DTYPES), default="bf16",
                   help="parameter (compute) dtype; 'none' keeps the parameters' dtype")
    p.add_argument("--reduce-dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--strategies", help="comma-separated (default: all that apply)")
    p.add_argument("--bucket", action="append", help="bucket policy: module, param or MiB (repeatable)")
    p.add_argument("--prefetch", type=int, action="append", help="prefetch depth (repeatable; default 1 and 2)")
    p.add_argument("--memory-budget", type=float, help="GiB per device (default: the cluster's usable memory)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "none"])
    p.add_argument("--max-batch", action="store_true", help="also solve the largest batch each fitting strategy takes")
    p.add_argument("--tp", default="1", help="tensor-parallel degrees to try, comma-separated, e.g. 1,2,8 (each "
                   "must divide the devices of a node and the model's heads; default 1: no TP)")
    p.add_argument("--parallelize", metavar="MODULE:FN",
                   help="with --tp: the function (model, tp_mesh) -> model applying the TP plan (default: the "
                        "built-in model's own)")
    p.add_argument("--float8", action="store_true",
                   help="plan torchao float8 training: the linears converted, float8 all-gather (needs torchao)")
    p.add_argument("--json", type=Path, help="write the plan as JSON")
    p.add_argument("--verbose", action="store_true")


def _presets() -> list[str]:
    from .cluster import Cluster

    return Cluster.presets()


def _mixed_precision(args: argparse.Namespace):
    from ..api import MixedPrecision

    param = DTYPES[args.mixed_precision]
    return None if param is None else MixedPrecision(param_dtype=param, reduce_dtype=DTYPES[args.reduce_dtype])


def run_plan(args: argparse.Namespace) -> int:
    from .cluster import Cluster
    from .plan import plan

    cluster = Cluster.preset(args.cluster, nodes=args.nodes, devices_per_node=args.devices_per_node)
    model = build_model(args.model, layers=args.layers, seq=args.seq, checkpoint=args.activation_checkpointing)
    tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    result = plan(model, (tokens,), cluster=cluster, loss_fn=_token_loss, mixed_precision=_mixed_precision(args),
                  optimizer=args.optimizer, world_size=args.world_size, strategies=_strategies(args.strategies),
                  buckets=[_bucket(b) for b in args.bucket] if args.bucket else ("module",),
                  prefetch=args.prefetch or (1, 2),
                  memory_budget=args.memory_budget * (1 << 30) if args.memory_budget else None,
                  verbose=args.verbose, tp_degrees=_tp_degrees(args.tp),
                  parallelize_fn=_import_fn(args.parallelize, "--parallelize"), float8=args.float8)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {params / 1e9:.3g}B parameters, batch {args.batch} x sequence {args.seq} per device")
    sys.stdout.write(str(result))
    fitting = dict.fromkeys(row.strategy for row in result.rows if row.fits) if args.max_batch else {}
    solved = {name: result.max_batch(name) for name in fitting}
    for name, batch in solved.items():
        print(f"largest batch {name} fits: {batch}")
    print(f"planned in {result.seconds:.1f}s")
    if args.json:
        data = result.to_json()
        data.update(model=args.model, parameters=params, batch=args.batch, seq=args.seq, max_batch=solved)
        args.json.write_text(json.dumps(data, indent=2))
    return 0 if result.best is not None else 1


def _tp_degrees(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"--tp {text!r}: give TP degrees as comma-separated integers, e.g. --tp 1,2,8") from None


def _import_fn(text: str | None, option: str) -> Any:
    if not text:
        return None
    module_name, _, attr = text.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise SystemExit(f"{option} {text}: cannot import {attr!r} from {module_name!r}: {exc}") from None


def _token_loss(output: torch.Tensor) -> torch.Tensor:
    """A language model's loss over the logits (the shape of cross-entropy's work, no targets needed)."""
    logits = output.float()
    return torch.logsumexp(logits, dim=-1).mean() - logits.mean()


# ---------------------------------------------------------------------- compare
def add_compare_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="(under torchrun) run every strategy here and set the plan beside it")
    p.add_argument("--model", default="gpt-demo", help=f"{', '.join(model_names())}, or module:factory "
                   "(default: the demo's GPT)")
    p.add_argument("--layers", type=int)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=12,
                   help="steps per strategy (the first two warm up; the median of the rest is reported)")
    p.add_argument("--strategies", help="comma-separated (default: all that apply at this world size)")
    p.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"])
    p.add_argument("--shard-size", type=int, help="hybrid strategies: ranks per shard group (default LOCAL_WORLD_SIZE)")
    p.add_argument("--gc-during-steps", action="store_true",
                   help="leave Python's garbage collector on inside the timed steps (default: it runs between "
                   "them, as torchtitan's trainer does)")
    p.add_argument("--emulate", metavar="INTRA[,INTER]",
                   help="run on an emulated network: the intra-node and inter-node link bandwidths, e.g. "
                        "1GB/s,100MB/s (fsdp_compile.EmulatedNetwork; ranks per node: --shard-size, else "
                        "LOCAL_WORLD_SIZE); the cluster is measured on it, so the plan predicts for it")
    p.add_argument("--emulate-latency", default="10us", help="the emulated links' latency per collective")
    p.add_argument("--exposed", action="store_true",
                   help="with --emulate and a --host that times the backend's own collectives: also run each "
                        "timed step on unlimited links (gloo's own speed), alternating with the emulated ones, "
                        "so that the table shows each strategy's exposed communication (step on the network - "
                        "step on unlimited links) measured and predicted from one calibration")
    p.add_argument("--host", metavar="MODULE:CLASS",
                   help="a host model to calibrate and plan with (Cluster.measure(host=...)): what the device "
                        "adds to the GPU cost model, e.g. ranks sharing CPU cores with gloo's threads; the "
                        "repository's lab (lab/, not installed) has fsdp_compile_lab:HostCPU")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: run every strategy over dp = world / tp with the model's TP plan "
                        "on a (dp, tp) mesh, and plan the same (default 1: no TP)")
    p.add_argument("--parallelize", metavar="MODULE:FN", help="with --tp: the TP plan (default: the built-in model's)")
    p.add_argument("--out", type=Path, default=Path("compare_out"), help="directory for compare.json and compare.png")


def run_compare(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    import torch.nn.functional as F

    from .child_process import run_in_subprocess
    from .cluster import Cluster
    from .compare import bar_chart, clusters_beside_steps, measure_strategy
    from .measured import step_range, within_noise

    owns_group = not dist.is_initialized()
    network = None
    if args.exposed and not args.emulate:
        raise SystemExit("--exposed compares an emulated network with unlimited links: add --emulate INTRA[,INTER]")
    host = _import_fn(args.host, "--host")
    if args.exposed and not hasattr(host, "unlimited_links"):
        raise SystemExit("--exposed plans each strategy on the links at the backend's own speed too, which a host "
                         "model times (its unlimited_links): add --host MODULE:CLASS, e.g. fsdp_compile_lab:HostCPU")
    if args.emulate and not owns_group:
        raise SystemExit("--emulate sets up the process group itself: run compare as a torchrun script, before "
                         "any torch.distributed.init_process_group()")
    if owns_group:
        if "RANK" not in os.environ:
            raise SystemExit("compare runs strategies on the current processes: start it with torchrun, e.g. "
                             "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m fsdp_compile compare")
        if args.emulate:
            network = _emulated_network(args.emulate, args.emulate_latency, args.shard_size)
            network.init_process_group()
        else:
            dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    shard_size = args.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    names = _strategies(args.strategies) or [
        s for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
        if not s.startswith("HYBRID") or (args.tp == 1 and shard_size < world and world % shard_size == 0)]
    def build() -> nn.Module:
        torch.manual_seed(0)
        return build_model(args.model, layers=args.layers, seq=args.seq, device="cpu")

    probe = build()
    tp = _compare_tp(args, probe, world, build)
    vocab = getattr(getattr(probe, "cfg", None), "vocab_size", 128)
    # Under TP the ranks of a tp group compute on the same batch: seeded by the dp rank.
    gen = torch.Generator().manual_seed(1 + (rank if tp is None else tp["mesh"]["dp"].get_local_rank()))
    data = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)]
    batches = [((d[:, :-1],), d[:, 1:]) for d in data]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    # Only the dtypes the model computes in: a CPU's bf16 calibration takes a minute and prices nothing here.
    dtypes = tuple(dict.fromkeys(p.dtype for p in probe.parameters() if p.is_floating_point()))
    cluster = Cluster.measure(nodes=world // shard_size if any(n.startswith("HYBRID") for n in names) else 1,
                              device_memory=64 << 30, dtypes=dtypes, host=host)
    # What the host model times beside each strategy's steps: the machine's speed moves between the calibration and the
    # steps
    beside_probe = cluster.host.beside_steps(build(), batches[0], loss_fn) if cluster.host is not None else None
    unlimited_cluster = cluster.host.unlimited_links(cluster) if args.exposed else None
    measured = {}
    gc_between_steps = not args.gc_during_steps
    for name in names:
        options = {"shard_size": shard_size} if name.startswith("HYBRID") else {}
        if tp is not None:
            options = {"mesh": tp["mesh"]["dp"]}
        measured[name] = measure_strategy(name, tp["build"] if tp else build, batches, loss_fn, compiler=args.compiler,
                                          backend_options=options, gc_between_steps=gc_between_steps,
                                          network=network, unlimited_too=args.exposed,
                                          reference=getattr(beside_probe, "reference", None),
                                          outside_graphs=beside_probe)
    rows = []
    if rank == 0:
        example = (torch.zeros(args.batch, args.seq, dtype=torch.long),)
        calibrated = getattr(cluster.host, "compute_scale", 1.0)
        beside = {name: beside_probe.numbers(measured[name], cluster) if beside_probe else {} for name in names}
        scales = {name: beside[name].get("compute_scale", calibrated) for name in names}
        on = {"at_calibration": (cluster, names), **clusters_beside_steps(cluster, unlimited_cluster, beside)}
        plans = run_in_subprocess(plan_each, probe, example, on=on, loss_fn=cross_entropy_loss, world_size=world,
                                  tp_degrees=(args.tp,), parallelize_fn=tp["fn"] if tp else None,
                                  **COMPARE_PLAN_OPTIONS)
        for name in names:
            rows.append({"strategy": name, "measured": measured[name].as_dict(),
                         "predicted": plans[name].row(name).as_dict(),
                         "predicted_at_calibration": plans["at_calibration"].row(name).as_dict(),
                         "compute_scale": {"at_calibration": calibrated, "beside_steps": scales[name]},
                         "outside_graphs": {
                             "at_calibration": {"optimizer_step": cluster.optimizer_step,
                                                "runtime_per_tensor": cluster.runtime_per_tensor},
                             "beside_steps": measured[name].outside_graphs}})
            if unlimited_cluster is not None:
                rows[-1]["predicted_unlimited"] = plans[f"{name} unlimited"].row(name).as_dict()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.json").write_text(json.dumps(
            {"model": args.model, "layers": args.layers, "world": world, "tp": args.tp, "batch": args.batch,
             "seq": args.seq, "compiler": args.compiler,
             "gc_between_steps": gc_between_steps,
             "network": None if network is None else repr(network),
             "cluster": cluster.describe(), "cluster_numbers": cluster_numbers(cluster),
             "unlimited_cluster_numbers": None if unlimited_cluster is None else cluster_numbers(unlimited_cluster),
             "rows": rows},
            indent=2, default=str))
        widths = (10, 15, 10, 10, 10, 10, 10, 10, 11)
        print(_line("strategy", ("step ms", "range ms", "pred ms", "tok/s", "peak MiB", "pred MiB", "wire MB",
                                 "pred MB", "compile s"), widths))
        for r in rows:
            m, p = r["measured"], r["predicted"]
            low, high = step_range(measured[r["strategy"]])
            print(_line(r["strategy"], (
                f"{m['step_seconds'] * 1e3:.1f}", f"{low * 1e3:.1f}-{high * 1e3:.1f}", f"{p['step_seconds'] * 1e3:.1f}",
                f"{m['tokens_per_second']:.0f}", f"{m['peak_bytes'] / 2**20:.1f}", f"{p['peak_bytes'] / 2**20:.1f}",
                f"{sum(m['bytes_per_step'].values()) / 1e6:.2f}", f"{sum(p['bytes_per_step'].values()) / 1e6:.2f}",
                f"{m['compile_seconds']:.1f}"), widths))
        _print_split(rows, beside_probe.cpu_share if beside_probe else 1.0)
        _print_speed(rows)
        if unlimited_cluster is not None:
            _print_exposed(rows)
        for line in within_noise(measured):
            print(line)
        if network is not None:
            print(f"on {network!r}, over the timed steps:")
            for name in names:
                print(f"  {name}: {measured[name].network['summary']}")
        try:
            bar_chart(rows, str(args.out / "compare.png"), f"{args.model}, world {world}: measured vs predicted")
        except ImportError:
            print("matplotlib is not installed: no chart (pip install -e '.[plot]')")
        print(f"written to {args.out}/compare.json and compare.png")
    if owns_group:  # started as a script under torchrun: it ends here
        end_process_group(exit_process=True)
    else:
        dist.barrier()
    return 0


# How compare plans each strategy (``bench/replan.py`` plans its published jobs again with them).
COMPARE_PLAN_OPTIONS: dict[str, Any] = {"prefetch": (1,), "memory_budget": 64 << 30}


def plan_each(model: nn.Module, example_inputs: tuple, *, on: dict[str, tuple[Any, list[str]]],
              **kwargs: Any) -> dict[str, Any]:
    """``plan(cluster=..., strategies=...)`` for each entry of ``on``, in one process (inside a job each ``plan()``
    would start a subprocess of its own, :mod:`.child_process`)."""
    from .plan import plan

    return {key: plan(model, example_inputs, cluster=cluster, strategies=strategies, **kwargs)
            for key, (cluster, strategies) in on.items()}


def _print_speed(rows: list[dict[str, Any]]) -> None:
    """How far the machine's speed moved from the calibration while each strategy ran."""
    if not any(r["measured"]["reference_seconds"] for r in rows):
        return  # not timed (a GPU, where the CPU runs ahead and compute_scale is 1)
    moved = [(r["strategy"], r["compute_scale"]["beside_steps"] / r["compute_scale"]["at_calibration"],
              r["predicted_at_calibration"]["step_seconds"]) for r in rows]
    print("predicted at the machine's speed beside each strategy's steps (the model's own forward and backward "
          "on one rank, and the calibration's optimizer and runtime workloads, timed after every step); "
          "compute_scale there against the calibration's, and the prediction at the calibration's: "
          + "; ".join(f"{name} {ratio:.2f}x, {seconds * 1e3:.1f} ms" for name, ratio, seconds in moved))


def _line(name: str, cells: Sequence[str], widths: Sequence[int]) -> str:
    """One row of compare's tables: the strategy, then each cell right-aligned to its width."""
    return f"{name:<20}" + "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))


def _print_exposed(rows: list[dict[str, Any]]) -> None:
    """The ``--exposed`` table: steps on unlimited links and the communication the network exposes."""
    widths = (14, 10, 12, 18, 10)
    print(_line("strategy", ("unlimited ms", "pred ms", "exposed ms", "95% interval", "pred ms"), widths))
    for r in rows:
        m, p, u = r["measured"], r["predicted"], r["predicted_unlimited"]
        interval = m["exposed_interval"]
        spread = "-" if interval is None else f"{interval[0] * 1e3:.1f} .. {interval[1] * 1e3:.1f}"
        cells = [f"{s * 1e3:.1f}" for s in (m["unlimited_step_seconds"], u["step_seconds"], m["exposed_seconds"])]
        print(_line(r["strategy"], (*cells, spread, f"{(p['step_seconds'] - u['step_seconds']) * 1e3:.1f}"), widths))
    print("exposed: the median over the timed steps of each step minus its pair on unlimited links; the interval "
          "holds the true median with 95% confidence (fewer than 6 timed steps give none)")


def step_split(measured: dict[str, Any], predicted: dict[str, Any],
               cpu_share: float = 1.0) -> dict[str, tuple[float, float]] | None:
    """A step's time three ways, (measured, predicted) seconds each: the main thread's CPU against the predicted
    compute, its wait for a core against the backend CPU the plan charges to compute, and the rest (blocked in waits)
    against the plan's waits; None without scheduler statistics. Each measured figure is the slowest rank's median, so
    the rest can dip a few ms below zero. A fourth pair, where the other threads were timed: their CPU (gloo's) against
    the plan's charge times ``cpu_share`` (the charge is that CPU stretched by the rank's share of a core)."""
    if measured.get("cpu_seconds") is None or measured.get("core_wait_seconds") is None:
        return None
    backend = predicted.get("backend_cpu_seconds") or 0.0
    rest = measured["step_seconds"] - measured["cpu_seconds"] - measured["core_wait_seconds"]
    split = {"compute": (measured["cpu_seconds"], predicted["compute_seconds"]),
             "core_wait": (measured["core_wait_seconds"], backend),
             "blocked": (rest, predicted["exposed_comm_seconds"] - backend)}
    if measured.get("others_cpu_seconds") is not None:
        split["backend_cpu"] = (measured["others_cpu_seconds"], backend * cpu_share)
    return split


def _print_split(rows: list[dict[str, Any]], cpu_share: float) -> None:
    """Where each step goes, measured / predicted (see :func:`step_split`)."""
    widths = (12, 8, 14, 8, 12, 8, 13, 8)
    print(_line("strategy", ("main CPU ms", "pred", "core wait ms", "pred", "blocked ms", "pred", "gloo CPU ms",
                             "pred"), widths))
    for r in rows:
        split = step_split(r["measured"], r["predicted"], cpu_share)
        if split is not None:
            print(_line(r["strategy"], [f"{s * 1e3:.1f}" for pair in split.values() for s in pair], widths))


def _compare_tp(args: argparse.Namespace, probe: nn.Module, world: int,
                build_dp: Callable[[], nn.Module]) -> dict[str, Any] | None:
    """``--tp N``: the (dp, tp) mesh, the TP plan and a builder applying it; None without TP."""
    if args.tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    from .tp import check_tp_degrees
    from .vocabulary import PlanError

    if args.emulate:
        raise SystemExit("--tp with --emulate: not supported yet (the emulated network has no 2-D mesh)")
    try:
        _, fn = check_tp_degrees((args.tp,), probe, world, world, _import_fn(args.parallelize, "--parallelize"))
    except PlanError as exc:
        raise SystemExit(f"--tp {args.tp}: {exc}") from None
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world // args.tp, args.tp),
                            mesh_dim_names=("dp", "tp"))

    def build() -> nn.Module:
        model = build_dp()
        return fn(model, mesh["tp"]) or model

    return {"mesh": mesh, "fn": fn, "build": build}


def _emulated_network(links: str, latency: str, devices_per_node: int | None) -> Any:
    """The ``--emulate INTRA[,INTER]`` network (its errors name the option)."""
    from ..network import EmulatedNetwork

    parts = [part.strip() for part in links.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise SystemExit(f"--emulate {links!r}: give the intra-node bandwidth, and optionally the inter-node one "
                         "after a comma, e.g. --emulate 1GB/s,100MB/s")
    try:
        return EmulatedNetwork(intra_node=parts[0], inter_node=parts[-1], latency=latency,
                               devices_per_node=devices_per_node)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"--emulate {links!r}: {exc}") from None


def cross_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against class 0 (module level: the planner pickles it)."""
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))
