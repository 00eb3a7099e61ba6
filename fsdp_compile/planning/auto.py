"""``strategy="auto"``: what :class:`fsdp_compile.auto_backend.AutoBackend` (which lives above the planner) plans with
at ``shard()``, and how the plan's best row becomes its options (strategy, bucket policy, prefetch depth; hybrid: shard
groups of one node). Rank 0 plans (in a subprocess, :mod:`.child_process`) and broadcasts the plan, or its error, to
every rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api import MixedPrecision
from .cluster import Cluster
from .plan import Plan, PlanError, PlanRow, plan, require_fit
from .vocabulary import ClusterError

log = logging.getLogger("fsdp_compile")


@dataclass
class AutoRequest:
    """What ``backend(strategy="auto", ...)`` plans with."""

    example_inputs: Sequence[Any] | torch.Tensor | None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    cluster: Cluster | None = None
    memory_budget: float | None = None
    optimizer: str = "adamw"
    plan_options: dict[str, Any] = field(default_factory=dict)


def machine_cluster(world: int, devices_per_node: int, device_type: str, memory_budget: float | None,
                    properties: Any = None, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                    ) -> Cluster:
    """The cluster this job runs on: on a GPU its preset, matched by the device's name and total memory, or measured
    where no preset describes it (:meth:`Cluster.for_device`; ``properties`` stands for the device's); on a CPU
    measured, against ``memory_budget``, its matmul rates for ``dtypes`` only (a CPU's bf16 calibration takes a
    minute)."""
    nodes = max(world // devices_per_node, 1)
    if device_type == "cuda":
        cluster = Cluster.for_device(nodes=nodes, devices_per_node=devices_per_node, properties=properties)
        if cluster.name.startswith("measured"):
            log.warning("fsdp_compile: no cluster preset describes this GPU (%s): strategy='auto' plans with "
                        "its rates measured by Cluster.measure()", cluster.name)
        return cluster
    if memory_budget is None:
        raise ClusterError("strategy='auto' on a CPU needs memory_budget= (bytes per rank to plan for)")
    return Cluster.measure(nodes=nodes, device_memory=memory_budget, dtypes=dtypes)


def compute_dtypes(model: nn.Module, mixed_precision: MixedPrecision | None) -> tuple[torch.dtype, ...]:
    """The dtypes ``model`` computes matmuls in: its parameters', and the mixed-precision one."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if mixed_precision is not None and mixed_precision.param_dtype is not None:
        dtypes.append(mixed_precision.param_dtype)
    return tuple(dict.fromkeys(dtypes)) or (torch.float32,)


def choose(model: nn.Module, request: AutoRequest, mixed_precision: MixedPrecision | None,
           device_type: str) -> tuple[Plan, PlanRow]:
    """Plan on rank 0, broadcast, and return (plan, chosen row) on every rank."""
    if request.example_inputs is None:
        raise ValueError("strategy='auto' plans from one rank's inputs: pass example_inputs= (real, meta or "
                         "fake tensors of one training step's inputs) to fsdp_compile.backend")
    world, rank = dist.get_world_size(), dist.get_rank()
    devices_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cluster = request.cluster if request.cluster is not None else machine_cluster(
        world, devices_per_node, device_type, request.memory_budget, dtypes=compute_dtypes(model, mixed_precision))
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome[0] = plan(model, request.example_inputs, cluster=cluster, loss_fn=request.loss_fn,
                              mixed_precision=mixed_precision, optimizer=request.optimizer, world_size=world,
                              memory_budget=request.memory_budget, **request.plan_options)
        except Exception as exc:  # raised on every rank below, not only on rank 0
            outcome[0] = exc
    dist.broadcast_object_list(outcome, src=0)
    result = outcome[0]
    if isinstance(result, Exception):
        raise result
    best = require_fit(result)
    if rank == 0:
        log.info("fsdp_compile: strategy='auto' chose %s: %s", best.label(), result.why)
    return result, best


def candidate_options(result: Plan, row: PlanRow) -> dict[str, Any]:
    """The backend options of ``row``: strategy, bucket policy, prefetch, and the units the plan's budget keeps gathered
    after forward (``reshard_after_forward=``; None: the strategy's)."""
    if row.tp != 1:
        raise PlanError(f"strategy='auto' applies 1-D rows only, and the plan chose {row.label()} (TP degree "
                        f"{row.tp}): plan_options must not ask for tp_degrees")
    if row.bucket not in result.bucket_policies:
        raise PlanError(f"the plan does not know bucket policy {row.bucket!r}")
    return {"strategy": row.strategy, "bucket": result.bucket_policies[row.bucket], "prefetch": row.prefetch,
            "reshard_after_forward": dict(row.reshard) or None}


# What strategy="auto" passes to plan() itself, so plan_options may not.
_PLANNED_BY_AUTO = ("cluster", "loss_fn", "mixed_precision", "optimizer", "world_size", "memory_budget")


def check_plan_options(plan_options: dict[str, Any]) -> None:
    """Refuse, by name, plan options that ``strategy="auto"`` cannot honour: a TP degree (it shards a 1-D model: plan TP
    by hand with ``fsdp_compile.plan(..., tp_degrees=...)`` and apply the row with ``parallelize_module`` and
    ``backend(strategy, mesh=mesh["dp"])``), what it passes itself, and options ``plan()`` does not take."""
    import inspect

    known = set(inspect.signature(plan).parameters) - {"model", "example_inputs"}
    unknown = sorted(set(plan_options) - known)
    if unknown:
        what = "is not an option" if len(unknown) == 1 else "are not options"
        raise ValueError(f"plan_options: {', '.join(unknown)} {what} of fsdp_compile.plan(); it takes "
                         f"{', '.join(sorted(known - set(_PLANNED_BY_AUTO)))}")
    own = [name for name in _PLANNED_BY_AUTO if name in plan_options]
    if own:
        raise ValueError(f"plan_options: strategy='auto' sets {', '.join(own)} itself: pass "
                         f"{'them' if len(own) > 1 else 'it'} to fsdp_compile.backend('auto', ...) instead "
                         "(world_size is the job's)")
    degrees = plan_options.get("tp_degrees")
    tp_asked = degrees is not None and tuple(degrees) != (1,)
    if tp_asked or plan_options.get("parallelize_fn") is not None:
        asked = f"tp_degrees={degrees!r}" if tp_asked else "parallelize_fn="
        raise ValueError(f"plan_options: {asked} asks strategy='auto' for tensor parallelism, which it does not "
                         "apply (it shards the model as given, over every rank): plan the TP degree with "
                         "fsdp_compile.plan(model, inputs, cluster=..., tp_degrees=...), then apply the row by hand "
                         "(torch's parallelize_module on mesh['tp'], then fsdp_compile.backend(row.strategy, "
                         "mesh=mesh['dp']))")


# Options only strategy="auto" takes (fsdp_compile.backend rejects them for other strategies).
AUTO_OPTIONS = ("example_inputs", "loss_fn", "cluster", "memory_budget", "plan_options")


def __getattr__(name: str) -> Any:
    # AutoBackend moved up to fsdp_compile.auto_backend, beside the backend it extends; the old spelling still works,
    # read from the package (the planner does not import the backend).
    if name == "AutoBackend":
        import sys
        import warnings

        warnings.warn("fsdp_compile.planning.auto.AutoBackend moved: use fsdp_compile.auto_backend.AutoBackend "
                      "(or fsdp_compile.backend('auto', ...))", DeprecationWarning, stacklevel=2)
        return sys.modules["fsdp_compile"].AutoBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
