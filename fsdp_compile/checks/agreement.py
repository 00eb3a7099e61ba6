"""Ranks that disagree fail together, named, before any data is touched.

A rank that builds another model or passes other options issues other collectives: the first
mismatch aborts inside the communication library, hangs, or silently pairs unrelated buffers.
Two checks catch it before the training step communicates: at ``shard()`` the ranks compare
what they are about to do (the options declared ``agree=True``, world, groups, every parameter;
:func:`agree_on_sharding`), and before a new graph's first run the collectives it will issue
(:class:`GraphVerifier`). Both exchange through the rendezvous store, never the collective
stream (which a mismatch would break), and wait at most the group's timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import api
from ..api.options import described
from ..passes.graph import COMM_META, decode_collective
from ..runtime.markers import REDUCE_GRAD, UNSHARD_TARGETS, decode
from ..sharding.groups import world_timeout
from ..sharding.units import describe_reshard_option, unit_modules, unit_of

if TYPE_CHECKING:
    from ..api import BackendOptions
    from ..sharding.groups import Topology

_PREFIX = "fsdp_compile"
_POLL_SECONDS = 0.02
# Item values longer than this are cut in error messages (a whole layout can be long).
_SHOWN_CHARS = 300


def _store() -> dist.Store | None:
    """The job's rendezvous store; None where no exchange is possible or needed."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _encode(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, default=str).encode())


def _decode(raw: bytes) -> Any:
    return json.loads(zlib.decompress(raw).decode())


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, default=str, sort_keys=False).encode()).hexdigest()[:16]


def _shorten(value: Any) -> str:
    if value is _ABSENT:
        text = "<absent>"
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


_ABSENT = object()


def first_difference(described: dict[int, list[tuple[str, Any]]]) -> tuple[str, dict[str, list[int]]] | None:
    """The first item (in the order the lowest rank lists them, then the others') whose value
    differs between ranks, and which ranks hold which value; None when all agree."""
    keys: list[str] = []
    per_rank = {rank: dict(items) for rank, items in described.items()}
    for rank in sorted(described):
        # A key another rank lacks goes right after the key it follows here, so an extra
        # parameter in the middle of one rank's model is found where it is.
        previous = None
        for key, _ in described[rank]:
            if key not in keys:
                keys.insert(keys.index(previous) + 1 if previous is not None else 0, key)
            previous = key
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank in sorted(described):
            holders.setdefault(_shorten(per_rank[rank].get(key, _ABSENT)), []).append(rank)
        if len(holders) > 1:
            return key, holders
    return None


def _describe_holders(holders: dict[str, list[int]]) -> str:
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {_ranks(r)}: {value}" for value, r in holders.items())


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return f"{ranks[:8]} and {len(ranks) - 8} more"
    return str(ranks) if len(ranks) > 1 else str(ranks[0])


class AgreementError(ValueError):
    """Ranks of one data-parallel mesh would communicate differently."""


@dataclass
class _Exchange:
    """One round of the store exchange among ``ranks`` under ``prefix``."""

    store: dist.Store
    prefix: str
    ranks: list[int]
    timeout: datetime.timedelta

    def wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except Exception as exc:  # the store raises a plain RuntimeError/DistStoreError on timeout
            missing = [k for k in keys if not self.store.check([k])]
            raise AgreementError(f"fsdp_compile: timed out after {self.timeout.total_seconds():.0f}s waiting for "
                                 f"{what} ({len(missing)} of {len(keys)} not there, e.g. {missing[:3]}); a rank "
                                 "has exited, is stuck, or runs a different program") from exc


def agree_on_sharding(items: list[tuple[str, Any]], ranks: Sequence[int], timeout: datetime.timedelta,
                      key: str) -> None:
    """Check that every rank in ``ranks`` passed the same ``(name, JSON-able value)`` ``items``,
    raising the same :class:`AgreementError` on every rank if not: the lowest rank compares one
    description per distinct digest and publishes the verdict. ``key`` names the call, alike on
    every rank."""
    store = _store()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = sorted(ranks)
    if store is None or len(ranks) < 2 or rank not in ranks:
        return
    ex = _Exchange(store, f"{_PREFIX}/shard/{key}", ranks, timeout)
    mine = digest(items)
    store.set(f"{ex.prefix}/items/{rank}", _encode(items))
    store.set(f"{ex.prefix}/digest/{rank}", mine)
    leader = ranks[0]
    verdict_key = f"{ex.prefix}/verdict"
    if rank == leader:
        verdict = "ok"
        try:
            ex.wait([f"{ex.prefix}/digest/{r}" for r in ranks], "every rank's shard() description")
            digests = {r: store.get(f"{ex.prefix}/digest/{r}").decode() for r in ranks}
            groups: dict[str, list[int]] = {}
            for r, d in digests.items():
                groups.setdefault(d, []).append(r)
            if len(groups) > 1:
                described = {members[0]: [tuple(i) for i in _decode(store.get(f"{ex.prefix}/items/{members[0]}"))]
                             for members in groups.values()}
                found = first_difference(described)
                verdict = _mismatch_message(found, groups)
        except AgreementError as exc:
            verdict = str(exc)
        store.set(verdict_key, verdict)
    else:
        ex.wait([verdict_key], f"rank {leader}'s verdict on shard()")
        verdict = store.get(verdict_key).decode()
    if verdict != "ok":
        raise AgreementError(verdict)


def _mismatch_message(found: tuple[str, dict[str, list[int]]] | None, groups: dict[str, list[int]]) -> str:
    if found is None:  # descriptions equal in content but not in order
        return ("fsdp_compile: ranks describe their model and options in a different order: "
                f"{_describe_holders({d: r for d, r in groups.items()})}")
    item, holders = found
    # Each listed rank stands for every rank with the same description.
    representative = {members[0]: members for members in groups.values()}
    expanded = {value: sorted(r for rep in reps for r in representative.get(rep, [rep]))
                for value, reps in holders.items()}
    return (f"fsdp_compile: ranks disagree at shard() on {item}: {_describe_holders(expanded)}. Every rank "
            "of a data-parallel mesh must build the same model with the same options (check that all "
            "ranks read the same config, seed and checkpoint, and take no rank-dependent branch when "
            "building the model)")


# ----------------------------------------------------------------------------- per graph
@dataclass(frozen=True)
class CollectiveCall:
    """One collective a graph issues, as the other ranks must issue it too."""

    phase: str  # "forward" or "backward"
    kind: str
    group: str
    dtype: str
    bytes: int
    bucket: str
    params: tuple[str, ...]

    def signature(self) -> list:
        """What must agree between ranks (the bucket and parameter names may not)."""
        return [self.phase, self.kind, self.group, self.dtype, self.bytes]

    def describe(self) -> str:
        params = ", ".join(self.params[:4]) + (f", +{len(self.params) - 4} more" if len(self.params) > 4 else "")
        return (f"{self.phase} {self.kind} of {self.bytes} bytes {self.dtype} in the {self.group} "
                f"(bucket {self.bucket}: {params or 'no parameters'})")


class GraphMismatchError(AgreementError):
    """A newly compiled graph would issue other collectives than another rank's graph."""


class GraphVerifier:
    """Compares, on the first run of each compiled graph, its collectives with every other rank's.

    On a graph's first run this rank publishes the digest of its collective sequence and, under
    its call number (equal on ranks in step), the sequence. It waits until each other rank has
    compiled a graph with the same digest (ranks recompile at different steps when shapes
    differ) or published another sequence under that call number: a mismatch, which names the
    first differing collective.
    """

    def __init__(self, key: str, ranks: Sequence[int], timeout: datetime.timedelta) -> None:
        self.prefix = f"{_PREFIX}/graphs/{key}"
        self.ranks = sorted(ranks)
        self.timeout = timeout
        self.calls = 0
        self.seconds = 0.0  # time spent verifying, for reporting its cost

    def verify(self, graph: str, calls: list[CollectiveCall]) -> None:
        store = _store()
        rank = dist.get_rank() if dist.is_initialized() else 0
        others = [r for r in self.ranks if r != rank]
        if store is None or not others:
            return
        start = time.perf_counter()
        signature = [c.signature() for c in calls]
        mine = digest(signature)
        call = self.calls
        store.set(f"{self.prefix}/has/{rank}/{mine}", "1")
        store.set(f"{self.prefix}/call/{call}/{rank}",
                  _encode({"graph": graph, "calls": [[*c.signature(), c.describe()] for c in calls]}))
        pending = set(others)
        deadline = time.monotonic() + self.timeout.total_seconds()
        while pending:
            for other in sorted(pending):
                if store.check([f"{self.prefix}/has/{other}/{mine}"]):
                    pending.discard(other)
                    continue
                theirs_key = f"{self.prefix}/call/{call}/{other}"
                if store.check([theirs_key]):
                    theirs = _decode(store.get(theirs_key))
                    if digest([c[:5] for c in theirs["calls"]]) != mine:
                        raise GraphMismatchError(_graph_mismatch(graph, rank, calls, other, theirs))
                    pending.discard(other)
            if pending and time.monotonic() > deadline:
                raise GraphMismatchError(
                    f"fsdp_compile: {graph} on rank {rank} was about to issue its first collective, but "
                    f"rank{'s' if len(pending) > 1 else ''} {_ranks(sorted(pending))} compiled no graph "
                    f"with the same collectives within {self.timeout.total_seconds():.0f}s: they have "
                    "exited, are stuck, or run a different program (rank-dependent control flow around "
                    "parameter use, different models or options)")
            if pending:
                time.sleep(_POLL_SECONDS)
        self.seconds += time.perf_counter() - start


def _graph_mismatch(graph: str, rank: int, mine: list[CollectiveCall], other: int, theirs: dict) -> str:
    their_calls = theirs["calls"]
    index = next((i for i, (a, b) in enumerate(zip(mine, their_calls)) if a.signature() != b[:5]),
                 min(len(mine), len(their_calls)))
    here = mine[index].describe() if index < len(mine) else "no further collective"
    there = their_calls[index][5] if index < len(their_calls) else "no further collective"
    return (f"fsdp_compile: ranks would issue different collectives: {graph} on rank {rank} and "
            f"{theirs['graph']} on rank {other} differ at collective #{index} "
            f"({len(mine)} vs {len(their_calls)} collectives in all): rank {rank}: {here}; rank {other}: "
            f"{there}. Usual causes: rank-dependent control flow around parameter use, different "
            "models or options on different ranks, or no_sync()/eval on some ranks only. Nothing was "
            "communicated; pass verify=False to the backend to skip this check")


def collective_calls(record: Any, group_roles: dict[str, str]) -> list[CollectiveCall]:
    """The collectives a compiled graph pair issues, forward then backward: lowered ones from the
    graphs, a marker not lowered as one each. Groups are named by role (``group_roles``): in a
    hybrid mesh each rank's shard group is another process group, yet the same role."""
    calls: list[CollectiveCall] = []
    graphs = [(name, record.phase(name).graph, record.phase(name).buckets) for name in ("forward", "backward")]
    if record.forward is None:  # not lowered at all: the Dynamo graph's markers
        graphs = [("forward", record.dynamo, {})]
    for phase, gm, buckets in graphs:
        if gm is None:
            continue
        members = {b.key: tuple(dict.fromkeys(b.fqns)) for kind in buckets.values() for b in kind}
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            collective = decode_collective(node)
            if collective is not None:
                tag = node.meta.get(COMM_META)
                bucket = tag.bucket if tag is not None else "?"
                group = str(collective.group)
                calls.append(CollectiveCall(phase, collective.kind, group_roles.get(group) or _role_of(group),
                                            str(collective.dtype).replace("torch.", ""),
                                            int(collective.buffer_bytes), bucket, members.get(bucket, ())))
            elif node.target in UNSHARD_TARGETS or node.target is REDUCE_GRAD:
                marker = decode(node)
                value = node.meta["val"] if marker.kind == "unshard" else marker.input.meta["val"]
                group = marker.spec.shard_group or marker.spec.replicate_group
                calls.append(CollectiveCall(phase, marker.kind, group_roles.get(group, group),
                                            str(value.dtype).replace("torch.", ""),
                                            int(value.numel() * value.element_size()), marker.unit or "<root>",
                                            (marker.fqn,)))
    return calls


def _role_of(group_name: str) -> str:
    """A group none of ours (tensor parallelism's) by size and this rank's place, alike across ranks."""
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return f"group of {group.size()} ranks (this rank {group.rank()})"
    except Exception:  # not a registered group: compare the name itself
        return group_name


# shard() calls per mesh on this process: the agreement key of the n-th call is the same on every rank.
_SHARD_CALLS: dict[str, int] = {}


def agree_on_model(options: BackendOptions, topology: Topology, model: nn.Module) -> GraphVerifier:
    """Every rank of the mesh must shard the same model with the same options; returns the verifier
    for the graphs this model will compile to."""
    ranks = [int(r) for r in topology.mesh.mesh.flatten().tolist()]
    timeout = options.timeout or world_timeout()
    mesh_key = hashlib.sha256(repr(ranks).encode()).hexdigest()[:12]
    count = _SHARD_CALLS[mesh_key] = _SHARD_CALLS.get(mesh_key, 0) + 1
    key = f"{mesh_key}/{count}"
    agree_on_sharding(sharding_items(options, topology, model), ranks, timeout, key)
    return GraphVerifier(key, ranks, timeout)


def _unique_parameters(model: nn.Module):
    """(module name, local name, parameter) for each distinct parameter, at its first owner."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield module_name, name, param


def sharding_items(options: BackendOptions, topology: Topology, model: nn.Module) -> list[tuple[str, Any]]:
    """What must be equal on every rank for the ranks to communicate alike, in a fixed order."""
    o = options
    agreed = described(o, "agree")
    if "reshard_after_forward" in agreed:  # modules by name, which only the model knows
        agreed["reshard_after_forward"] = describe_reshard_option(o.reshard_after_forward, model)
    items: list[tuple[str, Any]] = [
        ("the fsdp_compile version", api.__version__),
        ("the torch version", torch.__version__),
        *((f"{name}=", value) for name, value in agreed.items()),
        ("the world size", dist.get_world_size()),
        ("the mesh (replicate x shard ranks)", topology.mesh.mesh.tolist()),
    ]
    units = unit_modules(model, o.bucket_policy)
    for module_name, name, param in _unique_parameters(model):
        fqn = f"{module_name}.{name}" if module_name else name
        about = [list(param.shape), str(param.dtype).replace("torch.", ""), param.requires_grad,
                 unit_of(module_name, units) or "<root>"]
        if isinstance(param, DTensor):  # tensor parallel: the ranks' TP plans must agree too
            about.append([param.device_mesh.mesh_dim_names, [repr(p) for p in param.placements]])
        items.append((f"parameter {fqn!r} (shape, dtype, requires_grad, bucket unit[, TP layout])", about))
    # After the parameters: a missing or extra parameter is named before the count differs.
    items.append(("the number of parameters", sum(1 for _ in _unique_parameters(model))))
    return items
