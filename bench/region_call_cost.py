"""What a block compiled as a region costs per call, and how much of it is torch's own.

    OMP_NUM_THREADS=1 python bench/region_call_cost.py                 # 4 and 64 layers, Inductor
    python bench/region_call_cost.py --layers 4 32 --compiler aot_eager
    python bench/region_call_cost.py --smoke --out /tmp/rc              # tiny, for the test suite

Issue 11 asks for 64 layers in at most 2x the compile time of 4. With every block a
``nested_compile_region``, the body is compiled once, but every call of it still costs the
compile something: Dynamo's reuse check, AOTAutograd's tracing of the call, Inductor's lowering
and post-grad passes of the top-level graph. Two of torch's per-call steps are timed here by
name, because no backend can switch them off:

  gen_schema          ``InvokeSubgraphHOP.gen_schema``: AOTAutograd's autograd dispatch of a
                      region call checks that the call mutates no input by re-tracing the
                      region's body (``materialize_as_graph``), at every call;
  incremental_update  ``FakeTensorUpdater.incremental_update``: Inductor's post-grad passes
                      re-propagate fake tensors through every region call.

Variants (the project's GPT, d_model 64, 4 heads, sequence 64, batch 2, each (variant, depth)
in a fresh process with an empty Inductor cache, rank 0 of a fake world of two so that no
second rank competes for the cores and no collective waits):

  plain_regions   ``torch.compile`` of the unsharded model, ``Block.forward`` a nested
                  compile region (torch's own mechanism, the peer);
  fsdp            ``fsdp_compile`` FULL_SHARD, every block a region (``regions=2``: from two
                  copies on, which is Inductor's default; aot_eager's starts at 8).

The two functions are timed by wrapping them in the benchmark's own worker process (the
wrapper adds the elapsed time and calls torch's function unchanged); nothing in the package
does this. Per variant, the cost per block is the first step's difference between the deepest
and the shallowest depth over their difference in blocks, and the share of it that the two
functions take. Writes ``region_call_cost_<compiler>.json`` and ``.md`` under ``--out``
(``region_call_cost_smoke.*`` with ``--smoke``).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report_files import write_report

VARIANTS = ("plain_regions", "fsdp")
# name -> (module, class, method): the per-call work of torch's that the benchmark times.
TIMED = {
    "gen_schema": ("torch._higher_order_ops.invoke_subgraph", "InvokeSubgraphHOP", "gen_schema"),
    "incremental_update": ("torch._inductor.fx_utils", "FakeTensorUpdater", "incremental_update"),
}


# ----------------------------------------------------------------------------- worker
def _time_calls(module_name: str, class_name: str, method: str, into: dict) -> None:
    """Add the seconds and calls of ``class_name.method`` to ``into`` (this process only)."""
    import importlib

    cls = getattr(importlib.import_module(module_name), class_name)
    original = getattr(cls, method)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into["seconds"] += time.perf_counter() - start
            into["calls"] += 1

    setattr(cls, method, timed)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_compile
    from fsdp_compile.models.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    # Imports and compiler start-up once, outside the measurement.
    probe = torch.compile(lambda t: (t.sin() * 2).sum(), backend=args.compiler)
    probe(torch.randn(8, requires_grad=True)).backward()
    torch._dynamo.reset()

    timed = {name: {"seconds": 0.0, "calls": 0} for name in TIMED}
    for name, (module_name, class_name, method) in TIMED.items():
        _time_calls(module_name, class_name, method, timed[name])
    cfg = GPTConfig(vocab_size=67, block_size=args.seq, n_layer=args.layers[0], n_head=4, d_model=args.d_model)
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.variant == "plain_regions":
        Block.forward = torch.compiler.nested_compile_region(Block.forward)  # this process only
        compiled = torch.compile(model, backend=args.compiler)
    else:
        # Regions from two copies on under either compiler (aot_eager's default starts at 8), so
        # every depth measured has them, as the peer does.
        backend = fsdp_compile.backend("FULL_SHARD", compiler=args.compiler, regions=2)
        backend.shard(model)
        compiled = torch.compile(model, backend=backend)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=torch.Generator().manual_seed(1))
    metrics = torch._dynamo.utils.compilation_time_metrics
    metrics.clear()
    start = time.perf_counter()
    loss = F.cross_entropy(compiled(idx[:, :-1]).reshape(-1, cfg.vocab_size), idx[:, 1:].reshape(-1))
    loss.backward()
    first_step = time.perf_counter() - start
    Path(args.result).write_text(json.dumps({
        "first_step_s": first_step,
        "timed": timed,
        "torch_regions": {k: sum(v) for k, v in metrics.items()},
    }))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent
def run_one(args: argparse.Namespace, variant: str, layers: int, workdir: Path) -> dict:
    result = workdir / f"{variant}_{layers}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor_", dir=workdir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TRITON_CACHE_DIR", None)
    command = [sys.executable, __file__, "--worker", "--variant", variant, "--layers", str(layers),
               "--compiler", args.compiler, "--result", str(result), "--d-model", str(args.d_model),
               "--seq", str(args.seq), "--batch", str(args.batch)]
    proc = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} at {layers} layers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {"variant": variant, "layers": layers, **json.loads(result.read_text())}


def per_block(rows: list[dict], variant: str) -> dict | None:
    """Cost per block between the shallowest and the deepest depth, in total and per timed
    function; None with fewer than two depths."""
    mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["layers"])
    if len(mine) < 2 or mine[-1]["layers"] == mine[0]["layers"]:
        return None
    shallow, deep = mine[0], mine[-1]
    blocks = deep["layers"] - shallow["layers"]
    total = (deep["first_step_s"] - shallow["first_step_s"]) / blocks
    timed = {name: (deep["timed"][name]["seconds"] - shallow["timed"][name]["seconds"]) / blocks for name in TIMED}
    return {"from": shallow["layers"], "to": deep["layers"], "total_s": total, **{f"{k}_s": v for k, v in timed.items()}}


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"# Per-call cost of compile regions ({c['compiler']})", "",
        f"GPT d_model {c['d_model']}, 4 heads, sequence {c['seq']}, batch {c['batch']}; rank 0 of a fake world of "
        f"two in one process, each row a fresh process with empty caches; {report['machine']}, torch "
        f"{report['torch']}. First step = forward + backward, the compile included.", "",
        f"**Caveat:** {report['caveat']}", "",
        "| variant | layers | first step s | gen_schema s (calls) | incremental_update s (calls) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        g, u = r["timed"]["gen_schema"], r["timed"]["incremental_update"]
        lines.append(f"| {r['variant']} | {r['layers']} | {r['first_step_s']:.2f} | {g['seconds']:.2f} ({g['calls']}) "
                     f"| {u['seconds']:.2f} ({u['calls']}) |")
    lines += ["", "Per block (deepest minus shallowest first step over the blocks between them), and the share of it "
              "in torch's two per-call functions:", "",
              "| variant | depths | per block s | gen_schema | incremental_update | per block / plain_regions' |",
              "| --- | --- | --- | --- | --- | --- |"]
    peer = report["per_block"].get("plain_regions")
    for variant, fit in report["per_block"].items():
        if fit is None:
            lines.append(f"| {variant} | - | - | - | - | - |")
            continue
        def share(seconds: float, fit: dict = fit) -> str:
            return f"{seconds:.3f} s ({seconds / fit['total_s']:.0%})" if fit["total_s"] > 0 else f"{seconds:.3f} s"

        ratio = f"{fit['total_s'] / peer['total_s']:.2f}x" if peer and peer["total_s"] > 0 else "-"
        lines.append(f"| {variant} | {fit['from']} -> {fit['to']} | {fit['total_s']:.3f} | {share(fit['gen_schema_s'])} "
                     f"| {share(fit['incremental_update_s'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager, for the tests")
    parser.add_argument("--caveat", default="one run each on a shared 2-core machine: compare within a table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.smoke:
        args.layers, args.compiler, args.d_model, args.seq = [2, 3], "aot_eager", 16, 8
    from fsdp_compile.sharding.compile_regions import regions_supported

    if not regions_supported():
        parser.error("this torch has no region trace reuse (torch >= 2.13): there is no per-call cost to time")
    import torch

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="region_call_cost_") as tmp:
        for layers in args.layers:
            for variant in args.variants:
                rows.append(run_one(args, variant, layers, Path(tmp)))
                print(f"{variant:14s} {layers:3d} layers: first step {rows[-1]['first_step_s']:.2f} s", flush=True)
    report = {
        "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "caveat": args.caveat,
        "config": {"compiler": args.compiler, "d_model": args.d_model, "seq": args.seq, "batch": args.batch,
                   "layers": args.layers},
        "rows": rows,
        "per_block": {v: per_block(rows, v) for v in args.variants},
    }
    text = markdown(report)
    write_report(args.out, "region_call_cost_smoke" if args.smoke else f"region_call_cost_{args.compiler}", report, text)
    print(text)


if __name__ == "__main__":
    main()
