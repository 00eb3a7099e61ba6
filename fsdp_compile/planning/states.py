"""Model states per device: parameters, gradients and optimizer state under each strategy's
shard layout (exact, from the parameters' shapes), as ZeRO's memory formulas count them."""

from __future__ import annotations

import math

from torch import nn

from ..api import ShardingStrategy
from ..runtime.collectives import padded_rows
from .numbers import OPTIMIZER_STATES


def _shard_numel(shape: tuple[int, ...], shard_size: int) -> int:
    if not shape or shard_size == 1:
        return math.prod(shape)
    return padded_rows(shape[0], shard_size) * math.prod(shape[1:])


def model_state_bytes(model: nn.Module, strategy: ShardingStrategy, world: int, devices_per_node: int,
                      optimizer: str) -> dict[str, float]:
    """Resident bytes per device of parameters, gradients and optimizer state (exact, from the
    parameters' shapes and the strategy's shard layout), and of buffers."""
    shard = 1 if strategy is ShardingStrategy.NO_SHARD else (devices_per_node if strategy.is_hybrid else world)
    params = grads = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        numel = _shard_numel(tuple(p.shape), shard)
        params += numel * p.element_size()
        if p.requires_grad:
            grads += numel * p.element_size()
    states = OPTIMIZER_STATES[optimizer]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {"params": params, "grads": grads, "optimizer": states * grads, "buffers": buffers}
