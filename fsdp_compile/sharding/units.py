"""Bucket units: which module each parameter communicates with, decided when a model is sharded.

A unit is a module whose parameters form one bucket. ``bucket=`` (parsed in
:mod:`fsdp_compile.api.buckets`): ``"module"`` (default), the repeated blocks plus the rest
(:class:`_BlockFinder`); classes or a callable, each selected module, a parameter going to its
nearest selected ancestor or the root; an int, no units (a byte budget); ``"param"``, one bucket
per parameter. Units travel in each marker's ``unit`` argument, so bucketing needs only the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..api.buckets import Policy

ROOT_UNIT = ""


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# A rank holds two buckets gathered at once: two stacks holding more than this share of the
# model would keep most of it whole, so their blocks are the units instead.
_MAX_SHARE_OF_TWO = 0.5


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_composite(module: nn.Module) -> bool:
    """A layer made of layers (a block, an attention), not a leaf layer holding its own
    parameters (two embeddings or q/k/v projections side by side are not blocks)."""
    return any(_holds_parameters(child) for child in module.children())


class _BlockFinder:
    """The ``"module"`` policy: the outermost repeated blocks, wherever the model holds them.

    Siblings repeat when two or more have one class: members of a container (``nn.ModuleList``,
    ``nn.Sequential``, ``nn.ModuleDict``), or composite attributes (``self.block0``,
    ``self.block1``). A repeated sibling is a block (its experts are part of it) unless it is a
    *stage* grouping composite blocks, whose blocks are the units then: a container of them, or
    a stack (blocks in containers and beside them only leaf layers: T5's encoder and decoder).

    Structure alone cannot tell a stack from a block of experts beside a norm and a router: the
    sizes do. T5's two stacks are each near half of the model; a mixture of experts has many
    small blocks. So repeated stacks are stages only when two hold over half the parameters.
    """

    def __init__(self, model: nn.Module) -> None:
        # Shared submodules count where named_modules() first meets them, as their parameters do.
        self.name_of: dict[int, str] = {}
        for name, module in model.named_modules():
            self.name_of.setdefault(id(module), name)
        self.modules = dict(model.named_modules())
        # Parameter elements under each module name, each parameter counted once.
        self.numel: dict[str, int] = {}
        for name, param in model.named_parameters():
            parts = name.split(".")[:-1]
            for end in range(len(parts) + 1):
                prefix = ".".join(parts[:end])
                self.numel[prefix] = self.numel.get(prefix, 0) + param.numel()

    def blocks(self, module: nn.Module, prefix: str) -> list[str]:
        children = []
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if self.name_of.get(id(child)) == path and _holds_parameters(child):
                children.append((path, child))
        in_container = isinstance(module, _CONTAINERS)
        by_class: dict[type, list[str]] = {}
        for path, child in children:
            if in_container or (_is_composite(child) and not isinstance(child, _CONTAINERS)):
                by_class.setdefault(type(child), []).append(path)
        siblings = {path: paths for paths in by_class.values() if len(paths) >= 2 for path in paths}
        found = []
        for path, child in children:
            inner = self.blocks(child, path)
            if path in siblings and not self._is_stage(child, path, inner, siblings[path]):
                found.append(path)
            else:
                found += inner
        return found

    def _is_stage(self, module: nn.Module, path: str, inner: list[str], siblings: list[str]) -> bool:
        if not inner or not all(_is_composite(self.modules[name]) for name in inner):
            return False
        if isinstance(module, _CONTAINERS):
            return True
        largest = sorted((self.numel.get(name, 0) for name in siblings), reverse=True)[:2]
        if sum(largest) <= _MAX_SHARE_OF_TWO * self.numel.get("", 0):
            return False  # small enough to be one bucket each: a block (of experts)
        # Two attentions side by side (a decoder layer's self- and cross-attention) are not a
        # stack, and neither is a block whose experts sit beside its attention.
        if not all(isinstance(self.modules[name.rpartition(".")[0]], _CONTAINERS) for name in inner):
            return False
        for name, sub in module.named_modules(prefix=path):
            if name == path or self.name_of.get(id(sub)) != name:
                continue
            inside_block = any(name == b or name.startswith(b + ".") for b in inner)
            on_path_to_block = any(b.startswith(name + ".") for b in inner)
            if not inside_block and not on_path_to_block and _is_composite(sub):
                return False
        return True


def _repeated_blocks(model: nn.Module) -> set[str]:
    return set(_BlockFinder(model).blocks(model, ""))


def repeated_classes(model: nn.Module, within: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Names of the classes with parameters that occur twice or more among the modules ``within``
    selects (containers aside), composite ones first: what a class-set policy could name."""
    def user_class(module: nn.Module) -> type:
        # Once sharded, a module's class is a generated subclass; the user knows the original.
        return getattr(type(module), "_fsdp_original_class", type(module))

    counts: dict[type, int] = {}
    for name, module in model.named_modules():
        if name and within(name) and not isinstance(module, _CONTAINERS) and _holds_parameters(module):
            counts[user_class(module)] = counts.get(user_class(module), 0) + 1
    repeated = [cls for cls, n in counts.items() if n >= 2]
    composite = {user_class(m) for m in model.modules() if user_class(m) in repeated and _is_composite(m)}
    first = [cls.__name__ for cls in repeated if cls in composite]
    return first + [cls.__name__ for cls in repeated if cls not in composite]


def unit_modules(model: nn.Module, policy: Policy) -> set[str]:
    """Names of the modules that head a bucket under ``policy`` (the root is implicit)."""
    if policy.kind == "module":
        return _repeated_blocks(model)
    if not policy.uses_units:
        return set()
    select = (lambda m: isinstance(m, policy.classes)) if policy.kind == "classes" else policy.predicate
    chosen = {n for n, m in model.named_modules() if select(m)} - {ROOT_UNIT}
    if not chosen:
        classes = repeated_classes(model)
        known = (f"its repeated module classes are {', '.join(classes)}" if classes
                 else "it repeats no module class, so a size in bytes (bucket=<int>) fits it better")
        raise ValueError(f"bucket={policy.describe()} matches no module of {type(model).__name__} (other than the "
                         f"root); {known}. Name classes that occur in the model, a callable that selects some of "
                         "its submodules, or keep the default bucket='module'")
    return chosen


def unit_of(module_name: str, units: set[str]) -> str:
    """The nearest unit at or above ``module_name`` (the root unit if none)."""
    parts = module_name.split(".") if module_name else []
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in units:
            return candidate
    return ROOT_UNIT
