"""How far a whole graph's measured compute lies from the sum of its nodes' priced costs.

Each operator's calibration times it alone; a training graph runs them differently (an ``addmm``
on a transposed weight, smaller shapes, caches others just evicted, a Python call per operator):
on a 2-core Xeon a one-block GPT's forward and backward took 1.1-1.25x their priced cost. So the
calibration runs one such graph for real and prices it with the same cost model:
``HostCPU.compute_scale`` (:func:`compute_scale`) is measured over priced, a residual the cost
model applies to every compute node priced by roofline (1 on a GPU, where the CPU runs ahead).

Every rank runs the reference at once, also where the operators' calibrations take turns: ranks
time-slicing a core refill each other's caches, which a step pays too. Timed two at a time, it
left world-4 plain-gloo steps predicted 13-16% short; all at once, -12% to -4%
(``bench/results/archive/plan_emulated_cross_job.md``). The machine's speed also moves between
jobs (29 ms, then 37-40 ms a minute later), so ``compare`` times the compared model's own step
again beside the steps (:mod:`.beside_steps`; ``bench/results/plan_emulated.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from fsdp_compile.models.gpt import GPT, GPTConfig
from fsdp_compile.planning.calibration.compute import _compute_seconds
from fsdp_compile.planning.cost import graph_costs

from .cores import _cpu_share

# The reference: a GPT block as the CPU demos and benchmarks train it (d_model 256, 4 heads,
# 4 x 128 tokens), with its embeddings and output head, the loss inside the graph.
_REFERENCE = {"vocab_size": 512, "block_size": 128, "n_layer": 1, "n_head": 4, "d_model": 256}
_BATCH = 4


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


def compute_scale(measured_seconds: float, graphs: list[fx.GraphModule], cluster: Any) -> float:
    """Measured over priced for the reference's graphs on ``cluster`` (its host model's own
    ``compute_scale`` left out); 1 where nothing was measured."""
    if not graphs:
        return 1.0
    unscaled = cluster.with_host(compute_scale=1.0)
    priced = sum(cost.seconds for gm in graphs for _, cost in graph_costs(gm, unscaled) if cost.kind == "compute")
    return measured_seconds / priced if priced > 0 else 1.0


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def reference_step(device: torch.device) -> tuple[list[fx.GraphModule], Callable[[], None]]:
    """The calibration's reference (a one-block GPT with its loss): its forward and backward
    graphs and a function running one step of them."""
    model = _WithLoss(GPT(GPTConfig(**_REFERENCE))).to(device)
    tokens = torch.randint(0, _REFERENCE["vocab_size"], (_BATCH, _REFERENCE["block_size"]), device=device)
    return _captured_step(model, (tokens,))


def timed_reference(repeats: int, device: torch.device, group: Any = None,
                    sync: bool = True) -> tuple[float, list[fx.GraphModule]]:
    """(this rank's median seconds of one reference step on the compute clock, its graphs) on a
    CPU; ``(0.0, [])`` elsewhere, where no scale is measured.

    With ``sync`` the ranks start together, as they compute in training: a rank timed while
    its peers idle would have the machine's shared cache and memory to itself."""
    if device.type != "cpu":
        return 0.0, []
    graphs, step = reference_step(device)
    if sync and dist.is_initialized():
        dist.barrier(group=group)
    return _compute_seconds(step, max(repeats, 5), device, typical=True, share=_cpu_share(device)), graphs
