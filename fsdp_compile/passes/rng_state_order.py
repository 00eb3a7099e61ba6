"""Put activation checkpointing's saved RNG states where AOTAutograd's runtime looks for them.

Forward returns its outputs, then the saved tensors, then non-tensors (the DeviceMesh that
rebuilds DTensor gradients); with a random op in a checkpointed region the partitioner appends
its RNG state after the non-tensors, where the runtime expects a tensor and fails. The pass
moves those states in front of the trailing non-tensors, in forward's outputs and backward's inputs.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .context import PassContext


def _is_tensor(node: object) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_saved_rng_state(node: object) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    source, index = node.args
    return index == 0 and getattr(source, "target", None) is torch._prims.rng_prims.run_and_save_rng_state


def _before_trailing_non_tensors(items: list, moving: list) -> list:
    cut = next(i for i, x in enumerate(items) if any(x is m for m in moving))  # none moves before it
    while cut > 0 and not _is_tensor(items[cut - 1]):
        cut -= 1
    rest = [x for x in items if not any(x is m for m in moving)]
    return rest[:cut] + moving + rest[cut:]


def order_rng_states_before_opaque(forward: fx.GraphModule, backward: fx.GraphModule) -> bool:
    """Reorder in place as the module docstring says; returns whether anything moved."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    states = [x for x in outputs if _is_saved_rng_state(x)]
    if not states:
        return False
    new_outputs = _before_trailing_non_tensors(outputs, states)
    if all(a is b for a, b in zip(new_outputs, outputs)):
        return False
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    state_inputs = [p for p in placeholders if p.name.startswith("rng_state_output")]
    if len(state_inputs) != len(states):
        raise RuntimeError(f"found {len(states)} saved RNG states in forward but {len(state_inputs)} in backward; "
                           "cannot reorder them consistently")
    new_inputs = _before_trailing_non_tensors(placeholders, state_inputs)
    output.args = (tuple(new_outputs), *output.args[1:])
    anchor = new_inputs[0]
    for node in new_inputs[1:]:
        anchor.append(node)
        anchor = node
    forward.recompile()
    backward.recompile()
    return True


def order_rng_states_pass(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Partitioned pair: saved RNG states go before the trailing non-tensors, where AOTAutograd looks."""
    return order_rng_states_before_opaque(ctx.forward, gm)
