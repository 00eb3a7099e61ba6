"""Gradient accumulation without communication: ``backend.no_sync()``.

While sync is off, reads are ``unshard_no_sync(shard, accumulator, ...)``: the gradient is summed
unreduced into a full-shape ``accumulator``. The first backward with sync back on still accumulates,
then reduces everything with the graphs' ``reduce_grads``: one reduction per window, as FSDP's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime.collectives import CommSpec, reduce_grads

if TYPE_CHECKING:
    from .sharded_param import ShardedParamInfo


class GradientSync:
    """Whether backward reduces gradients, shared by every module of the models a backend shards."""

    def __init__(self) -> None:
        self.requires_sync = True
        # Read by the parameters' properties: Dynamo guards on it (one graph per value).
        self.accumulating = False
        self.accumulators: dict[str, torch.Tensor] = {}
        self._entries: dict[str, tuple[nn.Parameter, ShardedParamInfo]] = {}
        self._reduce_queued = False

    def add(self, param: nn.Parameter, info: ShardedParamInfo) -> None:
        self._entries[info.fqn] = (param, info)

    def set_requires_sync(self, requires_sync: bool) -> None:
        if not isinstance(requires_sync, bool):
            raise TypeError(f"set_requires_gradient_sync() takes a bool, got {type(requires_sync).__name__}")
        self.requires_sync = requires_sync
        if not requires_sync and not self.accumulating:
            self.accumulators = {fqn: self._accumulator(*entry) for fqn, entry in self._entries.items()
                                 if entry[0].requires_grad}
            self.accumulating = True
        # Turning sync back on keeps ``accumulating`` until the next backward has reduced.

    def _accumulator(self, param: nn.Parameter, info: ShardedParamInfo) -> torch.Tensor:
        local = param.to_local()
        dtype = info.comm.grad_reduce_dtype(local.dtype)
        device = info.comm.compute_device or local.device
        accumulator = torch.zeros((), dtype=dtype, device=device).expand(info.full_shape).requires_grad_()
        accumulator.register_post_accumulate_grad_hook(self._on_accumulated)
        return accumulator

    def _on_accumulated(self, _accumulator: torch.Tensor) -> None:
        if self.requires_sync and not self._reduce_queued:
            self._reduce_queued = True
            # Once the whole backward is done (every accumulator holds its last micro-batch), as FSDP's.
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce_accumulated)

    def reduce_accumulated(self) -> None:
        """Reduce the accumulated gradients into ``param.grad`` and end accumulation (the first backward
        with sync back on does; call it if the window ended without one)."""
        self._reduce_queued = False
        if not self.requires_sync:
            raise RuntimeError("reduce_accumulated() while gradient sync is off; turn it back on first")
        groups: dict[tuple[str, CommSpec], list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for fqn, accumulator in self.accumulators.items():
            if accumulator.grad is not None:
                param, info = self._entries[fqn]
                groups.setdefault((info.unit, info.comm), []).append((param, accumulator.grad))
        with torch.no_grad():
            for (_unit, comm), members in groups.items():
                locals_ = [param.to_local() for param, _ in members]
                shards = reduce_grads([g for _, g in members], [t.shape[0] if t.dim() else 0 for t in locals_],
                                      [t.dtype for t in locals_], comm)
                for (param, _), shard in zip(members, shards):
                    add_local_grad(param, shard)
        self.accumulators = {}
        self.accumulating = False


def add_local_grad(param: nn.Parameter, local_grad: torch.Tensor) -> None:
    """Accumulate ``local_grad`` (this rank's shard of a reduced gradient) into ``param.grad``."""
    grad = DTensor.from_local(local_grad, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
