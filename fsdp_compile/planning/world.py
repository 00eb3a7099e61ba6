"""A world that exists only in this process: torch's fake process group (every group, rank and size asked for, no
communication) and fake tensors (shapes and dtypes, no storage).

CPU fake tensors, not the meta device: under AOTAutograd some composite ops have a Python meta kernel that bypasses
their autograd formula on meta (torch 2.13: ``cross_entropy`` on meta traces a backward with zero gradients).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..sharding.sharded_param import like_float8_weight, plain_tensor


class RealProcessGroupError(RuntimeError):
    """A real default process group exists: the fake world must be made elsewhere."""


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0); reuses a fake one of that size,
    and leaves any other alone (then the planner runs in a subprocess, :mod:`.child_process`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            yield  # a fake world of this size (the caller's or an enclosing plan's): trace in it
            return
        raise RealProcessGroupError("a default process group exists in this process; the planner traces in a fake "
                                    "world of its own, so it runs in a subprocess here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_like(mode: FakeTensorMode, value: torch.Tensor) -> torch.Tensor:
    """A CPU fake tensor of ``value``'s shape, strides and dtype (no storage)."""
    with mode:
        return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="cpu")


def copy_with(model: nn.Module, stand_in: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A copy of ``model`` (on any device, meta included) whose parameters and buffers are their ``stand_in``s; no data
    is copied (they go into ``deepcopy``'s memo), shared ones stay shared."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            new = stand_in(tensor)
            memo[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
    return copy.deepcopy(model, memo)


def fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors."""
    return copy_with(model, lambda tensor: like_float8_weight(tensor, fake_like(mode, plain_tensor(tensor))))


def fake_inputs(mode: FakeTensorMode, inputs: Any) -> Any:
    """Example inputs (real, meta or fake tensors, in any nesting) as CPU fakes of ``mode``."""
    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not (isinstance(value, FakeTensor) and value.fake_mode is mode):
            return fake_like(mode, value)
        return value

    return torch.utils._pytree.tree_map(convert, inputs)
