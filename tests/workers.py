"""Bodies of multi-process tests (importable by spawned workers) and their shared helpers."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compile
from fsdp_compile import ShardingStrategy
from fsdp_compile.gpt import GPT, GPTConfig

# vocab 67 and block size 19 are prime: the embedding, head and position tables do not split
# evenly over 2 or 4 ranks, so padded shards are exercised on every rank count.
TEST_CONFIG = GPTConfig(vocab_size=67, block_size=19, n_layer=2, n_head=2, d_model=32)
PER_RANK_BATCH = 2
SEQ = 16
LR = 1e-3


def hybrid_options(strategy: ShardingStrategy | str) -> dict:
    """Hybrid strategies in tests: 2 'nodes' of 2 'devices' at world 4."""
    return {"shard_size": 2} if ShardingStrategy.parse(strategy).is_hybrid else {}


def batches(cfg: GPTConfig, world: int, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches (all ranks' data concatenated) for ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(0, cfg.vocab_size, (world * PER_RANK_BATCH, SEQ + 1), generator=gen)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def local_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * PER_RANK_BATCH:(rank + 1) * PER_RANK_BATCH]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly DTensor) tensor; collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def train(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    data: list,
    rank: int | None,
) -> dict[str, Any]:
    """AdamW steps; returns losses, first-step gradients and final parameters (whole tensors).

    ``rank=None`` trains on the whole global batch (the single-process reference).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], {}
    for step, (x, y) in enumerate(data):
        if rank is not None:
            x, y = local_slice(x, rank), local_slice(y, rank)
        loss = lm_loss(forward(x), y)
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params}


def fsdp2_model(model: nn.Module, strategy: ShardingStrategy, world: int) -> nn.Module:
    """torch's own FSDP2 configured as ``strategy``: one unit per block plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy is ShardingStrategy.NO_SHARD:
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    elif strategy.is_hybrid:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward)
    return model


def parity_worker(rank: int, world: int, strategy: str, modes: list[str], steps: int) -> dict:
    """Train the test GPT with each mode on the same data; rank 0 also trains the reference."""
    strategy = ShardingStrategy.parse(strategy)
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, steps)
    out: dict[str, Any] = {}
    for mode in modes:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if mode == "fsdp2":
            fsdp2_model(model, strategy, world)
            out[mode] = train(model, model, data, rank)
            continue
        compiler = "aot_eager" if mode == "eager" else mode
        backend = fsdp_compile.backend(strategy, compiler=compiler, **hybrid_options(strategy))
        backend.shard(model)
        forward = model if mode == "eager" else torch.compile(model, backend=backend)
        out[mode] = train(model, forward, data, rank)
        out[mode]["graphs"] = len(backend.graphs)
        if mode != "eager":
            out[mode]["facts"] = graph_facts(backend, model)
    if rank == 0:
        out["initial"] = {n: p.detach().clone() for n, p in base.named_parameters()}
        reference = copy.deepcopy(base)
        out["reference"] = train(reference, reference, data, None)
    return out if rank == 0 else {}



def graph_facts(backend: fsdp_compile.FSDPBackend, model: nn.Module) -> dict:
    """What the backend's (single) compiled graph pair communicates and keeps for backward."""
    from fsdp_compile.graphinfo import marker_counts, saved_gathered_parameters
    from fsdp_compile.ops import REDUCE_GRAD, UNSHARD, reduce_grad_spec, unshard_spec

    (record,) = backend.graphs

    def specs(gm, target, parse):
        return sorted({parse(n.args) for n in gm.graph.nodes if n.target is target}, key=repr)

    return {
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
        "forward": marker_counts(record.forward),
        "backward": marker_counts(record.backward),
        "saved_gathered": saved_gathered_parameters(record.forward),
        "unshard_specs": specs(record.forward, UNSHARD, unshard_spec),
        "reduce_specs": specs(record.backward, REDUCE_GRAD, reduce_grad_spec),
    }
