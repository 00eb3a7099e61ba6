"""Run strategies for real on the current processes and set the measurements beside the plan.

Every rank builds the same model (same seed), shards it with each strategy in turn, trains a
few steps with AdamW and measures:

* step time: the median over the timed steps of the slowest rank's step (a step waits for
  the slowest rank), after warm-up steps that include compilation. Python's cyclic garbage
  collector runs between steps, not inside them (``gc_between_steps``, the default; what
  torchtitan's trainer does with ``gc_freq``): a collection pauses whichever step allocates
  past its threshold, for a time set by everything the process holds (the compiled graphs'
  objects included), not by the strategy, so collecting inside the steps adds noise that no
  strategy causes;
* compile time: the first step's time minus a steady step's;
* peak memory per rank, by the allocator: the bytes of every storage alive before a profiled
  step (shards, optimizer state, buffers: storages the allocator handed out, counted once
  each) plus the largest running sum of the allocator's events during the step
  (``torch.profiler`` memory events on a CPU; ``torch.cuda.max_memory_allocated`` on a GPU).
  Never the planner's estimate;
* how much of each step the machine gave to other work (Linux, from ``/proc``): the main
  thread's CPU time per step and how long this process's threads spent runnable but waiting
  for a core (``cpu_wait_fraction``: their run-queue wait summed over threads, over the step's
  wall time -- above 1 when several threads wait at once -- the largest over ranks), and the
  load average. On a dedicated machine the wait is near
  0; on a shared one it is how far the measured wall time is from the machine's speed without other jobs.
  The main thread's own wait
  for a core (``core_wait_seconds``) splits its step three ways: CPU, waiting for a core, and
  the rest, blocked in waits for collectives; the plan splits its step the same way (compute,
  ``backend_cpu_seconds``, and waits);
* bytes per step: from the profiler's collective events (``gloo:*`` / ``nccl:*``), their
  buffers converted to wire bytes with the same ring formula as the planner. gloo runs a
  reduce-scatter as an all-reduce of the whole buffer (it shows up as ``gloo:all_reduce``), so
  it moves more bytes than a ring reduce-scatter would: the difference is gloo's, and shown.

* with ``reference`` (a host model's, :class:`~.host_model.BesideSteps`): a reference step timed
  on the compute clock after every timed step, all ranks at once, its median the slowest rank's
  (``reference_seconds``), so the plan can be made at the speed the machine had while this
  strategy's steps ran rather than at the calibration's; with ``outside_graphs`` (the same
  host's), other workloads sampled there, whose fits replace the calibration's;

* with ``unlimited_too`` (``compare --exposed``) on an emulated network: each timed step run
  again on unlimited links, alternating which goes first; the median of each step minus its
  pair (``exposed_seconds``) is the communication the network exposes, the machine's drift
  common to both steps of a pair.

:func:`compare` returns the measured rows and the plan made for the machine it runs on, for the
``compare`` subcommand and ``bench/plan_accuracy.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
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
from .calibration.compute import _compute_clock
from .measured import Measured
from .trace import make_backend


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class ThreadTimes(NamedTuple):
    """Seconds so far, from the kernel's scheduler statistics (Linux ``/proc``)."""

    main_on_cpu: float  # the main thread ran on a CPU
    main_waiting: float  # the main thread was runnable but waiting for a core
    all_waiting: float  # the same, summed over this process's threads
    others_on_cpu: float = 0.0  # every other live thread of this process ran on a CPU (the backend's)


def thread_times() -> ThreadTimes | None:
    """This process's :class:`ThreadTimes`; None where ``/proc`` has no schedstat (not Linux).

    Over a step, the main thread's wall time is its CPU time, plus its wait for a core (held
    by other threads: the communication backend's, the other ranks', other jobs'), plus the
    rest, where it was blocked (waiting for a collective)."""
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


def _largest(value: float) -> float:
    return _slowest(value)


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
    """Wire bytes per rank from the profiler's events, with the planner's ring formula.

    From the functional collectives the compiled graphs issued (their group size is an
    argument; an all-reduce's is ``all_reduce_size``), and separately from what the backend
    (gloo / NCCL) ran, which for gloo turns a reduce-scatter into an all-reduce.
    """
    issued: dict[str, float] = {"intra": 0.0, "inter": 0.0}
    backend_bytes = 0.0
    counts: dict[str, int] = {}

    def nbytes(event) -> float:
        shapes, dtypes = event.shapes(), event.dtypes()
        numel = 1
        for d in (shapes[0] if shapes else []):
            numel *= d
        return numel * torch.empty((), dtype=_dtype(dtypes[0] if dtypes else "float")).element_size()

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


def _dtype(name: str) -> torch.dtype:
    table = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
             "double": torch.float64, "long int": torch.int64, "int": torch.int32}
    return table.get(name, torch.float32)


def _profiled_step(step: Callable[[], None], device: torch.device) -> tuple[float, list]:
    """The largest running sum of allocator events during one step, and the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    from .calibration.allocator import allocation_records, allocator_peak, quiet_profiler

    quiet_profiler()
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
    return float(allocator_peak(allocation_records(prof))), list(prof.profiler.kineto_results.events())


@contextlib.contextmanager
def _collector_between_steps(enabled: bool) -> Iterator[None]:
    """Collect the young generations before a step and keep the automatic collector off
    during it (see the module docstring); the caller's collector state is restored."""
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
    """Train ``len(batches)`` steps of ``strategy``; see the module docstring for what is measured.

    ``build()`` returns the model (same on every rank); each batch is ``(inputs, targets)`` of
    this rank; ``loss_fn(output, targets)``. ``network``: the :class:`~fsdp_compile.EmulatedNetwork`
    the process group runs on, if any; its statistics are read over the timed steps alone.
    ``unlimited_too`` (needs ``network``): each timed step runs twice, on the network's links and
    on unlimited ones (gloo's own speed), in alternating order, so that the median of the
    pairs' differences is the step's exposed communication with the machine's drift common to both.
    The statistics then cover the steps on the network's links alone. ``reference``: a function
    running a reference step (the model's own on one rank), timed after each timed step (module docstring).
    ``outside_graphs``: a :class:`~.host_model.BesideSteps` sampled after each timed step; its
    fits become ``Measured.outside_graphs``.
    """
    if unlimited_too and network is None:
        raise ValueError("measure_strategy(unlimited_too=True) compares a network's links with unlimited ones: "
                         "pass the EmulatedNetwork the process group runs on as network=")
    strategy = ShardingStrategy.parse(strategy)
    options = dict(backend_options or {})
    if strategy.is_hybrid and "shard_size" not in options:
        import os

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
        """(wall, main-thread CPU, run-queue wait over wall, the main thread's wait for a core,
        the other threads' CPU) of one step, each the slowest rank's."""
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
                _largest((after.all_waiting - before.all_waiting) / wall),
                _largest(after.main_waiting - before.main_waiting),
                _largest(after.others_on_cpu - before.others_on_cpu))

    times, cpu, waits, core_waits, others_cpu, unlimited, reference_times = [], [], [], [], [], [], []
    network_stats = None
    if outside_graphs is not None:
        outside_graphs.reset()
    for i, (inputs, targets) in enumerate(batches):
        if network is not None and i == warmup:
            dist.barrier()
            network.reset_stats()
        if unlimited_too and i >= warmup:
            wall, step_cpu, wait, core_wait, other_cpu, network_stats = _paired_steps(
                network, functools.partial(timed, inputs, targets), network_stats, unlimited, first=i % 2 == 0)
        else:
            wall, step_cpu, wait, core_wait, other_cpu = timed(inputs, targets)
        times.append(wall)
        if step_cpu is not None:
            cpu.append(step_cpu)
            waits.append(wait)
            core_waits.append(core_wait)
            others_cpu.append(other_cpu)
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

    steady = after_warmup(times)
    step_seconds = statistics.median(steady)
    cpu_seconds = median_after_warmup(cpu)
    core_wait_seconds = median_after_warmup(core_waits)
    others_cpu_seconds = median_after_warmup(others_cpu)
    wait_fraction = median_after_warmup(waits)
    # per rank, then the slowest rank's: the calibration's own order (``timed_reference``)
    reference_seconds = _slowest(statistics.median(reference_times)) if reference_times else None
    fits = outside_graphs.fits() if outside_graphs is not None else None
    gc.collect()
    resident = resident_bytes(model, optimizer)
    inputs, targets = batches[-1]
    during, events = _profiled_step(lambda: step(inputs, targets), device)
    shard = options.get("shard_size", dist.get_world_size()) if strategy.is_hybrid else 1
    # The group an all-reduce runs on: the dp mesh's size under TP (at dp 2 x tp 2 the tp groups'
    # all-reduces have the same size; other shapes would need each event's group).
    groups = options["mesh"].size() if "mesh" in options else dist.get_world_size() // shard
    wire, backend_wire, counts = _collective_bytes(events, groups)
    tokens = tokens_per_step or int(next(t for t in inputs if isinstance(t, torch.Tensor)).numel())
    peak = _slowest(resident + during)
    return Measured(strategy.name, step_seconds, times, max(times[0] - step_seconds, 0.0), peak,
                    float(resident), tokens / step_seconds, wire, backend_wire, counts,
                    cpu_seconds, wait_fraction, core_wait_seconds, _load_average(), after_warmup(waits),
                    network_stats, warmup, unlimited, reference_seconds, fits, others_cpu_seconds)


def beside_steps(cluster: Any, measured: dict[str, Any]) -> Any:
    """``cluster`` with the numbers ``compare`` measured beside one strategy's steps in place of
    the calibration's: ``compute_scale`` (its host model's; a cluster without one keeps none where
    the scale is 1), and the optimizer and runtime fits
    (:class:`~.host_model.BesideSteps`); an optimizer not timed there keeps its fit."""
    changes: dict[str, Any] = {}
    if "optimizer_step" in measured:
        changes["optimizer_step"] = {**cluster.optimizer_step,
                                     **{name: tuple(line) for name, line in measured["optimizer_step"].items()}}
    if "runtime_per_tensor" in measured:
        changes["runtime_per_tensor"] = measured["runtime_per_tensor"]
    cluster = cluster.replace(**changes)
    if "compute_scale" in measured and (cluster.host is not None or measured["compute_scale"] != 1.0):
        cluster = cluster.with_host(compute_scale=measured["compute_scale"])
    return cluster


def clusters_beside_steps(cluster: Any, unlimited_cluster: Any, beside: dict[str, dict[str, Any]]) -> dict[str, tuple]:
    """``plan_each``'s ``on`` for every strategy of ``beside`` (name -> the numbers measured beside
    its steps): ``cluster`` with them under the strategy's name, and ``unlimited_cluster`` (its
    links at gloo's own speed: ``backend_links``; None: none) with them under "<name> unlimited"."""
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
    """One step on the network's links and one on unlimited links, the former first when
    ``first`` (alternating the order puts a cold cache on neither side). Returns the former's
    ``timed()`` and ``stats`` plus its window of the network's statistics; appends the
    unlimited step's wall time to ``unlimited``."""
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
