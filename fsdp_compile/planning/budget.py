"""``memory_budget=``: what each unit keeps from forward to backward, chosen at compile time.

Between FULL_SHARD (every unit gathered twice a step) and SHARD_GRAD_OP (once, held from forward to backward), a unit
can keep its gathered parameters (``reshard_after_forward=False`` for it) or a shard over ``n`` ranks that backward
gathers inside that group only (``=n``). At the first compile of a graph that gathers, :class:`MemoryBudget`:

1. traces the strategy's step without code generation (``Compiler.trace_step``);
2. prices each setting's memory: a kept unit holds its bytes (``1/n`` of them for a shard over ``n``) from its last
   forward use on, and the backward graph takes them as inputs held throughout; added to the graphs' memory timelines
   (:func:`.simulate.memory_timeline`, with this rank's shards, gradients and AdamW's moments, and the optimizer step's
   own peak), this gives any mix's peak without tracing it again;
3. prices what each setting saves: the simulator plays the backward graph on ``cluster=`` with that unit's gather
   removed or moved to ``n`` ranks;
4. takes settings greedily by exposed seconds saved per byte kept (then communication seconds saved), each while the
   mix's peak stays within the budget. Rank 0's choice is broadcast.

A budget below the strategy's own peak is an error naming the smallest that fits. The choice applies to every graph
compiled afterwards (the joint pass ``apply_reshard_choice``), is reported by ``backend.report()`` and checked against
the compiled graphs' own estimate.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from ..compilation import CompiledGraph
from ..errors import ConfigError
from ..inspection.memory_estimate import input_bytes, storage_lifetimes
from ..passes.graph import COMM_META
from ..passes.lowering import unit_label
from ..sharding.backend_state import ShardingState
from .choice import size
from .cluster import Cluster
from .cost import Group, NodeCost, collective_cost, graph_costs
from .simulate import memory_timeline, simulate_graph

log = logging.getLogger("fsdp_compile")

# AdamW's state per gradient byte (two moments), as plan() assumes by default.
_OPTIMIZER_STATES = 2


@dataclass(frozen=True)
class UnitChoice:
    """One unit's chosen setting (only units not resharded to the shard are listed)."""

    unit: str  # "" is the root
    reshard_to: int  # 1: keeps its gathered parameters; n: keeps a shard over n ranks
    kept_bytes: float  # beyond its shard, held from its forward to its backward
    saved_seconds: float  # predicted exposed communication it saves, on its own


@dataclass
class ReshardChoice:
    """What ``memory_budget=`` chose, and the predictions it rests on."""

    budget: float
    shard_size: int
    units: dict[str, UnitChoice] = field(default_factory=dict)
    strategy_peak: float = 0.0  # the step's predicted peak with every unit resharded to the shard
    peak: float = 0.0  # with the choice
    strategy_exposed: float = 0.0  # predicted exposed communication of the step, both ways
    exposed: float = 0.0
    compiled_peak: float | None = None  # the compiled graphs' own estimate, once they exist

    @property
    def reshard_to(self) -> dict[str, int]:
        return {unit: c.reshard_to for unit, c in self.units.items()}

    def summary(self) -> dict[str, Any]:
        return {"budget": self.budget, "strategy_peak": self.strategy_peak, "peak": self.peak,
                "strategy_exposed": self.strategy_exposed, "exposed": self.exposed,
                "compiled_peak": self.compiled_peak,
                "units": [{"unit": c.unit, "reshard_to": c.reshard_to, "kept_bytes": c.kept_bytes,
                           "saved_seconds": c.saved_seconds} for c in self.units.values()]}


# ---------------------------------------------------------------------- the strategy's step
@dataclass
class _Unit:
    gathered_bytes: float  # its full parameters in the compute dtype
    forward_free: int  # index of the forward node after which the strategy frees them
    backward_gather: int  # index of its first backward node (its gather)
    backward_free: int  # index of the backward node after which the strategy frees them again
    backward_nodes: set[fx.Node]  # the backward nodes its gather was lowered into
    gather_bytes: float  # the backward all-gather's buffer


class ReshardStep:
    """The strategy's traced step, and the peak and exposure of any mix of settings."""

    def __init__(self, record: CompiledGraph, cluster: Any, states: dict[str, float]) -> None:
        self.cluster = cluster
        self.forward, self.backward = record.forward, record.backward
        self.forward_live = graph_live(self.forward, states, cluster)
        self.backward_live = graph_live(self.backward, states, cluster)
        self.outside_peak = optimizer_step_peak(states)
        self.units = _units(record)
        self.groups: dict[str, Any] = {}
        self.forward_costs = graph_costs(self.forward, cluster, self.groups)
        self.backward_costs = graph_costs(self.backward, cluster, self.groups)

    def peak(self, settings: Mapping[str, int], shard_size: int) -> float:
        extra_forward = [0.0] * (len(self.forward_live) + 1)
        extra_backward = [0.0] * (len(self.backward_live) + 1)
        for unit, ranks in settings.items():
            info = self.units.get(unit)
            if info is None:
                continue
            kept = kept_bytes(info.gathered_bytes, ranks, shard_size)
            extra_forward[info.forward_free + 1] += kept  # from after its last forward use on
            extra_backward[0] += kept  # an input of the backward graph: held throughout
            if ranks == 1:  # and not gathered again, where the strategy held it
                extra_backward[info.backward_gather] -= kept
                extra_backward[info.backward_free + 1] += kept
        peak = self.outside_peak
        for live, extra in ((self.forward_live, extra_forward), (self.backward_live, extra_backward)):
            running = 0.0
            for i, total in enumerate(live):
                running += extra[i]
                peak = max(peak, total + running)
        return peak

    def exposed(self, settings: Mapping[str, int]) -> tuple[float, float]:
        """(exposed communication, communication seconds) of the step with ``settings``."""
        changed: dict[fx.Node, NodeCost] = {}
        for unit, ranks in settings.items():
            info = self.units.get(unit)
            if info is None:
                continue
            for node in info.backward_nodes:
                if ranks == 1:  # nothing to gather
                    changed[node] = NodeCost("free")
                elif node.op == "call_function" and "all_gather" in str(node.target):
                    changed[node] = collective_cost("all_gather", info.gather_bytes, Group(ranks, 1), self.cluster)
        backward = [(node, changed.get(node, cost)) for node, cost in self.backward_costs]
        total = (simulate_graph(self.forward_costs, self.cluster.comm_overlap, self.cluster.host)
                 + simulate_graph(backward, self.cluster.comm_overlap, self.cluster.host))
        return float(total.exposed_comm_seconds), float(total.comm_seconds)


def kept_bytes(gathered_bytes: float, ranks: int, shard_size: int) -> float:
    """What a unit holds beyond its shard from forward to backward, resharded to ``ranks``."""
    return 0.0 if ranks >= shard_size else gathered_bytes / ranks


def _units(record: CompiledGraph) -> dict[str, _Unit]:
    """Each unit's gather in the strategy's forward and backward graphs, from the buckets."""
    backward_index = {n: i for i, n in enumerate(record.backward.graph.nodes)}
    forward_life, backward_life = storage_lifetimes(record.forward), storage_lifetimes(record.backward)
    found: dict[str, _Unit] = {}
    for bucket in record.forward_buckets.get("unshard", []):
        unit = _unit_of(bucket.key)
        entry = found.setdefault(unit, _Unit(0.0, 0, len(backward_index), 0, set(), 0.0))
        entry.gathered_bytes += float(sum(m.value_bytes for m in bucket.markers))
        entry.forward_free = max(entry.forward_free, _last_use(forward_life, record.forward, bucket.key))
    for node in record.backward.graph.nodes:
        tag = node.meta.get(COMM_META)
        if tag is None or tag.kind != "gather" or _unit_of(tag.bucket) not in found:
            continue
        entry = found[_unit_of(tag.bucket)]
        entry.backward_nodes.add(node)
        entry.backward_gather = min(entry.backward_gather, backward_index[node])
        entry.backward_free = max(entry.backward_free, _last_use(backward_life, record.backward, tag.bucket))
        if "all_gather" in str(node.target):
            entry.gather_bytes += float(node.meta["val"].numel() * node.meta["val"].element_size())
    return {unit: entry for unit, entry in found.items() if entry.backward_nodes}


def _unit_of(bucket: str) -> str:
    label = unit_label(bucket)
    return "" if label == "<root>" else label


def _last_use(life: Any, gm: fx.GraphModule, bucket: str) -> int:
    """The index of the node after which a bucket's gathered parameters die in ``gm``."""
    outputs = [n for n in gm.graph.nodes
               if (tag := n.meta.get(COMM_META)) is not None and tag.bucket == bucket and tag.kind == "gather"]
    index = {n: i for i, n in enumerate(life.nodes)}
    return max((life.last_use[key] for n in outputs for key, _ in life.keys.get(n, ()) if key in life.last_use),
               default=max((index[n] for n in outputs), default=0))


# ---------------------------------------------------------------------- the choice
def choose(step: ReshardStep, budget: float, shard_size: int, candidates: Sequence[int]) -> ReshardChoice:
    """The greedy choice (module docstring, step 4) on a traced step."""
    choice = ReshardChoice(budget, shard_size)
    choice.strategy_peak = step.peak({}, shard_size)
    choice.strategy_exposed, strategy_comm = step.exposed({})
    if choice.strategy_peak > budget:
        raise ConfigError(
            f"memory_budget={size(budget)} is below what resharding every unit after forward needs for this "
            f"model and batch: the smallest budget that fits is {size(math.ceil(choice.strategy_peak))} "
            f"({math.ceil(choice.strategy_peak)} bytes) per rank, as the planner counts the step's peak (the graphs' "
            "live memory, this rank's shards, gradients and AdamW's state)")
    moves = []
    for unit, info in step.units.items():
        for ranks in (*candidates, 1):
            kept = kept_bytes(info.gathered_bytes, ranks, shard_size)
            if kept <= 0:
                continue
            exposed, comm = step.exposed({unit: ranks})
            saved, comm_saved = choice.strategy_exposed - exposed, strategy_comm - comm
            if saved > 0 or comm_saved > 0:
                moves.append(((max(saved, 0.0) / kept, comm_saved / kept), unit, ranks, max(saved, 0.0), kept))
    moves.sort(key=lambda m: m[0], reverse=True)
    settings: dict[str, int] = {}
    saved_by: dict[tuple[str, int], float] = {}
    for _, unit, ranks, saved, kept in moves:
        current = settings.get(unit, shard_size)
        if kept <= kept_bytes(step.units[unit].gathered_bytes, current, shard_size):
            continue  # it already keeps at least this much
        trial = {**settings, unit: ranks}
        if step.peak(trial, shard_size) <= budget:
            settings = trial
            saved_by[(unit, ranks)] = saved
    choice.units = {unit: UnitChoice(unit, ranks, kept_bytes(step.units[unit].gathered_bytes, ranks, shard_size),
                                     saved_by[(unit, ranks)]) for unit, ranks in sorted(settings.items())}
    choice.peak = step.peak(settings, shard_size)
    choice.exposed, _ = step.exposed(settings)
    return choice


def candidate_groups(shard_size: int) -> list[int]:
    """The group sizes a unit may reshard to besides the whole shard group: its proper divisors."""
    return [n for n in range(2, shard_size) if shard_size % n == 0]


def rank_states(local_shards: Iterable[Any]) -> dict[str, float]:
    """This rank's parameter shards, their gradients and AdamW's state, in bytes (padded as stored)."""
    shard = grads = 0.0
    for shards in local_shards:
        for leaf in shards.leaves.values():
            nbytes = float(leaf.numel() * leaf.element_size())
            shard += nbytes
            if leaf.requires_grad:
                grads += nbytes
    return {"params": shard, "grads": grads, "optimizer": _OPTIMIZER_STATES * grads}


class MemoryBudget:
    """``memory_budget=`` as the backend hands it to its compiler: the compiler traces, this prices and chooses (the
    compiler knows nothing of the cost model)."""

    def __init__(self, budget: float, cluster: Cluster) -> None:
        self.budget = float(budget)
        self.cluster = cluster

    def decide(self, trace: Callable[[], CompiledGraph], state: ShardingState) -> ReshardChoice:
        """Trace the strategy's step (``trace()``), choose, and make rank 0's choice every rank's.

        Whatever rank 0 meets (a failed trace included) is raised on every rank: a rank raising alone would leave the
        others waiting in a collective, or retry the compile alone."""
        shard_size = state.topology.shard_size
        choice: Any = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                step = ReshardStep(trace(), self.cluster, rank_states(state.local_shards))
                choice = choose(step, self.budget, shard_size, candidate_groups(shard_size))
            except ConfigError as error:
                choice = error
            except Exception as error:  # raised on every rank below
                if not dist.is_initialized() or dist.get_world_size() == 1:
                    raise
                choice = RuntimeError(f"fsdp_compile: memory_budget=: tracing the strategy's step on rank 0 failed: "
                                      f"{type(error).__name__}: {error}")
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [choice]
            dist.broadcast_object_list(shared, src=0)
            choice = shared[0]
        if isinstance(choice, BaseException):
            raise choice
        return choice

    def check_compiled(self, record: CompiledGraph, state: ShardingState) -> None:
        """Warn where the compiled graphs' own estimate exceeds the budget."""
        choice = state.reshard_choice
        if choice is None or choice.compiled_peak is not None or record.backward is None:
            return
        choice.compiled_peak = compiled_peak([record], self.cluster, state.local_shards)
        if choice.compiled_peak > choice.budget:
            message = (f"fsdp_compile: memory_budget={int(choice.budget)} bytes: the compiled graphs' estimated peak "
                       f"is {int(choice.compiled_peak)} bytes, above the budget (the choice predicted "
                       f"{int(choice.peak)}); give a smaller budget to keep fewer units gathered")
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)


def memory_budget(options: Any) -> MemoryBudget | None:
    """What a backend with ``options`` hands its compiler for ``memory_budget=``; None without one."""
    if options.memory_budget is None:
        return None
    return MemoryBudget(options.memory_budget, options.cluster)


def check_cluster(cluster: Any) -> None:
    """``cluster=`` is checked where it is used, so that the options module stays free of the planner."""
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster= takes an fsdp_compile.Cluster, got {type(cluster).__name__}")


def graph_live(gm: fx.GraphModule, states: Mapping[str, float], cluster: Any) -> list[float]:
    """Live bytes after each node of ``gm``, with the shards it does not read and the optimizer's state, as ``plan()``
    counts."""
    held = {"param": max(0.0, states["params"] - input_bytes(gm, "param"))}
    workspace = getattr(cluster, "collective_workspace", None)
    return [float(sum(live.values())) + states["optimizer"]
            for live in memory_timeline(gm, held, workspace=workspace)]


def optimizer_step_peak(states: Mapping[str, float]) -> float:
    """Shards, their gradients, AdamW's moments and one gradient-sized temporary."""
    return states["params"] + 2 * states["grads"] + states["optimizer"]


def compiled_peak(records: Sequence[CompiledGraph], cluster: Any, local_shards: Iterable[Any]) -> float:
    """The peak the planner counts for graphs compiled with a choice."""
    states = rank_states(local_shards)
    peak = optimizer_step_peak(states)
    for record in records:
        for gm in (record.forward, record.backward):
            if gm is not None:
                peak = max(peak, *graph_live(gm, states, cluster))
    return peak
