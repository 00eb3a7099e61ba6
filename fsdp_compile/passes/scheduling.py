"""Move collectives apart from their waits so communication overlaps compute.

A lowered bucket's stages (issue: copy-in, collective; finish: wait and after) move; compute keeps
its order. A gather is waited before its first use and issued ``prefetch`` buckets earlier (or as an
explicit order says); a reduction is issued once its gradients exist and waited late. Bytes in flight
stay under ``max_inflight_bytes`` (default: twice the largest bucket plus two hybrid all-reduces).
Under Inductor this is the order the step runs in (the compiler turns its reordering off).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from ..api import ConfigError, check_inflight_budget, check_prefetch
from .context import PassContext
from .graph import COLLECTIVE_OPS, COMM_META, PURE_VIEWS, CommTag, calls, collective_bytes, stable_topological_sort
from .lowering import unit_label


@dataclass(frozen=True)
class ScheduleOptions:
    prefetch: int = 1
    max_inflight_bytes: int | None = None
    explicit_prefetch: Mapping[str, Sequence[str]] | None = None  # for this graph's phase

    def __post_init__(self) -> None:
        check_prefetch(self.prefetch)  # the backend's prefetch= check, for direct callers
        check_inflight_budget(self.max_inflight_bytes)


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
    """One lowered bucket's stages (split at each wait): stage k < last ends with a collective in flight
    from ``at[k]`` to ``at[k + 1]``; a stage at position p goes right before compute node p."""

    tag: CommTag
    stages: list[list[fx.Node]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # bytes of each stage's collective
    at: list[int] = field(default_factory=list)
    ready: int = 0  # earliest position for stage 0 (after its inputs)
    first_use: int = 0  # position of the first compute node using the results
    pinned: bool = False
    delayed: bool = False
    issue_first: bool = False  # issued before the waits laid out at its position

    @property
    def nodes(self) -> list[fx.Node]:
        return [n for stage in self.stages for n in stage]

    def spans(self):
        """(positions, bytes) of each collective in flight; one waited where issued counts there."""
        for k, size in enumerate(self.sizes):
            lo, hi = self.at[k], self.at[k + 1]
            yield range(lo, max(hi, lo + 1)), size


class _Inflight:
    """Bytes in flight at each position: a segment tree (lazy range add, range max), or reductions in
    flight to the graph's end would make the pass grow with the square of the model's depth."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.top = [0] * (4 * size)  # max over the node's range, its own pending adds included
        self.pending = [0] * (4 * size)  # added to the node's whole range, not yet to its children

    def add(self, lo: int, hi: int, value: int, node: int = 1, left: int = 0, right: int | None = None) -> None:
        """Add ``value`` at every position of [lo, hi)."""
        right = self.size if right is None else right
        if hi <= left or right <= lo or lo >= hi:
            return
        if lo <= left and right <= hi:
            self.top[node] += value
            self.pending[node] += value
            return
        middle = (left + right) // 2
        self.add(lo, hi, value, 2 * node, left, middle)
        self.add(lo, hi, value, 2 * node + 1, middle, right)
        self.top[node] = self.pending[node] + max(self.top[2 * node], self.top[2 * node + 1])

    def __getitem__(self, position: int) -> int:
        return self.max(position, position + 1)

    def max(self, lo: int, hi: int, node: int = 1, left: int = 0, right: int | None = None) -> int:
        """The largest value in [lo, hi) (hi > lo)."""
        right = self.size if right is None else right
        if hi <= left or right <= lo:
            return -(1 << 62)
        if lo <= left and right <= hi:
            return self.top[node]
        middle = (left + right) // 2
        return self.pending[node] + max(self.max(lo, hi, 2 * node, left, middle),
                                        self.max(lo, hi, 2 * node + 1, middle, right))

    def first_above(self, lo: int, hi: int, limit: int) -> int:
        """The first position in [lo, hi) whose value exceeds ``limit``; ``hi`` if none."""
        found = self._search(lo, hi, limit, 1, 0, self.size, 0, first=True)
        return hi if found is None else found

    def last_above(self, lo: int, hi: int, limit: int) -> int | None:
        """The last position in [lo, hi) whose value exceeds ``limit``; None if none."""
        return self._search(lo, hi, limit, 1, 0, self.size, 0, first=False)

    def _search(self, lo: int, hi: int, limit: int, node: int, left: int, right: int, above: int,
                first: bool) -> int | None:
        if hi <= left or right <= lo or self.top[node] + above <= limit:
            return None
        if right - left == 1:
            return left
        middle = (left + right) // 2
        above += self.pending[node]
        halves = ((2 * node, left, middle), (2 * node + 1, middle, right))
        for child, child_left, child_right in (halves if first else reversed(halves)):
            found = self._search(lo, hi, limit, child, child_left, child_right, above, first)
            if found is not None:
                return found
        return None

    def peak(self) -> int:
        return self.top[1]


def _groups(graph: fx.Graph) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    for node in graph.nodes:
        tag = node.meta.get(COMM_META)
        if tag is None:
            continue
        group = groups.setdefault(tag.group, _Group(tag))
        while len(group.stages) <= tag.stage:
            group.stages.append([])
        group.stages[tag.stage].append(node)
        if node.target in COLLECTIVE_OPS:
            group.sizes.append(collective_bytes(node))
    # A bucket lowered without a collective (NO_SHARD's cast) is compute like any other.
    return {key: group for key, group in groups.items() if group.sizes}


def schedule_collectives(gm: fx.GraphModule, options: ScheduleOptions) -> Schedule:
    """Reorder ``gm.graph`` in place (recompile before running it); returns the schedule."""
    graph = gm.graph
    _hoist_and_sink_views(graph)
    groups = _groups(graph)
    if not groups:
        return Schedule(budget=options.max_inflight_bytes or 0, peak_inflight=0)
    largest = max(groups.values(), key=lambda g: max(g.sizes))
    largest_bytes = max(largest.sizes)
    # Room for two hybrid all-reduces beside two buckets, or each would be waited where issued.
    later_stage_bytes = max((size for g in groups.values() if g.tag.kind == "reduce" for size in g.sizes[1:]),
                            default=0)
    budget = options.max_inflight_bytes or 2 * largest_bytes + 2 * later_stage_bytes
    if budget < largest_bytes:
        raise ConfigError(f"max_inflight_bytes={budget} is smaller than bucket {largest.tag.bucket!r} ({largest_bytes} "
                          f"bytes, {largest.tag.kind}); raise it to at least {largest_bytes} or use smaller buckets")

    member = {n: g for g in groups.values() for n in g.nodes}
    compute = [n for n in graph.nodes if n not in member]
    position = {n: i for i, n in enumerate(compute)}
    first_op = next(i for i, n in enumerate(compute) if n.op != "placeholder")
    end = len(compute) - 1  # the output node

    original = list(graph.nodes)
    for group in groups.values():
        nodes = group.nodes
        inputs = {i for n in nodes for i in n.all_input_nodes if member.get(i) is not group}
        users = {u for n in nodes for u in n.users if member.get(u) is not group}
        if any(i in member for i in inputs) or any(u in member for u in users) or not users:
            # Depends on (or feeds) another bucket: keep the place lowering gave it.
            group.pinned = True
            group.at = [next((position[c] for c in original[original.index(stage[0]):] if c in position), end)
                        for stage in group.stages]
            continue
        group.ready = max([position[i] + 1 for i in inputs] + [first_op])
        group.first_use = min(position[u] for u in users)

    inflight = _Inflight(len(compute) + 1)

    def occupy(group: _Group, sign: int = 1) -> None:
        for positions, size in group.spans():
            inflight.add(positions.start, positions.stop, sign * size)

    gathers = sorted((g for g in groups.values() if g.tag.kind == "gather" and not g.pinned), key=lambda g: g.first_use)
    # Explicit orders name units; a unit with a tail bucket starts with its first and prefetches all.
    first_of_unit: dict[str, _Group] = {}
    for g in gathers:
        first_of_unit.setdefault(unit_label(g.tag.bucket), g)
    triggered: dict[str, int] = {}
    for trigger, targets in (options.explicit_prefetch or {}).items():
        if trigger in first_of_unit:
            for target in targets:
                triggered[target] = min(triggered.get(target, end), first_of_unit[trigger].first_use)
    for i, group in enumerate(gathers):
        unit = unit_label(group.tag.bucket)
        if unit in triggered:
            desired = triggered[unit]
        elif options.prefetch == 0:
            desired = group.first_use
        elif i >= options.prefetch:
            desired = gathers[i - options.prefetch].first_use
        else:
            desired = first_op
        start = min(max(desired, group.ready), group.first_use)
        size = max(group.sizes)
        # the first start from which the gather fits under the budget until its use
        last_over = inflight.last_above(start, group.first_use, budget - size)
        if last_over is not None:
            start = last_over + 1
        # A float8 gather's amax all-reduce needs only the shards: issued as soon as they exist.
        group.at = [group.ready] * (len(group.stages) - 2) + [start, group.first_use]
        group.delayed = start > max(desired, group.ready)
        occupy(group)

    # Reductions: issued when their gradients exist, after the gathers issued before the next
    # gather's wait (a link serves in issue order), waited as late as the budget allows.
    gather_issues = sorted(g.at[0] for g in gathers)
    gather_waits = sorted(g.at[-1] for g in gathers)
    reductions = sorted((g for g in groups.values() if g.tag.kind == "reduce" and not g.pinned), key=lambda g: g.ready)
    # Where the link has surely carried a collective issued at p: the next gather's wait or reduction.
    milestones = sorted({*gather_waits, *(g.ready for g in reductions)})
    placed: list[_Group] = []
    for group in reductions:
        start = min(group.ready, group.first_use)
        if gather_waits and gather_waits[-1] >= start:
            next_wait = gather_waits[bisect_left(gather_waits, start)]
            before = [p for p in gather_issues[bisect_left(gather_issues, start):] if p <= next_wait]
            if before:
                start = min(before[-1], group.first_use)
        size = group.sizes[0]
        while inflight[start] + size > budget:
            older = [q for q in placed if q.at[0] < start < q.at[-1]]
            if older:
                oldest = min(older, key=lambda q: q.at[0])
                occupy(oldest, -1)
                oldest.at = [min(p, start) for p in oldest.at]
                occupy(oldest)
            elif start < group.first_use:
                start += 1
            else:
                break  # gathers fill the budget here and this one is due: issue anyway
        group.at = [start]
        for k, size in enumerate(group.sizes):
            issued = group.at[-1]
            latest = group.first_use
            if k < len(group.sizes) - 1:
                # A hybrid all-reduce is issued where this one is waited: wait at the next milestone.
                later = milestones[bisect_left(milestones, issued + 1):]
                if later:
                    latest = min(latest, later[0])
            # in flight until the first position where it would break the budget, or its use
            wait = inflight.first_above(issued, latest, budget - size) if issued < latest else issued
            inflight.add(issued, wait, size)
            if wait == issued:
                inflight.add(wait, wait + 1, size)  # waited where it is issued: in flight for that moment
            group.at.append(wait)
        placed.append(group)

    # A gather issued where another is waited goes first, or the link idles every bucket.
    for group in gathers:
        start = group.at[0]
        waited_here = sum(g.sizes[-1] for g in gathers if g.at[-1] == start and g.at[0] < start)
        if waited_here and start < group.first_use and inflight[start] + waited_here <= budget:
            group.issue_first = True
            inflight.add(start, start + 1, waited_here)

    _emit(graph, compute, groups.values())
    stable_topological_sort(graph)
    graph.lint()

    return Schedule(budget, inflight.peak(), [
        ScheduledCollective(g.tag.kind, g.tag.bucket, g.sizes[0], compute[g.at[0]].name, compute[g.at[1]].name,
                            g.at[-1] - g.at[0], prefetch_delayed=g.delayed, pinned=g.pinned)
        for g in sorted(groups.values(), key=lambda g: tuple(g.at))])


def _hoist_and_sink_views(graph: fx.Graph) -> None:
    """Views of inputs go to the top, views only the output uses to the bottom (else they pin collectives)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    if placeholders:
        anchor = placeholders[-1]
        early = set(placeholders)
        for node in nodes:
            if calls(node, PURE_VIEWS) and node.all_input_nodes and all(i in early for i in node.all_input_nodes):
                early.add(node)
                anchor.append(node)
                anchor = node
    late: set[fx.Node] = {output}
    for node in reversed(nodes):
        if calls(node, PURE_VIEWS) and node.users and all(u in late for u in node.users):
            late.add(node)
    for node in nodes:
        if node in late and node is not output:
            output.prepend(node)


def _emit(graph: fx.Graph, compute: list[fx.Node], groups) -> None:
    """Lay the graph out: before each compute node, its position's stages: ``issue_first`` gathers,
    waits (freeing memory first), collectives waited right there, then later-waited issues, gathers
    before reductions (the link serves in issue order; a gather is needed sooner)."""
    entries = []
    for g in groups:
        for k, stage in enumerate(g.stages):
            if k == 0:
                waits_here = len(g.at) > 1 and g.at[1] == g.at[0]
                rank = -1 if g.issue_first else 1 if waits_here else 2
            else:
                rank = 0 if g.at[k] > g.at[k - 1] else 1
            entries.append((g.at[k], rank, g.tag.kind != "gather", g.tag.group, k, stage))
    at: dict[int, list[list[fx.Node]]] = {}
    for pos, _, _, _, _, nodes in sorted(entries, key=lambda e: e[:5]):
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


def schedule_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> Schedule:
    """Each graph, when scheduling is on: collectives issued early and waited late, within budget."""
    return schedule_collectives(gm, ctx.schedule)
