"""A world that exists only in this process: a fake process group and fake tensors.

The planner traces the real pipeline for a world of any size in one process. torch's fake
process group (``torch.testing._internal.distributed.fake_pg``) gives ``shard()`` and the
passes every group, rank and size they ask for and never communicates; fake tensors
(``FakeTensorMode``) give every parameter, buffer and input its shape and dtype without
storage. Nothing here allocates the model.

Why CPU fake tensors, not the meta device: under AOTAutograd, some composite ops have a
Python meta kernel that bypasses their autograd formula on the meta device (checked on torch
2.13: ``cross_entropy`` on meta tensors traces a backward graph with zero gradients), while
CPU fake tensors dispatch as a real CPU run would.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..sharding.float8_gather import like_float8_weight, plain_tensor


class RealProcessGroupError(RuntimeError):
    """A real default process group exists: the fake world must be made elsewhere."""


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0).

    Reuses a fake default group of the same size; any other default group is left alone
    (the planner then runs in a subprocess, see :mod:`fsdp_compile.planning.child_process`).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            yield  # a fake world of this size (the caller's or an enclosing plan's): trace in it
            return
        raise RealProcessGroupError(
            "a default process group exists in this process; the planner traces in a fake world of "
            "its own, so it runs in a subprocess here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_like(mode: FakeTensorMode, value: torch.Tensor) -> torch.Tensor:
    """A CPU fake tensor of ``value``'s shape, strides and dtype (no storage)."""
    with mode:
        fake = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="cpu")
    return fake


def fake_model(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors; the original is untouched.

    Works for a model on any device (meta included) and copies no data: every parameter and
    buffer goes into ``deepcopy``'s memo as its fake stand-in, so only the module objects are
    copied. Shared parameters stay shared.
    """
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        fake = like_float8_weight(tensor, fake_like(mode, plain_tensor(tensor)))
        if isinstance(tensor, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    return copy.deepcopy(model, memo)


def fake_inputs(mode: FakeTensorMode, inputs: Any) -> Any:
    """Example inputs (real, meta or fake tensors, in any nesting) as CPU fakes of ``mode``."""
    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if isinstance(value, FakeTensor) and value.fake_mode is mode:
                return value
            return fake_like(mode, value)
        return value

    return torch.utils._pytree.tree_map(convert, inputs)
