"""What each stage's passes are told about the backend (:class:`~fsdp_compile.passes.context.PassContext`)."""

from __future__ import annotations

from ..api import BackendOptions
from ..passes.context import PassContext
from ..passes.scheduling import ScheduleOptions
from ..sharding.backend_state import ShardingState


def pass_context(options: BackendOptions, state: ShardingState, phase: str,
                 decompositions: dict | None = None) -> PassContext:
    """The context of ``phase``'s passes: the bucket policy, the schedule options (graph stage,
    with schedule=True), the units' reshard choice (joint stage, under memory_budget=)."""
    schedule = None
    if options.schedule and phase not in ("joint", "partitioned"):
        kind = "backward" if phase == "backward" else "forward"
        schedule = ScheduleOptions(options.prefetch, options.max_inflight_bytes,
                                   state.explicit_prefetch[kind])
    reshard = None
    choice = state.reshard_choice
    if phase == "joint" and choice is not None:
        groups = {n: g.group_name for n, g in state.reshard_groups.groups().items()}
        reshard = {unit: (ranks, groups.get(ranks, "")) for unit, ranks in choice.reshard_to.items()}
    return PassContext(phase, bucket_policy=options.bucket_policy, decompositions=decompositions,
                       schedule=schedule, reshard=reshard)
