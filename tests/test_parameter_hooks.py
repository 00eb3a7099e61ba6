"""Hooks a user registers on a sharded (DTensor) parameter do not fire in backward, as with
FSDP2's sharded parameters, and the parameter's ``.grad`` is set (docs/strategies.md)."""

from __future__ import annotations

import copy

import torch
from distributed import run_workers
from helpers import TEST_CONFIG, batches, fsdp2_model, lm_loss, local_slice
from torch.distributed.tensor import DTensor

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.models.gpt import GPT


def hooks_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    x, y = (local_slice(t, rank) for t in batches(TEST_CONFIG, world, 1)[0])
    out = {}
    for mode in ("eager", "aot_eager", "fsdp2"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if mode == "fsdp2":
            forward = fsdp2_model(model, ShardingStrategy.FULL_SHARD, world)
        else:
            backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
            backend.shard(model)
            forward = model if mode == "eager" else torch.compile(model, backend=backend)
        fired: list[str] = []
        for name, param in model.named_parameters():
            param.register_hook(lambda grad, name=name: fired.append(name))
        lm_loss(forward(x), y).backward()
        out[mode] = {"fired": fired, "dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
                     "grads": all(p.grad is not None for p in model.parameters())}
    return out


def test_hooks_on_sharded_parameters_do_not_fire_in_backward() -> None:
    for rank, out in enumerate(run_workers(hooks_worker, 2)):
        for mode in ("eager", "aot_eager", "fsdp2"):
            assert out[mode]["dtensor"], (rank, mode)
            assert out[mode]["fired"] == [], (rank, mode, out[mode]["fired"][:3])
            assert out[mode]["grads"], (rank, mode)
