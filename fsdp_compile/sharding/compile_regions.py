"""Compile each repeated block once: repeated bucket units as ``nested_compile_region``\\ s.

Plain tracing pays for every copy of a block: Dynamo, AOTAutograd, the partitioner and the inner
compiler each walk it. With ``regions=True`` (the default where torch supports it) every unit of
a repeated class runs its forward through ``torch.compiler.nested_compile_region``: Dynamo traces
one block and stamps the others out of that trace (torch >= 2.13), the graph holds one body every
block calls through ``invoke_subgraph``, and the body is handled once per signature downstream.

For the next block to reuse a trace, nothing it reads may name the block: inside a region a
read is ``unshard(leaf, <name within the unit>, "<region>", ...)``, read from the module itself
(:class:`RegionReads`). The pass :mod:`fsdp_compile.passes.regions` hoists these markers to the
call sites with each parameter's real name, unit and groups, so collectives are bucketed,
prefetched and resharded as without regions.

A unit is a region only when its class repeats, it holds no parameter tied to one outside it,
and gradients are synchronized (under ``no_sync`` blocks run inline: their reads carry
per-parameter accumulators); outside ``torch.compile`` a region is a plain call. A block that
returns one of its inputs as it came (T5's position bias) would make the body return an alias,
which ``invoke_subgraph`` refuses: the body returns a reference to that input instead and the
call site hands the input back. What else torch refuses, the block class runs inline for
(:class:`RegionClass`, :mod:`.region_fallback`).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only

# From how many copies of a block a region pays for its fixed cost, by compiler: Inductor
# compiles the body once; aot_eager compiles nothing, so regions pay only in deeper models
# (docs/results.md, "Compile time"). The eager compiler runs every region inline.
MIN_REGION_COPIES = {"inductor": 2, "aot_eager": 8}
# The unit a marker inside a region names: hoisting replaces it with the call site's unit.
REGION_UNIT = "<region>"


def regions_supported() -> bool:
    """Whether this torch reuses a region's trace across calls (torch >= 2.13): without that,
    a region costs more to compile than inline code."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "max_reuse_entries" in inspect.signature(region).parameters


@dataclass(eq=False)
class RegionClass:
    """The units of one block class compiled as regions: whether Dynamo still traces them as one
    (``enabled``, read by the traced forward) and, once some calls compile inline, why."""

    key: str  # module.QualifiedName of the class
    units: list[str]
    enabled: bool = True
    reason: str | None = None

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    def describe_units(self) -> str:
        shown = ", ".join(self.units[:3])
        return shown + (", ..." if len(self.units) > 3 else "")


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class RegionReads:
    """What a sharded module inside a region reads, by local name: its leaf and the marker's
    arguments relative to the unit. Identical in every block but for the leaves, which Dynamo
    reaches through the module, so a trace of one block is valid for the next."""

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
    """The block classes whose units' tensor-parallel hooks hold different ``DeviceMesh`` objects,
    which cannot be regions on torch 2.13: slicing the mesh per block (``mesh["tp"]`` in the
    loop) makes Dynamo, reusing block 0's trace for block 1, raise while guarding block 1's mesh
    through its hook ("Expecting clean index here", ``torch/_dynamo/guards.py``). Read from the
    hooks' closures and partials, the only place the mesh object is kept."""
    by_class: dict[type, set[tuple[int, ...]]] = {}
    for module in (model.get_submodule(u) for u in units if u):
        by_class.setdefault(type(module), set()).add(_hook_meshes(module))
    return {cls for cls, meshes in by_class.items() if len(meshes) > 1}


def _hook_meshes(block: nn.Module) -> tuple[int, ...]:
    """The ids of the ``DeviceMesh`` objects the forward hooks inside ``block`` hold, in order."""
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
                try:
                    contents = cell.cell_contents
                except ValueError:  # a cell not yet assigned
                    continue
                visit(contents, depth + 1)

    for module in block.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for hook in hooks.values():
                visit(hook)
    return tuple(found)


def _compile_disabled(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward", type(module).forward)
    return bool(getattr(forward, "_torchdynamo_disable", False))


def relative_marker_args(fqn: str, unit: str, unshard_args: tuple) -> tuple:
    """A read's marker arguments inside a region: the name within the unit, the region's unit
    placeholder, then the rows and the spec (equal in every block)."""
    return (fqn[len(unit) + 1:], REGION_UNIT, *unshard_args[2:])


# torch raises once a region has this many traces it could not reuse; such a block is still
# right, only slower to compile (the backend warns), so the limit is out of reach.
_MAX_REUSE_ENTRIES = 1 << 16


# Which region Dynamo traced last (a constant-result function runs at trace time), so that an
# error torch raises about a region names its class.
_LAST_TRACED: list[str | None] = [None]


@torch.compiler.assume_constant_result
def _tracing_region(key: str) -> bool:
    _LAST_TRACED[0] = key
    return True


def last_traced_region() -> str | None:
    return _LAST_TRACED[0]


def forget_traced_region() -> None:
    _LAST_TRACED[0] = None


# What a region body returns in place of an output that is one of its inputs, followed by that
# input's position among the call's tensors. No block returns a string starting with NUL.
_INPUT_REFERENCE = "\x00fsdp_compile:input:"


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


def _reference_inputs(inputs: list[torch.Tensor], output: torch.Tensor) -> torch.Tensor | str:
    for position, value in enumerate(inputs):
        if output is value:
            return f"{_INPUT_REFERENCE}{position}"
    return output


def _resolve_inputs(inputs: list[torch.Tensor], output: str) -> torch.Tensor | str:
    if output.startswith(_INPUT_REFERENCE):
        return inputs[int(output[len(_INPUT_REFERENCE):])]
    return output


def make_region_forward(cls: type, tensor_parallel: bool = False):
    """The generated unit class's forward: the original, as a region while gradients are
    synchronized and its :class:`RegionClass` is enabled (``tensor_parallel``: :func:`region_input`)."""
    original_forward = cls.forward
    key = class_key(cls)

    def body(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if tensor_parallel:
            args, kwargs = tree_map_only(torch.Tensor, region_input, (args, kwargs))
        output = original_forward(self, *args, **kwargs)
        # An output that is an input would alias it, which invoke_subgraph refuses: return
        # where it came from instead (the identity test is decided while Dynamo traces).
        return tree_map_only(torch.Tensor, functools.partial(_reference_inputs, _tensors(args, kwargs)), output)

    region = torch.compiler.nested_compile_region(body, max_reuse_entries=_MAX_REUSE_ENTRIES)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._fsdp_state
        if state.sync.accumulating or not state.region_class.enabled:
            return original_forward(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            _tracing_region(key)
        # torch.compile must capture a region whole: where it cannot, the model's call retries
        # with this class inline (sharding/region_fallback.py) and says so.
        output = region(self, *args, **kwargs)
        return tree_map_only(str, functools.partial(_resolve_inputs, _tensors(args, kwargs)), output)

    forward.__doc__ = original_forward.__doc__
    return forward


def region_input(value: torch.Tensor) -> torch.Tensor:
    """A tensor a tensor-parallel region body may hand to ``DTensor.from_local``: a copy.

    On torch 2.13 ``from_local`` of a body input traces as an in-place ``detach_`` of it, so
    ``invoke_subgraph`` functionalizes the body, where ``from_local``'s autograd.Function is
    refused; of a tensor the body made it is no input mutation. Inductor drops the copy where it
    can; the eager runtime never makes it.
    """
    return value.clone() if torch.compiler.is_compiling() else value
