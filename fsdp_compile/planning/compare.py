"""Run strategies for real on the current processes and set the measurements beside the plan.

Every rank builds the same model (same seed), shards it with each strategy in turn, trains a
few steps with AdamW and measures:

* step time: the median over the timed steps of the slowest rank's step, after warm-up steps that include compilation.
  Python's cyclic collector runs between steps, not inside them (``gc_between_steps``, as torchtitan's ``gc_freq``): a
  collection's pause is set by all the process holds, not by the strategy;
* compile time: the first step's time minus a steady step's;
* peak memory per rank, by the allocator (never the planner's estimate): the storages alive before a profiled step plus
  the largest running sum of its allocator events;
* on Linux, what the machine gave to other work: the main thread's CPU per step, the threads' run-queue wait over the
  step (``cpu_wait_fraction``, the largest rank's), the main thread's own wait for a core (``core_wait_seconds``: with
  its CPU, the step splits three ways as the plan's does: compute, ``backend_cpu_seconds``, waits), the other threads'
  CPU, the load;
* bytes per step: from the profiler's collective events, converted with the planner's ring formula; gloo runs a
  reduce-scatter as an all-reduce of the whole buffer, shown apart;
* with ``reference`` and ``outside_graphs`` (a host model's :class:`~.host_model.BesideSteps`): a reference step timed
  on the compute clock after every timed step, all ranks at once (its median the slowest rank's, ``reference_seconds``),
  and other workloads sampled there, so the plan can be made at the machine's speed while this strategy's steps ran;
* with ``unlimited_too`` (``compare --exposed``) on an emulated network: each timed step run again on unlimited links,
  alternating which goes first; the median of each step minus its pair (``exposed_seconds``) is the communication the
  network exposes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..api import ShardingStrategy
from ..compilation import collector_paused
from ..network.links import unlimited_links
from ..runtime.ring import wire_bytes
from .calibration.allocator import _allocated_peak
from .calibration.compute import _compute_clock
from .calibration.compute import _slowest as _slowest_in
from .measured import Measured
from .trace import make_backend


def _slowest(value: float) -> float:
    return _slowest_in(value, None)


class ThreadTimes(NamedTuple):
    """Seconds so far, from the kernel's scheduler statistics (Linux ``/proc``)."""

    main_on_cpu: float  # the main thread ran on a CPU
    main_waiting: float  # the main thread was runnable but waiting for a core
    all_waiting: float  # the same, summed over this process's threads
    others_on_cpu: float = 0.0  # every other live thread of this process ran on a CPU (the backend's)


def thread_times() -> ThreadTimes | None:
    """This process's :class:`ThreadTimes`; None where ``/proc`` has no schedstat (not Linux). Over a step, the main
    thread's wall time is its CPU, its wait for a core, and the rest, blocked (waiting for a collective)."""
    import threading

    main = threading.get_native_id()
    on_cpu = main_waiting = waiting = others = 0.0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    ran, waited, _ = f.read().split()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            waiting += int(waited) / 1e9
            if int(tid) == main:
                on_cpu, main_waiting = int(ran) / 1e9, int(waited) / 1e9
            else:
                others += int(ran) / 1e9
    except (OSError, ValueError):
        return None
    return ThreadTimes(on_cpu, main_waiting, waiting, others)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


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


def _collective_bytes(events: list, all_reduce_size: int) -> tuple[dict[str, float], float, dict[str, int]]:
    """Wire bytes per rank with the planner's ring formula: of the functional collectives the graphs issued (an
    all-reduce's group size is ``all_reduce_size``), and of what the backend ran (gloo turns a reduce-scatter into an
    all-reduce)."""
    issued: dict[str, float] = {"intra": 0.0, "inter": 0.0}
    backend_bytes = 0.0
    counts: dict[str, int] = {}

    def nbytes(event) -> float:
        shapes, dtypes = event.shapes(), event.dtypes()
        dtype = _DTYPES.get(dtypes[0] if dtypes else "float", torch.float32)
        return math.prod(shapes[0] if shapes else []) * torch.empty((), dtype=dtype).element_size()

    for event in events:
        name = event.name()
        if name.startswith("_c10d_functional::"):
            kind = name.split("::", 1)[1]
            if kind == "all_gather_into_tensor":
                n = int(event.concrete_inputs()[1])
                issued["intra"] += wire_bytes("all_gather", nbytes(event) * n, n)
            elif kind == "reduce_scatter_tensor":
                issued["intra"] += wire_bytes("reduce_scatter", nbytes(event), int(event.concrete_inputs()[2]))
            elif kind == "all_reduce":
                issued["intra"] += wire_bytes("all_reduce", nbytes(event), all_reduce_size)
        elif name.startswith(("gloo:", "nccl:")):
            kind = name.split(":", 1)[1]
            counts[kind] = counts.get(kind, 0) + 1
            n = all_reduce_size
            if "all_gather" in kind:
                backend_bytes += nbytes(event) * (n - 1)
            elif "reduce_scatter" in kind:
                backend_bytes += wire_bytes("reduce_scatter", nbytes(event), n)
            elif "all_reduce" in kind or "allreduce" in kind:
                backend_bytes += wire_bytes("all_reduce", nbytes(event), n)
    return issued, backend_bytes, counts


_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
           "double": torch.float64, "long int": torch.int64, "int": torch.int32}


@contextlib.contextmanager
def _collector_between_steps(enabled: bool) -> Iterator[None]:
    """Collect the young generations before a step and keep the automatic collector off during it (see the module
    docstring); the caller's collector state is restored."""
    if not enabled:
        yield
        return
    gc.collect(1)
    with collector_paused():
        yield


def measure_strategy(
    strategy: ShardingStrategy | str, build: Callable[[], nn.Module], batches: Sequence[tuple],
    loss_fn: Callable, *, compiler: str = "aot_eager", warmup: int = 2, backend_options: dict | None = None,
    tokens_per_step: int | None = None, gc_between_steps: bool = True, network: Any = None,
    unlimited_too: bool = False, reference: Callable[[], None] | None = None, outside_graphs: Any = None,
) -> Measured:
    """Train ``len(batches)`` steps of ``strategy`` (module docstring: what is measured).

    ``build()`` returns the model (same on every rank); each batch is this rank's ``(inputs, targets)``;
    ``loss_fn(output, targets)``. ``network``: the :class:`~fsdp_compile.EmulatedNetwork` the group runs on, its
    statistics read over the timed steps alone. ``unlimited_too`` (needs ``network``): each timed step runs on the
    network's links and on unlimited ones, in alternating order. ``reference``: a step timed after each timed step;
    ``outside_graphs``: a :class:`~.host_model.BesideSteps` sampled there, whose fits become
    ``Measured.outside_graphs``."""
    if unlimited_too and network is None:
        raise ValueError("measure_strategy(unlimited_too=True) compares a network's links with unlimited ones: "
                         "pass the EmulatedNetwork the process group runs on as network=")
    strategy = ShardingStrategy.parse(strategy)
    options = dict(backend_options or {})
    if strategy.is_hybrid and "shard_size" not in options:
        options["shard_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    backend = make_backend(strategy, compiler=compiler, **options)
    model = backend.shard(build())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model, backend=backend)
    device = next(model.parameters()).device

    def step(inputs: Any, targets: Any) -> None:
        loss = loss_fn(compiled(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(inputs: Any, targets: Any) -> tuple[float, float | None, float | None, float | None, float | None]:
        """(wall, main-thread CPU, run-queue wait over wall, the main thread's wait for a core, the other threads' CPU)
        of one step, each the slowest rank's."""
        with _collector_between_steps(gc_between_steps):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            before = thread_times()
            start = time.perf_counter()
            step(inputs, targets)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            after = thread_times()
        if before is None or after is None:
            return _slowest(wall), None, None, None, None
        return (_slowest(wall), _slowest(after.main_on_cpu - before.main_on_cpu),
                _slowest((after.all_waiting - before.all_waiting) / wall),
                _slowest(after.main_waiting - before.main_waiting),
                _slowest(after.others_on_cpu - before.others_on_cpu))

    times, threads, unlimited, reference_times = [], [], [], []
    network_stats = None
    if outside_graphs is not None:
        outside_graphs.reset()
    for i, (inputs, targets) in enumerate(batches):
        if network is not None and i == warmup:
            dist.barrier()
            network.reset_stats()
        if unlimited_too and i >= warmup:
            *measured, network_stats = _paired_steps(
                network, functools.partial(timed, inputs, targets), network_stats, unlimited, first=i % 2 == 0)
        else:
            measured = timed(inputs, targets)
        times.append(measured[0])
        if measured[1] is not None:
            threads.append(measured[1:])
        if reference is not None and i >= warmup:
            reference_times.append(_timed_reference(reference, device, gc_between_steps))
        if outside_graphs is not None and i >= warmup:
            with _all_ranks_at_once(gc_between_steps):
                outside_graphs.sample()
        if i == 0:
            gc.collect()
    if network is not None:
        stats = network.stats() if network_stats is None else network_stats
        network_stats = {**stats.to_dict(), "summary": stats.overrun_summary()}
    def after_warmup(values: list[float]) -> list[float]:  # the last value where all were warm-up
        return values[warmup:] or values[-1:]

    def median_after_warmup(values: list[float]) -> float | None:
        return statistics.median(after_warmup(values)) if values else None

    step_seconds = statistics.median(after_warmup(times))
    cpu, waits, core_waits, others_cpu = (list(values) for values in zip(*threads)) if threads else ([],) * 4
    cpu_seconds, wait_fraction, core_wait_seconds, others_cpu_seconds = map(
        median_after_warmup, (cpu, waits, core_waits, others_cpu))
    # per rank, then the slowest rank's: the calibration's own order (``timed_reference``)
    reference_seconds = _slowest(statistics.median(reference_times)) if reference_times else None
    fits = outside_graphs.fits() if outside_graphs is not None else None
    gc.collect()
    resident = resident_bytes(model, optimizer)
    inputs, targets = batches[-1]
    events: list = []
    during, _ = _allocated_peak(lambda: step(inputs, targets), device, events)
    shard = options.get("shard_size", dist.get_world_size()) if strategy.is_hybrid else 1
    # The group an all-reduce runs on: the dp mesh's size under TP (at dp 2 x tp 2 the tp groups' all-reduces have the
    # same size; other shapes would need each event's group).
    groups = options["mesh"].size() if "mesh" in options else dist.get_world_size() // shard
    wire, backend_wire, counts = _collective_bytes(events, groups)
    tokens = tokens_per_step or int(next(t for t in inputs if isinstance(t, torch.Tensor)).numel())
    peak = _slowest(resident + during)
    return Measured(strategy.name, step_seconds, times, max(times[0] - step_seconds, 0.0), peak,
                    float(resident), tokens / step_seconds, wire, backend_wire, counts,
                    cpu_seconds, wait_fraction, core_wait_seconds, _load_average(), after_warmup(waits),
                    network_stats, warmup, unlimited, reference_seconds, fits, others_cpu_seconds)


def beside_steps(cluster: Any, measured: dict[str, Any]) -> Any:
    """``cluster`` with the numbers measured beside one strategy's steps in place of the calibration's:
    ``compute_scale`` (its host model's; none added where it is 1) and the optimizer and runtime fits (an optimizer not
    timed there keeps its fit)."""
    changes = {"runtime_per_tensor": measured["runtime_per_tensor"]} if "runtime_per_tensor" in measured else {}
    if "optimizer_step" in measured:
        changes["optimizer_step"] = {**cluster.optimizer_step,
                                     **{name: tuple(line) for name, line in measured["optimizer_step"].items()}}
    cluster = cluster.replace(**changes)
    if "compute_scale" in measured and (cluster.host is not None or measured["compute_scale"] != 1.0):
        cluster = cluster.with_host(compute_scale=measured["compute_scale"])
    return cluster


def clusters_beside_steps(cluster: Any, unlimited_cluster: Any, beside: dict[str, dict[str, Any]]) -> dict[str, tuple]:
    """``plan_each``'s ``on`` for every strategy of ``beside`` (name -> its numbers): ``cluster`` with them under the
    name, and ``unlimited_cluster`` (None: none) under "<name> unlimited"."""
    on: dict[str, tuple] = {}
    for name, numbers in beside.items():
        on[name] = (beside_steps(cluster, numbers), [name])
        if unlimited_cluster is not None:
            on[f"{name} unlimited"] = (beside_steps(unlimited_cluster, numbers), [name])
    return on


@contextlib.contextmanager
def _all_ranks_at_once(gc_between_steps: bool) -> Iterator[None]:
    """Every rank starts together, as they compute in training, and the collector stays out."""
    with _collector_between_steps(gc_between_steps):
        dist.barrier()
        yield


def _timed_reference(reference: Callable[[], None], device: torch.device, gc_between_steps: bool) -> float:
    """One timing of ``reference`` on the compute clock, on every rank at once."""
    clock = _compute_clock(device)
    with _all_ranks_at_once(gc_between_steps):
        start = clock()
        reference()
        return clock() - start


def _paired_steps(network: Any, timed: Callable[[], tuple], stats: Any, unlimited: list[float],
                  *, first: bool) -> tuple[float, float | None, float | None, float | None, float | None, Any]:
    """One step on the network's links and one on unlimited links, the former first when ``first`` (alternating puts a
    cold cache on neither side): the former's ``timed()`` and ``stats`` plus its window; the unlimited step's wall time
    goes to ``unlimited``."""
    def on_unlimited_links() -> None:
        with unlimited_links(network):
            unlimited.append(timed()[0])

    if not first:
        on_unlimited_links()
    dist.barrier()  # nothing of an unlimited step is in flight: the window is this step's
    network.reset_stats()
    result = timed()
    window = network.stats()
    if first:
        on_unlimited_links()
    return (*result, window if stats is None else stats + window)


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
