"""Model states per device: parameters, gradients and optimizer state under each strategy's shard layout (exact, from
the parameters' shapes), as ZeRO's memory formulas count them."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..api import ShardingStrategy
from ..inspection.memory_estimate import input_bytes
from ..runtime.collectives import padded_rows
from .vocabulary import OPTIMIZER_STATES


def _shard_numel(shape: tuple[int, ...], shard_size: int) -> int:
    if not shape or shard_size == 1:
        return math.prod(shape)
    return padded_rows(shape[0], shard_size) * math.prod(shape[1:])


def model_state_bytes(model: nn.Module, strategy: ShardingStrategy, world: int, devices_per_node: int,
                      optimizer: str, tp: int = 1) -> dict[str, float]:
    """Resident bytes per device of parameters, gradients, optimizer state and buffers. With ``tp`` > 1 (``model``
    parallelized), a TP parameter counts at its TP-local shape, sharded over the dp ranks, as the runtime shards it."""
    dp_world, dp_node = world // tp, devices_per_node // tp
    shard = 1 if strategy is ShardingStrategy.NO_SHARD else (dp_node if strategy.is_hybrid else dp_world)
    params = grads = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = getattr(p, "_local_tensor", p)  # a DTensor's TP-local tensor
        numel = _shard_numel(tuple(local.shape), shard)
        params += numel * p.element_size()
        if p.requires_grad:
            grads += numel * p.element_size()
    states = OPTIMIZER_STATES[optimizer]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"params": params, "grads": grads, "optimizer": states * grads, "buffers": buffers}


def held_outside(gm: Any, states: dict[str, float]) -> dict[str, float]:
    """The parameter shards and buffers of ``states`` that graph ``gm`` does not take as inputs: alive beside it."""
    return {role: max(0, states[key] - input_bytes(gm, role))
            for role, key in (("param", "params"), ("buffer", "buffers"))}
