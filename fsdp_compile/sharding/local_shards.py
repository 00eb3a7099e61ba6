"""The leaves one model's forward reads, kept in line with their DTensor parameters.

Tensor kinds (DTensor parameter, local shard, leaf, gathered parameter): [Note: sharded tensors]
in :mod:`.sharded_param`.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, is_

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .grad_sync import GradientSync
from .sharded_param import ShardedParam


@dataclass
class _Registration:
    """One name a sharded parameter is registered under: where to look for replacements."""

    parameters: dict  # the owning module's _parameters
    name: str
    fqn: str
    param: nn.Parameter


class LocalShards:
    """The leaves that stand for one model's sharded parameters in its forward, and the state of
    that forward. One per model, shared by the states of all its modules.

    Why leaves, not the DTensor parameters: every DTensor a graph reads costs Dynamo a subclass
    input with spec guards and an unwrapping per parameter, and AOTAutograd a subclass to
    flatten and a gradient to rebuild (more than twice the compile time of a deep model).
    Plain tensors also keep checkpointed regions clean (``to_local()`` inside one made
    AOTAutograd save the DeviceMesh for backward, which it cannot).

    The leaves follow their parameters (``requires_grad``, replaced storage) through
    :meth:`refresh`, run eagerly before every forward (the root's in the eager runtime, each
    compiled graph's call otherwise; a graph traced with a stale leaf runs eagerly once).

    Tied parameters (registered under several names) are gathered once per forward, at the
    root, so autograd sums all uses' gradients before one reduction, as FSDP2 does; a marker per
    read would reduce each use apart: twice the bytes, and a different rounding. At the root, not
    on first read: a first read inside a checkpointed region would mutate state outside it.
    """

    def __init__(self, sync: GradientSync | None = None) -> None:
        self.sync = sync
        self.shards: list[ShardedParam] = []
        self.registrations: list[_Registration] = []
        # What the graphs read: fqn -> leaf (the dict is kept, entries are replaced).
        self.leaves: dict[str, nn.Parameter] = {}
        # Tied parameters (registered under several names): (fqn, marker arguments).
        self.shared: list[tuple[str, tuple]] = []
        # fqn -> the marker's arguments after the tensor (a read's, see ShardedParamInfo).
        self.read_args: dict[str, tuple] = {}
        # Set by the root's forward for its duration: whether gradients accumulate without
        # synchronization (read once per forward, one guard under Dynamo), and the tied
        # parameters' gathered values.
        self.in_forward = False
        self.accumulating = False
        self.shared_gathered: dict[str, torch.Tensor] | None = None
        self.plain_reads = False  # in_forward, traced, not accumulating, no tied parameters
        # Reads that run as Python in this forward (eager_buckets.py): what they gathered for
        # reads still to come, and which parameters were gathered.
        self.prefetched: dict[str, torch.Tensor] = {}
        self.read_in_forward: set[str] = set()
        # fqn -> the (dict, key) places besides ``leaves`` that hold its leaf (region reads).
        self.mirrors: dict[str, list[tuple[dict, str]]] = {}
        self._snapshot: tuple[list, ...] | None = None  # what _unchanged compares, in parallel lists

    @property
    def tied(self) -> set[str]:
        return {fqn for fqn, _ in self.shared}

    def add(self, fqn: str, param: nn.Parameter, read_args: tuple | None = None) -> None:
        """Stand ``param`` in for ``fqn``; ``read_args``: its marker's arguments after the tensor."""
        if read_args is not None:
            self.read_args[fqn] = read_args
        shard = ShardedParam(fqn, param, self)
        self.shards.append(shard)
        self.leaves[fqn] = shard.leaf
        self._snapshot = None

    def mirror(self, fqn: str, where: dict, key: str) -> None:
        """``where[key]`` holds ``fqn``'s leaf too: keep it current when the leaf changes."""
        self.mirrors.setdefault(fqn, []).append((where, key))

    def register(self, module: nn.Module, name: str, fqn: str) -> None:
        """``module.<name>`` is (one registration of) the sharded parameter ``fqn``."""
        self.registrations.append(_Registration(module._parameters, name, fqn, module._parameters[name]))
        self._snapshot = None

    def refresh(self) -> dict[int, nn.Parameter]:
        """Bring every leaf in line with its parameter; returns ``{id(old leaf): new leaf}`` for
        those that changed. Raises if a sharded parameter was replaced by another tensor (its
        leaf would go on reading the old values)."""
        if self._unchanged():
            return {}
        for reg in self.registrations:
            current = reg.parameters.get(reg.name)
            if current is not reg.param:
                what = ("None" if current is None else "another DTensor" if isinstance(current, DTensor)
                        else "a plain tensor")
                raise RuntimeError(f"parameter {reg.fqn!r} was replaced by {what} after the model was sharded; load "
                                   "new values with load_state_dict() or copy_() into the existing parameter")
        changed = {}
        for shard in self.shards:
            old = shard.leaf
            if shard.refresh():
                changed[id(old)] = shard.leaf
                self.leaves[shard.fqn] = shard.leaf
                for where, key in self.mirrors.get(shard.fqn, ()):
                    where[key] = shard.leaf
        self._snapshot = None
        return changed

    def _unchanged(self) -> bool:
        # Runs before every graph call, for every parameter: compared with C-level iteration
        # (map over parallel lists), a few times faster than a loop over the objects.
        if self._snapshot is None:
            regs, shards = self.registrations, self.shards
            self._snapshot = ([r.parameters for r in regs], [r.name for r in regs], [r.param for r in regs],
                              [s.param for s in shards], [s.local for s in shards], [s.leaf for s in shards])
        dicts, names, registered, params, locals_, leaves = self._snapshot
        if not (all(map(is_, map(dict.get, dicts, names), registered))
                and all(map(is_, map(_LOCAL_TENSOR, params), locals_))):
            return False
        with torch._C.DisableTorchFunctionSubclass():  # a DTensor's attributes, without its dispatch
            return all(map(is_, map(_REQUIRES_GRAD, params), map(_REQUIRES_GRAD, leaves)))


_LOCAL_TENSOR = attrgetter("_local_tensor")
_REQUIRES_GRAD = attrgetter("requires_grad")
