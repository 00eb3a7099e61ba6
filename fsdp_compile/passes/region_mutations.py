"""Inline the region calls whose body updates one of its inputs in place while training.

Dynamo captures a block that updates a buffer in place (BatchNorm's running statistics, a
step counter) as a region, but AOTAutograd cannot differentiate through it: the autograd
kernel of every higher-order operator refuses a body that writes to an input when gradients are
on (``HigherOrderOperator.py_autograd_impl`` in ``torch/_ops.py``, from the body's
``invoke_subgraph.gen_schema``). The same test, made here on the captured graph before
AOTAutograd runs, decides which bodies to inline: their blocks compile as without regions
(mutations and all, which AOTAutograd handles in a flat graph), the other blocks keep theirs.
A graph traced without gradients (evaluation under ``no_grad``) keeps its regions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .context import PassContext
from .regions import inline_regions, is_region_call, region_body

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


@dataclass(frozen=True)
class InlinedRegion:
    """A region body whose calls were inlined: the block class it is (the module the first
    call runs), and the input it writes."""

    block_class: type | None
    written: str


def _value(node: object) -> object:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else node


def _block_class(call: fx.Node) -> type | None:
    """The class of the module whose forward made the region call (Dynamo's module stack)."""
    stack = call.meta.get("nn_module_stack")
    if not stack:
        return None
    _, cls = list(stack.values())[-1]
    return getattr(cls, "_fsdp_original_class", cls)


def _written_input(call: fx.Node) -> str | None:
    """The graph name of an input ``call``'s body writes to, if it does while it needs
    gradients: the test ``HigherOrderOperator.py_autograd_impl`` makes."""
    operands = [_value(a) for a in call.args[2:]]
    tensors = [v for v in operands if isinstance(v, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return None
    # The operands' own mode: the context Dynamo calls the backend in may hold another.
    fake_mode = next((t.fake_mode for t in tensors if isinstance(t, FakeTensor)), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        schema = INVOKE_SUBGRAPH.gen_schema(region_body(call), call.args[1], *operands)
    # The schema's arguments are the body, its identifier, then the operands in order.
    written = [i for i, arg in enumerate(schema.arguments[2:]) if arg.is_write]
    if not written:
        return None
    operand = call.args[2 + written[0]]
    return operand.name if isinstance(operand, fx.Node) else f"operand {written[0]}"


def inline_mutating_regions(gm: fx.GraphModule) -> list[InlinedRegion]:
    """Inline every call of a body that writes to an input while training; returns one entry
    per body inlined."""
    checked: dict[str, str | None] = {}
    found: list[InlinedRegion] = []
    for call in [n for n in gm.graph.nodes if is_region_call(n)]:
        body = call.args[0].target
        if body not in checked:
            checked[body] = _written_input(call)
            if checked[body] is not None:
                found.append(InlinedRegion(_block_class(call), checked[body]))
    bodies = {body for body, written in checked.items() if written is not None}
    if bodies:
        inline_regions(gm, bodies)
    return found


def inline_mutating_regions_pass(gm: fx.GraphModule, ctx: PassContext) -> list[InlinedRegion]:
    """Pipeline entry of :func:`inline_mutating_regions` (the captured Dynamo graph)."""
    return inline_mutating_regions(gm)
