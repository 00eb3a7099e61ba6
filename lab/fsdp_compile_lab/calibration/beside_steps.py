"""How far a whole graph's measured compute lies from the sum of its nodes' priced costs.

Each operator's calibration times that operator in isolation; a training graph runs them
differently (other shapes, caches that others just evicted, on a CPU each operator a Python call).
A host model's ``compute_scale`` corrects every compute node it prices by roofline with the ratio
of a step's graphs run for real over their priced cost (:func:`compute_scale`). ``compare`` times
the compared model's own step again after every timed step (:func:`model_reference_step`,
:func:`time_reference`) and predicts each strategy at the speed the machine had while that
strategy's steps ran: the speed of a shared machine moves between a calibration and the steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..cost import graph_costs
from .compute import _compute_clock, _stretched


class _ModelLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: tuple, targets: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), targets)


def _captured_step(module: nn.Module, args: tuple) -> tuple[list[fx.GraphModule], Callable[[], None]]:
    """``module(*args)`` (a scalar loss)'s forward and backward graphs as AOTAutograd lowers
    them (run as Python, as ``aot_eager`` runs them), and a function running one step of them."""
    from functorch.compile import aot_module, make_boxed_func

    graphs: list[fx.GraphModule] = []

    def capture(gm: fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm)

    compiled = aot_module(module, fw_compiler=capture, bw_compiler=capture)

    def step() -> None:
        compiled(*args).backward()
        for p in module.parameters():  # no gradient accumulation outside the graphs
            p.grad = None

    step()
    return graphs, step


def model_reference_step(
    model: nn.Module, inputs: tuple, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
) -> tuple[list[fx.GraphModule], Callable[[], None]]:
    """``model``'s own step as a reference: ``loss_fn(model(*inputs), targets)`` forward and
    backward on this rank alone, no collectives, its graphs and a function running one step.
    ``model`` is trained by nothing else (its gradients are dropped after each step)."""
    return _captured_step(_ModelLoss(model, loss_fn), (tuple(inputs), targets))


def time_reference(step: Callable[[], None], device: torch.device) -> float:
    """One run of a reference ``step`` on the compute clock, stretched by the rank's share of a
    core as the calibration stretches its timings: a sample of what the calibration measures."""
    clock = _compute_clock(device)
    start = clock()
    step()
    return _stretched(clock() - start, clock, device)


def compute_scale(measured_seconds: float, graphs: list[fx.GraphModule], cluster: Any) -> float:
    """Measured over priced for the reference's graphs on ``cluster`` (its host model's own
    ``compute_scale`` left out); 1 where nothing was measured."""
    if not graphs:
        return 1.0
    unscaled = cluster.with_host(compute_scale=1.0)
    priced = sum(cost.seconds for gm in graphs for _, cost in graph_costs(gm, unscaled) if cost.kind == "compute")
    return measured_seconds / priced if priced > 0 else 1.0
