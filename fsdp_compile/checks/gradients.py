"""Check a compiled graph's gradients against the eager runtime's on its first step.

``verify_gradients=`` (or ``FSDP_COMPILE_VERIFY=1``): on each compiled graph's first step with
gradients, the same graph also runs through the eager runtime on the same inputs and random
state, its backward with the same incoming gradients; a gradient that differs by more than the
tolerance (relative to the eager gradient's largest entry) raises :class:`GradientMismatch` on
every rank. It separates a fault of compilation from one of the model or data, for a second
forward and backward (and their memory) per graph. The default tolerance is 1e-4 in 32 or 64
bits, 2e-2 in 16 (Inductor reorders float arithmetic); under Inductor the check turns on
``fallback_random`` so that random ops draw what eager kernels draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import Node

from ..api import env_flag

ENV = "FSDP_COMPILE_VERIFY"
FULL_PRECISION_RTOL = 1e-4
LOW_PRECISION_RTOL = 2e-2


class GradientMismatch(RuntimeError):
    """A compiled graph's gradient differs from the eager runtime's beyond the tolerance."""


def requested(option: bool | float) -> bool | float:
    """The backend's ``verify_gradients`` option, or ``FSDP_COMPILE_VERIFY`` when it is off."""
    return option if option is not False else env_flag(ENV)


@dataclass
class _Input:
    index: int  # position among the graph's inputs
    name: str  # what a user calls it: the parameter's name, or the input's
    reference: torch.Tensor  # the eager run's copy of it


def _key(tensor: torch.Tensor) -> tuple:
    """Where autograd takes a tensor's gradient: its grad_fn's output, or the leaf itself."""
    if tensor.grad_fn is None:
        return ("leaf", id(tensor))
    return (tensor.grad_fn, tensor.output_nr)


def _edge_key(edge: tuple[Node | None, int]) -> tuple | None:
    node, output_nr = edge
    if node is None:
        return None
    variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
    return ("leaf", id(variable)) if variable is not None else (node, output_nr)


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| over max |reference| (exact match required of a zero tensor)."""
    diff = (value.double() - reference.double()).abs().max().item() if value.numel() else 0.0
    scale = reference.double().abs().max().item() if reference.numel() else 0.0
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


class GradientCheck:
    """Runs the comparison for every compiled graph of one backend."""

    def __init__(self, tolerance: bool | float) -> None:
        self.tolerance = None if tolerance is True else float(tolerance)
        self.checked: set[int] = set()  # graph indices whose first step was compared
        self.compared: list[dict[str, Any]] = []  # per graph: inputs compared, worst difference

    def wants(self, index: int) -> bool:
        return index not in self.checked and torch.is_grad_enabled()

    def run(self, index: int, names: Sequence[str], eager: Callable[..., Any], inputs: list[Any],
            call: Callable[[], Any]) -> Any:
        """``call()``'s outputs (the compiled graph on ``inputs``), with the comparison against
        ``eager`` (the same graph as Python) hooked onto their backward."""
        self.checked.add(index)
        references = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                      for t in inputs]
        rng = torch.get_rng_state()
        with torch.enable_grad():
            expected = eager(*references)
        torch.set_rng_state(rng)
        outputs = call()
        grad_inputs = [_Input(i, names[i], references[i]) for i, t in enumerate(inputs)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
        keys = {_key(t): n for t, n in zip((inputs[i.index] for i in grad_inputs), grad_inputs)}
        self._hook(index, outputs, expected, keys)
        return outputs

    def _hook(self, index: int, outputs: Any, expected: Any, keys: dict[tuple, _Input]) -> None:
        produced = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        reference = list(expected) if isinstance(expected, (list, tuple)) else [expected]
        pairs = [(p, r) for p, r in zip(produced, reference) if isinstance(p, torch.Tensor) and p.requires_grad
                 and isinstance(r, torch.Tensor) and r.requires_grad]
        nodes = {p.grad_fn for p, _ in pairs if p.grad_fn is not None and "CompiledFunction" in p.grad_fn.name()}
        if len(nodes) != 1:
            self.compared.append({"graph": index, "inputs": 0, "worst": 0.0, "note": "no compiled backward"})
            return
        (node,) = nodes
        incoming: list[torch.Tensor | None] = [None] * len(pairs)
        for slot, (produced_output, _) in enumerate(pairs):
            def keep(grad: torch.Tensor, slot: int = slot) -> None:
                incoming[slot] = grad
            produced_output.register_hook(keep)

        def compare(grad_inputs: Sequence[torch.Tensor | None], _grad_outputs: Any) -> None:
            found = {}
            for edge, grad in zip(node.next_functions, grad_inputs):
                item = keys.get(_edge_key(edge))
                if item is not None and grad is not None:
                    found[item.index] = (item, grad)
            self._compare(index, found, [r for _, r in pairs],
                          [g if g is not None else torch.zeros_like(r) for g, (_, r) in zip(incoming, pairs)])

        node.register_hook(compare)

    def _compare(self, index: int, found: dict[int, tuple[_Input, torch.Tensor]], outputs: list[torch.Tensor],
                 grad_outputs: list[torch.Tensor]) -> None:
        items = [item for item, _ in found.values()]
        expected = torch.autograd.grad(outputs, [i.reference for i in items], grad_outputs, allow_unused=True)
        worst, finding = 0.0, None
        for (item, grad), reference in zip(found.values(), expected):
            if reference is None:
                reference = torch.zeros_like(grad)
            rtol = self.tolerance if self.tolerance is not None else (
                LOW_PRECISION_RTOL if reference.dtype in (torch.bfloat16, torch.float16) else FULL_PRECISION_RTOL)
            difference = relative_difference(grad, reference)
            worst = max(worst, difference)
            if difference > rtol and finding is None:
                finding = (f"the gradient of {item.name} differs from the eager runtime's by {difference:.2e} of its "
                           f"largest entry (tolerance {rtol:.0e})")
        self.compared.append({"graph": index, "inputs": len(items), "worst": worst})
        findings = [finding]
        if dist.is_initialized() and dist.get_world_size() > 1:
            findings = [None] * dist.get_world_size()
            dist.all_gather_object(findings, finding)
        failed = [(rank, text) for rank, text in enumerate(findings) if text is not None]
        if failed:
            rank, text = failed[0]
            raise GradientMismatch(
                f"fsdp_compile: compiled graph {index} computes wrong gradients on rank {rank}: {text}. The eager "
                "runtime runs the same graph with every collective as written; the difference comes from "
                "compiling it. Try compiler='aot_eager', regions=False, schedule=False or disable_passes= to "
                "find the part responsible, and report it with FSDP_COMPILE_DUMP=<dir>")
