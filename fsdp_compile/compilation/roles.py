"""What each forward output is, and the roles backward's saved inputs inherit from them (the
memory estimate and the lowering read them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..inspection.graphinfo import is_gathered
from ..passes.graph import ROLE_META, SAVED_STORAGE_META


def tag_saved_inputs(gm: fx.GraphModule, forward_output_roles: list[str], forward_output_storages: list[Any]) -> None:
    """Give the backward graph's saved inputs the roles and storage keys their forward outputs had.
    Saved sizes (SymInts) are the forward's last outputs but the backward's first inputs, so
    tensors are matched with tensors only (the ``tangents_*`` come last)."""
    saved = [n for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
             and not _is_size(n)]
    storages = list(forward_output_storages) + [None] * (len(forward_output_roles) - len(forward_output_storages))
    tensors = [(role, key) for role, key in zip(forward_output_roles, storages) if role != "other"]
    if saved and len(saved) <= len(tensors):
        for node, (role, key) in zip(saved, tensors[-len(saved):]):
            node.meta[ROLE_META] = role
            if key is not None:
                node.meta[SAVED_STORAGE_META] = key


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def output_roles(gm: fx.GraphModule) -> list[str]:
    """What each output of a forward graph is: "gathered" (a full parameter), the role our passes
    tagged it with, "activation", or "other" (not a tensor)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    roles = []
    for value in output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]:
        if not isinstance(value, fx.Node) or _is_size(value):
            roles.append("other")
        elif is_gathered(value):
            roles.append("gathered")
        else:
            roles.append(value.meta.get(ROLE_META, "activation"))
    return roles
