"""The inner compilers the pipeline's stages run inside: AOTAutograd with ``aot_eager``, or Inductor.

Both call the same :class:`Stages` in the same order (joint, partition and fix-ups, then each
graph): ``aot_eager`` as AOTAutograd's ``partition_fn`` and phase compilers, Inductor through its
public hooks (:class:`JointPassHook`, :class:`PartitionerHook`, whose uuids carry our cache key,
and ``inner_compile``). The stages come as callables: this module does not know the pipeline.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..passes.graph import is_collective
from ..passes.regions import is_region_call
from ..passes.stages import fix_partition
from ..runtime.faults import reraise_named
from .cache import CacheLookup
from .records import CompiledGraph


@dataclass(frozen=True)
class Stages:
    """The pipeline's stages for one captured graph, as an inner compiler calls them."""

    record: CompiledGraph
    joint: Callable[[fx.GraphModule], None]  # the joint passes, in place
    # aot_eager's partition: the min-cut partitioner and the fix-ups, (joint, inputs, **kwargs)
    partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]]
    graph: Callable[[fx.GraphModule, str, dict | None], fx.GraphModule]  # (graph, phase, decompositions)
    disabled: tuple[str, ...] = ()  # disable_passes=, for the fix-ups Inductor's partitioner hook runs


def compile_aot_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], stages: Stages,
                      timeout: Any = None) -> Callable:
    """AOTAutograd with our stages and no code generation: graphs run as Python."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    record = stages.record

    def partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        stages.joint(joint)  # where Inductor's joint-graph hook runs it: before partitioning
        return stages.partition(joint, joint_inputs, **kwargs)

    def phase_compiler(phase: str):
        def compile_graph(g: fx.GraphModule, inputs: Sequence[Any]):
            run = stages.graph(g, phase, None).forward
            if phase != "backward":
                return make_boxed_func(run)

            def backward(args: list) -> Any:
                try:
                    return run(*args)
                except Exception as exc:
                    reraise_named(exc, f"the backward of compiled graph {record.index}", timeout)

            backward._boxed_call = True  # type: ignore[attr-defined]
            return backward
        return compile_graph

    return aot_autograd(fw_compiler=phase_compiler("forward"), bw_compiler=phase_compiler("backward"),
                        inference_compiler=phase_compiler("inference"), partition_fn=partition,
                        keep_inference_input_mutations=True)(gm, example_inputs)


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], stages: Stages, cache: CacheLookup,
                     fallback_random: bool = False) -> tuple[Callable, str]:
    """Inductor with our stages in its hooks: the compiled graph and what Inductor's caches did,
    "hit" (no stage ran), "miss" or "off: <why>". ``fallback_random``: random ops draw what the
    eager runtime draws (``verify_gradients=``)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    record = stages.record

    def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        phase = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        lowered = stages.graph(g, phase, select_decomp_table())
        scheduled = record.backward_schedule if phase == "backward" else record.forward_schedule
        if scheduled is None or not any(is_collective(n) for n in lowered.graph.nodes):
            return compile_fx_inner(lowered, inputs, **kwargs)
        # Inductor's peak-memory reordering would move each backward all-gather to right before
        # its wait and each reduce-scatter's wait to the end, undoing schedule_collectives' order.
        # It runs after fusion, so without it the kernels and results are the same.
        with torch._inductor.config.patch(reorder_for_peak_memory=False):
            return compile_fx_inner(lowered, inputs, **kwargs)

    key, lookups, why_off = cache.key, cache.lookups, cache.why_off
    joint_pass = JointPassHook(stages.joint, torch._inductor.config.joint_custom_pre_pass, key)
    patches: dict[str, Any] = {"joint_custom_pre_pass": joint_pass}
    if hasattr(torch._inductor.config, "custom_partitioner_fn"):  # torch >= 2.12
        patches["custom_partitioner_fn"] = PartitionerHook(torch._inductor.config.custom_partitioner_fn,
                                                           stages.disabled, key)
    if fallback_random:
        patches["fallback_random"] = True
    if not cache.fx_graph_cache:
        patches["fx_graph_cache"] = False
    # AOTAutograd's cache keys on Inductor's configuration, where our key travels as the hooks'
    # uuids: a hit is what our passes would produce again; a key of None bypasses the caches.
    counts = torch._dynamo.utils.counters["aot_autograd"]
    hits, bypasses = counts["autograd_cache_hit"], counts["autograd_cache_bypass"]
    functorch_patches: dict[str, Any] = {"enable_autograd_cache": lookups}
    if any(is_region_call(n) for n in gm.graph.nodes):
        # Inductor applies the backward graph's donated-buffer indices to a region body's own
        # inputs, which then overwrites a gradient the caller still reads (fixed upstream after
        # 2.13, pytorch#193960): graphs with regions donate nothing (see docs/design.md).
        functorch_patches["donated_buffer"] = False
    with torch._functorch.config.patch(**functorch_patches):
        compiled = compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
    if lookups and counts["autograd_cache_bypass"] > bypasses:
        lookups, why_off = False, "Inductor bypassed its cache for this graph (TORCH_LOGS=+aot_autograd says why)"
    if not lookups:
        return compiled, f"off: {why_off}"
    return compiled, "hit" if counts["autograd_cache_hit"] > hits else "miss"


class JointPassHook(torch._inductor.custom_graph_pass.CustomGraphPass):
    """The pipeline's joint stage, run by Inductor before it partitions; a user's joint pass after it."""

    def __init__(self, joint_stage: Callable[[fx.GraphModule], None],
                 user_pass: Callable[[fx.Graph], None] | None, key: str | None = None) -> None:
        self.joint_stage = joint_stage
        self.user_pass = user_pass
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        self.joint_stage(graph.owning_module)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Any:
        return _uuid(self.key, self.user_pass)


def _uuid(key: str | None, user_pass: Any) -> Any:
    """Our key with the uuid of the user's pass we wrap; None (no caching) when either is unknown."""
    if key is None:
        return None
    if user_pass is None:
        return key
    user_uuid = getattr(user_pass, "uuid", None)
    user_uuid = user_uuid() if callable(user_uuid) else None
    return None if user_uuid is None else (key, user_uuid)


class PartitionerHook(getattr(torch._inductor.custom_graph_pass, "CustomPartitionerFn", object)):
    """Inductor's partitioner (or the user's), then the partition fix-ups. It holds plain values
    only: one that held the compilation made AOTAutograd's cache bypass."""

    def __init__(self, user_partitioner: Callable[..., Any] | None, disabled: Sequence[str] = (),
                 key: str | None = None) -> None:
        self.user_partitioner = user_partitioner
        self.disabled = tuple(disabled)
        self.key = key

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        partition = self.user_partitioner or min_cut_rematerialization_partition
        forward, backward = partition(gm, joint_inputs, **kwargs)
        fix_partition(forward, backward, self.disabled)
        return forward, backward

    def uuid(self) -> Any:
        return _uuid(self.key, self.user_partitioner)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a graph compiles: compiling allocates millions of
    long-lived objects, which the collector would walk again and again (objects still die by
    reference count; cycles wait for one collection after the compile)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def backward_now() -> Any:
    """AOTAutograd compiles the backward graph with the forward, not at the first backward: the
    first run of the forward checks both graphs' collectives against the other ranks."""
    flag = "force_non_lazy_backward_lowering"
    return torch._functorch.config.patch(**({flag: True} if hasattr(torch._functorch.config, flag) else {}))
