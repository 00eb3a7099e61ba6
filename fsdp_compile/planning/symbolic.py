"""Memory and step time as expressions of the batch or the sequence length, and what fits.

The candidate is traced again with one input dimension marked dynamic: its size is a sympy symbol through every shape,
so live memory and the simulated step are expressions of it. Each node's live bytes is a polynomial; the largest size
that fits is the floor of the smallest root of any crossing the budget (or the bound Dynamo's guards put on the size).
Assumed: the partitioner's choices and the schedule do not change with the size (a real run compiles again). The step
leaves out what a host model has no closed form for (its ``closed_form()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from ..api import ShardingStrategy
from .cost import graph_costs, outside_graph_seconds
from .simulate import memory_timeline, simulate_graph
from .states import held_outside, model_state_bytes
from .trace import trace_candidates
from .vocabulary import OPTIMIZER_STATES, PlanError
from .world import fake_world


@dataclass
class SymbolicResult:
    variable: sympy.Symbol
    memory: sympy.Expr  # peak bytes per device
    step_seconds: sympy.Expr
    largest_fitting: int
    upper_bound: int | None  # from Dynamo's guards on the size, if any


def _polynomials(expressions: list[sympy.Expr], x: sympy.Symbol) -> list[sympy.Poly]:
    """Distinct polynomials, without those another one bounds coefficient by coefficient (for sizes >= 1 they can never
    be the maximum)."""
    polys: dict[tuple, sympy.Poly] = {}
    for expr in expressions:
        poly = sympy.Poly(sympy.expand(expr), x)
        polys[tuple(poly.all_coeffs())] = poly
    items = list(polys.values())

    def coeffs(p: sympy.Poly, degree: int) -> list:
        c = list(reversed(p.all_coeffs()))
        return c + [0] * (degree + 1 - len(c))

    degree = max((p.degree() for p in items), default=0)
    vectors = [coeffs(p, degree) for p in items]
    return [items[i] for i, v in enumerate(vectors)
            if not any(j != i and all(a <= b for a, b in zip(v, w)) and v != w for j, w in enumerate(vectors))]


def _largest_fitting(polys: list[sympy.Poly], budget: float, x: sympy.Symbol) -> int | float:
    """The largest integer x >= 1 with every polynomial <= budget (inf if unbounded, 0 if none)."""
    best: float = math.inf
    for poly in polys:
        if poly.eval(1) > budget:
            return 0
        shifted = poly - sympy.Poly(sympy.Integer(math.floor(budget)), x)
        roots = [r for r in shifted.real_roots() if r >= 1] if shifted.degree() > 0 else []
        if roots:
            best = min(best, math.floor(min(float(r) for r in roots)))
    return best


def symbolic_analysis(plan: Any, strategy: ShardingStrategy | str, size: str, input_index: int,
                      dim: int | None) -> SymbolicResult:
    context = plan._context
    if context is None:
        raise PlanError("this plan was made in another process (a real process group exists here); "
                        "its graphs stayed there, so it cannot solve for sizes; call plan() where no process "
                        "group is initialized")
    if size not in ("batch", "seq"):
        raise ValueError(f"size={size!r}: use 'batch' or 'seq'")
    dim = (0 if size == "batch" else 1) if dim is None else dim
    # Solving for sizes covers rows without tensor parallelism (tp 1) only, for now.
    row = plan.row(strategy, tp=1)
    if not row.traced:
        raise PlanError(f"{row.strategy} was not traced ({row.note}); nothing of it fits at any size")
    candidate = next(c for c in context.traced if c.strategy.name == row.strategy and c.bucket_label() == row.bucket
                     and c.prefetch == row.prefetch and c.tp == 1)
    inputs = list(context.example_inputs)
    if not (0 <= input_index < len(inputs)) or not isinstance(inputs[input_index], torch.Tensor):
        raise ValueError(f"input_index={input_index} is not a tensor input of the example")
    value = inputs[input_index]
    if not (0 <= dim < value.dim()):
        raise ValueError(f"dim={dim} is not a dimension of input {input_index} (shape {tuple(value.shape)})")
    if value.shape[dim] < 2:
        # Dynamo keeps sizes 0 and 1 static; trace at 2 (the inputs are fake, any size is free).
        shape = list(value.shape)
        shape[dim] = 2
        inputs[input_index] = torch.empty(shape, dtype=value.dtype, device="meta")
    key = (candidate, size, input_index, dim)
    cache = context.__dict__.setdefault("symbolic", {})
    if key in cache:
        return cache[key]
    cluster = plan.cluster
    with fake_world(context.world):
        traced = trace_candidates(
            context.model, inputs, context.loss_fn, [candidate], world=context.world,
            devices_per_node=cluster.devices_per_node, mixed_precision=context.mixed_precision,
            device_type=cluster.device_type, symbolic_dims={input_index: {dim: size}})[candidate]
        symbols = {name for name, label in traced.symbolic.items() if label == size}
        if not symbols:
            raise PlanError(f"the {size} size (input {input_index}, dim {dim}) did not stay symbolic: the model "
                            "specializes it (Dynamo guarded on its value), so it cannot be solved for")
        x = sympy.Symbol(size, positive=True, integer=True)
        states = model_state_bytes(context.model, candidate.strategy, context.world, cluster.devices_per_node,
                                   context.optimizer)
        lives: list[sympy.Expr] = []
        step = 0
        host = cluster.host.closed_form() if cluster.host is not None else None
        groups: dict = {}
        shape_env = None
        for record in traced.records:
            for gm in (record.forward, record.backward):
                if gm is None:
                    continue
                for live in memory_timeline(gm, held_outside(gm, states), symbolic=True,
                                            workspace=cluster.collective_workspace):
                    lives.append(sum(live.values()) + states["optimizer"])
                step = step + simulate_graph(graph_costs(gm, cluster, groups, symbolic=True), cluster.comm_overlap,
                                             host).seconds
                if shape_env is None:
                    shape_env = _shape_env(gm)
        temporary = states["grads"] if OPTIMIZER_STATES[context.optimizer] else 0
        lives.append(sum(states.values()) + temporary)
        tensors = len({id(p) for p in traced.model.parameters()})
        step = step + outside_graph_seconds(context.optimizer, int(states["grads"] / 4), states["grads"], tensors,
                                            cluster)
    substitution = {s: x for expr in lives if isinstance(expr, sympy.Basic)
                    for s in expr.free_symbols if str(s) in symbols}
    lives = [sympy.sympify(e).subs(substitution) for e in lives]
    polys = _polynomials(lives, x)
    memory = sympy.Max(*[p.as_expr() for p in polys]) if len(polys) > 1 else polys[0].as_expr()
    step_expr = sympy.sympify(step).subs(substitution)
    upper = None
    if shape_env is not None:
        for name in symbols:
            bound = shape_env.var_to_range.get(sympy.Symbol(name, positive=True, integer=True))
            if bound is None:
                bound = next((r for s, r in shape_env.var_to_range.items() if str(s) == name), None)
            if bound is not None and getattr(bound.upper, "is_Integer", False):
                upper = int(bound.upper) if upper is None else min(upper, int(bound.upper))
    largest = _largest_fitting(polys, plan.budget_bytes, x)
    if upper is not None:
        largest = min(largest, upper)
    if math.isinf(largest):
        raise PlanError(f"{row.strategy}: memory does not grow with the {size}; every size fits")
    result = SymbolicResult(x, memory, step_expr, int(largest), upper)
    cache[key] = result
    return result


def _shape_env(gm) -> Any:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for s in value.shape:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None
