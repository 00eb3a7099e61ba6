"""fsdp_compile: Fully Sharded Data Parallel training as a torch.compile backend.

    backend = fsdp_compile.backend(strategy="FULL_SHARD")
    model = torch.compile(backend.shard(model), backend=backend)

    print(fsdp_compile.plan(model, inputs, cluster=fsdp_compile.Cluster.preset("h100-sxm", nodes=4)))
"""

import importlib
import inspect
from typing import Any

import torch
import torch.nn as nn

from .api import ConfigError, CPUOffload, MixedPrecision, ShardingStrategy
from .auto_backend import AutoBackend
from .checks.agreement import AgreementError, GraphMismatchError
from .checks.gradients import GradientMismatch
from .compilation.records import CompiledGraph
from .compilation.tracing import trace_with
from .fsdp_backend import FSDPBackend
from .inspection.memory_estimate import MemoryEstimate, estimate_memory
from .runtime.faults import RankFailure
from .training.checkpoint import (
    CheckpointError,
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from .training.clip import clip_grad_norm_

__all__ = ["AgreementError", "CPUOffload", "CheckpointError", "Cluster", "CompiledGraph", "ConfigError",
           "EmulatedNetwork", "FSDPBackend", "GradientMismatch", "GraphMismatchError", "MemoryEstimate",
           "MixedPrecision", "Plan", "PlanError", "RankFailure", "ShardingStrategy", "backend", "clip_grad_norm_",
           "compile", "estimate_memory", "full_state_dict", "load_checkpoint", "load_full_state_dict", "plan",
           "save_checkpoint"]
from .api import __version__ as __version__

# Loaded on first use: a training job should pay for neither the planner nor the emulated
# network (a testing tool for CPU runs that stand in for a cluster).
_LAZY = {"Cluster": "planning", "Plan": "planning", "PlanError": "planning", "plan": "planning",
         "EmulatedNetwork": "network"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsdp_compile' has no attribute {name!r}")


trace_with(FSDPBackend)  # the planner shards and traces its candidates with this backend


def backend(strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD, **options: Any) -> FSDPBackend:
    # The docstring is FSDPBackend's (set below): the options are documented once, there.
    if isinstance(strategy, str) and strategy.strip().lower() == "auto":
        return AutoBackend(**options)
    from .planning.auto import AUTO_OPTIONS

    # memory_budget= and cluster= are the backend's too (it chooses reshard_after_forward with them).
    auto_only = [name for name in AUTO_OPTIONS if name not in ("memory_budget", "cluster")]
    given = [name for name in auto_only if options.get(name) is not None]
    if given:
        raise ValueError(f"{', '.join(f'{name}=' for name in auto_only)} are for strategy='auto' "
                         f"(got {', '.join(f'{name}=' for name in given)}); to plan by hand call fsdp_compile.plan()")
    return FSDPBackend(strategy, **{k: v for k, v in options.items() if k not in auto_only})


backend.__doc__ = (
    "Create a backend: ``FSDPBackend(strategy, **options)``; ``strategy=\"auto\"`` returns\n"
    ":class:`fsdp_compile.auto_backend.AutoBackend`, which plans the strategy at ``shard()``.\n\n"
    + inspect.cleandoc(FSDPBackend.__doc__ or ""))


def _backend_signature() -> inspect.Signature:
    """The backend's options (declared in fsdp_compile.api.BackendOptions), then those only
    ``strategy="auto"`` takes: what help() and IDEs that read signatures show for ``backend``."""
    options = list(inspect.signature(FSDPBackend).parameters.values())
    names = {p.name for p in options}
    auto = [p for p in inspect.signature(AutoBackend).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in names]
    return inspect.Signature(options + auto, return_annotation=FSDPBackend)


backend.__signature__ = _backend_signature()  # type: ignore[attr-defined]


def compile(model: nn.Module, strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
            **options: Any) -> nn.Module:
    """Shard ``model`` and return ``torch.compile(model, backend=...)``; the backend is ``.fsdp_backend``."""
    fsdp = backend(strategy, **options)
    compiled = torch.compile(fsdp.shard(model), backend=fsdp)
    compiled.fsdp_backend = fsdp
    return compiled
