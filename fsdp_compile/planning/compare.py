"""Run strategies for real on the current processes and set the measurements beside the plan.

Every rank builds the same model (same seed), shards it with each strategy in turn, trains a
few steps with AdamW and measures:

* step time: the median over the timed steps of the slowest rank's step (a step waits for
  the slowest rank), after warm-up steps that include compilation;
* compile time: the first step's time minus a steady step's;
* peak memory per rank, by the allocator: the bytes of every storage alive before a profiled
  step (shards, optimizer state, buffers: storages the allocator handed out, counted once
  each) plus the largest running sum of the allocator's events during the step
  (``torch.profiler`` memory events on a CPU; ``torch.cuda.max_memory_allocated`` on a GPU).
  Never the planner's estimate;
* bytes per step: from the profiler's collective events (``gloo:*`` / ``nccl:*``), their
  buffers converted to wire bytes with the same ring formula as the planner. gloo runs a
  reduce-scatter as an all-reduce of the whole buffer (it shows up as ``gloo:all_reduce``), so
  it moves more bytes than a ring reduce-scatter would: the difference is gloo's, and shown.

:func:`compare` returns the measured rows and the plan made for this machine, for the
``compare`` subcommand and ``bench/plan_accuracy.py``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..strategy import ShardingStrategy


@dataclass
class Measured:
    strategy: str
    step_seconds: float
    step_times: list[float]
    compile_seconds: float
    peak_bytes: float
    resident_bytes: float
    tokens_per_second: float
    bytes_per_step: dict[str, float]
    collectives: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def resident_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages reachable from modules, optimizers and tensors."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, DTensor):
            t = t._local_tensor
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for obj in objects:
        if isinstance(obj, nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                add(t)
                if t.grad is not None:
                    add(t.grad)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    add(value)
        else:
            add(obj)
    return total


def _collective_bytes(events: list, world_sizes: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
    """Wire bytes per rank from the profiler's collective events (ring formula, like the plan)."""
    wire: dict[str, float] = {"intra": 0.0, "inter": 0.0}
    counts: dict[str, int] = {}
    n = world_sizes.get("default", 2)
    for event in events:
        name = event.name()
        if not (name.startswith(("gloo:", "nccl:"))):
            continue
        kind = name.split(":", 1)[1]
        counts[kind] = counts.get(kind, 0) + 1
        shapes = event.shapes()
        dtypes = event.dtypes()
        if not shapes or not shapes[0]:
            continue
        numel = 1
        for d in shapes[0]:
            numel *= d
        itemsize = torch.empty((), dtype=_dtype(dtypes[0] if dtypes else "float")).element_size()
        buffer = numel * itemsize
        share = (n - 1) / n
        if "all_gather" in kind:
            wire["intra"] += buffer * (n - 1)  # the input is this rank's chunk
        elif "reduce_scatter" in kind:
            wire["intra"] += buffer * share
        elif "all_reduce" in kind or "allreduce" in kind:
            wire["intra"] += 2 * buffer * share
    return wire, counts


def _dtype(name: str) -> torch.dtype:
    table = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
             "double": torch.float64, "long int": torch.int64, "int": torch.int32}
    return table.get(name, torch.float32)


def _profiled_step(step: Callable[[], None], device: torch.device) -> tuple[float, list]:
    """The largest running sum of allocator events during one step, and the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - before), list(prof.profiler.kineto_results.events())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = peak = 0
    for _, delta in memory:
        running += delta
        peak = max(peak, running)
    return float(peak), events


def measure_strategy(
    strategy: ShardingStrategy | str, build: Callable[[], nn.Module], batches: Sequence[tuple],
    loss_fn: Callable, *, compiler: str = "aot_eager", warmup: int = 2, backend_options: dict | None = None,
    tokens_per_step: int | None = None,
) -> Measured:
    """Train ``len(batches)`` steps of ``strategy``; see the module docstring for what is measured.

    ``build()`` returns the model (same on every rank); each batch is ``(inputs, targets)`` of
    this rank; ``loss_fn(output, targets)``.
    """
    import fsdp_compile

    strategy = ShardingStrategy.parse(strategy)
    options = dict(backend_options or {})
    if strategy.is_hybrid and "shard_size" not in options:
        import os

        options["shard_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    backend = fsdp_compile.backend(strategy, compiler=compiler, **options)
    model = backend.shard(build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=backend)
    device = next(model.parameters()).device

    def step(inputs: Any, targets: Any) -> None:
        loss = loss_fn(compiled(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i, (inputs, targets) in enumerate(batches):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(_slowest(time.perf_counter() - start))
        if i == 0:
            gc.collect()
    steady = times[warmup:] or times[-1:]
    step_seconds = statistics.median(steady)
    gc.collect()
    resident = resident_bytes(model, optimizer)
    inputs, targets = batches[-1]
    during, events = _profiled_step(lambda: step(inputs, targets), device)
    sizes = {"default": dist.get_world_size()}
    wire, counts = _collective_bytes(events, sizes)
    tokens = tokens_per_step or int(next(t for t in inputs if isinstance(t, torch.Tensor)).numel())
    peak = _slowest(resident + during)
    return Measured(strategy.name, step_seconds, times, max(times[0] - step_seconds, 0.0), peak,
                    float(resident), tokens / step_seconds, wire, counts)


def bar_chart(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Measured against predicted step time and peak memory per strategy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    for ax, key, unit, scale in ((axes[0], "step_seconds", "ms", 1e3), (axes[1], "peak_bytes", "MiB", 1 / 2**20)):
        measured = [(r["measured"][key] or 0) * scale for r in rows]
        predicted = [(r["predicted"][key] or 0) * scale for r in rows]
        ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], predicted, 0.4, label="predicted")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylabel(f"{key.replace('_', ' ')} ({unit})")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
