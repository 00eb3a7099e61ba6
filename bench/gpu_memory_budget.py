"""memory_budget= on one GPU: the allocator's peak against each budget.

    python bench/gpu_memory_budget.py --fake-world 8     # rank 0 of 8, on this machine's GPU
    python bench/gpu_memory_budget.py --smoke            # tiny sizes on whatever device: checks that it runs

One GPU has no second rank, so FULL_SHARD runs as rank 0 of a fake world of ``--fake-world``
ranks (torch's fake process group: every rank's shards and buffers are allocated, no collective
moves data, so losses mean nothing and step times leave out communication). The cluster model
is the GPU's preset (:meth:`fsdp_compile.Cluster.for_device`, one node of that many GPUs). A
budget large enough to keep every unit gives the two ends of the span (the choice's predicted
peak of FULL_SHARD and of keeping everything); ``--budgets`` budgets spaced evenly between them
then train ``--steps`` steps each after ``--warmup``, and the row is the allocator's peak
(``torch.cuda.max_memory_allocated`` over the timed steps, less what was allocated before the
variant was built: the fake world's unsharded base model) against the budget, beside FULL_SHARD
and SHARD_GRAD_OP. Target: every budget's measured peak within it. On a CPU (``--smoke``) no
peak is read. Writes ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from report_files import run_facts, write_report

import fsdp_compile
from fsdp_compile.models.gpt import GPT, GPTConfig


def train(base: torch.nn.Module, cfg: GPTConfig, args: argparse.Namespace, device: torch.device, strategy: str,
          **options) -> dict:
    torch._dynamo.reset()
    gc.collect()  # the previous variant's model and optimizer, released by its return
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device) if cuda else 0
    model = copy.deepcopy(base)
    backend = fsdp_compile.backend(strategy, compiler=args.compiler, **options)
    backend.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=gen).to(device)
        logits = forward(idx[:, :-1])
        F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / args.steps
    choice = backend._state.reshard_choice
    row = {"strategy": strategy, "budget": options.get("memory_budget"),
           "peak_bytes": torch.cuda.max_memory_allocated(device) - before if cuda else None,
           "step_ms": seconds * 1e3, "choice": None if choice is None else choice.summary()}
    return row


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"# memory_budget= on one GPU ({report['device']})", "",
             f"{report['machine']}, torch {report['torch']}, commit {report['commit']}, {report['when']}; rank 0 of a "
             f"fake world of {c['fake_world']} (no collective moves data); GPT {c['layers']} blocks, d_model "
             f"{c['d_model']}, seq {c['seq']}, batch {c['batch']}; {c['compiler']}; cluster {report['cluster']}.", "",
             "| variant | budget MiB | predicted peak MiB | measured peak MiB | within | units kept |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        budget = r["budget"]
        predicted = r["choice"]["peak"] if r["choice"] else None
        peak = r["peak_bytes"]
        within = "" if budget is None or peak is None else "yes" if peak <= budget else "no"
        kept = "" if not r["choice"] else str(len(r["choice"]["units"]))
        lines.append(f"| {r['name']} | {'' if budget is None else f'{budget / 2**20:.1f}'} | "
                     f"{'' if predicted is None else f'{predicted / 2**20:.1f}'} | "
                     f"{'' if peak is None else f'{peak / 2**20:.1f}'} | {within} | {kept} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake-world", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--budgets", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab = 2, 32, 2, 16, 2, 67
        args.warmup, args.steps, args.budgets, args.fake_world, args.compiler = 1, 1, 3, 2, "aot_eager"
    cuda = torch.cuda.is_available()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        cluster = fsdp_compile.Cluster.for_device(nodes=1, devices_per_node=args.fake_world)
    else:
        cluster = fsdp_compile.Cluster.preset("h100-sxm", nodes=1, devices_per_node=args.fake_world)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)  # a fake group names no device: the model's own says where to shard
    rows = [{"name": s, **train(base, cfg, args, device, s)} for s in ("FULL_SHARD", "SHARD_GRAD_OP")]
    generous = train(base, cfg, args, device, "FULL_SHARD", memory_budget=1 << 50, cluster=cluster)["choice"]
    low, high = generous["strategy_peak"], generous["peak"]
    for k in range(args.budgets):
        budget = int(low + (high - low) * k / max(args.budgets - 1, 1))
        rows.append({"name": f"budget{k + 1}",
                     **train(base, cfg, args, device, "FULL_SHARD", memory_budget=budget, cluster=cluster)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "choice"}), flush=True)
    report = {**run_facts(), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "cluster": cluster.name, "rows": rows,
              "config": {"layers": args.layers, "d_model": args.d_model, "seq": args.seq, "batch": args.batch,
                         "vocab": args.vocab, "fake_world": args.fake_world, "compiler": args.compiler}}
    table = markdown(report)
    print(table)
    write_report(args.out, args.name or ("gpu_memory_budget_smoke" if args.smoke else "gpu_memory_budget_cuda"),
                 report, table)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
