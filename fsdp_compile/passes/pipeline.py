"""Run a sequence of graph passes on a graph, recording (and optionally dumping) each.

A pass is ``(name, fn)`` where ``fn(gm)`` rewrites ``gm`` in place and may return a value
(buckets, a schedule) or a replacement GraphModule. A ``ConfigError`` (the user's options
cannot work) passes through unwrapped; any other error becomes a ``PassFailure``. A pass that
fails half-way leaves the caller's graph as it was (it is restored from a copy): the caller
can still run it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

import torch.fx as fx

from ..errors import ConfigError

Pass = tuple[str, Callable[[fx.GraphModule], Any]]


@dataclass
class PassResult:
    name: str
    seconds: float
    value: Any = None


class PassFailure(RuntimeError):
    """A pass raised; ``pass_name`` says which, ``__cause__`` holds its error."""

    def __init__(self, pass_name: str, error: BaseException) -> None:
        super().__init__(f"pass {pass_name!r} failed: {type(error).__name__}: {error}")
        self.pass_name = pass_name


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy with its own graph, as a lazy graph module where torch has them: the passes'
    ``recompile()`` calls then defer Python code generation to the first call of ``forward``
    (or read of ``.code``) instead of regenerating it after every pass, which for a graph of
    tens of thousands of nodes costs seconds each time. It runs the same code either way."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule as cls
    except ImportError:  # a torch without lazy graph modules: copies recompile eagerly
        cls = fx.GraphModule
    return cls(gm, copy.deepcopy(gm.graph))


def run_passes(
    gm: fx.GraphModule,
    passes: Sequence[Pass],
    on_graph: Callable[[str, fx.GraphModule], None] | None = None,
    graph_only: Collection[Callable[[fx.GraphModule], Any]] = (),
) -> tuple[fx.GraphModule, list[PassResult]]:
    """Apply ``passes`` to ``gm``; ``on_graph(step, graph)`` sees it before and after each.

    On a failure ``gm`` is restored to the graph it had (a copy of the graph, not of the
    module, is the rollback: copying a module regenerates its code). Pass functions in
    ``graph_only`` only rewrite ``gm.graph`` and never run or read ``gm``'s generated code, so
    the code is regenerated once, before the first pass that may (a user's) and at the end,
    instead of after every pass: each regeneration costs time proportional to the graph.
    """
    backup = copy.deepcopy(gm.graph)
    work = gm
    stale = False
    if on_graph is not None:
        on_graph("partitioned", work)
    results = []
    try:
        for name, fn in passes:
            start = time.perf_counter()
            try:
                if stale and fn not in graph_only:
                    work.recompile()
                    stale = False
                value = fn(work)
                if isinstance(value, fx.GraphModule):
                    work, value = value, None
                stale = True
            except ConfigError:
                raise
            except Exception as exc:
                raise PassFailure(name, exc) from exc
            results.append(PassResult(name, time.perf_counter() - start, value))
            if on_graph is not None:
                on_graph(name, work)
        if stale:
            work.recompile()
    except BaseException:
        gm.graph = backup  # recompiles gm with the graph it came with
        raise
    return work, results
