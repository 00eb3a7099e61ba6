"""Move collectives apart from their waits so communication overlaps compute.

Runs on a lowered graph, where every bucket is an "issue" stage (copy-in or chunk-cat and the
collective) and a "finish" stage (the wait and what follows). Compute nodes keep their order;
only the stages move:

* a gather is waited right before its first use, and issued ``prefetch`` buckets earlier: when
  the bucket ``prefetch`` places before it in use order starts being used (forward order in the
  forward graph, the reverse order backward uses in the backward graph). ``prefetch=0`` issues
  right before the wait. An explicit order (``{bucket: [buckets to gather when it starts]}``,
  as FSDP2's ``set_modules_to_forward_prefetch``) overrides the distance for the buckets named;
* a reduction is issued as soon as its bucket's gradients exist and waited as late as possible:
  before the first use of its results (the graph's end), or earlier when the budget says so;
* unsharded bytes in flight (collectives issued and not yet waited) never exceed
  ``max_inflight_bytes``: a prefetch is delayed, and a reduction waited earlier, rather than
  break it. The default is two buckets' worth (twice the largest bucket of the graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch.fx as fx

from .lowering import COMM_META, CommTag, stable_topological_sort
from .reshard import PURE_VIEWS


@dataclass(frozen=True)
class ScheduleOptions:
    prefetch: int = 1
    max_inflight_bytes: int | None = None
    explicit_prefetch: Mapping[str, Sequence[str]] | None = None  # for this graph's phase


@dataclass
class ScheduledCollective:
    """Where one bucket's collective ended up."""

    kind: str
    bucket: str
    bytes: int
    issued_before: str  # the compute node the collective is issued before
    waited_before: str  # the compute node its wait comes before
    overlapped_nodes: int  # compute nodes between issue and wait
    prefetch_delayed: bool = False  # a gather issued later than asked, to respect the budget
    pinned: bool = False  # left where lowering put it (depends on another bucket)


@dataclass
class Schedule:
    budget: int
    peak_inflight: int
    collectives: list[ScheduledCollective] = field(default_factory=list)


@dataclass
class _Group:
    tag: CommTag
    issue: list[fx.Node] = field(default_factory=list)
    finish: list[fx.Node] = field(default_factory=list)
    ready: int = 0  # earliest position the issue may go (after its inputs)
    first_use: int = 0  # position of the first compute node using its results
    start: int = 0
    wait: int = 0
    pinned: bool = False
    delayed: bool = False


def _groups(graph: fx.Graph) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    for node in graph.nodes:
        tag = node.meta.get(COMM_META)
        if tag is None:
            continue
        group = groups.setdefault(tag.group, _Group(tag))
        (group.issue if tag.stage == "issue" else group.finish).append(node)
    return groups


def schedule_collectives(gm: fx.GraphModule, options: ScheduleOptions) -> Schedule:
    """Reorder ``gm`` in place as described in the module docstring; returns the schedule."""
    if options.prefetch < 0:
        raise ValueError(f"prefetch={options.prefetch} must be >= 0 (0 disables prefetching)")
    graph = gm.graph
    _hoist_and_sink_views(graph)
    groups = _groups(graph)
    if not groups:
        return Schedule(budget=options.max_inflight_bytes or 0, peak_inflight=0)
    largest = max(groups.values(), key=lambda g: g.tag.bytes)
    budget = options.max_inflight_bytes or 2 * largest.tag.bytes
    if budget < largest.tag.bytes:
        raise ValueError(
            f"max_inflight_bytes={budget} is smaller than bucket {largest.tag.bucket!r} "
            f"({largest.tag.bytes} bytes, {largest.tag.kind}); raise it to at least {largest.tag.bytes} "
            "or use smaller buckets"
        )

    member = {n: g for g in groups.values() for n in g.issue + g.finish}
    compute = [n for n in graph.nodes if n not in member]
    position = {n: i for i, n in enumerate(compute)}
    first_op = next(i for i, n in enumerate(compute) if n.op != "placeholder")
    end = len(compute) - 1  # the output node

    original = list(graph.nodes)
    for group in groups.values():
        inputs = {i for n in group.issue for i in n.all_input_nodes if member.get(i) is not group}
        users = {u for n in group.issue + group.finish for u in n.users if member.get(u) is not group}
        if any(i in member for i in inputs) or any(u in member for u in users) or not users:
            # Depends on (or feeds) another bucket: keep the place lowering gave it.
            group.pinned = True
            group.start = _next_compute_position(original, group.issue[0], position, end)
            group.wait = _next_compute_position(original, group.finish[0], position, end) if group.finish else group.start
            group.first_use = group.wait
            continue
        group.ready = max([position[i] + 1 for i in inputs] + [first_op])
        group.first_use = min(position[u] for u in users)

    inflight = [0] * (len(compute) + 1)

    def span(group: _Group) -> range:
        # A collective waited at its own position is still in flight for that moment.
        return range(group.start, max(group.wait, group.start + 1))

    def occupy(group: _Group, sign: int = 1) -> None:
        for t in span(group):
            inflight[t] += sign * group.tag.bytes

    gathers = sorted((g for g in groups.values() if g.tag.kind == "gather" and not g.pinned),
                     key=lambda g: g.first_use)
    by_bucket = {g.tag.bucket: g for g in gathers}
    triggered: dict[str, int] = {}
    for trigger, targets in (options.explicit_prefetch or {}).items():
        if trigger in by_bucket:
            for target in targets:
                triggered[target] = min(triggered.get(target, end), by_bucket[trigger].first_use)
    for i, group in enumerate(gathers):
        if group.tag.bucket in triggered:
            desired = triggered[group.tag.bucket]
        elif options.prefetch == 0:
            desired = group.first_use
        elif i >= options.prefetch:
            desired = gathers[i - options.prefetch].first_use
        else:
            desired = first_op
        group.wait = group.first_use
        group.start = min(max(desired, group.ready), group.first_use)
        while group.start < group.first_use and any(inflight[t] + group.tag.bytes > budget for t in span(group)):
            group.start += 1
        group.delayed = group.start > max(desired, group.ready)
        occupy(group)

    # Reductions: issued when their gradients exist (or as soon as the budget allows: earlier
    # reductions still in flight are waited first, oldest first), waited as late as fits.
    placed: list[_Group] = []
    for group in sorted((g for g in groups.values() if g.tag.kind == "reduce" and not g.pinned),
                        key=lambda g: g.ready):
        group.start = min(group.ready, group.first_use)
        while inflight[group.start] + group.tag.bytes > budget:
            in_flight = [q for q in placed if q.start < group.start < q.wait]
            if in_flight:
                oldest = min(in_flight, key=lambda q: q.start)
                occupy(oldest, -1)
                oldest.wait = group.start
                occupy(oldest)
            elif group.start < group.first_use:
                group.start += 1
            else:
                break  # only gathers fill the budget here and this one is due: issue anyway
        group.wait = group.start
        while group.wait < group.first_use and inflight[group.wait] + group.tag.bytes <= budget:
            group.wait += 1
        occupy(group)
        placed.append(group)

    _emit(graph, compute, groups.values())
    stable_topological_sort(graph)
    graph.lint()
    gm.recompile()

    return Schedule(
        budget=budget,
        peak_inflight=max(inflight),
        collectives=[
            ScheduledCollective(
                kind=g.tag.kind, bucket=g.tag.bucket, bytes=g.tag.bytes,
                issued_before=compute[g.start].name, waited_before=compute[g.wait].name,
                overlapped_nodes=g.wait - g.start, prefetch_delayed=g.delayed, pinned=g.pinned)
            for g in sorted(groups.values(), key=lambda g: (g.start, g.wait))
        ],
    )


def _hoist_and_sink_views(graph: fx.Graph) -> None:
    """Views of graph inputs go to the top, views only the output uses go to the bottom.

    AOTAutograd leaves such views next to the markers they fed (a shard's ``to_local`` view
    right before its gather, a gradient's reshape right after its reduction), which would pin
    collectives to those spots; views allocate nothing, so moving them changes no memory.
    """
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    if placeholders:
        anchor = placeholders[-1]
        early = set(placeholders)
        for node in nodes:
            if node.op == "call_function" and node.target in PURE_VIEWS and node.all_input_nodes \
                    and all(i in early for i in node.all_input_nodes):
                early.add(node)
                anchor.append(node)
                anchor = node
    late: set[fx.Node] = {output}
    for node in reversed(nodes):
        if node.op == "call_function" and node.target in PURE_VIEWS and node.users \
                and all(u in late for u in node.users):
            late.add(node)
    for node in nodes:
        if node in late and node is not output:
            output.prepend(node)


def _next_compute_position(order: list[fx.Node], node: fx.Node, position: dict, end: int) -> int:
    for candidate in order[order.index(node):]:
        if candidate in position:
            return position[candidate]
    return end


def _emit(graph: fx.Graph, compute: list[fx.Node], groups) -> None:
    """Lay the graph out: before each compute node, the stages scheduled at its position."""
    at: dict[int, list[list[fx.Node]]] = {}
    # At one position: reduction waits (free memory first), gather waits, gather issues,
    # reduction issues, then waits due at their own issue; then the compute node itself.
    rank = {("reduce", "finish"): 0, ("gather", "finish"): 1, ("gather", "issue"): 2, ("reduce", "issue"): 3}
    entries = []
    for g in groups:
        entries.append((g.start, rank[(g.tag.kind, "issue")], g.tag.group, g.issue))
        finish_rank = rank[(g.tag.kind, "finish")] if g.wait > g.start else 4
        entries.append((g.wait, finish_rank, g.tag.group, g.finish))
    for pos, _, _, nodes in sorted(entries, key=lambda e: e[:3]):
        at.setdefault(pos, []).append(nodes)
    order: list[fx.Node] = []
    for i, node in enumerate(compute):
        for nodes in at.get(i, []):
            order.extend(nodes)
        order.append(node)
    cursor = order[0]
    for node in order[1:]:
        if cursor.next is not node:
            cursor.append(node)
        cursor = node
