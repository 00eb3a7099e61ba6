"""What the stages leave behind besides graphs: dumps (``dump_dir=``) and pass failures (raised
under ``strict=True``, else warned, recorded, and the graph keeps its markers for the eager runtime).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..api import BackendOptions
from ..inspection.dump import Dumper, manifest_for
from ..inspection.report import graph_summary
from ..passes.stages import PassFailure
from ..sharding.backend_state import ShardingState
from .records import CompiledGraph

log = logging.getLogger("fsdp_compile")


class StrictFallbackError(RuntimeError):
    """``strict=True`` (or ``FSDP_COMPILE_STRICT=1``): a pass failed on a graph."""


class StageLog:
    """Dumps and pass failures of one compiler's graphs."""

    def __init__(self, options: BackendOptions, state: ShardingState) -> None:
        self.options = options  # replaced with the compiler's (strategy="auto" applies its plan)
        self.state = state
        self.quiet = False  # no dumps (the compiler's trace for memory_budget=)
        self._dumper: Dumper | None = None

    def dumper(self) -> Dumper | None:
        """Where this compiler's graphs are dumped (``dump_dir=`` or ``FSDP_COMPILE_DUMP``); None: nowhere."""
        root = self.options.dump_dir or os.environ.get("FSDP_COMPILE_DUMP")
        if not root or self.quiet:
            return None
        if self._dumper is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            manifest = manifest_for(self.options.strategy.name, world, self._describe_options())
            self._dumper = Dumper(root, rank, manifest)
        return self._dumper

    def _describe_options(self) -> dict[str, Any]:
        o, topo = self.options, self.state.topology
        return {"compiler": o.compiler, "bucket": o.bucket_policy.describe(), "schedule": o.schedule,
                "prefetch": o.prefetch, "max_inflight_bytes": o.max_inflight_bytes,
                "mixed_precision": repr(o.mixed_precision) if o.mixed_precision else None,
                "shard_size": topo.shard_size if topo else None,
                "replicate_size": topo.replicate_size if topo else None}

    def write_graph(self, record: CompiledGraph, name: str, code: Callable[[], str]) -> None:
        """Dump ``code()`` (run only when dumping) as the graph file ``name`` of ``record``."""
        dumper = self.dumper()
        if dumper is not None:
            dumper.write_graph(record.index, name, code())

    def write_summary(self, record: CompiledGraph) -> None:
        dumper = self.dumper()
        if dumper is not None:
            dumper.write_summary(record.index, graph_summary(record, self.options.strategy, self.state))

    def fail(self, record: CompiledGraph, phase: str, failure: PassFailure) -> None:
        where = f"graph {record.index} ({phase})"
        if self.options.strict:
            raise StrictFallbackError(f"fsdp_compile: {failure} on {where}") from failure.__cause__
        message = (f"fsdp_compile: {failure} on {where}; running that graph with its FSDP markers "
                   "executed by the eager runtime (same results, no bucketing or scheduling). "
                   "Pass strict=True to raise instead.")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
        record.fallbacks.append({"phase": phase, "pass": failure.pass_name, "error": str(failure.__cause__)})
