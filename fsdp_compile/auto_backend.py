"""``strategy="auto"``: the backend that plans its strategy when it shards a model. It sits above
the planner (which traces candidates with the backend's own pipeline) and loads it when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from .api import ShardingStrategy
from .fsdp_backend import FSDPBackend

if TYPE_CHECKING:
    from .planning.cluster import Cluster


class AutoBackend(FSDPBackend):
    """An :class:`~fsdp_compile.FSDPBackend` that plans its strategy at :meth:`shard` time.

    It plans for this job's world, topology and device memory and applies the fastest
    configuration that fits (strategy, bucket policy, prefetch depth, and which units keep their
    gathered parameters after forward where the budget has room: ``reshard_after_forward``); it takes
    ``example_inputs`` (one rank's inputs), ``loss_fn``, ``cluster`` (default: the GPU's
    preset, matched by its name and memory, or measured where none describes it; measured on a
    CPU), ``memory_budget`` (bytes per device; needed on a CPU) and ``plan_options`` (passed to
    :func:`fsdp_compile.plan`; not ``tp_degrees``: auto applies 1-D strategies only); the plan is
    ``backend.plan``. Every other option is the backend's. See docs/planning.md.
    """

    def __init__(self, *, example_inputs: Any = None, loss_fn: Callable[[Any], Any] | None = None,
                 cluster: Cluster | None = None, memory_budget: float | None = None,
                 plan_options: dict[str, Any] | None = None, **options: Any) -> None:
        if any(options.get(name) is not None for name in ("mesh", "process_groups", "shard_size")):
            raise ValueError("strategy='auto' chooses the layout itself; drop mesh=, process_groups= and shard_size=")
        if any(options.get(name) is not None for name in ("forward_prefetch", "backward_prefetch", "offload")):
            raise ValueError("strategy='auto' plans without forward_prefetch=, backward_prefetch= or offload=")
        if options.get("reshard_after_forward") is not None:
            raise ValueError("strategy='auto' chooses reshard_after_forward itself, within memory_budget=: drop "
                             "reshard_after_forward=, or name a strategy to set it yourself")
        from .planning.auto import AutoRequest, check_plan_options  # the planner loads when auto is asked for

        check_plan_options(dict(plan_options or {}))
        super().__init__(ShardingStrategy.FULL_SHARD, **options)  # replaced by the plan's choice in shard()
        self.request = AutoRequest(example_inputs, loss_fn, cluster, memory_budget,
                                   plan_options=dict(plan_options or {}))

    def __repr__(self) -> str:
        if self.plan is None:
            return f"fsdp_compile.backend(strategy='auto', compiler={self.options.compiler!r})"
        return super().__repr__()

    def _before_sharding(self, model: nn.Module) -> None:
        """Plan for this world (rank 0 plans, every rank gets the choice) and apply the choice."""
        if self.plan is not None:
            return
        from .planning.auto import candidate_options, choose

        device_type = self._device_type(model)
        self.plan, row = choose(model, self.request, self.options.mixed_precision, device_type)
        chosen = candidate_options(self.plan, row)
        strategy = ShardingStrategy.parse(chosen["strategy"])
        shard_size = self.plan.cluster.devices_per_node if strategy.is_hybrid else None
        self._set_options(strategy=strategy, bucket=chosen["bucket"], prefetch=chosen["prefetch"],
                          shard_size=shard_size, reshard_after_forward=chosen["reshard_after_forward"])
