"""Big-model initialization: materialize a meta-device model unit by unit while sharding it.

Modules run in post-order (as ``model.apply``), each allocating its meta tensors and running
``init_fn`` or ``reset_parameters()``; at a unit's head, each parameter whose owners all ran is cut
to this rank's shard and released, so a rank never holds the whole model (the draws are unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .units import unit_of

InitFn = Callable[[nn.Module], None]
# (the full tensor, the meta parameter it replaces) -> (this rank's shard, whether split on dim 0)
ShardFn = Callable[[torch.Tensor, nn.Parameter], tuple[torch.Tensor, bool]]


@dataclass
class Materialized:
    """Shards of the meta parameters (by ``id`` of the meta parameter) and what it cost."""

    shards: dict[int, tuple[torch.Tensor, bool]]
    peak_full_bytes: int  # most bytes of full (unsharded) parameters held at once


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", model)
    return order


def materialize(model: nn.Module, units: set[str], device: torch.device, shard: ShardFn,
                init_fn: InitFn | None = None) -> Materialized:
    """Initialize ``model``'s meta tensors unit by unit; returns the parameters' shards (buffers stay whole)."""
    order = _post_order(model)
    names = {id(m): n for n, m in order}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in order:
        for pname, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                owners.setdefault(id(p), []).append((module, pname))

    full: dict[int, nn.Parameter] = {}       # meta id -> materialized full parameter
    meta: dict[int, nn.Parameter] = {}       # meta id -> the meta parameter (kept registered)
    written_at: dict[int, int] = {}          # meta id -> version right after allocation
    initialized: set[int] = set()            # ids of modules whose initializer ran
    sharded: dict[int, tuple[torch.Tensor, bool]] = {}
    sharded_versions: dict[int, int] = {}
    fresh_buffers: list[tuple[str, str, torch.Tensor, int]] = []
    completed: set[str] = set()
    held = peak = 0

    for name, module in order:
        own_meta = [(pname, p) for pname, p in module._parameters.items() if p is not None and p.device.type == "meta"]
        for _pname, p in own_meta:
            if id(p) not in full:
                # A TP (DTensor) parameter is initialized whole (the draws before its TP plan).
                empty = (torch.empty(p.shape, dtype=p.dtype, device=device) if isinstance(p, DTensor)
                         else torch.empty_like(p, device=device))
                value = nn.Parameter(empty, requires_grad=p.requires_grad)
                full[id(p)], meta[id(p)], written_at[id(p)] = value, p, value._version
                held += value.nbytes
                for owner, owner_name in owners[id(p)]:
                    owner._parameters[owner_name] = value
        own_meta_buffers = [bname for bname, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        for bname in own_meta_buffers:
            value = torch.empty_like(module._buffers[bname], device=device)
            module._buffers[bname] = value
            fresh_buffers.append((name, bname, value, value._version))
        peak = max(peak, held)

        if init_fn is not None:
            init_fn(module)
        elif own_meta or own_meta_buffers:
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                what = f"module {name or '<root>'!r} ({type(module).__name__})"
                raise ValueError(f"{what} has parameters or buffers on the meta device and no reset_parameters(); "
                                 "pass init_fn= to shard() to initialize them")
            reset()
        initialized.add(id(module))
        for key, version in sharded_versions.items():
            if meta[key]._version != version:
                fqn = _fqn(owners[key][0], names)
                raise ValueError(f"initializing module {name or '<root>'!r} wrote parameter {fqn!r}, which was already "
                                 "sharded with its own unit; initialize a module's parameters in its own "
                                 "reset_parameters() (or init_fn), not in an ancestor's")

        if name in units or module is model:
            completed.add(name)
            # A parameter is final once every module owning it ran and so did the heads of
            # their units (an ancestor within a unit may still write its descendants).
            ready = [k for k in full if all(id(o) in initialized and unit_of(names[id(o)], units) in completed
                                            for o, _ in owners[k])]
            for key in ready:
                value = full.pop(key)
                if value._version == written_at[key]:
                    raise ValueError(f"parameter {_fqn(owners[key][0], names)!r} was materialized from the meta "
                                     "device but neither reset_parameters() nor init_fn wrote it; initialize it there")
                with torch.no_grad():
                    sharded[key] = shard(value, meta[key])
                held -= value.nbytes
                for owner, owner_name in owners[key]:
                    owner._parameters[owner_name] = meta[key]
                sharded_versions[key] = meta[key]._version
    for mod_name, bname, value, version in fresh_buffers:
        if value._version == version:
            raise ValueError(f"buffer {(mod_name + '.' if mod_name else '') + bname!r} was materialized from the meta "
                             "device but neither reset_parameters() nor init_fn wrote it; initialize it there")
    return Materialized(sharded, peak)


def _fqn(owner: tuple[nn.Module, str], names: dict[int, str]) -> str:
    module, pname = owner
    prefix = names.get(id(module), "")
    return f"{prefix}.{pname}" if prefix else pname
