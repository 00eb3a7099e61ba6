"""``fsdp_compile.plan()``: which strategy for this model on this cluster, and why.

For every candidate (strategy x bucket policy x prefetch depth) the planner traces the graphs a real run executes
(:mod:`.trace`), costs every node (:mod:`.cost`), plays forward and backward on a compute and a communication stream
(:mod:`.simulate`), walks their memory in the same order, and adds what lives outside the graphs (optimizer state,
gradients, buffers the graphs do not read).

``row.memory`` is the peak's breakdown per device (``params``, ``grads``, ``optimizer``: AdamW's two fp32 moments plus a
shard-sized temporary during the step, ``gathered``, ``activations``, ``buffers``), the peak being the largest of
forward, backward and the optimizer step; ``row.model_states`` is what a rank holds between steps, what ZeRO's formulas
count.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import ConfigError, MixedPrecision, ShardingStrategy
from ..inspection.memory_estimate import input_bytes
from .budget import ReshardStep, candidate_groups
from .budget import choose as choose_reshard
from .child_process import run_in_subprocess
from .choice import choose, rank, require_fit  # noqa: F401 (require_fit: re-exported for auto and tests)
from .cluster import Cluster
from .cost import Group, graph_costs, group_ranks, outside_graph_seconds
from .simulate import Timeline, memory_timeline, simulate_graph
from .states import held_outside, model_state_bytes  # noqa: F401 (model_state_bytes: re-exported for tests, benches)
from .symbolic import symbolic_analysis
from .tp import TPMeshes, check_tp_degrees, tp_model_states
from .trace import Candidate, Traced, candidate_label, trace_candidates
from .vocabulary import OPTIMIZER_STATES, ClusterError, GiB, PlanError

# Tensor parallelism's collective buffers count as activations in a plan's breakdown: the planner traces data
# parallelism alone, so its graphs hold none of them.
ROLE_NAMES = {"param": "params", "grad": "grads", "gathered": "gathered", "activation": "activations",
              "buffer": "buffers", "tp_comm": "activations"}
MEMORY_KEYS = ("params", "grads", "optimizer", "gathered", "activations", "buffers")


@dataclass
class PlanRow:
    """One candidate's prediction. Times in seconds, memory in bytes per device."""

    strategy: str
    bucket: str
    prefetch: int
    fits: bool
    peak_bytes: float
    memory: dict[str, float]
    step_seconds: float | None
    exposed_comm_seconds: float | None
    bytes_per_step: dict[str, float]
    compute_seconds: float | None = None
    comm_seconds: float | None = None
    tokens_per_second: float | None = None  # per device
    mfu: float | None = None
    traced: bool = True
    note: str = ""
    phase: str = ""  # where the peak is: "forward", "backward" or "optimizer step"
    chosen: bool = False
    # Resident between steps, per device (exact, from the shapes and the shard layout)
    model_states: dict[str, float] = field(default_factory=dict)
    tp: int = 1  # the tensor-parallel degree; FSDP shards over dp = world / tp
    tp_bytes_per_step: float = 0.0  # of bytes_per_step["intra"]: what the TP plan's collectives send
    # Of exposed_comm_seconds: compute's time a CPU backend's threads take (the rest: waits)
    backend_cpu_seconds: float | None = None
    # The budget's mix, as reshard_after_forward= takes it (unit -> False or n; empty: the strategy's)
    reshard: dict[str, bool | int] = field(default_factory=dict)

    def label(self) -> str:
        return candidate_label(self.strategy, self.tp, self.bucket, self.prefetch, self.reshard)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Context:
    model: nn.Module
    example_inputs: tuple
    loss_fn: Callable | None
    mixed_precision: MixedPrecision | None
    optimizer: str
    world: int
    traced: dict[Candidate, Traced] = field(default_factory=dict)


@dataclass
class Plan:
    """The planner's answer: ``rows`` (one per candidate), ``best`` (the chosen row), ``why``."""

    cluster: Cluster
    world_size: int
    rows: list[PlanRow]
    best: PlanRow | None
    why: str
    budget_bytes: float
    tokens_per_step: int
    seconds: float = 0.0
    bucket_policies: dict[str, Any] = field(default_factory=dict, repr=False)  # row.bucket -> policy
    _context: _Context | None = field(default=None, repr=False)
    _solved: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_context": None}  # graphs and fake models stay in the process that traced them

    def __str__(self) -> str:
        from .plan_table import render_plan

        return render_plan(self)

    def row(self, strategy: ShardingStrategy | str, tp: int | None = None) -> PlanRow:
        """The best row of ``strategy`` (fitting ones first, then the fastest), at TP degree ``tp`` (default: any)."""
        name = ShardingStrategy.parse(strategy).name
        rows = [r for r in self.rows if r.strategy == name and (tp is None or r.tp == tp)]
        if not rows:
            at = f" at TP degree {tp}" if tp is not None else ""
            raise PlanError(f"this plan has no row for {name}{at}; rows: {sorted({r.label() for r in self.rows})}")
        return min(rows, key=rank)

    def max_batch(self, strategy: ShardingStrategy | str, *, input_index: int = 0, dim: int = 0) -> int:
        """The largest batch ``strategy`` fits (dim ``dim`` traced symbolically); 0 if none fits."""
        return self._solve(strategy, "batch", input_index, dim)

    def max_seq_len(self, strategy: ShardingStrategy | str, *, input_index: int = 0, dim: int = 1) -> int:
        """The longest sequence ``strategy`` fits (dim ``dim`` traced symbolically); 0 if none fits."""
        return self._solve(strategy, "seq", input_index, dim)

    def memory_expr(self, strategy: ShardingStrategy | str, size: str = "batch", *, input_index: int = 0,
                    dim: int | None = None) -> Any:
        """Peak bytes per device of ``strategy`` as a sympy expression of the batch (or ``"seq"``)."""
        return symbolic_analysis(self, strategy, size, input_index, dim).memory

    def step_time_expr(self, strategy: ShardingStrategy | str, size: str = "batch", *, input_index: int = 0,
                       dim: int | None = None):
        """Predicted step seconds of ``strategy`` as a sympy expression of the batch (or ``"seq"``)."""
        return symbolic_analysis(self, strategy, size, input_index, dim).step_seconds

    def _solve(self, strategy, size: str, input_index: int, dim: int) -> int:
        name = ShardingStrategy.parse(strategy).name
        key = (name, size, input_index, dim)
        if key not in self._solved:
            self._solved[key] = symbolic_analysis(self, strategy, size, input_index, dim).largest_fitting
        return self._solved[key]

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster.describe(), "world_size": self.world_size,
                "budget_bytes": self.budget_bytes, "tokens_per_step": self.tokens_per_step,
                "why": self.why, "seconds": self.seconds, "rows": [r.as_dict() for r in self.rows],
                "best": self.best.as_dict() if self.best else None}


# ---------------------------------------------------------------------- one candidate
def evaluate(traced: Traced, cluster: Cluster, optimizer: str, budget: float, tokens: int,
             compute_dtype: torch.dtype, states: dict[str, float]) -> PlanRow:
    """Cost, simulate and walk the memory of one traced candidate."""
    groups: dict[str, Group] = {}
    timeline = Timeline()
    costed = []
    tp_bytes, ranks = 0.0, {}
    peak, peak_roles, phase = -1.0, {}, ""
    optimizer_bytes = states["optimizer"]
    for record in traced.records:
        for phase_name, gm in (("forward", record.forward), ("backward", record.backward)):
            if gm is None:
                continue
            costs = graph_costs(gm, cluster, groups)
            costed.append(costs)
            timeline = timeline + simulate_graph(costs, cluster.comm_overlap, cluster.host)
            tp_bytes += sum(cost.wire_bytes for node, cost in costs if cost.kind == "collective"
                            and traced.tp_ranks and group_ranks(node.args[-1], ranks) == traced.tp_ranks)
            for live in memory_timeline(gm, held_outside(gm, states), workspace=cluster.collective_workspace):
                total = sum(live.values()) + optimizer_bytes
                if total > peak:
                    peak, phase = total, phase_name
                    peak_roles = {"optimizer": optimizer_bytes}
                    for k, v in live.items():
                        peak_roles[ROLE_NAMES[k]] = peak_roles.get(ROLE_NAMES[k], 0) + v
    # The optimizer step: shards, their gradients, the moments and one shard-sized temporary.
    temporary = states["grads"] if OPTIMIZER_STATES[optimizer] else 0
    at_step = states["params"] + states["grads"] + optimizer_bytes + temporary + states["buffers"]
    if at_step > peak:
        peak, phase = at_step, "optimizer step"
        peak_roles = {**states, "optimizer": optimizer_bytes + temporary}
    n_tensors = len({id(p) for p in traced.model.parameters()})
    numel = states["grads"] / 4
    outside_seconds = outside_graph_seconds(optimizer, int(numel), states["grads"], n_tensors, cluster)
    step = timeline.seconds + outside_seconds
    exposed = timeline.exposed_comm_seconds
    shared = cluster.host.played_step(costed, outside_seconds) if cluster.host is not None else None
    if shared is not None:  # ranks time-slice the cores: what lockstep's waits cost them instead
        exposed, step = exposed + shared - step, shared
    memory = {k: float(peak_roles.get(k, 0)) for k in MEMORY_KEYS}
    c = traced.candidate
    failed = [f"{f['pass']} ({f['phase']})" for record in traced.records for f in record.fallbacks]
    note = (f"pass failed: {', '.join(failed)}; a real run warns and runs that graph's markers eagerly, "
            "as predicted here" if failed else "")
    return PlanRow(
        strategy=c.strategy.name, bucket=c.bucket_label(), prefetch=c.prefetch, fits=peak <= budget,
        peak_bytes=float(peak), memory=memory, step_seconds=float(step),
        exposed_comm_seconds=float(exposed),
        bytes_per_step={k: float(v) for k, v in timeline.wire_bytes.items()},
        compute_seconds=float(timeline.compute_seconds + outside_seconds), comm_seconds=float(timeline.comm_seconds),
        # the ranks of a tp group compute on the same tokens: a device's share is 1 / tp of them
        tokens_per_second=tokens / c.tp / step if step > 0 else None,
        mfu=float(timeline.flops) / (step * cluster.flops_for(compute_dtype)) if step > 0 else None,
        phase=phase, note=note, model_states={k: float(v) for k, v in states.items()}, tp=c.tp,
        tp_bytes_per_step=float(tp_bytes), backend_cpu_seconds=float(timeline.backend_cpu_seconds),
        reshard=dict(c.reshard))


def _untraced_row(candidate: Candidate, states: dict[str, float], budget: float) -> PlanRow:
    at_step = sum(states.values())
    return PlanRow(
        strategy=candidate.strategy.name, bucket=candidate.bucket_label(), prefetch=candidate.prefetch,
        fits=False, peak_bytes=float(at_step),
        memory={k: float(states.get(k, 0.0)) for k in MEMORY_KEYS},
        step_seconds=None, exposed_comm_seconds=None, bytes_per_step={"intra": 0.0, "inter": 0.0},
        traced=False, phase="optimizer step", model_states={k: float(v) for k, v in states.items()}, tp=candidate.tp,
        note=f"not traced: parameters, gradients and optimizer state alone need {at_step / GiB:.1f} GiB "
             f"> {budget / GiB:.1f} GiB (a lower bound: activations come on top)")


# ---------------------------------------------------------------------- the API
def _tokens(example_inputs: Sequence[Any]) -> int:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return int(value.numel()) if not value.is_floating_point() else int(math.prod(value.shape[:2]))
    return 1


def _compute_dtype(model: nn.Module, mixed_precision: MixedPrecision | None) -> torch.dtype:
    if mixed_precision is not None and mixed_precision.param_dtype is not None:
        return mixed_precision.param_dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _candidates(strategies, buckets, prefetches, world: int, devices_per_node: int,
                tp_degrees: Sequence[int] = (1,)) -> tuple[list[Candidate], list[str]]:
    chosen = [ShardingStrategy.parse(s) for s in strategies] if strategies else list(ShardingStrategy)
    skipped, out = [], []
    for tp in tp_degrees:
        at = f" at tp={tp}" if tp > 1 else ""
        for strategy in chosen:
            if strategy.is_hybrid and (world <= devices_per_node or world % devices_per_node):
                if tp == min(tp_degrees):
                    skipped.append(f"{strategy.name}: needs several whole nodes (world {world}, {devices_per_node} "
                                   "per node); on one node it is FULL_SHARD/SHARD_GRAD_OP")
                continue
            if strategy.is_hybrid and devices_per_node // tp == 1:
                skipped.append(f"{strategy.name}{at}: no ranks left in a node to shard over "
                               f"({devices_per_node} per node / tp {tp}); it is NO_SHARD over the nodes")
                continue
            if strategy is not ShardingStrategy.NO_SHARD and world // tp == 1:
                skipped.append(f"{strategy.name}{at}: a data-parallel world of 1 has nothing to shard over")
                continue
            for bucket in buckets:
                for prefetch in prefetches:
                    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
                        raise ValueError(f"prefetch values must be ints >= 0, got {prefetch!r}")
                    out.append(Candidate(strategy, bucket, prefetch, tp))
    return out, skipped


def plan(model: nn.Module, example_inputs: Sequence[Any] | torch.Tensor, *, cluster: Cluster,
         loss_fn: Callable[[Any], torch.Tensor] | None = None, mixed_precision: MixedPrecision | None = None,
         optimizer: str = "adamw", world_size: int | None = None,
         strategies: Sequence[ShardingStrategy | str] | None = None, buckets: Sequence[Any] = ("module",),
         prefetch: Sequence[int] = (1, 2), memory_budget: float | None = None, trace_all: bool = False,
         verbose: bool = False, tp_degrees: Sequence[int] = (1,),
         parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None, float8: bool = False) -> Plan:
    """Predict every strategy's memory and step time for ``model`` on ``cluster``; see docs/planning.md.

    ``model`` may live on any device (meta included); nothing is allocated: parameters become fake tensors and the world
    a fake process group of ``world_size`` (default: the whole cluster). ``example_inputs``: one rank's inputs (real,
    meta or fake); ``loss_fn(output) -> scalar`` (default: the output's sum) is traced with the model.
    ``mixed_precision`` and the policies in ``buckets`` mean what they mean for ``fsdp_compile.backend``; every strategy
    is tried with every bucket policy and ``prefetch`` depth. ``optimizer``: "adamw" (default), "adam", "sgd" or "none".
    ``memory_budget``: bytes per device (default: the cluster's usable memory); strategies whose model states alone
    exceed it are not traced unless ``trace_all``.

    ``tp_degrees``: tensor-parallel degrees to try (default 1, no TP); a degree runs ``parallelize_fn(model, tp_mesh)``
    (the built-in GPT and Llama bring theirs) on a (dp x tp) mesh with FSDP over dp; one that does not divide a node's
    devices, the world or the heads raises :class:`PlanError` (:mod:`.tp`). ``float8=True`` plans torchao's float8
    training (the linears converted, float8 all-gather; :mod:`.float8_plan`).
    """
    import time

    from .world import RealProcessGroupError, fake_world

    started = time.perf_counter()
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster= must be an fsdp_compile.Cluster (e.g. Cluster.preset('h100-sxm')), "
                        f"got {type(cluster).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan() takes an nn.Module, got {type(model).__name__}")
    example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    optimizer = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError("mixed_precision= must be an fsdp_compile.MixedPrecision")
    if float8:
        from .float8_plan import float8_training_model

        model = float8_training_model(model, cluster)
    world = cluster.world_size if world_size is None else world_size
    cluster.check_world(world)
    budget = cluster.usable_memory if memory_budget is None else float(memory_budget)
    if budget <= 0:
        raise ClusterError(f"memory_budget={memory_budget!r} must be > 0 bytes")
    compute_dtype = _compute_dtype(model, mixed_precision)
    cluster.flops_for(compute_dtype)
    tp_degrees, parallelize_fn = check_tp_degrees(tuple(tp_degrees), model, world, cluster.devices_per_node,
                                                  parallelize_fn)
    candidates, skipped = _candidates(strategies, tuple(buckets), tuple(prefetch), world, cluster.devices_per_node,
                                      tp_degrees)
    if not candidates:
        raise PlanError("no strategy applies here: " + "; ".join(skipped))
    context = _Context(model, example_inputs, loss_fn, mixed_precision, optimizer, world)
    try:
        with fake_world(world):
            meshes = TPMeshes(world, cluster.devices_per_node, parallelize_fn)
            states = tp_model_states(model, candidates, meshes, optimizer)
            to_trace = [c for c in candidates if trace_all or sum(states[c.strategy, c.tp].values()) <= budget]
            trace = functools.partial(trace_candidates, model, example_inputs, loss_fn, world=world,
                                      devices_per_node=cluster.devices_per_node, mixed_precision=mixed_precision,
                                      device_type=cluster.device_type, progress=print if verbose else None,
                                      tp_meshes=meshes)
            context.traced = trace(to_trace)
            tokens = _tokens(example_inputs)
            rows = []
            for candidate in candidates:
                if candidate in context.traced:
                    rows.append(evaluate(context.traced[candidate], cluster, optimizer, budget, tokens,
                                         compute_dtype, states[candidate.strategy, candidate.tp]))
                elif not any(r.strategy == candidate.strategy.name and r.tp == candidate.tp for r in rows):
                    # one row per strategy ruled out: its bucket and prefetch variants cannot fit either
                    rows.append(_untraced_row(candidate, states[candidate.strategy, candidate.tp], budget))
            mixes = budget_mixes(context.traced, rows, cluster, budget, states, world, cluster.devices_per_node)
            if mixes:
                mixed = trace(mixes)
                context.traced.update(mixed)
                rows += [evaluate(mixed[c], cluster, optimizer, budget, tokens, compute_dtype, states[c.strategy, c.tp])
                         for c in mixes]
    except RealProcessGroupError:
        return run_in_subprocess(plan, model, example_inputs, cluster=cluster, loss_fn=loss_fn,
                                  mixed_precision=mixed_precision, optimizer=optimizer, world_size=world,
                                  strategies=strategies, buckets=buckets, prefetch=prefetch,
                                  memory_budget=memory_budget, trace_all=trace_all, verbose=verbose,
                                  tp_degrees=tp_degrees, parallelize_fn=parallelize_fn)
    best, why = choose(rows, budget, skipped)
    policies = {c.bucket_label(): c.bucket for c in candidates}
    return Plan(cluster, world, rows, best, why, budget, tokens, time.perf_counter() - started, policies, context)


def budget_mixes(traced: dict[Candidate, Traced], rows: Sequence[PlanRow], cluster: Cluster, budget: float,
                 states: dict[tuple[ShardingStrategy, int], dict[str, float]], world: int,
                 devices_per_node: int) -> list[Candidate]:
    """For the fastest fitting FULL_SHARD (HYBRID_SHARD) row, the mix ``memory_budget=`` (:mod:`.budget`) would choose
    within the plan's budget, where it keeps some units but not all (those rows the plan has: the strategy itself,
    SHARD_GRAD_OP, HYBRID_SHARD_ZERO2)."""
    fastest: dict[ShardingStrategy, Candidate] = {}
    for row in sorted(rows, key=rank):
        candidate = next((c for c in traced if c.label() == row.label()), None)
        if candidate is None or not row.fits or candidate.tp != 1 or candidate.reshard:
            continue
        if candidate.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
            fastest.setdefault(candidate.strategy, candidate)
    mixes = []
    for candidate in fastest.values():
        entry = traced[candidate]
        if len(entry.records) != 1 or entry.records[0].backward is None:
            continue  # a step split by graph breaks: the backend chooses per graph, the plan does not
        shard_size = devices_per_node if candidate.strategy.is_hybrid else world
        step_states = states[candidate.strategy, candidate.tp]
        step = ReshardStep(entry.records[0], cluster, step_states)
        # the buffers the graph does not read are outside the step's accounting: off the budget
        unread = max(0.0, step_states.get("buffers", 0.0) - input_bytes(entry.records[0].forward, "buffer"))
        try:
            choice = choose_reshard(step, budget - unread, shard_size, candidate_groups(shard_size))
        except ConfigError:  # the strategy itself does not fit: no mix does
            continue
        kept_whole = [unit for unit, ranks in choice.reshard_to.items() if ranks == 1]
        if choice.units and len(kept_whole) < len(step.units):  # all kept: SHARD_GRAD_OP's own row
            option = {unit or "<root>": False if ranks == 1 else ranks for unit, ranks in choice.reshard_to.items()}
            mixes.append(dataclasses.replace(candidate, reshard=tuple(sorted(option.items()))))
    return mixes
