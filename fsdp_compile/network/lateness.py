"""Why emulated collectives finished after their modeled end: a late peer, or gloo itself.

The group's last rank may reach a collective late (ranks time-slicing a machine's cores drift
apart; gloo starts only once every rank issued), or gloo's transfer may outlast the link's time
(its threads waiting for a core). The two call for different readings of a benchmark;
:func:`lateness_causes` splits the lateness of recorded collectives between them, from every
rank's issue times on the one host's monotonic clock.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from .emulated import EmulatedNetwork
from .links import format_seconds


@dataclass
class LatenessCauses:
    """The split of the recorded collectives' lateness, over every rank's records.

    ``collectives``: records every group member made, completed; ``late``: those finished after
    the modeled end, ``lateness_seconds`` in all, of which ``from_peers_seconds`` the last rank's
    arrival alone explains (the rest is gloo's). ``peer_wait_seconds`` and
    ``gloo_after_last_seconds``: over the late ones, the 10th/50th/90th percentiles of the time
    from this rank's issue to the last rank's, and from there to gloo's completion; ``by_kind``:
    counts and sums per "kind/link".
    """

    collectives: int
    late: int
    lateness_seconds: float
    from_peers_seconds: float
    peer_wait_seconds: tuple[float, float, float]
    gloo_after_last_seconds: tuple[float, float, float]
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def from_peers_share(self) -> float:
        return self.from_peers_seconds / self.lateness_seconds if self.lateness_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "from_peers_share": self.from_peers_share}

    def summary(self) -> str:
        if not self.late:
            return f"none of {self.collectives} recorded collectives finished after the model"
        quantiles = "/".join(format_seconds(s) for s in self.peer_wait_seconds)
        gloo = "/".join(format_seconds(s) for s in self.gloo_after_last_seconds)
        return (f"{self.late} of {self.collectives} recorded collectives finished after the model, "
                f"{format_seconds(self.lateness_seconds)} in total: {100 * self.from_peers_share:.0f}% from "
                f"the group's last rank arriving late (wait for it, 10th/50th/90th percentile: {quantiles}), "
                f"the rest gloo's own (gloo after the last rank's issue: {gloo})")


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    if len(values) == 1:
        return (values[0],) * 3
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return (cuts[0], statistics.median(values), cuts[-1])


def split_lateness(records: list[list[tuple]]) -> LatenessCauses:
    """:class:`LatenessCauses` of every rank's records: ``records[rank]`` holds that rank's
    ``(group ranks, index in the group, kind, link, issued_at, modeled_end, gloo_done_at)``."""
    issued: dict[tuple, dict[int, float]] = {}
    for rank, rows in enumerate(records):
        for group, index, _kind, _link, issued_at, _end, _done in rows:
            issued.setdefault((group, index), {})[rank] = issued_at
    seen = late = 0
    lateness = from_peers = 0.0
    waits: list[float] = []
    after_last: list[float] = []
    by_kind: dict[str, dict[str, float]] = {}
    for rows in records:
        for group, index, kind, link, issued_at, modeled_end, done in rows:
            peers = issued[(group, index)]
            if done is None or set(peers) != set(group):
                continue
            seen += 1
            if done <= modeled_end:
                continue
            last = max(peers.values())
            # how late it would have been had gloo finished the moment the last rank issued it
            peers_part = min(done, max(last, modeled_end)) - modeled_end
            overdue = done - modeled_end
            late, lateness, from_peers = late + 1, lateness + overdue, from_peers + peers_part
            waits.append(last - issued_at)
            after_last.append(done - last)
            row = by_kind.setdefault(f"{kind}/{link}", {"late": 0, "lateness_seconds": 0.0, "from_peers_seconds": 0.0})
            for name, add in (("late", 1), ("lateness_seconds", overdue), ("from_peers_seconds", peers_part)):
                row[name] += add
    return LatenessCauses(seen, late, lateness, from_peers, _quantiles(waits), _quantiles(after_last), by_kind)


def lateness_causes(network: EmulatedNetwork, group: Any = None) -> LatenessCauses:
    """Split the lateness of what ``network`` recorded on every rank of ``group`` (default: the
    world) between late peers and gloo. Collective: call it on every rank, after the waits."""
    mine = [(ranks, index, work.kind, work.link, work.issued_at, work.modeled_end, work.gloo_done_at)
            for ranks, index, work in network.recorded()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return split_lateness(everyone)
