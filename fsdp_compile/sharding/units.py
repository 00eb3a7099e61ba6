"""Bucket units: which module each parameter communicates with, and what each unit keeps of its
gathered parameters from forward to backward, decided at shard time.

``bucket="module"`` (default) makes the repeated blocks units, plus the root (:class:`_BlockFinder`);
classes or a callable make each selected module one; an int or ``"param"`` make none. Units travel
in each marker's ``unit`` argument, so bucketing needs only the graph. ``reshard_after_forward=``
(per unit, or ``{unit name | module | class: value}``) resolves to ``reshard_to``, the ranks a unit
reshards to: all of the shard group, 1 (keep), or ``n`` consecutive ranks (ZeRO++'s hpZ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ..api import ConfigError, ReshardOption
from ..api.buckets import Policy
from .groups import Topology, new_groups

ROOT_UNIT = ""


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# Two buckets are gathered at once: two stacks over this share would keep most of the model whole.
_MAX_SHARE_OF_TWO = 0.5


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_composite(module: nn.Module) -> bool:
    """A layer made of layers (a block, an attention), not a leaf layer (q/k/v projections)."""
    return any(_holds_parameters(child) for child in module.children())


class _BlockFinder:
    """The ``"module"`` policy: the outermost repeated blocks, wherever the model holds them.

    Siblings repeat when two or more (container members, composite attributes) have one class. One
    is a block unless it is a *stage* whose composite blocks are the units (T5's encoder, decoder);
    a stack is a stage, not a block of experts, only when two hold over half the parameters."""

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
        paths = ((f"{prefix}.{name}" if prefix else name, child) for name, child in module.named_children())
        children = [(path, child) for path, child in paths if self.name_of.get(id(child)) == path
                    and _holds_parameters(child)]
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
    """The repeated classes with parameters ``within`` selects, composite first: what a policy could name."""
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
    return next((u for u in (".".join(parts[:end]) for end in range(len(parts), 0, -1)) if u in units), ROOT_UNIT)


def describe_reshard_option(option: ReshardOption, model: nn.Module | None = None) -> str:
    """The option, spelled alike on every rank (modules by name, classes by qualified name)."""
    if not isinstance(option, Mapping):
        return repr(option)
    names = {m: n for n, m in model.named_modules()} if model is not None else {}

    def key(k: Any) -> str:
        if isinstance(k, nn.Module):
            return names.get(k, type(k).__qualname__)
        return k.__qualname__ if isinstance(k, type) else repr(k)
    return "{" + ", ".join(f"{key(k)}: {v!r}" for k, v in option.items()) + "}"


def resolve_reshard(option: ReshardOption, model: nn.Module, units: Iterable[str],
                    topology: Topology) -> dict[str, int]:
    """Each unit's ``reshard_to`` (see the module docstring); bad keys and sizes are named."""
    shard_size = topology.shard_size
    default = shard_size if topology.strategy.reshard_after_forward else 1
    units = sorted(set(units) | {ROOT_UNIT})
    chosen = dict.fromkeys(units, default)
    given: dict[str, bool | int] = {}
    if isinstance(option, Mapping):
        for key, value in option.items():
            for unit in _units_of(key, model, units):
                given[unit] = value
    elif option is not None:
        given = dict.fromkeys(units, option)
    for unit, value in given.items():
        chosen[unit] = _reshard_to(unit, value, shard_size)
    return chosen


def _units_of(key: Any, model: nn.Module, units: list[str]) -> list[str]:
    shown = ", ".join(u or "<root>" for u in units)
    if isinstance(key, str):
        unit = ROOT_UNIT if key == "<root>" else key
        if unit not in units:
            raise ConfigError(f"reshard_after_forward= names {key!r}, which is not a bucket unit of the sharded model; "
                              f"units are: {shown}")
        return [unit]
    if isinstance(key, nn.Module):
        name = next((n for n, m in model.named_modules() if m is key), None)
        if name is None or name not in units:
            what = "not part of the model" if name is None else f"module {name!r}, which is not a bucket unit"
            raise ConfigError(f"reshard_after_forward= names a {type(key).__name__} that is {what}; units are: {shown}")
        return [name]
    matched = [u for u in units if isinstance(model.get_submodule(u), key)]
    if not matched:
        raise ConfigError(f"reshard_after_forward= names the class {key.__qualname__}, of which no bucket unit is an "
                          f"instance; units are: {shown}")
    return matched


def _reshard_to(unit: str, value: bool | int, shard_size: int) -> int:
    if isinstance(value, bool):
        return shard_size if value else 1
    if shard_size % value or value >= shard_size:
        label = unit or "<root>"
        raise ConfigError(f"reshard_after_forward={value} for unit {label!r}: a unit reshards to groups of n "
                          f"consecutive ranks of its shard group, so n must divide the shard group's {shard_size} "
                          f"ranks and be smaller than it (True reshards to all {shard_size}); use a divisor of "
                          f"{shard_size} between 2 and {shard_size // 2}")
    return value


class ReshardGroups:
    """This rank's group of ``n`` consecutive ranks of its shard group, by ``n``."""

    def __init__(self) -> None:
        self._groups: dict[int, dist.ProcessGroup] = {}

    def groups(self) -> dict[int, dist.ProcessGroup]:
        """This rank's group of each size made so far."""
        return dict(self._groups)

    def group(self, topology: Topology, n: int, timeout: Any = None) -> dist.ProcessGroup:
        if n not in self._groups:
            rows = topology.mesh.mesh.reshape(-1, topology.shard_size).tolist()
            self._groups[n] = new_groups([row[i:i + n] for row in rows for i in range(0, len(row), n)], timeout)
        return self._groups[n]
