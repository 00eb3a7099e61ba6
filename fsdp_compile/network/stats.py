"""What an emulated network carried, per collective kind and link, and where gloo overran the model.

An *overrun*: gloo finished a transfer after its modeled end, so a timing taken over it does not
rest on the emulated link alone; read every figure measured on an emulated network beside them.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields

from .links import format_seconds


@dataclass(frozen=True)
class LinkUsage:
    """What collectives of one kind (or a sum) did on one link (or a sum): ``wire_bytes`` each rank
    sent under the ring model, the buffers' bytes, the modeled busy time; ``observed``: those whose
    gloo completion was seen; ``overruns``: those gloo finished after the modeled end, and by how
    much (largest, summed)."""

    count: int = 0
    wire_bytes: float = 0.0
    buffer_bytes: int = 0
    busy_seconds: float = 0.0
    observed: int = 0
    overruns: int = 0
    overrun_max_seconds: float = 0.0
    overrun_total_seconds: float = 0.0

    def __add__(self, other: LinkUsage) -> LinkUsage:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        summed["overrun_max_seconds"] = max(self.overrun_max_seconds, other.overrun_max_seconds)
        return LinkUsage(**summed)


@dataclass(frozen=True)
class Overruns:
    """How often gloo finished after the modeled end, of ``observed`` completions, and by how much."""

    count: int
    observed: int
    max_seconds: float
    total_seconds: float

    def held(self) -> bool:
        return self.count == 0


@dataclass(frozen=True)
class NetworkStats:
    """A snapshot of :meth:`fsdp_compile.EmulatedNetwork.stats` on one rank: ``usage`` maps
    ``(kind, link)`` to its :class:`LinkUsage` (link "intra", "inter", or "local" for a group of one)."""

    usage: dict[tuple[str, str], LinkUsage]

    def total(self, kind: str | None = None, link: str | None = None) -> LinkUsage:
        """The sum over the kinds and links that match (``None``: all)."""
        return sum((use for (k, lk), use in self.usage.items() if kind in (None, k) and link in (None, lk)),
                   LinkUsage())

    def count(self, kind: str | None = None, link: str | None = None) -> int:
        return self.total(kind, link).count

    def counts(self) -> dict[str, int]:
        """Collectives issued per kind, over all links."""
        out: dict[str, int] = {}
        for (kind, _), use in self.usage.items():
            if use.count:  # a row can hold only the completion of a collective issued before a reset
                out[kind] = out.get(kind, 0) + use.count
        return out

    def __add__(self, other: NetworkStats) -> NetworkStats:
        """Two windows' stats as one (a run that switches its links between steps reads each)."""
        usage = dict(self.usage)
        for key, use in other.usage.items():
            usage[key] = usage[key] + use if key in usage else use
        return NetworkStats(usage)

    def overruns(self, kind: str | None = None, link: str | None = None) -> Overruns:
        """Where gloo finished after the modeled end, over the kinds and links that match."""
        t = self.total(kind, link)
        return Overruns(t.overruns, t.observed, t.overrun_max_seconds, t.overrun_total_seconds)

    def to_dict(self) -> dict:
        """JSON-ready: ``{"usage": {"kind/link": {...}}, "overruns": {...}}``."""
        return {"usage": {f"{kind}/{link}": asdict(use) for (kind, link), use in sorted(self.usage.items())},
                "overruns": asdict(self.overruns())}

    def overrun_summary(self) -> str:
        """One line saying whether the emulation held, and by how much gloo overran it."""
        o = self.overruns()
        if o.held():
            return f"emulation held: no overrun in {o.observed} observed collectives"
        return (f"emulation overran in {o.count} of {o.observed} observed collectives: gloo finished up to "
                f"{format_seconds(o.max_seconds)} after the model ({format_seconds(o.total_seconds)} in total)")

    def __str__(self) -> str:
        rows = [f"{'kind':<15}{'link':<7}{'count':>7}{'wire MB':>11}{'buffer MB':>11}{'busy s':>10}"
                f"{'overruns':>10}{'max over':>10}{'total over':>12}"]
        for (kind, link), u in sorted(self.usage.items()):
            rows.append(f"{kind:<15}{link:<7}{u.count:>7}{u.wire_bytes / 1e6:>11.3f}{u.buffer_bytes / 1e6:>11.3f}"
                        f"{u.busy_seconds:>10.4f}{u.overruns:>10}{format_seconds(u.overrun_max_seconds):>10}"
                        f"{format_seconds(u.overrun_total_seconds):>12}")
        rows.append(self.overrun_summary())
        return "\n".join(rows)


class StatsRecorder:
    """The counters behind :class:`NetworkStats` (issued from the main and autograd's threads,
    completed on gloo's), in :class:`LinkUsage`'s field order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[tuple[str, str], list] = {}

    def _row(self, key: tuple[str, str]) -> list:
        return self._usage.setdefault(key, [0, 0.0, 0, 0.0, 0, 0, 0.0, 0.0])

    def issued(self, kind: str, link: str, wire_bytes: float, buffer_bytes: int, seconds: float) -> None:
        with self._lock:
            row = self._row((kind, link))
            for i, value in enumerate((1, wire_bytes, buffer_bytes, seconds)):
                row[i] += value

    def completed(self, kind: str, link: str, lateness: float) -> None:
        """Gloo finished ``lateness`` seconds after the modeled end (negative: before it)."""
        with self._lock:
            row = self._row((kind, link))
            row[4] += 1
            if lateness > 0:
                row[5] += 1
                row[6] = max(row[6], lateness)
                row[7] += lateness

    def snapshot(self) -> NetworkStats:
        with self._lock:
            return NetworkStats({key: LinkUsage(*row) for key, row in self._usage.items()})

    def reset(self) -> None:
        with self._lock:
            self._usage.clear()
