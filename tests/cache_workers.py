"""Bodies of the compile-cache tests (importable by spawned workers)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdp_compile


class TinyNet(nn.Module):
    """Small enough for a quick Inductor compile; dim 0 of 5 and 3 split unevenly over 2 ranks
    (rank-dependent local shards, the case AOTAutograd's own key does not tell apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 5)
        self.proj = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.proj(self.head(x))


class UuidPass:
    """A user pass that leaves the graph as it is, keyed by ``tag``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        return None

    def uuid(self) -> str:
        return self.tag


def noop_pass(gm: torch.fx.GraphModule) -> None:
    return None


def backend_options(change: str) -> tuple[str, dict[str, Any]]:
    """(strategy, options) of the baseline run or of one change to it."""
    strategy, options = "FULL_SHARD", {}
    if change == "strategy":
        strategy = "SHARD_GRAD_OP"
    elif change == "bucket":
        options["bucket"] = "param"
    elif change == "mixed_precision":
        options["mixed_precision"] = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    elif change == "schedule":
        options["schedule"] = False
    elif change == "user_pass":
        options["passes"] = {"backward": [UuidPass("a")]}
    elif change == "user_pass_changed":
        options["passes"] = {"backward": [UuidPass("b")]}
    elif change == "user_pass_without_uuid":
        options["passes"] = {"backward": [noop_pass]}
    return strategy, options


def cache_run(rank: int, world: int, cache_dir: str, change: str = "", steps: int = 2) -> dict:
    """Train TinyNet for ``steps`` SGD steps under Inductor with ``cache_dir``; report what the
    cache did and everything a bitwise comparison needs."""
    if change == "version":
        fsdp_compile.api.__version__ = fsdp_compile.api.__version__ + "+test"
    torch.manual_seed(0)
    model = TinyNet()
    strategy, options = backend_options(change)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = fsdp_compile.backend(strategy, compiler="inductor", cache_dir=cache_dir, **options)
        backend.shard(model)
        compiled = torch.compile(model, backend=backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        losses, grads = [], []
        for _ in range(steps):
            x = torch.randn(4, 8, generator=gen)
            loss = F.mse_loss(compiled(x), torch.zeros(4, 3))
            loss.backward()
            grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {"cache": [g.cache for g in backend.graphs], "stats": dict(backend.cache_stats),
            "losses": losses, "grads": grads,
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "warnings": [str(w.message) for w in caught if "fsdp_compile" in str(w.message)],
            "report": backend.report()}


def cache_keys(rank: int, world: int, changes: list[str]) -> dict[str, str | None]:
    """The compile-cache key each change gives (no compile), with a fresh model each time."""
    keys = {}
    for change in changes:
        if change == "version":
            saved = fsdp_compile.api.__version__
            fsdp_compile.api.__version__ = saved + "+test"
        torch.manual_seed(0)
        model = TinyNet()
        strategy, options = backend_options(change)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend = fsdp_compile.backend(strategy, compiler="inductor", **options)
            backend.shard(model)
            key, _, _ = backend.compiler.cache_key()
        keys[change or "baseline"] = key
        if change == "version":
            fsdp_compile.api.__version__ = saved
    return keys
