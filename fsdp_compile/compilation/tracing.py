"""Running a step through ``torch.compile`` to trace it, not to train: what the tracing door needs,
and the backend class the planner traces with (:func:`trace_with`, :func:`make_backend`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from .inner_compilers import backward_now
from .records import CompiledGraph

_backend_factory: Callable[..., Any] | None = None


def trace_with(factory: Callable[..., Any]) -> None:
    """Name the backend the planner shards, traces and measures candidates with, called as
    ``factory(strategy, **options)`` (``fsdp_compile.FSDPBackend``). The package does so when it
    is imported, before any of the planner runs: the backend is the layer above the planner,
    and naming it here keeps the planner itself out of ``import fsdp_compile``."""
    global _backend_factory
    _backend_factory = factory


def make_backend(strategy: Any, **options: Any) -> Any:
    """A backend of the class :func:`trace_with` named, with these options."""
    if _backend_factory is None:
        raise RuntimeError("the planner has no backend to trace with: import fsdp_compile, which names it")
    return _backend_factory(strategy, **options)


def run_traced(backend: Callable[[fx.GraphModule, Sequence[Any]], Callable], fn: Callable,
               example_inputs: Sequence[Any], records: Callable[[], list[CompiledGraph]], *,
               dynamo_pass: Callable[[fx.GraphModule], None] | None = None, fake_mode: Any = None) -> None:
    """Run ``fn(*example_inputs)`` through ``torch.compile(backend=backend)``; ``records()``: the
    records the backend made meanwhile. ``dynamo_pass`` rewrites each Dynamo graph first;
    ``fake_mode``: the FakeTensorMode of fake inputs, under which the compiled graphs run."""

    def capture(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        if dynamo_pass is not None:
            dynamo_pass(gm)
            gm.recompile()
        compiled = backend(gm, inputs)
        if fake_mode is None:
            return compiled

        def run(*args: Any) -> Any:
            with fake_mode:
                return compiled(*args)
        return run

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    dynamo_patches = {limit: 1 << 20, "accumulated_" + limit: 1 << 20, "automatic_dynamic_shapes": False}
    with backward_now(), torch._dynamo.config.patch(**dynamo_patches):
        output = torch.compile(fn, backend=capture)(*example_inputs)
        if any(r.backward is None and not r.inference for r in records()):
            # A torch whose AOTAutograd lowers backward lazily: run it (on fake tensors).
            loss = [t for t in torch.utils._pytree.tree_leaves(output)
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if loss:
                torch.autograd.backward(loss, [torch.ones_like(t) for t in loss])


@contextlib.contextmanager
def own_tracing_context() -> Iterator[None]:
    """A tracing context of its own for a trace run inside a compile, sharing the outer one's
    fake mode and tensors.

    AOTAutograd caches what it traced of each region body (invoke_subgraph) in the context, and
    the compile that follows would reuse this trace's graphs, made without the inner compiler's
    decompositions (Inductor then refuses ``native_layer_norm``) and under another reshard policy."""
    from torch._guards import TracingContext, tracing

    outer = TracingContext.try_get()
    context = TracingContext(outer.fake_mode if outer is not None else None)
    if outer is not None:
        context.tensor_to_context = outer.tensor_to_context
    with tracing(context):
        yield
