"""Compile each repeated block once, as a ``nested_compile_region``; blocks torch refuses run inline.

Dynamo traces one block of a repeated class and stamps the others out of that trace, so no read
in a region may name the block: it is ``unshard(leaf, <name within the unit>, "<region>", ...)``
(:class:`RegionReads`), which :mod:`fsdp_compile.passes.regions` hoists to the call sites.
A model that trains with ``regions=False`` must train with the defaults: where Dynamo refuses a
block as a region, the root's ``__call__`` (:func:`region_fallback_call`) turns that class off
and calls again, with one warning per class, unless part of the step already ran (its side
effects would repeat) or, under ``strict=True``, the error is not one of torch's refusals.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only

# From how many copies a region pays for its fixed cost, by compiler (docs/results.md, "Compile
# time"); aot_eager compiles nothing, so only deeper models gain. Eager runs regions inline.
MIN_REGION_COPIES = {"inductor": 2, "aot_eager": 8}
# The unit a marker inside a region names: hoisting replaces it with the call site's unit.
REGION_UNIT = "<region>"


def regions_supported() -> bool:
    """Whether this torch reuses a region's trace across calls (else regions cost compile time)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "max_reuse_entries" in inspect.signature(region).parameters


@dataclass(eq=False)
class RegionClass:
    """One block class's region units: whether Dynamo still traces them as one, and if not, why."""

    key: str  # module.QualifiedName of the class
    units: list[str]
    enabled: bool = True
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def first_names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


@dataclass
class RegionReads:
    """What a module inside a region reads, by local name: identical in every block but for the
    leaves, which Dynamo reaches through the module, so a trace of one block is valid for the next."""

    leaves: dict[str, nn.Parameter]
    args: dict[str, tuple]
    sync: Any  # the backend's GradientSync: regions only while gradients are synchronized
    region_class: RegionClass  # the unit's class: regions only while it is enabled


def region_copies(regions: bool | int, compiler: str) -> int | None:
    """From how many copies a block class is a region, for ``regions=`` and ``compiler=``; None:
    no regions (``regions=False``, a torch without region reuse, the eager compiler)."""
    if regions is False or not regions_supported():
        return None
    if regions is True:
        return MIN_REGION_COPIES.get(compiler)
    return regions


def region_units(model: nn.Module, units: Iterable[str], tied_units: Iterable[str], min_copies: int = 2) -> set[str]:
    """The units compiled as regions: of a class heading ``min_copies`` units or more, holding no
    tied parameter (gathered once, at the root), and with nothing ``torch.compiler.disable``'d
    inside (a region must be captured whole: torch raises instead of breaking its graph)."""
    units = [u for u in units if u]
    classes = Counter(type(model.get_submodule(u)) for u in units)
    tied = set(tied_units)
    return {u for u in units if classes[type(model.get_submodule(u))] >= max(2, min_copies) and u not in tied
            and not any(_compile_disabled(m) for m in model.get_submodule(u).modules())}


def tp_mesh_split_classes(model: nn.Module, units: Iterable[str]) -> set[type]:
    """The block classes whose TP hooks hold different ``DeviceMesh`` objects (``mesh["tp"]`` sliced
    per block): torch 2.13 raises guarding block 1's mesh on block 0's trace ("Expecting clean
    index here"). Read from the hooks' closures and partials, where the mesh object is kept."""
    by_class: dict[type, set[tuple[int, ...]]] = {}
    for module in (model.get_submodule(u) for u in units if u):
        by_class.setdefault(type(module), set()).add(_hook_meshes(module))
    return {cls for cls, meshes in by_class.items() if len(meshes) > 1}


def _hook_meshes(block: nn.Module) -> tuple[int, ...]:
    from torch.distributed.device_mesh import DeviceMesh

    found: list[int] = []

    def visit(value: Any, depth: int = 0) -> None:
        if isinstance(value, DeviceMesh):
            found.append(id(value))
        elif depth < 3 and isinstance(value, functools.partial):
            for arg in (value.func, *value.args, *value.keywords.values()):
                visit(arg, depth + 1)
        elif depth < 3 and callable(value):
            for cell in getattr(value, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # a cell not yet assigned
                    visit(cell.cell_contents, depth + 1)

    for module in block.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook in hooks.values():
                visit(hook)
    return tuple(found)


def _compile_disabled(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward", type(module).forward)
    return bool(getattr(forward, "_torchdynamo_disable", False))


def relative_marker_args(fqn: str, unit: str, unshard_args: tuple) -> tuple:
    """A read's marker arguments inside a region (the name within the unit, equal in every block)."""
    return (fqn[len(unit) + 1:], REGION_UNIT, *unshard_args[2:])


# torch raises past this many unreusable traces; such a block is only slower to compile (warned).
_MAX_REUSE_ENTRIES = 1 << 16


# Which region Dynamo traced last (set at trace time), so an error about a region names its class.
_LAST_TRACED: list[str | None] = [None]


@torch.compiler.assume_constant_result
def _tracing_region(key: str) -> bool:
    _LAST_TRACED[0] = key
    return True


# A body's output that is its input at this position among the call's tensors (no block returns NUL).
_INPUT_REFERENCE = "\x00fsdp_compile:input:"


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _reference_inputs(inputs: list[torch.Tensor], output: torch.Tensor) -> torch.Tensor | str:
    return next((f"{_INPUT_REFERENCE}{position}" for position, value in enumerate(inputs) if output is value), output)


def _resolve_inputs(inputs: list[torch.Tensor], output: str) -> torch.Tensor | str:
    return inputs[int(output[len(_INPUT_REFERENCE):])] if output.startswith(_INPUT_REFERENCE) else output


def make_region_forward(cls: type, tensor_parallel: bool = False):
    """The unit class's forward: a region while gradients sync and its class is enabled."""
    original_forward = cls.forward
    key = class_key(cls)

    def body(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if tensor_parallel:
            args, kwargs = tree_map_only(torch.Tensor, region_input, (args, kwargs))
        output = original_forward(self, *args, **kwargs)
        # invoke_subgraph refuses an output aliasing an input (T5's position bias): say which input.
        return tree_map_only(torch.Tensor, functools.partial(_reference_inputs, _tensors(args, kwargs)), output)

    region = torch.compiler.nested_compile_region(body, max_reuse_entries=_MAX_REUSE_ENTRIES)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state
        if state.sync.accumulating or not state.region_class.enabled:
            return original_forward(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            _tracing_region(key)
        # Where torch.compile cannot capture a region whole, the model's call retries it inline.
        output = region(self, *args, **kwargs)
        return tree_map_only(str, functools.partial(_resolve_inputs, _tensors(args, kwargs)), output)

    forward.__doc__ = original_forward.__doc__
    return forward


def region_input(value: torch.Tensor) -> torch.Tensor:
    """A copy a TP region body may hand to ``DTensor.from_local``: torch 2.13 traces ``from_local``
    of a body input as an in-place ``detach_``, which makes the body refused. Inductor drops it."""
    return value.clone() if torch.compiler.is_compiling() else value


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
# What Dynamo raises when it cannot capture a region's body whole, matched by name.
_UNCAPTURED = "UncapturedHigherOrderOpError"


def refused_by_torch(error: BaseException) -> bool:
    """Whether ``error`` is torch refusing a block as a region by its rules: what inlining gets past."""
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
    if len(quoted) > 160:
        quoted = quoted[:160].rsplit(" ", 1)[0] + " ..."
    cause = next((words for sign, words in _CAUSES if sign in text), None)
    raised = f"{type(error).__name__}: {quoted}" if quoted else type(error).__name__
    return f"{cause} ({raised})" if cause else raised


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
        """A pass inlined ``block_class``'s calls: say so once. The class stays on for Dynamo."""
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

    def warn(self, region_class: RegionClass) -> None:
        """One warning per class (on rank 0; every rank logs it)."""
        if region_class.key in self.warned:
            return
        self.warned.add(region_class.key)
        message = (f"fsdp_compile: the {region_class.name} blocks ({first_names(region_class.units)}) compile "
                   f"inline, not as one region: {region_class.reason}. Inline they train as with "
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
    """One model's region classes and the steps of :func:`region_fallback_call` (Dynamo off)."""

    classes: list[RegionClass]
    fallback: RegionFallback

    @torch.compiler.disable
    def begin(self) -> _Attempt:
        _LAST_TRACED[0] = None
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
        traced = _LAST_TRACED[0]
        for region_class in [c for c in enabled if c.key == traced] or enabled:
            region_class.enabled = False
            region_class.reason = ("torch.compile could not capture one as a nested_compile_region: "
                                   + describe_failure(error))
            attempt.turned_off.append(region_class)
        _LAST_TRACED[0] = None

    @torch.compiler.disable
    def succeeded(self, attempt: _Attempt) -> None:
        for region_class in attempt.turned_off:
            self.fallback.warn(region_class)

    def _ran_before_failing(self, error: BaseException, enabled: list[RegionClass], attempt: _Attempt) -> None:
        """A compile failed after part of the call ran: not retried; the class traced last goes off."""
        self.succeeded(attempt)
        traced = next((c for c in enabled if c.key == _LAST_TRACED[0]), None)
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
        """strict=True and an error torch's rules do not explain: raised as it is."""
        self.succeeded(attempt)
        traced = [c for c in enabled if c.key == _LAST_TRACED[0]] or enabled
        _LAST_TRACED[0] = None
        names = ", ".join(c.name for c in traced)
        _add_note(error, f"fsdp_compile: strict=True: this error was raised while torch.compile compiled a model "
                         f"with regions (the {names} blocks as regions); it is not one of torch's refusals of a "
                         "region (a graph break inside the block, an alias or in-place write it does not allow), "
                         "so the step was not retried with those blocks inline. strict=False retries it, with a "
                         "warning; regions=False compiles every block inline from the start.")

    def _no_region_to_blame(self, error: BaseException, attempt: _Attempt) -> None:
        """Failed with every class inline too: the classes go back on and the first error is raised."""
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
    """Whether ``error``, or one it was raised from or during (Dynamo wraps what a backend raises),
    is one of this package's errors."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        if type(current).__module__.split(".")[0] == __name__.split(".")[0]:
            return True
        seen.add(id(current))
        stack += [current.__cause__, current.__context__, getattr(current, "inner_exception", None)]
    return False


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _top_frame_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run as Python when it is the frame ``torch.compile`` starts at, traced when a compiled
    function calls it: ``disable(fn, recursive=False)`` would break a compiled caller's graph."""
    from torch._dynamo import external_utils

    wrap = getattr(external_utils, "get_nonrecursive_disable_wrapper", None)
    if wrap is None:  # a torch without it: still retried; a compiled caller breaks its graph here
        return torch.compiler.disable(fn, recursive=False)
    return wrap(fn)


def region_fallback_call(cls: type) -> Callable[..., Any]:
    """The root class's ``__call__``, retried with the regions torch refused inline (the loop is in
    the frame ``torch.compile`` skips, so what compiling the model raises is caught here)."""
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
