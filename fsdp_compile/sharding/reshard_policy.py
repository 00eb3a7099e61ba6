"""``reshard_after_forward=``: what each bucket unit keeps of its gathered parameters from forward to backward.

As FSDP2's, per unit: ``True`` reshards to the shard group, ``False`` keeps the gathered
parameters, ``n`` keeps a shard over groups of ``n`` consecutive ranks (ZeRO++'s hpZ: backward
gathers inside a node). One value, or ``{unit name | module | module class: value}``. Each unit
resolves to ``reshard_to``, the ranks it reshards to (``shard_size``, 1, or ``n``); the
reduction is the same in every case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ..api import ConfigError, ReshardOption
from .groups import Topology
from .units import ROOT_UNIT


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
        raise ConfigError(
            f"reshard_after_forward={value} for unit {label!r}: a unit reshards to groups of n consecutive ranks "
            f"of its shard group, so n must divide the shard group's {shard_size} ranks and be smaller than it "
            f"(True reshards to all {shard_size}); use a divisor of {shard_size} between 2 and {shard_size // 2}")
    return value


class ReshardGroups:
    """This rank's group of ``n`` consecutive ranks of its shard group, by ``n``; every rank creates
    every group, in the same order (``new_group`` is collective)."""

    def __init__(self) -> None:
        self._groups: dict[int, dist.ProcessGroup] = {}

    def groups(self) -> dict[int, dist.ProcessGroup]:
        """This rank's group of each size made so far."""
        return dict(self._groups)

    def group(self, topology: Topology, n: int, timeout: Any = None) -> dist.ProcessGroup:
        if n not in self._groups:
            rows = topology.mesh.mesh.reshape(-1, topology.shard_size).tolist()
            me = dist.get_rank()
            for row in rows:
                for start in range(0, len(row), n):
                    ranks = row[start:start + n]
                    group = dist.new_group(ranks, timeout=timeout)
                    if me in ranks:
                        self._groups[n] = group
        return self._groups[n]
