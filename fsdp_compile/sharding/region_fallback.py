"""Blocks torch cannot compile as a region run inline instead: the defaults never fail because of regions.

Regions only shorten compilation, so a model that trains with ``regions=False`` must train with
the defaults too. Torch refuses some blocks as regions (its rules: docs/design.md) at two moments:

* **While AOTAutograd traces** (a block updating a buffer in place while training): the pass
  ``inline_mutating_regions`` (passes/regions.py) inlines those calls before AOTAutograd runs.
* **While Dynamo traces** (a graph break inside the block, a tensor kept outside it that aliases
  an input, an output that is a view of an input): the compile raises before any of the step
  ran. The root's ``__call__`` (:func:`region_fallback_call`) catches it, turns the class off
  (the class Dynamo traced last, else every class of the model) and calls again, inline for
  that class; one warning per class says which, and why.

A compile that fails after part of the step ran is not retried (its side effects would repeat):
the error carries a note, and the class is off for later calls. Only torch's refusals
(:func:`refused_by_torch`) are what the retry exists for; any other error may be a bug that
inlining would hide: ``strict=True`` raises it with a note, otherwise it is retried and quoted.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .compile_regions import RegionClass, class_key, forget_traced_region, last_traced_region

log = logging.getLogger("fsdp_compile")

# Plain words for the rules torch enforces on region bodies, matched on the message it raises.
_RULES = (
    ("intermediate tensor", "the block keeps a tensor that aliases one of its inputs in an object that outlives "
                            "the call (a buffer updated in place and assigned back, a KV cache)"),
    ("Encountered aliasing", "the block returns a view of one of its inputs"),
    ("does not currently support training with in-place", "the block updates a buffer or an input in place "
                                                           "while training (BatchNorm's running statistics)"),
)
_GRAPH_BREAK = "a graph break inside the block (a torch.compiler.disable'd call, a data-dependent branch)"
_CAUSES = (*_RULES, ("graph break", _GRAPH_BREAK), ("Graph break", _GRAPH_BREAK))
# What Dynamo raises when it cannot capture a region's body whole. Matched by name, not by the
# words "graph break": its message heads any error inside the body with "Got graph break/error".
_UNCAPTURED = "UncapturedHigherOrderOpError"


def refused_by_torch(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a block as a region by one of its rules (a graph break
    inside the body, an alias or in-place write it does not allow): what inlining gets past."""
    # The errors it was raised from, not during: an error raised while handling a refusal is not one.
    cause, seen = error, set()
    while cause is not None and id(cause) not in seen:
        if type(cause).__name__ == _UNCAPTURED:
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    text = str(error)
    return any(sign in text for sign, _ in _RULES)


def describe_failure(error: BaseException) -> str:
    """Why torch refused a region: plain words where its message says, and torch's own words."""
    text = str(error)
    lines = [line.strip() for line in text.split("Got graph break/error:")[-1].splitlines() if line.strip()]
    quoted = lines[0] if lines else ""
    if len(quoted) > _QUOTED_CHARS:
        quoted = quoted[:_QUOTED_CHARS].rsplit(" ", 1)[0] + " ..."
    cause = next((words for sign, words in _CAUSES if sign in text), None)
    raised = f"{type(error).__name__}: {quoted}" if quoted else type(error).__name__
    return f"{cause} ({raised})" if cause else raised


_QUOTED_CHARS = 160


@dataclass(eq=False)
class RegionFallback:
    """One backend's region classes, by key, and what the fallback needs to know."""

    classes: dict[str, RegionClass] = field(default_factory=dict)
    graph_runs: int = 0  # calls of this backend's compiled graphs (the step guard counts them)
    warned: set[str] = field(default_factory=set)
    strict: bool = False  # the backend's strict=: raise what torch's rules do not explain (refused_by_torch)

    def region_class(self, cls: type, units: list[str]) -> RegionClass:
        """The switch of ``cls``'s regions, shared by every model this backend shards."""
        region_class = self.classes.setdefault(class_key(cls), RegionClass(class_key(cls), []))
        region_class.units.extend(u for u in units if u not in region_class.units)
        return region_class

    def inlined(self) -> list[RegionClass]:
        """The classes whose blocks compile inline (all calls, or in graphs that train)."""
        return [c for c in self.classes.values() if c.reason is not None]

    def inlined_by_pass(self, block_class: type | None, reason: str) -> None:
        """A captured graph's pass inlined ``block_class``'s calls: say so once. The class stays on
        for Dynamo (every compiled graph guards on it); each graph that needs it inlines again."""
        region_class = self.classes.get(class_key(block_class)) if block_class is not None else None
        if region_class is None:
            return
        if region_class.reason is None:
            region_class.reason = reason
        self.warn(region_class)

    def turn_off(self, region_class: RegionClass, reason: str) -> None:
        """Compile ``region_class``'s blocks inline from now on, and say so once."""
        region_class.enabled = False
        region_class.reason = reason
        self.warn(region_class)

    def warn(self, region_class: RegionClass, reason: str | None = None) -> None:
        """One warning per class (on rank 0; every rank logs it)."""
        if region_class.key in self.warned:
            return
        self.warned.add(region_class.key)
        message = (f"fsdp_compile: the {region_class.name} blocks ({region_class.describe_units()}) compile "
                   f"inline, not as one region: {reason or region_class.reason}. Inline they train as with "
                   "regions=False; only compile time differs. Pass regions=False to compile every block inline "
                   "without trying.")
        log.warning(message)
        if not (dist.is_initialized() and dist.get_rank() != 0):
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())


@dataclass(eq=False)
class _Attempt:
    """One call of the model, across its retries."""

    graph_runs: int  # the backend's count when the call began
    turned_off: list[RegionClass] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


@dataclass(eq=False)
class ModelRegions:
    """The region classes of one sharded model (its root's state holds this), and the steps of
    the call that retries without the regions torch refused (:func:`region_fallback_call`);
    Dynamo off, as every frame the skipped frame calls would otherwise be compiled."""

    classes: list[RegionClass]
    fallback: RegionFallback

    @torch.compiler.disable
    def begin(self) -> _Attempt:
        forget_traced_region()
        return _Attempt(self.fallback.graph_runs)

    @torch.compiler.disable
    def failed(self, attempt: _Attempt, error: Exception) -> None:
        """The call raised ``error``: turn the class to blame off for another try, or raise."""
        if _raised_by_fsdp_compile(error):  # a named error of ours (strict=True, bad options): the user's to see
            self.succeeded(attempt)
            raise error
        enabled = [c for c in self.classes if c.enabled]
        if self.fallback.graph_runs != attempt.graph_runs:
            self._ran_before_failing(error, enabled, attempt)
            raise error
        if not enabled:
            self._no_region_to_blame(error, attempt)
        if self.fallback.strict and not refused_by_torch(error):
            self._not_retried(error, enabled, attempt)
            raise error
        attempt.errors.append(error)
        traced = last_traced_region()
        for region_class in [c for c in enabled if c.key == traced] or enabled:
            region_class.enabled = False
            region_class.reason = ("torch.compile could not capture one as a nested_compile_region: "
                                   + describe_failure(error))
            attempt.turned_off.append(region_class)
        forget_traced_region()

    @torch.compiler.disable
    def succeeded(self, attempt: _Attempt) -> None:
        for region_class in attempt.turned_off:
            self.fallback.warn(region_class)

    def _ran_before_failing(self, error: BaseException, enabled: list[RegionClass], attempt: _Attempt) -> None:
        """A compile failed after part of the call ran: not retried. The class traced last is
        turned off for the next calls (earlier tries' stay off), and the error says so."""
        self.succeeded(attempt)
        traced = next((c for c in enabled if c.key == last_traced_region()), None)
        if traced is None:
            return
        if self.fallback.strict and not refused_by_torch(error):
            _add_note(error, f"fsdp_compile: strict=True: this error was raised while torch.compile traced the "
                             f"{traced.name} blocks as one region, after part of this step had run; it is not one "
                             "of torch's refusals of a region, so those blocks stay regions for later calls. "
                             "strict=False compiles them inline from the next call, with a warning.")
            return
        self.fallback.turn_off(traced, "torch.compile raised while tracing it as a nested_compile_region, "
                                       "after part of the step had run: " + describe_failure(error))
        _add_note(error, f"fsdp_compile: this error was raised while torch.compile traced the {traced.name} "
                         "blocks as one region, after part of this step had run (a graph break before them), so "
                         "the step was not retried; later calls compile those blocks inline. Pass regions=False "
                         "to compile every block inline from the start.")

    def _not_retried(self, error: BaseException, enabled: list[RegionClass], attempt: _Attempt) -> None:
        """strict=True and an error torch's rules do not explain: raised as it is, each class as
        it was (those an earlier try turned off stay off, and are warned of)."""
        self.succeeded(attempt)
        traced = [c for c in enabled if c.key == last_traced_region()] or enabled
        forget_traced_region()
        names = ", ".join(c.name for c in traced)
        _add_note(error, f"fsdp_compile: strict=True: this error was raised while torch.compile compiled a model "
                         f"with regions (the {names} blocks as regions); it is not one of torch's refusals of a "
                         "region (a graph break inside the block, an alias or in-place write it does not allow), "
                         "so the step was not retried with those blocks inline. strict=False retries it, with a "
                         "warning; regions=False compiles every block inline from the start.")

    def _no_region_to_blame(self, error: BaseException, attempt: _Attempt) -> None:
        """Compiling failed with every class inline too: regions were not the cause. The classes
        go back on and the first error is raised, the last one noted beside it."""
        for region_class in attempt.turned_off:
            region_class.enabled = True
            region_class.reason = None
        if not attempt.errors:
            raise error
        _add_note(attempt.errors[0], "fsdp_compile: compiling with every block inline (as regions=False) "
                                     "failed too: " + describe_failure(error))
        raise attempt.errors[0]


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this package and torch: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _raised_by_fsdp_compile(error: BaseException) -> bool:
    """Whether ``error``, or one it was raised from or during, is one of this package's errors."""
    return any(type(e).__module__.split(".")[0] == __name__.split(".")[0] for e in _chain(error))


def _chain(error: BaseException) -> list[BaseException]:
    # Dynamo wraps what a backend raises.
    chain: dict[int, BaseException] = {}
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in chain:
            continue
        chain[id(current)] = current
        stack += [current.__cause__, current.__context__, getattr(current, "inner_exception", None)]
    return list(chain.values())


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _top_frame_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run as Python when it is the frame ``torch.compile`` starts at (to catch what
    compiling the frames it calls raises), traced like any code when a compiled function calls
    it (no graph break, no retry: that compile is the user's). ``torch.compiler.disable(fn,
    recursive=False)`` gives the first half, but its wrapper is marked disabled, which breaks
    the graph of a compiled caller; the same wrapper unmarked is inlined there instead."""
    from torch._dynamo import external_utils

    wrap = getattr(external_utils, "get_nonrecursive_disable_wrapper", None)
    if wrap is None:  # a torch without it: still retried; a compiled caller breaks its graph here
        return torch.compiler.disable(fn, recursive=False)
    return wrap(fn)


def region_fallback_call(cls: type) -> Callable[..., Any]:
    """The root class's ``__call__``: ``cls``'s, retried with the regions torch refused inline.
    The loop is in the frame ``torch.compile`` skips, so what compiling the model inside
    ``original_call`` raises is caught here."""
    original_call = cls.__call__

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside a function the user compiles
            return original_call(self, *args, **kwargs)
        regions = self._fsdp_state.regions
        attempt = regions.begin()
        while True:
            try:
                result = original_call(self, *args, **kwargs)
            except Exception as error:
                regions.failed(attempt, error)  # raises unless a class was turned off to try again
                continue
            regions.succeeded(attempt)
            return result

    return _top_frame_only(call)
